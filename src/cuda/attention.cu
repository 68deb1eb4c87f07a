/*
 * attention.cu - flash-style fused attention with tensor cores (FlashAttention-2 pattern), bf16 I/O.
 *
 * Design. Within a segment, the G = num_heads / num_kv_heads query heads that share one K/V head are
 * laid out as G * num_q "virtual query rows", token-major (row r = token r / G, head g*G + r % G), so
 * that one block serves many (token, head) pairs with every K/V tile it loads: with MQA (Gemma, G = 8)
 * a block of 64 rows covers 8 tokens x 8 heads, and an 11-token denoise segment needs only two blocks
 * per sample instead of one mostly-empty block per head. A block is 4 warps, 64 virtual rows (16 per
 * warp, one m16 tile each); grid = (row tiles of the largest segment, kv heads, segments), blocks past
 * their segment's rows return at once. Keys go by in tiles of 64 (256 at head dim 72 when the grid fits in one wave:
 * the ViT's keys in one tile, one softmax and one wait for its loads instead of a chain of four tiles, launch_vit):
 * K and V are copied to shared memory with 16-byte cp.async (zero-filled past num_k, so no key outside the segment is
 * ever read), and the copies overlap the math: V(j) streams in while S = Q K(j)^T is computed, K(j+1) while O += P V(j)
 * is. S and O use mma.sync m16n8k16 (bf16 in, fp32 accumulate) fed by ldmatrix (V through .trans).
 * The online softmax runs in fp32 in registers, in the log2 domain (exp2 of logits pre-scaled by
 * scale * log2 e); the row max is shared by the 4 lanes of a quad, the row sum stays per lane until the
 * end. The probabilities go from the S accumulators straight into the A fragments of the P V product
 * (an m16n8 C tile pair is an m16k16 A tile), rounded to bf16 as FlashAttention does. Masks: a logit
 * at key >= visible(row) is -inf (only the first query of a segment with state_keys can see fewer
 * keys); tiles past every row's visible range of a block are not visited. The first tile always holds
 * key 0, which every row sees, so the running max is finite after it and no row can produce NaN.
 * The result O / l is staged in the warp's own (no longer needed) Q rows of shared memory and written
 * with coalesced 16-byte stores.
 *
 * Key split (sm_90+). A block walks its keys one 64-key tile after another, about 2-4 us per tile at
 * head_dim 256 (the tensor-core work of one warp plus a load latency), so a small grid is latency-bound:
 * a batch-1 denoise step (2 blocks, 13 tiles) took ~55 us unsplit. When the grid is small the host
 * launches `split` = 2, 4, 8 or 16 blocks per row tile as one thread-block cluster; block `rank` takes the
 * tiles rank, rank + split, ..., and at the end the blocks merge their partial (O, max, sum) through
 * distributed shared memory (combine_split): no workspace in device memory, one kernel, and the grid
 * depends only on host arguments, so the call stays graph-capturable. The split is chosen so the grid
 * still fits on the GPU in one wave; grids that fill the GPU anyway (big batches) and the ViT are not split.
 * Before sm_90 (no clusters) there is no split.
 *
 * head_dim is a template constant for Pi0's: 256 (Gemma) and 72 (SigLIP). For 72 the QK^T contraction is
 * padded to 80 with zero columns in shared memory (global memory is never read past column 72) and
 * the output is 9 n8 tiles. Shared-memory rows are padded by 16 bytes, which makes every ldmatrix and
 * the staging stores free of bank conflicts. Shared memory per block: Q + K + V tiles of 64 rows =
 * 3 * 64 * (256 + 8) * 2 = 99 KB for 256 (two blocks per SM on Hopper; exactly the 99 KB opt-in limit
 * of sm_86/sm_89); for 72, 33 KB, or with K and V tiles of 256 keys (64 + 2 * 256) * 88 * 2 = 99 KB as
 * well. For 256 the Q fragments are re-read from shared memory per tile (keeping them would cost 64 more
 * registers on top of the 128 of the O accumulator and spill).
 *
 * Other head dims (any multiple of 8 up to 256: models the CPU runs, test models) run padded: an
 * instantiation with PADDED = true and HD = 64, 128 or 256 takes the call's head_dim <= HD at run time,
 * copies its head_dim columns and leaves columns [head_dim, HDP) of the tiles zero. That is exact: zero
 * columns of Q and K add nothing to Q K^T, those of V give output columns that are never written out.
 * (One instantiation per head dim instead, 32 of them, would take this file's build from ~30 s to ~4 min
 * for the four GPU archs, and the library from ~3 to ~13 MB.)
 *
 * On an H100/H200, head dim 256 (Gemma: the prefix, and denoise steps too long for the few-queries kernels) and the
 * ViT's 72 (while its grid fits one wave) run attention_wg_kernel below instead: the same blocks with wgmma products
 * and tensor-copy (TMA) loads.
 *
 * Trade-offs and what is left on the table: (1) mma.sync for everything else (sm_80..sm_89, the padded head dims, and
 * the ViT's batches on Hopper). (2) The key split is capped at 16 (a non-portable cluster,
 * sm_90); a batch-1 denoise step walks at most one tile per block. (3) Unaligned pointers or leading dimensions (not
 * multiples of 8 elements) take a correct but slow scalar copy path instead of cp.async. (4) P is
 * rounded to bf16 before P V (relative error ~2^-9 per weight, as in FlashAttention); the row sum l
 * uses the unrounded fp32 values. (5) Every block of a split loads the same Q tile (from L2).
 */
#include "cuda/attention.h"
#include "cuda/device.cuh"
#include "cuda/hopper.cuh"
#include "util/switches.h"

#include <cooperative_groups.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_bf16.h>
#include <cudaTypedefs.h>

namespace {

constexpr int kRows = 64;     /* virtual query rows per block */
constexpr int kKeys = 64;     /* keys per K/V tile */
constexpr int kThreads = 128; /* 4 warps x 16 rows */
constexpr int kMaxDevices = PI0_CUDA_MAX_DEVICES;
constexpr int kMaxSplit = 16; /* blocks per cluster in a key split (16: a non-portable cluster size, sm_90) */

template <int HD>
struct AttnConfig {
    static_assert(HD % 8 == 0, "head_dim must be a multiple of 8");
    static constexpr int HDP = (HD + 15) / 16 * 16;   /* contraction padded to k16: 80 or 256 */
    static_assert(HDP == HD || HDP == HD + 8, "one 8-column pad chunk at most");
    static constexpr int LDS = HDP + 8;               /* smem row stride (elements): +16 bytes vs bank conflicts */
    static constexpr int KCH = HDP / 16;              /* k16 steps of Q K^T */
    static constexpr int NTO = HD / 8;                /* n8 output tiles of P V */
    static constexpr int TILE = kRows * LDS;          /* elements of a 64-row tile (Q; K or V of 64 keys) */
    /* key-split combine: fp32 partial O (row stride HD + 4 floats), then row max and row sum */
    static constexpr int OLD = HD + 4;
    static constexpr size_t PARTIALS = (size_t)kRows * OLD * 4 + kRows * 8; /* bytes, from the start of shared memory */
};

struct AttnParams {
    uint16_t *out;
    const uint16_t *q, *k, *v;
    int ldo, ldq, ldkv;
    const attn_segment *segments;
    int group;        /* query heads per kv head */
    float scale_log2; /* scale * log2(e) */
    int vec_q, vec_kv, vec_o; /* 16-byte paths allowed */
    int split;        /* blocks (one thread-block cluster, sm_90+) sharing the keys of one row tile */
    int head_dim;     /* the call's; a padded instantiation (PADDED) runs any multiple of 8 up to its HD */
    int decode_tiles; /* the few-queries partials: 16-row tiles a block (its row group) */
};

extern __shared__ __align__(16) unsigned char attn_smem[];

/* One 16-byte chunk (8 bf16) global -> shared; zeros when !valid (src is then never read). */
__device__ __forceinline__ void copy_chunk(uint16_t *dst, const uint16_t *src, bool valid, bool vec) {
    if (vec) {
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
                     "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
                     : "memory");
    } else {
        uint4 w = make_uint4(0, 0, 0, 0);
        if (valid) {
            w.x = (uint32_t)src[0] | ((uint32_t)src[1] << 16);
            w.y = (uint32_t)src[2] | ((uint32_t)src[3] << 16);
            w.z = (uint32_t)src[4] | ((uint32_t)src[5] << 16);
            w.w = (uint32_t)src[6] | ((uint32_t)src[7] << 16);
        }
        *reinterpret_cast<uint4 *>(dst) = w;
    }
}

/* Zeros columns [8 * chunks, HDP) of `rows` shared-memory rows from s on (stride LDS): the k16 pad of the
 * contraction and, in a padded instantiation, the columns past the call's head dim. The copies never
 * write them, so once per kernel is enough; zero columns add nothing to Q K^T, and P V's columns there
 * are zeros that nobody writes out. */
template <int HD>
__device__ __forceinline__ void zero_pad_columns(uint16_t *s, int rows, int chunks, int tid, int threads) {
    using C = AttnConfig<HD>;
    const int pad = C::HDP / 8 - chunks;
    for (int i = tid; i < rows * pad; i += threads)
        *reinterpret_cast<uint4 *>(s + (i / pad) * C::LDS + (chunks + i % pad) * 8) = make_uint4(0, 0, 0, 0);
}

/* Element offset of column chunk c (8 columns) of row r in a shared-memory tile: row-major with rows ld apart (for
 * ldmatrix), or, SWIZZLED, the 128-byte swizzle that wgmma and the tensor copies use (hopper.cuh): 64-column blocks
 * ld elements apart, rows 64 elements apart in a block, chunk c at chunk (c ^ r) % 8 of its row. */
template <bool SWIZZLED>
__device__ __forceinline__ int tile_at(int r, int c, int ld) {
    return SWIZZLED ? (c >> 3) * ld + r * 64 + (((c ^ r) & 7) << 3) : r * ld + c * 8;
}

/* Column chunk c of rows r, r + step, ... (r < n) of a block's virtual query rows, walking (token, head) by adding:
 * virtual row vr = r_begin + r is token vr / G, head vr % G of qbase. */
template <bool SWIZZLED>
__device__ __forceinline__ void copy_q_column(uint16_t *sq, int ld, const uint16_t *qbase, int ldq, int hd, int G,
                                              int r_begin, int n, int rows_total, int c, int r, int step, bool vec) {
    const int step_t = step / G, step_h = step % G;
    int vr = r_begin + r, t = vr / G, hh = vr - t * G;
    for (; r < n; r += step, vr += step, t += step_t, hh += step_h) {
        if (hh >= G) { /* step_h < G: one carry at most */
            hh -= G;
            t++;
        }
        const bool valid = vr < rows_total;
        copy_chunk(sq + tile_at<SWIZZLED>(r, c, ld), qbase + (size_t)(valid ? t : 0) * ldq + (valid ? hh : 0) * hd + c * 8,
                   valid, vec);
    }
}

