/* GGML type ids, block sizes and the R16 layout of repacked weights (gguf_linear.c describes it), shared by the
 * AVX512-VNNI kernels (gguf_linear.c) and the AMX kernel (gguf_amx.c). */
#ifndef MINIVLLM_GGUF_R16_H
#define MINIVLLM_GGUF_R16_H
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* GGMLQuantizationType values */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
       IQ4_NL = 20, IQ4_XS = 23, MXFP4 = 39 };

/* weights per block and bytes per block of a type; 0 for an unknown type */
static inline int block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case IQ4_NL: return 18;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    case IQ4_XS: return 136;
    case MXFP4: return 17;
    default: return 0;
    }
}
static inline int block_weights(int type) {
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case IQ4_NL: case MXFP4: return 32;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: case IQ4_XS: return 256;
    default: return 0;
    }
}

/* R16: bytes of a 32-weight record's codes (its scales follow), where a super-block record's scales start, and
 * the bytes of one record (16 rows x one block) */
static inline int r16_code_bytes(int type) { return type == Q8_0 ? 512 : 256; }
static inline int r16_codes_end(int type) { return type == Q4_K ? 2048 : type == Q5_K ? 2560 : type == Q6_K ? 3072 : 0; }
static inline int r16_record_bytes(int type) {
    return type == Q4_K ? 2368 : type == Q5_K ? 2880 : type == Q6_K ? 3360 : 16 * block_bytes(type);
}
long gguf_r16_bytes(int type, int N, int K);

/* The quantized activations of an R16 product (gguf_linear.c carves them from a step's scratch), the int16 ones
 * (x0, x2, x1, x3) per 4 for vpdpwssd, the int8 ones in order */
typedef struct {
    int Kp;      /* K rounded up to 64 (zero padded) */
    void *xq;    /* [M, Kp] codes: int16, (x0, x2, x1, x3) per 4; or int8 in order (the int8 kernels below) */
    float *xd;   /* [M, Kp / 32] the scale of each block of 32 (per 256, prepare_row8k: [M, Kp / 256]) */
    float *xsum;   /* [M, Kp / 16] exact sums of x per 16 (int16 activations: the K-quants' offsets per 16) */
    float *xsum32; /* [M, Kp / 32] sums per 32, of x (int16) or of the rounded x (int8 per 32) */
    int16_t *is16; /* per 256 (prepare_row8k): [M, Kp / 16] the int8 codes' sums per 16 (Q6_K's offset), two a
                    * broadcast int32 */
    int16_t *is32; /* per 256: [M, Kp / 32] the codes' sums per 32 (the K-quants' mins), two a broadcast int32 */
} Acts;

#if defined(__x86_64__)
/* byte i = 0x10 where bit i of the 32 bits at p is set: the fifth bits of 32 Q5_0 / Q5_1 codes, or of one Q5_K
 * code register's half (AVX2: gguf_linear.c's blocks kernel and gguf_r16_avx2.c) */
static inline __attribute__((target("avx2"), always_inline)) __m256i fifth_bits32(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, sizeof bits);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}
#endif

/* in gguf_r16_avx2.c: the R16 kernels on AVX2 alone, int8 activations (Q4_0, Q4_1, MXFP4, Q4_K, Q5_K, Q6_K) */
#define R16A_MM 4 /* rows of x per pass over a group's codes */
/* 1 where `type` has an AVX2 R16 kernel (the CPU's AVX2, FMA and F16C are gguf_q8_isa's to check), else 0 */
int gguf_r16_avx2_type(int type);
/* row m of x into a's int8 codes: per 32 (xd, xsum32) or, `per256`, per 256 (xd per 256, is16, is32) */
void r16a_prepare_row(const Acts *a, const void *x, int x_bf16, int x_stride, int K, int m, int per256);
/* one group of 16 R16 rows (n0.., the first nr real; nb records) against mm <= R16A_MM rows of x from m0 */
void r16a_group(int type, int mm, const Acts *a, const uint8_t *grp, int nb, int m0, void *y, int y_bf16,
                int y_stride, int n0, int nr);
/* Q6_K's high bits: code register z = 4h + u of a sub-block takes its two bits from byte 4r + i of the sub-block's
 * plane h (64 B), at bit R16_Q6K_SHIFT(u): 4, 6, 0, 2 (bits 4-5 of the byte, or one shift away) */
