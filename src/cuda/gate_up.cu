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
 * That is a narrow unit. A wide unit is cuBLASLt's tile turned around, 256 weight rows a block x N tokens, the same
 * products and bytes a stage (each warpgroup's two products take two 64-row weight tiles against the one token tile,
 * which cluster rank 0 copies into both blocks). The kernel comes in two token widths N, and the host takes the one
 * whose tiles pad fewer tokens: N = 136 runs narrow units (2 x 136 tokens) and one wide unit for a last tile of 136 or
 * fewer; N = 144 runs wide units only, so Pi0.5's 512 + 60 tokens are four tiles of 144 (576) rather than 2 x 272 + 136
 * (680). A narrow unit there would load a whole tile's weights for half its products (session 29: 0.6-1 ms of prefix
 * lost); the 136 kernel's wide unit still padded 19% and lost 7 us a layer to cuBLASLt; the 144 kernel wins 8
 * (bench/NOTES.md, session 30).
 *
 * It launches as a programmatic dependent of the norm before it (device.cuh): the producer copies the first unit's
 * first kStages stages' weights, which no kernel writes, before `griddepcontrol.wait`, and the tokens after it, so a
 * block's first DRAM round trip overlaps the norm's last blocks instead of following them. Prefix -0.01 to -0.03 ms in
 * six same-call pairs on an H200 (seed, Pi0.5, three cameras; bench/NOTES.md, session 43). PI0_PDL=0 launches it
 * plainly.
 *
 * Epilogue: in wgmma's accumulator layout thread (g = lane / 4) holds rows g and g + 8 of its warp's 16, so gate_j
 * (row 2j) and up_j (row 2j + 1) sit in lanes 4 apart; one shuffle gives each thread both halves of one pair per
 * column. Gate and up are rounded to bf16 before gelu x up, as cuBLASLt's bf16 output and pi0_cuda_gelu_mul do, so the
 * two paths differ in the products' summation order and the GELU's formula (gelu_tanh_fast), ~4e-5 relative. Each
 * product's outputs leave through a staging tile by one tensor copy (whole 128-byte lines; the tokens past `rows`
 * clipped by the copy), the next product's GELU running while the copy reads the tile.
 */
#include "cuda/gate_up.h"

#include "cuda/device.cuh"
#include "cuda/hopper.cuh"

#include <cuda_bf16.h>

namespace {

constexpr int kBK = 64;                 /* k per stage: one 128-byte swizzled row */
constexpr int kTileW = 128;             /* weight rows a block in a narrow unit: 64 gate|up pairs */
constexpr int kCluster = 2;             /* blocks sharing the token tile */
constexpr int kStages = 4;
constexpr int kWBytes = kTileW * kBK * 2; /* 16 KB */
constexpr int kStageBytes = 50 * 1024;    /* a narrow unit's 128 weight rows and 2 x 136 tokens, or a wide unit's 256
                                           * and 136 or 144 */
constexpr int kThreads = 384;
[[maybe_unused]] constexpr int kConsumers = 256; /* warpgroups 1 and 2 */

/* N: tokens a product (wgmma's n), 136 or 144. The 136 kernel runs narrow units (2 x 136 tokens a tile) and a wide one
 * for a last tile of 136 or fewer; the 144 kernel runs wide units only (its narrow stage would not fit). */
template <int N>
constexpr int smem_bytes() {
    static_assert(N == 136 || N == 144, "the products' n");
    static_assert(2 * kWBytes + N * 128 <= kStageBytes && (N != 136 || kWBytes + 2 * N * 128 <= kStageBytes), "stage");
    static_assert(kStageBytes % 1024 == 0 && (N * 128) % 1024 == 0, "swizzled tiles start 1024-byte aligned");
    return kStages * kStageBytes + N * 128 + 1024; /* + the epilogue's staging (N tokens x 64 outputs), the alignment */
}

/* gelu_tanh(x) = x (1 + tanh(u)) / 2 = x / (1 + e^(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3), with the hardware's
 * approximate base-2 exponential and reciprocal (relative error ~2^-22 each, far under the bf16 rounding that follows):
 * two special-function instructions and four others an output, where tanhf's branches made the epilogue several times
 * longer and exp2f's and __fdividef's range fixes added three more. x -> -inf: the exponential -> inf, its reciprocal
 * -> 0 and the result -> -0; x -> inf: the exponential -> 0 and the result -> x. */
[[maybe_unused]] __device__ __forceinline__ float gelu_tanh_fast(float x) {
    constexpr float c = -2.0f * 0.7978845608028654f * 1.4426950408889634f; /* -2 u log2(e) = c x + 0.044715 c x^3 */
    float e, r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(e) : "f"(x * (c + 0.044715f * c * x * x)));
    asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(1.0f + e));
    return x * r;
}

