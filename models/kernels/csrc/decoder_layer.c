/* One Llama-family decoder layer in one call, for the few rows of a decode step on the CPU (float32 activations,
 * GGUF weights, a float32 or quantized (--kv-cache-dtype) paged KV cache; or, for a bfloat16 model (attn_bf16), q, k,
 * v and the attention in bfloat16 over a bfloat16 or quantized cache, as its op-by-op layer computes them): the
 * sequence models/llama.py's LlamaDecoderLayer runs op by op,
 *
 *     h = RMSNorm(residual += x)               add_rms_norm_float
 *     q | k | v = h Wqkv^T (+ b)               gguf_r16_linear / gguf_q8_linear / gguf_linear, per segment
 *     rotate q and k                           rotary_float
 *     a = attention(q, k, v, paged cache)      paged_attention_float[_q] (writes the new K/V first)
 *     a *= sigmoid(g)                          sigmoid_gate_float (Qwen3.5's gated attention: q | k | v | g)
 *     h = RMSNorm(residual += a Wo^T)
 *     x = (SiLU(h Wg^T) * (h Wu^T)) Wd^T       silu_and_mul_float between two linears
 *
 * or, for a mixture-of-experts layer (Qwen3-MoE's, Mixtral's: num_experts > 0), the last line as SparseMoeBlock
 * computes it:
 *
 *     ids, w = top-k softmax(h Wr^T)           moe_route_float
 *     x = sum_j w_j expert_ids_j(h)            gguf_moe (each expert's SiLU-gated MLP)
 *
 * with the layer's tensors described once (LayerDesc, filled by models/layers/fused_layer.py) and no Python
 * between the kernels: at batch 1 the interpreter and the OpenMP wake-ups around ~10 Python-level ops per layer
 * cost more than the layer's arithmetic (issue 34, "one C call per decoder layer"). The arithmetic is the kernels',
 * so the result equals the op-by-op path's bit for bit; where every kernel of a layer has a team form, a step's
 * layers run in one OpenMP parallel region, the kernels sharing out their work among its threads
 * (decoder_layers_float below), else each kernel runs on a team of its own.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_HEADS_DIM 16384 /* (query heads) x head_dim of a layer whose q and k heads the call normalizes */
#define MAX_SEGMENTS 4      /* fused_layer.py's: q | k | v | Qwen3.5's output gate */

/* one linear layer's weight: up to MAX_SEGMENTS stacked segments of GGUF blocks (q | k in Q4_K, v in Q6_K, say) */
typedef struct {
    int n;
    const uint8_t *data[MAX_SEGMENTS];
    int type[MAX_SEGMENTS], rows[MAX_SEGMENTS];
    /* 0: the exact float32 kernel, 1: gguf_q8_linear (int8 activations), 2: gguf_r16_linear, 3: gguf_r16_linear_i8 */
    int kernel[MAX_SEGMENTS];
    const void *bias; /* [sum rows] in the output's dtype (float32, or bfloat16 for a bfloat16 model's qkv), or
                         NULL */
    /* a segment's R16 copy beside its blocks (a large Q8_0 weight: GGUFTensor.r16_copy) or NULL, taken with
     * kernel copy_kernel for steps of at least copy_rows rows, as GGUFTensor.matmul takes it */
    const uint8_t *copy[MAX_SEGMENTS];
    int copy_kernel, copy_rows;
} LayerLinear;

typedef struct {
    int hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps, scale;
    int use_rope, window, block_size;
    int kvq;       /* the cache's quantization code (models/attention/kv_cache_dtype.py), 0 for none */
    int attn_bf16; /* q | k | v out of their linear, rotary, the attention and o_proj's input in bfloat16 */
    const float *input_norm, *post_norm; /* float32 [hidden] */
    LayerLinear qkv, o, gate_up, down;
    /* Qwen3's RMSNorm over each head of q and of k before the rotation: [head_dim] in q's dtype, or NULL */
    const void *q_norm, *k_norm;
    float qk_eps;
    /* a mixture-of-experts MLP in place of gate_up and down where num_experts > 0: the router float32 [E, hidden]
     * (+ bias [E] or NULL), top_k experts a token (renormalised or not), and every expert's gate, up and down as
     * gguf_moe takes them (moe_kernel its `r16`); inter is an expert's */
    int num_experts, top_k, renormalize, moe_kernel;
    const float *router, *router_bias;
    const uint8_t *experts[3];
    int expert_type[3];
    /* gpt-oss: the experts' biases float32 [E, 2 inter] (gate | up) and [E, hidden] or NULL, its clamped SwiGLU's
     * limit (0: SiLU) and alpha, as gguf_moe takes them; a learnt logit per query head joining each softmax (float32
     * [num_heads], the attention's sinks) or NULL */
    const float *expert_b13, *expert_b2;
    float swiglu_limit, swiglu_alpha;
    const float *sinks;
    /* Qwen3.5's attention: the leading `rotary_dim` features of each head rotate (partial rotary; 0 for
     * all), and with `output_gate` qkv holds a fourth part, [num_heads * head_dim] gates, and the attention's output
     * is multiplied by their sigmoid before o_proj (sigmoid_gate_float / _bf16) */
    int rotary_dim, output_gate;
} LayerDesc;

int gguf_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                int y_stride, int M, int N, int K, int num_threads);
int gguf_q8_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                   int y_stride, int M, int N, int K, int num_threads);
int gguf_r16_linear(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                    int y_stride, int M, int N, int K, int num_threads);
int gguf_r16_linear_i8(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                       int y_stride, int M, int N, int K, int num_threads);
void add_rms_norm_float(float *residual, const float *delta, const float *weight, float *out, int num_tokens,
                        int hidden, float eps, int num_threads);
