/* y = x W^T with W in a GGUF file's quantized blocks (llama.cpp's ggml formats), never a float copy of W.
 *
 * One form for every type. A weight row of K values is unpacked, block by block, into unsigned 8-bit
 * codes q[k] and one float scale and one float offset per 16 weights, with w[k] = scale[k/16] * q[k] +
 * min[k/16] exactly as ggml's (and gguf-py's) dequantization gives it in float32: every product of a
 * float16 scale and a code is exact in float32, so the two roundings agree. Per type (gguf-py quants.py):
 *   Q4_0 (32 w, 18 B): fp16 d, 16 B of nibbles (w j low nibble of byte j, w j+16 high): w = d (q - 8)
 *   Q4_1 (32 w, 20 B): fp16 d, fp16 m, nibbles as Q4_0:                                  w = d q + m
 *   Q8_0 (32 w, 34 B): fp16 d, 32 int8:                      code q + 128, w = d (code - 128)
 *   Q4_K (256 w, 144 B): fp16 d, fp16 dmin, 12 B of 6-bit scales and mins for 8 sub-blocks of 32,
 *                        128 B of nibbles (32 B per 64 w: low nibbles, then high): w = d sc q - dmin m
 *   Q5_K (256 w, 176 B): as Q4_K plus 32 B holding each weight's fifth bit (bit j for sub-block j)
 *   Q6_K (256 w, 210 B): 128 B low 4 bits, 64 B high 2 bits, 16 int8 scales (one per 16), fp16 d last:
 *                        w = d sc (q - 32)
 *   Q5_0 (32 w, 22 B): fp16 d, 4 B holding each weight's fifth bit, nibbles as Q4_0:      w = d (q - 16)
 *   Q5_1 (32 w, 24 B): fp16 d, fp16 m, fifth bits, nibbles:                               w = d q + m
 *   Q2_K (256 w, 84 B): 16 B of 4-bit scale | 4-bit min (one per 16), 64 B of 2-bit codes, fp16 d, fp16 dmin:
 *                       w = d sc q - dmin m
 *   Q3_K (256 w, 110 B): 32 B high bits, 64 B low 2 bits, 12 B of 6-bit scales (one per 16), fp16 d:
 *                        w = d (sc - 32) (q - 4), q = low | high << 2
 *   IQ4_NL (32 w, 18 B): fp16 d, nibbles as Q4_0 indexing the non-linear table KVALUES: w = d KVALUES[q]
 *   IQ4_XS (256 w, 136 B): fp16 d, 16 high and 4 B low bits of 8 6-bit sub-block scales, 128 B nibbles
 *                          (16 B per 32 w, low then high): w = d (sc - 32) KVALUES[q]
 *   MXFP4 (32 w, 17 B; gpt-oss's experts): one byte e (E8M0), nibbles as Q4_0 indexing E2M1 values doubled
 *                     (FP4_VALUES): w = 2^(e - 128) FP4_VALUES[q] (ggml's e8m0_to_fp32_half)
 * The IQ4 types' and MXFP4's codes are table indices: their value is table[q] (min 0) instead of q.
 *
 * Three kernels:
 *  - portable C on the file's blocks (MINIVLLM_GGUF_ACTIVATIONS=float, CPUs without AVX2, and the
 *    reference): a row unpacked, then sum_g scale_g sum_{k in g} x q + min_g sum_{k in g} x in float32;
 *  - AVX512-VNNI on "R16" weights (below): the blocks of 16 rows interleaved at load, so that one
 *    instruction multiplies codes of 16 rows at once, with int8 activations (gguf_r16_linear_i8, the
 *    default) or int16 ones (gguf_r16_linear);
 *  - AVX2 alone on R16 weights with int8 activations (gguf_r16_avx2.c: vpmaddubsw on 8 rows a register), for
 *    the R16 types but Q8_0 on CPUs without AVX512-VNNI;
 *  - AVX2 on the file's blocks with int8 activations (gguf_q8_linear, llama.cpp's arithmetic), for the
 *    types without R16 and CPUs without AVX512-VNNI (Q8_0 there).
 * Threads split W's rows. x [M, K] float32 or bfloat16 (rows x_stride apart), y [M, N] float32 or
 * bfloat16 (rows y_stride apart). Functions return -1 for a type they do not know (nothing written).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "hfold.h"
#include "gguf_r16.h"

/* the values of IQ4_NL's and IQ4_XS's 4-bit codes (ggml's kvalues_iq4nl) */
static const float KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's: the E2M1 values times two (ggml's kvalues_mxfp4) */
static const float FP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
/* MXFP4's block scale byte e as ggml reads it (e8m0_to_fp32_half): 2^(e - 128), exact (subnormal for e < 2) */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* the table a type's codes index, or NULL where a code is its own value */
static inline const float *code_table(int type) {
    return type == IQ4_NL || type == IQ4_XS ? KVALUES : type == MXFP4 ? FP4_VALUES : NULL;
}

static inline float fp16_to_f32(const uint8_t *p) { /* exact, without F16C */
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    uint32_t u;
    if (exp == 0) {
        float f = (float)mant * (1.0f / 16777216.0f); /* subnormal: mant * 2^-24, exact */
        memcpy(&u, &f, sizeof u);
        u |= sign;
    } else if (exp == 31) {
        u = sign | 0x7F800000u | mant << 13;
    } else {
        u = sign | (exp + 112) << 23 | mant << 13;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 packed bytes */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0xF) | (s[j - 4] >> 6) << 4;
        *m = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
    }
}

/* One row of `nb` blocks -> codes q [nb * block], scale and min [nb * block / 16]. */
static void unpack_row(int type, const uint8_t *row, int nb, uint8_t *q, float *scale, float *min) {
    switch (type) {
    case Q4_0:
    case Q4_1:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * block_bytes(type);
            const float d = fp16_to_f32(blk), m = type == Q4_0 ? -8.f * d : fp16_to_f32(blk + 2);
            const uint8_t *qs = blk + (type == Q4_0 ? 2 : 4);
            for (int j = 0; j < 16; j++) {
                q[32 * b + j] = qs[j] & 0xF;
                q[32 * b + j + 16] = qs[j] >> 4;
            }
            scale[2 * b] = scale[2 * b + 1] = d;
            min[2 * b] = min[2 * b + 1] = m;
        }
        break;
    case Q5_0:
    case Q5_1:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * block_bytes(type);
            const float d = fp16_to_f32(blk), m = type == Q5_0 ? -16.f * d : fp16_to_f32(blk + 2);
            const uint8_t *qh = blk + (type == Q5_0 ? 2 : 4), *qs = qh + 4;
            const uint32_t high = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
            for (int j = 0; j < 16; j++) {
                q[32 * b + j] = (qs[j] & 0xF) | ((high >> j) & 1) << 4;
                q[32 * b + j + 16] = (qs[j] >> 4) | ((high >> (j + 16)) & 1) << 4;
            }
            scale[2 * b] = scale[2 * b + 1] = d;
            min[2 * b] = min[2 * b + 1] = m;
        }
        break;
    case IQ4_NL:
    case MXFP4:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * block_bytes(type), *qs = blk + (type == MXFP4 ? 1 : 2);
            for (int j = 0; j < 16; j++) {
                q[32 * b + j] = qs[j] & 0xF;
                q[32 * b + j + 16] = qs[j] >> 4;
            }
            scale[2 * b] = scale[2 * b + 1] = type == MXFP4 ? e8m0_half(blk[0]) : fp16_to_f32(blk);
            min[2 * b] = min[2 * b + 1] = 0.f;
        }
        break;
    case Q2_K:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 84, *sc = blk, *qs = blk + 16;
            const float d = fp16_to_f32(blk + 80), dmin = fp16_to_f32(blk + 82);
            uint8_t *qb = q + 256 * b;
            for (int v = 0; v < 256; v++) qb[v] = (qs[32 * (v / 128) + v % 32] >> (2 * ((v % 128) / 32))) & 3;
            for (int g = 0; g < 16; g++) { /* as gguf-py: (d * sc) * q - dmin * m */
                scale[16 * b + g] = d * (float)(sc[g] & 0xF);
                min[16 * b + g] = -(dmin * (float)(sc[g] >> 4));
            }
        }
        break;
    case Q3_K:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 110, *hm = blk, *qs = blk + 32, *sc = blk + 96;
            const float d = fp16_to_f32(blk + 108);
            uint8_t *qb = q + 256 * b;
            for (int v = 0; v < 256; v++)
                qb[v] = ((qs[32 * (v / 128) + v % 32] >> (2 * ((v % 128) / 32))) & 3) | ((hm[v % 32] >> (v / 32)) & 1) << 2;
            for (int g = 0; g < 16; g++) {
                const int lo = (sc[g % 8] >> (4 * (g / 8))) & 0xF, hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
                scale[16 * b + g] = d * (float)((lo | hi << 4) - 32);
                min[16 * b + g] = -4.f * scale[16 * b + g];
            }
        }
        break;
    case IQ4_XS:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 136, *sl = blk + 4, *qs = blk + 8;
            const float d = fp16_to_f32(blk);
            const int sh = blk[2] | blk[3] << 8;
            uint8_t *qb = q + 256 * b;
            for (int ib = 0; ib < 8; ib++) {
                for (int j = 0; j < 16; j++) {
                    qb[32 * ib + j] = qs[16 * ib + j] & 0xF;
                    qb[32 * ib + 16 + j] = qs[16 * ib + j] >> 4;
                }
                const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 0xF) | ((sh >> (2 * ib)) & 3) << 4;
                scale[16 * b + 2 * ib] = scale[16 * b + 2 * ib + 1] = d * (float)(ls - 32);
                min[16 * b + 2 * ib] = min[16 * b + 2 * ib + 1] = 0.f;
            }
        }
        break;
    case Q8_0:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 34;
            const float d = fp16_to_f32(blk);
            for (int j = 0; j < 32; j++) q[32 * b + j] = blk[2 + j] ^ 0x80; /* int8 + 128 */
            scale[2 * b] = scale[2 * b + 1] = d;
            min[2 * b] = min[2 * b + 1] = -128.f * d;
        }
        break;
    case Q4_K:
    case Q5_K:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * block_bytes(type);
            const float d = fp16_to_f32(blk), dmin = fp16_to_f32(blk + 2);
            const uint8_t *sc6 = blk + 4, *qh = blk + 16, *qs = blk + (type == Q4_K ? 16 : 48);
            uint8_t *qb = q + 256 * b;
            for (int c = 0; c < 4; c++)
                for (int i = 0; i < 32; i++) {
                    qb[64 * c + i] = qs[32 * c + i] & 0xF;
                    qb[64 * c + 32 + i] = qs[32 * c + i] >> 4;
                }
            if (type == Q5_K)
                for (int j = 0; j < 8; j++)
                    for (int i = 0; i < 32; i++) qb[32 * j + i] |= ((qh[i] >> j) & 1) << 4;
            for (int j = 0; j < 8; j++) {
                int sc, m;
                k_scale_min(sc6, j, &sc, &m);
                /* as gguf-py: (d * sc) * q - dmin * m, both products exact */
                scale[16 * b + 2 * j] = scale[16 * b + 2 * j + 1] = d * (float)sc;
                min[16 * b + 2 * j] = min[16 * b + 2 * j + 1] = -(dmin * (float)m);
            }
        }
        break;
    case Q6_K:
        for (int b = 0; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * 210, *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = fp16_to_f32(blk + 208);
            uint8_t *qb = q + 256 * b;
            for (int h = 0; h < 2; h++)
                for (int t = 0; t < 4; t++)
                    for (int p = 0; p < 32; p++)
                        qb[128 * h + 32 * t + p] = ((ql[64 * h + 32 * (t & 1) + p] >> (4 * (t >> 1))) & 0xF) |
                                                   ((qh[32 * h + p] >> (2 * t)) & 3) << 4;
            for (int g = 0; g < 16; g++) {
                scale[16 * b + g] = d * (float)sc[g];
                min[16 * b + g] = -32.f * scale[16 * b + g];
            }
        }
        break;
    }
}

/* One row of `nb` blocks (`cols` weights) into float32 o [cols], through the scratch q [cols], scale and min
 * [cols / 16]: the weights gguf-py's dequantize() gives, bit for bit. */
static void dequantize_row(int type, const uint8_t *src, int nb, int cols, uint8_t *q, float *scale, float *min,
                           float *o) {
    unpack_row(type, src, nb, q, scale, min);
    const float *table = code_table(type);
    if (table)
        for (int k = 0; k < cols; k++) o[k] = scale[k / 16] * table[q[k]];
    else
        for (int k = 0; k < cols; k++) o[k] = scale[k / 16] * (float)q[k] + min[k / 16];
}

/* Dequantizes `rows` rows of `cols` weights to float32 (dst_bf16 0) or bfloat16 (1): the weights
 * gguf-py's dequantize() gives, bit for bit in float32. Returns -1 for an unknown type or cols not a
 * whole number of blocks. */
int gguf_dequantize(int type, const uint8_t *src, int rows, int cols, void *dst, int dst_bf16, int num_threads) {
    const int bw = block_weights(type);
    if (bw == 0 || cols % bw) return -1;
    const int nb = cols / bw;
    const size_t row_bytes = (size_t)nb * block_bytes(type);
    /* a few rows (the LM head rows that ops.refine_top rescores) cost less than waking the threads */
    _Pragma("omp parallel num_threads(num_threads) if ((size_t)rows * cols > 65536)") {
        uint8_t *q = malloc((size_t)cols);
        float *scale = malloc(sizeof(float) * (cols / 16)), *min = malloc(sizeof(float) * (cols / 16));
        float *q_f = dst_bf16 ? malloc(sizeof(float) * (size_t)cols) : NULL; /* a float32 row before rounding */
        _Pragma("omp for schedule(static)")
        for (int r = 0; r < rows; r++) {
            float *o = dst_bf16 ? (float *)q_f : (float *)dst + (size_t)r * cols;
            dequantize_row(type, src + r * row_bytes, nb, cols, q, scale, min, o);
            if (dst_bf16) {
                bf16 *ob = (bf16 *)dst + (size_t)r * cols;
                for (int k = 0; k < cols; k++) ob[k] = f32_to_bf16(o[k]);
            }
        }
        free(q), free(scale), free(min), free(q_f);
    }
    return 0;
}