/*
 * Rows [r_begin, r_begin + n) of a block's virtual query rows into a shared-memory tile (tile_at; row r - r_begin
 * there); rows from rows_total on are zeros. This runs right after the wait on the kernel that wrote q, so its issue
 * cost is on the chain: each thread walks rows of one column chunk (copy_q_column) rather than dividing per row. In
 * the row-major layout consecutive threads take consecutive chunks of a row; in the swizzled one, 8 consecutive
 * rows of a chunk (their 16-byte stores land in 8 different bank groups).
 */
template <bool SWIZZLED>
__device__ __forceinline__ void copy_q_rows(uint16_t *sq, int ld, const uint16_t *qbase, int ldq, int hd, int G, int r_begin,
                                            int n, int rows_total, int chunks, int tid, int threads, bool vec) {
    if (SWIZZLED) {
        for (int c = tid >> 3; c < chunks; c += threads >> 3)
            copy_q_column<true>(sq, ld, qbase, ldq, hd, G, r_begin, n, rows_total, c, tid & 7, 8, vec);
        return;
    }
    if (threads % chunks) {
        for (int i = tid; i < n * chunks; i += threads) {
            const int r = i / chunks, c = i % chunks, vr = r_begin + r;
            const bool valid = vr < rows_total;
            const int t = valid ? vr / G : 0, hh = valid ? vr - t * G : 0;
            copy_chunk(sq + r * ld + c * 8, qbase + (size_t)t * ldq + hh * hd + c * 8, valid, vec);
        }
        return;
    }
    copy_q_column<false>(sq, ld, qbase, ldq, hd, G, r_begin, n, rows_total, tid % chunks, tid / chunks,
                         threads / chunks, vec);
}

/* The online softmax's step to a new running max: O and the row sums l of this lane's two rows scaled by
 * exp2(m - base), m the old max, base the new one's finite stand-in. Both kernels skip it on a block's first
 * keys, where O and l are still 0. */
template <int NTO>
__device__ __forceinline__ void rescale_running(float (&o)[NTO][4], float &l0, float &l1, float m0, float m1, float base0,
                                                float base1) {
    const float alpha0 = exp2f(m0 - base0), alpha1 = exp2f(m1 - base1);
    l0 *= alpha0;
    l1 *= alpha1;
#pragma unroll
    for (int t = 0; t < NTO; t++) {
        o[t][0] *= alpha0;
        o[t][1] *= alpha0;
        o[t][2] *= alpha1;
        o[t][3] *= alpha1;
    }
}

/*
 * One key tile's step of the online softmax for a lane's two rows: the scores S (mma C layout) of keys key0 ..
 * key0 + 8 N - 1 scaled into the log2 domain, -inf at keys before `lo` (a tile moved back to end at the last key, whose
 * first keys were seen before) or past each row's visible count, the running max m over the quad, O and l rescaled
 * to it (not on the block's first tile, where both are still 0), and S replaced by its probabilities, their sums
 * added to l.
 */
template <int N, int NTO>
__device__ __forceinline__ void softmax_tile(float (&s)[N][4], float (&o)[NTO][4], float &m0, float &m1, float &l0,
                                             float &l1, int key0, int lo, int vis0, int vis1, int quad_col,
                                             float scale_log2, bool first) {
#pragma unroll
    for (int n = 0; n < N; n++) {
        s[n][0] *= scale_log2;
        s[n][1] *= scale_log2;
        s[n][2] *= scale_log2;
        s[n][3] *= scale_log2;
    }
    if (lo > key0 || key0 + 8 * N > vis0 || key0 + 8 * N > vis1) {
#pragma unroll
        for (int n = 0; n < N; n++) {
            const int key = key0 + n * 8 + quad_col * 2;
            if (key >= vis0 || key < lo) s[n][0] = -INFINITY;
            if (key + 1 >= vis0 || key + 1 < lo) s[n][1] = -INFINITY;
            if (key >= vis1 || key < lo) s[n][2] = -INFINITY;
            if (key + 1 >= vis1 || key + 1 < lo) s[n][3] = -INFINITY;
        }
    }
    float mx0 = m0, mx1 = m1;
#pragma unroll
    for (int n = 0; n < N; n++) {
        mx0 = fmaxf(mx0, fmaxf(s[n][0], s[n][1]));
        mx1 = fmaxf(mx1, fmaxf(s[n][2], s[n][3]));
    }
    quad_max(mx0, mx1);
    /* A row with every logit so far masked would have mx = -inf; exp2(-inf - 0) = 0 keeps it NaN-free. */
    const float base0 = mx0 == -INFINITY ? 0.f : mx0, base1 = mx1 == -INFINITY ? 0.f : mx1;
    if (!first) rescale_running(o, l0, l1, m0, m1, base0, base1);
    m0 = mx0;
    m1 = mx1;
    exp_scores(s, base0, base1, l0, l1);
}



/* S = Q K^T over KEYS keys (a multiple of 16) for one warp's 16 rows: Q and K from shared memory
 * through ldmatrix at q_addr (this lane's A address) and k_addr (its B address, rows = keys). */
template <int HD, int KEYS>
__device__ __forceinline__ void compute_scores(float (&s)[KEYS / 8][4], uint32_t q_addr, uint32_t k_addr) {
    using C = AttnConfig<HD>;
#pragma unroll
    for (int n = 0; n < KEYS / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kc = 0; kc < C::KCH; kc++) {
        uint32_t a[4];
        ldsm_x4(a, q_addr + kc * 32);
#pragma unroll
        for (int np = 0; np < KEYS / 16; np++) {
            uint32_t b[4];
            ldsm_x4(b, k_addr + (np * 16 * C::LDS + kc * 16) * 2);
            mma_bf16(s[2 * np], a, b[0], b[1]);
            mma_bf16(s[2 * np + 1], a, b[2], b[3]);
        }
    }
}

/* The A fragment of P V for keys [16 kc, 16 kc + 16): the S accumulators' C tiles 2 kc and 2 kc + 1 (an m16n8 C tile
 * pair is an m16k16 A tile, per warp, for mma.sync and wgmma alike), rounded to bf16. */