void add_rms_norm_bf16(float *residual, const bf16 *delta, const bf16 *weight, bf16 *out, int num_tokens, int hidden,
                       float eps, int num_threads);
void rotary_float(float *x, int num_tokens, int heads, int stride, int head_stride, int D, const float *cos_t,
                  const float *sin_t, int num_threads);
void silu_and_mul_float(const float *gate_up, float *out, int num_tokens, int inter, int num_threads);
void rotary_bf16(bf16 *x, int num_tokens, int heads, int stride, int head_stride, int D, const float *cos_t,
                 const float *sin_t, int num_threads);
void sigmoid_gate_float(float *x, int x_stride, const float *gate, int gate_stride, int num_tokens, int n,
                        int num_threads);
void sigmoid_gate_bf16(bf16 *x, int x_stride, const bf16 *gate, int gate_stride, int num_tokens, int n,
                       int num_threads);
/* models/kernels/csrc/paged_attention.c's entry points: activations in T, the cache in TC */
#define PAGED_ATTENTION_DECL(NAME, T, TC)                                                                          \
    int paged_attention_##NAME(const T *q, int q_stride, const T *k, int k_stride, const T *v, int v_stride,        \
                               TC *k_cache, TC *v_cache, const int64_t *slot_mapping, int num_tokens,               \
                               const int32_t *block_tables, const int32_t *seq_lens,                                \
                               const int32_t *query_start_loc, T *out, int num_seqs, int num_heads, int num_kv_heads, \
                               int D, int bs, int max_blocks, float scale, int window, float softcap,               \
                               int num_threads, int isa, int kvq, const float *sinks);
PAGED_ATTENTION_DECL(float, float, float)
PAGED_ATTENTION_DECL(float_q, float, uint8_t)
PAGED_ATTENTION_DECL(bf16, bf16, bf16)
PAGED_ATTENTION_DECL(bf16_q, bf16, uint8_t)

void *kernel_scratch(int slot, size_t bytes);
/* the team forms of the kernels (layer_ops.c, gguf_linear.c, paged_attention.c): called by every thread of a team
 * inside one parallel region, each returning once its output is whole, but layer_ops.c's per-token ops, which return
 * once the thread's own tokens are done: each is followed here by a kernel whose first loop gives the thread the same
 * tokens (a linear's activations, the attention's K/V write) */
void add_rms_norm_float_team(float *residual, const float *delta, const float *weight, float *out, int num_tokens,
                             int hidden, float eps, int num_threads);
void rotary_float_team(float *x, int num_tokens, int heads, int stride, int head_stride, int D, const float *cos_t,
                       const float *sin_t, int num_threads);
void rotary_bf16_team(bf16 *x, int num_tokens, int heads, int stride, int head_stride, int D, const float *cos_t,
                      const float *sin_t, int num_threads);
void silu_and_mul_float_team(const float *gate_up, float *out, int num_tokens, int inter, int num_threads);
void sigmoid_gate_float_team(float *x, int x_stride, const float *gate, int gate_stride, int num_tokens, int n,
                             int num_threads);
void sigmoid_gate_bf16_team(bf16 *x, int x_stride, const bf16 *gate, int gate_stride, int num_tokens, int n,
                            int num_threads);
int gguf_r16_isa(void);
long gguf_r16_bytes(int type, int N, int K);
int gguf_amx_takes(int M);
size_t gguf_r16_acts_bytes(int type, int M, int K, int int8);
long gguf_q8_acts_bytes(int type, int M, int K);
void gguf_q8_linear_team(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                         int y_stride, int M, int N, int K, void *ws);
int gguf_q8_isa(void);
void gguf_r16_linear_team(const void *x, int x_bf16, int x_stride, const uint8_t *w, int type, void *y, int y_bf16,
                          int y_stride, int M, int N, int K, int int8, void *ws);
int attention_tiles(int num_seqs, const int32_t *query_start_loc, const int32_t *seq_lens, int *tile_start);
int attention_workspace(int num_tiles, int max_len, int num_heads, int num_kv_heads, int D, int window, int kvq,
                        int num_threads, size_t *thread_floats, size_t *part_floats);
#define PAGED_ATTENTION_TEAM_DECL(NAME, T, TC)                                                                     \
    void paged_attention_team_##NAME(                                                                               \
        const T *q, int q_stride, const T *k, int k_stride, const T *v, int v_stride, TC *k_cache, TC *v_cache,     \
        const int64_t *slot_mapping, int num_tokens, const int32_t *block_tables, const int32_t *seq_lens,          \
        const int32_t *query_start_loc, T *out, int num_seqs, int num_heads, int num_kv_heads, int D, int bs,       \
        int max_blocks, float scale, int window, float softcap, int num_threads, int isa, int kvq,                  \
        const float *sinks, const int *tile_start, int max_len, float *thread_ws, float *part_ws);
PAGED_ATTENTION_TEAM_DECL(float, float, float)
PAGED_ATTENTION_TEAM_DECL(float_q, float, uint8_t)
PAGED_ATTENTION_TEAM_DECL(bf16, bf16, bf16)
PAGED_ATTENTION_TEAM_DECL(bf16_q, bf16, uint8_t)
void moe_route_float(const float *x, int n, int H, const float *w, const float *b, int E, int k, int renormalize,
                     int64_t *ids, float *topw, int num_threads);
int gguf_moe(const float *x, int T, int hidden, const int64_t *ids, const float *topw, int top_k,
             const uint8_t *w_gate, int t_gate, const uint8_t *w_up, int t_up, const uint8_t *w_down, int t_down,
             int num_experts, int inter, const float *b13, const float *b2, float limit, float alpha, int geglu,
             int r16, float *out, int num_threads);

