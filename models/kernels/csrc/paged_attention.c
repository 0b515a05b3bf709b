/* Paged attention on the CPU for a whole engine step: writes the step's new K/V into the paged cache,
 * then runs every row (decodes and prefill chunks alike), reading K/V in place through the block table.
 *
 * Layouts. q, out: [num_tokens, num_heads, head_dim] with a row stride per token (q may be a view of
 * the fused qkv tensor); k, v (new): [num_tokens, num_kv_heads, head_dim], row strides likewise.
 * k_cache, v_cache: [num_blocks, num_kv_heads, block_size, head_dim] ("HND": one head's keys of one
 * block are contiguous, so a task streams whole 2 KiB runs instead of every num_kv_heads-th row).
 * block_tables int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs] (cached + new tokens);
 * query_start_loc int32 [num_seqs + 1]; slot_mapping int64 [num_tokens] (block * block_size + offset).
 * Query j of a sequence with q new tokens and n in all sits at position p = n - q + j and sees keys
 * 0 .. p (causal), or with a sliding window W > 0 keys p - W + 1 .. p: a task starts at the first key
 * its tile's first query sees, so keys that have left the window are never read. A soft cap c > 0 turns
 * each scaled score s into c * tanh(s / c) (Gemma 2; the portable path computes it). `sinks` (NULL for none):
 * float32 [num_heads], gpt-oss's attention sinks, a logit per query head added to each row's softmax denominator
 * (the probabilities then sum to less than one; applied when a row's output is written, so every ISA path has it).
 *
 * Work. A task is (sequence, kv head, tile of up to QT query positions): it computes all G query heads
 * of the kv head's GQA group for those positions, so each K/V row is read once for G * QT query rows.
 * Keys are consumed in chunks of up to 16 (never crossing a block) with the online softmax of
 * FlashAttention (Dao et al. 2022): no score row is stored, K and V are each read once. When a step has
 * fewer tasks than threads can share (batch 1), each task's keys are split into partitions that run in
 * parallel and are merged by their log-sum-exp (flash-decoding, Dao et al. 2023). A decode step (one query a
 * sequence) runs a sequence's tasks, every kv head, as one unit (attention_heads_mode), its keys split alike.
 *
 * ISA. bfloat16 with head_dim 64 or 128 takes an AVX-512 path when the CPU has AVX512-BF16 (checked at
 * run time; `isa` 0 forces the portable path): scores from _mm512_dpbf16_ps over keys transposed into
 * bfloat16 pairs (16 scores per register, no horizontal sums), a vector exp, and accumulators kept in
 * registers for blocks of up to RB query rows; so do quantized caches of those head sizes, each chunk's keys and
 * values first turned into bfloat16 rows (queries rounded to bfloat16 under float32 activations). float32 with
 * head_dim 64, 128 or 256 takes an AVX-512 path on any AVX512F CPU, else an AVX2 one (keys read in place, 16 or 8
 * scores per register, a vector exp); so do quantized caches on a CPU without AVX512-BF16 (or of head_dim 256), each
 * chunk turned into float rows (int8 times its scale; fp8 through bfloat16 lookups on AVX-512, float16 on AVX2). The
 * portable path is
 * plain C that the compiler vectorizes, for other head sizes, soft caps and CPUs without those extensions.
 * Accumulation is float32 throughout.
 *
 * Quantized caches (`paged_attention_{float,bf16}_q`, vLLM's --kv-cache-dtype): the cache holds bytes, each
 * K or V row of a head `row` bytes: kvq 1 = int8 as llama.cpp's q8_0 (D int8 values, then D / 32 float32
 * scales, one per 32 values: x = q * scale, scale = max|x| / 127), kvq 2 = fp8 e4m3 ("fn": max 448, no
 * infinities), kvq 3 = fp8 e5m2 (max 57344); fp8 values saturate at the format's largest finite value, as
 * vLLM's conversions do, and round to nearest even. The new K/V are quantized as they are written; each
 * chunk of 16 keys is dequantized into a small per-thread buffer, so the cache is read in place, never copied
 * whole.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define MAX_HEAD_DIM 512 /* Gemma 4's global layers */
/* QT: query positions per task (8: a 512-token prompt's attention 8% slower, each chunk's keys transposed and
 * values interleaved for half as many rows) */
#define QT 16
#define MAX_ROWS 128 /* query rows per task: group size * QT positions, at most */
#define CHUNK 16     /* keys per online-softmax step */
#define MIN_PART 256 /* keys per partition when a task's keys are split */
#define AVX_BF16 2   /* a quantized cache's chunks dequantized to bfloat16 for the AVX512-BF16 step (1: float, AVX2) */
/* "minus infinity" for masked scores and empty maxima: finite, because -ffast-math assumes no infinities */
#define NEG_INF (-1e30f)
#define IS_NEG_INF(x) ((x) <= 0.5f * NEG_INF)

#include "bf16.h"
#include "hfold.h"
#include "vexp.h" /* exp512 (softmax arguments <= 0, up to LAZY_MAX above it in the chunks) */

/* Per-task state: rows r = j * G + g (tile position j, head g of the group). */
typedef struct {
    int R, G, D;       /* rows, group size, head dim */
    int row;           /* cache elements per K or V row of a head: D, or a quantized row's bytes */
    int kvq;           /* the cache's quantization: 0 none, 1 int8 (q8_0), 2 fp8 e4m3, 3 fp8 e5m2 */
    int first_pos;     /* absolute position of the tile's first query */
    int window;        /* sliding window in keys, 0 = none */
    float scale;
    float softcap;     /* 0 = none */
    float m[MAX_ROWS]; /* running max of each row's scores */
    float l[MAX_ROWS]; /* running sum of exp(score - m) (the AVX-512 chunks': in lv until unpermute_acc) */
    float *lv;         /* [R, 16] the AVX-512 chunks' l per lane, summed into l by unpermute_acc */
    float *acc;        /* [R, D] running sum of exp(score - m) * v */
    float *qf;         /* [R, D] queries in float32 (portable path) */
    const bf16 *qb[MAX_ROWS]; /* query rows in bfloat16 (AVX512-BF16 path) */
} Task;

/* Online-softmax update of every row with one chunk's scores s[r][0..n) (already scaled; rows that
 * cannot see key t have s = NEG_INF), then acc += p @ vf, where vf [n, D] is the chunk's values. */
static inline void softmax_update(Task *tk, float s[][CHUNK], int n, const float *vf) {
    const int D = tk->D;
    for (int r = 0; r < tk->R; r++) {
        float mx = tk->m[r];
        for (int t = 0; t < n; t++) mx = s[r][t] > mx ? s[r][t] : mx;
        if (IS_NEG_INF(mx)) continue; /* the row sees none of these keys */
        const float alpha = IS_NEG_INF(tk->m[r]) ? 0.f : expf(tk->m[r] - mx);
        float sum = 0.f;
        for (int t = 0; t < n; t++) {
            s[r][t] = IS_NEG_INF(s[r][t]) ? 0.f : expf(s[r][t] - mx);
            sum += s[r][t];
        }
        tk->m[r] = mx;
        tk->l[r] = tk->l[r] * alpha + sum;
        float *acc = tk->acc + (size_t)r * D;
        for (int d = 0; d < D; d++) acc[d] *= alpha;
        for (int t = 0; t < n; t++) {
            const float p = s[r][t];
            const float *vr = vf + (size_t)t * D;
            for (int d = 0; d < D; d++) acc[d] += p * vr[d];
        }
    }
}

/* A scaled score through the soft cap, if any. */
static inline float capped(const Task *tk, float s) { return tk->softcap > 0.f ? tk->softcap * tanhf(s / tk->softcap) : s; }

/* Whether the query at position qpos sees the key at kpos: causal, and within the window if any. */
static inline int sees(const Task *tk, int qpos, int kpos) {
    return kpos <= qpos && (tk->window == 0 || kpos > qpos - tk->window);
}

#define LOAD_ROWS(T, CONVERT)                                                                          \
    static inline void load_rows_##T(const T *src, int n, int D, float *dst) {                         \
        for (int t = 0; t < n; t++)                                                                    \
            for (int d = 0; d < D; d++) dst[(size_t)t * D + d] = CONVERT(src[(size_t)t * D + d]);      \
    }
static inline float f32_id(float x) { return x; }
LOAD_ROWS(float, f32_id)
LOAD_ROWS(bf16, bf16_to_f32)

/* The scaled (and capped) scores s[r][0..n) of every row against n keys kf [n, D] in float32. */
static inline void chunk_scores(const Task *tk, const float *kf, int pos0, int n, float s[][CHUNK]) {
    const int D = tk->D;
    for (int r = 0; r < tk->R; r++) {
        const float *q = tk->qf + (size_t)r * D;
        const int qpos = tk->first_pos + r / tk->G;
        for (int t = 0; t < n; t++) {
            float dot = 0.f;
            const float *kr = kf + (size_t)t * D;
            for (int d = 0; d < D; d++) dot += q[d] * kr[d];
            s[r][t] = sees(tk, qpos, pos0 + t) ? capped(tk, dot * tk->scale) : NEG_INF;
        }
    }
}

/* Portable chunk step: scores from float32 copies of the chunk's keys. */
#define CHUNK_PORTABLE(T)                                                                              \
    static void chunk_portable_##T(Task *tk, const T *kp, const T *vp, int pos0, int n, float *kvf) {  \
        float s[MAX_ROWS][CHUNK];                                                                      \
        load_rows_##T(kp, n, tk->D, kvf);                                                              \
        chunk_scores(tk, kvf, pos0, n, s);                                                             \
        load_rows_##T(vp, n, tk->D, kvf);                                                              \
        softmax_update(tk, s, n, kvf);                                                                 \
    }
CHUNK_PORTABLE(float)
CHUNK_PORTABLE(bf16)

/* fp8 -> float32, a table per format, filled once (kvq_init); FP8_BF16[f][c] the bfloat16 bits of code c < 128
 * (the sign apart) of format f (0 e4m3, 1 e5m2): exact, an fp8 value having at most 3 mantissa bits. */
static float FP8_E4M3[256], FP8_E5M2[256];
static uint16_t FP8_BF16[2][128];

__attribute__((constructor)) static void kvq_init(void) {
    for (int c = 0; c < 256; c++) {
        const int sign = c >> 7, e4 = (c >> 3) & 15, m3 = c & 7, e5 = (c >> 2) & 31, m2 = c & 3;
        float a = e4 ? ldexpf(1.f + m3 / 8.f, e4 - 7) : ldexpf(m3 / 8.f, -6); /* 0x7F, 0xFF (NaN) never written */
        FP8_E4M3[c] = sign ? -a : a;
        a = e5 ? ldexpf(1.f + m2 / 4.f, e5 - 15) : ldexpf(m2 / 4.f, -14);
        FP8_E5M2[c] = sign ? -a : a;
    }
    for (int c = 0; c < 128; c++) {
        uint32_t bits[2];
        memcpy(&bits[0], &FP8_E4M3[c], sizeof(float));
        memcpy(&bits[1], &FP8_E5M2[c], sizeof(float));
        FP8_BF16[0][c] = (uint16_t)(bits[0] >> 16), FP8_BF16[1][c] = (uint16_t)(bits[1] >> 16);
    }
}