template <int N>
__device__ __forceinline__ void p_fragment(uint32_t (&a)[4], const float (&s)[N][4], int kc) {
    a[0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]);
    a[1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
    a[2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
    a[3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
}

/*
 * O += P V over KEYS keys (a multiple of 16) for one warp's 16 rows: the C tiles (n = 2kc, 2kc+1) of
 * S = Q K^T form the A fragment of keys [16kc, 16kc+16), rounded to bf16; V comes from shared memory
 * (rows = keys, stride LDS) through ldmatrix .trans at v_addr.
 */
template <int HD, int KEYS>
__device__ __forceinline__ void accumulate_pv(float (&o)[HD / 8][4], const float (&s)[KEYS / 8][4], uint32_t v_addr) {
    using C = AttnConfig<HD>;
#pragma unroll
    for (int kc = 0; kc < KEYS / 16; kc++) {
        uint32_t a[4];
        p_fragment(a, s, kc);
#pragma unroll
        for (int dp = 0; dp < C::NTO / 2; dp++) {
            uint32_t b[4];
            ldsm_x4_trans(b, v_addr + (kc * 16 * C::LDS + dp * 16) * 2);
            mma_bf16(o[2 * dp], a, b[0], b[1]);
            mma_bf16(o[2 * dp + 1], a, b[2], b[3]);
        }
        if constexpr (C::NTO % 2 != 0) {
            uint32_t b[2];
            ldsm_x2_trans(b, v_addr + (kc * 16 * C::LDS + (C::NTO - 1) * 8) * 2);
            mma_bf16(o[C::NTO - 1], a, b[0], b[1]);
        }
    }
}

/* Shared memory of the mma.sync tiled kernel with K and V tiles of KEYS keys (and a Q tile of kRows rows). */
template <int HD, int KEYS>
constexpr size_t tiles_smem() {
    constexpr size_t bytes = (size_t)(kRows + 2 * KEYS) * AttnConfig<HD>::LDS * sizeof(uint16_t);
    static_assert(AttnConfig<HD>::PARTIALS <= bytes, "a split's partials must fit in the tiles' space");
    return bytes;
}

/* Bytes of one 64-column block of a 64-row swizzled tile (tile_at, SWIZZLED). */
[[maybe_unused]] constexpr int kBlockBytes = kRows * 128;

/* S = Q K^T over a 64-key tile as one warpgroup's wgmma batch (sm_90a): Q and K swizzled (tile_at), both K-major;
 * q_desc / k_desc describe the tiles' first k16 step. Returns with s complete. */
template <int HD>
__device__ __forceinline__ void wg_scores(float (&s)[kKeys / 8][4], uint64_t q_desc, uint64_t k_desc) {
    using C = AttnConfig<HD>;
    static_assert(kKeys == 64 && kRows == 64, "one m64n64 product per k16 step");
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < C::KCH; kc++) { /* k16 step kc: 32 bytes on in a 128-byte row, 4 to a column block */
        const uint64_t step = ((kc >> 2) * kBlockBytes + (kc & 3) * 32) >> 4;
        wg_m64n64k16_ss(s, q_desc + step, k_desc + step, kc);
    }
    wg_commit();
    wg_wait_all();
    wg_pin(s);
}

/* O += P V over a 64-key tile as one warpgroup's wgmma batch (sm_90a): P from the S accumulators (rounded to bf16,
 * as accumulate_pv), V swizzled (tile_at) and read MN-major (v_desc: 64-column blocks LBO apart, 8-key groups SBO): 64
 * output columns a product, and a head dim's last 8 (the ViT's 72 = 64 + 8) in one of 8. */
template <int HD>
__device__ __forceinline__ void wg_accumulate_pv(float (&o)[HD / 8][4], const float (&s)[kKeys / 8][4], uint64_t v_desc) {
    using C = AttnConfig<HD>;
    static_assert(C::NTO % 8 == 0 || C::NTO % 8 == 1, "m64n64 output blocks and at most one m64n8");
    uint32_t a[kKeys / 16][4];
#pragma unroll
    for (int kc = 0; kc < kKeys / 16; kc++) p_fragment(a[kc], s, kc);
    wg_fence();
#pragma unroll
    for (int kc = 0; kc < kKeys / 16; kc++) {
#pragma unroll
        for (int nb = 0; nb < C::NTO / 8; nb++) /* keys 16 kc.. (16 rows of 128 bytes), dims 64 nb.. (a column block) */
            wg_m64n64k16_rs_tb(*reinterpret_cast<float(*)[8][4]>(o + 8 * nb), a[kc],
                               v_desc + ((nb * kBlockBytes + kc * 16 * 128) >> 4));
        if constexpr (C::NTO % 8 == 1)
            wg_m64n8k16_rs_tb(o[C::NTO - 1], a[kc], v_desc + (((C::NTO / 8) * kBlockBytes + kc * 16 * 128) >> 4));
    }
    wg_commit();
    wg_wait_all();
    wg_pin(o);
}

/*
 * The end of a key-split kernel (split > 1, sm_90+): the `split` blocks of a cluster each hold an
 * unnormalized partial O, row max m (log2 domain) and row sum l for the same 64 rows over their own
 * keys. Block `rank` owns rows [rank * R, rank * R + R), R = 64 / split. After a cluster barrier (every
 * block is done with its K/V/Q tiles, whose shared memory now receives partials), each block pushes
 * each of its rows to the owner's shared memory (distributed shared memory stores: posted writes, no
 * round trip), slot [sender][row - owner * R]; after a second barrier every owner merges its rows
 * from local shared memory: M = max m_b, L = sum l_b 2^(m_b - M), O = sum O_b 2^(m_b - M) / L.
 * (Pulling the partials with DSMEM loads instead cost ~6 us more per call: one round trip per row.)
 * The merge order is fixed, so results are deterministic. Block 0 always owns key 0, which every row
 * sees, so M is finite and L > 0 for every real row; a block that saw no key of a row sends m = -inf,
 * l = 0, O = 0, which weighs 0.
 */
template <int HD>
__device__ __forceinline__ void combine_split(const float (&o)[HD / 8][4], float m0, float m1, float l0, float l1,
                                              int warp, int lane, int rank, int split, int r_begin, int rows_total,
                                              int G, int hd, uint16_t *obase, int ldo, bool vec_o) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using C = AttnConfig<HD>;
    namespace cg = cooperative_groups;
    cg::cluster_group cluster = cg::this_cluster();
    float *sO = reinterpret_cast<float *>(attn_smem); /* [split][R][OLD] */
    float2 *sML = reinterpret_cast<float2 *>(sO + kRows * C::OLD); /* [split][R]: (m, l) */
    const int R = kRows / split;
    const int quad_row = lane >> 2, quad_col = lane & 3;

    cp_async_wait_all(); /* nothing may still be copying into the tiles ... */
    __syncthreads();     /* ... for any thread of the block (racecheck wants this CTA barrier too) */
    cluster.sync();      /* every block of the cluster is done with its tiles */
#pragma unroll
    for (int half = 0; half < 2 && warp < kRows / 16; half++) { /* the warps that hold rows (a second warpgroup not) */
        const int row = warp * 16 + quad_row + half * 8, owner = row / R, slot = rank * R + row % R;
        float *dst = cluster.map_shared_rank(sO + slot * C::OLD, owner);
#pragma unroll
        for (int t = 0; t < C::NTO; t++)
            *reinterpret_cast<float2 *>(dst + t * 8 + quad_col * 2) =
                half ? make_float2(o[t][2], o[t][3]) : make_float2(o[t][0], o[t][1]);
        if (quad_col == 0)
            *cluster.map_shared_rank(sML + slot, owner) = half ? make_float2(m1, l1) : make_float2(m0, l0);
    }
    cluster.sync(); /* every partial delivered */

    for (int rr = warp; rr < R; rr += (int)blockDim.x / 32) { /* every warp of the block */
        const int vr = r_begin + rank * R + rr;
        if (vr >= rows_total) continue; /* warp-uniform */
        float w[kMaxSplit];
        float M = -INFINITY, L = 0.f;
#pragma unroll
        for (int b = 0; b < kMaxSplit; b++)
            if (b < split) M = fmaxf(M, sML[b * R + rr].x);
#pragma unroll
        for (int b = 0; b < kMaxSplit; b++) {
            w[b] = 0.f;
            if (b < split) {
                const float2 ml = sML[b * R + rr];
                w[b] = exp2f(ml.x - M); /* 0 for a block that saw no key of this row */
                L += ml.y * w[b];
            }
        }
        const float inv = 1.f / L;
        const int t = vr / G, hh = vr - t * G;
        uint16_t *dst_row = obase + (size_t)t * ldo + hh * hd;
        for (int c = lane; c < hd / 8; c += 32) {
            float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int b = 0; b < kMaxSplit; b++) {
                if (b < split) {
                    const float4 *src = reinterpret_cast<const float4 *>(sO + (b * R + rr) * C::OLD + c * 8);
                    const float4 x0 = src[0], x1 = src[1];
                    acc[0] += x0.x * w[b];
                    acc[1] += x0.y * w[b];
                    acc[2] += x0.z * w[b];
                    acc[3] += x0.w * w[b];
                    acc[4] += x1.x * w[b];
                    acc[5] += x1.y * w[b];
                    acc[6] += x1.z * w[b];
                    acc[7] += x1.w * w[b];
                }
            }
            uint4 packed;
            packed.x = pack_bf16(acc[0] * inv, acc[1] * inv);
            packed.y = pack_bf16(acc[2] * inv, acc[3] * inv);
            packed.z = pack_bf16(acc[4] * inv, acc[5] * inv);
            packed.w = pack_bf16(acc[6] * inv, acc[7] * inv);
            uint16_t *dst = dst_row + c * 8;
            if (vec_o) {
                *reinterpret_cast<uint4 *>(dst) = packed;
            } else {
                const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
                for (int e = 0; e < 8; e++) dst[e] = (uint16_t)(words[e / 2] >> (16 * (e % 2)));
            }
        }
    }
#else
    (void)o, (void)m0, (void)m1, (void)l0, (void)l1, (void)warp, (void)lane, (void)rank, (void)split;
    (void)r_begin, (void)rows_total, (void)G, (void)hd, (void)obase, (void)ldo, (void)vec_o;
    __trap(); /* the host never splits before sm_90 */
#endif
}

/*
 * The end of an unsplit block: a warp's 16 rows of O / l, staged as bf16 in `so` (16 rows, stride LDS: the warp's
 * own Q rows, no longer needed) and written with 16-byte stores. Lane l knows the token and head of the warp's row
 * l % 16 (one division a lane, not one a store); the stores take them by shuffle, so every lane runs every round.
 */
template <int HD>
__device__ __forceinline__ void store_rows(const float (&o)[HD / 8][4], float l0, float l1, uint16_t *so, int warp,
                                           int lane, int r_begin, int rows_total, int G, int hd, int chunks,
                                           uint16_t *obase, int ldo, bool vec_o) {
    using C = AttnConfig<HD>;
    const int quad_row = lane >> 2, quad_col = lane & 3;
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    __syncwarp(); /* every lane of the warp is done reading its Q rows */
#pragma unroll
    for (int t = 0; t < C::NTO; t++) {
        *reinterpret_cast<uint32_t *>(so + quad_row * C::LDS + t * 8 + quad_col * 2) =
            pack_bf16(o[t][0] * inv0, o[t][1] * inv0);
        *reinterpret_cast<uint32_t *>(so + (quad_row + 8) * C::LDS + t * 8 + quad_col * 2) =
            pack_bf16(o[t][2] * inv1, o[t][3] * inv1);
    }
    __syncwarp();
    const int own_vr = r_begin + warp * 16 + (lane & 15), own_t = own_vr / G, own_h = own_vr - own_t * G;
    for (int base = 0; base < 16 * chunks; base += 32) {
        const int i = base + lane, r = min(i / chunks, 15), c = i % chunks, vr = r_begin + warp * 16 + r;
        const int t = __shfl_sync(0xffffffffu, own_t, r), hh = __shfl_sync(0xffffffffu, own_h, r);
        if (i >= 16 * chunks || vr >= rows_total) continue;
        uint16_t *dst = obase + (size_t)t * ldo + hh * hd + c * 8;
        const uint16_t *src = so + r * C::LDS + c * 8;
        if (vec_o) {
            *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(src);
        } else {
#pragma unroll
            for (int e = 0; e < 8; e++) dst[e] = src[e];
        }
    }
}

/* The end of a tiled block: the row sums finished over the quad, then the key split's merge (split > 1) or this warp's
 * rows stored (store_rows, staged in `so`) when it has any. */
template <int HD>
__device__ __forceinline__ void finish_block(const float (&o)[HD / 8][4], float m0, float m1, float l0, float l1, int warp,
                                             int lane, int rank, int split, int r_begin, int rows_total, int G, int hd,
                                             int chunks, uint16_t *obase, int ldo, bool vec_o, uint16_t *so,
                                             bool warp_active) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    if (split > 1) {
        combine_split<HD>(o, m0, m1, l0, l1, warp, lane, rank, split, r_begin, rows_total, G, hd, obase, ldo, vec_o);
        return;
    }
    if (!warp_active) return; /* no barrier follows */
    store_rows<HD>(o, l0, l1, so, warp, lane, r_begin, rows_total, G, hd, chunks, obase, ldo, vec_o);
}

/* The tiled kernel's work for its block (the design note above), with K/V tiles of KEYS keys. PADDED: the call's head
 * dim is p.head_dim <= HD (see kernel_head_dim). */