void top_k_float(const float *x, int n, int v, int k, int64_t *out, int num_threads); /* layer_ops.c */
long gguf_r16_bytes(int type, int N, int K);
int gguf_r16_dequantize_rows(int type, const uint8_t *w, int K, const int64_t *ids, int n, void *dst, int dst_bf16,
                             int num_threads);

/* A token embedding's rows: dst float32 [n, K] = rows `ids` [n] of w [rows, K] (ggml blocks, or R16 where `r16`), each
 * value rounded to bfloat16 first where `round_bf16` (an embedding looked up in a bfloat16 model's dtype and then
 * widened: models/llama.py's `embed_tokens(ids).float()`), exact as gguf_dequantize and gguf_r16_dequantize_rows.
 * Returns 0, -1 for a type or shape without a kernel, -2 for an id outside [0, rows). */
int gguf_embed_rows(int type, const uint8_t *w, int r16, int rows, int K, const int64_t *ids, int n, float *dst,
                    int round_bf16, int num_threads) {
    const int bw = block_weights(type);
    if (bw == 0 || K % bw || (r16 && gguf_r16_bytes(type, 1, K) < 0)) return -1;
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -2;
    if (r16) gguf_r16_dequantize_rows(type, w, K, ids, n, dst, 0, num_threads);
    else {
        const size_t row_bytes = (size_t)(K / bw) * block_bytes(type);
        _Pragma("omp parallel num_threads(num_threads) if ((size_t)n * K > 65536)") {
            uint8_t *q = malloc((size_t)K);
            float *scale = malloc(sizeof(float) * (K / 16)), *min = malloc(sizeof(float) * (K / 16));
            _Pragma("omp for schedule(static)")
            for (int i = 0; i < n; i++)
                dequantize_row(type, w + (size_t)ids[i] * row_bytes, K / bw, K, q, scale, min, dst + (size_t)i * K);
            free(q), free(scale), free(min);
        }
    }
    if (round_bf16)
        for (size_t i = 0; i < (size_t)n * K; i++) dst[i] = bf16_to_f32(f32_to_bf16(dst[i]));
    return 0;
}

/* Each row's k highest logits of out [n, V] (float32, in place) recomputed as exact float32 dot products of
 * hidden [n, K] (float32) with their rows of the LM head w [V, K] (ggml blocks, or R16 where `r16`), each row
 * dequantized as gguf_dequantize does: models/kernels/ops.py refine_top's arithmetic (top_k_float, the rows, their
 * dot products) in one call, where its five small ops cost ~0.2 ms a decode step with the caches cold from the
 * layers' weights. k <= 64. Returns 0, or -1 for a type without a kernel. */
int gguf_refine_top(const float *hidden, int n, int K, const uint8_t *w, int type, int r16, float *out, int V, int k,
                    int num_threads) {
    const int bw = block_weights(type);
    if (bw == 0 || K % bw || k > 64 || (r16 && gguf_r16_bytes(type, 1, K) < 0)) return -1;
    const int nb = K / bw;
    const size_t row_bytes = (size_t)nb * block_bytes(type);
    _Pragma("omp parallel num_threads(num_threads) if (n > 8)") {
        float *row = malloc(sizeof(float) * (size_t)(K + K / 8)), *scale = row + K, *min = scale + K / 16;
        uint8_t *q = malloc((size_t)K);
        _Pragma("omp for schedule(static)")
        for (int r = 0; r < n; r++) {
            int64_t ids[64];
            float *o = out + (size_t)r * V;
            const float *x = hidden + (size_t)r * K;
            top_k_float(o, 1, V, k, ids, 1);
            for (int j = 0; j < k; j++) {
                if (r16) gguf_r16_dequantize_rows(type, w, K, ids + j, 1, row, 0, 1);
                else dequantize_row(type, w + (size_t)ids[j] * row_bytes, nb, K, q, scale, min, row);
                float dot = 0.f;
                for (int i = 0; i < K; i++) dot += x[i] * row[i];
                o[ids[j]] = dot;
            }
        }
        free(row), free(q);
    }
    return 0;
}

/* ---- the portable path: float activations against an unpacked row ---- */
static inline float load_x(const void *x, int x_bf16, size_t i) {
    return x_bf16 ? bf16_to_f32(((const bf16 *)x)[i]) : ((const float *)x)[i];
}

/* y[m][n] = sum_g scale_g (sum_{k in g} x q) + min_g (sum_{k in g} x), in float32; the codes of the types with
 * a `table` (code_table) through it */
static float row_dot_portable(const float *x, const float *xsum, const uint8_t *q, const float *scale,
                              const float *min, int K, const float *table) {
    float acc = 0.f;
    for (int g = 0; g < K / 16; g++) {
        float s = 0.f;
        if (table)
            for (int i = 0; i < 16; i++) s += x[16 * g + i] * table[q[16 * g + i]];
        else
            for (int i = 0; i < 16; i++) s += x[16 * g + i] * (float)q[16 * g + i];
        acc += scale[g] * s + min[g] * xsum[g];
    }
    return acc;
}

/* y = x W^T with W in ggml blocks, portable C in float32. Returns -1 for an unknown type or K not whole blocks. */
int gguf_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                int y_stride, int M, int N, int K, int num_threads) {
    const int bw = block_weights(type);
    if (bw == 0 || K % bw) return -1;
    const int nb = K / bw;
    const size_t row_bytes = (size_t)nb * block_bytes(type);
    float *xf = malloc(sizeof(float) * (size_t)M * K), *xsum = malloc(sizeof(float) * (size_t)M * (K / 16));
    _Pragma("omp parallel num_threads(num_threads)") {
        _Pragma("omp for schedule(static)")
        for (int m = 0; m < M; m++)
            for (int g = 0; g < K / 16; g++) {
                float s = 0.f;
                for (int i = 0; i < 16; i++) {
                    const float v = load_x(x, x_bf16, (size_t)m * x_stride + 16 * g + i);
                    xf[(size_t)m * K + 16 * g + i] = v, s += v;
                }
                xsum[(size_t)m * (K / 16) + g] = s;
            }
        uint8_t *q = malloc((size_t)K);
        float *scale = malloc(sizeof(float) * (K / 16)), *min = malloc(sizeof(float) * (K / 16));
        _Pragma("omp for schedule(static)")
        for (int n = 0; n < N; n++) {
            unpack_row(type, w + n * row_bytes, nb, q, scale, min);
            for (int m = 0; m < M; m++) {
                const float v = row_dot_portable(xf + (size_t)m * K, xsum + (size_t)m * (K / 16), q, scale, min, K,
                                                 code_table(type));
                const size_t at = (size_t)m * y_stride + n;
                if (y_bf16)
                    ((bf16 *)y)[at] = f32_to_bf16(v);
                else
                    ((float *)y)[at] = v;
            }
        }
        free(q), free(scale), free(min);
    }
    free(xf), free(xsum);
    return 0;
}

/* ---- R16: the 32-weight types repacked 16 rows at a time for the VNNI kernel (lossless) ----
 *
 * Rows are padded to a multiple of 16 (zero rows) and stored group by group; within a group, block b
 * of all 16 rows is one record: the codes laid out so that one 64-byte load holds 4 codes of each of
 * the 16 rows (one int32 lane per row, what _mm512_dpbusd_epi32 multiplies by 4 broadcast activation
 * codes), then the 16 rows' float16 scales d (MXFP4: their E8M0 bytes), then (Q4_1) their float16 offsets m.
 * 4-bit records: load p (0..3) holds codes 4p..4p+3 in its low nibbles and 16+4p..16+4p+3 in its high nibbles
 * (MXFP4's as the file has them, indices of its E2M1 values). Q8_0: load g (0..7) holds codes 4g..4g+3 as int8 +
 * 128. A record has exactly the bytes of the 16 blocks it came from (Q4_0 288, Q4_1 320, Q8_0 544, MXFP4 272), so
 * repacking costs no memory beyond the padding rows; the layout is that of llama.cpp's repacked CPU weights
 * (ggml-cpu repack.cpp), re-derived for VNNI. */

/* code k (0..31) of lane r in a record */
static inline uint8_t r16_code(int type, const uint8_t *rec, int r, int k) {
    if (type == Q8_0) return rec[64 * (k / 4) + 4 * r + k % 4];
    const int hi = k >= 16, kk = k - 16 * hi;
    const uint8_t byte = rec[64 * (kk / 4) + 4 * r + kk % 4];
    return hi ? byte >> 4 : byte & 0xF;
}

/* R16 of the super-block types: a record is 16 rows x one 256-weight super-block. Codes first, 8
 * sub-blocks of 32 (256 B each, the 4-bit layout above); for Q5_K then each code's fifth bit as 64-bit
 * masks, one per 64-byte code register (bit 4r + i of register z of sub-block j: lane r, byte i), for Q6_K
 * its fifth and sixth bits as two 64-byte planes per sub-block, four registers' pairs of bits in each byte
 * (gguf_r16.h R16_Q6K_SHIFT); then the scales: Q4_K/Q5_K the 16 rows' float16 d and dmin and
 * the 6-bit sub-block scales and mins as bytes [8][16]; Q6_K the float16 d and the int8 scales per 16
 * as [16][16]. Records are 16 x (148, 180, 210) bytes against 16 x (144, 176, 210) in the file. */
static int r16_type(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q8_0 || type == MXFP4 || type == Q4_K || type == Q5_K || type == Q6_K;
}

/* bytes of a repacked weight of N rows and K columns */
long gguf_r16_bytes(int type, int N, int K) {
    const int bw = block_weights(type);
    if (!r16_type(type) || K % bw) return -1;
    return (long)((N + 15) / 16) * (K / bw) * r16_record_bytes(type);
}

/* code k of super-block record lane r (super-block types) */
static inline uint8_t r16k_code(int type, const uint8_t *rec, int r, int k) {
    const int j = k / 32, kk = k % 32, hi = kk >= 16, q = kk % 16, p = q / 4, i = q % 4, z = 4 * hi + p;
    const uint8_t byte = rec[256 * j + 64 * p + 4 * r + i];
    uint8_t code = hi ? byte >> 4 : byte & 0xF;
    uint64_t mask;
    if (type == Q5_K) {
        memcpy(&mask, rec + 2048 + 64 * j + 8 * z, 8);
        code |= ((mask >> (4 * r + i)) & 1) << 4;
    } else if (type == Q6_K) {
        code |= ((rec[2048 + 128 * j + 64 * hi + 4 * r + i] >> R16_Q6K_SHIFT(p)) & 3) << 4;
    }
    return code;
}

/* Repacks N rows of K weights into R16 (dst: gguf_r16_bytes). Returns -1 for a type without R16. */
int gguf_repack_r16(int type, const uint8_t *src, int N, int K, uint8_t *dst) {
    const long total = gguf_r16_bytes(type, N, K);
    if (total < 0) return -1;
    const int bw = block_weights(type), nb = K / bw, bb = block_bytes(type), rec_bytes = r16_record_bytes(type);
    const int groups = (N + 15) / 16;
    memset(dst, 0, (size_t)total);
    uint8_t *q = malloc((size_t)K);
    float *scale = malloc(sizeof(float) * (K / 16)), *min = malloc(sizeof(float) * (K / 16));
    for (int n = 0; n < N; n++) {
        const int g = n / 16, r = n % 16;
        const uint8_t *row = src + (size_t)n * nb * bb;
        unpack_row(type, row, nb, q, scale, min); /* the codes; the scales are copied as stored */
        for (int b = 0; b < nb; b++) {
            uint8_t *rec = dst + ((size_t)g * nb + b) * rec_bytes;
            const uint8_t *blk = row + (size_t)b * bb, *qb = q + (size_t)b * bw;
            if (bw == 32) {
                const int cb = r16_code_bytes(type);
                if (type == MXFP4) rec[cb + r] = blk[0]; /* e */
                else memcpy(rec + cb + 2 * r, blk, 2); /* d */
                if (type == Q4_1) memcpy(rec + cb + 32 + 2 * r, blk + 2, 2); /* m */
                for (int k = 0; k < 32; k++) {
                    if (type == Q8_0) {
                        rec[64 * (k / 4) + 4 * r + k % 4] = qb[k];
                        continue;
                    }
                    const int kk = k % 16;
                    rec[64 * (kk / 4) + 4 * r + kk % 4] |= (uint8_t)(k < 16 ? qb[k] : qb[k] << 4);
                }
                continue;
            }
            for (int k = 0; k < 256; k++) {
                const int j = k / 32, kk = k % 32, hi = kk >= 16, qq = kk % 16, p = qq / 4, i = qq % 4, z = 4 * hi + p;
                rec[256 * j + 64 * p + 4 * r + i] |= (uint8_t)(hi ? (qb[k] & 0xF) << 4 : qb[k] & 0xF);
                uint64_t mask;
                const int bit = 4 * r + i;
                if (type == Q5_K && (qb[k] & 0x10)) {
                    memcpy(&mask, rec + 2048 + 64 * j + 8 * z, 8), mask |= 1ull << bit;
                    memcpy(rec + 2048 + 64 * j + 8 * z, &mask, 8);
                }
                if (type == Q6_K) rec[2048 + 128 * j + 64 * hi + bit] |= (uint8_t)(((qb[k] >> 4) & 3) << R16_Q6K_SHIFT(p));
            }
            const int cb = r16_codes_end(type);
            if (type == Q6_K) {
                memcpy(rec + cb + 2 * r, blk + 208, 2);
                for (int g16 = 0; g16 < 16; g16++) rec[cb + 32 + 16 * g16 + r] = blk[192 + g16];
            } else {
                memcpy(rec + cb + 2 * r, blk, 2), memcpy(rec + cb + 32 + 2 * r, blk + 2, 2);
                for (int j = 0; j < 8; j++) {
                    int sc, m;
                    k_scale_min(blk + 4, j, &sc, &m);
                    rec[cb + 64 + 16 * j + r] = (uint8_t)sc, rec[cb + 192 + 16 * j + r] = (uint8_t)m;
                }
            }
        }
    }
    free(q), free(scale), free(min);
    (void)groups;
    return 0;
}