/* The fp8 code nearest to x (ties to the even code), saturated at the largest finite one: a binary search
 * over the increasing positive codes 0 .. top. */
static inline uint8_t fp8_encode(float x, const float *table, int top) {
    const float a = fabsf(x);
    int lo = 0, hi = top; /* the largest code with table[code] <= a */
    if (!(a < table[top])) lo = top; /* saturate (NaN too) */
    else
        while (lo < hi) {
            const int mid = (lo + hi + 1) / 2;
            if (table[mid] <= a) lo = mid;
            else hi = mid - 1;
        }
    int c = lo;
    if (c < top) {
        const float below = a - table[c], above = table[c + 1] - a;
        if (above < below || (above == below && (c & 1))) c++;
    }
    return (uint8_t)(c | (x < 0.f ? 0x80 : 0));
}

#if defined(__x86_64__)
/* FP8_BF16's 128 entries of format kvq (2 e4m3, 3 e5m2) in four registers, for fp8_bf16_32 */
__attribute__((target("avx512f,avx512bw"))) static inline void fp8_tables(int kvq, __m512i t[4]) {
    for (int i = 0; i < 4; i++) t[i] = _mm512_loadu_si512(FP8_BF16[kvq == 2 ? 0 : 1] + 32 * i);
}

/* The bfloat16 bits of 32 fp8 codes, zero-extended to words in w (AVX512BW, no AVX512-BF16): their format's table t
 * (fp8_tables) looked up by two _mm512_permutex2var_epi16, the sign bit moved across */
__attribute__((target("avx512f,avx512bw"))) static inline __m512i fp8_bf16_32(__m512i w, const __m512i t[4]) {
    const __m512i lo = _mm512_permutex2var_epi16(t[0], w, t[1]), hi = _mm512_permutex2var_epi16(t[2], w, t[3]);
    const __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(w, _mm512_set1_epi16(0x40)), lo, hi);
    return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(w, _mm512_set1_epi16(0x80)), 8));
}

/* fp8_encode of 16 values at once (AVX-512), the same codes: the float's mantissa rounded to the format's M bits to
 * nearest even by an integer add on its bits (the carry moving the exponent), its exponent rebiased; below the
 * smallest normal the step count round(|x| / step), to nearest even; at or past the largest finite value (or NaN)
 * that value's code; the sign bit where x < 0. A decode step writes 2 x num_kv_heads rows a layer, and the binary
 * search took ~3% of a batch-1 step at depth 4,000. */
__attribute__((target("avx512f,avx512bw"))) static void fp8_encode16(const float *x, uint8_t *dst, int kvq) {
    const int M = kvq == 2 ? 3 : 2, bias = kvq == 2 ? 7 : 15, top = kvq == 2 ? 0x7E : 0x7B;
    const float max = kvq == 2 ? 448.f : 57344.f, min_normal = kvq == 2 ? 0x1p-6f : 0x1p-14f;
    const float per_step = kvq == 2 ? 512.f : 65536.f; /* 1 / the subnormal step */
    const __m512 v = _mm512_loadu_ps(x), a = _mm512_abs_ps(v);
    const __m512i bits = _mm512_castps_si512(a), S = _mm512_set1_epi32(23 - M);
    const __m512i lsb = _mm512_and_si512(_mm512_srlv_epi32(bits, S), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32((1 << (22 - M)) - 1), lsb));
    __m512i code = _mm512_sub_epi32(_mm512_srlv_epi32(r, S), _mm512_set1_epi32((127 - bias) << M));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(min_normal), _CMP_LT_OQ),
                                 _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(per_step))));
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(a, _mm512_set1_ps(max), _CMP_NLT_UQ), _mm512_set1_epi32(top));
    code = _mm512_mask_or_epi32(code, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ), code,
                                _mm512_set1_epi32(0x80));
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtepi32_epi8(code));
}
#endif

/* Bytes of one quantized K or V row of D values (D % 32 == 0 for int8). */
static inline int kvq_row_bytes(int D, int kvq) { return kvq == 1 ? D + D / 32 * (int)sizeof(float) : D; }

/* One row of D float32 values into its quantized bytes. */
static void kvq_store(uint8_t *dst, const float *x, int D, int kvq) {
    if (kvq == 1) {
        for (int b = 0; b < D / 32; b++) {
            float amax = 0.f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(x[32 * b + i]));
            const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            for (int i = 0; i < 32; i++) ((int8_t *)dst)[32 * b + i] = (int8_t)nearbyintf(x[32 * b + i] * inv);
            memcpy(dst + D + b * sizeof(float), &scale, sizeof(float));
        }
    } else {
        const float *table = kvq == 2 ? FP8_E4M3 : FP8_E5M2;
        const int top = kvq == 2 ? 0x7E : 0x7B;
        int d = 0;
#if defined(__x86_64__)
        if (__builtin_cpu_supports("avx512bw"))
            for (; d + 16 <= D; d += 16) fp8_encode16(x + d, dst + d, kvq);
#endif
        for (; d < D; d++) dst[d] = fp8_encode(x[d], table, top);
    }
}

/* n quantized rows (each `row` bytes apart) into float32 [n, D]. */
static void kvq_load(const uint8_t *src, int n, int D, int row, int kvq, float *dst) {
    for (int t = 0; t < n; t++) {
        const uint8_t *r = src + (size_t)t * row;
        float *o = dst + (size_t)t * D;
        if (kvq == 1) {
            for (int b = 0; b < D / 32; b++) {
                float scale;
                memcpy(&scale, r + D + b * sizeof(float), sizeof(float));
                for (int i = 0; i < 32; i++) o[32 * b + i] = ((const int8_t *)r)[32 * b + i] * scale;
            }
        } else {
            const float *table = kvq == 2 ? FP8_E4M3 : FP8_E5M2;
            for (int d = 0; d < D; d++) o[d] = table[r[d]];
        }
    }
}

/* Portable chunk step over a quantized cache: each chunk's keys, then its values, dequantized in turn. */
static void chunk_portable_uint8_t(Task *tk, const uint8_t *kp, const uint8_t *vp, int pos0, int n, float *kvf) {
    float s[MAX_ROWS][CHUNK];
    kvq_load(kp, n, tk->D, tk->row, tk->kvq, kvf);
    chunk_scores(tk, kvf, pos0, n, s);
    kvq_load(vp, n, tk->D, tk->row, tk->kvq, kvf);
    softmax_update(tk, s, n, kvf);
}

#if defined(__x86_64__)
/* Values d..d+7 of a quantized row r (D int8 or fp8 codes, then int8's D / 32 scales) in float32, with AVX2 and
 * F16C: int8 times its per-32 scale; fp8 through float16, whose bits it is moved into: e5m2 is a float16's top byte,
 * e4m3's exponent and mantissa sit 8 exponent steps low (times 2^8 after the conversion, subnormals included).
 * Exact: every value is representable on the way. */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 kvq_row8(const uint8_t *r, int D, int d, int kvq) {
    const __m128i b = _mm_loadl_epi64((const __m128i *)(r + d));
    if (kvq == 1) {
        float scale;
        memcpy(&scale, r + D + d / 32 * sizeof(float), sizeof(float));
        return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_set1_ps(scale));
    }
    if (kvq == 2) {
        const __m128i w = _mm_cvtepu8_epi16(b);
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                       _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    }
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8));
}

#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* In place: r[j] (16 x 32-bit each) becomes column j of the 16 x 16 matrix whose rows were r[0..15] (AVX512F alone:
 * the bfloat16 steps and the float32 prompt step, chunkt_avx512f, take it). */
__attribute__((target("avx512f"))) static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    /* u[4g + m], lane L: rows 4g..4g+3 at column 4L + m */
    for (int g = 0; g < 4; g++) {
        u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    /* column 4L + m gathers lane L of u[m], u[4 + m], u[8 + m], u[12 + m]: a 4 x 4 transpose of lanes */
    for (int m = 0; m < 4; m++) {
        const __m512i x0 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0x44), x1 = _mm512_shuffle_i32x4(u[m], u[4 + m], 0xEE);
        const __m512i x2 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0x44);
        const __m512i x3 = _mm512_shuffle_i32x4(u[8 + m], u[12 + m], 0xEE);
        r[m] = _mm512_shuffle_i32x4(x0, x2, 0x88);
        r[4 + m] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        r[8 + m] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        r[12 + m] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
}

/* independent dot-product chains per query row for a chunk's scores, added at the end: one chain of NP dependent
 * _mm512_dpbf16_ps waited on their latency (a decode step at depth 4,000: 3.45-3.6 ms of attention against
 * 2.98-3.01 with 4 chains, fp8 cache; 4.28-4.49 against 3.35-3.79 bfloat16; scripts/bench_attention.py) */
#define SCORE_CHAINS 4
#define LAZY_MAX 8.f /* natural-log units a score may pass a row's running max before it moves */

/* Pairs p0 .. p0 + 15 of a chunk's n keys [n, D] as bfloat16 pairs of all 16 keys: kt[i] = pair p0 + i (dims 2(p0 +
 * i), 2(p0 + i) + 1) of keys 0..15, zero past n */
AVX512BF16 static inline void chunk_keys_t(const bf16 *kp, int D, int n, int p0, __m512i kt[16]) {
    for (int t = 0; t < 16; t++) kt[t] = t < n ? _mm512_loadu_si512(kp + (size_t)t * D + 2 * p0) : _mm512_setzero_si512();
    transpose16(kt);
}

/* The values of keys 2q, 2q + 1 of a chunk's n [n, D], dims 32c .. 32c + 31, interleaved for _mm512_dpbf16_ps: *lo
 * the low half of each 128-bit lane (v = 2c of unpermute_acc's order), *hi the high half (v = 2c + 1) */
AVX512BF16 static inline void chunk_values_pair(const bf16 *vp, int D, int n, int q, int c, __m512i *lo, __m512i *hi) {
    const __m512i a = _mm512_loadu_si512(vp + (size_t)(2 * q) * D + 32 * c);
    const __m512i b = 2 * q + 1 < n ? _mm512_loadu_si512(vp + (size_t)(2 * q + 1) * D + 32 * c) : _mm512_setzero_si512();
    *lo = _mm512_unpacklo_epi16(a, b);
    *hi = _mm512_unpackhi_epi16(a, b);
}

