/* R16 weights on AVX2 alone (no AVX-512): the repacked layout of gguf_linear.c (16 rows interleaved per block, 4
 * codes of a row in each int32 lane) against int8 activations, for the CPUs whose best integer product is
 * _mm256_maddubs_epi16 (AMD's Zen 2 and Zen 3 EPYCs, Intel's client cores, older Xeons). A 256-bit register holds
 * 4 codes of 8 rows (a half of a 16-row group); one broadcast int32 (4 activations) meets it in one vpmaddubsw,
 * whose int16 pair sums add up in int16 for as many registers as the codes allow without overflow (8 for 4-bit
 * codes, 8 x 2 x 15 x 127 < 2^15; 4 for 5-bit and MXFP4's; 2 for 6-bit) before one vpmaddwd widens them, against
 * ones or the sub-block scales, into each row's int32 lane. The results are the 8 rows' sums side by side: no
 * horizontal add, one float step per block (32 weights) and row of x, where the blocks' kernel (gguf_q8_linear)
 * pays a vpmaddwd for every 32 products and a horizontal reduction. The layout of ik_llama.cpp's repacked rows
 * (Q4_0_R8 and kin, iqk_mul_mat.cpp), on gguf_linear.c's R16 records.
 *
 * A pass takes both halves of a group against R16A_MM rows of x (dot_chunks): 64 bytes of codes at a time (4
 * registers), each broadcast of x meeting both halves, 8 int16 sums in registers; 1.05-1.5x the pass per half it
 * replaced on a Zen 3 EPYC. Q6_K keeps a pass per half (half_q6k): its two scales per 32 codes and 2-register
 * int16 sums would take 16 registers for both halves.
 *
 * The activations are those of the VNNI kernels: int8 per 32 with the rounded values' sums (Q4_0, Q4_1, MXFP4:
 * the offsets meet the rounded activations, llama.cpp's Q8_1), or per 256 with the codes' sums per 16 and 32 (the
 * K-quants: llama.cpp's Q8_K). Q8_0 has no AVX2 R16 kernel (its codes + 128 overflow vpmaddubsw's pairs): its
 * blocks stay on gguf_q8_linear. */
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "gguf_r16.h"

#if defined(__x86_64__)
#define AVX2A __attribute__((target("avx2,fma,f16c")))
#define INL AVX2A static inline __attribute__((always_inline))

int gguf_r16_avx2_type(int type) {
    return type == Q4_0 || type == Q4_1 || type == MXFP4 || type == Q4_K || type == Q5_K || type == Q6_K;
}

/* gguf_linear.c's: one group of 32 or 256 float32 values to int8 codes, their max |v| and each 32's code sum */
void q8_quantize_f32(const float *v, int group, int8_t *q, float *amax_out, int *sums);

void r16a_prepare_row(const Acts *a, const void *x, int x_bf16, int x_stride, int K, int m, int per256) {
    const int Kp = a->Kp, group = per256 ? 256 : 32;
    int8_t *xq = (int8_t *)a->xq + (size_t)m * Kp;
    for (int k0 = 0; k0 < K; k0 += group) {
        float v[256], amax;
        int sums[8];
        const float *src = (const float *)x + (size_t)m * x_stride + k0;
        if (x_bf16) { /* widened first (exact) */
            const bf16 *b = (const bf16 *)x + (size_t)m * x_stride + k0;
            for (int i = 0; i < group; i++) v[i] = bf16_to_f32(b[i]);
            src = v;
        }
        q8_quantize_f32(src, group, xq + k0, &amax, sums);
        const float d = amax / 127.f;
        if (per256) {
            a->xd[(size_t)m * (Kp / 256) + k0 / 256] = d;
            int16_t *is16 = a->is16 + (size_t)m * (Kp / 16) + k0 / 16, *is32 = a->is32 + (size_t)m * (Kp / 32) + k0 / 32;
            for (int i = 0; i < 16; i++) {
                int s = 0;
                for (int e = 0; e < 16; e++) s += xq[k0 + 16 * i + e];
                is16[i] = (int16_t)s;
            }
            for (int i = 0; i < 8; i++) is32[i] = (int16_t)sums[i];
        } else {
            a->xd[(size_t)m * (Kp / 32) + k0 / 32] = d;
            a->xsum32[(size_t)m * (Kp / 32) + k0 / 32] = d * (float)sums[0];
        }
    }
}