template <int HD, bool PADDED, int KEYS>
__device__ __forceinline__ void attention_tiles(const AttnParams &p) {
    using C = AttnConfig<HD>;
    const int hd = PADDED ? p.head_dim : HD, chunks = hd / 8; /* global columns and 16-byte chunks of a head */
    const attn_segment seg = p.segments[blockIdx.z];
    const int G = p.group, split = p.split;
    const int rows_total = seg.num_q * G; /* virtual rows of this segment */
    const int rank = (int)blockIdx.x % split; /* = the block's rank in its cluster (cluster dims (split, 1, 1)) */
    const int r_begin = (int)blockIdx.x / split * kRows;
    /* uniform per block, and per cluster: all its blocks share the segment and the row tile */
    if (seg.num_q <= 0 || seg.num_k <= 0 || r_begin >= rows_total) {
        pdl_wait(); /* a dependent's end implies its predecessors' (device.cuh) */
        return;
    }

    uint16_t *sQ = reinterpret_cast<uint16_t *>(attn_smem);
    uint16_t *sK = sQ + C::TILE;
    uint16_t *sV = sK + KEYS * C::LDS;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kvh = blockIdx.y;
    const int num_k = seg.num_k;
    const int state_vis = seg.state_keys > 0 ? min(seg.state_keys, num_k) : num_k;

    /* Keys visible to this block's rows: only virtual rows r < G (token 0) can see fewer. */
    const int r_last = min(r_begin + kRows, rows_total) - 1;
    const int block_vis = r_last < G ? state_vis : num_k;
    const int n_tiles = (block_vis + KEYS - 1) / KEYS;

    const uint16_t *qbase = p.q + (size_t)seg.q_row * p.ldq + (size_t)kvh * G * hd;
    const uint16_t *kbase = p.k + (size_t)seg.k_row * p.ldkv + (size_t)kvh * hd;
    const uint16_t *vbase = p.v + (size_t)seg.k_row * p.ldkv + (size_t)kvh * hd;
    const bool vec_q = p.vec_q != 0, vec_kv = p.vec_kv != 0;

    /* The pad columns [hd, HDP) of all three tiles (contiguous rows) are zeros. */
    if (PADDED || C::HDP > HD) zero_pad_columns<HD>(sQ, kRows + 2 * KEYS, chunks, tid, kThreads);

    auto load_kv = [&](uint16_t *dst, const uint16_t *base, int key0) {
        for (int i = tid; i < KEYS * chunks; i += kThreads) {
            const int r = i / chunks, c = i % chunks, key = key0 + r;
            const bool valid = key < num_k;
            copy_chunk(dst + r * C::LDS + c * 8, base + (size_t)(valid ? key : 0) * p.ldkv + c * 8, valid, vec_kv);
        }
    };
    /* This block's key tiles: rank, rank + split, ... (all of them without a split). The first tile's V streams in
     * behind its K (a later tile's V follows the wait for its K: the buffer is free only then). Launched as a
     * dependent (pi0_cuda_attention_ws), a first tile of keys before the segment's last num_q streams in before the
     * wait (attention.h); Q and the other keys are the previous kernel's output. */
    const bool preloaded = rank < n_tiles && (rank + 1) * KEYS <= num_k - seg.num_q;
    if (preloaded) {
        load_kv(sK, kbase, rank * KEYS);
        cp_async_commit();
        load_kv(sV, vbase, rank * KEYS);
        cp_async_commit();
    }
    pdl_wait();

    /* Q tile: virtual row r -> token r / G, head kvh * G + r % G; rows past the segment are zeros. */
    copy_q_rows<false>(sQ, C::LDS, qbase, p.ldq, hd, G, r_begin, kRows, rows_total, chunks, tid, kThreads, vec_q);
    cp_async_commit();
    if (!preloaded) {
        if (rank < n_tiles) load_kv(sK, kbase, rank * KEYS);
        cp_async_commit();
        if (rank < n_tiles) load_kv(sV, vbase, rank * KEYS);
        cp_async_commit();
    }

    /* Per-lane ldmatrix addresses (bytes, shared space). */
    const int lrow = lane & 7, lsel1 = (lane >> 3) & 1, lsel2 = lane >> 4;
    /* A (Q): matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15) */
    const uint32_t q_addr = smem_addr(sQ + (warp * 16 + lrow + lsel1 * 8) * C::LDS + lsel2 * 8);
    /* B (K, non-trans): (keys 0-7, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 0-7), (keys 8-15, d 8-15) */
    const uint32_t k_addr = smem_addr(sK + (lrow + lsel2 * 8) * C::LDS + lsel1 * 8);
    /* B (V, trans): (keys 0-7, d 0-7), (keys 8-15, d 0-7), (keys 0-7, d 8-15), (keys 8-15, d 8-15) */
    const uint32_t v_addr = smem_addr(sV + (lrow + lsel1 * 8) * C::LDS + lsel2 * 8);

    /* This lane's two rows: quad_row and quad_row + 8 of the warp's 16. */
    const int quad_row = lane >> 2, quad_col = lane & 3;
    const int vr0 = r_begin + warp * 16 + quad_row, vr1 = vr0 + 8;
    const int vis0 = vr0 < G ? state_vis : num_k, vis1 = vr1 < G ? state_vis : num_k;
    const bool warp_active = r_begin + warp * 16 < rows_total; /* warp-uniform */

    float o[C::NTO][4];
#pragma unroll
    for (int t = 0; t < C::NTO; t++) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int j = rank; j < n_tiles; j += split) {
        const int key0 = j * KEYS;
        if (j == rank && !preloaded) cp_async_wait_one(); /* K(j) (and Q) landed for this thread ... */
        else cp_async_wait_all();
        __syncthreads(); /* ... and for all; every warp is also done with V(j-1) */
        if (j != rank) {
            load_kv(sV, vbase, key0);
            cp_async_commit();
        }

        float s[KEYS / 8][4];
        if (warp_active) {
            compute_scores<HD, KEYS>(s, q_addr, k_addr);
            softmax_tile(s, o, m0, m1, l0, l1, key0, key0, vis0, vis1, quad_col, p.scale_log2, j == rank);
        }

        cp_async_wait_all(); /* V(j) landed for this thread ... */
        __syncthreads();     /* ... and for all; every warp is also done with K(j) */
        if (j + split < n_tiles) {
            load_kv(sK, kbase, key0 + split * KEYS);
            cp_async_commit();
        }

        if (warp_active) {
            accumulate_pv<HD, KEYS>(o, s, v_addr);
        }
    }

    finish_block<HD>(o, m0, m1, l0, l1, warp, lane, rank, split, r_begin, rows_total, G, hd, chunks,
                     p.out + (size_t)seg.q_row * p.ldo + (size_t)kvh * G * hd, p.ldo, p.vec_o != 0,
                     sQ + warp * 16 * C::LDS, warp_active);
}

/* Head dim 72 and the padded 64 in 64-key tiles: 4 blocks per SM (<= 128 registers); 72 in 256-key tiles (whose
 * scores alone take 128 registers) and 256: 2 blocks per SM (shared memory bound); the padded 128: 2 (at 128
 * registers it would spill). */
template <int HD, bool PADDED, int KEYS>
__global__ void __launch_bounds__(kThreads, HD < 128 && KEYS == kKeys ? 4 : 2) attention_kernel(AttnParams p) {
    attention_tiles<HD, PADDED, KEYS>(p);
}

/*
 * The tiled kernel on Hopper (sm_90a; head dims 256 and 72): the same blocks, rows, masks, online softmax, split and
 * merge, with the work per 64-key tile cut to what Hopper needs to issue (bench/NOTES.md, session 12: the mma.sync
 * kernel issues ~2,600 instructions a tile a warp, at one warp a scheduler and ~4.5 cycles each, and that, not its
 * loads or its math, is its time). The products are wgmma batches (hopper.cuh: 16 + 16 instructions a tile for the
 * warpgroup, against 256 mma.sync and 144 ldmatrix a warp). K and V arrive by tensor copies (TMA) that one thread
 * issues, 8 a tile, into a ring of kStages (K, V) tile pairs with an mbarrier each, refilled as soon as a slot is free
 * (the copies' 32 cp.async a thread and their address math were ~400 instructions a tile). Q is copied once, by every
 * thread, into the same 128-byte-swizzled layout the copies write. A last tile that would run past the segment's keys
 * is moved back to end at its last key, its first keys (seen before) masked, so that no copy reads past the keys it was
 * given (in a segment of under 64 keys the rows before it are masked, and their V zeroed).
 *
 * Two consumer warpgroups share the block's Q tile and ring and take its key tiles in turn (warpgroup w the tiles
 * w, w + 2, ...), each with its own running softmax, so that a block's chain of tiles (a tile is a serial chain of
 * products, softmax and rescale that one warpgroup an SM leaves mostly idle: session 12) is half as long and two
 * chains interleave on the SM. Slot s of the ring holds tiles s, s + 3, ...: consecutive tiles of a slot belong to
 * different warpgroups, so the consumer of tile i, once done with it, issues tile i + 3 and arrives on named barrier
 * 1 + s, where the consumer of tile i + 3 syncs before waiting on the slot's mbarrier: it must not wait for tile
 * i + 3's parity while tile i's phase is still pending, or the wait would pass at once (the tests cannot provoke
 * that race: bench/RESULTS.md, session 15). At the end warpgroup 1's O, maxima and sums go through shared memory to
 * warpgroup 0, which merges them and finishes the block (the split's merge, where there is one, takes every warp).
 * Prefix attention 16.7 -> 14.9 us a layer on an H200 against one warpgroup. The ring takes 226 KB of shared
 * memory: one block an SM. The host takes this kernel only in builds with sm_90a code (PI0_SM90A_BUILD); elsewhere
 * it runs attention_kernel.
 *
 * The ViT's head dim 72 is a 64-column block and 8 columns of a second: its tiles are 128 columns wide (113 KB in
 * all: two blocks an SM), the tensor copies fill the columns past 72 with zeros (the maps end at the head,
 * kv_tensor_map), Q's are zeroed once, S takes 5 k16 steps (the fifth over columns 64-79) and P V one m64n64 and one
 * m64n8 product a k16 step.
 */
constexpr int kStages = 3;
constexpr int kWgThreads = 2 * kThreads; /* two consumer warpgroups */

template <int HD>
struct WgConfig { /* Q and the ring's K and V tiles (64 rows each of whole 64-column blocks), and 1 KB of alignment
                   * slack that also holds the ring's barriers (the kernel's `bars`) */
    static constexpr int HDS = (HD + 63) / 64 * 64; /* a tile's columns: 128 for the ViT's 72 */
    /* 113 KB for the ViT: two blocks an SM (228 KB, 1 KB of it reserved per block), with not a byte to spare */
    static constexpr size_t SMEM = (size_t)(1 + 2 * kStages) * kRows * HDS * sizeof(uint16_t) + 1024;
    static_assert(AttnConfig<HD>::PARTIALS <= SMEM, "a split's partials must fit");
};

template <int HD>
__global__ void __launch_bounds__(kWgThreads, 1)
    attention_wg_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ CUtensorMap k_map,
                        const __grid_constant__ CUtensorMap v_map) {
#if PI0_WGMMA
    using C = AttnConfig<HD>;
    constexpr int HDS = WgConfig<HD>::HDS;
    static_assert(HD % 64 == 0 || HD % 64 == 8, "whole 64-column blocks, and 8 columns past them at most");
    static_assert(kStages % 2 == 1, "a slot's consecutive tiles belong to different warpgroups");
    constexpr int chunks = HD / 8;
    constexpr uint32_t kTileBytes = kRows * HDS * 2;
    static_assert(2 * kTileBytes + (C::NTO + 1) * kThreads * sizeof(float4) <= kStages * 2 * kTileBytes,
                  "warpgroup 1's partials fit in the ring past its first slot");
    const attn_segment seg = p.segments[blockIdx.z];
    const int G = p.group, split = p.split;
    const int rows_total = seg.num_q * G;
    const int rank = (int)blockIdx.x % split, r_begin = (int)blockIdx.x / split * kRows;
    if (seg.num_q <= 0 || seg.num_k <= 0 || r_begin >= rows_total) { /* uniform per cluster */
        pdl_wait(); /* a dependent's end implies its predecessors' (device.cuh) */
        return;
    }

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int wg = tid / kThreads, wtid = tid % kThreads, wwarp = warp % 4; /* warpgroup; its thread and warp */
    const int kvh = blockIdx.y, num_k = seg.num_k;
    const int state_vis = seg.state_keys > 0 ? min(seg.state_keys, num_k) : num_k;
    const int r_last = min(r_begin + kRows, rows_total) - 1;
    const int n_tiles = ((r_last < G ? state_vis : num_k) + kKeys - 1) / kKeys;
    const int my_tiles = rank < n_tiles ? (n_tiles - 1 - rank) / split + 1 : 0; /* key tiles rank, rank + split, ... */

    /* Shared memory: Q, then the ring's slots (K, then V), 1024-byte aligned for the swizzle; then the barriers. */
    const uint32_t raw = smem_addr(attn_smem), q_tile = (raw + 1023) & ~1023u, ring = q_tile + kTileBytes;
    /* the barriers in the alignment slack: before Q where it left room, else past the ring (then Q is at most 16 bytes
     * past raw, and the slack's other 1008 bytes follow the ring) */
    const uint32_t bars = q_tile - raw >= 8 * kStages ? q_tile - 8 * kStages : ring + kStages * 2 * kTileBytes;
    uint16_t *sQ = reinterpret_cast<uint16_t *>(attn_smem + (q_tile - raw));

    /* The first key of the block's i-th tile: tile rank + i split, or for a last tile that would run past num_k
     * the 64 keys that end at num_k (negative rows, before the tensor, arrive as zeros; all are masked). */
    auto tile_key0 = [&](int i) {
        const int key0 = (rank + i * split) * kKeys;
        return key0 + kKeys > num_k ? num_k - kKeys : key0;
    };
    auto load_tile = [&](int i) { /* one thread: 2 x HDS / 64 boxes of 64 keys x 64 dims, one barrier */
        const uint32_t dk = ring + (i % kStages) * 2 * kTileBytes, bar = bars + 8 * (i % kStages);
        const int y = seg.k_row + tile_key0(i);
        mbar_expect_bytes(bar, 2 * kTileBytes);
#pragma unroll
        for (int b = 0; b < HDS / 64; b++) { /* columns past HD are outside the map: they arrive as zeros */
            tma_load_3d(dk + b * kBlockBytes, &k_map, b * 64, kvh, y, bar);
            tma_load_3d(dk + kTileBytes + b * kBlockBytes, &v_map, b * 64, kvh, y, bar);
        }
    };
    /* Launched as a dependent (pi0_cuda_attention_ws), the tiles of keys before the segment's last num_q stream in
     * before the wait (attention.h); Q and the other keys are the previous kernel's output. */
    const int early_keys = num_k - seg.num_q;
    int issued = 0; /* thread 0's */
    if (tid == 0) {
        for (int i = 0; i < kStages; i++) mbar_init(bars + 8 * i, 1);
        mbar_init_fence();
        for (; issued < kStages && issued < my_tiles && tile_key0(issued) >= 0 && tile_key0(issued) + kKeys <= early_keys;
             issued++)
            load_tile(issued);
    }
    if constexpr (HDS > HD) /* Q's columns past HD: zeros, which the copies never write */
        for (int i = tid; i < kRows * (HDS / 8 - chunks); i += kWgThreads) {
            const int r = i % kRows, c = chunks + i / kRows;
            *reinterpret_cast<uint4 *>(sQ + tile_at<true>(r, c, kRows * 64)) = make_uint4(0, 0, 0, 0);
        }
    pdl_wait();
    copy_q_rows<true>(sQ, kRows * 64, p.q + (size_t)seg.q_row * p.ldq + (size_t)kvh * G * HD, p.ldq, HD, G, r_begin,
                      kRows, rows_total, chunks, tid, kWgThreads, p.vec_q != 0);
    cp_async_commit();
    __syncthreads(); /* the barriers are initialized before a thread waits on one */
    if (tid == 0)
        for (int i = issued; i < kStages && i < my_tiles; i++) load_tile(i);
    cp_async_wait_all(); /* this thread's Q copies landed, */
    fence_proxy_async(); /* visible to the products, */
    __syncthreads();     /* and every thread's */

    const uint64_t q_desc = wg_desc(q_tile, 16, 1024);
    const int quad_row = lane >> 2, quad_col = lane & 3;
    const int vr0 = r_begin + wwarp * 16 + quad_row, vr1 = vr0 + 8;
    const int vis0 = vr0 < G ? state_vis : num_k, vis1 = vr1 < G ? state_vis : num_k;

    float o[C::NTO][4];
#pragma unroll
    for (int t = 0; t < C::NTO; t++) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int i = wg; i < my_tiles; i += 2) {
        const int s_i = i % kStages;
        const uint32_t slot = ring + s_i * 2 * kTileBytes;
        if (i >= kStages) named_sync(1 + s_i, kWgThreads); /* the other warpgroup is done with tile i - 3, issued i */
        mbar_wait(bars + 8 * s_i, (i / kStages) & 1);       /* the slot's copies landed */
        const int key0 = tile_key0(i);
        if (key0 < 0) { /* a segment of under 64 keys (one tile, warpgroup 0's); rows before it may hold anything */
            uint16_t *v_tile = reinterpret_cast<uint16_t *>(attn_smem + (slot + kTileBytes - raw));
            for (int e = wtid; e < -key0 * chunks; e += kThreads) /* their V rows weigh 0, and 0 x NaN is NaN */
                *reinterpret_cast<uint4 *>(v_tile + tile_at<true>(e / chunks, e % chunks, kRows * 64)) = make_uint4(0, 0, 0, 0);
            fence_proxy_async();           /* the zeros visible to the products, */
            named_sync(4 + wg, kThreads);  /* the warpgroup's */
        }
        /* every warp runs the products (rows past the segment are zeros), so no warp-uniform skip here */
        float s[kKeys / 8][4];
        wg_scores<HD>(s, q_desc, wg_desc(slot, 16, 1024));
        softmax_tile(s, o, m0, m1, l0, l1, key0, (rank + i * split) * kKeys, vis0, vis1, quad_col, p.scale_log2, i == wg);
        wg_accumulate_pv<HD>(o, s, wg_desc(slot + kTileBytes, kBlockBytes, 1024));
        if (i + kStages < my_tiles) {
            named_sync(4 + wg, kThreads); /* every warp of the warpgroup is done with the slot */
            if (wtid == 0) load_tile(i + kStages);
            named_arrive(1 + s_i, kWgThreads);
        }
    }

    /* Warpgroup 1's partial results into warpgroup 0's, through the ring's second slot (past what finish_block
     * stages, from sQ on, and what a split's merge receives, from the start of shared memory). A thread's fragments
     * are the same rows and columns in both warpgroups. */
    float4 *part = reinterpret_cast<float4 *>(attn_smem + (ring + 2 * kTileBytes - raw));
    __syncthreads(); /* every product is done with every slot */
    if (wg == 1) {
#pragma unroll
        for (int t = 0; t < C::NTO; t++) part[t * kThreads + wtid] = make_float4(o[t][0], o[t][1], o[t][2], o[t][3]);
        part[C::NTO * kThreads + wtid] = make_float4(m0, m1, l0, l1);
    }
    __syncthreads();
    if (wg == 0) {
        const float4 ml = part[C::NTO * kThreads + wtid];
        const float M0 = fmaxf(m0, ml.x), M1 = fmaxf(m1, ml.y);
        /* a row that neither warpgroup saw a key of keeps -inf maxima and zero sums: factors exp2(-inf) = 0 */
        const float base0 = M0 == -INFINITY ? 0.f : M0, base1 = M1 == -INFINITY ? 0.f : M1;
        rescale_running(o, l0, l1, m0, m1, base0, base1); /* this warpgroup's O and l to the common max */
        const float b0 = exp2f(ml.x - base0), b1 = exp2f(ml.y - base1);
#pragma unroll
        for (int t = 0; t < C::NTO; t++) { /* plus the other's, rescaled likewise */
            const float4 x = part[t * kThreads + wtid];
            o[t][0] += x.x * b0;
            o[t][1] += x.y * b0;
            o[t][2] += x.z * b1;
            o[t][3] += x.w * b1;
        }
        l0 += ml.z * b0, l1 += ml.w * b1;
        m0 = M0, m1 = M1;
    }

    /* every warp of the block calls it (a split's merge has block and cluster barriers); warpgroup 0's hold the rows */
    finish_block<HD>(o, m0, m1, l0, l1, warp, lane, rank, split, r_begin, rows_total, G, HD, chunks,
                     p.out + (size_t)seg.q_row * p.ldo + (size_t)kvh * G * HD, p.ldo, p.vec_o != 0,
                     sQ + wwarp * 16 * C::LDS, wg == 0);
#else
    (void)p, (void)k_map, (void)v_map;
    __trap(); /* the host launches this kernel only where it is built for sm_90a */
#endif
}

/* The kernel that runs a launch<HD, PADDED, WG, KEYS>, its threads and its shared memory. */
template <int HD, bool PADDED, bool WG, int KEYS>
const void *tiled_kernel() {
    if constexpr (WG) return reinterpret_cast<const void *>(attention_wg_kernel<HD>);
    else return reinterpret_cast<const void *>(attention_kernel<HD, PADDED, KEYS>);
}

template <bool WG>
constexpr int tiled_threads() {
    return WG ? kWgThreads : kThreads;
}

template <int HD, bool WG, int KEYS>
constexpr size_t tiled_smem() {
    if constexpr (WG) return WgConfig<HD>::SMEM;
    else return tiles_smem<HD, KEYS>();
}

/*
 * A tensor map of K or V for the wgmma kernel's copies: (column, head, row) over num_kv_heads heads of head_dim columns
 * in rows of ldkv bf16 (row = key), boxes of 64 columns of one head x 64 keys in the 128-byte swizzle. A head dim that
 * is not a multiple of 64 (the ViT's 72) ends inside a box: the columns past it are outside the map, and the copies
 * fill them with zeros. The number of rows is not known here (the segments live in device memory); the kernel never
 * asks for a row past a segment's last key, so the map's extent is only a bound: every row a coordinate (an int) can
 * name. False where the driver has no tensor maps or refuses this one (the caller then takes the mma.sync kernel).
 */
