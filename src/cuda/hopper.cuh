/*
 * hopper.cuh - Hopper's (sm_90a) warpgroup products and tensor copies, for the attention's tiles.
 *
 * wgmma: a warpgroup (4 warps, 128 threads) multiplies a 64-row A by an N-column B in one instruction,
 * asynchronously, with B (and A, or A from registers) read from shared memory through a descriptor. The
 * accumulator's layout per warp is mma.sync m16n8's repeated over the N / 8 column tiles (warp w holds rows
 * 16 w .. 16 w + 15), so code written for mma.sync's C fragments reads it unchanged, and the A fragment from
 * registers is mma.sync m16n8k16's.
 *
 * Shared-memory operands use the 128-byte swizzle, the layout the tensor copies (TMA) write: a tile is stored as
 * blocks of 64 columns (128 bytes a row), rows 128 bytes apart, and 16-byte chunk c of row r sits at chunk
 * c ^ (r % 8) of its row (the block 1024-byte aligned). A K-major operand (K contiguous: Q, K) steps along K by
 * moving the descriptor's start 32 bytes a k16 step inside the row; its 8-row groups are SBO = 1024 bytes apart.
 * An MN-major one (N contiguous: V, read with the transpose bit) has its 8-row K groups SBO = 1024 bytes apart and
 * its 64-column N blocks LBO apart.
 *
 * PI0_WGMMA is 1 in the device pass for sm_90a and 0 everywhere else (other archs, plain sm_90, the host pass);
 * code that uses these wrappers must be compiled out where it is 0 (the wrappers then trap).
 */
#ifndef PI0_CUDA_HOPPER_CUH
#define PI0_CUDA_HOPPER_CUH

#include <cuda.h> /* CUtensorMap: the type only (no driver library is linked) */
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <stdint.h>

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PI0_WGMMA 1
#else
#define PI0_WGMMA 0
#endif

/* A shared-memory matrix descriptor, 128-byte swizzle: start address, LBO and SBO, each in 16-byte units. */
static __device__ __forceinline__ uint64_t wg_desc(uint32_t smem_byte_addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
    return (uint64_t)((smem_byte_addr & 0x3ffff) >> 4) | ((uint64_t)(lbo_bytes >> 4) << 16) |
           ((uint64_t)(sbo_bytes >> 4) << 32) | (1ull << 62);
}

/* Before a warpgroup's first product of a batch: orders the threads' earlier register writes (accumulators, A). */
static __device__ __forceinline__ void wg_fence(void) {
#if PI0_WGMMA
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#else
    __trap();
#endif
}

static __device__ __forceinline__ void wg_commit(void) {
#if PI0_WGMMA
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}

/* Waits until no committed batch of this warpgroup is in flight. */
static __device__ __forceinline__ void wg_wait_all(void) {
#if PI0_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#endif
}

/* Shared memory written through the generic proxy (st.shared, cp.async) made visible to the products' reads. */
static __device__ __forceinline__ void fence_proxy_async(void) {
#if PI0_WGMMA
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

/* An accumulator's registers pinned after a wait: the compiler may not move their reads above it. */
template <int N>
static __device__ __forceinline__ void wg_pin(float (&r)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(r[i][0]), "+f"(r[i][1]), "+f"(r[i][2]), "+f"(r[i][3])::"memory");
}

#define PI0_WG_D32(d)                                                                                                   \
    "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),           \
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),       \
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),       \
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),       \
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define PI0_WG_REGS32                                                                                                   \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"

/* d (64 x 64 f32) = a b^T (+ d when accumulate): a 64 x 16 and b 64 x 16 bf16, both K-major in shared memory. */
static __device__ __forceinline__ void wg_m64n64k16_ss(float (&d)[8][4], uint64_t a_desc, uint64_t b_desc, int accumulate) {
#if PI0_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PI0_WG_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : PI0_WG_D32(d)
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
#else
    (void)d, (void)a_desc, (void)b_desc, (void)accumulate;
    __trap();
#endif
}

/* d (64 x 64 f32) += a b: a 64 x 16 bf16 from registers (mma.sync's A fragment, per warp), b 16 x 64 bf16 MN-major
 * (N contiguous) in shared memory. */
static __device__ __forceinline__ void wg_m64n64k16_rs_tb(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b_desc) {
#if PI0_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " PI0_WG_REGS32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : PI0_WG_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
#else
    (void)d, (void)a, (void)b_desc;
    __trap();
#endif
}

/* d (64 x 8 f32) += a b, as wg_m64n64k16_rs_tb for 8 columns of b (the first 8 of a 64-column block). */
static __device__ __forceinline__ void wg_m64n8k16_rs_tb(float (&d)[4], const uint32_t (&a)[4], uint64_t b_desc) {
#if PI0_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8,"
                 " p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(1));
#else
    (void)d, (void)a, (void)b_desc;
    __trap();
#endif
}