/* Rows `ids` [n] of an R16 weight dequantized to float32 or bfloat16 [n, K], exact as gguf_dequantize. */
int gguf_r16_dequantize_rows(int type, const uint8_t *w, int K, const int64_t *ids, int n, void *dst, int dst_bf16,
                             int num_threads) {
    if (gguf_r16_bytes(type, 1, K) < 0) return -1;
    const int bw = block_weights(type), nb = K / bw, rec_bytes = r16_record_bytes(type);
    _Pragma("omp parallel for num_threads(num_threads) if (n > 8)")
    for (int i = 0; i < n; i++) {
        const int g = (int)(ids[i] / 16), r = (int)(ids[i] % 16);
        for (int b = 0; b < nb; b++) {
            const uint8_t *rec = w + ((size_t)g * nb + b) * rec_bytes;
            float v[256]; /* the block's values, then stored: the record's scales are read once a block (stores to
                           * dst could alias the uint8_t record, so the compiler read them again for every value) */
            if (bw == 32) {
                const int cb = r16_code_bytes(type);
                if (type == MXFP4) {
                    const float d = e8m0_half(rec[cb + r]);
                    for (int k = 0; k < 32; k++) v[k] = d * FP4_VALUES[r16_code(type, rec, r, k)];
                } else {
                    const float d = fp16_to_f32(rec + cb + 2 * r);
                    const float m = type == Q4_1 ? fp16_to_f32(rec + cb + 32 + 2 * r) : type == Q4_0 ? -8.f * d : -128.f * d;
                    for (int k = 0; k < 32; k++) v[k] = d * (float)r16_code(type, rec, r, k) + m;
                }
            } else {
                const int cb = r16_codes_end(type);
                const float d = fp16_to_f32(rec + cb + 2 * r);
                if (type == Q6_K)
                    for (int k = 0; k < 256; k++) {
                        const float sc = d * (float)(int8_t)rec[cb + 32 + 16 * (k / 16) + r];
                        v[k] = sc * (float)r16k_code(type, rec, r, k) + -32.f * sc;
                    }
                else {
                    const float dmin = fp16_to_f32(rec + cb + 32 + 2 * r);
                    for (int k = 0; k < 256; k++) {
                        const int j = k / 32;
                        v[k] = d * (float)rec[cb + 64 + 16 * j + r] * (float)r16k_code(type, rec, r, k) +
                               -(dmin * (float)rec[cb + 192 + 16 * j + r]);
                    }
                }
            }
            const size_t at = (size_t)i * K + (size_t)bw * b;
            for (int k = 0; k < bw; k++)
                if (dst_bf16)
                    ((bf16 *)dst)[at + k] = f32_to_bf16(v[k]);
                else
                    ((float *)dst)[at + k] = v[k];
        }
    }
    return 0;
}

/* ---- the R16 kernels: int16 activations, AVX512-VNNI ----
 *
 * Each row of x is quantized per 32 values to int16 with a float scale (amax / 32767: a relative error
 * near 1e-5, below bfloat16's own; int8 activations as llama.cpp uses them changed the greedy tokens
 * of SmolLM2-135M on 2 of 3 prompts, int16 on as few as bfloat16 does). _mm512_dpwssd_epi32 multiplies
 * pairs of int16: a 64-byte code register (4 codes c0..c3 of each of 16 rows) splits into the words
 * (c0, c2) and (c1, c3), so the activations are stored as (x0, x2, x1, x3) per 4 and one broadcast
 * int32 feeds each. Sums of 16 products stay in int32 (255 * 32767 * 16 < 2^31); each group of 32
 * then takes its float scales. The offsets use exact float sums of x. */
/* the activations of an R16 product: Acts, gguf_r16.h */

/* values k0..k0 + 31 of row m of x into v (zeros past K); returns their largest magnitude */
static float load_block32(const void *x, int x_bf16, int x_stride, int K, int m, int k0, float *v) {
    float amax = 0.f;
    for (int i = 0; i < 32; i++) {
        v[i] = k0 + i < K ? load_x(x, x_bf16, (size_t)m * x_stride + k0 + i) : 0.f;
        amax = v[i] > amax ? v[i] : (-v[i] > amax ? -v[i] : amax);
    }
    return amax;
}

static void prepare_row(Acts *a, const void *x, int x_bf16, int x_stride, int K, int m) {
    const int Kp = a->Kp;
    for (int k0 = 0; k0 < Kp; k0 += 32) {
        float v[32];
        const float amax = load_block32(x, x_bf16, x_stride, K, m, k0, v);
        float *xsum = a->xsum + (size_t)m * (Kp / 16) + k0 / 16;
        xsum[0] = xsum[1] = 0.f;
        for (int i = 0; i < 32; i++) xsum[i / 16] += v[i];
        a->xsum32[(size_t)m * (Kp / 32) + k0 / 32] = xsum[0] + xsum[1];
        const float id = amax > 0.f ? 32767.f / amax : 0.f;
        a->xd[(size_t)m * (Kp / 32) + k0 / 32] = amax / 32767.f;
        int16_t *q = (int16_t *)a->xq + (size_t)m * Kp + k0;
        static const int order[4] = {0, 2, 1, 3};
        for (int i = 0; i < 32; i++) q[(i & ~3) + order[i & 3]] = (int16_t)__builtin_lrintf(v[i] * id);
    }
}

/* R16 against int8 activations (gguf_r16_linear_i8): each row of x quantized per 32 values to int8
 * with a float scale amax / 127 (llama.cpp's Q8_0 activations), in natural order: one broadcast int32 (4
 * activations) meets a code register (codes k..k+3 of 16 rows, unsigned) in one _mm512_dpbusd_epi32, 64
 * multiply-adds where _mm512_dpwssd_epi32 does 32, and the codes need no split into words. Sums of 32 products stay
 * in int32 (255 * 127 * 32 < 2^31). The offsets (Q4_1's min, the -8, -128 and -32 of Q4_0, Q8_0 and Q6_K, the
 * K-quants' mins) meet the rounded activations' sums, as llama.cpp's Q8_1: the output is then the dequantized
 * weights' exact product with the rounded activations, where the exact sums would leave the unsigned codes' larger
 * error (codes 0..255 against -128..127 for Q8_0). */
#if defined(__x86_64__)
/* AVX512-VNNI and BW alone: no AVX512-BF16 instruction, so the kernels also run on the Xeons that have VNNI without
 * BF16 (Cascade Lake, Ice Lake, and VMs that hide BF16); bfloat16 is widened and rounded with integer ops */
#define VNNI512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c")))

/* 16 bfloat16 values widened to float32 */
VNNI512 static inline __m512 widen_bf16(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 16 float32 values rounded to bfloat16, to nearest even, as bf16.h's f32_to_bf16 (without AVX512-BF16's
 * vcvtneps2bf16, which also flushes denormals: the two differ only there and on NaN payloads) */
VNNI512 static inline __m256i narrow_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

#define MAX_PS(a, b) _mm512_max_ps(a, b)
#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* a product rounded as written, never fused into an FMA */
#define ADD_EPI32(a, b) _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)))
HFOLD(VNNI512, hmax, MAX_PS) /* hfold.h */
HFOLD(VNNI512, hsum, ADD_EPI32)

/* prepare_row8's 16 blocks from column k0 (k0 + 512 <= K), their reductions folded together (HFOLD): the same
 * codes, scales and sums as one block at a time, bit for bit (the max and the integer sums exact in any order);
 * half the time */
VNNI512 static void prepare_span8(Acts *a, const void *x, int x_bf16, int x_stride, int m, int k0) {
    const int Kp = a->Kp;
    const bf16 *pb = (const bf16 *)x + (size_t)m * x_stride + k0;
    const float *pf = (const float *)x + (size_t)m * x_stride + k0;
#define SPAN_LOAD(i)                                                                                                  \
    (x_bf16 ? widen_bf16(_mm256_loadu_si256((const __m256i *)(pb + 16 * (i)))) : _mm512_loadu_ps(pf + 16 * (i)))
    __m512 u[4];
    for (int g = 0; g < 4; g++) {
        __m512 am[4];
        for (int i = 0; i < 4; i++) {
            const int b = 4 * g + i;
            am[i] = _mm512_max_ps(_mm512_abs_ps(SPAN_LOAD(2 * b)), _mm512_abs_ps(SPAN_LOAD(2 * b + 1)));
        }
        u[g] = hmax_fold4(am);
    }
    const __m512 amax = hmax_lanes(u);
    const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_setzero_ps(), _CMP_GT_OQ);
    const __m512 d = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
    float id[16];
    _mm512_storeu_ps(id, _mm512_maskz_div_ps(live, _mm512_set1_ps(127.f), amax));
    int8_t *q = (int8_t *)a->xq + (size_t)m * Kp + k0;
    __m512 s0[4], s1[4]; /* the codes' sums, folded by 4 blocks: the first and the second 16 of each block */
    for (int g = 0; g < 4; g++) {
        __m512 c0[4], c1[4];
        for (int i = 0; i < 4; i++) {
            const int b = 4 * g + i;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(SPAN_LOAD(2 * b), _mm512_set1_ps(id[b])));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(SPAN_LOAD(2 * b + 1), _mm512_set1_ps(id[b])));
            _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtsepi32_epi8(q1));
            c0[i] = _mm512_castsi512_ps(q0), c1[i] = _mm512_castsi512_ps(q1);
        }
        s0[g] = hsum_fold4(c0), s1[g] = hsum_fold4(c1);
    }
#undef SPAN_LOAD
    const __m512 x0 = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_castps_si512(hsum_lanes(s0))), RN);
    const __m512 x1 = _mm512_mul_round_ps(d, _mm512_cvtepi32_ps(_mm512_castps_si512(hsum_lanes(s1))), RN);
    _mm512_storeu_ps(a->xd + (size_t)m * (Kp / 32) + k0 / 32, d);
    _mm512_storeu_ps(a->xsum32 + (size_t)m * (Kp / 32) + k0 / 32, _mm512_add_ps(x0, x1));
}

/* row m of x to int8 codes per 32 (scale max|x| / 127, rounded to nearest even), their scales and the rounded
 * values' sums per 32 (each half's d sum(codes) rounded, then added: RN keeps -ffast-math from fusing them), with
 * AVX-512: 512 values a step (prepare_span8), then 32 a step, zeros past K */
VNNI512 static void prepare_row8(Acts *a, const void *x, int x_bf16, int x_stride, int K, int m) {
    const int Kp = a->Kp;
    int k = 0;
    for (; k + 512 <= K; k += 512) prepare_span8(a, x, x_bf16, x_stride, m, k);
    for (int k0 = k; k0 < Kp; k0 += 32) {
        const int n = K - k0 < 0 ? 0 : K - k0 > 32 ? 32 : K - k0;
        const __mmask16 m0 = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
        const __mmask16 m1 = n >= 32 ? 0xFFFF : n > 16 ? (__mmask16)((1u << (n - 16)) - 1) : 0;
        __m512 v0, v1;
        if (x_bf16) {
            const bf16 *p = (const bf16 *)x + (size_t)m * x_stride + k0;
            v0 = widen_bf16(_mm256_maskz_loadu_epi16(m0, p)), v1 = widen_bf16(_mm256_maskz_loadu_epi16(m1, p + 16));
        } else {
            const float *p = (const float *)x + (size_t)m * x_stride + k0;
            v0 = _mm512_maskz_loadu_ps(m0, p), v1 = _mm512_maskz_loadu_ps(m1, p + 16);
        }
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        const float id = amax > 0.f ? 127.f / amax : 0.f, d = amax / 127.f;
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        int8_t *q = (int8_t *)a->xq + (size_t)m * Kp + k0;
        _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(q1));
        a->xd[(size_t)m * (Kp / 32) + k0 / 32] = d;
        const __m128 half0 = _mm_mul_round_ss(_mm_set_ss(d), _mm_set_ss((float)_mm512_reduce_add_epi32(q0)), RN);
        const __m128 half1 = _mm_mul_round_ss(_mm_set_ss(d), _mm_set_ss((float)_mm512_reduce_add_epi32(q1)), RN);
        a->xsum32[(size_t)m * (Kp / 32) + k0 / 32] = _mm_cvtss_f32(_mm_add_ss(half0, half1));
    }
}

/* row m of x to int8 codes per 256 (llama.cpp's Q8_K: scale max|x| / 127 over 256 values, in xd at [m, Kp / 256]),
 * with the codes' integer sums per 16 (is16) and per 32 (is32), int16; K a multiple of 256 */
VNNI512 static void prepare_row8k(Acts *a, const void *x, int x_bf16, int x_stride, int K, int m) {
    const int Kp = a->Kp;
    for (int k0 = 0; k0 < K; k0 += 256) {
        __m512 v[16];
        __m512 amax = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) {
            const size_t at = (size_t)m * x_stride + k0 + 16 * i;
            v[i] = x_bf16 ? widen_bf16(_mm256_loadu_si256((const __m256i *)((const bf16 *)x + at)))
                          : _mm512_loadu_ps((const float *)x + at);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
        }
        const float mx = _mm512_reduce_max_ps(amax), id = mx > 0.f ? 127.f / mx : 0.f;
        a->xd[(size_t)m * (Kp / 256) + k0 / 256] = mx / 127.f;
        int8_t *q = (int8_t *)a->xq + (size_t)m * Kp + k0;
        int16_t *is16 = a->is16 + (size_t)m * (Kp / 16) + k0 / 16;
        int16_t *is32 = a->is32 + (size_t)m * (Kp / 32) + k0 / 32;
        for (int i = 0; i < 16; i++) {
            const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)(q + 16 * i), _mm512_cvtsepi32_epi8(qi));
        }
        /* the sums per 16 (|sum| <= 16 x 127, exact in int16 per 32 too): the codes plus 128 as unsigned bytes,
         * vpsadbw against zero summing each 8, where a horizontal add per 16 codes took 3% of a decode step */
        for (int c = 0; c < 4; c++) {
            const __m512i b = _mm512_xor_si512(_mm512_loadu_si512(q + 64 * c), _mm512_set1_epi8((char)0x80));
            uint64_t s8[8];
            _mm512_storeu_si512(s8, _mm512_sad_epu8(b, _mm512_setzero_si512()));
            for (int t = 0; t < 4; t++) is16[4 * c + t] = (int16_t)((int)(s8[2 * t] + s8[2 * t + 1]) - 16 * 128);
        }
        for (int i = 0; i < 8; i++) is32[i] = (int16_t)(is16[2 * i] + is16[2 * i + 1]);
    }
}

/* the 16 rows' dot products of codes k..k+3 (one lane per row, split into the words (c0, c2) in w02 and
 * (c1, c3) in w13) with activations xq[k..k+3], stored (x0, x2, x1, x3): a += w02 . (x0, x2) and
 * b += w13 . (x1, x3), two accumulators so that consecutive instructions do not wait on each other */