bool kv_tensor_map(CUtensorMap *map, const void *base, int ldkv, int head_dim, int num_kv_heads) {
    PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (!encode) return false;
    const cuuint64_t dims[3] = {(cuuint64_t)head_dim, (cuuint64_t)num_kv_heads, (cuuint64_t)INT32_MAX};
    const cuuint64_t strides[2] = {(cuuint64_t)head_dim * 2, (cuuint64_t)ldkv * 2};
    const cuuint32_t box[3] = {64, 1, kKeys}, elem_strides[3] = {1, 1, 1};
    return encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void *>(base), dims, strides, box, elem_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/* A launch of `grid` as clusters of `split` blocks along x (the key split); `attr` must outlive the config. */
template <int HD, bool WG, int KEYS>
cudaLaunchConfig_t cluster_config(dim3 grid, int split, cudaStream_t stream, cudaLaunchAttribute *attr) {
    attr->id = cudaLaunchAttributeClusterDimension;
    attr->val.clusterDim.x = (unsigned)split;
    attr->val.clusterDim.y = 1;
    attr->val.clusterDim.z = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(tiled_threads<WG>(), 1, 1);
    cfg.dynamicSmemBytes = tiled_smem<HD, WG, KEYS>();
    cfg.stream = stream;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cfg;
}

/* Per device and instantiation: the dynamic shared-memory limit raised, and what the split needs. */
struct DeviceInfo {
    int ready;
    int sms;           /* multiprocessors */
    int blocks_per_sm; /* resident blocks of this kernel per multiprocessor */
    int max_split;     /* largest cluster of this kernel the device can run (1 before sm_90) */
};

int g_split_override; /* pi0_cuda_attention_set_split */

template <int HD, bool PADDED, bool WG, int KEYS>
cudaError_t configure(DeviceInfo *out) {
    static DeviceInfo info[kMaxDevices];
    int dev = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const bool cached = dev >= 0 && dev < kMaxDevices;
    if (cached && __atomic_load_n(&info[dev].ready, __ATOMIC_ACQUIRE)) {
        *out = info[dev];
        return cudaSuccess;
    }
    DeviceInfo d = {1, 1, 1, 1};
    int major = 0;
    if ((e = cudaFuncSetAttribute(tiled_kernel<HD, PADDED, WG, KEYS>(), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  (int)tiled_smem<HD, WG, KEYS>())) != cudaSuccess ||
        (e = cudaFuncSetAttribute(tiled_kernel<HD, PADDED, WG, KEYS>(), cudaFuncAttributePreferredSharedMemoryCarveout,
                                  (int)cudaSharedmemCarveoutMaxShared)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&d.sms, cudaDevAttrMultiProcessorCount, dev)) != cudaSuccess ||
        (e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev)) != cudaSuccess ||
        (e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&d.blocks_per_sm, tiled_kernel<HD, PADDED, WG, KEYS>(), tiled_threads<WG>(),
                                                           tiled_smem<HD, WG, KEYS>())) != cudaSuccess)
        return e;
    if (d.blocks_per_sm < 1) d.blocks_per_sm = 1;
    if (major >= 9) {
        /* clusters of 16 are "non-portable": allowed on H100/H200 once asked for; the occupancy query below
         * says whether the device can actually run them (else the next size down) */
        if (cudaFuncSetAttribute(tiled_kernel<HD, PADDED, WG, KEYS>(), cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess)
            (void)cudaGetLastError();
        for (int split = kMaxSplit; split > 1; split /= 2) {
            cudaLaunchAttribute attr;
            cudaLaunchConfig_t cfg = cluster_config<HD, WG, KEYS>(dim3((unsigned)split, 1, 1), split, 0, &attr);
            int clusters = 0;
            e = cudaOccupancyMaxActiveClusters(&clusters, tiled_kernel<HD, PADDED, WG, KEYS>(), &cfg);
            if (e != cudaSuccess) {
                (void)cudaGetLastError(); /* not fatal: no split */
                continue;
            }
            if (clusters >= 1) {
                d.max_split = split;
                break;
            }
        }
    }
    if (cached) {
        info[dev].sms = d.sms;
        info[dev].blocks_per_sm = d.blocks_per_sm;
        info[dev].max_split = d.max_split;
        __atomic_store_n(&info[dev].ready, 1, __ATOMIC_RELEASE);
    }
    *out = d;
    return cudaSuccess;
}

/* Blocks per row tile. A split costs a merge and a second load of Q per block, and pays only when a
 * block would otherwise walk many tiles on a mostly idle GPU. Measured on H200 (us, no split -> split):
 * batch-1 denoise (11 q x 799 k, 2 blocks) 53 -> 17 with 8; batch-8 denoise (51 q, 56 blocks) 58 ->
 * 35 with 4; batch-1 prefix (788 tokens, 99 blocks) 56 -> 50.5 with 2; but a 3-image ViT call (192
 * blocks of 4 tiles each) 12.4 -> 14.8 with 2, and on an H100 the 2-image ViT (128 blocks) took 1.78 ms
 * for its 27 layers unsplit against 2.14 with the split of 4 this rule used to pick. The host does not
 * know num_k (it lives in device memory), so the rule uses the head dim as the hint: Gemma (256)
 * attends over hundreds of keys and splits when the grid is under half a wave (doubling while the grid
 * still fits in one wave); smaller head dims (the ViT's 256 keys, the test models) never split. A block of the
 * Hopper kernel (`consumers` 2) walks two tiles at a time, so its split is half that: at H = 50 (7 row tiles, ~10
 * key tiles) 16 took 12.5 us, 8 11.5, 4 12.3 (the one-warpgroup kernel: 11.8 at 16). */
int choose_split(const DeviceInfo &d, long long base_blocks, int head_dim, int consumers) {
    static int env_cap = -1; /* PI0_ATTN_SPLIT=n: the automatic choice goes no higher than n (A/B runs) */
    if (env_cap < 0) {
        const char *env = getenv("PI0_ATTN_SPLIT");
        env_cap = env && atoi(env) > 0 ? atoi(env) : kMaxSplit;
    }
    int split = 1;
    if (g_split_override > 0) {
        while (split * 2 <= g_split_override && split * 2 <= d.max_split) split *= 2;
        return split;
    }
    const long long capacity = (long long)d.sms * d.blocks_per_sm;
    if (head_dim < 256 || base_blocks * 2 > capacity) return 1;
    while (split * 2 <= d.max_split && split * 2 <= env_cap && base_blocks * split * 2 <= capacity) split *= 2;
    return split > 1 ? split / consumers : split;
}

template <int HD, bool PADDED, bool WG, int KEYS = kKeys>
cudaError_t launch(const AttnParams &base, int num_segments, int row_tiles, int num_kv_heads, bool dependent,
                   cudaStream_t stream) {
    DeviceInfo d;
    cudaError_t e = configure<HD, PADDED, WG, KEYS>(&d);
    if (e != cudaSuccess) return e;
    const int kMaxZ = 65535;
    const int split =
        choose_split(d, (long long)row_tiles * num_kv_heads * (num_segments < kMaxZ ? num_segments : kMaxZ), HD,
                     tiled_threads<WG>() / kThreads);
    if ((long long)row_tiles * split > 0x7fffffffLL) return cudaErrorInvalidValue;
    CUtensorMap k_map, v_map; /* the wgmma kernel's tensor copies of K and V */
    if constexpr (WG)
        if (!kv_tensor_map(&k_map, base.k, base.ldkv, base.head_dim, num_kv_heads) ||
            !kv_tensor_map(&v_map, base.v, base.ldkv, base.head_dim, num_kv_heads))
            return cudaErrorNotSupported;
    for (int first = 0; first < num_segments; first += kMaxZ) {
        AttnParams p = base;
        p.segments = base.segments + first;
        p.split = split;
        const int n = num_segments - first < kMaxZ ? num_segments - first : kMaxZ;
        dim3 grid((unsigned)(row_tiles * split), (unsigned)num_kv_heads, (unsigned)n);
        cudaLaunchAttribute attrs[2];
        cudaLaunchConfig_t cfg = cluster_config<HD, WG, KEYS>(grid, split, stream, attrs);
        if (split == 1) cfg.numAttrs = 0; /* no cluster */
        if (dependent && first == 0) make_dependent(&cfg, attrs); /* after the kernel that wrote Q (attention.h) */
        if constexpr (WG) e = cudaLaunchKernelEx(&cfg, attention_wg_kernel<HD>, p, k_map, v_map);
        else e = cudaLaunchKernelEx(&cfg, attention_kernel<HD, PADDED, KEYS>, p);
        if (e != cudaSuccess) return e;
    }
    return cudaSuccess;
}

/* Whether head dims 256 and 72 take the wgmma kernel on the current device: an sm_90a device (hopper.cuh), unless
 * PI0_ATTN_WGMMA=0 (A/B runs). */
bool use_wgmma(void) { return sm90a_device() && !switched_off("PI0_ATTN_WGMMA"); }

/* Head dim 72 (the ViT). On an H100/H200 (use_wgmma) the wgmma kernel while its grid fits the GPU in one wave (two
 * blocks an SM: 1-4 images; vision 1.60 -> 1.56 ms at 2 on an H100, 1.95 -> 1.93 at 3, bench/NOTES.md session 25).
 * Elsewhere, and past that, the mma.sync kernel: the 256-key tile while the grid fits in one wave (two blocks an SM,
 * where a block's chain of tiles is the time; 9.8 -> 8.2 us a layer at 2), the 64-key tiles beyond (batches, where
 * four blocks an SM keep more warps busy: the 256-key tile took vision +2-4% at 8-128 images). */
cudaError_t launch_vit(const AttnParams &p, int num_segments, int row_tiles, int num_kv_heads, bool dependent,
                       cudaStream_t stream) {
    const long long blocks = (long long)row_tiles * num_kv_heads * num_segments;
    DeviceInfo d;
    cudaError_t e;
    if (use_wgmma() && p.vec_kv) { /* the tensor copies need 16-byte aligned rows */
        if ((e = configure<72, false, true, kKeys>(&d)) != cudaSuccess) return e;
        if (blocks <= (long long)d.sms * d.blocks_per_sm) {
            e = launch<72, false, true>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
            if (e != cudaErrorNotSupported) return e; /* not supported: no tensor maps in this driver */
        }
    }
    if ((e = configure<72, false, false, 256>(&d)) != cudaSuccess) return e;
    if (blocks <= (long long)d.sms * d.blocks_per_sm)
        return launch<72, false, false, 256>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
    return launch<72, false, false>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
}

bool aligned16(const void *ptr, int ld) { return ((uintptr_t)ptr % 16) == 0 && ld % 8 == 0; }

/*
 * Few queries against many keys (a small-batch denoise step: 11 tokens x 8 heads = 88 virtual rows over ~540 keys).
 * The tiled kernel above pays for this shape with a long chain per block (a 64-key tile is ~256 dependent mma.sync
 * per warp, ~3.7 us on an H100) and a cluster merge (~5 us). Here the keys are spread thin instead: P blocks per
 * (kv head, segment, row group) (P = kDecodeBlocks, or kDecodeBlocksShort where the caller's key bound allows),
 * block b taking the 32-key chunks b, b + P, ...; each of its warps holds one 16-row tile of its group's virtual
 * rows (a segment has up to kDecodeRows), so a chunk of K and V is loaded once for the group's rows and a warp's
 * chain per chunk is a quarter of a tile's. Row groups (launch_decode) split a small batch's rows over more blocks:
 * each block then copies less of Q and stores fewer partial rows, the two largest transfers of a block (at 11
 * tokens: Q 45 KB and partials 90 KB a block for one group, against 32 KB of K and V; a block of 256 threads moves
 * ~40-60 GB/s to or from L2, bench/NOTES.md session 13). Each block writes its unnormalized partial (O, max, sum)
 * per row to a float32 workspace; a second kernel merges the partials of a row in block order (deterministic) and
 * writes bf16. Numerics are the tiled kernel's (log2-domain softmax, P rounded to bf16 for P V).
 */
