/* y = x W^T on AMX tiles (Intel Xeons since Sapphire Rapids) for weights repacked to R16 (gguf_linear.c).
 *
 * W4A16, as vLLM-CPU's AMX kernel for AWQ/GPTQ int4 weights: each group of 16 weight rows is dequantized once per
 * call (w = s q + o in float32, one fused multiply-add, rounded to bfloat16) into K / 32 B tiles of 16 rows x 64
 * bytes, row k / 2 holding the pairs (w[n][k], w[n][k + 1]) of the 16 weight rows n; the activations are bfloat16
 * rows (float32 ones rounded), 32 per A tile; TDPBF16PS accumulates the products in float32 tiles over all K. Two
 * groups of weight rows and two tiles of 16 activation rows at a time: 4 result tiles (tmm4..tmm7) fed by 2 A
 * (tmm0, tmm1) and 2 B tiles (tmm2, tmm3), one tile load per tile op. Each thread takes a run of whole pairs of
 * groups, so each core streams its own weights once, and dequantizes them a block of pairs at a time (AMX_B_BYTES
 * of B tiles, kept in its L2) that every 32 activation rows pass over in turn: a prompt step's activations are read
 * once per block, not once per pair; where K is long, a pass takes AMX_KC tile columns of K over every pair of the
 * block (those 32 rows' A tiles stay in the L1), the pairs' sums kept between passes in memory (the 4 result tiles
 * stored and loaded again: float32, exact, the same order of additions). The activations' rows are K + 32 values
 * apart, so that an A tile's 16 rows do not share one L1 set where a row is 4 KB. Buffers are the threads' own, kept
 * between calls (kernel_scratch).
 *
 * Why not int8 tiles (llama.cpp's ggml-cpu/amx/mmq.cpp: activations to int8 per 32, one TDPBSSD / TDPBSUD per
 * 32-weight block, the int32 tile stored and rescaled by the block's scales after every op): measured on an Emerald
 * Rapids Xeon (docs/benchmarks.md), one 16 x 16 x 32 int8 op with its zeroing, tile loads and store took ~90 TSC
 * cycles where back-to-back 16 x 16 x 64 ops took ~40: the per-block store and rescale bound that scheme, and our
 * int8 kernel (software-pipelined, 8 blocks in flight) ran 1.0-2.0x slower than this one at 64 rows and 1.4-2.1x
 * at 512, with the activations rounded to int8 besides.
 *
 * Safe on every CPU: gguf_amx_probe() checks CPUID (AMX-TILE, AMX-BF16, AVX512-BF16), that the OS enables the tile
 * state (XCR0), asks Linux for the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM) and runs one tile op
 * under a SIGILL guard against its exact result; gguf_amx_enable() refuses to turn the tiles on before that passed.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "gguf_r16.h"

#define AMX_KC 16 /* tile columns of K a pass takes where K > 2 AMX_KC tiles (32 values each) */
#define AMX_B_BYTES (1024 << 10) /* B tiles a thread keeps in its L2 (2 MB a core on Sapphire Rapids and later) */

void *kernel_scratch(int slot, size_t bytes); /* paged_attention.c: a thread's buffer kept between calls */

static int amx_min_rows; /* rows of x from which gguf_r16_linear takes the tiles; 0: never */
static int amx_state = 2; /* gguf_amx_probe's result; 2: not probed */

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX                                                                                                    \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx512dq,avx512vbmi,f16c,fma")))
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* the 64-byte tile configuration of LDTILECFG (palette 1) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

#define AMX_INLINE AMX static inline __attribute__((always_inline))

/* every tile 16 rows x 64 bytes: A 16 activation rows x 32 bfloat16, B 16 pair rows x 16 weight rows, C 16 x 16
 * float32 */
AMX static void bf16_configure(void) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

/* a per-row vector v (lane n: weight row n) as two vectors in a B tile row's order, each lane twice: d[h] lanes
 * (2i, 2i + 1) = v[8h + i] */