static int out_rows(const LayerLinear *w) {
    int n = 0;
    for (int s = 0; s < w->n; s++) n += w->rows[s];
    return n;
}

/* the kernel and the bytes a segment of w runs on for M rows: its R16 copy's from copy_rows rows where it has one */
static int segment_kernel(const LayerLinear *w, int s, int M, const uint8_t **data) {
    const int copy = w->copy[s] && M >= w->copy_rows;
    *data = copy ? w->copy[s] : w->data[s];
    return copy ? w->copy_kernel : w->kernel[s];
}

/* row m of y [M, N] += w's bias, in y's dtype: added to the rounded product, as torch adds a bfloat16 bias (in
 * float32, rounded once more) */
static void add_bias(const LayerLinear *w, void *y, int y_bf16, int N, int m) {
    for (int j = 0; j < N; j++) {
        if (y_bf16) {
            bf16 *yj = (bf16 *)y + (size_t)m * N + j;
            *yj = f32_to_bf16(bf16_to_f32(*yj) + bf16_to_f32(((const bf16 *)w->bias)[j]));
        } else {
            ((float *)y)[(size_t)m * N + j] += ((const float *)w->bias)[j];
        }
    }
}

/* y [M, out_rows(w)] = x [M, K] W^T (+ b, add_bias), x and y float32 or (x_bf16, y_bf16) bfloat16 */
static int layer_linear(const LayerLinear *w, const void *x, int x_bf16, int K, void *y, int y_bf16, int M, int nt) {
    const int N = out_rows(w);
    for (int s = 0, at = 0; s < w->n; at += w->rows[s], s++) {
        const uint8_t *data;
        const int k = segment_kernel(w, s, M, &data);
        int (*const kernel)(const void *, int, int, const uint8_t *, int, void *, int, int, int, int, int, int) =
            k == 3   ? gguf_r16_linear_i8
            : k == 2 ? gguf_r16_linear
            : k == 1 ? gguf_q8_linear
                     : gguf_linear;
        void *ys = y_bf16 ? (void *)((bf16 *)y + at) : (void *)((float *)y + at);
        const int rc = kernel(x, x_bf16, K, data, w->type[s], ys, y_bf16, N, M, w->rows[s], K, nt);
        if (rc != 0) return rc;
    }
    if (w->bias)
        for (int m = 0; m < M; m++) add_bias(w, y, y_bf16, N, m);
    return 0;
}

/* A layer's activations in one workspace of layer_ws_bytes: h [M, hidden], qkv [M, q | k | v (| gate)], attn [M,
 * heads * head_dim], o [M, hidden], gu [M, 2 inter], act [M, inter], and a mixture of experts' top-k weights and ids
 * [M, top_k] */
typedef struct {
    float *h, *qkv, *attn, *o, *gu, *act, *topw;
    int64_t *ids;
} LayerBuffers;

static size_t layer_floats(const LayerDesc *L, int M) { /* an even count: the int64 ids after them stay aligned */
    const int nq = L->num_heads * L->head_dim, nkv = L->num_kv_heads * L->head_dim;
    const size_t qkv_n = nq + 2 * nkv + (L->output_gate ? nq : 0);
    return ((size_t)M * (2 * L->hidden + qkv_n + nq + 3 * L->inter + L->top_k) + 1) & ~(size_t)1;
}

static size_t layer_ws_bytes(const LayerDesc *L, int M) {
    return sizeof(float) * layer_floats(L, M) + sizeof(int64_t) * (size_t)M * L->top_k;
}

static LayerBuffers layer_buffers(const LayerDesc *L, int M, float *ws) {
    const int nq = L->num_heads * L->head_dim, nkv = L->num_kv_heads * L->head_dim;
    const size_t qkv_n = nq + 2 * nkv + (L->output_gate ? nq : 0);
    LayerBuffers b = {.h = ws};
    b.qkv = b.h + (size_t)M * L->hidden, b.attn = b.qkv + (size_t)M * qkv_n, b.o = b.attn + (size_t)M * nq;
    b.gu = b.o + (size_t)M * L->hidden, b.act = b.gu + (size_t)M * 2 * L->inter, b.topw = b.act + (size_t)M * L->inter;
    b.ids = (int64_t *)(ws + layer_floats(L, M));
    return b;
}

/* x_out [M, hidden] = (SiLU(h Wg^T) * (h Wu^T)) Wd^T, the layers' SwiGLU MLP, through gu [M, 2 inter] and act
 * [M, inter]; returns 0 or the failing linear's status */
static int swiglu_mlp(const LayerLinear *gate_up, const LayerLinear *down, const float *h, int H, int inter,
                      float *gu, float *act, float *x_out, int M, int nt) {
    int rc;
    if ((rc = layer_linear(gate_up, h, 0, H, gu, 0, M, nt))) return rc;
    silu_and_mul_float(gu, act, M, inter, nt);
    return layer_linear(down, act, 0, inter, x_out, 0, M, nt);
}

/* Qwen3's q_norm and k_norm over each token's q | k rows (qkv_n apart), in place, as models/layers/layernorm.py's
 * HeadRMSNorm runs them op by op: add_rms_norm over each head's D values (bfloat16 heads widened first, exactly) */
