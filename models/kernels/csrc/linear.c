/* y = x W^T (+ b) in bfloat16 for the few rows of a decode step, at the speed of streaming W.
 *
 * With few rows (batch-1 to batch-16 decodes) a linear layer is a matrix-vector product bound by reading
 * its weights once; general GEMM libraries lose much of the bandwidth at these shapes on small matrices
 * (per-call setup, blocking for large M). Here W [N, K] stays in its row-major nn.Linear layout (no
 * repacked copy): each thread streams a contiguous range of W's rows, 4 rows at a time, and for every
 * group of up to 4 rows of x computes the 16 dot products with AVX512-BF16 (_mm512_dpbf16_ps: exact
 * products, float32 sums), so a 4-row tile of W read once from memory serves all of x from L1.
 * Larger batches are compute-bound and go to torch's GEMM.
 *
 * x [M, K] bf16 (rows `x_stride` apart), W [N, K] bf16, bias [N] bf16 or NULL, y [M, N] bf16.
 * Returns -1 where AVX512-BF16 is missing (the caller uses torch).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "bf16.h"

#if defined(__x86_64__)
#define AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* W is read 4 rows at a time, 4 interleaved streams that each end after K / 32 cache lines: too short
 * for the hardware prefetchers to follow (measured: one core streamed 6 GB/s of W, latency-bound, where
 * a plain sum streams 36). So each load also prefetches the same line PREFETCH_ROWS rows further on,
 * about two tiles ahead of use. */
#define PREFETCH_ROWS 8

/* Rows n0 .. n0 + nn (nn <= 4) of W against rows m0 .. m0 + MM of x, MM a constant (1..4) so the
 * accumulators stay in registers. */
#define TILE(MM)                                                                                       \
    AVX512BF16 static void tile_##MM(const bf16 *x, int x_stride, const bf16 *w, const bf16 *bias, bf16 *y, \
                                     int N, int K, int n0, int nn, int m0) {                           \
        __m512 acc[4][MM];                                                                             \
        for (int i = 0; i < 4; i++)                                                                    \
            for (int j = 0; j < MM; j++) acc[i][j] = _mm512_setzero_ps();                              \
        const bf16 *wr[4];                                                                             \
        for (int i = 0; i < 4; i++) wr[i] = w + (size_t)(n0 + (i < nn ? i : 0)) * K;                   \
        for (int k = 0; k < K; k += 32) {                                                              \
            const __mmask32 mask = K - k >= 32 ? 0xFFFFFFFFu : (1u << (K - k)) - 1;                    \
            __m512bh wv[4];                                                                            \
            for (int i = 0; i < 4; i++) {                                                              \
                _mm_prefetch((const char *)(wr[i] + k + PREFETCH_ROWS * K), _MM_HINT_T0);              \
                wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mask, wr[i] + k);                           \
            }                                                                                          \
            for (int j = 0; j < MM; j++) {                                                             \
                const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + (size_t)(m0 + j) * x_stride + k); \
                for (int i = 0; i < 4; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);        \
            }                                                                                          \
        }                                                                                              \
        for (int j = 0; j < MM; j++)                                                                   \
            for (int i = 0; i < nn; i++) {                                                             \
                float v = _mm512_reduce_add_ps(acc[i][j]);                                             \
                if (bias) v += bf16_to_f32(bias[n0 + i]);                                              \
                y[(size_t)(m0 + j) * N + n0 + i] = f32_to_bf16(v);                                     \
            }                                                                                          \
    }
TILE(1)
TILE(2)
TILE(3)
TILE(4)

AVX512BF16 static void linear_avx512bf16(const bf16 *x, int x_stride, const bf16 *w, const bf16 *bias, bf16 *y,
                                         int M, int N, int K, int num_threads) {
    /* contiguous row ranges per thread, 4-row aligned: each thread streams its part of W once */
    const int groups = (N + 3) / 4;
    _Pragma("omp parallel num_threads(num_threads)") {
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();
        const int g0 = (int)((long)groups * id / nt), g1 = (int)((long)groups * (id + 1) / nt);
        for (int g = g0; g < g1; g++) {
            const int n0 = 4 * g, nn = N - n0 < 4 ? N - n0 : 4;
            for (int m0 = 0; m0 < M; m0 += 4) {
                switch (M - m0 < 4 ? M - m0 : 4) {
                case 1: tile_1(x, x_stride, w, bias, y, N, K, n0, nn, m0); break;
                case 2: tile_2(x, x_stride, w, bias, y, N, K, n0, nn, m0); break;
                case 3: tile_3(x, x_stride, w, bias, y, N, K, n0, nn, m0); break;
                default: tile_4(x, x_stride, w, bias, y, N, K, n0, nn, m0);
                }
            }
        }
    }
}

static int has_avx512bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}
#endif

int linear_bf16(const bf16 *x, int x_stride, const bf16 *w, const bf16 *bias, bf16 *y, int M, int N, int K,
                int num_threads) {
#if defined(__x86_64__)
    if (has_avx512bf16()) {
        linear_avx512bf16(x, x_stride, w, bias, y, M, N, K, num_threads);
        return 0;
    }
#endif
    (void)x, (void)x_stride, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
}

