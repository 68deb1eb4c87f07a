/*
 * gate_up.cu - the prefix's gate|up Linear with gelu x up in its epilogue, on Hopper (sm_90a).
 *
 * cuBLASLt runs the prefix's gate|up (532 x 32768 x 2048 at the seed) at ~700 TFLOP/s but writes gate and up (35 MB a
 * layer) for a separate kernel to read back and turn into gelu(gate) x up: 0.27 ms of the seed's prefix (bench/NOTES.md,
 * session 28). This kernel keeps gate and up in registers and writes only gelu(gate) x up.
 *
 * Its shape is the transposed twin of cuBLASLt's own kernel for this product (nvjet_..._256x136_64x4_1x2: 256 weight
 * rows x 136 tokens, persistent, clusters of 2, bench/RESULTS.md session 29): a block computes 128 weight rows (64
 * gate|up pairs: w's rows are interleaved (gate_j, up_j), weights.c) x 272 tokens, so 532 tokens take two tiles with 2%
 * padding. Blocks run in clusters of two along the weight rows: each loads its own 128 weight rows and half of the token
 * tile, which the tensor copy multicasts into both blocks, so a block reads ~33 KB from L2 per 64-deep k step for 4.5
 * MFLOP. Warp specialization: warpgroup 0 issues the copies into a ring of kStages stages; warpgroups 1 and 2 each
 * multiply 64 of the weight rows by the 272 tokens (two m64n136k16 products per k16 step, 136 accumulators a thread)
 * and release each stage to both blocks' producers once their products have read it. One block a multiprocessor walks
 * the work units in turn (persistent), the ring running on from one unit to the next.
 *
 * Epilogue: in wgmma's accumulator layout thread (g = lane / 4) holds rows g and g + 8 of its warp's 16, so gate_j
 * (row 2j) and up_j (row 2j + 1) sit in lanes 4 apart; one shuffle gives each thread both halves of one pair per
 * column. Gate and up are rounded to bf16 before gelu x up, as cuBLASLt's bf16 output and pi0_cuda_gelu_mul do, so the
 * two paths differ in the products' summation order and the GELU's formula (gelu_tanh_fast), ~4e-5 relative.
 */
#include "cuda/gate_up.h"

#include "cuda/device.cuh"
#include "cuda/hopper.cuh"

#include <cuda_bf16.h>