/*
 * One product's 64 x N accumulators (weight rows in gate|up pairs x tokens) as gelu(gate) x up, one packed bf16 pair
 * (tokens t and t + 1) a column tile. Pairing: thread (g = lane / 4) holds rows g and g + 8 of its warp's 16; even g
 * computes pair g / 2 of the warp's 8 from its row g (gate) and its partner's (up), odd g pair 4 + g / 2 from its
 * partner's row g + 8 (gate) and its own (up); gate and up are rounded to bf16 first, as the GEMM's output would be,
 * and travel as one packed pair per column pair.
 */
template <int N>
[[maybe_unused]] __device__ __forceinline__ void gelu_up(const float (&acc)[N / 8][4], uint32_t (&out)[N / 8]) {
    const int odd = (threadIdx.x % 32 / 4) & 1;
#pragma unroll
    for (int n = 0; n < N / 8; n++) {
        const uint32_t row_g = pack_bf16(acc[n][0], acc[n][1]), row_g8 = pack_bf16(acc[n][2], acc[n][3]);
        const uint32_t other = __shfl_xor_sync(0xffffffffu, odd ? row_g : row_g8, 4);
        const uint32_t gate = odd ? other : row_g, up = odd ? row_g8 : other;
        out[n] = pack_bf16(gelu_tanh_fast(bf16_lo(gate)) * bf16_lo(up), gelu_tanh_fast(bf16_hi(gate)) * bf16_hi(up));
    }
}

/* gelu_up's outputs into the staging tile: token-major, row t the 64 outputs of token t (128 bytes) with its 16-byte
 * chunks swizzled by t % 8, which is both what the tensor copy's 128-byte swizzle reads and what puts the four tokens a
 * store instruction writes in different banks. pair0: the thread's warp's first column of the 64. */
template <int N>
[[maybe_unused]] __device__ __forceinline__ void stage_outputs(const uint32_t (&v)[N / 8], uint32_t staging, int pair0) {
    const int lane = threadIdx.x % 32, g = lane / 4, j = pair0 + (g & 1 ? 4 + g / 2 : g / 2);
#pragma unroll
    for (int n = 0; n < N / 8; n++) {
        const int t = n * 8 + (lane % 4) * 2; /* t % 8 and (t + 1) % 8 are the lane's, whatever n */
        asm volatile("{\n.reg .b16 lo, hi;\nmov.b32 {lo, hi}, %0;\n"
                     "st.shared.b16 [%1], lo;\nst.shared.b16 [%2], hi;\n}\n" ::"r"(v[n]),
                     "r"(staging + t * 128 + (((j / 8) ^ (t % 8)) * 16) + (j % 8) * 2),
                     "r"(staging + (t + 1) * 128 + (((j / 8) ^ ((t + 1) % 8)) * 16) + (j % 8) * 2)
                     : "memory");
    }
}

/* The work units. A super-tile is 512 weight rows (a cluster's two blocks twice over); a narrow unit is a block's 128
 * weight rows x a 2N-token tile (two a super-tile and tile: w halves 0 and 1), a wide unit 256 weight rows x an N-token
 * tile; every unit is the same work. The order keeps what the clusters running at once read in L2: super-tiles go in
 * groups of kGroup (16 MB of weights), and within a group, token tile by token tile, every super-tile of the group
 * takes its units, so a token tile is read from DRAM once a group and a group's weights once (B = 64's x, 139 MB,
 * would otherwise come from DRAM once per super-tile: 8.9 GB a layer). */