AMX_INLINE void rows_twice(__m512 v, __m512 d[2]) {
    const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    d[0] = _mm512_permutexvar_ps(lo, v);
    d[1] = _mm512_permutexvar_ps(_mm512_add_epi32(lo, _mm512_set1_epi32(8)), v);
}

/* the 4 codes of each lane of wq (codes k..k+3 of 16 weight rows) with scale s and offset o per row (rows_twice), as
 * the two B tile rows (k / 2, k / 2 + 1) of bfloat16 pairs at dst. One byte permute with zeroing gathers the codes
 * (k, k + 1) (or (k + 2, k + 3)) of 8 rows as 16 int32 lanes in the tile row's order, so that the bfloat16 pair
 * conversion of two of them is the tile row (a shift and a mask a code, and a word permute a tile row, before) */
AMX_INLINE void bf16_pairs(__m512i wq, const __m512 s[2], const __m512 o[2], bf16 *dst) {
    for (int r = 0; r < 2; r++) {
        __m512 w[2];
        for (int h = 0; h < 2; h++) { /* lane 2i + j: byte 4 (8h + i) + 2r + j of wq */
            const int b = 32 * h + 2 * r;
            const __m512i idx = _mm512_set_epi32(b + 29, b + 28, b + 25, b + 24, b + 21, b + 20, b + 17, b + 16, b + 13,
                                                 b + 12, b + 9, b + 8, b + 5, b + 4, b + 1, b);
            const __m512i q = _mm512_maskz_permutexvar_epi8(0x1111111111111111ull, idx, wq);
            w[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), s[h], o[h]);
        }
        _mm512_store_si512(dst + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
    }
}

/* a group of 16 weight rows (R16 records over all K) as K / 32 bfloat16 B tiles at dst (1 KB each) */
AMX static void bf16_unpack(int type, const uint8_t *grp, int K, bf16 *dst) {
    const int rb = r16_record_bytes(type);
    __m512i wq[8];
    if (block_weights(type) == 32) {
        for (int b = 0; b < K / 32; b++) {
            const uint8_t *rec = grp + (size_t)b * rb;
            r16_codes32(type, rec, wq);
            __m512 d, o, d2[2], o2[2];
            r16_scales32(type, rec, &d, &o);
            rows_twice(d, d2);
            rows_twice(o, o2);
            for (int z = 0; z < 8; z++) bf16_pairs(wq[z], d2, o2, dst + 512 * b + 64 * z);
        }
        return;
    }
    const int cb = r16_codes_end(type);
    for (int sb = 0; sb < K / 256; sb++) {
        const uint8_t *rec = grp + (size_t)sb * rb, *sc = rec + cb;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
        for (int jb = 0; jb < 8; jb++) {
            bf16 *t = dst + 512 * (8 * sb + jb);
            r16k_codes(type, rec, jb, wq);
            if (type == Q6_K) { /* one int8 scale per 16: codes 0..15 in wq[0..3], 16..31 in wq[4..7] */
                for (int h = 0; h < 2; h++) {
                    const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                          _mm_loadu_si128((const __m128i *)(sc + 32 + 16 * (2 * jb + h))))));
                    __m512 s2[2], o2[2];
                    rows_twice(s, s2);
                    rows_twice(_mm512_mul_ps(s, _mm512_set1_ps(-32.f)), o2);
                    for (int z = 4 * h; z < 4 * h + 4; z++) bf16_pairs(wq[z], s2, o2, t + 64 * z);
                }
                continue;
            }
            const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)));
            const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                                  _mm_loadu_si128((const __m128i *)(sc + 64 + 16 * jb)))));
            const __m512 o = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), dmin),
                                           _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                                               _mm_loadu_si128((const __m128i *)(sc + 192 + 16 * jb)))));
            __m512 s2[2], o2[2];
            rows_twice(s, s2);
            rows_twice(o, o2);
            for (int z = 0; z < 8; z++) bf16_pairs(wq[z], s2, o2, t + 64 * z);
        }
    }
}