#define DOT4(a, b, w02, w13, xq)                                                                              \
    do {                                                                                                  \
        a = _mm512_dpwssd_epi32(a, w02, _mm512_set1_epi32(*(const int32_t *)(xq)));                       \
        b = _mm512_dpwssd_epi32(b, w13, _mm512_set1_epi32(*(const int32_t *)((xq) + 2)));                 \
    } while (0)

/* the code registers wq[0..7] as words: w02[z] = (c0, c2), w13[z] = (c1, c3) of each lane */
#define SPLIT_WORDS(wq, w02, w13)                                                                             \
    for (int z = 0; z < 8; z++) {                                                                         \
        w02[z] = _mm512_and_si512(wq[z], _mm512_set1_epi32(0x00FF00FF));                                  \
        w13[z] = _mm512_srli_epi16(wq[z], 8);                                                             \
    }

/* stores the 16 rows' results v (the first nr) at row m of y */
#define STORE16(v, m)                                                                                         \
    do {                                                                                                  \
        const size_t at = (size_t)(m) * y_stride + n0;                                                    \
        if (y_bf16)                                                                                       \
            _mm256_mask_storeu_epi16((bf16 *)y + at, keep, narrow_bf16(v));                              \
        else                                                                                              \
            _mm512_mask_storeu_ps((float *)y + at, keep, v);                                              \
    } while (0)

/* the 32 codes' int32 dot products of 16 rows (their words w02, w13) with row `row` of x (int16 activations) from
 * column k, two _mm512_dpwssd_epi32 per 4 codes (DOT4): codes 0..15 in i0 and 16..31 in i1, joined into i0 unless
 * SPLIT (Q6_K: a scale per 16). int8 activations take R16B_SUMS instead */
#define R16_DOT32(SPLIT, a, row, k, w02, w13, i0, i1)                                                                \
    do {                                                                                                             \
        const int16_t *xq = (const int16_t *)(a)->xq + (row) * (a)->Kp + (k);                                        \
        __m512i a0 = _mm512_setzero_si512(), b0 = a0, a1 = a0, b1 = a0;                                              \
        for (int p = 0; p < 4; p++) {                                                                                \
            DOT4(a0, b0, w02[p], w13[p], xq + 4 * p);                                                                \
            DOT4(a1, b1, w02[p + 4], w13[p + 4], xq + 16 + 4 * p);                                                   \
        }                                                                                                            \
        i0 = _mm512_add_epi32(a0, b0), i1 = _mm512_add_epi32(a1, b1);                                                \
        if (!(SPLIT)) i0 = _mm512_add_epi32(i0, i1);                                                                 \
    } while (0)

/* the scales of sub-block jb (32 weights) of a super-block record whose scales start at sc, for the 16 rows (d,
 * dmin: the super-block's): s0 and s1 of its codes 0..15 and 16..31, mn its min (Q6_K: d, its -32 offset is the
 * caller's) */
#define R16K_SCALES(TYPE, sc, d, dmin, jb, s0, s1, mn)                                                        \
    do {                                                                                                  \
        if (TYPE == Q6_K) {                                                                               \
            s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                \
                                      _mm_loadu_si128((const __m128i *)((sc) + 32 + 32 * (jb))))));       \
            s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(                                \
                                      _mm_loadu_si128((const __m128i *)((sc) + 48 + 32 * (jb))))));       \
            mn = dmin;                                                                                    \
        } else {                                                                                          \
            s0 = s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                           \
                                           _mm_loadu_si128((const __m128i *)((sc) + 64 + 16 * (jb))))));  \
            mn = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(                             \
                                         _mm_loadu_si128((const __m128i *)((sc) + 192 + 16 * (jb))))));   \
        }                                                                                                 \
    } while (0)

/* acc += a sub-block's int32 sums of 16 rows (R16_DOT32: i0 and i1 per 16 for Q6_K, else i0 all 32) with x's block
 * scale xd and its sums xs[0..1] per 16 (xs32 per 32), the weights' scales s0, s1 and min mn (R16K_SCALES) */
#define R16K_ACC(TYPE, acc, i0, i1, xd, xs, xs32, s0, s1, mn)                                                 \
    do {                                                                                                  \
        if (TYPE == Q6_K) { /* w = s (q - 32) per 16 */                                                   \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, xd), acc);                     \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i1), _mm512_mul_ps(s1, xd), acc);                     \
            acc = _mm512_fmadd_ps(s0, _mm512_set1_ps(-32.f * (xs)[0]), acc);                               \
            acc = _mm512_fmadd_ps(s1, _mm512_set1_ps(-32.f * (xs)[1]), acc);                               \
        } else { /* w = s q - mn per 32 */                                                                \
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i0), _mm512_mul_ps(s0, xd), acc);                     \
            acc = _mm512_fnmadd_ps(mn, _mm512_set1_ps(xs32), acc);                                        \
        }                                                                                                 \
    } while (0)

/* prefetches record sb + 2 of a super-block type, an eighth per sub-block jb: codes, high bits and scales alike (a
 * constant count of lines, unrolled: the loop bounded by jb's byte range cost 2-8% of the products) */
#define R16K_PREFETCH(rec, rec_bytes, jb)                                                                     \
    _Pragma("GCC unroll 8") for (int l = 0; l < ((rec_bytes) / 8 + 63) / 64; l++)                         \
    _mm_prefetch((const char *)((rec) + 2 * (rec_bytes) + (jb) * ((rec_bytes) / 8) + 64 * l), _MM_HINT_T0)

/* is[j] += wq . the int32 at r + j stride (4 int8 activations, broadcast), j < 8: vpdpbusd with the broadcast in
 * its memory operand ({1to16}). GCC 12 does not fold _mm512_set1_epi32(*p) into vpdpbusd's memory operand: it
 * issues a vpbroadcastd per product, and on a Zen 4 EPYC those took a vector-pipe slot each beside the products
 * (8 rows x 8 products from an L1-resident array: 2.4-2.6 against 3.2-3.3 G vpdpbusd/s; the R16 Q4_K kernel 4-13%
 * faster with this, bit for bit). One statement for the 8 rows keeps their chains interleaved: an asm a product let
 * the compiler put each row's chain back to back. R16B_SUMS takes it for Q6_K's half passes (4 code registers) too:
 * 4-9% faster on the 1B shape's Q6_K tensors at 32 and 256 rows on an Intel Xeon (model 207), where the EPYC had
 * measured them 3-4% slower with it. */
__attribute__((target("avx512f,avx512vnni"), always_inline)) static inline void
dpbusd8_bcst(__m512i *is, __m512i wq, const int8_t *r, size_t stride) {
    __asm__("vpdpbusd %9%{1to16%}, %8, %0\n\tvpdpbusd %10%{1to16%}, %8, %1\n\t"
            "vpdpbusd %11%{1to16%}, %8, %2\n\tvpdpbusd %12%{1to16%}, %8, %3\n\t"
            "vpdpbusd %13%{1to16%}, %8, %4\n\tvpdpbusd %14%{1to16%}, %8, %5\n\t"
            "vpdpbusd %15%{1to16%}, %8, %6\n\tvpdpbusd %16%{1to16%}, %8, %7"
            : "+v"(is[0]), "+v"(is[1]), "+v"(is[2]), "+v"(is[3]), "+v"(is[4]), "+v"(is[5]), "+v"(is[6]), "+v"(is[7])
            : "v"(wq), "m"(*(const int32_t *)r), "m"(*(const int32_t *)(r + stride)),
              "m"(*(const int32_t *)(r + 2 * stride)), "m"(*(const int32_t *)(r + 3 * stride)),
              "m"(*(const int32_t *)(r + 4 * stride)), "m"(*(const int32_t *)(r + 5 * stride)),
              "m"(*(const int32_t *)(r + 6 * stride)), "m"(*(const int32_t *)(r + 7 * stride)));
}

/* int8 activations: is[j] = the int32 dot products of code registers wq[p0..p1) (codes 4p..4p+3 of 16 rows) with
 * row m0 + j of x from column k, for j < MM, in one chain per row with the rows' chains interleaved: the loop is
 * bound by vpdpbusd's latency, and chains that ran a row at a time, or two per row joined by an add, measured 5-13%
 * slower on this EPYC */
#define R16B_SUMS(a, m0, k, wq, p0, p1, MM, is)                                                                      \
    do {                                                                                                             \
        const int8_t *xq_ = (const int8_t *)(a)->xq + (size_t)(m0) * (a)->Kp + (k);                                  \
        for (int j = 0; j < MM; j++) is[j] = _mm512_setzero_si512();                                                 \
        for (int p = p0; p < p1; p++)                                                                                \
            if (MM == 8 && (p1) - (p0) >= 4)                                                                         \
                dpbusd8_bcst(is, wq[p], xq_ + 4 * p, (size_t)(a)->Kp);                                               \
            else                                                                                                     \
                for (int j = 0; j < MM; j++)                                                                         \
                    is[j] = _mm512_dpbusd_epi32(is[j], wq[p],                                                        \
                                                _mm512_set1_epi32(*(const int32_t *)(xq_ + (size_t)j * (a)->Kp + 4 * p))); \
    } while (0)

/* One group of 16 rows of a 32-weight TYPE against MM rows of x: y[m0 + j][n0 + r] for r < nr; NAME r16_group
 * (int16 activations) or r16b_group (int8, I8) */
#define R16_GROUP_OF(NAME, I8, TYPE, MM)                                                                             \
    VNNI512 static void NAME##_##TYPE##_##MM(const Acts *a, const uint8_t *grp, int nb, int m0, void *y, int y_bf16, \
                                               int y_stride, int n0, int nr) {                                       \
        const int Kp = a->Kp, rec_bytes = r16_record_bytes(TYPE);                                                    \
        __m512 acc[MM]; /* the scaled dot products and the offsets' terms, summed together */                        \
        for (int j = 0; j < MM; j++) acc[j] = _mm512_setzero_ps();                                                   \
        for (int b = 0; b < nb; b++) {                                                                               \
            const uint8_t *rec = grp + (size_t)b * rec_bytes;                                                        \
            for (int l = 0; l < rec_bytes; l += 64) _mm_prefetch((const char *)(rec + 4 * rec_bytes + l), _MM_HINT_T0); \
            __m512i wq[8], w02[8], w13[8]; /* wq[p]: codes 4p..4p+3, wq[p + 4]: codes 16 + 4p.. */                   \
            r16_codes32(TYPE, rec, wq);                                                                              \
            if (!I8) SPLIT_WORDS(wq, w02, w13)                                                                       \
            __m512 d, m;                                                                                             \
            r16_scales32(TYPE, rec, &d, &m);                                                                         \
            __m512i is[MM]; /* each row's int32 sums of the 32 codes */                                              \
            if (I8) R16B_SUMS(a, m0, 32 * b, wq, 0, 8, MM, is);                                                      \
            else                                                                                                     \
                for (int j = 0; j < MM; j++) {                                                                       \
                    __m512i i1;                                                                                      \
                    R16_DOT32(0, a, (size_t)(m0 + j), 32 * b, w02, w13, is[j], i1);                                  \
                }                                                                                                    \
            for (int j = 0; j < MM; j++) {                                                                           \
                const size_t row = (size_t)(m0 + j);                                                                 \
                acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[j]), _mm512_mul_ps(d, _mm512_set1_ps(a->xd[row * (Kp / 32) + b])), \
                                         acc[j]);                                                                    \
                acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->xsum32[row * (Kp / 32) + b]), acc[j]);                \
            }                                                                                                        \
        }                                                                                                            \
        const __mmask16 keep = (__mmask16)((1u << nr) - 1);                                                          \
        for (int j = 0; j < MM; j++) STORE16(acc[j], m0 + j);                                                        \
    }

/* One group of 16 rows of a super-block TYPE against MM rows of x quantized to int16 per 32 (int8 activations
 * take r16q_group) */