[[maybe_unused]] constexpr int kGroup = 8;
struct Units {
    int narrow_tiles, per_super, supers, total;
};
template <int N>
[[maybe_unused]] __host__ __device__ __forceinline__ Units count_units(int rows, int mlp) {
    int narrow = 0, wide = (rows + N - 1) / N; /* the 144 kernel: every tile wide */
    if (N == 136) { /* tiles of 2N, and a last one of N or fewer wide */
        const int last = rows % (2 * N);
        narrow = rows / (2 * N) + (last > N);
        wide = last > 0 && last <= N;
    }
    const int supers = 2 * mlp / (2 * kTileW * kCluster);
    return {narrow, 2 * narrow + wide, supers, (2 * narrow + wide) * supers};
}

/* Tokens the units cover, padding included: what the product costs, in tokens. */
template <int N>
int padded_tokens(int rows) {
    const Units u = count_units<N>(rows, 256);
    return 2 * N * u.narrow_tiles + N * (u.per_super - 2 * u.narrow_tiles);
}

/* Where unit `unit` puts cluster rank `rank`: its first weight row and first token, and whether it is wide. The
 * producer and the products walk the units alike through this. */
struct UnitOrigin {
    int w_row0, tok0;
    bool wide;
};
template <int N>
[[maybe_unused]] __device__ __forceinline__ UnitOrigin unit_origin(int unit, const Units &u, unsigned rank) {
    const int first = unit / (kGroup * u.per_super) * kGroup; /* the group's first super-tile */
    const int supers = u.supers - first < kGroup ? u.supers - first : kGroup;
    int r = unit - first * u.per_super; /* the unit within its group */
    if (N == 136 && r < 2 * u.narrow_tiles * supers) { /* narrow: token tile, then super-tile, then w half */
        const int tile = r / (2 * supers), w_tile = first * 2 + r % (2 * supers); /* of 256 rows, a cluster's */
        return {(w_tile * kCluster + (int)rank) * kTileW, tile * 2 * N, false};
    }
    r -= 2 * u.narrow_tiles * supers; /* wide: token tile, then super-tile (the 144 kernel: always) */
    const int super = first + r % supers;
    return {(super * kCluster + (int)rank) * 2 * kTileW, u.narrow_tiles * 2 * N + r / supers * N, true};
}

/* Where a unit's operands sit in a stage: a narrow unit's 128 weight rows, then its 2N tokens; a wide unit's 256 weight
 * rows, then its N tokens. Warpgroup c's two products take (a_lo, b_lo) and (a_hi, b_hi): a narrow unit its 64 weight
 * rows against both token halves, a wide unit weight rows 64 c and 128 + 64 c against the one token tile, so that the
 * two warpgroups' lo products are the unit's first 64 outputs and their hi products its next 64. */
struct StageOperands {
    int a_lo, a_hi, b_lo, b_hi; /* byte offsets in the stage */
};
template <int N>
[[maybe_unused]] __device__ __forceinline__ StageOperands stage_operands(bool wide, int c) {
    if (wide) return {c * 64 * 128, (c + 2) * 64 * 128, 2 * kWBytes, 2 * kWBytes};
    return {c * 64 * 128, c * 64 * 128, kWBytes, kWBytes + N * 128};
}

template <int N>
[[maybe_unused]] __device__ __forceinline__ void product(float (&d)[N / 8][4], uint64_t a, uint64_t b) {
    if constexpr (N == 136) wg_m64n136k16_ss(d, a, b, 1);
    else wg_m64n144k16_ss(d, a, b, 1);
}

/*
 * A unit's k loop for one products warpgroup: its two products (stage_operands) stage by stage from the ring at
 * position `it`; each stage is released to both blocks' producers once the products after it are issued and its own
 * are done. Returns the ring's position after the unit.
 */