/* a stored result tile c [16][16] into y rows m0.. (those < M) at columns n0.. (the first nr) */
AMX_INLINE void bf16_store(const float *c, void *y, int y_bf16, int y_stride, int m0, int M, int n0, int nr) {
    const __mmask16 keep = (__mmask16)((1u << nr) - 1);
    for (int r = 0; r < 16 && m0 + r < M; r++) {
        const __m512 v = _mm512_load_ps(c + 16 * r);
        const size_t at = (size_t)(m0 + r) * y_stride + n0;
        if (y_bf16)
            _mm256_mask_storeu_epi16((bf16 *)y + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
        else
            _mm512_mask_storeu_ps((float *)y + at, keep, v);
    }
}

AMX static int bf16_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                           int y_stride, int M, int N, int K, int num_threads) {
    const int Mp = (M + 31) / 32 * 32, groups = (N + 15) / 16, pairs = (groups + 1) / 2;
    const size_t group_bytes = (size_t)(K / block_weights(type)) * r16_record_bytes(type);
    /* the activations' rows one cache line longer than K: at a row of 4 KB (K = 2,048) every row of an A tile fell
     * in one L1 set and the 1B shape's Q4_K linears ran at half the speed of K = 576's */
    const int ks = K + 32;
    /* pairs of groups whose B tiles (64 K bytes a pair) fill AMX_B_BYTES of a core's L2 */
    const int fit = (int)(AMX_B_BYTES / (64 * (size_t)K)), max_block = fit > 1 ? fit : 1;
    const size_t stride = 2 * (size_t)ks;
    /* tile columns (32 values of K) a pass over a block's pairs takes: all of K, or AMX_KC where K is longer, so that
     * 32 activation rows of the pass (32 KB) stay in the L1 while the block's B tiles stream from the L2 */
    const int kc = K / 32 > 2 * AMX_KC ? AMX_KC : K / 32;
    bf16 *xa = kernel_scratch(5, sizeof(bf16) * Mp * ks); /* the activations, zero rows past M */
    _Pragma("omp parallel num_threads(num_threads)") {
        _Pragma("omp for schedule(static)")
        for (int m = 0; m < Mp; m++) {
            bf16 *row = xa + (size_t)m * ks;
            if (m >= M)
                memset(row, 0, sizeof(bf16) * K);
            else if (x_bf16)
                memcpy(row, (const bf16 *)x + (size_t)m * x_stride, sizeof(bf16) * K);
            else
                for (int k = 0; k < K; k += 16)
                    _mm256_store_si256((__m256i *)(row + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(
                                                                 (const float *)x + (size_t)m * x_stride + k)));
        }
        /* each thread its own run of pairs of groups, in blocks of up to `block` pairs whose B tiles stay in the L2
         * while every 32 rows of activations pass over them: with a pair at a time, a 2,048-row prompt step's
         * activations (2.4-6.3 MB) were streamed again from the L3 for every 32 weight rows */
        const int t = omp_get_thread_num(), nth = omp_get_num_threads();
        const int p_begin = (int)((long)pairs * t / nth), p_end = (int)((long)pairs * (t + 1) / nth);
        const int per = p_end - p_begin, blocks = (per + max_block - 1) / max_block;
        const int block = blocks ? (per + blocks - 1) / blocks : 1;
        /* the block's B tiles, then its pairs' 4 result tiles between the chunks of K (AMX_KC) */
        bf16 *bt = kernel_scratch(6, sizeof(bf16) * 2 * 16 * K * (size_t)block + sizeof(float) * 1024 * (size_t)block);
        float *partial = (float *)(bt + (size_t)2 * 16 * K * block);
        float c[4][256] __attribute__((aligned(64)));
        bf16_configure();
        for (int pb = p_begin; pb < p_end; pb += block) {
            const int pe = pb + block < p_end ? pb + block : p_end;
            for (int p = pb; p < pe; p++) {
                const int g0 = 2 * p;
                bf16 *b0 = bt + (size_t)(p - pb) * 32 * K, *b1 = b0 + 16 * K;
                bf16_unpack(type, w + g0 * group_bytes, K, b0);
                if (g0 + 1 < groups)
                    bf16_unpack(type, w + (g0 + 1) * group_bytes, K, b1);
                else
                    memset(b1, 0, sizeof(bf16) * 16 * K);
            }
            for (int m0 = 0; m0 < M; m0 += 32) {
                const int two_m = m0 + 16 < M;
                const bf16 *a0 = xa + (size_t)m0 * ks, *a1 = a0 + (size_t)16 * ks;
                for (int k0 = 0; k0 < K / 32; k0 += kc) { /* tile columns k0 .. k1 - 1 of every pair in turn */
                    const int k1 = k0 + kc < K / 32 ? k0 + kc : K / 32, last = k1 == K / 32;
                    for (int p = pb; p < pe; p++) {
                        const int g0 = 2 * p, two_n = g0 + 1 < groups;
                        const bf16 *b0 = bt + (size_t)(p - pb) * 32 * K, *b1 = b0 + 16 * K;
                        float *part = partial + (size_t)(p - pb) * 1024;
                        if (k0 == 0) {
                            _tile_zero(4);
                            _tile_zero(5);
                            _tile_zero(6);
                            _tile_zero(7);
                        } else {
                            _tile_loadd(4, part, 64);
                            _tile_loadd(5, part + 256, 64);
                            _tile_loadd(6, part + 512, 64);
                            _tile_loadd(7, part + 768, 64);
                        }
                        for (int kt = k0; kt < k1; kt++) {
                            _tile_loadd(0, a0 + 32 * kt, stride);
                            _tile_loadd(2, b0 + 512 * kt, 64);
                            _tile_loadd(3, b1 + 512 * kt, 64);
                            _tile_dpbf16ps(4, 0, 2);
                            _tile_dpbf16ps(5, 0, 3);
                            if (two_m) {
                                _tile_loadd(1, a1 + 32 * kt, stride);
                                _tile_dpbf16ps(6, 1, 2);
                                _tile_dpbf16ps(7, 1, 3);
                            }
                        }
                        if (!last) {
                            _tile_stored(4, part, 64);
                            _tile_stored(5, part + 256, 64);
                            _tile_stored(6, part + 512, 64);
                            _tile_stored(7, part + 768, 64);
                            continue;
                        }
                        const int n0 = 16 * g0, nr0 = N - n0 < 16 ? N - n0 : 16;
                        const int nr1 = N - n0 - 16 < 16 ? N - n0 - 16 : 16;
                        _tile_stored(4, c[0], 64);
                        _tile_stored(5, c[1], 64);
                        bf16_store(c[0], y, y_bf16, y_stride, m0, M, n0, nr0);
                        if (two_n) bf16_store(c[1], y, y_bf16, y_stride, m0, M, n0 + 16, nr1);
                        if (two_m) {
                            _tile_stored(6, c[2], 64);
                            _tile_stored(7, c[3], 64);
                            bf16_store(c[2], y, y_bf16, y_stride, m0 + 16, M, n0, nr0);
                            if (two_n) bf16_store(c[3], y, y_bf16, y_stride, m0 + 16, M, n0 + 16, nr1);
                        }
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}

/* ---- the probe ---- */
static sigjmp_buf probe_jump;
static void probe_sigill(int sig) {
    (void)sig;
    siglongjmp(probe_jump, 1);
}

/* one TDPBF16PS of 16 x 32 by 32 x 16 bfloat16 small integers (every sum exact in float32) against the scalar sums:
 * 1 if equal */
AMX static int probe_tile_op(void) {
    bf16 A[16 * 32] __attribute__((aligned(64))), B[16 * 32] __attribute__((aligned(64)));
    float C[256] __attribute__((aligned(64)));
    for (int i = 0; i < 16 * 32; i++)
        A[i] = f32_to_bf16((float)(i * 7 % 15 - 7)), B[i] = f32_to_bf16((float)(i * 13 % 17 - 8));
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 3; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
    _tile_zero(2);
    _tile_loadd(0, A, 64);
    _tile_loadd(1, B, 64);
    _tile_dpbf16ps(2, 0, 1);
    _tile_stored(2, C, 64);
    _tile_release();
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            float want = 0.f;
            for (int k = 0; k < 32; k++) want += bf16_to_f32(A[32 * i + k]) * bf16_to_f32(B[32 * (k / 2) + 2 * j + k % 2]);
            if (C[16 * i + j] != want) return 0;
        }
    return 1;
}

static int probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return 0; /* AMX-BF16, -TILE */
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx2") ||
        !__builtin_cpu_supports("avx512vbmi"))
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return -1; /* OSXSAVE */
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo >> 17 & 3) != 3) return -1; /* XTILECFG and XTILEDATA state not enabled by the OS */
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -2;
    struct sigaction guard, old;
    memset(&guard, 0, sizeof guard);
    guard.sa_handler = probe_sigill;
    sigemptyset(&guard.sa_mask);
    sigaction(SIGILL, &guard, &old);
    int ok = -3;
    if (sigsetjmp(probe_jump, 1) == 0) ok = probe_tile_op() ? 1 : -4;
    sigaction(SIGILL, &old, NULL);
    return ok;
}
#endif

