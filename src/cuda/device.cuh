/*
 * device.cuh - device helpers shared by the CUDA backend's kernels: bf16 packing, the tensor-core
 * product they all use, and the tanh GELU.
 */
#ifndef PI0_CUDA_DEVICE_CUH
#define PI0_CUDA_DEVICE_CUH

#include <stdint.h>

/* c (16x8 f32) += a (16x16 bf16, row) * b (16x8 bf16, col) */
static __device__ __forceinline__ void mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Two floats -> packed bf16x2 (round to nearest even): lo in the low half (lower column). */
static __device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* The two bf16 of a packed pair as floats (exact). */
static __device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
static __device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

static __device__ __forceinline__ float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * (x + 0.044715f * x * x * x)));
}

#endif