template <int N>
[[maybe_unused]] __device__ __forceinline__ int products(float (&lo)[N / 8][4], float (&hi)[N / 8][4], uint32_t ring,
                                                         uint64_t *full, uint64_t *empty, StageOperands op, int k_steps,
                                                         int it) {
#if PI0_WGMMA
    for (int kt = 0; kt < k_steps; kt++, it++) {
        const int s = it % kStages;
        const uint32_t stage = ring + s * kStageBytes;
        mbar_wait(smem_addr(&full[s]), (unsigned)(it / kStages) & 1);
        const uint64_t a_lo = wg_desc(stage + op.a_lo, 16, 1024), a_hi = wg_desc(stage + op.a_hi, 16, 1024),
                       b_lo = wg_desc(stage + op.b_lo, 16, 1024), b_hi = wg_desc(stage + op.b_hi, 16, 1024);
        wg_fence();
#pragma unroll
        for (int kc = 0; kc < kBK / 16; kc++) { /* k16 step: 32 bytes on in the 128-byte rows */
            product<N>(lo, a_lo + 2 * kc, b_lo + 2 * kc);
            product<N>(hi, a_hi + 2 * kc, b_hi + 2 * kc);
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

[[maybe_unused]] constexpr int kStoreThread = 128; /* the first thread of the products' warpgroups */

/* One product's gelu_up outputs out through the staging tile: once the last copy has read the tile, every products
 * thread writes its part (stage_outputs), and thread kStoreThread sends the tile to (col0, tok0) of out by one tensor
 * copy, which clips the tokens past the matrix. */
template <int N>
[[maybe_unused]] __device__ __forceinline__ void send_outputs(const uint32_t (&v)[N / 8], uint32_t staging, int pair0,
                                                              const CUtensorMap *out_map, int col0, int tok0) {
    if (threadIdx.x == kStoreThread) bulk_wait_read<0>();
    named_sync(1, kConsumers);
    stage_outputs<N>(v, staging, pair0);
    fence_proxy_async(); /* the tile's writes before the tensor copy reads it */
    named_sync(1, kConsumers);
    if (threadIdx.x == kStoreThread) {
        tma_store_2d(out_map, col0, tok0, staging);
        bulk_commit();
    }
}

/* A stage's weight rows (128, or a wide unit's 256) by tensor copy, announcing on its full barrier every byte the
 * stage will bring (the tokens' too, load_tokens). */
template <int N>
[[maybe_unused]] __device__ __forceinline__ void load_weights(uint32_t stage, uint32_t bar, const CUtensorMap *w_map,
                                                              const UnitOrigin &o, int kt) {
    mbar_expect_bytes(bar, o.wide ? 2 * kWBytes + N * 128 : kWBytes + 2 * N * 128);
    tma_load_2d(stage, w_map, kt * kBK, o.w_row0, bar);
    if (o.wide) tma_load_2d(stage + kWBytes, w_map, kt * kBK, o.w_row0 + kTileW, bar);
}

/* A stage's tokens, multicast into both blocks of the cluster: a wide unit's N by rank 0, a narrow unit's 2N half by
 * each rank. */
template <int N>
[[maybe_unused]] __device__ __forceinline__ void load_tokens(uint32_t stage, uint32_t bar, const CUtensorMap *x_map,
                                                             const UnitOrigin &o, int kt, unsigned rank) {
    const uint16_t both = (uint16_t)((1u << kCluster) - 1);
    if (o.wide) {
        if (rank == 0) tma_load_2d_multicast(stage + 2 * kWBytes, x_map, kt * kBK, o.tok0, bar, both);
    } else {
        tma_load_2d_multicast(stage + kWBytes + rank * N * 128, x_map, kt * kBK, o.tok0 + (int)rank * N, bar, both);
    }
}

/*
 * Persistent: each cluster walks the work units (count_units, unit_origin) cluster_id, cluster_id + num_clusters, ....
 * The ring of stages runs on across units: while the products' warpgroups write one unit's epilogue, the producer is
 * already loading the next unit's first stages.
 *
 * The epilogue: each product's outputs (64 columns x N tokens, both warpgroups') go through the staging tile and out
 * by one tensor copy, which thread kStoreThread issues and waits on (its bulk groups) before the tile is written again;
 * the hi product's GELU runs while the lo product's copy reads the tile. The copy clips the tokens past `rows`.
 */
template <int N>
__global__ void __launch_bounds__(kThreads, 1)
    gate_up_gelu_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,
                        const __grid_constant__ CUtensorMap out_map, int rows, int mlp, int k_steps) {
#if PI0_WGMMA
    extern __shared__ uint8_t smem_raw[];
    __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
    const uint32_t ring = (smem_addr(smem_raw) + 1023) & ~1023u, staging = ring + kStages * kStageBytes;
    const unsigned rank = cluster_rank();
    const int num_clusters = (int)gridDim.x / kCluster;
    const Units units = count_units<N>(rows, mlp);
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
            /* The first unit's first stages' weights go out before the wait: no kernel writes them, so their DRAM
             * round trip overlaps the end of the kernel before (the norm that writes the tokens). */
            const int first = (int)blockIdx.x / kCluster;
            const int early = first < units.total ? (k_steps < kStages ? k_steps : kStages) : 0;
            if (early) {
                const UnitOrigin o = unit_origin<N>(first, units, rank);
                for (int kt = 0; kt < early; kt++)
                    load_weights<N>(ring + kt * kStageBytes, smem_addr(&full[kt]), &w_map, o, kt);
            }
            pdl_wait(); /* the tokens are the kernel before's output */
            int it = 0; /* k steps issued, over all units: the ring's position */
            for (int unit = first; unit < units.total; unit += num_clusters) {
                const UnitOrigin o = unit_origin<N>(unit, units, rank);
                for (int kt = 0; kt < k_steps; kt++, it++) {
                    const int s = it % kStages;
                    const uint32_t stage = ring + s * kStageBytes, bar = smem_addr(&full[s]);
                    if (it >= early) { /* the early stages are fresh, their weights on the way */
                        mbar_wait(smem_addr(&empty[s]), ((unsigned)(it / kStages) & 1) ^ 1); /* both blocks done with it */
                        load_weights<N>(stage, bar, &w_map, o, kt);
                    }
                    load_tokens<N>(stage, bar, &x_map, o, kt, rank);
                }
            }
        }
    } else {
        regs_increase<232>();
        pdl_wait(); /* the outputs overwrite what kernels before may read */
        const int c = wg - 1; /* this warpgroup's share of the tile's weight rows */
        const int warp = (threadIdx.x % 128) / 32;
        int it = 0;
        for (int unit = (int)blockIdx.x / kCluster; unit < units.total; unit += num_clusters) {
            /* zeroed rather than overwritten by the first product: with the first product's scale-d a variable, ptxas
             * serializes the products (its C7511 warning) */
            float lo[N / 8][4], hi[N / 8][4];
#pragma unroll
            for (int n = 0; n < N / 8; n++)
#pragma unroll
                for (int i = 0; i < 4; i++) lo[n][i] = hi[n][i] = 0.f;
            const UnitOrigin o = unit_origin<N>(unit, units, rank);
            it = products<N>(lo, hi, ring, full, empty, stage_operands<N>(o.wide, c), k_steps, it);
            wg_pin(lo);
            wg_pin(hi);
            /* staging columns c * 32 + 8 warp ..: this warp's 8 pairs of each product */
            const int pair0 = o.w_row0 / 2, warp_pairs = c * 32 + warp * 8;
            uint32_t v[N / 8];
            gelu_up<N>(lo, v);
            send_outputs<N>(v, staging, warp_pairs, &out_map, pair0, o.tok0);
            gelu_up<N>(hi, v); /* while the copy reads the tile */
            /* the hi product: a wide unit's next 64 columns, a narrow one's next N tokens */
            send_outputs<N>(v, staging, warp_pairs, &out_map, o.wide ? pair0 + 64 : pair0, o.wide ? o.tok0 : o.tok0 + N);
        }
        if (threadIdx.x == kStoreThread) bulk_wait<0>(); /* the outputs written before the block leaves */
    }
    cluster_barrier(); /* no block leaves while its partner may still arrive on its barriers */
#else
    (void)w_map, (void)x_map, (void)out_map, (void)rows, (void)mlp, (void)k_steps;
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

/* The kernel for these rows: the 144 one where its tiles pad fewer tokens (Pi0.5's 512 + 60: 576 against 2 x 272 +
 * 136), else the 136 one. */
static int tokens_a_product(int rows) { return padded_tokens<144>(rows) < padded_tokens<136>(rows) ? 144 : 136; }

extern "C" int pi0_cuda_gate_up_gelu_pays(int rows, int k) {
    const int p136 = padded_tokens<136>(rows), p144 = padded_tokens<144>(rows); /* the kernel takes the fewer */
    return rows >= 256 && k >= 2048 && 8 * (p144 < p136 ? p144 : p136) <= 9 * rows; /* at most 1/8 padding */
}

extern "C" int pi0_cuda_gate_up_gelu_fits(int rows, int mlp, int k) {
    return rows > 0 && mlp > 0 && mlp % (kTileW * kCluster) == 0 && k > 0 && k % 8 == 0 && sm90a_device() &&
           tensor_map_encoder() != NULL;
}

template <int N>
static cudaError_t launch(__nv_bfloat16 *out, const pi0_bf16 *x, const pi0_bf16 *w, int rows, int mlp, int k, int sms,
                          int dev, cudaStream_t stream) {
    static int configured[PI0_CUDA_MAX_DEVICES];
    cudaError_t e;
    if (dev < 0 || dev >= PI0_CUDA_MAX_DEVICES || !__atomic_load_n(&configured[dev], __ATOMIC_ACQUIRE)) {
        if ((e = cudaFuncSetAttribute(gate_up_gelu_kernel<N>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      smem_bytes<N>())) != cudaSuccess)
            return e;
        if (dev >= 0 && dev < PI0_CUDA_MAX_DEVICES) __atomic_store_n(&configured[dev], 1, __ATOMIC_RELEASE);
    }
    CUtensorMap w_map, x_map, out_map;
    if (!matrix_map(&w_map, w, 2 * mlp, k, kTileW) || !matrix_map(&x_map, x, rows, k, N) ||
        !matrix_map(&out_map, out, rows, mlp, N))
        return cudaErrorInvalidValue;
    const int units = count_units<N>(rows, mlp).total, clusters = units < sms / kCluster ? units : sms / kCluster;
    cudaLaunchAttribute attrs[2];
    attrs[0].id = cudaLaunchAttributeClusterDimension;
    attrs[0].val.clusterDim.x = kCluster, attrs[0].val.clusterDim.y = 1, attrs[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = launch_config(dim3((unsigned)(clusters * kCluster)), dim3(kThreads), smem_bytes<N>(), stream);
    cfg.attrs = attrs, cfg.numAttrs = 1;
    make_dependent(&cfg, attrs); /* after the norm that writes its tokens (forward.c) */
    return cudaLaunchKernelEx(&cfg, gate_up_gelu_kernel<N>, w_map, x_map, out_map, rows, mlp, (k + kBK - 1) / kBK);
}

extern "C" cudaError_t pi0_cuda_gate_up_gelu(pi0_bf16 *out, const pi0_bf16 *x, const pi0_bf16 *w, int rows, int mlp,
                                             int k, cudaStream_t stream) {
    if (!pi0_cuda_gate_up_gelu_fits(rows, mlp, k) || (uintptr_t)out % 16) return cudaErrorInvalidValue;
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (e != cudaSuccess) return e;
    __nv_bfloat16 *o = reinterpret_cast<__nv_bfloat16 *>(out);
    return tokens_a_product(rows) == 144 ? launch<144>(o, x, w, rows, mlp, k, sms, dev, stream)
                                         : launch<136>(o, x, w, rows, mlp, k, sms, dev, stream);
}