/* Probes AMX once per process (later calls return the first answer): 1 ready; 0 the CPU lacks AMX-BF16 (or the
 * AVX512-BF16 and AVX512-VBMI the dequantization uses); -1 the OS does not enable the tile state; -2 Linux refused
 * the tile data permission; -3 the first tile op raised SIGILL; -4 it gave a wrong result. */
int gguf_amx_probe(void) {
#if defined(__x86_64__) && defined(__linux__)
    if (amx_state == 2) amx_state = probe();
    return amx_state;
#else
    return 0;
#endif
}

/* gguf_r16_linear takes the tiles from min_rows rows of x (0: never). Returns -1 (AMX stays off) for min_rows > 0
 * unless gguf_amx_probe() returned 1. */
int gguf_amx_enable(int min_rows) {
    if (min_rows > 0 && gguf_amx_probe() != 1) return -1;
    amx_min_rows = min_rows > 0 ? min_rows : 0;
    return 0;
}

/* 1 where gguf_r16_linear takes steps of M rows of x to the tiles (AMX on, M at its threshold or above), else 0 */
int gguf_amx_takes(int M) { return amx_min_rows > 0 && M >= amx_min_rows; }

/* y = x W^T for W in R16 on AMX tiles (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K; x float32 or bfloat16 [M, K] rows
 * x_stride apart, y float32 or bfloat16 rows y_stride apart). Returns 1 without writing where AMX is off, M is
 * below the threshold or the type or K has no R16 layout. */
int gguf_amx_r16_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                        int y_stride, int M, int N, int K, int num_threads) {
#if defined(__x86_64__) && defined(__linux__)
    if (amx_min_rows == 0 || M < amx_min_rows || gguf_r16_bytes(type, 1, K) < 0) return 1;
    return bf16_linear(x, x_bf16, x_stride, w, type, y, y_bf16, y_stride, M, N, K, num_threads);
#else
    (void)x, (void)x_bf16, (void)x_stride, (void)w, (void)type, (void)y, (void)y_bf16, (void)y_stride, (void)M;
    (void)N, (void)K, (void)num_threads;
    return 1;
#endif
}