/* the int32 at p broadcast (4 int8 activations) */
INL __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return _mm256_set1_epi32(v);
}

/* 8 int32 (a byte each, zero or sign extended) as int16 pairs (v, v): a vpmaddwd factor per row */
INL __m256i pair16(__m256i v32) {
    return _mm256_or_si256(_mm256_and_si256(v32, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v32, 16));
}

/* The 8 codes registers of half h (rows 8h..8h+7) of a 32-weight block of 4-bit codes at c (256 bytes, the R16
 * 4-bit layout): q[p] codes 4p..4p+3, q[p + 4] codes 16 + 4p.. of each row, one int32 lane a row */
INL void codes4(const uint8_t *c, int h, __m256i *q) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; p++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(c + 64 * p + 32 * h));
        q[p] = _mm256_and_si256(v, nib), q[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
    }
}

/* stores the 8 results v of row `row` at columns n0.. (the first n) */
INL void store8(__m256 v, void *y, int y_bf16, int y_stride, int row, int n0, int n) {
    float t[8];
    _mm256_storeu_ps(t, v);
    const size_t at = (size_t)row * y_stride + n0;
    if (y_bf16)
        for (int r = 0; r < n; r++) ((bf16 *)y)[at + r] = f32_to_bf16(t[r]);
    else if (n == 8)
        _mm256_storeu_ps((float *)y + at, v);
    else
        memcpy((float *)y + at, t, sizeof(float) * (size_t)n);
}

/* Chunk p of a record's codes at c (the R16 layout: 64 bytes a chunk, rows 0-7 then 8-15) for both halves, as
 * unsigned bytes: q[0], q[1] codes 4p..4p+3 of rows 0-7 and 8-15, q[2], q[3] codes 16 + 4p.. of the same rows.
 * Nibbles for Q4_0, Q4_1, Q4_K; MXFP4's doubled E2M1 values + 12 (0..24, a byte shuffle); Q5_K's fifth bits from
 * its sub-block's plane at f (64 bytes: register z's half h at 8z + 4h) */
INL void chunk4(const int TYPE, const uint8_t *c, const uint8_t *f, int p, __m256i *q) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i v0 = _mm256_loadu_si256((const __m256i *)(c + 64 * p));
    const __m256i v1 = _mm256_loadu_si256((const __m256i *)(c + 64 * p + 32));
    q[0] = _mm256_and_si256(v0, nib), q[1] = _mm256_and_si256(v1, nib);
    q[2] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nib), q[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nib);
    if (TYPE == MXFP4) { /* ggml's kvalues_mxfp4 plus 12 by index, in each 128-bit lane */
        const __m256i fp4 = _mm256_broadcastsi128_si256(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
        for (int i = 0; i < 4; i++) q[i] = _mm256_shuffle_epi8(fp4, q[i]);
    }
    if (TYPE == Q5_K)
        for (int i = 0; i < 4; i++) /* register z = p (+ 4 for the high nibbles), half i % 2 */
            q[i] = _mm256_or_si256(q[i], fifth_bits32(f + 8 * (p + 4 * (i / 2)) + 4 * (i % 2)));
}

/* Chunks p0..p1 - 1 of a record's codes (chunk4's c, f) against MM rows of int8 activations (x, rows Kp apart, at
 * the record's first weight): S[2j + h] the int16 pair sums of row j of x and half h, 4 vpmaddubsw a chunk and
 * half added in int16 (no overflow: 4 chunks of 4-bit codes, 8 x 2 x 15 x 127 < 2^15; 2 of 5-bit codes or of
 * MXFP4's up to 24). Both halves meet each broadcast of x, and each chunk's codes are decoded once for the MM rows. */
