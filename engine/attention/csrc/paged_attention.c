/* Paged attention on the CPU for a whole step: decodes and prefill chunks, K/V read in place from the
 * paged cache through the block table (no gather copy, no padding).
 *
 * Layout as in the engine: q, out [num_tokens, num_heads, head_dim], the sequences' new tokens laid
 * end to end (query_start_loc int32 [num_seqs + 1]); k_cache, v_cache [num_blocks, block_size,
 * num_kv_heads, head_dim], already holding this step's new K/V; block_tables int32
 * [num_seqs, max_blocks]; seq_lens int32 [num_seqs] (cached + new tokens). Query j of a sequence with
 * q new tokens and n in all sits at position n - q + j and attends to keys 0..n - q + j (causal).
 *
 * One task per (sequence, kv head, tile of up to QT query positions) computes every query head of
 * the kv head's GQA group for those positions, so each K/V row is loaded and converted once for
 * G * QT query vectors. Softmax is exact (all scores kept, max-subtracted), accumulated in float32.
 * Head sizes 64 and 128 get their own inlined copies so the compiler unrolls the head_dim loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define QT 8          /* query positions per task */
#define MAX_ROWS 256  /* query vectors per task: group size * QT */

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

/* Rows r = j * G + g: query position j of the tile (absolute position first_pos + j), head g. */
#define TILE_TASK(NAME, T, LOAD, STORE)                                                               \
    static inline __attribute__((always_inline)) void NAME(                                            \
        const T *q, const T *k_cache, const T *v_cache, const int32_t *table, int first_pos, int nq,  \
        T *out, int G, int h, int num_heads, int num_kv_heads, const int D, int block_size,            \
        float scale, float *work) {                                                                    \
        float row[MAX_HEAD_DIM], mx[MAX_ROWS], inv[MAX_ROWS];                                          \
        const int R = nq * G, L = first_pos + nq; /* keys the last query sees */                       \
        float *qf = work, *acc = work + (size_t)R * D, *scores = work + 2 * (size_t)R * D;             \
        const size_t token_stride = (size_t)num_kv_heads * D;                                          \
        for (int j = 0; j < nq; j++)                                                                   \
            for (int g = 0; g < G; g++) {                                                              \
                const T *qp = q + ((size_t)j * num_heads + (size_t)h * G + g) * D;                     \
                for (int d = 0; d < D; d++) qf[(j * G + g) * D + d] = LOAD(qp[d]) * scale;            \
                mx[j * G + g] = -INFINITY;                                                             \
            }                                                                                          \
        for (int t = 0; t < L; t++) {                                                                  \
            const T *kp = k_cache + ((size_t)table[t / block_size] * block_size + t % block_size)      \
                                        * token_stride + (size_t)h * D;                                \
            for (int d = 0; d < D; d++) row[d] = LOAD(kp[d]);                                          \
            /* queries at positions >= t see this key: tile rows from j0 on */                         \
            const int j0 = t > first_pos ? t - first_pos : 0;                                          \
            for (int r = j0 * G; r < R; r++) {                                                         \
                float dot = 0.f;                                                                       \
                for (int d = 0; d < D; d++) dot += qf[r * D + d] * row[d];                             \
                scores[(size_t)r * L + t] = dot;                                                       \
                mx[r] = dot > mx[r] ? dot : mx[r];                                                     \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++) {                                                                  \
            const int n = first_pos + r / G + 1; /* keys row r sees */                                 \
            float sum = 0.f, *sc = scores + (size_t)r * L;                                             \
            for (int t = 0; t < n; t++) {                                                              \
                sc[t] = expf(sc[t] - mx[r]);                                                           \
                sum += sc[t];                                                                          \
            }                                                                                          \
            inv[r] = 1.f / sum;                                                                        \
        }                                                                                              \
        memset(acc, 0, sizeof(float) * R * D);                                                         \
        for (int t = 0; t < L; t++) {                                                                  \
            const T *vp = v_cache + ((size_t)table[t / block_size] * block_size + t % block_size)      \
                                        * token_stride + (size_t)h * D;                                \
            for (int d = 0; d < D; d++) row[d] = LOAD(vp[d]);                                          \
            const int j0 = t > first_pos ? t - first_pos : 0;                                          \
            for (int r = j0 * G; r < R; r++) {                                                         \
                const float w = scores[(size_t)r * L + t];                                             \
                for (int d = 0; d < D; d++) acc[r * D + d] += w * row[d];                              \
            }                                                                                          \
        }                                                                                              \
        for (int j = 0; j < nq; j++)                                                                   \
            for (int g = 0; g < G; g++) {                                                              \
                T *op = out + ((size_t)j * num_heads + (size_t)h * G + g) * D;                         \
                const int r = j * G + g;                                                               \
                for (int d = 0; d < D; d++) op[d] = STORE(acc[r * D + d] * inv[r]);                    \
            }                                                                                          \
    }

#define PAGED_ATTENTION(NAME, TASK, T)                                                                \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,             \
             const int32_t *seq_lens, const int32_t *query_start_loc, T *out, int num_seqs,           \
             int num_heads, int num_kv_heads, int head_dim, int block_size, int max_blocks,           \
             float scale, int num_threads) {                                                           \
        const int G = num_heads / num_kv_heads;                                                        \
        if (head_dim > MAX_HEAD_DIM || G * QT > MAX_ROWS) return -1;                                   \
        /* tasks: (sequence, kv head, query tile), numbered through a prefix sum of tiles */           \
        int *tile_start = malloc(sizeof(int) * (num_seqs + 1));                                        \
        tile_start[0] = 0;                                                                             \
        for (int s = 0; s < num_seqs; s++) {                                                           \
            const int nq = query_start_loc[s + 1] - query_start_loc[s];                                \
            tile_start[s + 1] = tile_start[s] + (nq + QT - 1) / QT;                                    \
        }                                                                                              \
        const int num_tasks = tile_start[num_seqs] * num_kv_heads;                                     \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                      \
        for (int task = num_tasks - 1; task >= 0; task--) { /* long tiles (late positions) first */    \
            const int h = task % num_kv_heads, tile = task / num_kv_heads;                             \
            int s = 0;                                                                                 \
            while (tile_start[s + 1] <= tile) s++;                                                     \
            const int q_len = query_start_loc[s + 1] - query_start_loc[s];                             \
            const int j_first = (tile - tile_start[s]) * QT;                                           \
            const int nq = q_len - j_first < QT ? q_len - j_first : QT;                                \
            const int first_pos = seq_lens[s] - q_len + j_first;                                       \
            const size_t tok0 = (size_t)query_start_loc[s] + j_first;                                  \
            const int32_t *table = block_tables + (size_t)s * max_blocks;                              \
            /* per task: queries and accumulators [rows, head_dim], scores [rows, keys] */             \
            float *work = malloc(sizeof(float) * (size_t)nq * G * (2 * head_dim + first_pos + nq));  \
            const T *qp = q + tok0 * num_heads * head_dim;                                             \
            T *op = out + tok0 * num_heads * head_dim;                                                 \
            if (head_dim == 64)                                                                        \
                TASK(qp, k_cache, v_cache, table, first_pos, nq, op, G, h, num_heads, num_kv_heads,   \
                     64, block_size, scale, work);                                                     \
            else if (head_dim == 128)                                                                  \
                TASK(qp, k_cache, v_cache, table, first_pos, nq, op, G, h, num_heads, num_kv_heads,   \
                     128, block_size, scale, work);                                                    \
            else                                                                                       \
                TASK(qp, k_cache, v_cache, table, first_pos, nq, op, G, h, num_heads, num_kv_heads,   \
                     head_dim, block_size, scale, work);                                               \
            free(work);                                                                                \
        }                                                                                              \
        free(tile_start);                                                                              \
        return 0;                                                                                      \
    }

TILE_TASK(tile_task_f32, float, load_f32, store_f32)
TILE_TASK(tile_task_bf16, uint16_t, load_bf16, store_bf16)
PAGED_ATTENTION(paged_attention_f32, tile_task_f32, float)
PAGED_ATTENTION(paged_attention_bf16, tile_task_bf16, uint16_t)