/* Each row's scores s[j] from its SCORE_CHAINS dot-product chains s2[c][j], added in chain order */
#define JOIN_CHAINS(RB)                                                                                \
    for (int j = 0; j < RB; j++) {                                                                     \
        s[j] = s2[0][j];                                                                               \
        for (int c = 1; c < SCORE_CHAINS; c++) s[j] = _mm512_add_ps(s[j], s2[c][j]);                   \
    }

/* A chunk's online-softmax step for rows row[0 .. RB) (r0 the first; rows past R repeat the last one and are
 * dropped) from their scores s[RB] (16 keys each): each row's weights e = exp(s - m) into pw as bfloat16 pairs, l
 * (per lane, lv) and m updated, and the rows' accumulators acc[RB][NV] loaded, rescaled where a max moved. Inside
 * CHUNK_AVX512 and CHUNK1_AVX512, whose locals it reads (tk, live, key_pos, scale, neg) and declares (pw, acc). */
#define CHUNK_SOFTMAX(D, RB)                                                                           \
            /* each row's rescale exp(m_old - m_new), all RB rows in one vector exp after the loop (a scalar expf \
             * a row and chunk cost a prompt's attention ~20%) */                                        \
            float alpha[16] = {0};                                                                     \
            __m512 e[RB]; /* each row's weights exp(s - m), its sum added per lane to lv */               \
            __mmask16 fresh = 0; /* rows with no max before this chunk: alpha 0 */                     \
            int moved = 0;       /* a row's max moved: rescale (else every alpha is 1) */              \
            int32_t pw[RB][CHUNK / 2]; /* bfloat16 weight pairs of keys 2q, 2q + 1 */                  \
            for (int j = 0; j < RB; j++) {                                                             \
                const int r = row[j], qpos = tk->first_pos + r / tk->G;                                \
                const __mmask16 seen = live & _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(qpos)) \
                    & _mm512_cmpgt_epi32_mask(key_pos, _mm512_set1_epi32(tk->window ? qpos - tk->window : -1)); \
                e[j] = _mm512_setzero_ps();                                                            \
                _mm256_storeu_si256((__m256i *)pw[j], _mm256_setzero_si256());                        \
                if (!seen || r0 + j >= tk->R) continue;                                                \
                const __m512 sc = _mm512_mask_mov_ps(neg, seen, _mm512_mul_ps(s[j], scale));           \
                /* the running max moves only when a score passes it by LAZY_MAX (FlashAttention-4's lazy  \
                 * rescaling): no reduction and no rescale in most chunks; l and acc then hold the weights    \
                 * exp(s - m) <= e^LAZY_MAX, with the same m, so acc / l is unchanged */                     \
                const float mx = _mm512_cmp_ps_mask(sc, _mm512_set1_ps(tk->m[r] + LAZY_MAX), _CMP_GT_OQ)  \
                                     ? fmaxf(tk->m[r], _mm512_reduce_max_ps(sc))                       \
                                     : tk->m[r];                                                       \
                e[j] = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));      \
                if (IS_NEG_INF(tk->m[r])) fresh |= (__mmask16)(1u << j);                               \
                else alpha[j] = tk->m[r] - mx;                                                         \
                moved |= mx != tk->m[r];                                                               \
                tk->m[r] = mx;                                                                         \
                _mm256_storeu_si256((__m256i *)pw[j], (__m256i)_mm512_cvtneps_pbh(e[j]));              \
            }                                                                                          \
            __m512 acc[RB][NV];                                                                        \
            if (moved) {                                                                               \
                _mm512_storeu_ps(alpha, _mm512_maskz_mov_ps((__mmask16)~fresh, exp512(_mm512_loadu_ps(alpha)))); \
                for (int j = 0; j < RB && r0 + j < tk->R; j++) {                                       \
                    float *lv = tk->lv + 16 * row[j];                                                  \
                    _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), _mm512_set1_ps(alpha[j]), e[j])); \
                }                                                                                      \
                for (int j = 0; j < RB; j++)                                                           \
                    for (int c = 0; c < NV; c++)                                                       \
                        acc[j][c] = _mm512_mul_ps(_mm512_loadu_ps(tk->acc + (size_t)row[j] * D + 16 * c), \
                                                  _mm512_set1_ps(alpha[j]));                           \
            } else {                                                                                   \
                for (int j = 0; j < RB && r0 + j < tk->R; j++) {                                       \
                    float *lv = tk->lv + 16 * row[j];                                                  \
                    _mm512_storeu_ps(lv, _mm512_add_ps(_mm512_loadu_ps(lv), e[j]));                    \
                }                                                                                      \
                for (int j = 0; j < RB; j++)                                                           \
                    for (int c = 0; c < NV; c++) acc[j][c] = _mm512_loadu_ps(tk->acc + (size_t)row[j] * D + 16 * c); \
            }

/* AVX512-BF16 chunk step for head_dim D (64 or 128), RB query rows at a time. The chunk's keys are
 * transposed into bfloat16 pairs (kt[p] = pair p of all 16 keys), so one dot-product sweep over a query
 * row gives its 16 scores in one register (products exact, sums float32) with no horizontal sums; the
 * softmax runs on those registers; then P V is again dot products of bfloat16 pairs, weights of two
 * keys against their interleaved values, into RB rows x D float32 accumulators held in registers
 * (P in bfloat16 for P V, as FlashAttention does). The transposed keys and interleaved values are made once for
 * all the passes over the rows (a prompt tile's G x QT rows); CHUNK1_AVX512 takes rows that fit one pass. */
#define CHUNK_AVX512(D, RB)                                                                            \
    AVX512BF16 static void chunk_avx512_##D##_##RB(Task *tk, const bf16 *kp, const bf16 *vp, int pos0, int n) { \
        enum { NV = D / 16, NP = D / 2 };                                                              \
        __m512i kt[NP];                                                                                \
        const __mmask16 live = (__mmask16)((1u << n) - 1);                                             \
        for (int p0 = 0; p0 < NP; p0 += 16) chunk_keys_t(kp, D, n, p0, kt + p0);                       \
        __m512i vv[CHUNK / 2][NV];                                                                     \
        for (int q = 0; q < (n + 1) / 2; q++)                                                          \
            for (int c = 0; c < NV / 2; c++) chunk_values_pair(vp, D, n, q, c, &vv[q][2 * c], &vv[q][2 * c + 1]); \
        const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(pos0),                              \
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));                   \
        const __m512 scale = _mm512_set1_ps(tk->scale), neg = _mm512_set1_ps(NEG_INF);                 \
        for (int r0 = 0; r0 < tk->R; r0 += RB) {                                                       \
            int row[RB]; /* rows past R repeat the last one; their results are dropped */              \
            for (int j = 0; j < RB; j++) row[j] = r0 + j < tk->R ? r0 + j : tk->R - 1;                 \
            __m512 s[RB], s2[SCORE_CHAINS][RB]; /* SCORE_CHAINS chains of dot products a row, joined after */            \
            for (int j = 0; j < RB; j++)                                                               \
                for (int c = 0; c < SCORE_CHAINS; c++) s2[c][j] = _mm512_setzero_ps();                        \
            for (int p = 0; p < NP; p += SCORE_CHAINS)                                                        \
                for (int c = 0; c < SCORE_CHAINS; c++)                                                        \
                    for (int j = 0; j < RB; j++)                                                       \
                        s2[c][j] = _mm512_dpbf16_ps(                                                   \
                            s2[c][j], (__m512bh)_mm512_set1_epi32(((const int32_t *)tk->qb[row[j]])[p + c]), \
                            (__m512bh)kt[p + c]);                                                      \
            JOIN_CHAINS(RB)                                                                            \
            CHUNK_SOFTMAX(D, RB)                                                                       \
            for (int q = 0; q < (n + 1) / 2; q++)                                                      \
                for (int j = 0; j < RB; j++) {                                                         \
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(pw[j][q]);                          \
                    for (int v = 0; v < NV; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], w, (__m512bh)vv[q][v]); \
                }                                                                                      \
            for (int j = 0; j < RB && r0 + j < tk->R; j++)                                             \
                for (int c = 0; c < NV; c++) _mm512_storeu_ps(tk->acc + (size_t)(r0 + j) * D + 16 * c, acc[j][c]); \
        }                                                                                              \
    }

/* CHUNK_AVX512 for exactly RB rows, one pass (a decode step's GQA group): the keys are transposed 16 pairs at a time
 * and each is used as it is made, and each pair of values is interleaved where P V takes it, so no chunk-sized array
 * of registers is kept: the one-pass form above spilled its 64 (kt and vv) to the stack and back every chunk. The
 * same dot products in the same order, so the same result bit for bit. */
#define CHUNK1_AVX512(D, RB)                                                                           \
    AVX512BF16 static void chunk1_avx512_##D##_##RB(Task *tk, const bf16 *kp, const bf16 *vp, int pos0, int n) { \
        enum { NV = D / 16, NP = D / 2 };                                                              \
        const __mmask16 live = (__mmask16)((1u << n) - 1);                                             \
        const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(pos0),                              \
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));                   \
        const __m512 scale = _mm512_set1_ps(tk->scale), neg = _mm512_set1_ps(NEG_INF);                 \
        const int r0 = 0;                                                                              \
        int row[RB];                                                                                   \
        for (int j = 0; j < RB; j++) row[j] = j;                                                       \
        __m512 s[RB], s2[SCORE_CHAINS][RB];                                                            \
        for (int j = 0; j < RB; j++)                                                                   \
            for (int c = 0; c < SCORE_CHAINS; c++) s2[c][j] = _mm512_setzero_ps();                     \
        for (int p0 = 0; p0 < NP; p0 += 16) {                                                          \
            __m512i kt[16];                                                                            \
            chunk_keys_t(kp, D, n, p0, kt);                                                            \
            for (int p = 0; p < 16; p += SCORE_CHAINS)                                                 \
                for (int c = 0; c < SCORE_CHAINS; c++)                                                 \
                    for (int j = 0; j < RB; j++)                                                       \
                        s2[c][j] = _mm512_dpbf16_ps(                                                   \
                            s2[c][j], (__m512bh)_mm512_set1_epi32(((const int32_t *)tk->qb[j])[p0 + p + c]), \
                            (__m512bh)kt[p + c]);                                                      \
        }                                                                                              \
        JOIN_CHAINS(RB)                                                                                \
        CHUNK_SOFTMAX(D, RB)                                                                           \
        for (int q = 0; q < (n + 1) / 2; q++)                                                          \
            for (int c = 0; c < NV / 2; c++) {                                                         \
                __m512i lo, hi;                                                                        \
                chunk_values_pair(vp, D, n, q, c, &lo, &hi);                                           \
                for (int j = 0; j < RB; j++) {                                                         \
                    const __m512bh w = (__m512bh)_mm512_set1_epi32(pw[j][q]);                          \
                    acc[j][2 * c] = _mm512_dpbf16_ps(acc[j][2 * c], w, (__m512bh)lo);                  \
                    acc[j][2 * c + 1] = _mm512_dpbf16_ps(acc[j][2 * c + 1], w, (__m512bh)hi);          \
                }                                                                                      \
            }                                                                                          \
        for (int j = 0; j < RB; j++)                                                                   \
            for (int c = 0; c < NV; c++) _mm512_storeu_ps(tk->acc + (size_t)j * D + 16 * c, acc[j][c]); \
    }