#define R16K_GROUP(TYPE, MM)                                                                                         \
    VNNI512 static void r16_group_##TYPE##_##MM(const Acts *a, const uint8_t *grp, int nsb, int m0, void *y, int y_bf16, \
                                               int y_stride, int n0, int nr) {                                       \
        const int Kp = a->Kp, cb = r16_codes_end(TYPE), rec_bytes = r16_record_bytes(TYPE);                          \
        __m512 acc[MM];                                                                                              \
        for (int j = 0; j < MM; j++) acc[j] = _mm512_setzero_ps();                                                   \
        for (int sb = 0; sb < nsb; sb++) {                                                                           \
            const uint8_t *rec = grp + (size_t)sb * rec_bytes, *sc = rec + cb;                                       \
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));                               \
            const __m512 dmin = TYPE == Q6_K ? d : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));  \
            for (int jb = 0; jb < 8; jb++) {                                                                         \
                R16K_PREFETCH(rec, rec_bytes, jb);                                                                   \
                __m512i wq[8], w02[8], w13[8];                                                                       \
                r16k_codes(TYPE, rec, jb, wq);                                                                       \
                SPLIT_WORDS(wq, w02, w13)                                                                            \
                __m512 s0, s1, mn;                                                                                   \
                R16K_SCALES(TYPE, sc, d, dmin, jb, s0, s1, mn);                                                      \
                const int k0 = 256 * sb + 32 * jb;                                                                   \
                for (int j = 0; j < MM; j++) {                                                                       \
                    const size_t row = (size_t)(m0 + j);                                                             \
                    __m512i i0, i1;                                                                                  \
                    R16_DOT32(TYPE == Q6_K, a, row, k0, w02, w13, i0, i1);                                           \
                    const __m512 xd = _mm512_set1_ps(a->xd[row * (Kp / 32) + k0 / 32]);                              \
                    R16K_ACC(TYPE, acc[j], i0, i1, xd, a->xsum + row * (Kp / 16) + k0 / 16,                          \
                             a->xsum32[row * (Kp / 32) + k0 / 32], s0, s1, mn);                                      \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        const __mmask16 keep = (__mmask16)((1u << nr) - 1);                                                          \
        for (int j = 0; j < MM; j++) STORE16(acc[j], m0 + j);                                                        \
    }

/* One group of 16 rows of a K-quant TYPE against MM rows of x quantized per 256 (prepare_row8k, llama.cpp's
 * ggml_vec_dot_q4_K_q8_K arithmetic): a sub-block's int32 sums meet its integer scale in one float32 FMA, each
 * product an integer below 2^24 and so exact (31 x 127 x 32 x 63 for Q5_K, 63 x 127 x 16 x 128 for Q6_K), their sum
 * rounded only past 2^24: vpmulld in int32, 2 uops on port 0 of Intel's cores and an add, was 3-8% slower on the 1B
 * shape's Q4_K and Q6_K tensors on an Intel Xeon, with the same outputs there. The rest of the float work is once per
 * super-block: y += d dx sum_j sc_j (q_j . x_j) - dmin dx sum_j m_j sum(x_j) for Q4_K and
 * Q5_K (the mins' term with vpdpwssd on (m_j, m_j+1) pairs), y += d dx sum_h sc_h ((q_h - 32) . x_h) for Q6_K (per
 * 16; its -32 offset once per super-block, vpdpwssd on (sc_h, sc_h+1) pairs against the codes' sums per 16, in
 * int32). */
#define R16Q_GROUP(TYPE, MM)                                                                                      \
    VNNI512 static void r16q_group_##TYPE##_##MM(const Acts *a, const uint8_t *grp, int nsb, int m0, void *y,      \
                                                  int y_bf16, int y_stride, int n0, int nr) {                         \
        const int Kp = a->Kp, cb = r16_codes_end(TYPE), rec_bytes = r16_record_bytes(TYPE);                          \
        __m512 acc[MM];                                                                                              \
        for (int j = 0; j < MM; j++) acc[j] = _mm512_setzero_ps();                                                   \
        for (int sb = 0; sb < nsb; sb++) {                                                                           \
            const uint8_t *rec = grp + (size_t)sb * rec_bytes, *sc = rec + cb;                                       \
            __m512 A[MM]; /* sum_j sc_j (q_j . x_j), in float32: each product below 2^24, so exact */                \
            for (int j = 0; j < MM; j++) A[j] = _mm512_setzero_ps();                                                 \
            for (int jb = 0; jb < 8; jb++) {                                                                         \
                R16K_PREFETCH(rec, rec_bytes, jb);                                                                   \
                __m512i wq[8], is[MM];                                                                               \
                r16k_codes(TYPE, rec, jb, wq);                                                                       \
                const int k0 = 256 * sb + 32 * jb;                                                                   \
                if (TYPE == Q6_K) {                                                                                  \
                    _Pragma("GCC unroll 2") /* wq[] indexed by constants: registers, not the stack */        \
                    for (int h = 0; h < 2; h++) {                                                                    \
                        const __m512 s = _mm512_cvtepi32_ps(                                                         \
                            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 32 + 32 * jb + 16 * h))));  \
                        R16B_SUMS(a, m0, k0, wq, 4 * h, 4 * h + 4, MM, is);                                          \
                        for (int j = 0; j < MM; j++) A[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[j]), s, A[j]);     \
                    }                                                                                                \
                } else {                                                                                             \
                    const __m512 s = _mm512_cvtepi32_ps(                                                             \
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 64 + 16 * jb))));               \
                    R16B_SUMS(a, m0, k0, wq, 0, 8, MM, is);                                                          \
                    for (int j = 0; j < MM; j++) A[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[j]), s, A[j]);         \
                }                                                                                                    \
            }                                                                                                        \
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));                               \
            if (TYPE == Q6_K) {                                                                                      \
                __m512i sp[8]; /* (s_2t, s_2t+1) of each row as two int16 */                                          \
                for (int t = 0; t < 8; t++)                                                                          \
                    sp[t] = _mm512_or_si512(                                                                         \
                        _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 32 + 32 * t))),  \
                                         _mm512_set1_epi32(0xFFFF)),                                                  \
                        _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sc + 48 + 32 * t))), 16)); \
                for (int j = 0; j < MM; j++) { /* the -32 offset: 32 sum_h s_h sum(x_h) */                           \
                    const int32_t *x16 = (const int32_t *)(a->is16 + (size_t)(m0 + j) * (Kp / 16) + 16 * sb);         \
                    __m512i B = _mm512_setzero_si512();                                                              \
                    for (int t = 0; t < 8; t++) B = _mm512_dpwssd_epi32(B, sp[t], _mm512_set1_epi32(x16[t]));         \
                    A[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(B), _mm512_set1_ps(32.f), A[j]);                      \
                }                                                                                                    \
                for (int j = 0; j < MM; j++) {                                                                       \
                    const float dx = a->xd[(size_t)(m0 + j) * (Kp / 256) + sb];                                      \
                    acc[j] = _mm512_fmadd_ps(A[j], _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[j]);                    \
                }                                                                                                    \
            } else {                                                                                                 \
                const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));                 \
                __m512i mp[4]; /* (m_2t, m_2t+1) of each row as two int16 */                                          \
                for (int t = 0; t < 4; t++)                                                                          \
                    mp[t] = _mm512_or_si512(                                                                         \
                        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 192 + 32 * t))),                 \
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sc + 208 + 32 * t))), 16)); \
                for (int j = 0; j < MM; j++) {                                                                       \
                    const size_t row = (size_t)(m0 + j);                                                             \
                    const int32_t *s32 = (const int32_t *)(a->is32 + row * (Kp / 32) + 8 * sb);                       \
                    __m512i B = _mm512_setzero_si512();                                                              \
                    for (int t = 0; t < 4; t++) B = _mm512_dpwssd_epi32(B, mp[t], _mm512_set1_epi32(s32[t]));        \
                    const __m512 dx = _mm512_set1_ps(a->xd[row * (Kp / 256) + sb]);                                  \
                    acc[j] = _mm512_fmadd_ps(A[j], _mm512_mul_ps(d, dx), acc[j]);                                    \
                    acc[j] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(B), _mm512_mul_ps(dmin, dx), acc[j]);               \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        const __mmask16 keep = (__mmask16)((1u << nr) - 1);                                                          \
        for (int j = 0; j < MM; j++) STORE16(acc[j], m0 + j);                                                        \
    }

#define R16_MM 4  /* rows of x per pass over a group's codes, int16 activations */
#define R16B_MM 8 /* the same, int8: no word split, so twice as many rows fit the registers */
#ifndef R16_CHUNK_BYTES
#define R16_CHUNK_BYTES (256 << 10) /* activation codes a pass over the weights keeps in L2 (r16_linear) */
#endif
#define R16_GROUP(TYPE, MM) R16_GROUP_OF(r16_group, 0, TYPE, MM)
#define R16B_GROUP(TYPE, MM) R16_GROUP_OF(r16b_group, 1, TYPE, MM)
#define INSTANCES(G, TYPE) G(TYPE, 1) G(TYPE, 2) G(TYPE, 3) G(TYPE, 4)
#define INSTANCES8(G, TYPE) INSTANCES(G, TYPE) G(TYPE, 5) G(TYPE, 6) G(TYPE, 7) G(TYPE, 8)
INSTANCES(R16_GROUP, Q4_0)
INSTANCES(R16_GROUP, Q4_1)
INSTANCES(R16_GROUP, Q8_0)
INSTANCES(R16_GROUP, MXFP4)
INSTANCES(R16K_GROUP, Q4_K)
INSTANCES(R16K_GROUP, Q5_K)
INSTANCES(R16K_GROUP, Q6_K)
INSTANCES8(R16B_GROUP, Q4_0)
INSTANCES8(R16B_GROUP, Q4_1)
INSTANCES8(R16B_GROUP, Q8_0)
INSTANCES8(R16B_GROUP, MXFP4)
INSTANCES8(R16Q_GROUP, Q4_K)
INSTANCES8(R16Q_GROUP, Q5_K)
INSTANCES8(R16Q_GROUP, Q6_K)

typedef void (*r16_group_fn)(const Acts *, const uint8_t *, int, int, void *, int, int, int, int);
static int is_k_quant(int type) { return type == Q4_K || type == Q5_K || type == Q6_K; }
/* the kernel for `type` and mm rows: int16 activations (1 <= mm <= R16_MM) or int8 (i8, mm <= R16B_MM; per 256
 * for the K-quants: r16q_group) */
static r16_group_fn r16_group(int type, int mm, int i8) {
#define FNS(T) {r16_group_##T##_1, r16_group_##T##_2, r16_group_##T##_3, r16_group_##T##_4}
    static const r16_group_fn fns[7][R16_MM] = {FNS(Q4_0), FNS(Q4_1), FNS(Q8_0), FNS(Q4_K),
                                                FNS(Q5_K), FNS(Q6_K), FNS(MXFP4)};
#undef FNS
#define FNS(T, G)                                                                                                   \
    {G##_##T##_1, G##_##T##_2, G##_##T##_3, G##_##T##_4, G##_##T##_5, G##_##T##_6, G##_##T##_7, G##_##T##_8}
    static const r16_group_fn fns8[7][R16B_MM] = {FNS(Q4_0, r16b_group), FNS(Q4_1, r16b_group), FNS(Q8_0, r16b_group),
                                                  FNS(Q4_K, r16q_group), FNS(Q5_K, r16q_group), FNS(Q6_K, r16q_group),
                                                  FNS(MXFP4, r16b_group)};
#undef FNS
    const int t = type == Q4_0   ? 0
                  : type == Q4_1 ? 1
                  : type == Q8_0 ? 2
                  : type == Q4_K ? 3
                  : type == Q5_K ? 4
                  : type == Q6_K ? 5
                                 : 6;
    return i8 ? fns8[t][mm - 1] : fns[t][mm - 1];
}

static int has_vnni512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl");
}
#endif

/* 1 when this CPU runs gguf_r16_linear (AVX512-VNNI, BW and VL; no AVX512-BF16 needed), else 0 */
int gguf_r16_isa(void) {
#if defined(__x86_64__)
    return has_vnni512();
#else
    return 0;
#endif
}

/* 1 when this CPU runs R16 weights of `type` on int16 activations (`int8` 0) or int8 ones: every R16 type with
 * AVX512-VNNI; with AVX2 alone, int8 activations against the types of gguf_r16_avx2.c (not Q8_0) */
int gguf_q8_isa(void); /* below: AVX2, FMA and F16C */
int gguf_r16_takes(int type, int int8) {
#if defined(__x86_64__)
    if (!r16_type(type)) return 0;
    return has_vnni512() || (int8 && gguf_r16_avx2_type(type) && gguf_q8_isa());
#else
    (void)type, (void)int8;
    return 0;
#endif
}

/* The activations' buffers of an R16 product of M rows of K (int8: int8 codes, per 256 against the K-quants), carved
 * from `ws` (gguf_r16_acts_bytes of it, 64-byte aligned), or their bytes where ws is NULL */
#if defined(__x86_64__)
static size_t r16_acts(Acts *a, void *ws, int type, int M, int K, int int8) {
    const size_t Kp = (size_t)(K + 63) / 64 * 64;
    const int q8k = int8 && is_k_quant(type); /* int8 activations meet a K-quant per 256 (r16q_group) */
    const size_t bytes[6] = {(int8 ? 1 : sizeof(int16_t)) * M * Kp, sizeof(float) * M * (Kp / 32),
                             int8 ? 0 : sizeof(float) * M * (Kp / 16), q8k ? 0 : sizeof(float) * M * (Kp / 32),
                             q8k ? sizeof(int16_t) * M * (Kp / 16) : 0, q8k ? sizeof(int16_t) * M * (Kp / 32) : 0};
    void *at[6];
    size_t total = 0;
    for (int i = 0; i < 6; i++) {
        at[i] = bytes[i] && ws ? (char *)ws + total : NULL;
        total += (bytes[i] + 63) / 64 * 64;
    }
    if (a)
        *a = (Acts){.Kp = (int)Kp, .xq = at[0], .xd = at[1], .xsum = at[2], .xsum32 = at[3], .is16 = at[4],
                    .is32 = at[5]};
    return total;
}
#endif

size_t gguf_r16_acts_bytes(int type, int M, int K, int int8) {
#if defined(__x86_64__)
    return r16_acts(NULL, NULL, type, M, K, int8);
#else
    (void)type, (void)M, (void)K, (void)int8;
    return 0;
#endif
}

/* y = x W^T on R16 weights by the calling thread's team: inside a parallel region, every thread of the team calls it
 * with the same arguments (`ws` shared: gguf_r16_acts_bytes). It returns once the calling thread's share is done,
 * without waiting for the others: y is whole, and ws free for the next product, after the team's next barrier. The
 * arithmetic and the split of the work (groups of 16 rows shared out statically) are gguf_r16_linear's (_i8's with
 * int8), which runs it on a team of its own. The caller has checked what r16_linear checks (the type has an R16
 * layout, the CPU AVX512-VNNI, AMX not taking M rows). */
void gguf_r16_linear_team(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                          int y_stride, int M, int N, int K, int int8, void *ws) {
#if defined(__x86_64__)
    const int nb = K / block_weights(type), groups = (N + 15) / 16;
    const size_t group_bytes = (size_t)nb * r16_record_bytes(type);
    Acts a;
    r16_acts(&a, ws, type, M, K, int8);
    const int q8k = int8 && is_k_quant(type);
    const int avx2 = !has_vnni512(); /* gguf_r16_avx2.c's kernels (int8 activations only) */
    const int step = avx2 ? R16A_MM : int8 ? R16B_MM : R16_MM;
    /* R16_CHUNK_BYTES of codes a chunk, whole steps of rows */
    const int fit = (int)(R16_CHUNK_BYTES / ((int8 ? 1 : 2) * (long)a.Kp)) / step * step, chunk = fit > step ? fit : step;
    _Pragma("omp for schedule(static)")
    for (int m = 0; m < M; m++)
        if (avx2)
            r16a_prepare_row(&a, x, x_bf16, x_stride, K, m, q8k);
        else
            (q8k ? prepare_row8k : int8 ? prepare_row8 : prepare_row)(&a, x, x_bf16, x_stride, K, m);
    /* rows of x in chunks whose codes stay in L2 while every group of weights passes over them (unchunked,
     * a 2,048-row prompt chunk's codes were streamed again from L3 for each 16 weight rows); the chunks are
     * independent, so no thread waits for the others between them */
    for (int c0 = 0; c0 < M; c0 += chunk) {
        const int c1 = M - c0 < chunk ? M : c0 + chunk;
        _Pragma("omp for schedule(static) nowait")
        for (int g = 0; g < groups; g++) {
            const int nr = N - 16 * g < 16 ? N - 16 * g : 16;
            for (int m0 = c0; m0 < c1; m0 += step) {
                const int mm = c1 - m0 < step ? c1 - m0 : step;
                if (avx2)
                    r16a_group(type, mm, &a, w + g * group_bytes, nb, m0, y, y_bf16, y_stride, 16 * g, nr);
                else
                    r16_group(type, mm, int8)(&a, w + g * group_bytes, nb, m0, y, y_bf16, y_stride, 16 * g, nr);
            }
        }
    }
#else
    (void)x, (void)x_bf16, (void)x_stride, (void)w, (void)type, (void)y, (void)y_bf16, (void)y_stride, (void)M;
    (void)N, (void)K, (void)int8, (void)ws;
#endif
}

