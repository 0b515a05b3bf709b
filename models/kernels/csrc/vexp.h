/* The vector exponentials of the kernels (paged_attention.c's softmax, layer_ops.c's SiLU): e^x = 2^n e^r with
 * n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts, Cody-Waite) and e^r a degree-6 Taylor polynomial,
 * |relative error| < 2e-7. */
#ifndef MINIVLLM_VEXP_H
#define MINIVLLM_VEXP_H
#if defined(__x86_64__)
#include <immintrin.h>

/* e^r for |r| <= ln 2 / 2: the degree-6 Taylor polynomial of the vector exps, in FMADD's width */
#define EXP_TAYLOR6(FMADD, SET1, r)                                                                                \
    FMADD(FMADD(FMADD(FMADD(FMADD(FMADD(SET1(1.f / 720), r, SET1(1.f / 120)), r, SET1(1.f / 24)), r, SET1(1.f / 6)), \
                      r, SET1(0.5f)),                                                                            \
                r, SET1(1.f)),                                                                                   \
          r, SET1(1.f))

/* exp(x) for x <= 88 (softmax arguments, SiLU's e^-x held below float32's overflow), 0 below -87 */
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    const __m512 p = EXP_TAYLOR6(_mm512_fmadd_ps, _mm512_set1_ps, r);
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
