/* The decoder layer's elementwise ops, one pass each, for float32 and bfloat16 activations:
 * residual-add + RMSNorm (Zhang & Sennrich 2019), rotary embedding (Su et al. 2021) in place, and
 * SiLU(gate) * up (SwiGLU, Shazeer 2020), the sigmoid output gate. All math in float32.
 *
 * The residual stream is float32 [num_tokens, hidden] whatever the model dtype: adding each
 * sublayer's output to it in float32 instead of rounding the sum to bfloat16 every layer keeps
 * bfloat16 models close to float32 at no cost (one pass reads and writes it anyway).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "vexp.h"
static inline float f32_id(float x) { return x; }

/* Each op below is a function of one token, NAME_tok(..., t), run over the tokens two ways: NAME(...) on a team of
 * its own (past one token), and NAME_team(...) by the calling thread's team, inside a parallel region every one of
 * its threads enters with the same arguments (decoder_layer.c's one region a step: no team woken per op). The
 * tokens are shared out statically, each computed as by NAME, and NAME_team returns on each thread once its own
 * tokens are done, without waiting for the others (`nowait`): the next kernel of a layer begins with a static `omp
 * for` over the same tokens (a linear's activations, the attention's K/V write), which OpenMP gives each thread the
 * same tokens in, so it reads only rows its own thread wrote, and its barrier then waits for all (the norms', rotary's
 * and SiLU's barriers: four of a layer's ~15). A caller reading other tokens' rows first needs a barrier. */
#define OVER_TOKENS(NAME, PARAMS, ARGS)                                                                \
    void NAME PARAMS {                                                                                 \
        _Pragma("omp parallel for num_threads(num_threads) if (num_tokens > 1)")                       \
        for (int t = 0; t < num_tokens; t++) NAME##_tok ARGS;                                          \
    }                                                                                                  \
    void NAME##_team PARAMS {                                                                          \
        (void)num_threads;                                                                             \
        _Pragma("omp for schedule(static) nowait")                                                     \
        for (int t = 0; t < num_tokens; t++) NAME##_tok ARGS;                                          \
    }

/* residual [T, H] float32 += delta [T, H] (model dtype; NULL = nothing to add);
 * out [T, H] (model dtype) = weight [H] (model dtype) * residual / sqrt(mean(residual^2) + eps). */
#define ADD_RMS_NORM(T, TO_F32, FROM_F32)                                                              \
    static inline void add_rms_norm_##T##_tok(float *residual, const T *delta, const T *weight, T *out, int t, \
                                              int hidden, float eps) {                                 \
        float *x = residual + (size_t)t * hidden;                                                      \
        if (delta) {                                                                                   \
            const T *dx = delta + (size_t)t * hidden;                                                  \
            for (int i = 0; i < hidden; i++) x[i] += TO_F32(dx[i]);                                    \
        }                                                                                              \
        float ss = 0.f;                                                                                \
        for (int i = 0; i < hidden; i++) ss += x[i] * x[i];                                            \
        const float inv = 1.f / sqrtf(ss / hidden + eps);                                              \
        T *o = out + (size_t)t * hidden;                                                               \
        for (int i = 0; i < hidden; i++) o[i] = FROM_F32(TO_F32(weight[i]) * (x[i] * inv));            \
    }                                                                                                  \
    OVER_TOKENS(add_rms_norm_##T,                                                                      \
                (float *residual, const T *delta, const T *weight, T *out, int num_tokens, int hidden, float eps, \
                 int num_threads),                                                                     \
                (residual, delta, weight, out, t, hidden, eps))
ADD_RMS_NORM(float, f32_id, f32_id)
ADD_RMS_NORM(bf16, bf16_to_f32, f32_to_bf16)

/* Rotate-half RoPE in place on the first D features of each head of x [T, heads, ...] (token row stride `stride`
 * elements, heads `head_stride` apart: D itself where every feature rotates, the head's size for partial rotary):
 * (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos, sin [T, D / 2] float32 of each token's position. */