static int r16_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                      int y_stride, int M, int N, int K, int num_threads, int int8) {
#if defined(__x86_64__)
    if (gguf_r16_bytes(type, 1, K) < 0 || !gguf_r16_takes(type, int8)) return -1;
    const int amx = gguf_amx_r16_linear(x, x_bf16, x_stride, w, type, y, y_bf16, y_stride, M, N, K, num_threads);
    if (amx <= 0) return amx; /* done on AMX tiles */
    void *ws = aligned_alloc(64, gguf_r16_acts_bytes(type, M, K, int8));
    _Pragma("omp parallel num_threads(num_threads)")
    gguf_r16_linear_team(x, x_bf16, x_stride, w, type, y, y_bf16, y_stride, M, N, K, int8, ws);
    free(ws);
    return 0;
#else
    (void)x, (void)x_bf16, (void)x_stride, (void)w, (void)type, (void)y, (void)y_bf16, (void)y_stride, (void)M;
    (void)N, (void)K, (void)num_threads, (void)int8;
    return -1;
#endif
}

/* y = x W^T for W in R16 (N real rows), x quantized to int16 per 32. Needs AVX512-VNNI (and BF16 for bfloat16 y):
 * returns -1 without them (the caller dequantizes instead), or for a type without R16. From AMX_MIN_ROWS rows
 * where gguf_amx_enable turned the tiles on, the AMX kernel instead. */
int gguf_r16_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                    int y_stride, int M, int N, int K, int num_threads) {
    return r16_linear(x, x_bf16, x_stride, w, type, y, y_bf16, y_stride, M, N, K, num_threads, 0);
}

/* The same with x quantized to int8 per 32 (vpdpbusd: llama.cpp's Q8_0 activations, twice the multiply-adds per
 * instruction), or per 256 against Q4_K, Q5_K and Q6_K (its Q8_K: r16q_group, the sub-blocks' scales applied in
 * int32). */
int gguf_r16_linear_i8(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                       int y_stride, int M, int N, int K, int num_threads) {
    return r16_linear(x, x_bf16, x_stride, w, type, y, y_bf16, y_stride, M, N, K, num_threads, 1);
}

/* ---- Q8: int8 activations against the file's blocks, AVX2 (llama.cpp's ggml_vec_dot_*_q8_0 / _q8_1 / _q8_K) ----
 * Each row of x is quantized per 32 values to int8 xq with a float scale dx = max|x| / 127, and the block's sum
 * sx = dx sum(xq) (llama.cpp's Q8_1 `s`: the sum of the quantized values, so that a type with an offset m
 * computes exactly sum (d q + m) (dx xq), the dot of the dequantized weights with the rounded activations; the
 * float sum instead left m sum(x - dx xq) over, +2.8% perplexity on the default Q4_1 model). A 32-weight chunk's
 * codes q are decoded into one 256-bit register (Q4_0 / Q4_1 nibbles, Q5_0 / Q5_1 plus a fifth bit, Q8_0 bytes,
 * Q4_K / Q5_K sub-blocks, Q6_K's 6-bit codes; IQ4_NL's and MXFP4's nibbles through their value tables, one byte
 * shuffle) and multiplied with _mm256_maddubs_epi16 (unsigned x signed bytes,
 * pairs summed to int16; codes ≤ 63, so no int16 saturates) and _mm256_madd_epi16 (to int32): signed codes (Q4_0
 * q - 8, Q5_0 q - 16, Q8_0) as |q| against xq with q's sign. A chunk adds s dx dot + m sx, with s its scale
 * and m its offset. The K-quants (Q4_K, Q5_K, Q6_K) meet activations quantized per 256 (llama.cpp's Q8_K): their
 * sub-block scales multiply int16 pair sums in _mm256_madd_epi16 and a super-block takes one float step; Q6_K's
 * offset 32 meets each 16 activations' integer sum. Not exact: the activations'
 * rounding moves each product by up to half a step of dx, as in llama.cpp; the caller chooses the path
 * (models/quantization/gguf.py). */
#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma,f16c")))

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

AVX2 static inline float half_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* the 32 codes of a Q4_0 / Q4_1 block's 16 bytes: low nibbles (weights 0..15), then high (16..31) */
AVX2 static inline __m256i nibbles32(const uint8_t *qs) { /* the bytes in both halves, the high half shifted */
    const __m256i raw = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i shift = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    return _mm256_and_si256(_mm256_srlv_epi32(raw, shift), _mm256_set1_epi8(0x0F));
}

/* the signed int8 values of 32 codes 0..15 through a 16-entry table (IQ4_NL's KVALUES, MXFP4's FP4_VALUES) */
AVX2 static inline __m256i table32(__m256i codes, const float *table) {
    int8_t t[16];
    for (int i = 0; i < 16; i++) t[i] = (int8_t)table[i];
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)t)), codes);
}

/* the two float16 at p (a block's d and m) as floats */
AVX2 static inline void half_pair(const uint8_t *p, float *d, float *m) {
    int32_t v;
    memcpy(&v, p, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(v));
    *d = _mm_cvtss_f32(f), *m = _mm_cvtss_f32(_mm_movehdup_ps(f));
}

/* the 8 int32 sums over 4 bytes each of a * b: a unsigned, b signed. With AVX512-VNNI (the build is -march=native)
 * one vpdpbusd, llama.cpp's choice too; the same sums, as no int16 pair sum saturates for the callers' codes. */
AVX2 static inline __m256i dot_u8_i8(__m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
#endif
}

/* the same with both signed: |a| against b with a's sign */
AVX2 static inline __m256i dot_i8_i8(__m256i a, __m256i b) {
    return dot_u8_i8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a));
}

AVX2 static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define Q8_MAX_ROWS 8 /* activation rows per kernel call; more are taken 8 at a time */
#define Q8_TILE 16    /* weight rows per tile when there are more */

/* the activations: xq int8 [M, K], xd and xs float [M, K / 32], and for Q6_K xb int16 [M, K / 16]: each 16 codes'
 * sum */
typedef struct {
    const int8_t *xq;
    const float *xd, *xs;
    const int16_t *xb;
    int M, K;
} Q8Acts;

/* acc[j] += s dx_j dot(q, xq_j) over the 32 activations of row j < M from column k, and bias[j] += m sx_j when
 * `has_min`; `is_signed`: q holds signed codes; s: the scale of int32 lanes 0..7. Inlined into q8_range with M and the
 * type known at compile time, so acc and bias stay in registers and the type's branches fold away. */
#define Q8_INLINE AVX2 static inline __attribute__((always_inline))
Q8_INLINE void q8_chunk(const Q8Acts *a, const int M, int k, __m256i q, int is_signed, __m256 s, int has_min,
                        float m, __m256 *acc, float *bias) {
    const int nb = a->K / 32, c = k / 32;
    const __m256i qa = is_signed ? _mm256_sign_epi8(q, q) : q;
    for (int j = 0; j < M; j++) {
        __m256i xv = _mm256_loadu_si256((const __m256i *)(a->xq + (size_t)j * a->K + k));
        if (is_signed) xv = _mm256_sign_epi8(xv, q);
        const __m256 dot = _mm256_cvtepi32_ps(dot_u8_i8(qa, xv));
        acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(s, _mm256_set1_ps(a->xd[j * nb + c])), dot, acc[j]);
        if (has_min) bias[j] += m * a->xs[j * nb + c];
    }
}

/* one block of a row (32 or 256 weights, starting at column k) into acc and bias */
Q8_INLINE void q8_block(const Q8Acts *a, const int M, const int type, const uint8_t *blk, int k, __m256 *acc,
                        float *bias) {
    switch (type) {
    case Q4_0:
        q8_chunk(a, M, k, _mm256_sub_epi8(nibbles32(blk + 2), _mm256_set1_epi8(8)), 1,
                 _mm256_set1_ps(half_to_f32(blk)), 0, 0.f, acc, bias);
        break;
    case Q4_1:
    case Q5_1: {
        float d, m;
        half_pair(blk, &d, &m);
        const __m256i q = type == Q4_1 ? nibbles32(blk + 4) : _mm256_or_si256(nibbles32(blk + 8), fifth_bits32(blk + 4));
        q8_chunk(a, M, k, q, 0, _mm256_set1_ps(d), 1, m, acc, bias);
        break;
    }
    case Q5_0:
        q8_chunk(a, M, k,
                 _mm256_sub_epi8(_mm256_or_si256(nibbles32(blk + 6), fifth_bits32(blk + 2)), _mm256_set1_epi8(16)), 1,
                 _mm256_set1_ps(half_to_f32(blk)), 0, 0.f, acc, bias);
        break;
    case Q8_0:
        q8_chunk(a, M, k, _mm256_loadu_si256((const __m256i *)(blk + 2)), 1, _mm256_set1_ps(half_to_f32(blk)), 0, 0.f,
                 acc, bias);
        break;
    case IQ4_NL:
        q8_chunk(a, M, k, table32(nibbles32(blk + 2), KVALUES), 1, _mm256_set1_ps(half_to_f32(blk)), 0, 0.f, acc, bias);
        break;
    case MXFP4:
        q8_chunk(a, M, k, table32(nibbles32(blk + 1), FP4_VALUES), 1, _mm256_set1_ps(e8m0_half(blk[0])), 0, 0.f, acc,
                 bias);
        break;
    case Q4_K:
    case Q5_K: { /* Q8_K activations: sum_sb sc_sb (q . xq)_sb in int32, one float step per super-block */
        float d, dmin;
        half_pair(blk, &d, &dmin);
        /* the 12 bytes of 6-bit scales and mins into bytes 0-7 (scales) and 8-15 (mins), as k_scale_min reads them */
        uint32_t u[4];
        memcpy(u, blk + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
        const uint32_t mins_lo = u[1] & 0x3f3f3f3f;
        u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
        u[2] = mins_lo;
        u[0] &= 0x3f3f3f3f;
        const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)u)));
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(u + 2))));
        const uint8_t *qs = blk + (type == Q4_K ? 16 : 48);
        const __m256i low = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
        const __m256i qh = type == Q5_K ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
        __m256i sumi[Q8_MAX_ROWS];
        for (int j = 0; j < M; j++) sumi[j] = _mm256_setzero_si256();
        for (int p = 0; p < 4; p++) { /* 32 bytes: sub-block 2p in the low nibbles, 2p + 1 in the high */
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * p));
            for (int h = 0; h < 2; h++) {
                const int sb = 2 * p + h;
                __m256i q = _mm256_and_si256(h ? _mm256_srli_epi16(raw, 4) : raw, low);
                if (type == Q5_K)
                    q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, sb), one), 4));
                /* scale sb (int16 lane sb) in every lane */
                const __m256i scale = _mm256_shuffle_epi8(scales, _mm256_set1_epi16((short)(2 * sb | (2 * sb + 1) << 8)));
                for (int j = 0; j < M; j++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(a->xq + (size_t)j * a->K + k + 32 * sb));
                    sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
                }
            }
        }
        const int nb = a->K / 32, c = k / 32;
        for (int j = 0; j < M; j++) { /* d dy sumi - dmin dy sum_sb m_sb xs_sb, into acc's 8 lanes */
            const float dy = a->xd[j * nb + c];
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * dy), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
            acc[j] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(-dmin * dy), mins), _mm256_loadu_ps(a->xs + j * nb + c),
                                     acc[j]);
        }
        break;
    }
    case Q6_K: { /* Q8_K activations: codes 0..63 unsigned against xq, the 16 int8 scales (one per 16) as madd
                  * factors, the offset 32 through the activations' sums per 16; one float step per 256 weights */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(3);
        __m256i sumi[Q8_MAX_ROWS];
        for (int j = 0; j < M; j++) sumi[j] = _mm256_setzero_si256();
        for (int h = 0; h < 2; h++) { /* 128 weights: ql 64 B, qh 32 B, scales 8h..8h+7 */
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            const __m256i scales = _mm256_broadcastsi128_si256(h ? _mm256_extracti128_si256(sc16, 1)
                                                                 : _mm256_castsi256_si128(sc16));
            for (int t = 0; t < 4; t++) { /* chunk t: low or high nibbles of l0 or l1, bits 2t.. of qh */
                const __m256i l = t & 1 ? l1 : l0;
                const __m256i lo = _mm256_and_si256(t >> 1 ? _mm256_srli_epi16(l, 4) : l, low);
                const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * t), two), 4);
                const __m256i q = _mm256_or_si256(lo, hi);
                /* int16 scale 2t in the low 128 bits (weights 0-15), 2t + 1 in the high (16-31) */
                const __m256i scale = _mm256_shuffle_epi8(
                    scales, _mm256_setr_m128i(_mm_set1_epi16((short)(4 * t | (4 * t + 1) << 8)),
                                              _mm_set1_epi16((short)((4 * t + 2) | (4 * t + 3) << 8))));
                for (int j = 0; j < M; j++) {
                    const __m256i xv =
                        _mm256_loadu_si256((const __m256i *)(a->xq + (size_t)j * a->K + k + 128 * h + 32 * t));
                    sumi[j] = _mm256_add_epi32(sumi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), scale));
                }
            }
        }
        const float d = half_to_f32(blk + 208);
        const int nb = a->K / 32, c = k / 32;
        for (int j = 0; j < M; j++) { /* d dy (sumi - 32 sum_16 sc bsum) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(a->xb + (size_t)j * (a->K / 16) + k / 16));
            sumi[j] = _mm256_sub_epi32(sumi[j], _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 5));
            acc[j] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->xd[j * nb + c]), _mm256_cvtepi32_ps(sumi[j]), acc[j]);
        }
        break;
    }
    }
}

/* The 4 int32 sums of four blocks' dot products p0..p3 (8 partial lanes each) in lanes 0-3, and again in lanes
 * 4-7 (each half of a block in its own half): ik_llama.cpp's Sum4. `pack`: the lanes fit int16 (4- and 5-bit
 * codes against int8: |lane| <= 4 * 31 * 128), so they add through two saturating packs and madds; Q8_0's do not. */
Q8_INLINE __m256i sum4(__m256i p0, __m256i p1, __m256i p2, __m256i p3, int pack) {
    if (pack) {
        const __m256i one = _mm256_set1_epi16(1);
        const __m256i p01 = _mm256_madd_epi16(one, _mm256_packs_epi32(p0, p1)); /* 0,0,1,1 per 128 bits */
        const __m256i p23 = _mm256_madd_epi16(one, _mm256_packs_epi32(p2, p3)); /* 2,2,3,3 */
        return _mm256_madd_epi16(one, _mm256_packs_epi32(p01, p23));             /* 0,1,2,3 */
    }
    const __m256i p01 = _mm256_add_epi32(_mm256_unpacklo_epi32(p0, p1), _mm256_unpackhi_epi32(p0, p1)); /* 0,1,0,1 */
    const __m256i p23 = _mm256_add_epi32(_mm256_unpacklo_epi32(p2, p3), _mm256_unpackhi_epi32(p2, p3)); /* 2,3,2,3 */
    return _mm256_add_epi32(_mm256_unpacklo_epi64(p01, p23), _mm256_unpackhi_epi64(p01, p23));
}

/* Four consecutive 32-weight blocks of a row (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) from column k into acc and bias4:
 * one int-to-float conversion and one FMA per row for the four (their sums in the lanes of sum4, against the
 * vector of d_w dx per block), where q8_block takes one each per block. Q4_0, Q5_0 and MXFP4 run as offset types
 * (codes 0..15, 0..31 or 0..24 with m = -8 d, -16 d or -12 d: exact in integers), so every type but Q8_0 and IQ4_NL
 * skips the sign trick. */
Q8_INLINE void q8_quad(const Q8Acts *a, const int M, const int type, const uint8_t *blk, int k, __m256 *acc,
                       __m128 *bias4) {
    const int bb = block_bytes(type), nb = a->K / 32, c = k / 32;
    __m256i q[4];
    for (int i = 0; i < 4; i++) {
        const uint8_t *b = blk + i * bb;
        switch (type) {
        case Q4_0: q[i] = nibbles32(b + 2); break;
        case Q4_1: q[i] = nibbles32(b + 4); break;
        case Q5_0: q[i] = _mm256_or_si256(nibbles32(b + 6), fifth_bits32(b + 2)); break;
        case Q5_1: q[i] = _mm256_or_si256(nibbles32(b + 8), fifth_bits32(b + 4)); break;
        case Q8_0: q[i] = _mm256_loadu_si256((const __m256i *)(b + 2)); break;
        case IQ4_NL: q[i] = table32(nibbles32(b + 2), KVALUES); break;
        case MXFP4: /* its values plus 12, unsigned codes 0..24: an offset type with m = -12 d, exact in integers */
            q[i] = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11,
                                                                                  10, 9, 8, 6, 4, 0)),
                                       nibbles32(b + 1));
            break;
        }
    }
    /* the four blocks' float16 d (and m) gathered into one vector and converted at once (ik_llama.cpp's
     * ScaleHelperQ_1): no scalar conversions, no floats stored and read back as a vector */
    uint32_t u[4];
    for (int i = 0; i < 4; i++) memcpy(&u[i], blk + i * bb, sizeof(uint32_t)); /* d, then m or the codes */
    const __m128i raw = _mm_loadu_si128((const __m128i *)u);
    __m128 dw, mw;
    if (type == MXFP4) { /* a power-of-two scale byte per block; the offset of the shifted codes */
        dw = _mm_setr_ps(e8m0_half(blk[0]), e8m0_half(blk[bb]), e8m0_half(blk[2 * bb]), e8m0_half(blk[3 * bb]));
        mw = _mm_mul_ps(dw, _mm_set1_ps(-12.f));
    } else if (type == Q4_1 || type == Q5_1) { /* d0 m0 d1 m1 ... -> d0..d3 m0..m3 */
        const __m256 dm = _mm256_cvtph_ps(_mm_shuffle_epi8(raw, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10,
                                                                               11, 14, 15)));
        dw = _mm256_castps256_ps128(dm), mw = _mm256_extractf128_ps(dm, 1);
    } else {
        dw = _mm_cvtph_ps(_mm_shuffle_epi8(raw, _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1)));
        mw = _mm_mul_ps(dw, _mm_set1_ps(type == Q4_0 ? -8.f : type == Q5_0 ? -16.f : 0.f));
    }
    const int is_signed = type == Q8_0 || type == IQ4_NL; /* IQ4_NL's values span -127..113: signed */
    __m256i qa[4];
    for (int i = 0; i < 4; i++) qa[i] = is_signed ? _mm256_sign_epi8(q[i], q[i]) : q[i];
    for (int j = 0; j < M; j++) {
        const int8_t *x = a->xq + (size_t)j * a->K + k;
        __m256i p[4];
        for (int i = 0; i < 4; i++) {
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * i));
            if (is_signed) xv = _mm256_sign_epi8(xv, q[i]);
            p[i] = dot_u8_i8(qa[i], xv);
        }
        const __m128 s = _mm_mul_ps(dw, _mm_loadu_ps(a->xd + j * nb + c));
        acc[j] = _mm256_fmadd_ps(_mm256_set_m128(s, s), _mm256_cvtepi32_ps(sum4(p[0], p[1], p[2], p[3], !is_signed)),
                                 acc[j]);
        if (!is_signed) bias4[j] = _mm_fmadd_ps(mw, _mm_loadu_ps(a->xs + j * nb + c), bias4[j]);
    }
}

