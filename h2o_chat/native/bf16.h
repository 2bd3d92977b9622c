/* bf16 <-> float32 for the native kernels: a bf16 is a float32's top 16 bits. */
#ifndef H2O_CHAT_BF16_H
#define H2O_CHAT_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bits_to_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float from_bf16(uint16_t x) { return bits_to_float((uint32_t)x << 16); }

/* Round to nearest even, as torch's bf16 cast (a NaN stays a quiet NaN). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }

#endif
