/*
 * gemm.h - every GEMM of the CUDA backend: out (m, n) = alpha x (m, k) . w (n, k)^T [+ bias] [gelu]
 * + beta out, through cuBLASLt.
 *
 * Weights keep PyTorch's (out, in) layout: read column-major they are w^T (k, n), so each call is
 * cuBLAS's "TN" product with no transposed copy anywhere. bf16 operands, float32 accumulation;
 * out is bf16 (feeding the next GEMM) or float32 (a residual stream, with beta = 1 to accumulate).
 * The bias has out's type.
 *
 * k_parts > 1 splits k into that many equal slices and writes each slice's float32 product to its own (m, n)
 * matrix, one after another from out (beta 0, no bias): split-K whose partial sums the next kernel adds instead of
 * a reduction kernel of cuBLASLt's (the RMSNorm after a Linear into the residual stream: forward.c's stack_parts).
 *
 * Algorithm choice: the first time a shape runs outside graph capture, up to TUNE_CANDIDATES of
 * cuBLASLt's heuristic candidates are timed on a scratch output and the fastest is cached (on an
 * H200 that beats the heuristic's first pick most at horizon 50's 51 rows: denoise 8.39 -> 8.17 ms, session 16).
 * Later calls, and graph capture, reuse the cached choice. PI0_GEMM_TUNE=0 in the environment skips
 * the timing (a faster first call of each shape).
 */
#ifndef PI0_CUDA_GEMM_H
#define PI0_CUDA_GEMM_H

#include <cublasLt.h>
#include <stdint.h>

#include "pi0.h"

typedef struct {
    int m, n, k;
    const void *x, *w; /* bf16 */
    void *out;
    const void *bias;  /* NULL: none */
    int out_f32, gelu;
    float alpha, beta;
    int k_parts;       /* > 1: the partial products of k_parts slices of k (above); 0 or 1: none */
} gemm_args;

typedef struct gemm_algo_entry gemm_algo_entry;

typedef struct {
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_size;
    cudaStream_t side;      /* GEMMs on this stream use side_workspace (gemm_side): they may run beside the others */
    void *side_workspace;
    gemm_algo_entry *algos; /* shape -> algorithm cache */
    int num_algos, cap_algos;
    void *scratch;          /* timing output, so tuning never touches the real one */
    size_t scratch_size;
    int tune;               /* 0: take the heuristic's first pick ($PI0_GEMM_TUNE=0) */
} gemm_context;

pi0_status gemm_init(gemm_context *ctx, pi0_error *err);
/* A second workspace for the GEMMs enqueued on `side`, which may run concurrently with those on other streams (the
 * algorithm cache is shared: tune a shape outside such concurrency, e.g. in an eager call). */
pi0_status gemm_side(gemm_context *ctx, cudaStream_t side, pi0_error *err);
void gemm_free(gemm_context *ctx);
pi0_status gemm_run(gemm_context *ctx, const gemm_args *a, cudaStream_t stream, pi0_error *err);

#endif
