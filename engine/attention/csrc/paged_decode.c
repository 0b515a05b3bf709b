/* Paged attention for decode rows on the CPU: one query token per sequence, its K/V read in place
 * from the paged cache through the block table (no gather copy, no padding).
 *
 * Layout as in the engine: q, out [num_seqs, num_heads, head_dim]; k_cache, v_cache
 * [num_blocks, block_size, num_kv_heads, head_dim]; block_tables int32 [num_seqs, max_blocks];
 * seq_lens int32 [num_seqs]. One task per (sequence, kv head) computes the group of query heads that
 * share that kv head (GQA), so each K/V row is loaded and converted once. Softmax is exact (scores
 * kept for the whole context, max-subtracted), accumulated in float32. Common head sizes (64, 128)
 * get their own inlined copy so the compiler unrolls and vectorizes the head_dim loops fully.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 32

static inline float load_f32(float x) { return x; }
static inline float store_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint16_t store_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One (sequence, kv head) task; D is a constant where the caller passes one. */
#define DECODE_TASK(NAME, T, LOAD, STORE)                                                             \
    static inline __attribute__((always_inline)) void NAME(                                            \
        const T *q, const T *k_cache, const T *v_cache, const int32_t *table, int L, T *out, int G,   \
        int h, int num_kv_heads, const int D, int block_size, float scale, float *scores) {           \
        float qf[MAX_GROUP * MAX_HEAD_DIM], acc[MAX_GROUP * MAX_HEAD_DIM], row[MAX_HEAD_DIM];          \
        float mx[MAX_GROUP], inv[MAX_GROUP];                                                           \
        const size_t token_stride = (size_t)num_kv_heads * D;                                          \
        for (int g = 0; g < G; g++) {                                                                  \
            for (int d = 0; d < D; d++) qf[g * D + d] = LOAD(q[(size_t)g * D + d]) * scale;            \
            mx[g] = -INFINITY;                                                                         \
        }                                                                                              \
        for (int t = 0; t < L; t++) {                                                                  \
            const T *kp = k_cache + ((size_t)table[t / block_size] * block_size + t % block_size)      \
                                        * token_stride + (size_t)h * D;                                \
            for (int d = 0; d < D; d++) row[d] = LOAD(kp[d]);                                          \
            for (int g = 0; g < G; g++) {                                                              \
                float dot = 0.f;                                                                       \
                for (int d = 0; d < D; d++) dot += qf[g * D + d] * row[d];                             \
                scores[(size_t)g * L + t] = dot;                                                       \
                mx[g] = dot > mx[g] ? dot : mx[g];                                                     \
            }                                                                                          \
        }                                                                                              \
        for (int g = 0; g < G; g++) {                                                                  \
            float sum = 0.f, *sc = scores + (size_t)g * L;                                             \
            for (int t = 0; t < L; t++) {                                                              \
                sc[t] = expf(sc[t] - mx[g]);                                                           \
                sum += sc[t];                                                                          \
            }                                                                                          \
            inv[g] = 1.f / sum;                                                                        \
        }                                                                                              \
        memset(acc, 0, sizeof(float) * G * D);                                                         \
        for (int t = 0; t < L; t++) {                                                                  \
            const T *vp = v_cache + ((size_t)table[t / block_size] * block_size + t % block_size)      \
                                        * token_stride + (size_t)h * D;                                \
            for (int d = 0; d < D; d++) row[d] = LOAD(vp[d]);                                          \
            for (int g = 0; g < G; g++) {                                                              \
                const float w = scores[(size_t)g * L + t];                                             \
                for (int d = 0; d < D; d++) acc[g * D + d] += w * row[d];                              \
            }                                                                                          \
        }                                                                                              \
        for (int g = 0; g < G; g++)                                                                    \
            for (int d = 0; d < D; d++) out[(size_t)g * D + d] = STORE(acc[g * D + d] * inv[g]);       \
    }

#define PAGED_DECODE(NAME, TASK, T)                                                                   \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,             \
             const int32_t *seq_lens, T *out, int num_seqs, int num_heads, int num_kv_heads,           \
             int head_dim, int block_size, int max_blocks, float scale, int num_threads) {             \
        const int G = num_heads / num_kv_heads;                                                        \
        if (head_dim > MAX_HEAD_DIM || G > MAX_GROUP) return -1;                                       \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                      \
        for (int task = 0; task < num_seqs * num_kv_heads; task++) {                                   \
            const int s = task / num_kv_heads, h = task % num_kv_heads, L = seq_lens[s];               \
            const size_t head0 = ((size_t)s * num_heads + (size_t)h * G) * head_dim;                   \
            const int32_t *table = block_tables + (size_t)s * max_blocks;                              \
            float *scores = malloc(sizeof(float) * (size_t)G * L);                                     \
            if (head_dim == 64)                                                                        \
                TASK(q + head0, k_cache, v_cache, table, L, out + head0, G, h, num_kv_heads, 64,      \
                     block_size, scale, scores);                                                       \
            else if (head_dim == 128)                                                                  \
                TASK(q + head0, k_cache, v_cache, table, L, out + head0, G, h, num_kv_heads, 128,     \
                     block_size, scale, scores);                                                       \
            else                                                                                       \
                TASK(q + head0, k_cache, v_cache, table, L, out + head0, G, h, num_kv_heads,          \
                     head_dim, block_size, scale, scores);                                             \
            free(scores);                                                                              \
        }                                                                                              \
        return 0;                                                                                      \
    }

DECODE_TASK(decode_task_f32, float, load_f32, store_f32)
DECODE_TASK(decode_task_bf16, uint16_t, load_bf16, store_bf16)
PAGED_DECODE(paged_decode_f32, decode_task_f32, float)
PAGED_DECODE(paged_decode_bf16, decode_task_bf16, uint16_t)