namespace {

constexpr int kBK = 64;                             /* k per stage: one 128-byte swizzled row */
constexpr int kTileW = 128;                         /* weight rows a block: 64 gate|up pairs */
constexpr int kHalfT = 136;                         /* tokens a product (n136), and a cluster rank's share of the copies */
constexpr int kTileT = 2 * kHalfT;                  /* tokens a block */
constexpr int kCluster = 2;                         /* blocks sharing the token tile */
constexpr int kStages = 4;
constexpr int kWBytes = kTileW * kBK * 2;           /* 16 KB */
constexpr int kXBytes = kTileT * kBK * 2;           /* 34 KB */
constexpr int kStageBytes = kWBytes + kXBytes;      /* 50 KB */
constexpr int kOutBytes = kHalfT * kTileW;          /* the epilogue's staging: 136 tokens x 64 outputs, 17 KB */
constexpr int kSmem = kStages * kStageBytes + kOutBytes + 1024; /* + the alignment of the first stage */
constexpr int kThreads = 384;
constexpr int kConsumers = 256;                     /* warpgroups 1 and 2 */

static_assert(kStageBytes % 1024 == 0 && (kHalfT * 128) % 1024 == 0, "swizzled tiles start 1024-byte aligned");

/* gelu_tanh(x) = x (1 + tanh(u)) / 2 = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3): the fast exponential and
 * division (relative error ~1e-6, far under the bf16 rounding that follows) rather than tanhf, whose branches made the
 * epilogue several times longer. x -> -inf: e^(-2u) -> inf and the quotient -> -0; x -> inf: e^(-2u) -> 0. */
[[maybe_unused]] __device__ __forceinline__ float gelu_tanh_fast(float x) {
    const float two_u_log2e = 2.0f * 0.7978845608028654f * 1.4426950408889634f * (x + 0.044715f * x * x * x);
    return __fdividef(x, 1.0f + exp2f(-two_u_log2e));
}

/*
 * One product's 64 x 136 accumulators (weight rows in gate|up pairs x tokens) as gelu(gate) x up into the staging
 * tile, token-major: row t holds the block's 64 outputs for token t (128 bytes), its 16-byte chunks swizzled by t % 8
 * so that the four tokens a store instruction writes fall in different banks. Pairing: thread (g = lane / 4) holds rows
 * g and g + 8 of its warp's 16; even g computes pair g / 2 of the warp's 8 from its row g (gate) and its partner's
 * (up), odd g pair 4 + g / 2 from its partner's row g + 8 (gate) and its own (up); gate and up are rounded to bf16
 * first, as the GEMM's output would be, and travel as one packed pair per column pair.
 */
[[maybe_unused]] __device__ __forceinline__ void stage_gelu_up(const float (&acc)[17][4], uint32_t staging, int pair0) {
    const int lane = threadIdx.x % 32, g = lane / 4, odd = g & 1, j = pair0 + (odd ? 4 + g / 2 : g / 2);
#pragma unroll
    for (int n = 0; n < 17; n++) {
        const uint32_t row_g = pack_bf16(acc[n][0], acc[n][1]), row_g8 = pack_bf16(acc[n][2], acc[n][3]);
        const uint32_t other = __shfl_xor_sync(0xffffffffu, odd ? row_g : row_g8, 4);
        const uint32_t gate = odd ? other : row_g, up = odd ? row_g8 : other;
        const int t = n * 8 + (lane % 4) * 2;
        const uint16_t lo = __bfloat16_as_ushort(__float2bfloat16(gelu_tanh_fast(bf16_lo(gate)) * bf16_lo(up)));
        const uint16_t hi = __bfloat16_as_ushort(__float2bfloat16(gelu_tanh_fast(bf16_hi(gate)) * bf16_hi(up)));
        asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(staging + t * 128 + (((j / 8) ^ (t % 8)) * 16) + (j % 8) * 2),
                     "h"(lo));
        asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(staging + (t + 1) * 128 + (((j / 8) ^ ((t + 1) % 8)) * 16) +
                                                       (j % 8) * 2),
                     "h"(hi));
    }
}

/* The staging tile's real tokens out to (tok0.., pair0..pair0 + 63) of out, a 128-byte line a token, 16 bytes a
 * thread. */
[[maybe_unused]] __device__ __forceinline__ void copy_out(uint32_t staging, __nv_bfloat16 *out, int rows, int mlp,
                                                          int tok0, int pair0) {
    const int count = (rows - tok0 < kHalfT ? rows - tok0 : kHalfT) * 8;
    for (int i = (int)threadIdx.x - 128; i < count; i += kConsumers) {
        const int t = i / 8, chunk = i % 8;
        uint4 v;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "r"(staging + t * 128 + ((chunk ^ (t % 8)) * 16)));
        *reinterpret_cast<uint4 *>(out + (size_t)(tok0 + t) * mlp + pair0 + chunk * 8) = v;
    }
}

/* Where work unit `unit` puts cluster rank `rank`: its first weight row (its weight pair's tile for that rank) and its
 * token tile's first token. Token tiles fastest, so that the clusters running at once share weight tiles (read from
 * DRAM once, the next time from L2). The producer and the products walk the units alike through this. */
struct UnitOrigin {
    int w_row0, tok0;
};
[[maybe_unused]] __device__ __forceinline__ UnitOrigin unit_origin(int unit, int token_tiles, unsigned rank) {
    return {((unit / token_tiles) * kCluster + (int)rank) * kTileW, (unit % token_tiles) * kTileT};
}

/*
 * A unit's k loop for one products warpgroup: weight rows 64 c.. of the tile times its tokens 0-135 (lo) and, with
 * BOTH, 136-271 (hi), stage by stage from the ring at position `it`; each stage is released to both blocks' producers
 * once the products after it are issued and its own are done. Returns the ring's position after the unit. (BOTH is a
 * template parameter: a product under a run-time condition makes ptxas fence every product, its C7519 remark.)
 */
