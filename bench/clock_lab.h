/* clock_lab.h - bench/clock_lab.c's kernels (bench/clock_lab_kernels.cu). */
#ifndef PI0_BENCH_CLOCK_LAB_H
#define PI0_BENCH_CLOCK_LAB_H

#include <cuda_runtime.h>

enum { CLOCK_LOAD_FMA, CLOCK_LOAD_TENSOR };

#ifdef __cplusplus
extern "C" {
#endif

cudaError_t clock_lab_sample(unsigned long long *pairs, int n, long long period_ns, int sm, int *taken, int blocks,
                             cudaStream_t stream);
cudaError_t clock_lab_load(int kind, int sm, unsigned long long t0, long long total_ns, long long burst_ns,
                           long long gap_ns, float *sink, int blocks, cudaStream_t stream);
cudaError_t clock_lab_now(unsigned long long *ns, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
