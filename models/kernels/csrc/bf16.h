/* bfloat16 as raw 16-bit storage, and its conversions to and from float32 (shared by every kernel). */
#ifndef MINIVLLM_BF16_H
#define MINIVLLM_BF16_H
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float bf16_to_f32(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline bf16 f32_to_bf16(float f) { /* round to nearest even */
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}
#endif