/* y[:, n] for the weight rows n0 <= n < n1: the body of q8_range_<type>_<M> */
Q8_INLINE void q8_range(const Q8Acts *a, const int M, const int type, const uint8_t *w, int n0, int n1, void *y,
                        int y_bf16, int y_stride) {
    const int bw = block_weights(type), nb = a->K / bw, bb = block_bytes(type);
    const size_t row_bytes = (size_t)nb * bb;
    for (int n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[Q8_MAX_ROWS];
        __m128 bias4[Q8_MAX_ROWS];
        float bias[Q8_MAX_ROWS] = {0};
        for (int j = 0; j < M; j++) acc[j] = _mm256_setzero_ps(), bias4[j] = _mm_setzero_ps();
        int b = 0;
        if (bw == 32) /* four blocks at a time, the rest one by one */
            for (; b + 4 <= nb; b += 4) {
                const uint8_t *blk = row + (size_t)b * bb;
                _mm_prefetch((const char *)(blk + 4 * bb), _MM_HINT_T0);
                _mm_prefetch((const char *)(blk + 4 * bb + 64), _MM_HINT_T0);
                q8_quad(a, M, type, blk, b * bw, acc, bias4);
            }
        for (; b < nb; b++) {
            const uint8_t *blk = row + (size_t)b * bb;
            _mm_prefetch((const char *)(blk + 4 * bb), _MM_HINT_T0);
            q8_block(a, M, type, blk, b * bw, acc, bias);
        }
        for (int j = 0; j < M; j++) {
            const __m128 b4 = _mm_add_ps(bias4[j], _mm_movehl_ps(bias4[j], bias4[j]));
            const float v = hsum8(acc[j]) + bias[j] + _mm_cvtss_f32(_mm_add_ss(b4, _mm_movehdup_ps(b4)));
            const size_t at = (size_t)j * y_stride + n;
            if (y_bf16)
                ((bf16 *)y)[at] = f32_to_bf16(v);
            else
                ((float *)y)[at] = v;
        }
    }
}

typedef void (*q8_range_fn)(const Q8Acts *, const uint8_t *, int, int, void *, int, int);
#define Q8_RANGE(T, MM)                                                                                              \
    AVX2 static void q8_range_##T##_##MM(const Q8Acts *a, const uint8_t *w, int n0, int n1, void *y, int y_bf16,   \
                                         int y_stride) {                                                             \
        q8_range(a, MM, T, w, n0, n1, y, y_bf16, y_stride);                                                          \
    }
#define Q8_RANGES(T)                                                                                                 \
    Q8_RANGE(T, 1) Q8_RANGE(T, 2) Q8_RANGE(T, 3) Q8_RANGE(T, 4) Q8_RANGE(T, 5) Q8_RANGE(T, 6) Q8_RANGE(T, 7)         \
        Q8_RANGE(T, 8)
#define Q8_TABLE_ROW(T)                                                                                              \
    {q8_range_##T##_1, q8_range_##T##_2, q8_range_##T##_3, q8_range_##T##_4, q8_range_##T##_5, q8_range_##T##_6,     \
     q8_range_##T##_7, q8_range_##T##_8}
Q8_RANGES(Q4_0)
Q8_RANGES(Q4_1)
Q8_RANGES(Q5_0)
Q8_RANGES(Q5_1)
Q8_RANGES(Q8_0)
Q8_RANGES(Q4_K)
Q8_RANGES(Q5_K)
Q8_RANGES(Q6_K)
Q8_RANGES(IQ4_NL)
Q8_RANGES(MXFP4)

/* the kernel specialised for `type` and M rows (1 <= M <= Q8_MAX_ROWS, type one of q8_type's) */
static q8_range_fn q8_kernel(int type, int M) {
    static const q8_range_fn table[][Q8_MAX_ROWS] = {
        Q8_TABLE_ROW(Q4_0), Q8_TABLE_ROW(Q4_1), Q8_TABLE_ROW(Q5_0), Q8_TABLE_ROW(Q5_1),   Q8_TABLE_ROW(Q8_0),
        Q8_TABLE_ROW(Q4_K), Q8_TABLE_ROW(Q5_K), Q8_TABLE_ROW(Q6_K), Q8_TABLE_ROW(IQ4_NL), Q8_TABLE_ROW(MXFP4)};
    const int t = type == Q4_0 ? 0 : type == Q4_1 ? 1 : type == Q5_0 ? 2 : type == Q5_1 ? 3 : type == Q8_0 ? 4
                : type == Q4_K ? 5 : type == Q5_K ? 6 : type == Q6_K ? 7 : type == IQ4_NL ? 8 : 9;
    return table[t][M - 1];
}

/* thread t of nt's share of the N weight rows (an even split, one specialised call each) */
static void q8_rows_share(const Q8Acts *a, int type, const uint8_t *w, void *y, int y_bf16, int y_stride, int N, int t,
                          int nt) {
    const int nb = a->K / 32;
    const size_t y_elem = y_bf16 ? sizeof(bf16) : sizeof(float);
    /* Q6_K's 8-row kernel runs out of registers (8 int32 sums and 8 float accumulators): 4 rows at a time measured
     * 10-20% faster from 8 rows up */
    const int group_rows = type == Q6_K ? 4 : Q8_MAX_ROWS;
    const int n0 = (int)((long)N * t / nt), n1 = (int)((long)N * (t + 1) / nt);
    /* more rows than one call takes: a tile of weight rows meets every group of rows while it is in L1 */
    const int tile = a->M <= group_rows ? n1 - n0 : Q8_TILE;
    for (int r0 = n0; r0 < n1; r0 += tile) {
        const int r1 = r0 + tile < n1 ? r0 + tile : n1;
        for (int m0 = 0; m0 < a->M; m0 += group_rows) {
            const int mm = a->M - m0 < group_rows ? a->M - m0 : group_rows;
            const Q8Acts group = {a->xq + (size_t)m0 * a->K, a->xd + (size_t)m0 * nb, a->xs + (size_t)m0 * nb,
                                  a->xb ? a->xb + (size_t)m0 * (a->K / 16) : NULL, mm, a->K};
            q8_kernel(type, mm)(&group, w, r0, r1, (char *)y + (size_t)m0 * y_stride * y_elem, y_bf16, y_stride);
        }
    }
}

/* the N weight rows split evenly over the threads of a team of their own */
static void q8_rows(const Q8Acts *a, int type, const uint8_t *w, void *y, int y_bf16, int y_stride, int N,
                    int num_threads) {
    _Pragma("omp parallel num_threads(num_threads)")
    q8_rows_share(a, type, w, y, y_bf16, y_stride, N, omp_get_thread_num(), omp_get_num_threads());
}

/* One group of a float32 row (`group` = 32 or 256 values) to int8 codes q = v * (127 / max|v|) rounded to nearest
 * even, its max |v| and each 32's code sum, eight values per instruction. */
AVX2 void q8_quantize_f32(const float *v, int group, int8_t *q, float *amax_out, int *sums) {
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < group; i += 8)
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(_mm256_set1_ps(-0.f), _mm256_loadu_ps(v + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int c = 0; c < group / 32; c++) {
        __m256i i32[4];
        for (int k = 0; k < 4; k++)
            i32[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 32 * c + 8 * k), inv));
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        sums[c] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
        /* the packs interleave the 128-bit halves: dwords a0 b0 c0 d0 a1 b1 c1 d1, put back in order */
        const __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        _mm256_storeu_si256((__m256i *)(q + 32 * c), _mm256_permutevar8x32_epi32(p8, order));
    }
    *amax_out = amax;
}
#endif

static int q8_type(int type) {
    return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K ||
           type == Q5_K || type == Q6_K || type == IQ4_NL || type == MXFP4;
}

/* 1 when this CPU runs gguf_q8_linear (AVX2, FMA, F16C), else 0 */
int gguf_q8_isa(void) {
#if defined(__x86_64__)
    return has_avx2();
#else
    return 0;
#endif
}

#if defined(__x86_64__)
/* the values that share one activation scale for `type`'s kernel: 32, or 256 for the K-quants */
static int q8_group(int type) { return type == Q4_K || type == Q5_K || type == Q6_K ? 256 : 32; }

/* M rows of activations quantized for `type`'s kernel, and the buffers the Q8Acts points into */
typedef struct {
    Q8Acts a;
    int8_t *xq;
    float *xd, *xs;
    int16_t *xb;
} Q8Buf;

/* The buffers of M rows of K quantized for `type` carved from `ws` (64-byte aligned pieces), or with ws NULL only
 * their bytes: xq int8 [M, K], xd and xs float [M, K / 32], and for Q6_K xb int16 [M, K / 16] */