INL void dot_chunks(const int TYPE, const uint8_t *c, const uint8_t *f, int p0, int p1, const int8_t *x, int Kp,
                    const int MM, __m256i *S) {
    for (int j = 0; j < 2 * MM; j++) S[j] = _mm256_setzero_si256();
    for (int p = p0; p < p1; p++) {
        __m256i q[4];
        chunk4(TYPE, c, f, p, q);
        for (int j = 0; j < MM; j++) {
            const __m256i xa = bcast4(x + (size_t)j * Kp + 4 * p), xb = bcast4(x + (size_t)j * Kp + 16 + 4 * p);
            S[2 * j] = _mm256_add_epi16(S[2 * j], _mm256_add_epi16(_mm256_maddubs_epi16(q[0], xa),
                                                                   _mm256_maddubs_epi16(q[2], xb)));
            S[2 * j + 1] = _mm256_add_epi16(S[2 * j + 1], _mm256_add_epi16(_mm256_maddubs_epi16(q[1], xa),
                                                                           _mm256_maddubs_epi16(q[3], xb)));
            /* the sums whole after each chunk: else GCC reassociates the adds across chunks and holds all of a
             * record's products at once, in stack spills (1.3x slower) */
            __asm__("" : "+x"(S[2 * j]), "+x"(S[2 * j + 1]));
        }
    }
}

/* A group of a 32-weight TYPE (Q4_0, Q4_1, MXFP4), both halves a pass, against MM rows of x from row m0: acc[2j +
 * h] = the outputs of rows 8h..8h+7 for row m0 + j. Per block: w = d code + m, y += d dx (codes . xq) + m (dx sum
 * xq); Q4_0's m = -8 d (MXFP4's -12 d) folds into one FMA: y += d (dx (codes . xq) - 8 dx sum xq) */
INL void pair32(const Acts *a, const int TYPE, const int MM, const uint8_t *grp, int nb, int m0, __m256 *acc) {
    const int Kp = a->Kp, rec_bytes = r16_record_bytes(TYPE), step = TYPE == MXFP4 ? 2 : 4;
    const float off = TYPE == MXFP4 ? -12.f : -8.f;
    const int8_t *x0 = (const int8_t *)a->xq + (size_t)m0 * Kp;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int j = 0; j < 2 * MM; j++) acc[j] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *rec = grp + (size_t)b * rec_bytes, *sc = rec + 256;
        for (int l = 0; l < rec_bytes; l += 64) _mm_prefetch((const char *)(rec + 4 * rec_bytes + l), _MM_HINT_T0);
        __m256i I[2 * R16A_MM];
        for (int p0 = 0; p0 < 4; p0 += step) {
            __m256i S[2 * R16A_MM];
            dot_chunks(TYPE, rec, NULL, p0, p0 + step, x0 + 32 * b, Kp, MM, S);
            for (int j = 0; j < 2 * MM; j++)
                I[j] = p0 ? _mm256_add_epi32(I[j], _mm256_madd_epi16(S[j], ones)) : _mm256_madd_epi16(S[j], ones);
        }
        __m256 d[2], m[2];
        for (int h = 0; h < 2; h++) {
            if (TYPE == MXFP4) { /* E8M0 bytes: 2^(e - 128), subnormal below e = 2 (ggml's e8m0_to_fp32_half) */
                const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * h)));
                const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
                const __m256i tiny = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
                d[h] = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, tiny, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
            } else {
                d[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * h)));
            }
            if (TYPE == Q4_1) m[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32 + 16 * h)));
        }
        for (int j = 0; j < MM; j++) {
            const size_t at = (size_t)(m0 + j) * (Kp / 32) + b;
            const __m256 dx = _mm256_set1_ps(a->xd[at]);
            for (int h = 0; h < 2; h++) {
                const __m256 s = _mm256_cvtepi32_ps(I[2 * j + h]);
                if (TYPE == Q4_1) {
                    acc[2 * j + h] = _mm256_fmadd_ps(_mm256_mul_ps(s, dx), d[h], acc[2 * j + h]);
                    acc[2 * j + h] = _mm256_fmadd_ps(m[h], _mm256_set1_ps(a->xsum32[at]), acc[2 * j + h]);
                } else {
                    const __m256 t = _mm256_fmadd_ps(s, dx, _mm256_set1_ps(off * a->xsum32[at]));
                    acc[2 * j + h] = _mm256_fmadd_ps(t, d[h], acc[2 * j + h]);
                }
            }
        }
    }
}