constexpr int kDecodeKeys = 32;     /* keys per chunk */
constexpr int kDecodeBlocks = 32;   /* blocks per (kv head, segment): the workspace's parts */
/* Fewer blocks where the caller's key bound allows (up to 640 keys: Pi0's seed workload has 543, Pi0.5 at a 60-token
 * prompt 582): the merge walks 20 parts instead of 32, and 20 blocks a group make room for one 16-row tile a block.
 * Attention 5.95 -> 5.27 us in the lab, denoise -0.03 to -0.05 ms on an H100 (bench/NOTES.md, session 33); past the
 * bound (three cameras: 799 keys) blocks would take two chunks, +0.13 ms, so the larger calls keep 32. */
constexpr int kDecodeBlocksShort = 20;
constexpr int kDecodeRows = 128;    /* virtual rows per segment at most: 8 warps x 16 */
constexpr int kDecodeThreads = 256;
constexpr int kDecodeProblems = 16; /* segments x kv heads at most (beyond, the tiled kernel fills the GPU) */

template <int HD>
struct DecodeConfig {
    using C = AttnConfig<HD>;
    static constexpr size_t SMEM = (size_t)(kDecodeRows + 2 * kDecodeKeys) * C::LDS * sizeof(uint16_t);
    static constexpr size_t PART_ROWS = (size_t)kDecodeBlocks * kDecodeRows; /* per (segment, kv head) */
};

/* The HD of the instantiation that runs a call's head_dim (a multiple of 8 up to 256): Pi0's own 72
 * (SigLIP) and 256 (Gemma) exactly; any other padded (PADDED) to the next of 64, 128 and 256, paying for
 * the zero columns' share of the math (see the design note). */
int kernel_head_dim(int head_dim) { return head_dim == 72 ? 72 : head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256; }

/* Workspace: O partials [problem][block][row][HD] floats, then (max, sum) [problem][block][row]. */
size_t decode_workspace_bytes(int problems, int head_dim) {
    return (size_t)problems * kDecodeBlocks * kDecodeRows * ((size_t)kernel_head_dim(head_dim) + 2) * sizeof(float);
}

