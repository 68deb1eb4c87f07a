/* bf16.h - float32 -> bfloat16 rounding on the host, as every bf16 consumer (checkpoint writer,
 * GPU weight upload) must do it: round to nearest even, NaN stays NaN. */
#ifndef PI0_UTIL_BF16_H
#define PI0_UTIL_BF16_H

#include <stdint.h>
#include <string.h>

static inline uint16_t f32_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif
