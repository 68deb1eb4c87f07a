/* half.h - the 16-bit floats the engine meets: bfloat16 (checkpoints, the GPU's weights and
 * activations) and IEEE binary16 (checkpoints, numpy float16 fields). One definition of each
 * conversion, for the host code and the tests alike. */
#ifndef PI0_UTIL_HALF_H
#define PI0_UTIL_HALF_H

#include <stdint.h>
#include <string.h>

static inline float float_from_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t bits_from_float(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN. */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t bits = bits_from_float(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* bfloat16 -> float32, exact: bf16 is the top half of a float. */
static inline float bf16_to_f32(uint16_t h) {
    return float_from_bits((uint32_t)h << 16);
}

/* A float as three bfloat16 pieces, x = out[0] + out[1] + out[2] exactly for x = 0 and 2^-110 <= |x| < 2^127 (below,
 * the last piece falls among float32's subnormals; above, the first may round to infinity): each piece is the rounding of
 * what the ones before it left, 8 significant bits of float32's 24 at a time (the float32 patch embedding on bf16 tensor
 * cores, kernels.h's PI0_PATCH_PIECES). */
static inline void f32_to_bf16x3(float x, uint16_t out[3]) {
    for (int i = 0; i < 3; i++) {
        out[i] = f32_to_bf16(x);
        x -= bf16_to_f32(out[i]); /* exact: x and the piece share their leading bits */
    }
}

/* IEEE binary16 -> binary32, exact for every input: normals are rebiased (15 -> 127), inf and nan keep
   their payload under an all-ones exponent, subnormals are mantissa * 2^-24 (exactly representable as
   float normals). Masks instead of branches so the loops calling it vectorize. */
static inline float f16_to_f32(uint16_t half) {
    uint32_t sign = (uint32_t)(half & 0x8000) << 16;
    uint32_t exponent = (half >> 10) & 0x1f, mantissa = half & 0x3ff;
    uint32_t normal = (exponent + 112) << 23 | mantissa << 13;
    normal += (uint32_t)(exponent == 0x1f) * (112u << 23); /* 31 + 112 + 112 = 255 */
    uint32_t subnormal = bits_from_float((float)mantissa * 0x1p-24f);
    uint32_t is_normal = 0u - (uint32_t)(exponent != 0);
    return float_from_bits(sign | (normal & is_normal) | (subnormal & ~is_normal));
}

#endif