static void head_norms(const LayerDesc *L, void *qkv, int qkv_n, int M) {
    const int D = L->head_dim, heads[2] = {L->num_heads, L->num_kv_heads};
    const void *w[2] = {L->q_norm, L->k_norm};
    float row[MAX_HEADS_DIM];
    for (int m = 0; m < M; m++)
        for (int p = 0, at = 0; p < 2; at += heads[p] * D, p++) {
            if (!L->attn_bf16) {
                float *x = (float *)qkv + (size_t)m * qkv_n + at;
                add_rms_norm_float(x, NULL, w[p], x, heads[p], D, L->qk_eps, 1);
                continue;
            }
            bf16 *x = (bf16 *)qkv + (size_t)m * qkv_n + at;
            for (int i = 0; i < heads[p] * D; i++) row[i] = bf16_to_f32(x[i]);
            add_rms_norm_bf16(row, NULL, w[p], x, heads[p], D, L->qk_eps, 1);
        }
}

/* residual float32 [M, hidden], updated in place; x_in [M, hidden] (the previous layer's MLP output, or NULL);
 * x_out [M, hidden] (this layer's MLP output, not yet added); cos_t, sin_t float32 [M, head_dim / 2]; the cache
 * (float32, bfloat16 with L->attn_bf16, or the bytes of a quantized one when L->kvq) and metadata as
 * paged_attention_{float,bf16}[_q] take them.
 * The layer kernel by kernel, each on a team of its own (decoder_layers_float below takes the one-region form where
 * the layer has one). Returns 0, or the failing kernel's status (nothing is half-written then but this layer's own
 * K/V slots and residual). */
static int decoder_layer_ops(const LayerDesc *L, float *residual, const float *x_in, float *x_out, int M,
                             const float *cos_t, const float *sin_t, void *k_cache, void *v_cache,
                             const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *seq_lens,
                             const int32_t *query_start_loc, int num_seqs, int max_blocks, int isa, int nt) {
    const int H = L->hidden, D = L->head_dim, nq = L->num_heads * D, nkv = L->num_kv_heads * D;
    const int qkv_n = nq + 2 * nkv + (L->output_gate ? nq : 0), heads = L->num_heads + L->num_kv_heads;
    const int rot = L->rotary_dim ? L->rotary_dim : D;
    const LayerBuffers lb = layer_buffers(L, M, kernel_scratch(2, layer_ws_bytes(L, M)));
    float *h = lb.h, *qkv = lb.qkv, *attn = lb.attn, *o = lb.o, *gu = lb.gu, *act = lb.act, *topw = lb.topw;
    int64_t *ids = lb.ids;
    int rc;
    add_rms_norm_float(residual, x_in, L->input_norm, h, M, H, L->eps, nt);
    if ((rc = layer_linear(&L->qkv, h, 0, H, qkv, L->attn_bf16, M, nt))) return rc;
    if (L->q_norm) head_norms(L, qkv, qkv_n, M);
/* paged_attention_NAME on q | k | v rows `q` (qkv_n apart) into `out` */
#define ATTEND(NAME, q, out, kvq)                                                                                  \
    paged_attention_##NAME(q, qkv_n, (q) + nq, qkv_n, (q) + nq + nkv, qkv_n, k_cache, v_cache, slot_mapping, M,       \
                           block_tables, seq_lens, query_start_loc, out, num_seqs, L->num_heads, L->num_kv_heads, D, \
                           L->block_size, max_blocks, L->scale, L->window, 0.f, nt, isa, kvq, L->sinks)
    if (L->attn_bf16) {
        bf16 *q = (bf16 *)qkv, *a = (bf16 *)attn;
        if (L->use_rope) rotary_bf16(q, M, heads, qkv_n, D, rot, cos_t, sin_t, nt);
        rc = L->kvq ? ATTEND(bf16_q, q, a, L->kvq) : ATTEND(bf16, q, a, 0);
        if (!rc && L->output_gate) sigmoid_gate_bf16(a, nq, q + nq + 2 * nkv, qkv_n, M, nq, nt);
    } else {
        if (L->use_rope) rotary_float(qkv, M, heads, qkv_n, D, rot, cos_t, sin_t, nt);
        rc = L->kvq ? ATTEND(float_q, qkv, attn, L->kvq) : ATTEND(float, qkv, attn, 0);
        if (!rc && L->output_gate) sigmoid_gate_float(attn, nq, qkv + nq + 2 * nkv, qkv_n, M, nq, nt);
    }
#undef ATTEND
    if (rc) return rc;
    if ((rc = layer_linear(&L->o, attn, L->attn_bf16, nq, o, 0, M, nt))) return rc;
    add_rms_norm_float(residual, o, L->post_norm, h, M, H, L->eps, nt);
    if (L->num_experts) {
        moe_route_float(h, M, H, L->router, L->router_bias, L->num_experts, L->top_k, L->renormalize, ids, topw, nt);
        return gguf_moe(h, M, H, ids, topw, L->top_k, L->experts[0], L->expert_type[0], L->experts[1],
                        L->expert_type[1], L->experts[2], L->expert_type[2], L->num_experts, L->inter, L->expert_b13,
                        L->expert_b2, L->swiglu_limit, L->swiglu_alpha, 0, L->moe_kernel, x_out, nt);
    }
    return swiglu_mlp(&L->gate_up, &L->down, h, H, L->inter, gu, act, x_out, M, nt);
}

/* ---- A step's layers in one parallel region ----
 * Each kernel above runs on a team of its own: ~8 teams a layer (240 a step of the default model), each a fork, a
 * join and the threads' reads of the weights started afresh. Reading the default model's weights in its step's
 * pattern (2 threads, a Zen 5 EPYC) took 2.17 ms with a team per kernel against 1.87 ms in one region with a
 * barrier between kernels. So where every kernel of every layer has a team form (the R16 linears and the AVX2
 * int8 ones, the norms, rotary, the output gate, SiLU-and-mul, the attention; the same arithmetic and the same split
 * of the work), the layers run in one region: each thread walks the whole stack, sharing out each kernel's work with
 * the others and meeting them at its end. Other layers (a mixture of experts; a weight on gguf_linear; AMX tiles
 * taking the step's rows) run kernel by kernel. */