#define R16_Q6K_SHIFT(u) ((4 + 2 * (u)) % 8)

#if defined(__x86_64__)
#define R16_INLINE static inline __attribute__((target("avx512f,avx512bw"), always_inline))

/* 64 bits of a K-quant's high-bit plane as a byte mask (memcpy: the plane need not be aligned) */
static inline __mmask64 bits64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return (__mmask64)v;
}

/* The unsigned codes of a 32-weight record (Q4_0, Q4_1, Q8_0 as code + 128, MXFP4 as its doubled E2M1 value + 12:
 * 0..24, through a byte shuffle) as 8 registers: wq[z] holds codes 4z..4z+3 of each of the 16 rows, one int32 lane
 * per row (the B operand of VNNI and of an AMX tile). */
R16_INLINE void r16_codes32(int type, const uint8_t *rec, __m512i *wq) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    /* ggml's kvalues_mxfp4 (the E2M1 values times two) plus 12, in each 128-bit lane */
    const __m512i fp4 = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
    for (int p = 0; p < 4; p++) {
        if (type == Q8_0) {
            wq[p] = _mm512_loadu_si512(rec + 64 * p);
            wq[p + 4] = _mm512_loadu_si512(rec + 64 * (p + 4));
        } else {
            const __m512i v = _mm512_loadu_si512(rec + 64 * p);
            wq[p] = _mm512_and_si512(v, nib);
            wq[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
            if (type == MXFP4) wq[p] = _mm512_shuffle_epi8(fp4, wq[p]), wq[p + 4] = _mm512_shuffle_epi8(fp4, wq[p + 4]);
        }
    }
}

/* The 16 rows' scale d and offset m of a 32-weight record, a weight being d code + m with r16_codes32's codes:
 * float16 d after the codes, m = -8 d (Q4_0), -128 d (Q8_0), the float16 m after the d (Q4_1); MXFP4's E8M0 byte
 * e per row as 2^(e - 128) (ggml's e8m0_to_fp32_half, subnormal for e < 2) with m = -12 d */
R16_INLINE void r16_scales32(int type, const uint8_t *rec, __m512 *d, __m512 *m) {
    const uint8_t *sc = rec + r16_code_bytes(type);
    if (type == MXFP4) {
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sc));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
        *d = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2)), normal, tiny));
        *m = _mm512_mul_ps(*d, _mm512_set1_ps(-12.f));
        return;
    }
    *d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
    *m = type == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 32)))
                      : _mm512_mul_ps(*d, _mm512_set1_ps(type == Q4_0 ? -8.f : -128.f));
}

/* The same for sub-block jb (32 weights) of a Q4_K, Q5_K or Q6_K record: unsigned codes 0..15, 0..31, 0..63 */
R16_INLINE void r16k_codes(int type, const uint8_t *rec, int jb, __m512i *wq) {
    r16_codes32(Q4_0, rec + 256 * jb, wq);
    if (type == Q5_K)
        for (int z = 0; z < 8; z++) /* the fifth bits */
            wq[z] = _mm512_or_si512(wq[z], _mm512_maskz_mov_epi8(bits64(rec + 2048 + 64 * jb + 8 * z),
                                                                 _mm512_set1_epi8(0x10)));
    if (type == Q6_K)
        for (int h = 0; h < 2; h++) { /* the fifth and sixth bits: one shift and one vpternlogd (a | b & 0x30) */
            const __m512i hb = _mm512_loadu_si512(rec + 2048 + 128 * jb + 64 * h), m = _mm512_set1_epi8(0x30);
            wq[4 * h] = _mm512_ternarylogic_epi32(wq[4 * h], hb, m, 0xF8);
            wq[4 * h + 1] = _mm512_ternarylogic_epi32(wq[4 * h + 1], _mm512_srli_epi16(hb, 2), m, 0xF8);
            wq[4 * h + 2] = _mm512_ternarylogic_epi32(wq[4 * h + 2], _mm512_slli_epi16(hb, 4), m, 0xF8);
            wq[4 * h + 3] = _mm512_ternarylogic_epi32(wq[4 * h + 3], _mm512_slli_epi16(hb, 2), m, 0xF8);
        }
}
#endif

/* in gguf_amx.c: y = x W^T on AMX tiles for R16 weights; 1 where AMX is off or M is below its threshold */
int gguf_amx_r16_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                        int y_stride, int M, int N, int K, int num_threads);
#endif