#define ROTARY(T, TO_F32, FROM_F32)                                                                    \
    static inline void rotary_##T##_tok(T *x, int t, int heads, int stride, int head_stride, int D,    \
                                        const float *cos_t, const float *sin_t) {                      \
        const int half = D / 2;                                                                        \
        const float *c = cos_t + (size_t)t * half, *s = sin_t + (size_t)t * half;                      \
        for (int h = 0; h < heads; h++) {                                                              \
            T *x1 = x + (size_t)t * stride + (size_t)h * head_stride, *x2 = x1 + half;                 \
            for (int i = 0; i < half; i++) {                                                           \
                const float a = TO_F32(x1[i]), b = TO_F32(x2[i]);                                      \
                x1[i] = FROM_F32(a * c[i] - b * s[i]);                                                 \
                x2[i] = FROM_F32(b * c[i] + a * s[i]);                                                 \
            }                                                                                          \
        }                                                                                              \
    }                                                                                                  \
    OVER_TOKENS(rotary_##T,                                                                            \
                (T * x, int num_tokens, int heads, int stride, int head_stride, int D, const float *cos_t, \
                 const float *sin_t, int num_threads),                                                 \
                (x, t, heads, stride, head_stride, D, cos_t, sin_t))
ROTARY(float, f32_id, f32_id)
ROTARY(bf16, bf16_to_f32, f32_to_bf16)

/* out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:], gate_up [T, 2I]. */
/* exp's argument held below float32's overflow: -ffast-math assumes no infinities, and an inf there (a < -88)
 * came out as NaN; silu(a) is -0 to float precision anyway */
static inline float silu(float a) { return a / (1.f + expf(fminf(-a, 88.f))); }

/* GELU's tanh approximation (Hendrycks & Gimpel 2016), as torch's gelu(approximate="tanh") */
static inline float gelu_tanh(float a) { return 0.5f * a * (1.f + tanhf(0.7978845608f * (a + 0.044715f * a * a * a))); }

/* silu(g) * u over the first n / 16 * 16 values, 16 at a time (exp512: the libm expf the compiler vectorizes and
 * the division took a prompt ~4% of its time); returns how many it did (0 without AVX-512) */
static inline int silu_mul_float_vec(const float *g, const float *u, float *o, int n) {
#if defined(__AVX512F__)
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 a = _mm512_loadu_ps(g + i);
        const __m512 e = exp512(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), _mm512_set1_ps(88.f)));
        const __m512 s = _mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    return i;
#else
    (void)g, (void)u, (void)o, (void)n;
    return 0;
#endif
}
static inline int no_vec(const void *g, const void *u, void *o, int n) { return (void)g, (void)u, (void)o, n * 0; }

/* NAME_and_mul_T: ACT(gate) * up over gate_up [num_tokens, 2 * inter] = [gate | up] into out [num_tokens, inter]
 * (SwiGLU with silu, Gemma's GeGLU with gelu_tanh; Shazeer 2020); VEC does a leading part where it has a vector
 * form */
#define ACT_AND_MUL(NAME, ACT, T, TO_F32, FROM_F32, VEC)                                               \
    static inline void NAME##_and_mul_##T##_tok(const T *gate_up, T *out, int t, int inter) {          \
        const T *g = gate_up + (size_t)t * 2 * inter, *u = g + inter;                                  \
        T *o = out + (size_t)t * inter;                                                                \
        for (int i = VEC(g, u, o, inter); i < inter; i++) o[i] = FROM_F32(ACT(TO_F32(g[i])) * TO_F32(u[i])); \
    }                                                                                                  \
    OVER_TOKENS(NAME##_and_mul_##T, (const T *gate_up, T *out, int num_tokens, int inter, int num_threads), \
                (gate_up, out, t, inter))
ACT_AND_MUL(silu, silu, float, f32_id, f32_id, silu_mul_float_vec)
ACT_AND_MUL(silu, silu, bf16, bf16_to_f32, f32_to_bf16, no_vec)
ACT_AND_MUL(gelu_tanh, gelu_tanh, float, f32_id, f32_id, no_vec)
ACT_AND_MUL(gelu_tanh, gelu_tanh, bf16, bf16_to_f32, f32_to_bf16, no_vec)

/* x [T, n] (row stride x_stride) *= sigmoid(gate [T, n], row stride gate_stride), in place: the gated attention
 * output of Qwen3.5 (Qiu et al. 2025, "Gated Attention for Large Language Models"), as torch computes
 * `x * torch.sigmoid(gate)` in x's dtype: the sigmoid rounded to T, then the product rounded to T. The op-by-op layer
 * (ops.sigmoid_gate) and the one-call layer (decoder_layer.c) both call it, so that they agree bit for bit. */