CHUNK_AVX512(64, 4)
CHUNK_AVX512(128, 2)
CHUNK1_AVX512(64, 1)
CHUNK1_AVX512(64, 2)
CHUNK1_AVX512(64, 3)
CHUNK1_AVX512(64, 4)
CHUNK1_AVX512(128, 1)
CHUNK1_AVX512(128, 2)

/* The AVX-512 chunks accumulate each 32 dims c*32.. in two registers in unpack order (v = 2c holds
 * dims 8L..8L+3 of each 128-bit lane L at 4L.., v = 2c + 1 dims 8L+4..8L+7): back to dim order; and their running
 * sums per lane (lv) into l. Called once when a task's keys are done. */
AVX512BF16 static void unpermute_acc(Task *tk) {
    for (int r = 0; r < tk->R; r++) tk->l[r] += _mm512_reduce_add_ps(_mm512_loadu_ps(tk->lv + 16 * r));
    for (int r = 0; r < tk->R; r++)
        for (int c = 0; c < tk->D / 32; c++) {
            float *a = tk->acc + (size_t)r * tk->D + 32 * c;
            const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
            const __m512 x0 = _mm512_shuffle_f32x4(lo, hi, 0x44), x1 = _mm512_shuffle_f32x4(lo, hi, 0xEE);
            _mm512_storeu_ps(a, _mm512_shuffle_f32x4(x0, x0, 0xD8));
            _mm512_storeu_ps(a + 16, _mm512_shuffle_f32x4(x1, x1, 0xD8));
        }
}

/* Rows per block: as many as the task has, up to what keeps 16 accumulator registers; a task of no more rows than that
 * (a decode step's) in one pass of its own (CHUNK1_AVX512). */
AVX512BF16 static void chunk_avx512(Task *tk, const bf16 *kp, const bf16 *vp, int pos0, int n) {
    if (tk->D == 128) {
        switch (tk->R) {
        case 1: chunk1_avx512_128_1(tk, kp, vp, pos0, n); break;
        case 2: chunk1_avx512_128_2(tk, kp, vp, pos0, n); break;
        default: chunk_avx512_128_2(tk, kp, vp, pos0, n);
        }
        return;
    }
    switch (tk->R) {
    case 1: chunk1_avx512_64_1(tk, kp, vp, pos0, n); break;
    case 2: chunk1_avx512_64_2(tk, kp, vp, pos0, n); break;
    case 3: chunk1_avx512_64_3(tk, kp, vp, pos0, n); break;
    case 4: chunk1_avx512_64_4(tk, kp, vp, pos0, n); break;
    default: chunk_avx512_64_4(tk, kp, vp, pos0, n);
    }
}

static int cpu_has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

/* kvq_load into bfloat16 rows [n, D] (D % 32 == 0), 32 values at a time: fp8 codes looked up in FP8_BF16 (two
 * _mm512_permutex2var_epi16 over its 128 entries, the sign bit moved across: exact, fp8's 3 or 2 mantissa bits within
 * bfloat16's 7); int8 codes times their per-32 scale in float32, rounded to bfloat16 (2^-9 relative, under its own
 * step of max / 127). Through float16 8 values at a time (kvq_row8), a batch-1 decode step at depth 4,000 over an
 * fp8 cache took 9.2 ms against 7.0 (the default model on a 2-core EPYC). */
AVX512BF16 static void kvq_load_bf16(const uint8_t *src, int n, int D, int row, int kvq, bf16 *dst) {
    if (kvq == 1) {
        for (int t = 0; t < n; t++) {
            const uint8_t *r = src + (size_t)t * row;
            for (int d = 0; d < D; d += 16) {
                float scale;
                memcpy(&scale, r + D + d / 32 * sizeof(float), sizeof(float));
                const __m512 v = _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + d)))),
                    _mm512_set1_ps(scale));
                _mm256_storeu_si256((__m256i *)(dst + (size_t)t * D + d), (__m256i)_mm512_cvtneps_pbh(v));
            }
        }
        return;
    }
    __m512i tab[4];
    fp8_tables(kvq, tab);
    for (int t = 0; t < n; t++) {
        const uint8_t *r = src + (size_t)t * row;
        for (int d = 0; d < D; d += 32)
            _mm512_storeu_si512(dst + (size_t)t * D + d,
                                fp8_bf16_32(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(r + d))), tab));
    }
}

/* A chunk of a quantized cache on AVX512-BF16: its keys and values into bfloat16 rows (kvb holds 2 CHUNK rows of
 * D), then the bfloat16 step. Through float rows and AVX2 instead, 16 keys x 3 query rows took 580-840 ns a chunk,
 * more than a bfloat16 cache's chunk at twice the bytes. */
AVX512BF16 static void chunk_avx512_q(Task *tk, const uint8_t *kp, const uint8_t *vp, int pos0, int n, bf16 *kvb) {
    bf16 *vb = kvb + (size_t)CHUNK * tk->D;
    kvq_load_bf16(kp, n, tk->D, tk->row, tk->kvq, kvb);
    kvq_load_bf16(vp, n, tk->D, tk->row, tk->kvq, vb);
    chunk_avx512(tk, kvb, vb, pos0, n);
}
#else
static int cpu_has_avx512bf16(void) { return 0; }
#endif

#if defined(__x86_64__)
/* ---- float32 caches on AVX2 (head_dim 64, 128 or 256, no soft cap): the cache's rows are read in place (no copy
 * into a float buffer), eight keys' dot products reduced into one register, a vector exp, and each row's
 * accumulator held in registers across the chunk's values. ---- */
#define AVX2F __attribute__((target("avx2,fma,f16c")))

static int cpu_has_avx2f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* exp(x) for x <= 0, |relative error| < 2e-7 (exp512's polynomial; 2^n built in the exponent bits) */
AVX2F static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    const __m256 p = EXP_TAYLOR6(_mm256_fmadd_ps, _mm256_set1_ps, r);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* lane i = the sum of a[i]'s 8 lanes */
AVX2F static inline __m256 hsum8x8(const __m256 a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

AVX2F static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

AVX2F static inline float hadd8(__m256 v) {
    __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_add_ps(m, _mm_movehl_ps(m, m));
    m = _mm_add_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

#define CHUNK_AVX2(D)                                                                                  \
    AVX2F static void chunk_avx2_##D(Task *tk, const float *kp, const float *vp, int pos0, int n) {    \
        enum { NV = D / 8 };                                                                           \
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                \
        for (int r = 0; r < tk->R; r++) {                                                              \
            const float *q = tk->qf + (size_t)r * D;                                                   \
            const int qpos = tk->first_pos + r / tk->G;                                                \
            const int first = tk->window ? qpos - tk->window + 1 : 0; /* the first key the row sees */ \
            __m256 sc[CHUNK / 8];                                                                      \
            for (int t0 = 0; t0 < CHUNK; t0 += 8) {                                                    \
                __m256 dots[8];                                                                        \
                for (int t = 0; t < 8; t++) {                                                          \
                    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();                           \
                    if (t0 + t < n) {                                                                  \
                        const float *k = kp + (size_t)(t0 + t) * D;                                    \
                        for (int c = 0; c < NV; c += 2) {                                              \
                            a = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_loadu_ps(k + 8 * c), a); \
                            b = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), _mm256_loadu_ps(k + 8 * c + 8), b); \
                        }                                                                              \
                    }                                                                                  \
                    dots[t] = _mm256_add_ps(a, b);                                                     \
                }                                                                                      \
                const __m256i kpos = _mm256_add_epi32(_mm256_set1_epi32(pos0 + t0), lane);             \
                const __m256i in = _mm256_and_si256(                                                   \
                    _mm256_cmpgt_epi32(_mm256_set1_epi32(pos0 + n), kpos),                             \
                    _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(qpos + 1), kpos),            \
                                     _mm256_cmpgt_epi32(kpos, _mm256_set1_epi32(first - 1))));         \
                sc[t0 / 8] = _mm256_blendv_ps(_mm256_set1_ps(NEG_INF),                                  \
                                              _mm256_mul_ps(hsum8x8(dots), _mm256_set1_ps(tk->scale)),  \
                                              _mm256_castsi256_ps(in));                                \
            }                                                                                          \
            const float mx = fmaxf(tk->m[r], hmax8(_mm256_max_ps(sc[0], sc[1])));                      \
            if (IS_NEG_INF(mx)) continue; /* the row sees none of these keys */                        \
            const float alpha = IS_NEG_INF(tk->m[r]) ? 0.f : expf(tk->m[r] - mx);                      \
            float p[CHUNK];                                                                            \
            __m256 sum = _mm256_setzero_ps();                                                          \
            for (int h = 0; h < CHUNK / 8; h++) {                                                      \
                const __m256 live = _mm256_cmp_ps(sc[h], _mm256_set1_ps(0.5f * NEG_INF), _CMP_GT_OQ);  \
                const __m256 e = _mm256_and_ps(live, exp256(_mm256_sub_ps(sc[h], _mm256_set1_ps(mx))));\
                sum = _mm256_add_ps(sum, e);                                                           \
                _mm256_storeu_ps(p + 8 * h, e);                                                        \
            }                                                                                          \
            tk->m[r] = mx;                                                                             \
            tk->l[r] = tk->l[r] * alpha + hadd8(sum);                                                  \
            float *acc = tk->acc + (size_t)r * D;                                                      \
            for (int c0 = 0; c0 < NV; c0 += 8) { /* 64 dims at a time: 8 accumulators */               \
                __m256 o[8];                                                                           \
                for (int c = 0; c < 8; c++)                                                            \
                    o[c] = _mm256_mul_ps(_mm256_loadu_ps(acc + 8 * (c0 + c)), _mm256_set1_ps(alpha));  \
                for (int t = 0; t < n; t++) {                                                          \
                    const __m256 w = _mm256_set1_ps(p[t]);                                             \
                    const float *vr = vp + (size_t)t * D + 8 * c0;                                     \
                    for (int c = 0; c < 8; c++) o[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8 * c), o[c]); \
                }                                                                                      \
                for (int c = 0; c < 8; c++) _mm256_storeu_ps(acc + 8 * (c0 + c), o[c]);                \
            }                                                                                          \
        }                                                                                              \
    }
CHUNK_AVX2(64)
CHUNK_AVX2(128)
CHUNK_AVX2(256)