template <bool BOTH>
__device__ __forceinline__ int products(float (&lo)[17][4], float (&hi)[17][4], uint32_t ring, uint64_t *full,
                                        uint64_t *empty, int c, int k_steps, int it) {
#if PI0_WGMMA
    for (int kt = 0; kt < k_steps; kt++, it++) {
        const int s = it % kStages;
        const uint32_t w_tile = ring + s * kStageBytes, x_tile = w_tile + kWBytes;
        mbar_wait(smem_addr(&full[s]), (unsigned)(it / kStages) & 1);
        const uint64_t a = wg_desc(w_tile + c * 64 * 128, 16, 1024), b_lo = wg_desc(x_tile, 16, 1024),
                       b_hi = wg_desc(x_tile + kHalfT * 128, 16, 1024);
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < kBK / 16; kc++) { /* k16 step: 32 bytes on in the 128-byte rows */
            wg_m64n136k16_ss(lo, a + 2 * kc, b_lo + 2 * kc, 1);
            if (BOTH) wg_m64n136k16_ss(hi, a + 2 * kc, b_hi + 2 * kc, 1);
        }
        wg_commit();
        wg_wait<1>(); /* the previous stage's products are done: release it */
        if (kt > 0 && threadIdx.x % 128 < kCluster)
            mbar_arrive_cluster(smem_addr(&empty[(it - 1) % kStages]), threadIdx.x % 128);
    }
    wg_wait<0>();
    if (threadIdx.x % 128 < kCluster) /* the unit's last stage */
        mbar_arrive_cluster(smem_addr(&empty[(it - 1) % kStages]), threadIdx.x % 128);
#endif
    return it;
}

/*
 * Persistent: each cluster walks the work units (its two blocks' weight tiles x one token tile, unit_origin)
 * cluster_id, cluster_id + num_clusters, .... The ring of stages runs on across units: while the products' warpgroups
 * write one unit's epilogue, the producer is already loading the next unit's first stages.
 */
__global__ void __launch_bounds__(kThreads, 1)
    gate_up_gelu_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,
                        __nv_bfloat16 *out, int rows, int mlp, int k_steps, int token_tiles) {
#if PI0_WGMMA
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
    const uint32_t ring = (smem_addr(smem_raw) + 1023) & ~1023u, staging = ring + kStages * kStageBytes;
    const unsigned rank = cluster_rank();
    const int num_clusters = (int)gridDim.x / kCluster, units = token_tiles * (2 * mlp / kTileW / kCluster);
    const int wg = threadIdx.x / 128;

    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; s++) {
            mbar_init(smem_addr(&full[s]), 1);
            mbar_init(smem_addr(&empty[s]), 2 * kCluster); /* each consumer warpgroup of each block */
        }
        mbar_init_fence();
    }
    cluster_barrier(); /* every block's barriers initialized before any copy lands in it */

    if (wg == 0) {
        regs_decrease<40>();
        if (threadIdx.x == 0) {
            int it = 0; /* k steps issued, over all units: the ring's position */
            for (int unit = (int)blockIdx.x / kCluster; unit < units; unit += num_clusters) {
                const UnitOrigin o = unit_origin(unit, token_tiles, rank);
                const int tok = o.tok0 + (int)rank * kHalfT; /* this block's half of the token tile */
                for (int kt = 0; kt < k_steps; kt++, it++) {
                    const int s = it % kStages;
                    const uint32_t w_dst = ring + s * kStageBytes, x_dst = w_dst + kWBytes, bar = smem_addr(&full[s]);
                    mbar_wait(smem_addr(&empty[s]), ((unsigned)(it / kStages) & 1) ^ 1); /* both blocks done with it */
                    mbar_expect_bytes(bar, kStageBytes);
                    tma_load_2d(w_dst, &w_map, kt * kBK, o.w_row0, bar);
                    tma_load_2d_multicast(x_dst + rank * kHalfT * 128, &x_map, kt * kBK, tok, bar,
                                          (uint16_t)((1u << kCluster) - 1));
                }
            }
        }
    } else {
        regs_increase<232>();
        const int c = wg - 1; /* this warpgroup's 64 weight rows of the tile */
        const int warp = (threadIdx.x % 128) / 32;
        int it = 0;
        for (int unit = (int)blockIdx.x / kCluster; unit < units; unit += num_clusters) {
            /* tokens 0-135 and 136-271 of the tile, zeroed rather than overwritten by the first product: with the
             * first product's scale-d a variable, ptxas serializes the products (its C7511 warning) */
            float lo[17][4], hi[17][4];
#pragma unroll
            for (int n = 0; n < 17; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) lo[n][i] = hi[n][i] = 0.f;
            /* a last token tile of at most 136 tokens skips the second half's products (the engine sends no such
             * shape: they still lost to cuBLASLt, gate_up.h; the tests and the lab do) */
            const UnitOrigin o = unit_origin(unit, token_tiles, rank);
            const bool both = o.tok0 + kHalfT < rows;
            if (both)
                it = products<true>(lo, hi, ring, full, empty, c, k_steps, it);
            else
                it = products<false>(lo, hi, ring, full, empty, c, k_steps, it);
            wg_pin(lo);
            wg_pin(hi);
            const int pair0 = o.w_row0 / 2;
            const int warp_pairs = c * 32 + warp * 8; /* of the block's 64 */
            stage_gelu_up(lo, staging, warp_pairs);
            named_sync(1, kConsumers); /* the staging tile complete */
            copy_out(staging, out, rows, mlp, o.tok0, pair0);
            named_sync(1, kConsumers); /* and read */
            if (both) {
                stage_gelu_up(hi, staging, warp_pairs);
                named_sync(1, kConsumers);
                copy_out(staging, out, rows, mlp, o.tok0 + kHalfT, pair0);
                named_sync(1, kConsumers);
            }
        }
    }
    cluster_barrier(); /* no block leaves while its partner may still arrive on its barriers */
