/* Recurrent layers' one-token updates, in place on each sequence's state slot.
 *
 * gated_delta_rule_decode: the gated delta rule (Yang, Kautz & Hatamizadeh 2024, "Gated Delta Networks"), Qwen3.5's
 * linear attention, for one new token of each of `batch` sequences. Per value head, with S its [dk, dv] state:
 *     S <- exp(g) S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q
 * computed in two passes over S (the first reads it for S^T k, the second writes the update and reads it for o),
 * where torch's ops would make five. The caller L2-normed q and k (q also scaled), and expanded them to the value
 * heads.
 */
#include <math.h>
#include <stdint.h>

/* state: float32, slot s's head h at state + s * slot_stride + h * dk * dv, [dk, dv] row-major; slots: int64
 * [batch]; q, k: float32 [batch, heads, dk]; v, out: [batch, heads, dv]; g, beta: [batch, heads]. dv <= 1024. */
void gated_delta_rule_decode(float *state, int64_t slot_stride, const int64_t *slots, int batch, int heads, int dk,
                             int dv, const float *q, const float *k, const float *v, const float *g,
                             const float *beta, float *out, int threads) {
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < heads; h++) {
            const int64_t bh = (int64_t)b * heads + h;
            float *s = state + slots[b] * slot_stride + (int64_t)h * dk * dv;
            const float *qh = q + bh * dk, *kh = k + bh * dk, *vh = v + bh * dv;
            float *o = out + bh * dv;
            const float decay = expf(g[bh]), rate = beta[bh];
            float delta[1024];
            for (int j = 0; j < dv; j++)
                delta[j] = 0.0f;
            for (int i = 0; i < dk; i++) {
                const float ki = kh[i] * decay;
                const float *row = s + (int64_t)i * dv;
                for (int j = 0; j < dv; j++)
                    delta[j] += ki * row[j];
            }
            for (int j = 0; j < dv; j++) {
                delta[j] = (vh[j] - delta[j]) * rate;
                o[j] = 0.0f;
            }
            for (int i = 0; i < dk; i++) {
                const float ki = kh[i], qi = qh[i];
                float *row = s + (int64_t)i * dv;
                for (int j = 0; j < dv; j++) {
                    const float x = row[j] * decay + ki * delta[j];
                    row[j] = x;
                    o[j] += qi * x;
                }
            }
        }
    }
}