/* the most bytes of activations a segment of w takes on its kernel for M rows of K (the R16 kernels, or the AVX2
 * int8 kernel: gguf_q8_linear), or -1 where a segment is on another kernel (or its type has no R16 layout) */
static long linear_team_bytes(const LayerLinear *w, int K, int M) {
    long most = 0;
    for (int s = 0; s < w->n; s++) {
        const uint8_t *data;
        const int k = segment_kernel(w, s, M, &data);
        long b;
        if (k == 1) {
            if ((b = gguf_q8_acts_bytes(w->type[s], M, K)) < 0) return -1;
        } else {
            if ((k != 2 && k != 3) || gguf_r16_bytes(w->type[s], 1, K) < 0) return -1;
            b = (long)gguf_r16_acts_bytes(w->type[s], M, K, k == 3);
        }
        most = b > most ? b : most;
    }
    return most;
}

/* linear_team_bytes over the layer's four linears, or -1 where the layer has no team form for M rows */
static long layer_team_bytes(const LayerDesc *L, int M) {
    if (L->num_experts) return -1;
    const long b[4] = {linear_team_bytes(&L->qkv, L->hidden, M),
                       linear_team_bytes(&L->o, L->num_heads * L->head_dim, M),
                       linear_team_bytes(&L->gate_up, L->hidden, M), linear_team_bytes(&L->down, L->inter, M)};
    long most = 0;
    for (int i = 0; i < 4; i++) {
        if (b[i] < 0) return -1;
        most = b[i] > most ? b[i] : most;
    }
    return most;
}

/* layer_linear by the calling team (acts: the activations' shared buffer); returns on every thread once y is whole */
static void linear_team(const LayerLinear *w, const void *x, int x_bf16, int K, void *y, int y_bf16, int M,
                        void *acts) {
    const int N = out_rows(w);
    for (int s = 0, at = 0; s < w->n; at += w->rows[s], s++) {
        const uint8_t *data;
        const int k = segment_kernel(w, s, M, &data);
        void *ys = y_bf16 ? (void *)((bf16 *)y + at) : (void *)((float *)y + at);
        if (s) { /* the last segment's reads of acts done */
            _Pragma("omp barrier")
        }
        if (k == 1)
            gguf_q8_linear_team(x, x_bf16, K, data, w->type[s], ys, y_bf16, N, M, w->rows[s], K, acts);
        else
            gguf_r16_linear_team(x, x_bf16, K, data, w->type[s], ys, y_bf16, N, M, w->rows[s], K, k == 3, acts);
    }
    _Pragma("omp barrier")
    if (!w->bias) return;
    _Pragma("omp for schedule(static)")
    for (int m = 0; m < M; m++) add_bias(w, y, y_bf16, N, m);
}

/* the shared buffers of a step's team */
typedef struct {
    float *ws;        /* the layer's activations (layer_buffers) */
    void *acts;       /* a linear's quantized activations */
    int *tile_start;  /* attention_tiles' */
    int max_len;
    float *thread_ws, *part_ws; /* the attention's */
} TeamBuffers;

/* decoder_layer_ops' sequence by the calling team, with the same kernels' team forms */
static void decoder_layer_team(const LayerDesc *L, float *residual, const float *x_in, float *x_out, int M,
                               const float *cos_t, const float *sin_t, void *k_cache, void *v_cache,
                               const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *seq_lens,
                               const int32_t *query_start_loc, int num_seqs, int max_blocks, int isa, int nt,
                               const TeamBuffers *b) {
    const int H = L->hidden, D = L->head_dim, nq = L->num_heads * D, nkv = L->num_kv_heads * D;
    const int qkv_n = nq + 2 * nkv + (L->output_gate ? nq : 0), heads = L->num_heads + L->num_kv_heads;
    const int rot = L->rotary_dim ? L->rotary_dim : D;
    const LayerBuffers lb = layer_buffers(L, M, b->ws);
    float *h = lb.h, *qkv = lb.qkv, *attn = lb.attn, *o = lb.o, *gu = lb.gu, *act = lb.act;
    add_rms_norm_float_team(residual, x_in, L->input_norm, h, M, H, L->eps, nt);
    linear_team(&L->qkv, h, 0, H, qkv, L->attn_bf16, M, b->acts);
    if (L->q_norm) {
        _Pragma("omp single")
        head_norms(L, qkv, qkv_n, M);
    }
#define ATTEND_TEAM(NAME, q, out, kvq)                                                                             \
    paged_attention_team_##NAME(q, qkv_n, (q) + nq, qkv_n, (q) + nq + nkv, qkv_n, k_cache, v_cache, slot_mapping, M,  \
                                block_tables, seq_lens, query_start_loc, out, num_seqs, L->num_heads, L->num_kv_heads, \
                                D, L->block_size, max_blocks, L->scale, L->window, 0.f, nt, isa, kvq, L->sinks,        \
                                b->tile_start, b->max_len, b->thread_ws, b->part_ws)
    if (L->attn_bf16) {
        bf16 *q = (bf16 *)qkv, *a = (bf16 *)attn;
        if (L->use_rope) rotary_bf16_team(q, M, heads, qkv_n, D, rot, cos_t, sin_t, nt);
        if (L->kvq) ATTEND_TEAM(bf16_q, q, a, L->kvq);
        else ATTEND_TEAM(bf16, q, a, 0);
        if (L->output_gate) sigmoid_gate_bf16_team(a, nq, q + nq + 2 * nkv, qkv_n, M, nq, nt);
    } else {
        if (L->use_rope) rotary_float_team(qkv, M, heads, qkv_n, D, rot, cos_t, sin_t, nt);
        if (L->kvq) ATTEND_TEAM(float_q, qkv, attn, L->kvq);
        else ATTEND_TEAM(float, qkv, attn, 0);
        if (L->output_gate) sigmoid_gate_float_team(attn, nq, qkv + nq + 2 * nkv, qkv_n, M, nq, nt);
    }