#else
    (void)w_map, (void)x_map, (void)out, (void)rows, (void)mlp, (void)k_steps, (void)token_tiles;
    __trap();
#endif
}

/* A row-major bf16 matrix (rows, cols) as a tensor map of boxes of 64 columns x box_rows rows, 128-byte swizzle. */
bool matrix_map(CUtensorMap *map, const void *base, int rows, int cols, int box_rows) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode) return false;
    const cuuint64_t dims[2] = {(cuuint64_t)cols, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)cols * 2};
    const cuuint32_t box[2] = {kBK, (cuuint32_t)box_rows}, elem_strides[2] = {1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(base), dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} // namespace

extern "C" int pi0_cuda_gate_up_gelu_pays(int rows, int k) {
    const int last_tile = rows % kTileT; /* tokens in the last token tile, 0: full */
    return rows >= 256 && rows <= 2176 && k >= 2048 && (last_tile == 0 || last_tile > kHalfT);
}

extern "C" int pi0_cuda_gate_up_gelu_fits(int rows, int mlp, int k) {
    return rows > 0 && mlp > 0 && mlp % (kTileW / 2 * kCluster) == 0 && k > 0 && k % 8 == 0 && sm90a_device() &&
           tensor_map_encoder() != NULL;
}

extern "C" cudaError_t pi0_cuda_gate_up_gelu(pi0_bf16 *out, const pi0_bf16 *x, const pi0_bf16 *w, int rows, int mlp,
                                             int k, cudaStream_t stream) {
    if (!pi0_cuda_gate_up_gelu_fits(rows, mlp, k) || (uintptr_t)out % 16) return cudaErrorInvalidValue;
    static int configured[PI0_CUDA_MAX_DEVICES];
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    if (dev < 0 || dev >= PI0_CUDA_MAX_DEVICES || !__atomic_load_n(&configured[dev], __ATOMIC_ACQUIRE)) {
        if ((e = cudaFuncSetAttribute(gate_up_gelu_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem)) !=
            cudaSuccess)
            return e;
        if (dev >= 0 && dev < PI0_CUDA_MAX_DEVICES) __atomic_store_n(&configured[dev], 1, __ATOMIC_RELEASE);
    }
    CUtensorMap w_map, x_map;
    if (!matrix_map(&w_map, w, 2 * mlp, k, kTileW) || !matrix_map(&x_map, x, rows, k, kHalfT))
        return cudaErrorInvalidValue;
    const int token_tiles = (rows + kTileT - 1) / kTileT, units = token_tiles * (2 * mlp / kTileW / kCluster);
    const int clusters = units < sms / kCluster ? units : sms / kCluster;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = kCluster, cluster.val.clusterDim.y = 1, cluster.val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)(clusters * kCluster)), cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = kSmem, cfg.stream = stream, cfg.attrs = &cluster, cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, gate_up_gelu_kernel, w_map, x_map, reinterpret_cast<__nv_bfloat16 *>(out), rows, mlp,
                              (k + kBK - 1) / kBK, token_tiles);
}
