/* Recurrent layers' one-token steps, in place on each sequence's state slot.
 *
 * gated_delta_net_decode: the gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"), Qwen3.5's
 * linear attention, for one new token of each of `batch` sequences, with the convolution before it and the gated
 * norm after it (one call where torch takes some thirty ops). Per value head, with S its [dk, dv] state:
 *     S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
 * in two passes over S (the first reads it for S^T k, the second writes the update and reads it for o).
 * models/layers/gated_delta_net.py has the torch version, the reference.
 */
#include <math.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
/* flush denormals to zero (FTZ | DAZ) in this thread for the kernel's span: a head whose decay is strong drives its
 * state toward zero, and x86 takes microcode assists on every denormal operand (here 40x slower per step) */
#define DENORMALS_OFF(saved)                                                                                          \
    const unsigned saved = _mm_getcsr();                                                                               \
    _mm_setcsr(saved | 0x8040)
#define DENORMALS_RESTORE(saved) _mm_setcsr(saved)
#else
#define DENORMALS_OFF(saved) (void)0
#define DENORMALS_RESTORE(saved) (void)0
#endif

static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* A whole Gated DeltaNet layer's one-token step between its projections (Qwen3.5's linear attention), for `batch`
 * sequences, in place on their state slots: the causal convolution over q | k | v (its last K - 1 inputs kept at the
 * slot's start, [K - 1, C] row-major), SiLU, q and k L2-normed per key head (q scaled by dk^-1/2), beta = sigmoid(b),
 * g = -exp(A_log) softplus(a + dt_bias), the gated delta rule on the slot's [nv, dk, dv] matrices (after the
 * convolution's inputs), then per value head RMSNorm(o) * norm_w * silu(z).
 *
 * qkv: float32 [batch, C] (C = 2 nk dk + nv dv), overwritten by the convolution's activated output; conv_w: [C, K]
 * (tap K - 1 on the newest input); z, out: [batch, nv dv]; a, b: [batch, nv]; A_log, dt_bias: [nv]; norm_w: [dv].
 * Value head h reads key head h mod nk when `tiled` (llama.cpp's order), else h / (nv / nk). dk, dv <= 1024. */
void gated_delta_net_decode(float *state, int64_t slot_stride, const int64_t *slots, int batch, float *qkv,
                            const float *z, const float *a, const float *b, const float *conv_w, int kernel,
                            const float *A_log, const float *dt_bias, const float *norm_w, float eps, int nk, int nv,
                            int dk, int dv, int tiled, float *out, int threads) {
    const int channels = 2 * nk * dk + nv * dv, past = kernel - 1;
    const int64_t conv_elems = (int64_t)past * channels;
#pragma omp parallel num_threads(threads)
    {
        DENORMALS_OFF(csr);
        /* the convolution: each channel of each sequence on its own */
#pragma omp for collapse(2) schedule(static)
        for (int s = 0; s < batch; s++) {
            for (int c = 0; c < channels; c++) {
                float *window = state + slots[s] * slot_stride + c; /* [past, channels]: column c */
                const float *w = conv_w + (int64_t)c * kernel;
                float x = qkv[(int64_t)s * channels + c], y = w[past] * x;
                for (int j = 0; j < past; j++)
                    y += w[j] * window[(int64_t)j * channels];
                for (int j = 0; j + 1 < past; j++)
                    window[(int64_t)j * channels] = window[(int64_t)(j + 1) * channels];
                if (past > 0)
                    window[(int64_t)(past - 1) * channels] = x;
                qkv[(int64_t)s * channels + c] = silu(y);
            }
        }
        /* each value head: its key head's q and k normed, the delta rule, the gated norm */
#pragma omp for collapse(2) schedule(static)
        for (int s = 0; s < batch; s++) {
            for (int h = 0; h < nv; h++) {
                const int kh = tiled ? h % nk : h / (nv / nk);
                const float *row = qkv + (int64_t)s * channels;
                const float *qr = row + (int64_t)kh * dk, *kr = row + (int64_t)nk * dk + (int64_t)kh * dk;
                const float *vh = row + 2 * (int64_t)nk * dk + (int64_t)h * dv;
                float qh[1024], kv[1024], delta[1024];
                float qq = 0.0f, kk = 0.0f;
                for (int i = 0; i < dk; i++) {
                    qq += qr[i] * qr[i];
                    kk += kr[i] * kr[i];
                }
                const float qs = 1.0f / sqrtf(qq + 1e-6f) / sqrtf((float)dk), ks = 1.0f / sqrtf(kk + 1e-6f);
                for (int i = 0; i < dk; i++) {
                    qh[i] = qr[i] * qs;
                    kv[i] = kr[i] * ks;
                }
                const int64_t sh = (int64_t)s * nv + h;
                const float beta = 1.0f / (1.0f + expf(-b[sh]));
                const float t = a[sh] + dt_bias[h];
                const float softplus = t > 20.0f ? t : log1pf(expf(t));
                const float decay = expf(-expf(A_log[h]) * softplus);
                float *m = state + slots[s] * slot_stride + conv_elems + (int64_t)h * dk * dv;
                for (int j = 0; j < dv; j++)
                    delta[j] = 0.0f;
                for (int i = 0; i < dk; i++) {
                    const float ki = kv[i] * decay;
                    const float *mr = m + (int64_t)i * dv;
                    for (int j = 0; j < dv; j++)
                        delta[j] += ki * mr[j];
                }
                float *o = out + sh * dv;
                for (int j = 0; j < dv; j++) {
                    delta[j] = (vh[j] - delta[j]) * beta;
                    o[j] = 0.0f;
                }
                for (int i = 0; i < dk; i++) {
                    const float ki = kv[i], qi = qh[i];
                    float *mr = m + (int64_t)i * dv;
                    for (int j = 0; j < dv; j++) {
                        const float x = mr[j] * decay + ki * delta[j];
                        mr[j] = x;
                        o[j] += qi * x;
                    }
                }
                float ss = 0.0f;
                for (int j = 0; j < dv; j++)
                    ss += o[j] * o[j];
                const float inv = 1.0f / sqrtf(ss / dv + eps);
                const float *zh = z + sh * dv;
                for (int j = 0; j < dv; j++)
                    o[j] = o[j] * inv * norm_w[j] * silu(zh[j]);
            }
        }
        DENORMALS_RESTORE(csr);
    }
}