#undef ATTEND_TEAM
    linear_team(&L->o, attn, L->attn_bf16, nq, o, 0, M, b->acts);
    add_rms_norm_float_team(residual, o, L->post_norm, h, M, H, L->eps, nt);
    linear_team(&L->gate_up, h, 0, H, gu, 0, M, b->acts);
    silu_and_mul_float_team(gu, act, M, L->inter, nt);
    linear_team(&L->down, act, 0, L->inter, x_out, 0, M, b->acts);
}

/* the attention's tiles of a step (attention_tiles), shared by every layer of its one-region runs */
typedef struct {
    int *tile_start; /* NULL where no layer can run in one region for the step's rows */
    int max_len;
} StepTiles;

/* whether layer l runs in one region for M rows: every linear on the R16 kernels and an attention workspace for the
 * step's tiles; its buffers' sizes then raised to cover it (acts: a linear's activations; thread_floats,
 * part_floats: the attention's) */
static int layer_has_team(const LayerDesc *l, int M, const StepTiles *t, int num_seqs, int nt, size_t *ws_bytes,
                          size_t *acts, size_t *thread_floats, size_t *part_floats) {
    if (!t->tile_start) return 0;
    const long a = layer_team_bytes(l, M);
    size_t tf, pf;
    if (a < 0 || attention_workspace(t->tile_start[num_seqs], t->max_len, l->num_heads, l->num_kv_heads, l->head_dim,
                                     l->window, l->kvq, nt, &tf, &pf))
        return 0;
    const size_t f = layer_ws_bytes(l, M);
    *ws_bytes = f > *ws_bytes ? f : *ws_bytes;
    *acts = (size_t)a > *acts ? (size_t)a : *acts;
    *thread_floats = tf > *thread_floats ? tf : *thread_floats;
    *part_floats = pf > *part_floats ? pf : *part_floats;
    return 1;
}

/* n consecutive layers L[0 .. n-1] of one step in one call (Python only per step): each layer's MLP output is the
 * next one's input, in x_out [M, hidden] (a layer reads its x_in before it writes its x_out, so they may be one
 * buffer); x_in the first layer's input (NULL at the model's first layer); k_caches[i] and v_caches[i] layer i's
 * cache; the step's metadata shared by every layer (one KV cache group). Each run of consecutive layers that have a
 * one-region form for M rows (layer_has_team) runs in one parallel region (decoder_layer_team), each other layer
 * kernel by kernel (decoder_layer_ops): a stack whose dense layers sit between layers with experts keeps its dense
 * runs in one region, and each layer's verdict is taken once a step. Returns 0, or the first failing layer's status
 * (the team forms cannot fail: their shapes were checked first). */
int decoder_layers_float(const LayerDesc *const *L, int n, float *residual, const float *x_in, float *x_out, int M,
                         const float *cos_t, const float *sin_t, void *const *k_caches, void *const *v_caches,
                         const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *seq_lens,
                         const int32_t *query_start_loc, int num_seqs, int max_blocks, int isa, int nt) {
    StepTiles t = {NULL, 0};
    if ((gguf_r16_isa() || gguf_q8_isa()) && !gguf_amx_takes(M)) {
        t.tile_start = malloc(sizeof(int) * (num_seqs + 1));
        t.max_len = attention_tiles(num_seqs, query_start_loc, seq_lens, t.tile_start);
    }
    int rc = 0;
    for (int i = 0; i < n && !rc;) {
        size_t ws_bytes = 0, acts = 0, thread_floats = 0, part_floats = 0;
        int j = i; /* layers i .. j - 1 in one region, then layer j (if any) kernel by kernel */
        while (j < n && layer_has_team(L[j], M, &t, num_seqs, nt, &ws_bytes, &acts, &thread_floats, &part_floats)) j++;
        if (j > i) {
            const float *in = i ? x_out : x_in;
            const TeamBuffers b = {.ws = kernel_scratch(2, ws_bytes),
                                   .acts = kernel_scratch(3, acts),
                                   .tile_start = t.tile_start,
                                   .max_len = t.max_len,
                                   .thread_ws = kernel_scratch(0, sizeof(float) * (size_t)nt * thread_floats),
                                   .part_ws = part_floats ? kernel_scratch(1, sizeof(float) * part_floats) : NULL};
            _Pragma("omp parallel num_threads(nt)")
            for (int l = i; l < j; l++)
                decoder_layer_team(L[l], residual, l > i ? x_out : in, x_out, M, cos_t, sin_t, k_caches[l],
                                   v_caches[l], slot_mapping, block_tables, seq_lens, query_start_loc, num_seqs,
                                   max_blocks, isa, nt, &b);
        }
        if (j < n)
            rc = decoder_layer_ops(L[j], residual, j ? x_out : x_in, x_out, M, cos_t, sin_t, k_caches[j], v_caches[j],
                                   slot_mapping, block_tables, seq_lens, query_start_loc, num_seqs, max_blocks, isa,
                                   nt);
        i = j + 1;
    }
    free(t.tile_start);
    return rc;
}