AVX2F static void chunk_avx2(Task *tk, const float *kp, const float *vp, int pos0, int n) {
    if (tk->D == 64) chunk_avx2_64(tk, kp, vp, pos0, n);
    else if (tk->D == 128) chunk_avx2_128(tk, kp, vp, pos0, n);
    else chunk_avx2_256(tk, kp, vp, pos0, n);
}

/* kvq_load for AVX2 with F16C (D % 8 == 0) */
AVX2F static void kvq_load_avx2(const uint8_t *src, int n, int D, int row, int kvq, float *dst) {
    for (int t = 0; t < n; t++)
        for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + (size_t)t * D + d, kvq_row8(src + (size_t)t * row, D, d, kvq));
}

/* A chunk of a quantized cache on AVX2: its keys and values into float rows (kvf holds 2 CHUNK rows of D), then
 * the float32 step. */
AVX2F static void chunk_avx2_q(Task *tk, const uint8_t *kp, const uint8_t *vp, int pos0, int n, float *kvf) {
    float *vf = kvf + (size_t)CHUNK * tk->D;
    kvq_load_avx2(kp, n, tk->D, tk->row, tk->kvq, kvf);
    kvq_load_avx2(vp, n, tk->D, tk->row, tk->kvq, vf);
    chunk_avx2(tk, kvf, vf, pos0, n);
}

/* ---- float32 caches on AVX-512 (AVX512F alone: the Xeons without AVX512-BF16 take it, as every AVX-512 CPU does for
 * a float32 cache): CHUNK_AVX2's scheme 16 lanes wide. A row's query is held in registers, each of the chunk's 16
 * keys is read in place into one register of partial dot products, the 16 are folded into the chunk's 16 scores in
 * one register (fold4_add, fold_lanes: 45 shuffles and adds), one vector exp, and the row's D accumulators are held
 * in registers across the chunk's values. ---- */
#define AVX512FA __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,fma")))
#define AVX512F_PATH 3 /* `avx` of the float32 cache's AVX-512 step (1: AVX2) */

static int cpu_has_avx512f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

/* lane j of hadd_lanes(u) = the sum of v[j]'s 16 lanes, u[g] = hadd_fold4(v + 4 g) (hfold.h) */
#define ADD_PS(a, b) _mm512_add_ps(a, b)
HFOLD(AVX512FA, hadd, ADD_PS)

/* lane j = the sum of v[j]'s 16 lanes, j < 16 */
AVX512FA static inline __m512 hsum16x16(const __m512 *v) {
    const __m512 u[4] = {hadd_fold4(v), hadd_fold4(v + 4), hadd_fold4(v + 8), hadd_fold4(v + 12)};
    return hadd_lanes(u);
}

#define CHUNK_AVX512F(D)                                                                               \
    AVX512FA static void chunk_avx512f_##D(Task *tk, const float *kp, const float *vp, int pos0, int n) { \
        enum { NV = D / 16 };                                                                          \
        const __mmask16 live = (__mmask16)((1u << n) - 1);                                             \
        const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(pos0),                              \
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));                   \
        for (int r = 0; r < tk->R; r++) {                                                              \
            const int qpos = tk->first_pos + r / tk->G;                                                \
            const __mmask16 seen = live & _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(qpos))    \
                & _mm512_cmpgt_epi32_mask(key_pos, _mm512_set1_epi32(tk->window ? qpos - tk->window : -1)); \
            if (!seen) continue; /* the row sees none of these keys */                                 \
            const float *q = tk->qf + (size_t)r * D;                                                   \
            __m512 qv[NV], dots[CHUNK];                                                                \
            for (int c = 0; c < NV; c++) qv[c] = _mm512_loadu_ps(q + 16 * c);                          \
            for (int t = 0; t < CHUNK; t++) {                                                          \
                __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();                               \
                if (t < n) {                                                                           \
                    const float *k = kp + (size_t)t * D;                                               \
                    for (int c = 0; c < NV; c += 2) {                                                  \
                        a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + 16 * c), a);                    \
                        b = _mm512_fmadd_ps(qv[c + 1], _mm512_loadu_ps(k + 16 * c + 16), b);           \
                    }                                                                                  \
                }                                                                                      \
                dots[t] = _mm512_add_ps(a, b);                                                         \
            }                                                                                          \
            const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), seen,                        \
                                                 _mm512_mul_ps(hsum16x16(dots), _mm512_set1_ps(tk->scale))); \
            const float mx = fmaxf(tk->m[r], _mm512_reduce_max_ps(sc));                                \
            const float alpha = IS_NEG_INF(tk->m[r]) ? 0.f : expf(tk->m[r] - mx);                      \
            const __m512 e = _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));  \
            float p[CHUNK];                                                                            \
            _mm512_storeu_ps(p, e);                                                                    \
            tk->m[r] = mx;                                                                             \
            tk->l[r] = tk->l[r] * alpha + _mm512_reduce_add_ps(e);                                     \
            float *acc = tk->acc + (size_t)r * D;                                                      \
            __m512 o[NV];                                                                              \
            for (int c = 0; c < NV; c++) o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * c), _mm512_set1_ps(alpha)); \
            for (int t = 0; t < n; t++) {                                                              \
                const __m512 w = _mm512_set1_ps(p[t]);                                                 \
                const float *vr = vp + (size_t)t * D;                                                  \
                for (int c = 0; c < NV; c++) o[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vr + 16 * c), o[c]); \
            }                                                                                          \
            for (int c = 0; c < NV; c++) _mm512_storeu_ps(acc + 16 * c, o[c]);                         \
        }                                                                                              \
    }
CHUNK_AVX512F(64)
CHUNK_AVX512F(128)
CHUNK_AVX512F(256)

/* The float32 step for a prompt tile's rows (more than CHUNKT_MIN_ROWS): the chunk's keys transposed 16 dims at a
 * time (transpose16, once for all the tile's rows), so that a row's 16 scores are one register of FMAs, its query's
 * values broadcast from memory, with no horizontal sums; TROWS rows' chains interleaved. The softmax then runs a row
 * at a time on those registers with the lazy running max of CHUNK_SOFTMAX (l per lane in lv, summed by fold_lv; the
 * rescales of the rows whose max moved in one vector exp), the weights kept in s. Then P V for RB rows at a time, their
 * accumulators in registers, each value row loaded once for the RB rows. chunk_avx512f's row-at-a-time form spent
 * ~45 shuffles and adds a row and chunk folding 16 partial dot products, a scalar expf and two reductions: a pp512
 * run of the default model spent 28% of its time in it. */
#define CHUNKT_MIN_ROWS 4 /* a decode step's GQA group (up to 4 rows) keeps chunk_avx512f */
#define TROWS 8           /* rows whose score chains run interleaved (16 dependent FMAs each) */
#define CHUNKT_AVX512F(D)                                                                              \
    AVX512FA static void chunkt_avx512f_##D(Task *tk, const float *kp, const float *vp, int pos0, int n) { \
        enum { NV = D / 16, RB = D == 64 ? 4 : D == 128 ? 2 : 1 };                                     \
        const int R = tk->R;                                                                           \
        float s[MAX_ROWS][CHUNK] __attribute__((aligned(64))); /* scores, then weights */              \
        for (int c = 0; c < NV; c++) {                                                                 \
            __m512 kt[16]; /* kt[i] lane t = dim 16 c + i of key t */                                  \
            for (int t = 0; t < CHUNK; t++)                                                            \
                kt[t] = t < n ? _mm512_loadu_ps(kp + (size_t)t * D + 16 * c) : _mm512_setzero_ps();    \
            transpose16((__m512i *)kt);                                                                \
            for (int r0 = 0; r0 < R; r0 += TROWS) {                                                    \
                const float *qr[TROWS]; /* rows past R repeat the last one; their scores are dropped */ \
                __m512 a[TROWS];                                                                       \
                for (int j = 0; j < TROWS; j++) {                                                      \
                    const int r = r0 + j < R ? r0 + j : R - 1;                                         \
                    qr[j] = tk->qf + (size_t)r * D + 16 * c;                                           \
                    a[j] = c ? _mm512_load_ps(s[r]) : _mm512_setzero_ps();                             \
                }                                                                                      \
                for (int i = 0; i < 16; i++)                                                           \
                    for (int j = 0; j < TROWS; j++) a[j] = _mm512_fmadd_ps(_mm512_set1_ps(qr[j][i]), kt[i], a[j]); \
                for (int j = 0; j < TROWS && r0 + j < R; j++) _mm512_store_ps(s[r0 + j], a[j]);        \
            }                                                                                          \
        }                                                                                              \
        const __mmask16 live = (__mmask16)((1u << n) - 1);                                             \
        const __m512i key_pos = _mm512_add_epi32(_mm512_set1_epi32(pos0),                              \
            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));                   \
        float alpha[MAX_ROWS] __attribute__((aligned(64))); /* m_old - m_new, then its exp */          \
        int moved = 0;                                                                                 \
        for (int r = R; r < (R + 15) / 16 * 16; r++) alpha[r] = 0.f;                                   \
        for (int r = 0; r < R; r++) {                                                                  \
            const int qpos = tk->first_pos + r / tk->G;                                                \
            const __mmask16 seen = live & _mm512_cmple_epi32_mask(key_pos, _mm512_set1_epi32(qpos))    \
                & _mm512_cmpgt_epi32_mask(key_pos, _mm512_set1_epi32(tk->window ? qpos - tk->window : -1)); \
            alpha[r] = 0.f;                                                                            \
            if (!seen) { /* the row sees none of these keys: weights 0, its state as it was */         \
                _mm512_store_ps(s[r], _mm512_setzero_ps());                                            \
                continue;                                                                              \
            }                                                                                          \
            const __m512 sc = _mm512_mask_mov_ps(_mm512_set1_ps(NEG_INF), seen,                        \
                                                 _mm512_mul_ps(_mm512_load_ps(s[r]), _mm512_set1_ps(tk->scale))); \
            const float m = tk->m[r];                                                                  \
            const float mx = _mm512_cmp_ps_mask(sc, _mm512_set1_ps(m + LAZY_MAX), _CMP_GT_OQ)          \
                                 ? fmaxf(m, _mm512_reduce_max_ps(sc)) : m;                             \
            _mm512_store_ps(s[r], _mm512_maskz_mov_ps(seen, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mx))))); \
            if (mx != m) { /* a fresh row's acc and lv are 0: any finite factor keeps them */          \
                alpha[r] = IS_NEG_INF(m) ? 0.f : m - mx;                                               \
                moved = 1;                                                                             \
                tk->m[r] = mx;                                                                         \
            }                                                                                          \
        }                                                                                              \
        if (moved)                                                                                     \
            for (int r = 0; r < R; r += 16)                                                            \
                _mm512_store_ps(alpha + r, exp512(_mm512_load_ps(alpha + r)));                        \
        for (int r0 = 0; r0 < R; r0 += RB) {                                                           \
            __m512 o[RB][NV];                                                                          \
            const float *w[RB];                                                                        \
            for (int j = 0; j < RB; j++) {                                                             \
                const int r = r0 + j < R ? r0 + j : R - 1;                                             \
                const __m512 f = _mm512_set1_ps(moved ? alpha[r] : 1.f);                               \
                w[j] = s[r];                                                                           \
                for (int c = 0; c < NV; c++)                                                           \
                    o[j][c] = _mm512_mul_ps(_mm512_loadu_ps(tk->acc + (size_t)r * D + 16 * c), f);     \
                if (r0 + j < R) {                                                                      \
                    float *lv = tk->lv + 16 * r;                                                       \
                    _mm512_storeu_ps(lv, _mm512_fmadd_ps(_mm512_loadu_ps(lv), f, _mm512_load_ps(s[r]))); \
                }                                                                                      \
            }                                                                                          \
            for (int t = 0; t < n; t++) {                                                              \
                __m512 v[NV];                                                                          \
                for (int c = 0; c < NV; c++) v[c] = _mm512_loadu_ps(vp + (size_t)t * D + 16 * c);      \
                for (int j = 0; j < RB; j++) {                                                         \
                    const __m512 p = _mm512_set1_ps(w[j][t]);                                          \
                    for (int c = 0; c < NV; c++) o[j][c] = _mm512_fmadd_ps(p, v[c], o[j][c]);          \
                }                                                                                      \
            }                                                                                          \
            for (int j = 0; j < RB && r0 + j < R; j++)                                                 \
                for (int c = 0; c < NV; c++) _mm512_storeu_ps(tk->acc + (size_t)(r0 + j) * D + 16 * c, o[j][c]); \
        }                                                                                              \
    }