static inline float sigmoid(float a) { return 1.f / (1.f + expf(fminf(-a, 88.f))); }
#define SIGMOID_GATE(T, TO_F32, FROM_F32)                                                              \
    static inline void sigmoid_gate_##T##_tok(T *x, int x_stride, const T *gate, int gate_stride, int t, int n) { \
        T *xt = x + (size_t)t * x_stride;                                                              \
        const T *g = gate + (size_t)t * gate_stride;                                                   \
        for (int i = 0; i < n; i++) {                                                                  \
            const float s = TO_F32(FROM_F32(sigmoid(TO_F32(g[i])))); /* rounded as torch.sigmoid's */  \
            xt[i] = FROM_F32(TO_F32(xt[i]) * s);                                                       \
        }                                                                                              \
    }                                                                                                  \
    OVER_TOKENS(sigmoid_gate_##T,                                                                      \
                (T * x, int x_stride, const T *gate, int gate_stride, int num_tokens, int n, int num_threads), \
                (x, x_stride, gate, gate_stride, t, n))
SIGMOID_GATE(float, f32_id, f32_id)
SIGMOID_GATE(bf16, bf16_to_f32, f32_to_bf16)

/* out [n, k] (int64) = the column indices of each row's k largest values of x [n, v] float32 (k <= 64, in no set
 * order; of equal values the first ones seen). One pass per row: a span of 64 values whose maximum is not above
 * the k-th largest so far is skipped (past the first few spans most are), the others' larger values go into the
 * k best by insertion. Rows over threads past 8 rows (an LM head's logits). */
void top_k_float(const float *x, int n, int v, int k, int64_t *out, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if (n > 8)")
    for (int r = 0; r < n; r++) {
        const float *row = x + (size_t)r * v;
        float val[64];
        int64_t *idx = out + (size_t)r * k;
        int have = 0;
        for (int s = 0; s < v; s += 64) {
            const int e = s + 64 < v ? s + 64 : v;
            float mx = row[s];
            for (int i = s + 1; i < e; i++) mx = row[i] > mx ? row[i] : mx;
            if (have == k && !(mx > val[k - 1])) continue;
            for (int i = s; i < e; i++) {
                if (have == k && !(row[i] > val[k - 1])) continue;
                int j = have < k ? have++ : k - 1; /* val descending: shift the smaller ones down */
                while (j > 0 && val[j - 1] < row[i]) {
                    val[j] = val[j - 1];
                    idx[j] = idx[j - 1];
                    j--;
                }
                val[j] = row[i];
                idx[j] = i;
            }
        }
    }
}

/* A mixture-of-experts router for n tokens (models/layers/fused_moe.py's select_experts on the logits of
 * SparseMoeBlock's `gate`): logits x W^T (+ b) in float32 (x [n, H], W [E, H], b [E] or NULL), softmax over the E
 * experts, the k most probable (descending; of equal ones the lower index) into ids [n, k] (int64) and their
 * probabilities into topw [n, k] float32, divided by their sum where `renormalize` (Mixtral, Qwen3-MoE; gpt-oss's
 * softmax over its top-k logits is the same). The one arithmetic both the op-by-op layer and the one-call layer
 * (decoder_layer.c) route with, so that they choose the same experts with the same weights. k <= 64. */
void moe_route_float(const float *x, int n, int H, const float *w, const float *b, int E, int k, int renormalize,
                     int64_t *ids, float *topw, int num_threads) {
    _Pragma("omp parallel for num_threads(num_threads) if ((long)n * E * H > (1L << 20))")
    for (int t = 0; t < n; t++) {
        const float *xt = x + (size_t)t * H;
        float p[E];
        float mx = -INFINITY, sum = 0.f;
        for (int e = 0; e < E; e++) {
            const float *we = w + (size_t)e * H;
            float dot = 0.f;
            for (int i = 0; i < H; i++) dot += xt[i] * we[i];
            p[e] = b ? dot + b[e] : dot;
            mx = p[e] > mx ? p[e] : mx;
        }
        for (int e = 0; e < E; e++) sum += p[e] = expf(p[e] - mx);
        for (int e = 0; e < E; e++) p[e] /= sum;
        float *wt = topw + (size_t)t * k, chosen = 0.f;
        int64_t *it = ids + (size_t)t * k;
        top_k_float(p, 1, E, k, it, 1);
        for (int j = 0; j < k; j++) { /* top_k_float's order is unset: descending, ties by index */
            int best = j;
            for (int i = j + 1; i < k; i++)
                if (p[it[i]] > p[it[best]] || (p[it[i]] == p[it[best]] && it[i] < it[best])) best = i;
            const int64_t s = it[j];
            it[j] = it[best], it[best] = s;
            chosen += wt[j] = p[it[j]];
        }
        if (renormalize)
            for (int j = 0; j < k; j++) wt[j] /= chosen;
    }
}