#define PI0_WG_D68(d) "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),        \
        "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]),       \
        "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]),       \
        "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]),       \
        "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3]), "+f"(d[8][0]), "+f"(d[8][1]),       \
        "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), "+f"(d[9][3]), "+f"(d[10][0]),      \
        "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), "+f"(d[11][2]),                \
        "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]),                \
        "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]),                \
        "+f"(d[14][3]), "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3]), "+f"(d[16][0]),                \
        "+f"(d[16][1]), "+f"(d[16][2]), "+f"(d[16][3])
#define PI0_WG_LIST68 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, "    \
    "%20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, "        \
    "%41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, "        \
    "%62, %63, %64, %65, %66, %67"
#define PI0_WG_REGS68 "{" PI0_WG_LIST68 "}"

/* d (64 x 136 f32) = a b^T (+ d when accumulate): a 64 x 16 and b 136 x 16 bf16, both K-major in shared memory. */
static __device__ __forceinline__ void wg_m64n136k16_ss(float (&d)[17][4], uint64_t a_desc, uint64_t b_desc,
                                                        int accumulate) {
#if PI0_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %70, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n136k16.f32.bf16.bf16 " PI0_WG_REGS68 ", %68, %69, p, 1, 1, 0, 0;\n}\n"
                 : PI0_WG_D68(d)
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
#else
    (void)d, (void)a_desc, (void)b_desc, (void)accumulate;
    __trap();
#endif
}

#define PI0_WG_D72(d) PI0_WG_D68(d), "+f"(d[17][0]), "+f"(d[17][1]), "+f"(d[17][2]), "+f"(d[17][3])
#define PI0_WG_REGS72 "{" PI0_WG_LIST68 ", %68, %69, %70, %71}"

/* d (64 x 144 f32) = a b^T (+ d when accumulate), as wg_m64n136k16_ss for 144 columns of b. */
static __device__ __forceinline__ void wg_m64n144k16_ss(float (&d)[18][4], uint64_t a_desc, uint64_t b_desc,
                                                        int accumulate) {
#if PI0_WGMMA
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %74, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 " PI0_WG_REGS72 ", %72, %73, p, 1, 1, 0, 0;\n}\n"
                 : PI0_WG_D72(d)
                 : "l"(a_desc), "l"(b_desc), "r"(accumulate));
#else
    (void)d, (void)a_desc, (void)b_desc, (void)accumulate;
    __trap();
#endif
}

/* Waits until at most N committed batches of this warpgroup are in flight. */
template <int N>
static __device__ __forceinline__ void wg_wait(void) {
#if PI0_WGMMA
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

/* A warpgroup's register budget moved at run time (all its threads): producers give theirs to the products'. */
template <int N>
static __device__ __forceinline__ void regs_increase(void) {
#if PI0_WGMMA
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
static __device__ __forceinline__ void regs_decrease(void) {
#if PI0_WGMMA
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

#undef PI0_WG_D32
#undef PI0_WG_D68
#undef PI0_WG_REGS68
#undef PI0_WG_LIST68
#undef PI0_WG_D72
#undef PI0_WG_REGS72
#undef PI0_WG_REGS32

/* mbarriers: a transaction count (the bytes a tensor copy will deliver) and a phase bit per use. */
static __device__ __forceinline__ void mbar_init(uint32_t bar, unsigned count) {
#if PI0_WGMMA
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
#endif
}

/* The barriers' initialization made visible to the tensor copies (before the block barrier that publishes it). */
static __device__ __forceinline__ void mbar_init_fence(void) {
#if PI0_WGMMA
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

static __device__ __forceinline__ void mbar_expect_bytes(uint32_t bar, unsigned bytes) {
#if PI0_WGMMA
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

/* Waits until the barrier's phase `parity` has completed. */
static __device__ __forceinline__ void mbar_wait(uint32_t bar, unsigned parity) {
#if PI0_WGMMA
    asm volatile("{\n.reg .pred done;\nwait:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra wait;\n}\n" ::"r"(bar), "r"(parity)
                 : "memory");
#endif
}

/* A 3-D box of `map` at (x, y, z) (x the contiguous dimension; out-of-range elements arrive as zeros) into shared
 * memory at dst, its bytes counted on bar. */
static __device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap *map, int x, int y, int z,
                                                   uint32_t bar) {
#if PI0_WGMMA
    asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4}], [%5];\n"
                 ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(z), "r"(bar)
                 : "memory");
#else
    (void)dst, (void)map, (void)x, (void)y, (void)z, (void)bar;
    __trap();
#endif
}

/* This block's rank in its cluster, and a barrier of every thread of the cluster (release, then acquire). */
static __device__ __forceinline__ unsigned cluster_rank(void) {
    unsigned r = 0;
#if PI0_WGMMA
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
    return r;
}

static __device__ __forceinline__ void cluster_barrier(void) {
#if PI0_WGMMA
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#endif
}

/* One arrival on the barrier at shared offset `bar` of block `rank` of the cluster (this block's own included), with
 * the default (CTA-scope) release: what it publishes is that wgmma has read a stage, which needs no cluster-scope fence
 * (one cost a GEMM's consumers ~30% of their time, bench/NOTES.md session 29). */
static __device__ __forceinline__ void mbar_arrive_cluster(uint32_t bar, unsigned rank) {
#if PI0_WGMMA
    asm volatile("{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
                 "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar), "r"(rank)
                 : "memory");
#endif
}

/* A 2-D box of `map` at (x, y) into shared memory at dst, its bytes counted on bar; with a mask, the same box lands
 * at dst in every block of the cluster the mask names, and is counted on each one's barrier at offset bar. */
static __device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int x, int y, uint32_t bar) {
#if PI0_WGMMA
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar)
                 : "memory");
