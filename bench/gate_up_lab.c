/*
 * gate_up_lab.c - the prefix's gate|up Linear and gelu x up two ways at the engine's shapes: cuBLASLt's product (gemm.h,
 * tuned as the engine tunes it) followed by pi0_cuda_gelu_mul, and the fused Hopper kernel (gate_up.h). Each is launched
 * `iters` times back to back between two events, `reps` times; median, min and max per launch, and TFLOP/s of the
 * product at the median. Also prints the relative difference of the two paths' outputs (only the summation order and
 * the GELU's formula differ; the GPU tests check both against the CPU). Random bf16 inputs, not zeros: a GPU at its
 * power cap runs zeros faster (bench/NOTES.md, session 28).
 *
 * Usage: build/bench/gate_up_lab [ROWS MLP K]   (default: the shapes below; needs an H100/H200 for the fused kernel)
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/gate_up.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "lab.h"

#define REPS 9

static uint64_t rng_state = 12345;

static uint16_t random_bf16(float scale) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    float f = scale * (float)((rng_state >> 40) * (1.0 / 8388608.0) - 1.0);
    uint32_t b;
    memcpy(&b, &f, 4);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

static float bf16_value(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static int by_value(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef struct {
    gemm_context *gemm;
    gemm_args product;
    void *gate_up, *out_cublas, *out_fused;
    int rows, mlp, k;
} lab_shape;

/* Launches path 0 (cuBLASLt's product alone), 1 (the product and gelu x up) or 2 (the fused kernel) once. */
static void launch(const lab_shape *s, int path, cudaStream_t stream) {
    pi0_error err;
    if (path < 2 && gemm_run(s->gemm, &s->product, stream, &err) != PI0_OK) {
        fprintf(stderr, "cuBLASLt: %s\n", err.message);
        exit(1);
    }
    if (path == 1) CK(pi0_cuda_gelu_mul(s->out_cublas, s->gate_up, s->rows, s->mlp, stream));
    if (path == 2) CK(pi0_cuda_gate_up_gelu(s->out_fused, s->product.x, s->product.w, s->rows, s->mlp, s->k, stream));
}

static double relative_difference(const void *a_dev, const void *b_dev, size_t n) {
    uint16_t *a = malloc(n * 2), *b = malloc(n * 2);
    CK(cudaMemcpy(a, a_dev, n * 2, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b, b_dev, n * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double x = bf16_value(a[i]), y = bf16_value(b[i]);
        num += (x - y) * (x - y), den += x * x;
    }
    free(a), free(b);
    return isfinite(num) ? sqrt(num / (den > 0 ? den : 1)) : INFINITY;
}

static void time_shape(gemm_context *gemm, int rows, int mlp, int k, cudaStream_t stream) {
    size_t nx = (size_t)rows * k, nw = (size_t)2 * mlp * k, nout = (size_t)rows * mlp;
    uint16_t *x = malloc(nx * 2), *w = malloc(nw * 2);
    for (size_t i = 0; i < nx; i++) x[i] = random_bf16(1.0f);
    for (size_t i = 0; i < nw; i++) w[i] = random_bf16(2.0f / sqrtf((float)k));
    lab_shape s = {.gemm = gemm, .rows = rows, .mlp = mlp, .k = k};
    void *dx, *dw;
    CK(cudaMalloc(&dx, nx * 2));
    CK(cudaMalloc(&dw, nw * 2));
    CK(cudaMalloc(&s.gate_up, nout * 4));
    CK(cudaMalloc(&s.out_cublas, nout * 2));
    CK(cudaMalloc(&s.out_fused, nout * 2));
    CK(cudaMemcpy(dx, x, nx * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dw, w, nw * 2, cudaMemcpyHostToDevice));
    s.product = (gemm_args){.m = rows, .n = 2 * mlp, .k = k, .x = dx, .w = dw, .out = s.gate_up, .alpha = 1};
    const int fused = pi0_cuda_gate_up_gelu_fits(rows, mlp, k), paths = fused ? 3 : 2;
    for (int path = 0; path < paths; path++) launch(&s, path, stream); /* tunes cuBLASLt, loads the modules */
    CK(cudaStreamSynchronize(stream));
    printf("%d x %d x %d (rows x mlp x k): fused kernel %s the engine's choice at these dims", rows, mlp, k,
           pi0_cuda_gate_up_gelu_pays(rows, k) ? "is" : "is not");
    if (fused) printf(", its output against cuBLASLt's path: %.2g relative", relative_difference(s.out_cublas, s.out_fused, nout));
    printf("\n");
    cudaEvent_t start, stop;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&stop));
    const int iters = rows > 8192 ? 3 : 20;
    float us[3][REPS];
    for (int r = 0; r < REPS; r++)
        for (int path = 0; path < paths; path++) { /* alternating, so that drift hits every path alike */
            CK(cudaEventRecord(start, stream));
            for (int i = 0; i < iters; i++) launch(&s, path, stream);
            CK(cudaEventRecord(stop, stream));
            CK(cudaEventSynchronize(stop));
            float ms;
            CK(cudaEventElapsedTime(&ms, start, stop));
            us[path][r] = ms * 1000.0f / (float)iters;
        }
    static const char *names[3] = {"cuBLASLt gate|up", "cuBLASLt + gelu x up", "fused (gate_up.cu)"};
    const double flop = 2.0 * rows * 2.0 * mlp * k;
    for (int path = 0; path < paths; path++) {
        qsort(us[path], REPS, sizeof(float), by_value);
        printf("  %-22s median %9.1f us  min %9.1f  max %9.1f  %5.0f TFLOP/s\n", names[path], us[path][REPS / 2],
               us[path][0], us[path][REPS - 1], flop / (us[path][REPS / 2] * 1e-6) / 1e12);
    }
    CK(cudaEventDestroy(start));
    CK(cudaEventDestroy(stop));
    cudaFree(dx), cudaFree(dw), cudaFree(s.gate_up), cudaFree(s.out_cublas), cudaFree(s.out_fused);
    free(x), free(w);
}

int main(int argc, char **argv) {
    /* the seed's prefix, three cameras, Pi0.5's 60-token prompt (a short last tile), Pi0's 48, B = 2, Pi0.5's B = 2,
     * B = 64, and the expert's at B = 64 */
    static const int shapes[][3] = {{532, 16384, 2048},  {788, 16384, 2048},   {572, 16384, 2048},
                                    {560, 16384, 2048},  {1064, 16384, 2048},  {1144, 16384, 2048},
                                    {34048, 16384, 2048}, {704, 4096, 1024}};
    if (argc != 1 && argc != 4) {
        fprintf(stderr, "usage: %s [ROWS MLP K]\n", argv[0]);
        return 2;
    }
    gemm_context gemm;
    pi0_error err;
    if (gemm_init(&gemm, &err) != PI0_OK) {
        fprintf(stderr, "cuBLASLt: %s\n", err.message);
        return 1;
    }
    cudaStream_t stream;
    CK(cudaStreamCreate(&stream));
    if (argc == 4) {
        int rows = atoi(argv[1]), mlp = atoi(argv[2]), k = atoi(argv[3]);
        if (rows <= 0 || mlp <= 0 || k <= 0 || k % 8) {
            fprintf(stderr, "ROWS, MLP and K must be positive, K a multiple of 8\n");
            return 2;
        }
        time_shape(&gemm, rows, mlp, k, stream);
    } else {
        for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
            time_shape(&gemm, shapes[i][0], shapes[i][1], shapes[i][2], stream);
    }
    CK(cudaStreamDestroy(stream));
    gemm_free(&gemm);
    return 0;
}