/* A group of Q4_K or Q5_K, both halves a pass, against MM rows of x quantized per 256 (llama.cpp's
 * ggml_vec_dot_q4_K_q8_K arithmetic): each sub-block's int16 sums (all 4 chunks for 4-bit codes, 2 at a time for
 * 5-bit) meet its integer scale in vpmaddwd, a super-block sums in int32 (below 2^31: 8 x 63 x 32 x 31 x 127) and
 * takes one float step per row: y += d dx sum_j sc_j (q_j . x_j) - dmin dx sum_j m_j sum(x_j) */
INL void pairk(const Acts *a, const int TYPE, const int MM, const uint8_t *grp, int nsb, int m0, __m256 *acc) {
    const int Kp = a->Kp, cb = r16_codes_end(TYPE), rec_bytes = r16_record_bytes(TYPE), step = TYPE == Q5_K ? 2 : 4;
    const int8_t *x0 = (const int8_t *)a->xq + (size_t)m0 * Kp;
    for (int j = 0; j < 2 * MM; j++) acc[j] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *rec = grp + (size_t)sb * rec_bytes, *sc = rec + cb;
        __m256i A[2 * R16A_MM];
        for (int j = 0; j < 2 * MM; j++) A[j] = _mm256_setzero_si256();
        for (int jb = 0; jb < 8; jb++) {
            for (int l = 0; l < rec_bytes / 8; l += 64)
                _mm_prefetch((const char *)(rec + 2 * rec_bytes + jb * (rec_bytes / 8) + l), _MM_HINT_T0);
            __m256i s[2]; /* each half's sub-block scales as vpmaddwd factors */
            for (int h = 0; h < 2; h++)
                s[h] = pair16(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 64 + 16 * jb + 8 * h))));
            for (int p0 = 0; p0 < 4; p0 += step) {
                __m256i S[2 * R16A_MM];
                dot_chunks(TYPE, rec + 256 * jb, rec + 2048 + 64 * jb, p0, p0 + step, x0 + 256 * sb + 32 * jb, Kp, MM, S);
                for (int j = 0; j < 2 * MM; j++) A[j] = _mm256_add_epi32(A[j], _mm256_madd_epi16(S[j], s[j % 2]));
            }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * h)));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 32 + 16 * h)));
            __m256i mp[4]; /* (m_2t, m_2t+1) of each row as two int16 */
            for (int t = 0; t < 4; t++)
                mp[t] = _mm256_or_si256(
                    _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 192 + 32 * t + 8 * h))),
                    _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 208 + 32 * t + 8 * h))), 16));
            for (int j = 0; j < MM; j++) {
                const int16_t *s32 = a->is32 + (size_t)(m0 + j) * (Kp / 32) + 8 * sb;
                __m256i B = _mm256_setzero_si256();
                for (int t = 0; t < 4; t++) B = _mm256_add_epi32(B, _mm256_madd_epi16(mp[t], bcast4((const int8_t *)(s32 + 2 * t))));
                const __m256 dx = _mm256_set1_ps(a->xd[(size_t)(m0 + j) * (Kp / 256) + sb]);
                acc[2 * j + h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(A[2 * j + h]), _mm256_mul_ps(d, dx), acc[2 * j + h]);
                acc[2 * j + h] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(B), _mm256_mul_ps(dmin, dx), acc[2 * j + h]);
            }
        }
    }
}