CHUNKT_AVX512F(64)
CHUNKT_AVX512F(128)
CHUNKT_AVX512F(256)

/* The float32 steps' running sums per lane (chunkt_avx512f's lv) into l, once a task's keys are done (lv is 0 where
 * chunk_avx512f ran). */
AVX512FA static void fold_lv(Task *tk) {
    for (int r = 0; r < tk->R; r++) tk->l[r] += _mm512_reduce_add_ps(_mm512_loadu_ps(tk->lv + 16 * r));
}

AVX512FA static void chunk_avx512f(Task *tk, const float *kp, const float *vp, int pos0, int n) {
    if (tk->R > CHUNKT_MIN_ROWS) {
        if (tk->D == 64) chunkt_avx512f_64(tk, kp, vp, pos0, n);
        else if (tk->D == 128) chunkt_avx512f_128(tk, kp, vp, pos0, n);
        else chunkt_avx512f_256(tk, kp, vp, pos0, n);
        return;
    }
    if (tk->D == 64) chunk_avx512f_64(tk, kp, vp, pos0, n);
    else if (tk->D == 128) chunk_avx512f_128(tk, kp, vp, pos0, n);
    else chunk_avx512f_256(tk, kp, vp, pos0, n);
}

/* kvq_load into float32 rows [n, D] (D % 32 == 0) with AVX512F and BW, 32 values at a time: fp8 codes looked up in
 * FP8_BF16 as kvq_load_bf16 does (exact: fp8's bits within bfloat16's) and widened; int8 codes times their per-32
 * scale. The same floats as kvq_load. */
AVX512FA static void kvq_load_f32(const uint8_t *src, int n, int D, int row, int kvq, float *dst) {
    if (kvq == 1) {
        for (int t = 0; t < n; t++) {
            const uint8_t *r = src + (size_t)t * row;
            for (int d = 0; d < D; d += 16) {
                float scale;
                memcpy(&scale, r + D + d / 32 * sizeof(float), sizeof(float));
                _mm512_storeu_ps(dst + (size_t)t * D + d,
                                 _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(r + d)))),
                                               _mm512_set1_ps(scale)));
            }
        }
        return;
    }
    __m512i tab[4];
    fp8_tables(kvq, tab);
    for (int t = 0; t < n; t++) {
        const uint8_t *r = src + (size_t)t * row;
        float *o = dst + (size_t)t * D;
        for (int d = 0; d < D; d += 32) {
            const __m512i b = fp8_bf16_32(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(r + d))), tab);
            _mm512_storeu_ps(o + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16)));
            _mm512_storeu_ps(o + d + 16, _mm512_castsi512_ps(_mm512_slli_epi32(
                                             _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16)));
        }
    }
}

/* A chunk of a quantized cache on AVX-512 without AVX512-BF16: its keys and values into float rows (kvf holds 2 CHUNK
 * rows of D), then the float32 step. */
/* A chunk of a bfloat16 cache on AVX-512 without AVX512-BF16: its n keys and values [n, D] widened into float rows
 * (exact; kvf holds 2 CHUNK rows of D), then the float32 step. Before, such a cache took the portable step. */
AVX512FA static void chunk_avx512f_b(Task *tk, const bf16 *kp, const bf16 *vp, int pos0, int n, float *kvf) {
    float *vf = kvf + (size_t)CHUNK * tk->D;
    for (size_t i = 0; i < (size_t)n * tk->D; i += 16) {
        const __m512i k = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(kp + i)));
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vp + i)));
        _mm512_storeu_ps(kvf + i, _mm512_castsi512_ps(_mm512_slli_epi32(k, 16)));
        _mm512_storeu_ps(vf + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
    }
    chunk_avx512f(tk, kvf, vf, pos0, n);
}

AVX512FA static void chunk_avx512f_q(Task *tk, const uint8_t *kp, const uint8_t *vp, int pos0, int n, float *kvf) {
    float *vf = kvf + (size_t)CHUNK * tk->D;
    kvq_load_f32(kp, n, tk->D, tk->row, tk->kvq, kvf);
    kvq_load_f32(vp, n, tk->D, tk->row, tk->kvq, vf);
    chunk_avx512f(tk, kvf, vf, pos0, n);
}
#else
static int cpu_has_avx2f(void) { return 0; }
static int cpu_has_avx512f(void) { return 0; }
#endif

/* The SIMD paths this CPU takes: bit 0 = AVX512-BF16 (bfloat16 and quantized caches), bit 1 = AVX2 (quantized caches
 * without AVX512-BF16, float32 caches without AVX-512), bit 2 = AVX-512 (float32 caches). */
int attention_isa(void) { return cpu_has_avx512bf16() | cpu_has_avx2f() << 1 | cpu_has_avx512f() << 2; }

/* Asks for [p, p + bytes) in the L2 (hint T1) or the L1 (T0) ahead of use. */
static inline void prefetch_l2(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 2);
}
static inline void prefetch_l1(const void *p, size_t bytes) {
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)p + i, 0, 3);
}

/* K and V bytes a task keeps in flight towards the L2 ahead of the chunk it computes */
#define PREFETCH_BYTES (24 << 10)

/* Runs keys [k_begin, k_end) of nh tasks, kv heads h0 .. h0 + nh - 1 of one tile (tks[j] head h0 + j), through
 * their chunks: each chunk of keys for every head in turn, so that a decode step's tasks of one sequence (nh = every
 * kv head, attention_heads_mode) read each block's K (and V) of all heads as one run of bytes. A task's blocks lie
 * wherever the block table put them, so the hardware prefetchers cannot guess the next one: a cursor runs
 * PREFETCH_BYTES of K and V ahead into the L2, a block table entry at a time, and the next chunk is asked into the
 * L1. With only the next chunk asked for, the kernel waited on DRAM latency once a step's caches outgrew the L3
 * (scripts/bench_attention.py, a W64 decode step on a 2-core EPYC: 30 layers of 17 MB, 53-72 ms a step at 7-10 GB/s;
 * 29-30 ms with the cursor). */
#define RUN_KEYS(T)                                                                                    \
    static void run_keys_##T(Task *tks, int nh, const T *k_cache, const T *v_cache, const int32_t *table, \
                             int k_begin, int k_end, int h0, int num_kv_heads, int bs, int avx, float *kvf) { \
        const size_t row_bytes = (size_t)tks[0].row * sizeof(T), row = tks[0].row;                    \
        const int lead = PREFETCH_BYTES / (2 * row_bytes * nh) > CHUNK ? PREFETCH_BYTES / (2 * row_bytes * nh) \
                                                                         : CHUNK;                      \
        int pf = k_begin; /* keys before pf have been asked for */                                     \
        for (int t = k_begin; t < k_end;) {                                                            \
            const int off = t % bs;                                                                    \
            int n = bs - off < CHUNK ? bs - off : CHUNK;                                               \
            n = k_end - t < n ? k_end - t : n;                                                         \
            const size_t base = (((size_t)table[t / bs] * num_kv_heads + h0) * bs + off) * row;        \
            for (const int ahead = t + lead < k_end ? t + lead : k_end; pf < ahead;) {                 \
                const int poff = pf % bs, pn = bs - poff < ahead - pf ? bs - poff : ahead - pf;         \
                const size_t at = (((size_t)table[pf / bs] * num_kv_heads + h0) * bs + poff) * row;     \
                for (int j = 0; j < nh; j++) {                                                         \
                    prefetch_l2(k_cache + at + (size_t)j * bs * row, pn * row_bytes);                  \
                    prefetch_l2(v_cache + at + (size_t)j * bs * row, pn * row_bytes);                  \
                }                                                                                      \
                pf += pn;                                                                              \
            }                                                                                          \
            const int next = t + n;                                                                    \
            for (int j = 0; j < nh; j++) {                                                             \
                if (j + 1 < nh) { /* the next head's piece of these keys */                            \
                    prefetch_l1(k_cache + base + (size_t)(j + 1) * bs * row, n * row_bytes);           \
                    prefetch_l1(v_cache + base + (size_t)(j + 1) * bs * row, n * row_bytes);           \
                } else if (next < k_end) {                                                             \
                    const int noff = next % bs, nn = bs - noff < CHUNK ? bs - noff : CHUNK;            \
                    const size_t at = (((size_t)table[next / bs] * num_kv_heads + h0) * bs + noff) * row; \
                    prefetch_l1(k_cache + at, nn * row_bytes);                                         \
                    prefetch_l1(v_cache + at, nn * row_bytes);                                         \
                }                                                                                      \
                const size_t hb = base + (size_t)j * bs * row;                                         \
                CHUNK_DISPATCH_##T(&tks[j], k_cache + hb, v_cache + hb, t, n, kvf, avx);               \
            }                                                                                          \
            t += n;                                                                                    \
        }                                                                                              \
    }
#if defined(__x86_64__)
#define CHUNK_DISPATCH_float(tk, kp, vp, t, n, kvf, avx)                                               \
    do {                                                                                               \
        if (avx == AVX512F_PATH) chunk_avx512f(tk, kp, vp, t, n);                                      \
        else if (avx) chunk_avx2(tk, kp, vp, t, n);                                                    \
        else chunk_portable_float(tk, kp, vp, t, n, kvf);                                              \
    } while (0)
