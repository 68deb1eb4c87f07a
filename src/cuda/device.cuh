/*
 * device.cuh - device helpers shared by the CUDA backend's kernels: bf16 packing and arithmetic, the tensor-core
 * product they all use with its shared-memory loads (ldmatrix), the few-queries attention's masked softmax steps,
 * the tanh GELU, and programmatic dependent launch.
 */
#ifndef PI0_CUDA_DEVICE_CUH
#define PI0_CUDA_DEVICE_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "util/switches.h"

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

/* The sum of squares of 8 packed bf16 (an RMSNorm's statistics from the values a product reads). */
static __device__ __forceinline__ float sum_squares(uint4 v) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) s += bf16_lo(w[i]) * bf16_lo(w[i]) + bf16_hi(w[i]) * bf16_hi(w[i]);
    return s;
}

/* The 8 bf16 values of v times the 8 bf16 values of s, rounded back to bf16 (Pi0.5's adaptive norm scale). */
static __device__ __forceinline__ uint32_t mul_bf16x2(uint32_t v, uint32_t s) {
    return pack_bf16(bf16_lo(v) * bf16_lo(s), bf16_hi(v) * bf16_hi(s));
}

static __device__ __forceinline__ uint4 mul_bf16x8(uint4 v, uint4 s) {
    return make_uint4(mul_bf16x2(v.x, s.x), mul_bf16x2(v.y, s.y), mul_bf16x2(v.z, s.z), mul_bf16x2(v.w, s.w));
}

/* A shared-memory address as the PTX instructions below take it. */
static __device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

/* cp.async groups: close the copies issued so far into a group; wait until at most 0 (1) of this thread's groups are
 * still copying (its copies are then visible to it; to the block after a barrier). */
static __device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
static __device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
static __device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

/* ldmatrix: four (two) 8x8 bf16 tiles from shared memory, each lane giving one row address; .trans transposes. */
static __device__ __forceinline__ void ldsm_x4(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

static __device__ __forceinline__ void ldsm_x4_trans(uint32_t r[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}

static __device__ __forceinline__ void ldsm_x2_trans(uint32_t r[2], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(addr)
                 : "memory");
}

/* Attention scores of one warp's 16 rows over N n8 tiles of keys from key0 (mma C layout: this lane holds keys
 * key0 + 8 n + 2 quad_col (+1) of rows g and g + 8): scaled into the log2 domain, -inf at a key >= the row's
 * visible count (vis0, vis1), and the rows' maxima over the quad folded into mx0 / mx1. */
/* A row maximum held by the 4 lanes of a quad (each over its own columns), made the quad's. */
static __device__ __forceinline__ void quad_max(float &mx0, float &mx1) {
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
    mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
}

template <int N>
static __device__ __forceinline__ void mask_scores(float (&s)[N][4], int key0, int quad_col, int vis0, int vis1,
                                                   float scale_log2, float &mx0, float &mx1) {
#pragma unroll
    for (int n = 0; n < N; n++) {
        const int key = key0 + n * 8 + quad_col * 2;
        s[n][0] = key < vis0 ? s[n][0] * scale_log2 : -INFINITY;
        s[n][1] = key + 1 < vis0 ? s[n][1] * scale_log2 : -INFINITY;
        s[n][2] = key < vis1 ? s[n][2] * scale_log2 : -INFINITY;
        s[n][3] = key + 1 < vis1 ? s[n][3] * scale_log2 : -INFINITY;
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    quad_max(mx0, mx1);
}

/* The probabilities exp2(s - base) in place, their sums (this lane's) added to l0 / l1. */
template <int N>
static __device__ __forceinline__ void exp_scores(float (&s)[N][4], float base0, float base1, float &l0, float &l1) {
#pragma unroll
    for (int n = 0; n < N; n++) {
        s[n][0] = exp2f(s[n][0] - base0), s[n][1] = exp2f(s[n][1] - base0);
        s[n][2] = exp2f(s[n][2] - base1), s[n][3] = exp2f(s[n][3] - base1);
        l0 += s[n][0] + s[n][1];
        l1 += s[n][2] + s[n][3];
    }
}

/* Named barriers (bar 0 is __syncthreads'): a sync waits until `threads` have arrived or synced; an arrive does not
 * wait. */
static __device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
static __device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

static __device__ __forceinline__ float gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * (x + 0.044715f * x * x * x)));
}

/*
 * Programmatic dependent launch (sm_90+). A chain of short kernels (a denoise layer at batch 1: ~5 us
 * each) loses ~1-2 us at every boundary to launch and ramp-up. A kernel launched with
 * dependent_launch() may start while the kernel before it in the stream is still running, as
 * soon as that one's blocks have all called pdl_trigger() (or exited); it does what needs nothing from
 * its predecessors (loading weights) and then pdl_wait(), which returns once the predecessor has
 * finished and its writes are visible. Rules for such a kernel: pdl_wait() in every block before
 * reading what an earlier kernel wrote or writing what one reads, and also before an early exit (so
 * that "this kernel finished" still implies "every kernel before it finished"). Both are no-ops
 * before sm_90 and in kernels launched without the attribute.
 */
static __device__ __forceinline__ void pdl_wait(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void pdl_trigger(void) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

/* Whether the current device takes dependent launches: sm_90+, unless PI0_PDL=0 (A/B runs). */
static inline int pdl_supported(void) {
    static int env_off = -1;
    if (env_off < 0) env_off = switched_off("PI0_PDL");
    int dev = 0, major = 0;
    if (env_off || cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return 0;
    }
    return major >= 9;
}

/* A plain cudaLaunchKernelEx configuration. */
static inline cudaLaunchConfig_t launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    return cfg;
}

/* Makes `cfg` launch as a programmatic dependent where the device takes it (else it stays as it is), keeping the
 * attributes it has: `attrs` holds them (cfg->numAttrs of them, or none) and has room for one more, and must outlive
 * the config. Only for kernels that follow the rules above, and only after kernels of our own: measured after
 * cuBLASLt GEMMs it made the run slower (bench/NOTES.md). */
static inline void make_dependent(cudaLaunchConfig_t *cfg, cudaLaunchAttribute *attrs) {
    if (!pdl_supported()) return;
    attrs[cfg->numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[cfg->numAttrs].val.programmaticStreamSerializationAllowed = 1;
    cfg->attrs = attrs;
    cfg->numAttrs++;
}

/* launch_config made a programmatic dependent (make_dependent); `attr` must outlive it. */
static inline cudaLaunchConfig_t dependent_launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                                  cudaLaunchAttribute *attr) {
    cudaLaunchConfig_t cfg = launch_config(grid, block, smem, stream);
    make_dependent(&cfg, attr);
    return cfg;
}

#endif