/* Half h (rows 8h..8h+7) of a Q6_K group against MM rows of x quantized per 256: its 6-bit codes allow 2
 * vpmaddubsw of int16 sums (2 x 2 x 63 x 127 < 2^15) before the sub-block's scale (one per 16 codes) meets them in
 * vpmaddwd, so a half's 8 code registers and 4 vpmaddwd a row leave no registers for the other half (dot_chunks'
 * pass over both). A super-block sums in int32 (below 2^31: 16 x 128 x 16 x 63 x 127) and takes one float step per
 * row: y += d dx sum_h sc_h ((q_h - 32) . x_h), its -32 through the codes' sums per 16 (llama.cpp's
 * ggml_vec_dot_q6_K_q8_K arithmetic) */
INL void half_q6k(const Acts *a, const int MM, const uint8_t *grp, int nsb, int m0, int h, __m256 *acc) {
    const int Kp = a->Kp, rec_bytes = r16_record_bytes(Q6_K);
    const int8_t *x0 = (const int8_t *)a->xq + (size_t)m0 * Kp;
    for (int j = 0; j < MM; j++) acc[j] = _mm256_setzero_ps();
    for (int sb = 0; sb < nsb; sb++) {
        const uint8_t *rec = grp + (size_t)sb * rec_bytes, *sc = rec + r16_codes_end(Q6_K);
        __m256i A[R16A_MM];
        for (int j = 0; j < MM; j++) A[j] = _mm256_setzero_si256();
        for (int jb = 0; jb < 8; jb++) {
            for (int l = 0; l < (rec_bytes / 8 + 63) / 64; l++)
                _mm_prefetch((const char *)(rec + 2 * rec_bytes + jb * (rec_bytes / 8) + 64 * l), _MM_HINT_T0);
            __m256i q[8];
            codes4(rec + 256 * jb, h, q);
            for (int g = 0; g < 2; g++) { /* the fifth and sixth bits, R16_Q6K_SHIFT */
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(rec + 2048 + 128 * jb + 64 * g + 32 * h));
                const __m256i m30 = _mm256_set1_epi8(0x30);
                q[4 * g] = _mm256_or_si256(q[4 * g], _mm256_and_si256(hb, m30));
                q[4 * g + 1] = _mm256_or_si256(q[4 * g + 1], _mm256_and_si256(_mm256_srli_epi16(hb, 2), m30));
                q[4 * g + 2] = _mm256_or_si256(q[4 * g + 2], _mm256_and_si256(_mm256_slli_epi16(hb, 4), m30));
                q[4 * g + 3] = _mm256_or_si256(q[4 * g + 3], _mm256_and_si256(_mm256_slli_epi16(hb, 2), m30));
            }
            /* the vpmaddwd factors: the scales of codes 0-15 and 16-31 */
            const __m256i s0 = pair16(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 32 + 32 * jb + 8 * h))));
            const __m256i s1 = pair16(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 48 + 32 * jb + 8 * h))));
            const int8_t *xb = x0 + 256 * sb + 32 * jb;
            for (int j = 0; j < MM; j++) {
                const int8_t *xj = xb + (size_t)j * Kp;
                __m256i p[8];
                for (int z = 0; z < 4; z++)
                    p[z] = _mm256_maddubs_epi16(q[z], bcast4(xj + 4 * z)),
                    p[z + 4] = _mm256_maddubs_epi16(q[z + 4], bcast4(xj + 16 + 4 * z));
                const __m256i s = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), s0),
                                                                    _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), s0)),
                                                   _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), s1),
                                                                    _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), s1)));
                A[j] = _mm256_add_epi32(A[j], s);
                __asm__("" : "+x"(A[j])); /* as dot_chunks: no reassociation across sub-blocks */
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + 16 * h)));
        __m256i sp[8]; /* (s_2t, s_2t+1) of each row as two int16 */
        for (int t = 0; t < 8; t++)
            sp[t] = _mm256_or_si256(
                _mm256_and_si256(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 32 + 32 * t + 8 * h))),
                                 _mm256_set1_epi32(0xFFFF)),
                _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 48 + 32 * t + 8 * h))), 16));
        for (int j = 0; j < MM; j++) {
            const int16_t *x16 = a->is16 + (size_t)(m0 + j) * (Kp / 16) + 16 * sb;
            __m256i B = _mm256_setzero_si256();
            for (int t = 0; t < 8; t++) B = _mm256_add_epi32(B, _mm256_madd_epi16(sp[t], bcast4((const int8_t *)(x16 + 2 * t))));
            const __m256i S = _mm256_sub_epi32(A[j], _mm256_slli_epi32(B, 5));
            const float dx = a->xd[(size_t)(m0 + j) * (Kp / 256) + sb];
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[j]);
        }
    }
}

