/*
 * clock_lab_kernels.cu - the kernels of bench/clock_lab.c: a one-thread sampler of one multiprocessor's clock
 * (%clock64 against %globaltimer), and a load that keeps chosen multiprocessors busy with float32 FMAs or with
 * tensor-core products, continuously or in bursts.
 */
#include "clock_lab.h"

static __device__ __forceinline__ unsigned long long global_ns(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __device__ __forceinline__ int sm_id(void) {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return (int)s;
}

/* One-thread blocks: the first to land on multiprocessor `sm` stores (globaltimer, clock64) pairs every period_ns,
 * the others leave at once. The pairs' differences are the multiprocessor's cycles over nanoseconds. */
static __global__ void sample_kernel(unsigned long long *pairs, int n, long long period_ns, int sm, int *taken) {
    if (sm_id() != sm || atomicExch(taken, 1)) return;
    unsigned long long t = global_ns(), next = t, cycles;
    for (int i = 0; i < n; i++) {
        do t = global_ns(); while (t < next);
        asm volatile("mov.u64 %0, %%clock64;" : "=l"(cycles));
        pairs[2 * i] = t, pairs[2 * i + 1] = cycles;
        next = t + (unsigned long long)period_ns;
    }
}

/* From t0 for total_ns, the blocks on multiprocessor `sm` (every block, sm < 0) work: dependent FMA or mma.sync chains
 * in bursts of burst_ns every burst_ns + gap_ns (gap_ns 0: without a break). A chain a warp, so the load is light:
 * what it shows is that the kind of work, not its amount, moves the clock. */
static __global__ void load_kernel(int kind, int sm, unsigned long long t0, long long total_ns, long long burst_ns,
                                   long long gap_ns, float *sink) {
    if (sm >= 0 && sm_id() != sm) return;
    const unsigned ones = 0x3f803f80u; /* two bf16 1.0 */
    const unsigned long long period = (unsigned long long)(burst_ns + gap_ns);
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    for (unsigned long long t = global_ns(); t < t0 + (unsigned long long)total_ns; t = global_ns()) {
        if (t < t0 || (t - t0) % period >= (unsigned long long)burst_ns) continue;
        for (int r = 0; r < 8; r++) {
            if (kind == CLOCK_LOAD_TENSOR)
                asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%4,%4}, "
                             "{%0,%1,%2,%3};"
                             : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                             : "r"(ones));
            else
                d0 = fmaf(d0, 0.999f, 1.f), d1 = fmaf(d1, 0.999f, d0);
        }
    }
    if (d0 + d1 + d2 + d3 == -1.f) *sink = d0; /* never: keeps the chains */
}

static __global__ void now_kernel(unsigned long long *ns) { *ns = global_ns(); }

extern "C" {

cudaError_t clock_lab_sample(unsigned long long *pairs, int n, long long period_ns, int sm, int *taken, int blocks,
                             cudaStream_t stream) {
    sample_kernel<<<blocks, 1, 0, stream>>>(pairs, n, period_ns, sm, taken);
    return cudaGetLastError();
}

cudaError_t clock_lab_load(int kind, int sm, unsigned long long t0, long long total_ns, long long burst_ns,
                           long long gap_ns, float *sink, int blocks, cudaStream_t stream) {
    load_kernel<<<blocks, 128, 0, stream>>>(kind, sm, t0, total_ns, burst_ns, gap_ns, sink);
    return cudaGetLastError();
}

cudaError_t clock_lab_now(unsigned long long *ns, cudaStream_t stream) {
    now_kernel<<<1, 1, 0, stream>>>(ns);
    return cudaGetLastError();
}

} /* extern "C" */