#define CHUNK_DISPATCH_bf16(tk, kp, vp, t, n, kvf, avx)                                                \
    do {                                                                                               \
        if (avx == AVX512F_PATH) chunk_avx512f_b(tk, kp, vp, t, n, kvf);                               \
        else if (avx) chunk_avx512(tk, kp, vp, t, n);                                                  \
        else chunk_portable_bf16(tk, kp, vp, t, n, kvf);                                               \
    } while (0)
#else
#define CHUNK_DISPATCH_float(tk, kp, vp, t, n, kvf, avx) chunk_portable_float(tk, kp, vp, t, n, kvf)
#define CHUNK_DISPATCH_bf16(tk, kp, vp, t, n, kvf, avx) chunk_portable_bf16(tk, kp, vp, t, n, kvf)
#endif
#if defined(__x86_64__)
#define CHUNK_DISPATCH_uint8_t(tk, kp, vp, t, n, kvf, avx)                                             \
    do {                                                                                               \
        if (avx == AVX_BF16) chunk_avx512_q(tk, kp, vp, t, n, (bf16 *)(kvf));                          \
        else if (avx == AVX512F_PATH) chunk_avx512f_q(tk, kp, vp, t, n, kvf);                          \
        else if (avx) chunk_avx2_q(tk, kp, vp, t, n, kvf);                                             \
        else chunk_portable_uint8_t(tk, kp, vp, t, n, kvf);                                            \
    } while (0)
#else
#define CHUNK_DISPATCH_uint8_t(tk, kp, vp, t, n, kvf, avx) chunk_portable_uint8_t(tk, kp, vp, t, n, kvf)
#endif
RUN_KEYS(float)
RUN_KEYS(bf16)
RUN_KEYS(uint8_t)
#if defined(__x86_64__)
#define UNPERMUTE_float(tk, avx) if (avx == AVX512F_PATH) fold_lv(tk)
#define UNPERMUTE_bf16(tk, avx) if (avx == AVX512F_PATH) fold_lv(tk); else if (avx) unpermute_acc(tk)
#define UNPERMUTE_uint8_t(tk, avx) if (avx == AVX_BF16) unpermute_acc(tk); else if (avx == AVX512F_PATH) fold_lv(tk)
#else
#define UNPERMUTE_float(tk, avx)
#define UNPERMUTE_bf16(tk, avx)
#define UNPERMUTE_uint8_t(tk, avx)
#endif

/* The query positions of one tile: sequence s (tile_start[s] <= tile < tile_start[s + 1]), its q_len new
 * tokens, the tile's first position j_first among them, nq <= QT positions, and tok0 the flat row of
 * the first. */
typedef struct {
    int s, q_len, j_first, nq;
    size_t tok0;
} Tile;

static inline Tile tile_of(int tile, const int *tile_start, const int32_t *query_start_loc) {
    Tile t = {0};
    while (tile_start[t.s + 1] <= tile) t.s++;
    t.q_len = query_start_loc[t.s + 1] - query_start_loc[t.s];
    t.j_first = (tile - tile_start[t.s]) * QT;
    t.nq = t.q_len - t.j_first < QT ? t.q_len - t.j_first : QT;
    t.tok0 = (size_t)query_start_loc[t.s] + t.j_first;
    return t;
}

/* A buffer of at least `bytes` (64-byte aligned) owned by the calling thread and kept between calls, one per `slot`
 * (0 and 1 this file's workspaces, 2 and 3 decoder_layer.c's layers', 4 its step's, 5 and 6 gguf_amx.c's activations
 * and B tiles): workspaces above malloc's mmap threshold (~170 KiB at batch 1 here) mapped fresh pages and faulted
 * them in on every call, ~10 us a layer. */
void *kernel_scratch(int slot, size_t bytes) {
    static __thread void *buf[7];
    static __thread size_t cap[7];
    if (cap[slot] < bytes) {
        free(buf[slot]);
        cap[slot] = (bytes + 63) / 64 * 64;
        buf[slot] = aligned_alloc(64, cap[slot]);
    }
    return buf[slot];
}

/* Writing one new K or V row of a head into the cache: as it is, or quantized (kvq). */
static inline void store_row_float(float *dst, const float *src, int D, int kvq) { memcpy(dst, src, D * sizeof(float)); }
static inline void store_row_bf16(bf16 *dst, const bf16 *src, int D, int kvq) { memcpy(dst, src, D * sizeof(bf16)); }
static inline void store_row_float_q(uint8_t *dst, const float *src, int D, int kvq) { kvq_store(dst, src, D, kvq); }
static inline void store_row_bf16_q(uint8_t *dst, const bf16 *src, int D, int kvq) {
    float x[MAX_HEAD_DIM];
    for (int d = 0; d < D; d++) x[d] = bf16_to_f32(src[d]);
    kvq_store(dst, x, D, kvq);
}

/* The factor that turns a row's accumulator sum_t exp(s_t - m) v_t into its output: 1 / l, l = sum_t exp(s_t - m);
 * with attention sinks (gpt-oss: a learned logit per query head that joins the softmax's denominator but has no
 * value), 1 / (l + exp(sink - m)), computed as exp(m - M) / (l exp(m - M) + exp(sink - M)), M = max(m, sink), so
 * that neither exponential overflows. */
static inline float sink_inverse(const float *sinks, int head, float m, float l) {
    if (sinks == NULL) return 1.f / l;
    const float sink = sinks[head], M = m > sink ? m : sink, e = expf(m - M);
    return e / (l * e + expf(sink - M));
}

/* The tasks of a step: tile_start [num_seqs + 1] gets each sequence's first tile (tiles of QT query positions,
 * numbered through the sequences); returns the longest sequence's length. */
int attention_tiles(int num_seqs, const int32_t *query_start_loc, const int32_t *seq_lens, int *tile_start) {
    int max_len = 0;
    tile_start[0] = 0;
    for (int s = 0; s < num_seqs; s++) {
        const int nq = query_start_loc[s + 1] - query_start_loc[s];
        tile_start[s + 1] = tile_start[s] + (nq + QT - 1) / QT;
        max_len = seq_lens[s] > max_len ? seq_lens[s] : max_len;
    }
    return max_len;
}

/* Partitions of each task's keys: 1, or more when the tasks are too few to keep every thread busy */
static int attention_parts(int num_tasks, int max_len, int window, int num_threads) {
    int parts = 1;
    if (num_tasks > 0 && num_tasks < 4 * num_threads) {
        parts = (4 * num_threads + num_tasks - 1) / num_tasks;
        const int span = window && window + QT < max_len ? window + QT : max_len; /* keys a task reads */
        const int most = (span + MIN_PART - 1) / MIN_PART;
        parts = parts < most ? parts : most;
        /* whole rounds of units: 3 tasks x 3 parts on 2 threads left one thread a unit alone */
        while ((num_tasks * parts) % num_threads && parts < most) parts++;
    }
    return parts;
}

/* A decode step (one query a sequence) runs each sequence's tasks as one unit, every kv head in turn over each chunk of
 * keys (run_keys), where the heads' rows fit a unit's workspace; a sequence's keys split into partitions as
 * attention_parts splits a task's when the sequences are too few for the threads. One head's K of a block is 2 KB for
 * the default model, too short a run for the hardware prefetchers; every head's K of a block is one run, and the
 * blocks of a fresh sequence follow each other. Decode steps at batch 1 on a 2-core EPYC, attention a step: the
 * default model at depth 352 314-331 -> 293-299 us, the 1B shape (8 kv heads) at 434 1,060 -> 930-980 us; an fp8
 * cache at depth 4,000 2.8-2.9 -> 1.9 ms (scripts/bench_attention.py). */
#define MAX_UNIT_HEADS 8
static int attention_heads_mode(int num_tokens, int num_seqs, int num_heads, int num_kv_heads) {
    return num_tokens == num_seqs && num_kv_heads > 1 && num_kv_heads <= MAX_UNIT_HEADS && num_heads <= MAX_ROWS;
}

/* Floats of a thread's workspace for head_dim D: acc, qf, bfloat16 queries (rows of MAX_ROWS * D), a K/V chunk, lv */
static size_t attention_thread_floats(int D) { return 3 * (size_t)MAX_ROWS * D + 2 * CHUNK * D + 16 * MAX_ROWS; }

/* The workspaces paged_attention_team_NAME takes, in floats: *thread_floats for each thread (num_threads of them in
 * one buffer), *part_floats for the partitions' results (0 where no task's keys are split), for a step of num_tiles
 * tiles whose longest sequence has max_len tokens. Returns -1 where the kernel refuses the shape: head_dim past
 * MAX_HEAD_DIM, a GQA group of more than MAX_ROWS / QT heads, an int8 cache's rows not in whole blocks of 32. */
int attention_workspace(int num_tiles, int max_len, int num_heads, int num_kv_heads, int D, int window, int kvq,
                        int num_threads, size_t *thread_floats, size_t *part_floats) {
    if (D > MAX_HEAD_DIM || num_heads / num_kv_heads * QT > MAX_ROWS || (kvq == 1 && D % 32)) return -1;
    const size_t row_floats = (size_t)MAX_ROWS * D, num_tasks = (size_t)num_tiles * num_kv_heads;
    const int per_head = attention_parts((int)num_tasks, max_len, window, num_threads);
    /* a decode step (attention_heads_mode: a tile and a unit a sequence) splits its sequences' keys instead */
    const int per_seq = attention_parts(num_tiles, max_len, window, num_threads);
    const int parts = per_head > per_seq ? per_head : per_seq;
    /* per unit when split: acc, m, l */
    *thread_floats = attention_thread_floats(D);
    *part_floats = parts > 1 ? num_tasks * parts * (row_floats + 2 * MAX_ROWS) : 0;
    return 0;
}

/* paged_attention_NAME's parameters: q, k, v and out in T, the cache in TC (T itself, or the bytes of a quantized
 * one) */
#define ATTENTION_PARAMS(T, TC)                                                                        \
    const T *q, int q_stride, const T *k, int k_stride, const T *v, int v_stride, TC *k_cache, TC *v_cache, \
        const int64_t *slot_mapping, int num_tokens, const int32_t *block_tables, const int32_t *seq_lens, \
        const int32_t *query_start_loc, T *out, int num_seqs, int num_heads, int num_kv_heads, int D, int bs, \
        int max_blocks, float scale, int window, float softcap, int num_threads, int isa, int kvq, const float *sinks

/* paged_attention_team_NAME: the step's attention by the calling thread's team. Inside a parallel region every thread
 * of the team calls it with the same arguments, and it returns on every thread once `out` is whole (decoder_layer.c's
 * one region a step; paged_attention_NAME runs it on a team of its own). tile_start and max_len as attention_tiles
 * gives them; thread_ws and part_ws shared, of the floats attention_workspace asked for (the caller has checked that
 * it took the shape). The new K/V rows are written first, then the units (task, partition) run, the longest
 * first, then each split task's partitions are merged. */