/* One group of 16 rows (n0.., the first nr real) against MM rows of x from m0: y[m0 + j][n0 + r]; both halves a
 * pass (Q6_K: half by half) */
#define R16A_GROUP(TYPE, MM)                                                                                         \
    AVX2A static void r16a_group_##TYPE##_##MM(const Acts *a, const uint8_t *grp, int nb, int m0, void *y,           \
                                               int y_bf16, int y_stride, int n0, int nr) {                           \
        __m256 acc[2 * MM];                                                                                          \
        if (TYPE == Q6_K)                                                                                            \
            for (int h = 0; h < 2 && 8 * h < nr; h++) {                                                              \
                __m256 half[MM];                                                                                     \
                half_q6k(a, MM, grp, nb, m0, h, half);                                                               \
                for (int j = 0; j < MM; j++) acc[2 * j + h] = half[j];                                               \
            }                                                                                                        \
        else if (TYPE == Q4_K || TYPE == Q5_K)                                                                       \
            pairk(a, TYPE, MM, grp, nb, m0, acc);                                                                    \
        else                                                                                                         \
            pair32(a, TYPE, MM, grp, nb, m0, acc);                                                                   \
        for (int h = 0; h < 2 && 8 * h < nr; h++) {                                                                  \
            const int n = nr - 8 * h < 8 ? nr - 8 * h : 8;                                                           \
            for (int j = 0; j < MM; j++) store8(acc[2 * j + h], y, y_bf16, y_stride, m0 + j, n0 + 8 * h, n);         \
        }                                                                                                            \
    }
#define R16A_INSTANCES(TYPE) R16A_GROUP(TYPE, 1) R16A_GROUP(TYPE, 2) R16A_GROUP(TYPE, 3) R16A_GROUP(TYPE, 4)
R16A_INSTANCES(Q4_0)
R16A_INSTANCES(Q4_1)
R16A_INSTANCES(MXFP4)
R16A_INSTANCES(Q4_K)
R16A_INSTANCES(Q5_K)
R16A_INSTANCES(Q6_K)

void r16a_group(int type, int mm, const Acts *a, const uint8_t *grp, int nb, int m0, void *y, int y_bf16,
                int y_stride, int n0, int nr) {
    typedef void (*fn)(const Acts *, const uint8_t *, int, int, void *, int, int, int, int);
#define FNS(T) {r16a_group_##T##_1, r16a_group_##T##_2, r16a_group_##T##_3, r16a_group_##T##_4}
    static const fn fns[6][R16A_MM] = {FNS(Q4_0), FNS(Q4_1), FNS(MXFP4), FNS(Q4_K), FNS(Q5_K), FNS(Q6_K)};
#undef FNS
    const int t = type == Q4_0 ? 0 : type == Q4_1 ? 1 : type == MXFP4 ? 2 : type == Q4_K ? 3 : type == Q5_K ? 4 : 5;
    fns[t][mm - 1](a, grp, nb, m0, y, y_bf16, y_stride, n0, nr);
}
#else
int gguf_r16_avx2_type(int type) {
    (void)type;
    return 0;
}
#endif