/* ---- A step's layers with the ends of the model in one call ----
 * Around the layers' one call a batch-1 decode step ran ~10 Python-level ops: the embedding lookup, the rotary
 * tables' gather, the final norm, the LM head and the rescoring of its best logits. With the caches cold from the
 * layers' weights each cost 20-80 us (0.3 ms a step of the default model on a Zen 4 EPYC, against ~1 ms for all of
 * the step's Python). decoder_step_float runs them here with the kernels their ops call (gguf_embed_rows,
 * add_rms_norm_float, the LM head's layer_linear, gguf_refine_top), so the result is the op-by-op model's bit for
 * bit. */

int gguf_embed_rows(int type, const uint8_t *w, int r16, int rows, int K, const int64_t *ids, int n, float *dst,
                    int round_bf16, int num_threads);
int gguf_refine_top(const float *hidden, int n, int K, const uint8_t *w, int type, int r16, float *out, int V, int k,
                    int num_threads);
void top_k_float(const float *x, int n, int v, int k, int64_t *out, int num_threads);

/* The ends of a model's stack that decoder_step_float computes, filled by models/layers/fused_layer.py's
 * StepEnds: a NULL embedding leaves it to the caller, a NULL norm marks a stage but the last, head.n 0 leaves the
 * logits to the caller */
typedef struct {
    /* the first pipeline stage's token embedding: GGUF rows [embed_rows, hidden] (R16 where embed_r16), rounded to
     * bfloat16 first where embed_bf16 (looked up in a bfloat16 model's dtype) */
    const uint8_t *embed;
    int embed_type, embed_r16, embed_rows, embed_bf16;
    const float *cos, *sin; /* the rotary tables, float32 [table_rows, half] */
    int table_rows, half;
    /* the last stage's final RMSNorm (float32 [hidden]) and LM head [vocab, hidden], whose rows' best refine_k
     * logits are rescored from head_blocks (ggml blocks, or R16 where head_r16: gguf_refine_top) */
    const float *norm;
    float eps;
    LayerLinear head;
    const uint8_t *head_blocks;
    int head_type, head_r16, vocab, refine_k;
} StepEnds;

/* One step of a model's stage: the rotary tables' rows at positions [M], the layers L[0 .. n-1] as
 * decoder_layers_float runs them (its metadata arguments), and E's ends. residual float32 [M, hidden]: the stream,
 * updated in place; the embedding of ids [M] where E->embed (written here; NULL: the call's own buffer, for a last
 * stage), else the previous stage's or the caller's embedding. Where E->norm, hidden [M, hidden] = RMSNorm(residual +
 * the last layer's MLP output) and, where E->head.n, logits float32 [n_rows, vocab] are the LM head's of hidden's
 * rows `rows` [n_rows] (increasing, each below M), rescored (gguf_refine_top), and where `argmax` (int64 [n_rows])
 * each row's argmax as ops.argmax takes it (top_k_float, k = 1: the first of equal maxima) while the logits are in
 * this core's caches (cold, from Python, the scan took 50-100 us a row); else the MLP output joins residual (the
 * stream passed on to the next stage). Returns 0, -2 for a token id or position outside its table (nothing
 * computed), or the first failing kernel's status. */
int decoder_step_float(const StepEnds *E, const LayerDesc *const *L, int n, const int64_t *ids,
                       const int64_t *positions, float *residual, float *hidden, int M, void *const *k_caches,
                       void *const *v_caches, const int64_t *slot_mapping, const int32_t *block_tables,
                       const int32_t *seq_lens, const int32_t *query_start_loc, int num_seqs, int max_blocks, int isa,
                       int nt, const int64_t *rows, int n_rows, float *logits, int64_t *argmax) {
    const int H = L[0]->hidden, half = E->half, gather = n_rows < M;
    /* the MLP output x, the stream where the call owns it, the rotary rows and the logits rows' hidden states */
    float *x = kernel_scratch(4, sizeof(float) * ((size_t)M * (2 * H + 2 * half) + (gather ? (size_t)n_rows * H : 0)));
    float *cos_t = x + (size_t)M * H, *sin_t = cos_t + (size_t)M * half, *own = sin_t + (size_t)M * half;
    float *hrows = own + (size_t)M * H;
    residual = residual ? residual : own;
    for (int m = 0; m < M; m++) {
        if (positions[m] < 0 || positions[m] >= E->table_rows) return -2;
        memcpy(cos_t + (size_t)m * half, E->cos + (size_t)positions[m] * half, sizeof(float) * half);
        memcpy(sin_t + (size_t)m * half, E->sin + (size_t)positions[m] * half, sizeof(float) * half);
    }
    int rc;
    if (E->embed &&
        (rc = gguf_embed_rows(E->embed_type, E->embed, E->embed_r16, E->embed_rows, H, ids, M, residual, E->embed_bf16,
                              nt)))
        return rc;
    if ((rc = decoder_layers_float(L, n, residual, NULL, x, M, cos_t, sin_t, k_caches, v_caches, slot_mapping,
                                   block_tables, seq_lens, query_start_loc, num_seqs, max_blocks, isa, nt)))
        return rc;
    if (!E->norm) {
        for (size_t i = 0; i < (size_t)M * H; i++) residual[i] += x[i];
        return 0;
    }
    add_rms_norm_float(residual, x, E->norm, hidden, M, H, E->eps, nt);
    if (!E->head.n || n_rows == 0) return 0;
    const float *h = hidden;
    if (gather) {
        for (int r = 0; r < n_rows; r++)
            memcpy(hrows + (size_t)r * H, hidden + (size_t)rows[r] * H, sizeof(float) * H);
        h = hrows;
    }
    if ((rc = layer_linear(&E->head, h, 0, H, logits, 0, n_rows, nt))) return rc;
    if (E->refine_k && (rc = gguf_refine_top(h, n_rows, H, E->head_blocks, E->head_type, E->head_r16, logits, E->vocab,
                                             E->refine_k, nt)))
        return rc;
    if (argmax) top_k_float(logits, n_rows, E->vocab, 1, argmax, nt);
    return 0;
}