static size_t q8_carve(Q8Buf *b, void *ws, int type, int M, int K) {
    const size_t bytes[4] = {(size_t)M * K, sizeof(float) * (size_t)M * (K / 32), sizeof(float) * (size_t)M * (K / 32),
                             type == Q6_K ? sizeof(int16_t) * (size_t)M * (K / 16) : 0};
    void *at[4];
    size_t total = 0;
    for (int i = 0; i < 4; i++) {
        at[i] = bytes[i] && ws ? (char *)ws + total : NULL;
        total += (bytes[i] + 63) / 64 * 64;
    }
    if (b) *b = (Q8Buf){{at[0], at[1], at[2], at[3], M, K}, at[0], at[1], at[2], at[3]};
    return total;
}

/* Row m of x (float32, or bfloat16 when x_bf16; rows x_stride apart) quantized into b: to int8 per 32, or per 256
 * for the K-quants (llama.cpp's Q8_K: one scale per 256 values, so a super-block's sub-blocks sum in int32; xd then
 * holds that scale in each of its 8 slots, xs each 32's integer sum, and for Q6_K xb each 16's) */
static void q8_prepare_row(const Q8Buf *b, const void *x, int x_bf16, int x_stride, int type, int K, int m) {
    const int nb = K / 32, group = q8_group(type);
    int8_t *xq = b->xq;
    float *xd = b->xd, *xs = b->xs;
    for (int g = 0; g < K / group; g++) {
        const int b0 = group / 32 * g;
        const size_t at = (size_t)m * x_stride + (size_t)group * g;
        float v[256], amax;
        int sums[8];
        if (x_bf16) /* bfloat16 rows widened first (exact) */
            for (int i = 0; i < group; i++) v[i] = load_x(x, 1, at + i);
        q8_quantize_f32(x_bf16 ? v : (const float *)x + at, group, xq + (size_t)m * K + 32 * b0, &amax, sums);
        for (int c = 0; c < group / 32; c++) {
            xd[m * nb + b0 + c] = amax / 127.f;
            xs[m * nb + b0 + c] = group == 32 ? xd[m * nb + b0 + c] * (float)sums[c] : (float)sums[c];
        }
    }
    if (b->xb)
        for (int i = 0; i < K / 16; i++) {
            int sum = 0;
            for (int e = 0; e < 16; e++) sum += xq[(size_t)m * K + 16 * i + e];
            b->xb[(size_t)m * (K / 16) + i] = (int16_t)sum;
        }
}

/* x [M, K] quantized for `type`'s kernel (q8_prepare_row) into buffers of its own; release with q8_release */
static Q8Buf q8_prepare(const void *x, int x_bf16, int x_stride, int type, int M, int K, int num_threads) {
    Q8Buf b;
    q8_carve(&b, aligned_alloc(64, q8_carve(NULL, NULL, type, M, K)), type, M, K);
    _Pragma("omp parallel for num_threads(num_threads) if (M > Q8_MAX_ROWS)")
    for (int m = 0; m < M; m++) q8_prepare_row(&b, x, x_bf16, x_stride, type, K, m);
    return b;
}

static void q8_release(Q8Buf *b) { free(b->xq); } /* the one allocation q8_carve split */
#endif

/* The bytes gguf_q8_linear_team takes from its `ws` for M rows of K, or -1 where gguf_q8_linear refuses the type,
 * the shape or the CPU */
long gguf_q8_acts_bytes(int type, int M, int K) {
#if defined(__x86_64__)
    if (!has_avx2() || !q8_type(type) || K % block_weights(type) || M < 1) return -1;
    return (long)q8_carve(NULL, NULL, type, M, K);
#else
    (void)type, (void)M, (void)K;
    return -1;
#endif
}

/* gguf_q8_linear by the calling thread's team: inside a parallel region every thread of the team calls it with the
 * same arguments (`ws` shared, gguf_q8_acts_bytes of it, 64-byte aligned). The team quantizes x's rows (shared out
 * statically, then a barrier), and each thread returns once its share of the weight rows is done, without waiting
 * for the others: y is whole, and ws free for the next product, after the team's next barrier. The same
 * arithmetic and split of the rows as gguf_q8_linear, which runs it on a team of its own; the caller has checked
 * what gguf_q8_acts_bytes checks. */
void gguf_q8_linear_team(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                         int y_stride, int M, int N, int K, void *ws) {
#if defined(__x86_64__)
    Q8Buf b;
    q8_carve(&b, ws, type, M, K);
    _Pragma("omp for schedule(static)")
    for (int m = 0; m < M; m++) q8_prepare_row(&b, x, x_bf16, x_stride, type, K, m);
    q8_rows_share(&b.a, type, w, y, y_bf16, y_stride, N, omp_get_thread_num(), omp_get_num_threads());
#else
    (void)x, (void)x_bf16, (void)x_stride, (void)w, (void)type, (void)y, (void)y_bf16, (void)y_stride, (void)M;
    (void)N, (void)K, (void)ws;
#endif
}

/* y = x W^T for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K blocks and M rows of x, with x quantized to int8
 * per 32 (the kernels take 8 rows at a time, past 8 over tiles of Q8_TILE weight rows). Returns -1 (nothing
 * written) for another type or shape, or without AVX2. */
int gguf_q8_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                   int y_stride, int M, int N, int K, int num_threads) {
#if defined(__x86_64__)
    if (gguf_q8_acts_bytes(type, M, K) < 0) return -1;
    Q8Buf b = q8_prepare(x, x_bf16, x_stride, type, M, K, num_threads);
    q8_rows(&b.a, type, w, y, y_bf16, y_stride, N, num_threads);
    q8_release(&b);
    return 0;
#else
    (void)x, (void)x_bf16, (void)x_stride, (void)w, (void)type, (void)y, (void)y_bf16, (void)y_stride, (void)M;
    (void)N, (void)K, (void)num_threads;
    return -1;
#endif
}

/* layer_ops.c's */
void silu_and_mul_float(const float *gate_up, float *out, int num_tokens, int inter, int num_threads);
void gelu_tanh_and_mul_float(const float *gate_up, float *out, int num_tokens, int inter, int num_threads);

/* o += (d + bias) w, each product rounded before the sum (no fused multiply-add), as torch's index_add_ of the
 * weighted outputs sums them in fused_moe.py's loop */
__attribute__((optimize("fp-contract=off"))) static void moe_accumulate(float *o, const float *d, const float *bias,
                                                                         float w, int n) {
    for (int c = 0; c < n; c++) o[c] += (bias ? d[c] + bias[c] : d[c]) * w;
}

#if defined(__x86_64__)
/* bytes of one expert's [rows, cols] weight: its GGUF blocks, or their R16 form */
static size_t expert_bytes(int r16, int type, int rows, int cols) {
    return r16 ? (size_t)gguf_r16_bytes(type, rows, cols)
               : (size_t)rows * (cols / block_weights(type)) * block_bytes(type);
}
#endif

/* A mixture-of-experts layer's routed experts for T tokens in one call: for each expert that tokens chose (in
 * expert order, as models/layers/fused_moe.py's loop), its tokens' rows of x gathered, gate and up, the activation,
 * down, then out[t] += topw (down + b2) for each of its tokens. SiLU(gate) up, or with `limit` > 0 gpt-oss's clamped
 * SwiGLU (clamp(up, -l, l) + 1) g sigmoid(alpha g) with g = min(gate, l) (vLLM's "swigluoai"), or with `geglu`
 * GELU_tanh(gate) up (Gemma 4's experts). The products take the kernel each expert's projection would take alone:
 * `r16` 0, the file's blocks on the AVX2 int8 kernels (activations quantized once where gate's and up's types share
 * a group); 1 or 2, R16 weights on the AVX512-VNNI kernel (r16_linear) on int16 or (2) int8 activations, AMX
 * tiles where gguf_amx_enable turned them on.
 *
 * x, out float32 [T, hidden]; ids int64 [T, top_k] (expert of each choice), topw float32 [T, top_k]; w_gate,
 * w_up: every expert's [inter, hidden] stacked (E * inter rows of GGUF blocks of t_gate, t_up, or their R16 form,
 * each expert a whole number of 16-row groups), w_down [hidden, inter] per expert (t_down); b13 float32 [E, 2 inter]
 * (gate | up) and b2 [E, hidden] or NULL. Returns -1 (nothing written) for a type or shape the kernels do not take,
 * or a CPU without AVX2 (AVX512-VNNI for R16). */
int gguf_moe(const float *x, int T, int hidden, const int64_t *ids, const float *topw, int top_k,
             const uint8_t *w_gate, int t_gate, const uint8_t *w_up, int t_up, const uint8_t *w_down, int t_down,
             int num_experts, int inter, const float *b13, const float *b2, float limit, float alpha, int geglu,
             int r16, float *out, int num_threads) {
#if defined(__x86_64__)
    if (T < 1 || hidden % block_weights(t_gate) || hidden % block_weights(t_up) || inter % block_weights(t_down))
        return -1;
    if (r16 ? !gguf_r16_takes(t_gate, r16 == 2) || !gguf_r16_takes(t_up, r16 == 2) || !gguf_r16_takes(t_down, r16 == 2) ||
                  inter % 16 ||
                  hidden % 16
            : !has_avx2() || !q8_type(t_gate) || !q8_type(t_up) || !q8_type(t_down))
        return -1;
    const size_t gate_bytes = expert_bytes(r16, t_gate, inter, hidden);
    const size_t up_bytes = expert_bytes(r16, t_up, inter, hidden), down_bytes = expert_bytes(r16, t_down, hidden, inter);
    const int pairs = T * top_k;
    /* the (token, choice) pairs grouped by expert, stably (a counting sort) */
    int *start = calloc((size_t)num_experts + 1, sizeof(int)), *order = malloc(sizeof(int) * (size_t)pairs);
    for (int p = 0; p < pairs; p++) start[ids[p] + 1]++;
    for (int e = 0; e < num_experts; e++) start[e + 1] += start[e];
    int *fill = malloc(sizeof(int) * (size_t)num_experts);
    memcpy(fill, start, sizeof(int) * (size_t)num_experts);
    for (int p = 0; p < pairs; p++) order[fill[ids[p]]++] = p;
    float *xe = malloc(sizeof(float) * (size_t)T * hidden), *gu = malloc(sizeof(float) * (size_t)T * 2 * inter);
    float *h = malloc(sizeof(float) * (size_t)T * inter), *d = malloc(sizeof(float) * (size_t)T * hidden);
    memset(out, 0, sizeof(float) * (size_t)T * hidden);
    for (int e = 0; e < num_experts; e++) {
        const int n = start[e + 1] - start[e];
        if (!n) continue;
        const int *mine = order + start[e];
        for (int i = 0; i < n; i++) memcpy(xe + (size_t)i * hidden, x + (size_t)(mine[i] / top_k) * hidden,
                                           sizeof(float) * (size_t)hidden);
        if (r16) {
            r16_linear(xe, 0, hidden, w_gate + e * gate_bytes, t_gate, gu, 0, 2 * inter, n, inter, hidden, num_threads,
                       r16 == 2);
            r16_linear(xe, 0, hidden, w_up + e * up_bytes, t_up, gu + inter, 0, 2 * inter, n, inter, hidden,
                       num_threads, r16 == 2);
        } else {
            Q8Buf qg = q8_prepare(xe, 0, hidden, t_gate, n, hidden, num_threads);
            q8_rows(&qg.a, t_gate, w_gate + e * gate_bytes, gu, 0, 2 * inter, inter, num_threads);
            if (q8_group(t_up) == q8_group(t_gate) && (t_up != Q6_K || qg.xb)) { /* up reads gate's prepare */
                q8_rows(&qg.a, t_up, w_up + e * up_bytes, gu + inter, 0, 2 * inter, inter, num_threads);
            } else {
                Q8Buf qu = q8_prepare(xe, 0, hidden, t_up, n, hidden, num_threads);
                q8_rows(&qu.a, t_up, w_up + e * up_bytes, gu + inter, 0, 2 * inter, inter, num_threads);
                q8_release(&qu);
            }
            q8_release(&qg);
        }
        if (b13) /* gate_up + bias first, as the loop adds it before the activation */
            for (int i = 0; i < n; i++)
                for (int j = 0; j < 2 * inter; j++) gu[(size_t)i * 2 * inter + j] += b13[(size_t)e * 2 * inter + j];
        if (geglu) /* layer_ops.c's activations, so that the result is the per-expert loop's bit for bit */
            gelu_tanh_and_mul_float(gu, h, n, inter, num_threads);
        else if (limit <= 0.f)
            silu_and_mul_float(gu, h, n, inter, num_threads);
        for (int i = 0; i < n && limit > 0.f; i++) { /* gpt-oss's clamped SwiGLU */
            const float *g = gu + (size_t)i * 2 * inter, *u = g + inter;
            for (int j = 0; j < inter; j++) {
                const float a = fminf(g[j], limit), b = fminf(fmaxf(u[j], -limit), limit);
                h[(size_t)i * inter + j] = (b + 1.f) * a / (1.f + expf(fminf(-alpha * a, 88.f)));
            }
        }
        if (r16) {
            r16_linear(h, 0, inter, w_down + e * down_bytes, t_down, d, 0, hidden, n, hidden, inter, num_threads,
                       r16 == 2);
        } else {
            Q8Buf qh = q8_prepare(h, 0, inter, t_down, n, inter, num_threads);
            q8_rows(&qh.a, t_down, w_down + e * down_bytes, d, 0, hidden, hidden, num_threads);
            q8_release(&qh);
        }
        const float *bd = b2 ? b2 + (size_t)e * hidden : NULL;
        for (int i = 0; i < n; i++) {
            const int p = mine[i];
            moe_accumulate(out + (size_t)(p / top_k) * hidden, d + (size_t)i * hidden, bd, topw[p], hidden);
        }
    }
    free(start), free(order), free(fill), free(xe), free(gu), free(h), free(d);
    return 0;
#else
    (void)x, (void)T, (void)hidden, (void)ids, (void)topw, (void)top_k, (void)w_gate, (void)t_gate, (void)w_up;
    (void)t_up, (void)w_down, (void)t_down, (void)num_experts, (void)inter, (void)b13, (void)b2, (void)limit;
    (void)alpha, (void)geglu, (void)r16, (void)out, (void)num_threads;
    return -1;
#endif
}