template <int HD, bool PADDED, int PARTS>
__global__ void __launch_bounds__(kDecodeThreads) decode_partial_kernel(AttnParams p, float *ws) {
    using C = AttnConfig<HD>;
    const int hd = PADDED ? p.head_dim : HD, chunks = hd / 8; /* as in attention_kernel */
    pdl_trigger(); /* launched as a dependent (device.cuh) */
    /* The segments are the graph's inputs, copied in before any kernel ran: readable before pdl_wait. */
    const attn_segment seg = p.segments[blockIdx.z];
    const int G = p.group, rows_total = seg.num_q * G, num_k = seg.num_k;
    const int n_chunks = (num_k + kDecodeKeys - 1) / kDecodeKeys;
    const int kvh = blockIdx.y, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    /* block (b, group): key chunks b, b + PARTS, ... for the group's row tiles (decode_tiles of them) */
    const int b = (int)blockIdx.x % PARTS, group = (int)blockIdx.x / PARTS;
    const int state_vis = seg.state_keys > 0 ? min(seg.state_keys, num_k) : num_k;
    uint16_t *sQ = reinterpret_cast<uint16_t *>(attn_smem);
    uint16_t *sK = sQ + kDecodeRows * C::LDS;
    uint16_t *sV = sK + kDecodeKeys * C::LDS;
    const uint16_t *qbase = p.q + (size_t)seg.q_row * p.ldq + (size_t)kvh * G * hd;
    const uint16_t *kbase = p.k + (size_t)seg.k_row * p.ldkv + (size_t)kvh * hd;
    const uint16_t *vbase = p.v + (size_t)seg.k_row * p.ldkv + (size_t)kvh * hd;
    const bool vec_q = p.vec_q != 0, vec_kv = p.vec_kv != 0;
    const int tile0 = group * p.decode_tiles, row_tiles = min((rows_total + 15) / 16 - tile0, p.decode_tiles);
    const int r_begin = tile0 * 16; /* the group's first virtual row */

    auto load_kv = [&](int key0) {
        for (int i = tid; i < 2 * kDecodeKeys * chunks; i += kDecodeThreads) {
            const int which = i / (kDecodeKeys * chunks), j = i % (kDecodeKeys * chunks);
            const int r = j / chunks, c = j % chunks, key = key0 + r;
            const bool valid = key < num_k;
            copy_chunk((which ? sV : sK) + r * C::LDS + c * 8,
                       (which ? vbase : kbase) + (size_t)(valid ? key : 0) * p.ldkv + c * 8, valid, vec_kv);
        }
        cp_async_commit();
    };
    /* The keys before the segment's own queries' (a denoise step's prefix, attention.h) were written before
     * the kernels this one depends on, so the block's first chunk of them streams in from DRAM while the
     * previous kernel (the QKV that writes the rest) finishes: one round trip off the step's chain. */
    const int early_keys = num_k - seg.num_q;
    const bool has_chunk = seg.num_q > 0 && num_k > 0 && b < n_chunks && row_tiles > 0; /* block-uniform */
    const bool preloaded = has_chunk && (b + 1) * kDecodeKeys <= early_keys;
    if (preloaded) load_kv(b * kDecodeKeys);
    pdl_wait(); /* Q and the segment's last num_q keys are the previous kernel's output */
    if (!has_chunk) return;

    if (PADDED || C::HDP > HD) zero_pad_columns<HD>(sQ, kDecodeRows + 2 * kDecodeKeys, chunks, tid, kDecodeThreads);
    copy_q_rows<false>(sQ, C::LDS, qbase, p.ldq, hd, G, r_begin, row_tiles * 16, rows_total, chunks, tid, kDecodeThreads,
                       vec_q);
    cp_async_commit();

    const int lrow = lane & 7, lsel1 = (lane >> 3) & 1, lsel2 = lane >> 4;
    const uint32_t q_addr = smem_addr(sQ + (warp * 16 + lrow + lsel1 * 8) * C::LDS + lsel2 * 8);
    const uint32_t k_addr = smem_addr(sK + (lrow + lsel2 * 8) * C::LDS + lsel1 * 8);
    const uint32_t v_addr = smem_addr(sV + (lrow + lsel1 * 8) * C::LDS + lsel2 * 8);
    const int quad_row = lane >> 2, quad_col = lane & 3;
    const int vr0 = r_begin + warp * 16 + quad_row, vr1 = vr0 + 8;
    const int vis0 = vr0 < G ? state_vis : num_k, vis1 = vr1 < G ? state_vis : num_k;
    const bool warp_active = warp < row_tiles; /* warp-uniform */

    float o[C::NTO][4];
#pragma unroll
    for (int t = 0; t < C::NTO; t++) o[t][0] = o[t][1] = o[t][2] = o[t][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

    for (int chunk = b; chunk < n_chunks; chunk += PARTS) {
        const int key0 = chunk * kDecodeKeys;
        if (!(preloaded && chunk == b)) load_kv(key0);
        cp_async_wait_all(); /* K, V (and Q, first time) landed for this thread ... */
        __syncthreads();     /* ... and for every thread */
        if (warp_active) {
            float s[4][4];
            compute_scores<HD, kDecodeKeys>(s, q_addr, k_addr);
            float mx0 = m0, mx1 = m1;
            mask_scores(s, key0, quad_col, vis0, vis1, p.scale_log2, mx0, mx1);
            /* rows with every key so far masked keep mx = -inf: exp2(-inf - 0) = 0, no NaN */
            const float base0 = mx0 == -INFINITY ? 0.f : mx0, base1 = mx1 == -INFINITY ? 0.f : mx1;
            /* O and l are still 0 on the block's first chunk (the only one at ~540 keys) */
            if (chunk != b) rescale_running(o, l0, l1, m0, m1, base0, base1);
            m0 = mx0, m1 = mx1;
            exp_scores(s, base0, base1, l0, l1);
            accumulate_pv<HD, kDecodeKeys>(o, s, v_addr);
        }
        __syncthreads(); /* every warp is done with this chunk's K and V */
    }
    if (!warp_active) return;
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const size_t problem = (size_t)blockIdx.z * gridDim.y + kvh;
    const size_t part = (problem * kDecodeBlocks + b) * kDecodeRows;
    float *wo = ws + part * HD;
    float2 *wml = reinterpret_cast<float2 *>(ws + (size_t)gridDim.z * gridDim.y * DecodeConfig<HD>::PART_ROWS * HD) + part;
#pragma unroll
    for (int t = 0; t < C::NTO; t++) {
        if (vr0 < rows_total) *reinterpret_cast<float2 *>(wo + (size_t)vr0 * HD + t * 8 + quad_col * 2) = make_float2(o[t][0], o[t][1]);
        if (vr1 < rows_total) *reinterpret_cast<float2 *>(wo + (size_t)vr1 * HD + t * 8 + quad_col * 2) = make_float2(o[t][2], o[t][3]);
    }
    if (quad_col == 0) {
        if (vr0 < rows_total) wml[vr0] = make_float2(m0, l0);
        if (vr1 < rows_total) wml[vr1] = make_float2(m1, l1);
    }
}

/* One block per virtual row, one thread per output dim: merges the row's partials of every block that had keys, in
 * block order. Each thread issues its loads of the partials at once; every warp computes the weights itself (lane b
 * from part b's max and sum: the same arithmetic, the same values in every warp) and its lanes take them by shuffle,
 * so one round trip to L2 follows the wait and no barrier does. */
template <int HD, bool PADDED, int PARTS>
__global__ void __launch_bounds__(kDecodeThreads) decode_combine_kernel(AttnParams p, const float *ws) {
    static_assert(HD <= kDecodeThreads, "one thread per output dim");
    pdl_trigger();
    const attn_segment seg = p.segments[blockIdx.z]; /* the graph's input: readable before the wait */
    const int G = p.group, rows_total = seg.num_q * G, num_k = seg.num_k, row = blockIdx.x;
    const int t = row / G, hh = row - t * G; /* the row's token and head */
    pdl_wait();
    if (seg.num_q <= 0 || num_k <= 0 || row >= rows_total) return; /* block-uniform */
    const int n_chunks = (num_k + kDecodeKeys - 1) / kDecodeKeys, parts = min(n_chunks, PARTS);
    const size_t problem = (size_t)blockIdx.z * gridDim.y + blockIdx.y;
    const float *wo = ws + problem * DecodeConfig<HD>::PART_ROWS * HD;
    const float2 *wml = reinterpret_cast<const float2 *>(ws + (size_t)gridDim.z * gridDim.y * DecodeConfig<HD>::PART_ROWS * HD) +
                        problem * DecodeConfig<HD>::PART_ROWS;
    const int hd = PADDED ? p.head_dim : HD, d = threadIdx.x, lane = threadIdx.x & 31;
    float part[PARTS]; /* this dim of every part's O (finite; 0 past the parts) */
#pragma unroll
    for (int b = 0; b < PARTS; b++) part[b] = b < parts && d < hd ? wo[((size_t)b * kDecodeRows + row) * HD + d] : 0.f;
    /* lane b: part b's (max, sum); a part that saw no key of this row has sum 0 and weighs 0 */
    const float2 ml = lane < parts ? wml[(size_t)lane * kDecodeRows + row] : make_float2(-INFINITY, 0.f);
    float M = ml.y > 0.f ? ml.x : -INFINITY;
    for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
    const float w = ml.y > 0.f ? exp2f(ml.x - M) : 0.f;
    float L = ml.y * w;
    for (int off = 16; off; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
    float acc = 0.f;
#pragma unroll
    for (int b = 0; b < PARTS; b++) {
        const float wb = __shfl_sync(0xffffffffu, w, b); /* 0 past the parts */
        if (b < parts) acc += part[b] * wb;              /* in block order, as before: the same sums */
    }
    if (d >= hd) return;
    uint16_t *dst = p.out + ((size_t)seg.q_row + t) * p.ldo + ((size_t)blockIdx.y * G + hh) * hd;
    dst[d] = __bfloat16_as_ushort(__float2bfloat16(acc * (1.f / L))); /* every row sees key 0: some part has sum > 0 */
}

template <int HD, bool PADDED, int PARTS>
cudaError_t launch_decode_parts(const AttnParams &p, int num_segments, int num_kv_heads, int max_rows, float *ws,
                                int max_sms, cudaStream_t stream) {
    static int multiprocessors[kMaxDevices]; /* per device, once configured (0: not yet) */
    int dev = 0, sms = 0;
    cudaError_t e = cudaGetDevice(&dev);
    if (e != cudaSuccess) return e;
    const bool cached = dev >= 0 && dev < kMaxDevices;
    if (cached) sms = __atomic_load_n(&multiprocessors[dev], __ATOMIC_ACQUIRE);
    if (!sms) {
        e = cudaFuncSetAttribute(decode_partial_kernel<HD, PADDED, PARTS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 (int)DecodeConfig<HD>::SMEM);
        if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
        if (e != cudaSuccess) return e;
        if (cached) __atomic_store_n(&multiprocessors[dev], sms, __ATOMIC_RELEASE);
    }
    /* Row groups: as many as keep every partial block (PARTS per problem and group, counting all as holding keys) in
     * one wave at one block a multiprocessor (at head dim 256 a block takes the register file) of the max_sms the
     * caller leaves them, so that a small batch's blocks each copy a share of Q and store a share of the partials. */
    const int problems = num_segments * num_kv_heads, row_tiles = (max_rows + 15) / 16;
    int groups = (max_sms > 0 && max_sms < sms ? max_sms : sms) / (problems * PARTS);
    groups = groups < 1 ? 1 : groups > row_tiles ? row_tiles : groups;
    AttnParams q = p;
    q.decode_tiles = (row_tiles + groups - 1) / groups;
    groups = (row_tiles + q.decode_tiles - 1) / q.decode_tiles; /* none empty */
    cudaLaunchAttribute attr;
    const dim3 partial_grid((unsigned)(PARTS * groups), (unsigned)num_kv_heads, (unsigned)num_segments);
    cudaLaunchConfig_t cfg = dependent_launch(partial_grid, dim3(kDecodeThreads), DecodeConfig<HD>::SMEM, stream, &attr);
    if ((e = cudaLaunchKernelEx(&cfg, decode_partial_kernel<HD, PADDED, PARTS>, q, ws)) != cudaSuccess) return e;
    const dim3 combine_grid((unsigned)max_rows, (unsigned)num_kv_heads, (unsigned)num_segments);
    cfg = dependent_launch(combine_grid, dim3(kDecodeThreads), 0, stream, &attr);
    return cudaLaunchKernelEx(&cfg, decode_combine_kernel<HD, PADDED, PARTS>, p, (const float *)ws);
}

/* The expert's head dim (256) takes kDecodeBlocksShort blocks when every segment has at most max_num_k keys (0:
 * unknown); the other dims, which no model runs here at batch 1, keep kDecodeBlocks. The bound only chooses the
 * split: with more keys than it says, blocks walk more chunks and the result is the same. */
template <int HD, bool PADDED>
cudaError_t launch_decode(const AttnParams &p, int num_segments, int num_kv_heads, int max_rows, int max_num_k,
                          float *ws, int max_sms, cudaStream_t stream) {
    if constexpr (HD == 256 && !PADDED)
        if (max_num_k > 0 && max_num_k <= kDecodeBlocksShort * kDecodeKeys)
            return launch_decode_parts<HD, PADDED, kDecodeBlocksShort>(p, num_segments, num_kv_heads, max_rows, ws,
                                                                       max_sms, stream);
    return launch_decode_parts<HD, PADDED, kDecodeBlocks>(p, num_segments, num_kv_heads, max_rows, ws, max_sms, stream);
}


/* Whether a call takes the few-queries kernels: a workspace big enough, no forced split, few rows
 * and few (segment, kv head) problems; PI0_ATTN_DECODE=0 in the environment turns it off (A/B). */
bool use_decode(int num_segments, int num_kv_heads, long long rows, int head_dim, size_t workspace_bytes) {
    static int env_off = -1;
    if (env_off < 0) env_off = switched_off("PI0_ATTN_DECODE");
    const long long problems = (long long)num_segments * num_kv_heads;
    return !env_off && g_split_override == 0 && rows <= kDecodeRows && problems <= kDecodeProblems &&
           workspace_bytes >= decode_workspace_bytes((int)problems, head_dim);
}

} /* namespace */

extern "C" void pi0_cuda_attention_set_split(int split) { g_split_override = split > 0 ? split : 0; }

extern "C" size_t pi0_cuda_attention_workspace(int num_segments, int num_kv_heads, int head_dim) {
    if (num_segments <= 0 || num_kv_heads <= 0 || (long long)num_segments * num_kv_heads > kDecodeProblems) return 0;
    return decode_workspace_bytes(num_segments * num_kv_heads, head_dim);
}

/* Both entry points: `dependent` launches every kernel as a programmatic dependent (pi0_cuda_attention_ws). */
static cudaError_t attention(pi0_bf16 *out, int ldo, const pi0_bf16 *q, int ldq, const pi0_bf16 *k, const pi0_bf16 *v,
                             int ldkv, const attn_segment *segments, int num_segments, int max_num_q, int max_num_k,
                             int num_heads, int num_kv_heads, int head_dim, float scale, float *workspace,
                             size_t workspace_bytes, int max_sms, bool dependent, cudaStream_t stream) {
    if (head_dim <= 0 || head_dim % 8 || head_dim > PI0_CUDA_ATTN_MAX_HEAD_DIM) return cudaErrorInvalidValue;
    if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || num_kv_heads > 65535)
        return cudaErrorInvalidValue;
    if (num_segments < 0 || max_num_q < 0) return cudaErrorInvalidValue;
    if (num_segments == 0 || max_num_q == 0) return cudaSuccess;
    if (!out || !q || !k || !v || !segments) return cudaErrorInvalidValue;
    if ((long long)ldq < (long long)num_heads * head_dim || (long long)ldo < (long long)num_heads * head_dim ||
        (long long)ldkv < (long long)num_kv_heads * head_dim)
        return cudaErrorInvalidValue;
    if (((uintptr_t)out | (uintptr_t)q | (uintptr_t)k | (uintptr_t)v) % 2 != 0) return cudaErrorInvalidValue;
    const int group = num_heads / num_kv_heads;
    const long long rows = (long long)group * max_num_q;
    if (rows > 0x7fffffffLL - kRows) return cudaErrorInvalidValue;
    const int row_tiles = (int)((rows + kRows - 1) / kRows);

    AttnParams p;
    p.out = out;
    p.q = q;
    p.k = k;
    p.v = v;
    p.ldo = ldo;
    p.ldq = ldq;
    p.ldkv = ldkv;
    p.segments = segments;
    p.group = group;
    p.scale_log2 = scale * 1.4426950408889634f;
    p.vec_q = aligned16(q, ldq);
    p.vec_kv = aligned16(k, ldkv) && aligned16(v, ldkv);
    p.vec_o = aligned16(out, ldo);
    p.split = 1;
    p.head_dim = head_dim;
    p.decode_tiles = kDecodeRows / 16; /* launch_decode sets the row groups */
    /* kernel_head_dim: 72 and 256 exact, the rest padded */
    if (workspace && use_decode(num_segments, num_kv_heads, rows, head_dim, workspace_bytes)) {
        const int r = (int)rows;
        switch (kernel_head_dim(head_dim)) {
        case 64: return launch_decode<64, true>(p, num_segments, num_kv_heads, r, max_num_k, workspace, max_sms, stream);
        case 72: return launch_decode<72, false>(p, num_segments, num_kv_heads, r, max_num_k, workspace, max_sms, stream);
        case 128: return launch_decode<128, true>(p, num_segments, num_kv_heads, r, max_num_k, workspace, max_sms, stream);
        default:
            return head_dim == 256
                       ? launch_decode<256, false>(p, num_segments, num_kv_heads, r, max_num_k, workspace, max_sms, stream)
                       : launch_decode<256, true>(p, num_segments, num_kv_heads, r, max_num_k, workspace, max_sms, stream);
        }
    }
    switch (kernel_head_dim(head_dim)) {
    case 64: return launch<64, true, false>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
    case 72: return launch_vit(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
    case 128: return launch<128, true, false>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
    default:
        if (head_dim != 256) return launch<256, true, false>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
        if (use_wgmma() && p.vec_kv) { /* the tensor copies need 16-byte aligned rows */
            const cudaError_t e = launch<256, false, true>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
            if (e != cudaErrorNotSupported) return e; /* not supported: no tensor maps in this driver */
        }
        return launch<256, false, false>(p, num_segments, row_tiles, num_kv_heads, dependent, stream);
    }
}

extern "C" cudaError_t pi0_cuda_attention(pi0_bf16 *out, int ldo, const pi0_bf16 *q, int ldq, const pi0_bf16 *k,
                                          const pi0_bf16 *v, int ldkv, const attn_segment *segments,
                                          int num_segments, int max_num_q, int num_heads, int num_kv_heads,
                                          int head_dim, float scale, cudaStream_t stream) {
    return attention(out, ldo, q, ldq, k, v, ldkv, segments, num_segments, max_num_q, 0, num_heads, num_kv_heads,
                     head_dim, scale, NULL, 0, 0, false, stream);
}

extern "C" cudaError_t pi0_cuda_attention_ws(pi0_bf16 *out, int ldo, const pi0_bf16 *q, int ldq, const pi0_bf16 *k,
                                             const pi0_bf16 *v, int ldkv, const attn_segment *segments,
                                             int num_segments, int max_num_q, int max_num_k, int num_heads,
                                             int num_kv_heads, int head_dim, float scale, float *workspace,
                                             size_t workspace_bytes, int max_sms, cudaStream_t stream) {
    return attention(out, ldo, q, ldq, k, v, ldkv, segments, num_segments, max_num_q, max_num_k, num_heads, num_kv_heads,
                     head_dim, scale, workspace, workspace_bytes, max_sms, true, stream);
}