/* One layer: decoder_layers_float of n = 1 (x_in, x_out, the cache and the metadata as there) */
int decoder_layer_float(const LayerDesc *L, float *residual, const float *x_in, float *x_out, int M,
                        const float *cos_t, const float *sin_t, void *k_cache, void *v_cache,
                        const int64_t *slot_mapping, const int32_t *block_tables, const int32_t *seq_lens,
                        const int32_t *query_start_loc, int num_seqs, int max_blocks, int isa, int nt) {
    return decoder_layers_float(&L, 1, residual, x_in, x_out, M, cos_t, sin_t, &k_cache, &v_cache, slot_mapping,
                                block_tables, seq_lens, query_start_loc, num_seqs, max_blocks, isa, nt);
}

/* ---- A Gated DeltaNet decoder layer (Qwen3.5's linear-attention layers) in one call, for a decode step ----
 * The sequence models/qwen3_5.py's Qwen3_5DecoderLayer runs op by op for a layer of linear attention:
 *
 *     h = RMSNorm(residual += x)
 *     q k v | z = h Wqkvz^T, b | a = h Wba^T
 *     o = DeltaNet step(q k v, z, a, b, state)   gated_delta_net_decode (recurrent.c), on each sequence's slot
 *     h = RMSNorm(residual += o Wout^T)
 *     x = (SiLU(h Wg^T) * (h Wu^T)) Wd^T
 *
 * with the same kernels, so that the result is the op-by-op layer's bit for bit. */
typedef struct {
    int hidden, inter, nk, nv, dk, dv, kernel, tiled;
    float eps, norm_eps; /* the residual norms', the DeltaNet's gated head norm's */
    const float *input_norm, *post_norm;
    const float *conv_w, *A_log, *dt_bias, *norm_w; /* float32 [C, K], [nv], [nv], [dv] */
    LayerLinear qkvz, ba, out, gate_up, down;
} DeltaDesc;

void gated_delta_net_decode(float *state, int64_t slot_stride, const int64_t *slots, int batch, float *qkv,
                            const float *z, const float *a, const float *b, const float *conv_w, int kernel,
                            const float *A_log, const float *dt_bias, const float *norm_w, float eps, int nk, int nv,
                            int dk, int dv, int tiled, float *out, int threads);

/* residual, x_in, x_out as decoder_layer_float takes them, for M decode tokens each of its own sequence; state
 * float32 [slots, slot_stride] (the layer's, gated_delta_net_decode's layout), slots int64 [M] each sequence's.
 * Returns 0, or the failing linear's status. */
int delta_layer_float(const DeltaDesc *L, float *residual, const float *x_in, float *x_out, int M, float *state,
                      int64_t slot_stride, const int64_t *slots, int nt) {
    const int H = L->hidden, Z = L->nv * L->dv, C = 2 * L->nk * L->dk + Z, nv = L->nv;
    float *ws = kernel_scratch(
        2, sizeof(float) * (size_t)M * (H + (C + Z) + 2 * nv + C + Z + 2 * nv + Z + H + 3 * L->inter));
    float *h = ws, *qz = h + (size_t)M * H, *ba = qz + (size_t)M * (C + Z), *qkv = ba + (size_t)M * 2 * nv;
    float *z = qkv + (size_t)M * C, *b = z + (size_t)M * Z, *a = b + (size_t)M * nv, *o = a + (size_t)M * nv;
    float *d = o + (size_t)M * Z, *gu = d + (size_t)M * H, *act = gu + (size_t)M * 2 * L->inter;
    int rc;
    add_rms_norm_float(residual, x_in, L->input_norm, h, M, H, L->eps, nt);
    if ((rc = layer_linear(&L->qkvz, h, 0, H, qz, 0, M, nt)) || (rc = layer_linear(&L->ba, h, 0, H, ba, 0, M, nt)))
        return rc;
    for (int m = 0; m < M; m++) { /* the projections' parts, each contiguous, as the kernel takes them */
        memcpy(qkv + (size_t)m * C, qz + (size_t)m * (C + Z), sizeof(float) * C);
        memcpy(z + (size_t)m * Z, qz + (size_t)m * (C + Z) + C, sizeof(float) * Z);
        memcpy(b + (size_t)m * nv, ba + (size_t)m * 2 * nv, sizeof(float) * nv);
        memcpy(a + (size_t)m * nv, ba + (size_t)m * 2 * nv + nv, sizeof(float) * nv);
    }
    gated_delta_net_decode(state, slot_stride, slots, M, qkv, z, a, b, L->conv_w, L->kernel, L->A_log, L->dt_bias,
                           L->norm_w, L->norm_eps, L->nk, nv, L->dk, L->dv, L->tiled, o, nt);
    if ((rc = layer_linear(&L->out, o, 0, Z, d, 0, M, nt))) return rc;
    add_rms_norm_float(residual, d, L->post_norm, h, M, H, L->eps, nt);
    return swiglu_mlp(&L->gate_up, &L->down, h, H, L->inter, gu, act, x_out, M, nt);
}
