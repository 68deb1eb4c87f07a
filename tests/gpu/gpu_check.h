/*
 * gpu_check.h - what the GPU tests share: fresh random inputs, bf16 rounding as the GPU sees it,
 * device buffers that are poisoned before each run, and CUDA return-code checks.
 */
#ifndef PI0_TESTS_GPU_CHECK_H
#define PI0_TESTS_GPU_CHECK_H

#include <cuda_runtime_api.h>
#include <stdint.h>
#include <time.h>

#include "check.h"

#define CUDA_OK(call)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        REQUIRE(e_ == cudaSuccess, "%s: %s", #call, cudaGetErrorString(e_));                        \
    } while (0)

static uint64_t gpu_rng_state;

/* A seed from the clock, printed, so each run draws fresh inputs and a failure can be replayed
 * with PI0_TEST_SEED. */
static inline void gpu_seed(void) {
    const char *fixed = getenv("PI0_TEST_SEED");
    gpu_rng_state = fixed ? strtoull(fixed, NULL, 10) : (uint64_t)time(NULL) * 2654435761u + (uint64_t)clock();
    fprintf(stderr, "random seed %llu (set PI0_TEST_SEED to repeat)\n", (unsigned long long)gpu_rng_state);
}

static inline float gpu_uniform(void) { /* [-1, 1) */
    gpu_rng_state = gpu_rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((gpu_rng_state >> 40) * (1.0 / 8388608.0) - 1.0);
}

static inline void fill_uniform(float *x, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) x[i] = scale * gpu_uniform();
}

static inline uint16_t bf16_bits(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static inline float bf16_value(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float x;
    memcpy(&x, &b, 4);
    return x;
}

/* Rounds x to bf16 in place (what the GPU will read) and returns the bits in a new array. */
static inline uint16_t *to_bf16_rounding(float *x, size_t n) {
    uint16_t *h = malloc(n * sizeof(uint16_t) + 2);
    for (size_t i = 0; i < n; i++) {
        h[i] = bf16_bits(x[i]);
        x[i] = bf16_value(h[i]);
    }
    return h;
}

static inline void *dev_upload(const void *host, size_t bytes) {
    void *d = NULL;
    if (cudaMalloc(&d, bytes ? bytes : 1) != cudaSuccess) return NULL;
    if (host && cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) return NULL;
    return d;
}

/* A device buffer filled with 0xFF bytes: NaN in both float32 and bf16, so unwritten outputs show. */
static inline void *dev_poisoned(size_t bytes) {
    void *d = dev_upload(NULL, bytes);
    if (d) cudaMemset(d, 0xff, bytes);
    return d;
}

static inline float *download_f32(const void *dev, size_t n) {
    float *h = malloc(n * sizeof(float) + 4);
    cudaMemcpy(h, dev, n * sizeof(float), cudaMemcpyDeviceToHost);
    return h;
}

static inline float *download_bf16(const void *dev, size_t n) {
    uint16_t *bits = malloc(n * sizeof(uint16_t) + 2);
    float *h = malloc(n * sizeof(float) + 4);
    cudaMemcpy(bits, dev, n * sizeof(uint16_t), cudaMemcpyDeviceToHost);
    for (size_t i = 0; i < n; i++) h[i] = bf16_value(bits[i]);
    free(bits);
    return h;
}

static inline int all_finite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return 0;
    return 1;
}

#endif