/* ---- 16-bit weights against float32 activations: AVX2 + F16C ----
 *
 * y = x W^T for W float16 or bfloat16 [N, K] (a GGUF file's F16 / BF16 tensors, kept 16-bit as llama.cpp keeps
 * them rather than widened to float32 copies twice the size) and x [M, K] float32, y [M, N] float32: each weight is
 * widened to float32 in registers (exact) and multiplied with the activation, float32 sums; so y is the float32
 * product with W's values, as torch's on a float32 copy of W (up to summation order). Few rows: the same
 * weight-streaming scheme as above, 4 rows of W at a time against 2 rows of x (8 accumulators in the 16 ymm
 * registers). Returns -1 where AVX2, FMA or F16C is missing (the caller widens W for torch). */
#if defined(__x86_64__)
#define AVX2F16 __attribute__((target("avx2,fma,f16c")))

AVX2F16 static inline __m256 load8_w(const uint16_t *p, int w_bf16) {
    const __m128i h = _mm_loadu_si128((const __m128i *)p);
    return w_bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)) : _mm256_cvtph_ps(h);
}

AVX2F16 static inline float w_at(const uint16_t *w, int w_bf16, size_t i) {
    return w_bf16 ? bf16_to_f32(w[i]) : _cvtsh_ss(w[i]);
}

AVX2F16 static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

/* rows n0 .. n0 + nn (nn <= 4) of W against rows m0 .. m0 + MM of x, MM a constant (1 or 2) so the
 * accumulators stay in registers; K in steps of 32 (one cache line of each W row, prefetched PREFETCH_ROWS rows
 * ahead), then of 8, then single columns */
#define HALF_TILE(MM)                                                                                              \
    AVX2F16 static void half_tile_##MM(const float *x, int x_stride, const uint16_t *w, int w_bf16, float *y,      \
                                       int N, int K, int n0, int nn, int m0) {                                     \
        __m256 acc[4][MM];                                                                                         \
        for (int i = 0; i < 4; i++)                                                                                \
            for (int j = 0; j < MM; j++) acc[i][j] = _mm256_setzero_ps();                                          \
        const uint16_t *wr[4];                                                                                     \
        for (int i = 0; i < 4; i++) wr[i] = w + (size_t)(n0 + (i < nn ? i : 0)) * K;                               \
        const float *xr[MM];                                                                                       \
        for (int j = 0; j < MM; j++) xr[j] = x + (size_t)(m0 + j) * x_stride;                                      \
        int k = 0;                                                                                                 \
        for (; k + 32 <= K; k += 32) {                                                                             \
            for (int i = 0; i < 4; i++) _mm_prefetch((const char *)(wr[i] + k + PREFETCH_ROWS * (size_t)K), _MM_HINT_T0); \
            for (int kk = k; kk < k + 32; kk += 8) {                                                               \
                __m256 a[MM];                                                                                      \
                for (int j = 0; j < MM; j++) a[j] = _mm256_loadu_ps(xr[j] + kk);                                   \
                for (int i = 0; i < 4; i++) {                                                                      \
                    const __m256 wv = load8_w(wr[i] + kk, w_bf16);                                                 \
                    for (int j = 0; j < MM; j++) acc[i][j] = _mm256_fmadd_ps(wv, a[j], acc[i][j]);                 \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (; k + 8 <= K; k += 8)                                                                                 \
            for (int i = 0; i < 4; i++) {                                                                          \
                const __m256 wv = load8_w(wr[i] + k, w_bf16);                                                      \
                for (int j = 0; j < MM; j++) acc[i][j] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xr[j] + k), acc[i][j]); \
            }                                                                                                      \
        for (int j = 0; j < MM; j++)                                                                               \
            for (int i = 0; i < nn; i++) {                                                                         \
                float v = hsum256(acc[i][j]);                                                                      \
                for (int c = k; c < K; c++) v += w_at(wr[i], w_bf16, c) * xr[j][c];                                \
                y[(size_t)(m0 + j) * N + n0 + i] = v;                                                              \
            }                                                                                                      \
    }
HALF_TILE(1)
HALF_TILE(2)

static int has_f16c(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#endif

int linear_half(const float *x, int x_stride, const uint16_t *w, int w_bf16, float *y, int M, int N, int K,
                int num_threads) {
#if defined(__x86_64__)
    if (has_f16c()) {
        const int groups = (N + 3) / 4;
        _Pragma("omp parallel num_threads(num_threads)") {
            const int nt = omp_get_num_threads(), id = omp_get_thread_num();
            const int g0 = (int)((long)groups * id / nt), g1 = (int)((long)groups * (id + 1) / nt);
            for (int g = g0; g < g1; g++) {
                const int n0 = 4 * g, nn = N - n0 < 4 ? N - n0 : 4;
                for (int m0 = 0; m0 < M; m0 += 2) {
                    if (M - m0 == 1)
                        half_tile_1(x, x_stride, w, w_bf16, y, N, K, n0, nn, m0);
                    else
                        half_tile_2(x, x_stride, w, w_bf16, y, N, K, n0, nn, m0);
                }
            }
        }
        return 0;
    }
#endif
    (void)x, (void)x_stride, (void)w, (void)w_bf16, (void)y, (void)M, (void)N, (void)K, (void)num_threads;
    return -1;
}