#else
    (void)dst, (void)map, (void)x, (void)y, (void)bar;
    __trap();
#endif
}

static __device__ __forceinline__ void tma_load_2d_multicast(uint32_t dst, const CUtensorMap *map, int x, int y,
                                                             uint32_t bar, uint16_t mask) {
#if PI0_WGMMA
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
                 " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst), "l"(map), "r"(x), "r"(y), "r"(bar), "h"(mask)
                 : "memory");
#else
    (void)dst, (void)map, (void)x, (void)y, (void)bar, (void)mask;
    __trap();
#endif
}

/* A 2-D box of `map` at (x, y) written from shared memory at src (the layout a load of the same box would leave there);
 * elements past the tensor's end are not written. The store joins this thread's open bulk group. */
static __device__ __forceinline__ void tma_store_2d(const CUtensorMap *map, int x, int y, uint32_t src) {
#if PI0_WGMMA
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(map), "r"(x),
                 "r"(y), "r"(src)
                 : "memory");
#else
    (void)map, (void)x, (void)y, (void)src;
    __trap();
#endif
}

/* Closes this thread's open bulk group (the stores issued since the last commit). */
static __device__ __forceinline__ void bulk_commit(void) {
#if PI0_WGMMA
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}

/* Waits until at most N of this thread's bulk groups still read their shared memory (bulk_wait_read: its source may
 * be written again) or are in flight at all (bulk_wait: their global writes done). */
template <int N>
static __device__ __forceinline__ void bulk_wait_read(void) {
#if PI0_WGMMA
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
#endif
}
template <int N>
static __device__ __forceinline__ void bulk_wait(void) {
#if PI0_WGMMA
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

/* ---- host side ------------------------------------------------------------------------------------ */

/* cuTensorMapEncodeTiled, looked up in the driver once (no driver library is linked); NULL where the driver has none. */
static inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(void) {
    static PFN_cuTensorMapEncodeTiled_v12000 encode;
    static int looked_up;
    if (!__atomic_load_n(&looked_up, __ATOMIC_ACQUIRE)) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult found;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
                cudaSuccess &&
            found == cudaDriverEntryPointSuccess)
            __atomic_store_n(&encode, (PFN_cuTensorMapEncodeTiled_v12000)fn, __ATOMIC_RELAXED);
        else
            (void)cudaGetLastError();
        __atomic_store_n(&looked_up, 1, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&encode, __ATOMIC_RELAXED);
}

#define PI0_CUDA_MAX_DEVICES 64 /* per-device caches (launch limits, decisions) */

/* Whether the current device runs this build's sm_90a code: compute capability 9.0 (H100, H200) in a build with
 * sm_90a code (PI0_SM90A_BUILD, set by the Makefile). Decided per device: a process may drive GPUs of different kinds. */
static inline bool sm90a_device(void) {
#ifndef PI0_SM90A_BUILD
    return false;
#endif
    static int decided[PI0_CUDA_MAX_DEVICES]; /* 0: not yet, 1: no, 2: yes */
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) {
        (void)cudaGetLastError();
        return false;
    }
    const bool cached = dev >= 0 && dev < PI0_CUDA_MAX_DEVICES;
    int d = cached ? __atomic_load_n(&decided[dev], __ATOMIC_ACQUIRE) : 0;
    if (!d) {
        const bool ok = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess;
        if (!ok) (void)cudaGetLastError();
        d = ok && major == 9 && minor == 0 ? 2 : 1;
        if (cached) __atomic_store_n(&decided[dev], d, __ATOMIC_RELEASE);
    }
    return d == 2;
}

#endif
