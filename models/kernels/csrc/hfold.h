/* Horizontal reductions of 16 AVX-512 registers at once, transpose-free (shared by gguf_linear.c's activation
 * quantization and paged_attention.c's scores): NAME_fold4 folds v[0..3] into one register whose 128-bit lane L
 * holds, for each v[i] (at position i), OP over v[i]'s lane L; NAME_lanes folds four such u[0..3] (of v[0..15])
 * into lane j = OP over all of v[j]. 45 shuffles and OPs for 16 registers where 16 reductions one by one take ~130.
 * ATTR: the functions' target attribute (AVX512F at least). */
#ifndef MINIVLLM_HFOLD_H
#define MINIVLLM_HFOLD_H
#if defined(__x86_64__)
#include <immintrin.h>

#define HFOLD(ATTR, NAME, OP)                                                                                     \
    ATTR static inline __m512 NAME##_fold4(const __m512 *v) {                                                     \
        const __m512 t0 = OP(_mm512_unpacklo_ps(v[0], v[1]), _mm512_unpackhi_ps(v[0], v[1]));                    \
        const __m512 t1 = OP(_mm512_unpacklo_ps(v[2], v[3]), _mm512_unpackhi_ps(v[2], v[3]));                    \
        const __m512d a = _mm512_castps_pd(t0), b = _mm512_castps_pd(t1);                                       \
        return OP(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));      \
    }                                                                                                             \
    ATTR static inline __m512 NAME##_lanes(const __m512 *u) {                                                     \
        const __m512 w0 = OP(_mm512_shuffle_f32x4(u[0], u[1], 0x44), _mm512_shuffle_f32x4(u[0], u[1], 0xEE));    \
        const __m512 w1 = OP(_mm512_shuffle_f32x4(u[2], u[3], 0x44), _mm512_shuffle_f32x4(u[2], u[3], 0xEE));    \
        return OP(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));                        \
    }
#endif
#endif