#define PAGED_ATTENTION(NAME, T, TC, FROM_F32, TO_F32)                                                 \
    void paged_attention_team_##NAME(ATTENTION_PARAMS(T, TC), const int *tile_start, int max_len,      \
                                     float *thread_ws, float *part_ws) {                               \
        const int G = num_heads / num_kv_heads;                                                        \
        const int row = kvq ? kvq_row_bytes(D, kvq) : D; /* cache elements per row of a head */       \
        /* the SIMD chunk step: AVX512-BF16 for bfloat16 and quantized, else AVX-512 or AVX2 (float rows) */ \
        const int bf16_ok = (D == 64 || D == 128) && cpu_has_avx512bf16();                             \
        const int avx = !isa || softcap != 0.f ? 0                                                     \
                        : sizeof(TC) == 2 && bf16_ok ? 1                                               \
                        : sizeof(TC) == 2 && (D == 64 || D == 128 || D == 256) && cpu_has_avx512f() ? AVX512F_PATH \
                        : sizeof(TC) == 2      ? 0                                                     \
                        : sizeof(TC) == 1 && bf16_ok ? AVX_BF16                                        \
                        : !(D == 64 || D == 128 || D == 256) ? 0                                      \
                        : cpu_has_avx512f() ? AVX512F_PATH                                            \
                                                              : cpu_has_avx2f();                       \
        /* 1. the new tokens' K/V into their slots (every read below may need them) */                 \
        _Pragma("omp for schedule(static)")                                                                          \
        for (int i = 0; i < num_tokens; i++) {                                                         \
            const int64_t blk = slot_mapping[i] / bs, off = slot_mapping[i] % bs;                      \
            for (int h = 0; h < num_kv_heads; h++) {                                                   \
                const size_t dst = (((size_t)blk * num_kv_heads + h) * bs + off) * row;                \
                store_row_##NAME(k_cache + dst, k + (size_t)i * k_stride + (size_t)h * D, D, kvq);     \
                store_row_##NAME(v_cache + dst, v + (size_t)i * v_stride + (size_t)h * D, D, kvq);     \
            }                                                                                          \
        }                                                                                              \
        /* 2. tasks (sequence, kv head, query tile), each sequence's in one unit in attention_heads_mode */        \
        const int num_tasks = tile_start[num_seqs] * num_kv_heads;                                     \
        const int heads_mode = attention_heads_mode(num_tokens, num_seqs, num_heads, num_kv_heads);    \
        const int nh = heads_mode ? num_kv_heads : 1; /* the tasks (kv heads) of a unit */             \
        const int parts = attention_parts(num_tasks / nh, max_len, window, num_threads);               \
        const size_t row_floats = (size_t)MAX_ROWS * D;                                                \
        const size_t ws_floats = attention_thread_floats(D);                                           \
        _Pragma("omp for schedule(dynamic, 1)")                                                                       \
        for (int unit = num_tasks / nh * parts - 1; unit >= 0; unit--) { /* late tiles (long) first */ \
            const int task0 = unit / parts * nh, part = unit % parts; /* tasks task0 .. task0 + nh - 1 */ \
            const int h0 = task0 % num_kv_heads;                                                       \
            const Tile ti = tile_of(task0 / num_kv_heads, tile_start, query_start_loc);                \
            const int s = ti.s, nq = ti.nq, R = nq * G;                                                \
            float *ws = thread_ws + (size_t)omp_get_thread_num() * ws_floats;                          \
            const int first_pos = seq_lens[s] - ti.q_len + ti.j_first;                                 \
            const int L = first_pos + nq; /* keys up to the tile's last query */                       \
            /* the first key the tile's first query sees */                                            \
            const int lo = window && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;          \
            const int per = (L - lo + parts - 1) / parts;                                              \
            const int k_begin = lo + part * per, k_end = k_begin + per < L ? k_begin + per : L;        \
            const size_t tok0 = ti.tok0;                                                               \
            Task tks[MAX_UNIT_HEADS]; /* head h0 + j's rows at j R in each of the workspace's row buffers */ \
            for (int j = 0; j < nh; j++) {                                                             \
                const int h = h0 + j;                                                                  \
                Task *tk = &tks[j];                                                                    \
                *tk = (Task){.R = R, .G = G, .D = D, .row = row, .kvq = kvq, .first_pos = first_pos,   \
                             .window = window, .scale = scale, .softcap = softcap,                     \
                             .acc = ws + (size_t)j * R * D, .qf = ws + row_floats + (size_t)j * R * D,  \
                             .lv = ws + 3 * row_floats + 2 * CHUNK * D + (size_t)j * 16 * R};           \
                /* queries rounded to bfloat16 (float32 q, AVX_BF16) */                                \
                bf16 *qb16 = (bf16 *)(ws + 2 * row_floats) + (size_t)j * R * D;                        \
                for (int r = 0; r < R; r++) {                                                          \
                    const T *qr = q + (tok0 + r / G) * q_stride + ((size_t)h * G + r % G) * D;         \
                    for (int d = 0; d < D; d++) tk->qf[(size_t)r * D + d] = TO_F32(qr[d]);             \
                    tk->qb[r] = (const bf16 *)qr;                                                      \
                    if (sizeof(T) == 4 && avx == AVX_BF16) {                                           \
                        for (int d = 0; d < D; d++) qb16[(size_t)r * D + d] = f32_to_bf16(tk->qf[(size_t)r * D + d]); \
                        tk->qb[r] = qb16 + (size_t)r * D;                                              \
                    }                                                                                  \
                    tk->m[r] = NEG_INF;                                                                \
                    tk->l[r] = 0.f;                                                                    \
                }                                                                                      \
                memset(tk->acc, 0, sizeof(float) * R * D);                                             \
                memset(tk->lv, 0, sizeof(float) * 16 * R);                                             \
            }                                                                                          \
            if (k_begin < k_end)                                                                       \
                run_keys_##TC(tks, nh, k_cache, v_cache, block_tables + (size_t)s * max_blocks, k_begin, \
                              k_end, h0, num_kv_heads, bs, avx, ws + 3 * row_floats);                  \
            for (int j = 0; j < nh; j++) {                                                             \
                Task *tk = &tks[j];                                                                    \
                const int h = h0 + j;                                                                  \
                UNPERMUTE_##TC(tk, avx);                                                               \
                if (parts == 1) {                                                                      \
                    for (int r = 0; r < R; r++) {                                                      \
                        T *o = out + (tok0 + r / G) * num_heads * D + ((size_t)h * G + r % G) * D;     \
                        const float inv = sink_inverse(sinks, h * G + r % G, tk->m[r], tk->l[r]);      \
                        for (int d = 0; d < D; d++) o[d] = FROM_F32(tk->acc[(size_t)r * D + d] * inv); \
                    }                                                                                  \
                } else { /* the merge's slot of (task, part) */                                        \
                    float *pw = part_ws + ((size_t)(task0 + j) * parts + part) * (row_floats + 2 * MAX_ROWS); \
                    memcpy(pw, tk->acc, sizeof(float) * R * D);                                        \
                    memcpy(pw + row_floats, tk->m, sizeof(float) * R);                                 \
                    memcpy(pw + row_floats + MAX_ROWS, tk->l, sizeof(float) * R);                      \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        if (parts > 1) { /* 3. merge each task's partitions by their log-sum-exp */                    \
            _Pragma("omp for schedule(static)")                                                           \
            for (int task = 0; task < num_tasks; task++) {                                             \
                const int h = task % num_kv_heads;                                                     \
                const Tile ti = tile_of(task / num_kv_heads, tile_start, query_start_loc);             \
                const int nq = ti.nq;                                                                  \
                const size_t tok0 = ti.tok0;                                                           \
                const float *base = part_ws + (size_t)task * parts * (row_floats + 2 * MAX_ROWS);      \
                for (int r = 0; r < nq * G; r++) {                                                     \
                    float mx = NEG_INF, l = 0.f, o[MAX_HEAD_DIM] = {0};                                \
                    for (int p = 0; p < parts; p++) {                                                  \
                        const float m = base[p * (row_floats + 2 * MAX_ROWS) + row_floats + r];        \
                        mx = m > mx ? m : mx;                                                          \
                    }                                                                                  \
                    for (int p = 0; p < parts; p++) {                                                  \
                        const float *pw = base + p * (row_floats + 2 * MAX_ROWS);                      \
                        if (IS_NEG_INF(pw[row_floats + r])) continue; /* an empty partition */         \
                        const float w = expf(pw[row_floats + r] - mx);                                 \
                        l += w * pw[row_floats + MAX_ROWS + r];                                        \
                        for (int d = 0; d < D; d++) o[d] += w * pw[(size_t)r * D + d];                 \
                    }                                                                                  \
                    T *dst = out + (tok0 + r / G) * num_heads * D + ((size_t)h * G + r % G) * D;       \
                    const float inv = sink_inverse(sinks, h * G + r % G, mx, l);                       \
                    for (int d = 0; d < D; d++) dst[d] = FROM_F32(o[d] * inv);                         \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
                                                                                                       \
    int paged_attention_##NAME(ATTENTION_PARAMS(T, TC)) {                                              \
        size_t thread_floats, part_floats;                                                             \
        int *tile_start = malloc(sizeof(int) * (num_seqs + 1));                                        \
        const int max_len = attention_tiles(num_seqs, query_start_loc, seq_lens, tile_start);          \
        if (attention_workspace(tile_start[num_seqs], max_len, num_heads, num_kv_heads, D, window, kvq, \
                                num_threads, &thread_floats, &part_floats)) {                          \
            free(tile_start);                                                                          \
            return -1;                                                                                 \
        }                                                                                              \
        float *thread_ws = kernel_scratch(0, sizeof(float) * (size_t)num_threads * thread_floats);     \
        float *part_ws = part_floats ? kernel_scratch(1, sizeof(float) * part_floats) : NULL;          \
        _Pragma("omp parallel num_threads(num_threads)")                                               \
        paged_attention_team_##NAME(q, q_stride, k, k_stride, v, v_stride, k_cache, v_cache, slot_mapping, \
                                    num_tokens, block_tables, seq_lens, query_start_loc, out, num_seqs,   \
                                    num_heads, num_kv_heads, D, bs, max_blocks, scale, window, softcap,   \
                                    num_threads, isa, kvq, sinks, tile_start, max_len, thread_ws, part_ws); \
        free(tile_start);                                                                              \
        return 0;                                                                                      \
    }

PAGED_ATTENTION(float, float, float, f32_id, f32_id)
PAGED_ATTENTION(bf16, bf16, bf16, f32_to_bf16, bf16_to_f32)
PAGED_ATTENTION(float_q, float, uint8_t, f32_id, f32_id)
PAGED_ATTENTION(bf16_q, bf16, uint8_t, f32_to_bf16, bf16_to_f32)
