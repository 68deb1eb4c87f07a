/*
 * skinny.cu - Linear layers over a few rows, with the norm and the epilogue fused (skinny.h).
 *
 * Why. A batch-1 denoise step multiplies 11 rows by ~34 MB of expert weights per layer: the work is
 * streaming the weights once, and the time goes to latency, so what matters is (1) every weight load
 * of a kernel issued before anything waits for one, (2) as few dependent steps as possible between
 * launch and the last store, (3) as few launches as possible. cuBLASLt picks split-K kernels with a
 * separate reduction here, and the norms and the GELU were kernels of their own: 8 launches per
 * expert layer, 4 with these kernels.
 *
 * Design. A block owns 8 * NT output columns of a 16-row tile (of two past 16 rows), and all of k: its warps split k
 * between them, each walking chunks of 32 k with mma.sync m16n8k16 (bf16 in, float32 accumulate).
 * Each lane loads 16 bytes (8 consecutive k) of its weight row and of its two x rows per chunk and
 * n8 tile; the k order inside a chunk is permuted identically for x and w (lane t's physical
 * k 8t..8t+3 feed the first mma's k slots 2t, 2t+1, 2t+8, 2t+9, and 8t+4..8t+7 the second's), so one
 * 16-byte load feeds two mma instructions with no shuffles and no shared memory. A pass issues the
 * loads of C chunks at once (C * (NT + 2) 16-byte loads per lane, all in flight together), then
 * multiplies (a second tile's x is loaded next and multiplied by the same weight fragments); k up to
 * warps * C * 32 is one pass, which covers every Pi0 shape. The warps' partial
 * tiles (and, with rms_norm, their partial sums of squares of x) meet in shared memory and are added
 * in warp order, so the result does not depend on timing. The epilogue then scales, applies
 * GELU x up or the residual add, and stores.
 *
 * RoPE (SKINNY_ROPE_QKV). Rotate-half pairs column i of a head with column i + head_dim / 2, so with
 * RoPE a block (NT = 2) does not own 16 contiguous columns: its first n8 tile takes columns
 * i0 .. i0 + 7 of one head's first half and its second tile the same columns of the second half; each
 * epilogue thread then holds both members of its pair and rotates the float32 result before rounding.
 *
 * The RMSNorm: the statistics come from the bf16 x the product uses, summed in float32 (a relative
 * difference of ~2^-9 / sqrt(k) from the float32 rows), and the factor is applied to the float32
 * accumulator, where openpi rounds the normalized row to bf16 before the product: the same number of
 * roundings, in another place.
 */
#include <cuda_bf16.h>
#include <stdint.h>

#include "cuda/device.cuh"
#include "cuda/skinny.h"
#include "util/switches.h"

namespace {

constexpr int kMaxWarps = 16;

struct SkinnyParams {
    int m, n, k;
    const uint16_t *x, *w;
    int rms_norm;
    float eps;
    const uint16_t *in_scale;
    const float *col_bias;
    int epilogue;
    uint16_t *out;
    float *out_f32;
    float *residual;
    uint16_t *residual_bf16;
    const float *gate;
    int heads, kv_heads, head_dim;
    const int *positions, *cache_rows;
    const float *rope_cos, *rope_sin;
    uint16_t *cache_k, *cache_v;
    int staged_passes; /* a warp's passes after the first whose weights wait in shared memory (staged_passes_for) */
};

/* Which loads issue before griddepcontrol.wait is ptxas's choice, not the source's. Weak loads keep their side of the
 * wait in the SASS (cuobjdump, session 23); non-coherent ones (ld.global.nc, `__ldg`) it moves across the wait either
 * way. Through session 22 both the weights and x were non-coherent: 0-5 of a pass's 4-8 weight loads issued before the
 * wait (the rest after it, so not in flight during the kernel before's tail), and x after it only by the scheduler's
 * choice (a build whose only change was a branch never taken gave wrong results). Both are weak loads now, and
 * tests/pdl_loads.sh keeps non-coherent loads out of every kernel that waits (bench/NOTES.md, session 23). */

/* Weights are read once per call: keep them out of L1. A lane's 16 bytes are a quarter of a 64-byte run of its weight
 * row, and the other half of that 128-byte line is the same lanes' next chunk, a separate load: .L2::128B has L2 fetch
 * the whole line on the first miss (QKV 4.24 -> 4.07 us, gate|up 7.13 -> 6.90, the layer 24.7 -> 24.35 in the lab;
 * .L2::256B 24.5; bench/NOTES.md, session 17). */
__device__ __forceinline__ uint4 load_stream(const uint16_t *p) {
    uint4 r;
    asm volatile("ld.global.L1::no_allocate.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

/* A later pass's 16 bytes of weights into shared memory (zeros where !valid), as load_stream asks L2 for them. Issued
 * before griddepcontrol.wait, behind the first pass's loads; the lane that copies them is the one that reads them. */
__device__ __forceinline__ void stage_stream(void *dst, const uint16_t *src, bool valid) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
                 "r"(valid ? 16 : 0)
                 : "memory");
}

/* x, the kernel before's output: a plain load (through L1, where the blocks of a multiprocessor share it). */
__device__ __forceinline__ uint4 load_x_chunk(const uint16_t *p) { return *reinterpret_cast<const uint4 *>(p); }

/* The bias of output column n (0 without one). */
__device__ __forceinline__ float col_bias(const SkinnyParams &p, int n) { return p.col_bias ? p.col_bias[n] : 0.f; }

/* What RoPE needs from memory for column pair i of row m: the rotation at the row's position and its cache row.
 * Constants of the step (the graph's inputs and tables), so a kernel may read them before griddepcontrol.wait. */
struct RopeAt {
    float c, s;
    int cache_row;
};

__device__ __forceinline__ RopeAt rope_at(const SkinnyParams &p, int m, int i) {
    const size_t at = (size_t)p.positions[m] * (p.head_dim / 2) + i;
    return {p.rope_cos[at], p.rope_sin[at], p.cache_rows[m]};
}

/* Rotates the pair (lo, hi) = columns (i, i + head_dim / 2) of `head` in row m by r and stores it: q to out,
 * k rotated and v as is to the row's cache row. */
__device__ __forceinline__ void store_rope(const SkinnyParams &p, int m, int head, int i, float lo, float hi, RopeAt r) {
    const int hd = p.head_dim, half = hd / 2, kv_dim = p.kv_heads * hd;
    uint16_t *dst;
    if (head < p.heads + p.kv_heads) {
        const float x1 = lo, x2 = hi;
        lo = x1 * r.c - x2 * r.s;
        hi = x2 * r.c + x1 * r.s;
        dst = head < p.heads ? p.out + (size_t)m * p.n + (size_t)head * hd
                             : p.cache_k + (size_t)r.cache_row * kv_dim + (size_t)(head - p.heads) * hd;
    } else {
        dst = p.cache_v + (size_t)r.cache_row * kv_dim + (size_t)(head - p.heads - p.kv_heads) * hd;
    }
    dst[i] = __bfloat16_as_ushort(__float2bfloat16(lo));
    dst[i + half] = __bfloat16_as_ushort(__float2bfloat16(hi));
}

/* The RMSNorm factor of block row `row` from the warps' partial sums of squares (1 without the norm). */
template <int ROWS>
__device__ __forceinline__ float row_scale(const SkinnyParams &p, const float *sums, int warps, int row) {
    if (!p.rms_norm) return 1.f;
    float s = 0.f;
    for (int w = 0; w < warps; w++) s += sums[w * ROWS + row];
    return rsqrtf(s / (float)p.k + p.eps);
}

/* Block row `row`, column `col` of the product: the warps' partials added in warp order. */
template <int NC, int ROWS>
__device__ __forceinline__ float column_total(const float *part, int warps, int row, int col) {
    float v = 0.f;
    for (int w = 0; w < warps; w++) v += part[(w * ROWS + row) * NC + col];
    return v;
}

/* One 16-row tile's x for a pass: C chunks of rows g (x0) and g + 8 (x1) of the tile, 8 k from k0 on each (zeros past
 * k_end or past the call's rows). */
template <int C>
__device__ __forceinline__ void load_x(uint4 *xa, uint4 *xb, const uint16_t *x0, const uint16_t *x1, bool row0, bool row1,
                                       int k0, int k_end) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int c = 0; c < C; c++) {
        const int k = k0 + c * 32;
        xa[c] = k < k_end && row0 ? load_x_chunk(x0 + k) : zero;
        xb[c] = k < k_end && row1 ? load_x_chunk(x1 + k) : zero;
    }
}

/* acc += one tile's x times the pass's weight fragments (and the tile's sums of squares of x, with the norm); x is
 * scaled by Pi0.5's adaptive scale sv in place first. With SPLIT the second mma of each chunk (its k slots 8..15)
 * accumulates into acc2 instead: two dependent chains of C mma each rather than one of 2 C. Once x lands, that chain is
 * what the product costs (~30 cycles an mma; down's 16 in a row were ~0.3 us), and the two are added before the warps'
 * reduction. */
template <int NT, int C, bool SCALE, bool SPLIT>
__device__ __forceinline__ void tile_product(float (&acc)[NT][4], float (&acc2)[NT][4], float (&ss)[2], uint4 *xa, uint4 *xb,
                                             const uint4 (&wv)[C][NT], const uint4 *sv, int rms_norm) {
#pragma unroll
    for (int c = 0; c < C; c++) {
        if (rms_norm) { /* the statistics of x itself, before any adaptive scale */
            ss[0] += sum_squares(xa[c]);
            ss[1] += sum_squares(xb[c]);
        }
        if (SCALE) {
            xa[c] = mul_bf16x8(xa[c], sv[SCALE ? c : 0]);
            xb[c] = mul_bf16x8(xb[c], sv[SCALE ? c : 0]);
        }
        const uint32_t a_lo[4] = {xa[c].x, xb[c].x, xa[c].y, xb[c].y};
        const uint32_t a_hi[4] = {xa[c].z, xb[c].z, xa[c].w, xb[c].w};
#pragma unroll
        for (int j = 0; j < NT; j++) {
            mma_bf16(acc[j], a_lo, wv[c][j].x, wv[c][j].y);
            mma_bf16(SPLIT ? acc2[j] : acc[j], a_hi, wv[c][j].z, wv[c][j].w);
        }
    }
}

/* SCALE: Pi0.5's adaptive scale of x (in_scale) is in use. A template argument, so that the other kernels
 * carry neither its registers nor its branch in the main loop (col_bias and gate are epilogue-only checks).
 * R (1 or 2): the block's 16-row tiles. Each weight fragment a warp loads feeds both, so a call over up to 32 rows
 * streams the weights once; the second tile's x is loaded after the first's product (loaded together they spilled).
 * The kernel is written so that R = 1 compiles to the code of the one-tile kernel it replaced (session 16: the same
 * source with the tiles in arrays indexed by a loop compiled differently, and the 11-row layer was 0.5-2 us slower). */
template <int NT, int C, int R, bool SCALE>
__global__ void __launch_bounds__(kMaxWarps * 32, 1) skinny_kernel(SkinnyParams p) {
    constexpr int NC = 8 * NT, ROWS = 16 * R; /* columns and rows of the block */
    /* Two accumulator chains (tile_product) where their registers fit: with two tiles of two n8 tiles they spilled,
     * and Pi0.5's scaled QKV and gate|up (127 registers) gained nothing (bench/NOTES.md, session 24). */
    constexpr bool SPLIT = !SCALE && (R == 1 || NT == 1);
    extern __shared__ float smem[];
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * NC, m0 = blockIdx.y * ROWS;
    const uint16_t *x0 = p.x + (size_t)(m0 + g) * p.k, *x1 = x0 + (size_t)8 * p.k; /* rows g, g + 8 of tile 0 */
    const size_t tile_stride = (size_t)16 * p.k;                                      /* tile 1: 16 rows further */
    bool row0[R], row1[R]; /* whether those rows of each tile are the call's */
#pragma unroll
    for (int r = 0; r < R; r++) row0[r] = m0 + 16 * r + g < p.m, row1[r] = m0 + 16 * r + g + 8 < p.m;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const bool rope = NT == 2 && p.epilogue == SKINNY_ROPE_QKV; /* the host runs RoPE with NT = 2 */
    int tile_n[NT]; /* this lane's column (weight row) of each n8 tile */
#pragma unroll
    for (int j = 0; j < NT; j++) tile_n[j] = n0 + j * 8 + g;
    int head = 0, i0 = 0; /* with RoPE: the block's head and first column within each half */
    if (rope) {
        head = (int)blockIdx.x / (p.head_dim / 16);
        i0 = (int)blockIdx.x % (p.head_dim / 16) * 8;
#pragma unroll
        for (int j = 0; j < NT; j++) tile_n[j] = head * p.head_dim + j * (p.head_dim / 2) + i0 + g;
    }

    /* RoPE's factors for this thread's first output pair (e = threadIdx.x in the epilogue): constants of the step,
     * read now, so that the epilogue's two dependent loads (position, then factors) are not on the chain after the
     * product. */
    const bool rope_first = rope && (int)threadIdx.x < ROWS * (NC / 2) && m0 + (int)threadIdx.x / (NC / 2) < p.m;
    RopeAt early_rope = {0.f, 0.f, 0};
    if (rope_first) early_rope = rope_at(p, m0 + (int)threadIdx.x / (NC / 2), i0 + (int)threadIdx.x % (NC / 2));

    /* Outputs (columns, or column pairs) per block row: a power of two, so that the epilogue's index math is shifts
     * (a division here is ~20 dependent instructions on the chain after the product). */
    constexpr int LOG2_NC = NT == 2 ? 4 : 3;
    static_assert(NC == 1 << LOG2_NC, "NC is 8 NT");

    /* Pi0.5's column bias (its adaptive norm's shift through the Linear) of this thread's first output, or of both
     * columns of its first pair: a constant of the step too, read now. Read in the epilogue it was one more memory
     * round trip on the chain, after the block's barrier. One row tile only: with two, its registers spill more. */
    float2 early_bias = make_float2(0.f, 0.f);
    if (R == 1 && p.col_bias) {
        int lo = -1, hi = -1;
        if (rope_first) lo = head * p.head_dim + i0 + (int)threadIdx.x % (NC / 2), hi = lo + p.head_dim / 2;
        else if (!rope) { /* the epilogue's first output below */
            const int pairs = p.epilogue == SKINNY_GELU_MUL, row_shift = LOG2_NC - pairs, per_row = 1 << row_shift;
            const int m = m0 + ((int)threadIdx.x >> row_shift), n = n0 + (((int)threadIdx.x & (per_row - 1)) << pairs);
            if ((int)threadIdx.x < ROWS * per_row && m < p.m && n < p.n) lo = n, hi = pairs ? n + 1 : -1;
        }
        if (lo >= 0) early_bias.x = p.col_bias[lo];
        if (hi >= 0) early_bias.y = p.col_bias[hi];
    }

    float acc[R][NT][4], acc2[R][NT][4];
    float ss[R][2]; /* sums of squares of the lane's rows g and g + 8 of each tile */
#pragma unroll
    for (int r = 0; r < R; r++) {
        ss[r][0] = ss[r][1] = 0.f;
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[r][j][e] = acc2[r][j][e] = 0.f;
    }

    pdl_trigger(); /* the next kernel may start streaming its weights */
    /* this warp's staged passes: [pass - 1][chunk][n8 tile][lane], past the partials and sums (launch_as) */
    uint4 *staged = reinterpret_cast<uint4 *>(smem + warps * ROWS * (NC + 1)) + (size_t)warp * p.staged_passes * C * NT * 32;
    auto staged_slot = [&](int q, int c, int j) { return &staged[(((size_t)q * C + c) * NT + j) * 32 + lane]; };
    const int step = warps * C * 32;
    for (int kb = warp * C * 32, pass = 0; kb < p.k; kb += step, pass++) {
        uint4 wv[C][NT], sv[SCALE ? C : 1];
        const bool from_stage = pass > 0 && pass <= p.staged_passes;
        if (from_stage && pass == 1) cp_async_wait_all(); /* this lane's copies (each lane reads only its own) */
#pragma unroll
        for (int c = 0; c < C; c++) {
            const int k = kb + c * 32 + t * 8;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int n = tile_n[j];
                if (from_stage) wv[c][j] = *staged_slot(pass - 1, c, j);
                else wv[c][j] = k < p.k && n < p.n ? load_stream(p.w + (size_t)n * p.k + k) : zero;
            }
            /* the adaptive scale is a constant of the step, not the previous kernel's output: load it early */
            if (SCALE) sv[SCALE ? c : 0] = k < p.k ? *reinterpret_cast<const uint4 *>(p.in_scale + k) : zero;
        }
        if (pass == 0 && p.staged_passes) { /* the later passes' weights, queued behind this pass's */
            for (int q = 0; q < p.staged_passes; q++)
#pragma unroll
                for (int c = 0; c < C; c++) {
                    const int k = kb + (q + 1) * step + c * 32 + t * 8;
#pragma unroll
                    for (int j = 0; j < NT; j++) {
                        const int n = tile_n[j];
                        const bool valid = k < p.k && n < p.n;
                        stage_stream(staged_slot(q, c, j), valid ? p.w + (size_t)n * p.k + k : p.w, valid);
                    }
                }
            cp_async_commit();
        }
        pdl_wait(); /* x is the previous kernel's output (a no-op after the first pass) */
        uint4 xa[C], xb[C];
        load_x<C>(xa, xb, x0, x1, row0[0], row1[0], kb + t * 8, p.k);
        tile_product<NT, C, SCALE, SPLIT>(acc[0], acc2[0], ss[0], xa, xb, wv, sv, p.rms_norm);
        if constexpr (R == 2) {
            load_x<C>(xa, xb, x0 + tile_stride, x1 + tile_stride, row0[1], row1[1], kb + t * 8, p.k);
            tile_product<NT, C, SCALE, SPLIT>(acc[1], acc2[1], ss[1], xa, xb, wv, sv, p.rms_norm);
        }
    }

    const int pairs = rope || p.epilogue == SKINNY_GELU_MUL, row_shift = LOG2_NC - pairs, per_row = 1 << row_shift;

    /* The residual (and gate) of this thread's first output, loaded now: the load overlaps the warps' reduction
     * below rather than following it. (Not before the product: live across the loop, their registers would cost
     * the weight loads in flight.) A warp that ran no pass has not waited for the kernel before: it waits here. */
    const int first_m = m0 + ((int)threadIdx.x >> row_shift), first_n = n0 + ((int)threadIdx.x & (per_row - 1));
    const bool early = p.epilogue == SKINNY_RESIDUAL && (int)threadIdx.x < ROWS * per_row && first_m < p.m && first_n < p.n;
    float early_res = 0.f, early_gate = 1.f;
    if (early) {
        pdl_wait();
        early_res = p.residual[(size_t)first_m * p.n + first_n];
        early_gate = p.gate ? p.gate[first_n] : 1.f;
    }

    if constexpr (SPLIT) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[r][j][e] += acc2[r][j][e];
    }
    /* Partials to shared memory: [warp][row][column], then sums of squares [warp][row]. */
    float *part = smem + warp * ROWS * NC;
    float *sums = smem + warps * ROWS * NC;
#pragma unroll
    for (int r = 0; r < R; r++) {
#pragma unroll
        for (int j = 0; j < NT; j++) {
            const int col = j * 8 + 2 * t, row = 16 * r + g;
            part[row * NC + col] = acc[r][j][0];
            part[row * NC + col + 1] = acc[r][j][1];
            part[(row + 8) * NC + col] = acc[r][j][2];
            part[(row + 8) * NC + col + 1] = acc[r][j][3];
        }
        if (p.rms_norm) {
            float s0 = ss[r][0], s1 = ss[r][1];
            s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
            s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
            s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
            s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
            if (t == 0) {
                sums[warp * ROWS + 16 * r + g] = s0;
                sums[warp * ROWS + 16 * r + g + 8] = s1;
            }
        }
    }
    __syncthreads();

    /* Epilogue: one thread per output (per column pair for GELU x up and RoPE). */
    if (rope) {
        constexpr int half_cols = NC / 2;
        for (int e = threadIdx.x; e < ROWS * half_cols; e += blockDim.x) {
            const int row = e / half_cols, c = e % half_cols, m = m0 + row;
            if (m >= p.m) continue;
            const float scale = row_scale<ROWS>(p, sums, warps, row);
            const int col_lo = head * p.head_dim + i0 + c, col_hi = col_lo + p.head_dim / 2;
            const bool first = e == (int)threadIdx.x, bias_read = R == 1 && first; /* read above */
            store_rope(p, m, head, i0 + c,
                       column_total<NC, ROWS>(smem, warps, row, c) * scale + (bias_read ? early_bias.x : col_bias(p, col_lo)),
                       column_total<NC, ROWS>(smem, warps, row, c + half_cols) * scale +
                           (bias_read ? early_bias.y : col_bias(p, col_hi)),
                       first ? early_rope : rope_at(p, m, i0 + c));
        }
        return;
    }
    for (int e = threadIdx.x; e < ROWS * per_row; e += blockDim.x) {
        const int row = e >> row_shift, col = (e & (per_row - 1)) << pairs, m = m0 + row, n = n0 + col;
        if (m >= p.m || n >= p.n) continue;
        const float scale = row_scale<ROWS>(p, sums, warps, row);
        const bool first = e == (int)threadIdx.x, bias_read = R == 1 && first; /* read above */
        const float v0 = column_total<NC, ROWS>(smem, warps, row, col) * scale + (bias_read ? early_bias.x : col_bias(p, n));
        const float v1 = pairs ? column_total<NC, ROWS>(smem, warps, row, col + 1) * scale +
                                     (bias_read ? early_bias.y : col_bias(p, n + 1))
                               : 0.f;
        if (p.epilogue == SKINNY_STORE) {
            p.out[(size_t)m * p.n + n] = __bfloat16_as_ushort(__float2bfloat16(v0));
            if (p.out_f32) p.out_f32[(size_t)m * p.n + n] = v0;
        } else if (pairs) {
            p.out[(size_t)m * (p.n / 2) + n / 2] = __bfloat16_as_ushort(__float2bfloat16(gelu_tanh(v0) * v1));
        } else {
            const size_t i = (size_t)m * p.n + n;
            const bool mine = early && first; /* read above */
            const float r = (mine ? early_res : p.residual[i]) + (mine ? early_gate : p.gate ? p.gate[n] : 1.f) * v0;
            p.residual[i] = r;
            p.residual_bf16[i] = __bfloat16_as_ushort(__float2bfloat16(r));
        }
    }
}

/* The block's shape for (n, k), see the design note: warps split k (up to 16, at least 4 chunks of
 * 32 each), NT n8 tiles per block chosen so the grid still has ~128+ blocks, C = 8 chunks per pass
 * when k is long. Registers (at most 128 a thread) bound NT: 2 with C = 4, 1 with C = 8. A grid of 512 blocks or
 * more gets 4-warp blocks (each warp then takes two passes): four of them share an SM, which beat two blocks of 8
 * warps by ~1 us on gate|up (bench/NOTES.md, session 14; NT 4 in 8 warps, its former shape, spilled). Pi0's
 * expert: QKV (2560 x 1024) NT 2, gate|up (8192 x 1024) NT 2 with 4 warps, o_proj (1024 x 2048) NT 1 with 16
 * warps of C 4, down (1024 x 4096) NT 1 with 16 of C 8; with max_warps 8 (skinny_args), 8 warps of C 8 each (down
 * in two passes). Past 16 rows a block takes two row tiles (R 2) and C is 4: with two tiles of x a chunk, C 8
 * spilled, and two passes of C 4 were faster (down at 22 rows 7.9 -> 7.4 us, session 16). */
struct Shape {
    int warps, nt, chunks, row_tiles;
};

Shape choose_shape(int m, int n, int k, int rope, int scale, int max_warps) {
    Shape s;
    max_warps = max_warps > 0 && max_warps < kMaxWarps ? max_warps : kMaxWarps;
    s.warps = k / 128;
    s.warps = s.warps < 1 ? 1 : s.warps > max_warps ? max_warps : s.warps;
    s.chunks = k > s.warps * 4 * 32 && !scale ? 8 : 4;
    const int tiles = (n + 7) / 8;
    s.nt = 1;
    const int max_nt = s.chunks == 8 ? 1 : 2;
    while (s.nt < max_nt && tiles / (2 * s.nt) >= 128) s.nt *= 2;
    if (tiles / s.nt >= 512 && s.warps > 4) s.warps /= 2;
    if (rope) s.nt = 2, s.chunks = 4; /* a block holds 8 columns of each half of a head */
    s.row_tiles = m > 16 ? 2 : 1;
    if (s.row_tiles == 2) s.chunks = 4; /* two tiles of x a chunk: C 8 spills, and two passes of C 4 were faster */
    return s;
}

/*
 * A warp's passes after its first (k longer than its warps x C chunks of 32: Pi0's down projection at 8 warps, gate|up at
 * 4) loaded their weights only once the pass before was done with its registers, so every such pass added a memory round
 * trip to the chain after the wait. Their fragments are instead copied into shared memory before the wait, queued behind
 * the first pass's loads, and read from there (the same values, so the same results to the bit). As many passes as fit
 * beside the warps' partials in 48 KB (the most a block has without opting in), one row tile only (two tiles' kernels
 * are at their register limit), and not with Pi0.5's adaptive scale: its staged gate|up cost Pi0.5's denoise 0.02 ms
 * where Pi0's gained 0.02-0.03 (why is not probed). PI0_STAGE=0 turns it off (A/B runs). Lab (H200): down 5.71 -> 5.29 us, gate|up 7.27 -> 6.98, the layer 24.31
 * -> 23.84 (bench/NOTES.md, session 42).
 */
constexpr size_t kMaxSmemBytes = 48 * 1024;

/* A block's shared memory: the warps' partials and sums of squares (R row tiles), then the staged passes. */
constexpr size_t partials_bytes(int warps, int NT, int R) { return (size_t)warps * 16 * R * (8 * NT + 1) * sizeof(float); }
constexpr size_t staged_bytes(int warps, int C, int NT, int passes) { return (size_t)warps * passes * C * NT * 32 * 16; }

int staged_passes_for(const Shape &s, int k, bool scale) {
    static int off = -1;
    if (off < 0) off = switched_off("PI0_STAGE");
    if (off || s.row_tiles != 1 || scale) return 0;
    const int step = s.warps * s.chunks * 32, later = (k + step - 1) / step - 1;
    const size_t partials = partials_bytes(s.warps, s.nt, 1);
    int passes = 0;
    while (passes < later && partials + staged_bytes(s.warps, s.chunks, s.nt, passes + 1) <= kMaxSmemBytes) passes++;
    return passes;
}

/* How a call is launched: plainly or as a programmatic dependent, and the carveout it asks for (skinny_args). */
struct Launch {
    bool plain;
    int carveout;
    cudaStream_t stream;
};

template <int NT, int C, int R, bool SCALE>
cudaError_t launch_as(const SkinnyParams &p, int warps, const Launch &l) {
    const dim3 grid((unsigned)((p.n + 8 * NT - 1) / (8 * NT)), (unsigned)((p.m + 16 * R - 1) / (16 * R)));
    const size_t smem = partials_bytes(warps, NT, R) + staged_bytes(warps, C, NT, p.staged_passes);
    cudaLaunchAttribute attrs[2];
    cudaLaunchConfig_t cfg = launch_config(grid, dim3((unsigned)warps * 32), smem, l.stream);
    cfg.attrs = attrs;
    if (l.carveout > 0) {
        attrs[cfg.numAttrs].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
        attrs[cfg.numAttrs++].val.sharedMemCarveout = (unsigned)l.carveout;
    }
    if (!l.plain) make_dependent(&cfg, attrs);
    return cudaLaunchKernelEx(&cfg, skinny_kernel<NT, C, R, SCALE>, p);
}

template <int NT, int C, bool SCALE>
cudaError_t launch_rows(const SkinnyParams &p, const Shape &s, const Launch &l) {
    return s.row_tiles == 1 ? launch_as<NT, C, 1, SCALE>(p, s.warps, l) : launch_as<NT, C, 2, SCALE>(p, s.warps, l);
}

template <int NT, int C>
cudaError_t launch(const SkinnyParams &p, const Shape &s, const Launch &l) {
    return p.in_scale ? launch_rows<NT, C, true>(p, s, l) : launch_rows<NT, C, false>(p, s, l);
}

/* ---- the Euler step at a step boundary (skinny_euler_args) ---- */

constexpr int kEulerWarps = 8, kEulerChunks = 4, kEulerTiles = 4; /* the tail's skinny launch: 8 warps of C 4 */
constexpr int kEulerCols = 8 * kEulerTiles;                        /* every action column in one block */
constexpr int kEulerNextCols = 64;                                 /* the next Linear's columns a block */
constexpr int kEulerMaxK = 32;                                     /* its k (action_dim): 4 x 8 bf16 a weight row */
constexpr int kEulerOuts = (16 * kEulerCols + kEulerWarps * 32 - 1) / (kEulerWarps * 32); /* the update's outputs a thread */

struct EulerParams {
    int rows, width, action_dim;
    const uint16_t *x, *out_w, *in_scale;
    const float *out_bias, *gate;
    float eps;
    const float *x_t;
    float *x_t_next;
    const uint16_t *next_w;
    const float *next_bias;
    int next_n, swish;
    float *next_f32;
    uint16_t *next_bf16;
};

/*
 * Every block computes the whole update (action_dim columns of up to 16 rows) exactly as the skinny kernel does for
 * n = action_dim with rms_norm and SKINNY_RESIDUAL: the same warps, chunks and fragments and the same order of every sum
 * (a block of that kernel holds one of the four n8 tiles, this one all four), so the same bits; block 0 stores it.
 * Then each block computes kEulerNextCols columns of the next Linear from the updated rows in shared memory, as
 * linear_small_k does (kernels.cu: the same float32 sum in k order). The update's weights (64 KB at Pi0's dims), its
 * constants and the next Linear's weight rows are loaded before the wait.
 */
template <bool SCALE>
__global__ void __launch_bounds__(kEulerWarps * 32, 1) euler_kernel(EulerParams e) {
    constexpr int NT = kEulerTiles, C = kEulerChunks, NC = kEulerCols, ROWS = 16;
    constexpr bool SPLIT = !SCALE; /* as the skinny kernel's for one row tile */
    extern __shared__ float smem[];
    float *part = smem, *sums = part + kEulerWarps * ROWS * NC, *x_next = sums + kEulerWarps * ROWS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    SkinnyParams p = {};
    p.k = e.width, p.rms_norm = 1, p.eps = e.eps;
    const uint16_t *x0 = e.x + (size_t)g * e.width, *x1 = x0 + (size_t)8 * e.width;
    const bool row0 = g < e.rows, row1 = g + 8 < e.rows;
    const uint4 zero = make_uint4(0, 0, 0, 0);

    /* The next Linear: this thread's column and its first row (rows r, r + 4, ...). */
    const int next_col = blockIdx.x * kEulerNextCols + (threadIdx.x & (kEulerNextCols - 1));
    const int next_row = threadIdx.x / kEulerNextCols, row_step = kEulerWarps * 32 / kEulerNextCols;
    const bool has_next = e.next_w && next_col < e.next_n;
    uint4 next_w[kEulerMaxK / 8];
    float next_bias = 0.f;
#pragma unroll
    for (int c = 0; c < kEulerMaxK / 8; c++)
        next_w[c] = has_next && 8 * c < e.action_dim
                        ? *reinterpret_cast<const uint4 *>(e.next_w + (size_t)next_col * e.action_dim + 8 * c)
                        : zero;
    if (has_next && e.next_bias) next_bias = e.next_bias[next_col];

    float acc[NT][4], acc2[NT][4], ss[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < NT; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = acc2[j][i] = 0.f;

    pdl_trigger(); /* the next kernel may start streaming its weights */
    /* skinny_kernel's pass, written out again: the same loop as one helper of both changed skinny_kernel's SASS
     * (cuobjdump), whose layer time follows its code's shape (session 16), for nothing measured */
    for (int kb = warp * C * 32; kb < e.width; kb += kEulerWarps * C * 32) {
        uint4 wv[C][NT], sv[SCALE ? C : 1];
#pragma unroll
        for (int c = 0; c < C; c++) {
            const int k = kb + c * 32 + t * 8;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                const int n = j * 8 + g;
                wv[c][j] = k < e.width && n < e.action_dim ? load_stream(e.out_w + (size_t)n * e.width + k) : zero;
            }
            if (SCALE) sv[SCALE ? c : 0] = k < e.width ? *reinterpret_cast<const uint4 *>(e.in_scale + k) : zero;
        }
        pdl_wait(); /* x is the previous kernel's output (a no-op after the first pass) */
        uint4 xa[C], xb[C];
        load_x<C>(xa, xb, x0, x1, row0, row1, kb + t * 8, e.width);
        tile_product<NT, C, SCALE, SPLIT>(acc, acc2, ss, xa, xb, wv, sv, 1);
    }
    pdl_wait(); /* a warp that ran no pass has not waited yet */
    /* This thread's outputs of the update (rows <= 16 of kEulerCols columns: at most kEulerOuts a thread), their x_t, gate
     * and bias loaded now: the loads overlap the warps' reduction below, and none waits behind the update's stores. */
    float out_x[kEulerOuts], out_gate[kEulerOuts], out_bias[kEulerOuts];
#pragma unroll
    for (int o = 0; o < kEulerOuts; o++) {
        const int i = threadIdx.x + o * kEulerWarps * 32, row = i / kEulerCols, col = i % kEulerCols;
        const bool valid = row < e.rows && col < e.action_dim;
        out_x[o] = valid ? e.x_t[(size_t)row * e.action_dim + col] : 0.f;
        out_gate[o] = valid ? e.gate[col] : 0.f;
        out_bias[o] = valid ? e.out_bias[col] : 0.f;
    }

    if constexpr (SPLIT) {
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) acc[j][i] += acc2[j][i];
    }
    float *mine = part + warp * ROWS * NC;
#pragma unroll
    for (int j = 0; j < NT; j++) {
        const int col = j * 8 + 2 * t;
        mine[g * NC + col] = acc[j][0];
        mine[g * NC + col + 1] = acc[j][1];
        mine[(g + 8) * NC + col] = acc[j][2];
        mine[(g + 8) * NC + col + 1] = acc[j][3];
    }
    float s0 = ss[0], s1 = ss[1];
    s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
    s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
    s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
    if (t == 0) {
        sums[warp * ROWS + g] = s0;
        sums[warp * ROWS + g + 8] = s1;
    }
    __syncthreads();

    /* The update, as SKINNY_RESIDUAL's epilogue (the one column of a block there is one of the action_dim here). */
#pragma unroll
    for (int o = 0; o < kEulerOuts; o++) {
        const int i = threadIdx.x + o * kEulerWarps * 32, row = i / kEulerCols, col = i % kEulerCols;
        if (row >= e.rows || col >= e.action_dim) continue;
        const float scale = row_scale<ROWS>(p, sums, kEulerWarps, row);
        const float v0 = column_total<NC, ROWS>(part, kEulerWarps, row, col) * scale + out_bias[o];
        const float r = out_x[o] + out_gate[o] * v0;
        x_next[row * kEulerMaxK + col] = r;
        if (blockIdx.x == 0) e.x_t_next[(size_t)row * e.action_dim + col] = r;
    }
    if (!e.next_w) return;
    __syncthreads();
    if (!has_next) return;

    /* The next Linear, as linear_small_k: bias, then x_t_next's k in order, then swish. */
    for (int row = next_row; row < e.rows; row += row_step) {
        const float *xr = x_next + row * kEulerMaxK;
        float v = next_bias;
#pragma unroll
        for (int c = 0; c < kEulerMaxK / 8; c++) {
            const uint32_t w4[4] = {next_w[c].x, next_w[c].y, next_w[c].z, next_w[c].w};
#pragma unroll
            for (int h = 0; h < 8; h++)
                if (8 * c + h < e.action_dim) v += xr[8 * c + h] * (h & 1 ? bf16_hi(w4[h / 2]) : bf16_lo(w4[h / 2]));
        }
        if (e.swish) v = v / (1.0f + __expf(-v));
        const size_t at = (size_t)row * e.next_n + next_col;
        if (e.next_f32) e.next_f32[at] = v;
        if (e.next_bf16) e.next_bf16[at] = __bfloat16_as_ushort(__float2bfloat16(v));
    }
}

} /* namespace */

extern "C" int pi0_cuda_skinny_supported(const skinny_args *a) {
    if (!a || a->m <= 0 || a->n <= 0 || a->k <= 0 || a->k % 8 || !a->x || !a->w) return 0;
    if ((uintptr_t)a->x % 16 || (uintptr_t)a->w % 16 || (uintptr_t)a->in_scale % 16) return 0;
    if ((long long)a->m * a->k > 0x7fffffffLL * 8 || (a->m + 15) / 16 > 65535) return 0;
    switch (a->epilogue) {
    case SKINNY_STORE: return a->out != NULL;
    case SKINNY_GELU_MUL: return a->out != NULL && a->n % 2 == 0;
    case SKINNY_RESIDUAL: return a->residual != NULL && a->residual_bf16 != NULL;
    case SKINNY_ROPE_QKV:
        return a->out && a->cache_k && a->cache_v && a->positions && a->cache_rows && a->rope_cos && a->rope_sin &&
               a->heads > 0 && a->kv_heads > 0 && a->head_dim > 0 && a->head_dim % 16 == 0 &&
               (long long)(a->heads + 2LL * a->kv_heads) * a->head_dim == a->n;
    default: return 0;
    }
}

extern "C" int pi0_cuda_skinny_block_supported(int width, int mlp_dim, int head_dim) {
    return width > 0 && width % 8 == 0 && mlp_dim > 0 && mlp_dim % 8 == 0 && head_dim > 0 && head_dim % 16 == 0;
}

/* The shape and the staged passes pi0_cuda_skinny_linear launches a call's arguments with. */
static Shape call_shape(const skinny_args *a, int *staged_passes) {
    const Shape s = choose_shape(a->m, a->n, a->k, a->epilogue == SKINNY_ROPE_QKV, a->in_scale != NULL, a->max_warps);
    *staged_passes = staged_passes_for(s, a->k, a->in_scale != NULL);
    return s;
}

extern "C" size_t pi0_cuda_skinny_shared_bytes(const skinny_args *a, int *staged_passes) {
    int passes;
    const Shape s = call_shape(a, &passes);
    if (staged_passes) *staged_passes = passes;
    return partials_bytes(s.warps, s.nt, s.row_tiles) + staged_bytes(s.warps, s.chunks, s.nt, passes);
}

extern "C" cudaError_t pi0_cuda_skinny_linear(const skinny_args *a, cudaStream_t stream) {
    if (!pi0_cuda_skinny_supported(a)) return cudaErrorInvalidValue;
    SkinnyParams p = {a->m, a->n, a->k, a->x, a->w, a->rms_norm, a->eps, a->in_scale, a->col_bias, a->epilogue,
                      a->out, a->out_f32, a->residual, a->residual_bf16, a->gate, a->heads, a->kv_heads, a->head_dim,
                      a->positions, a->cache_rows, a->rope_cos, a->rope_sin, a->cache_k, a->cache_v, 0};
    const Shape s = call_shape(a, &p.staged_passes);
    /* C 8 never comes with in_scale (choose_shape), so only C 4 has both variants */
    const Launch l = {a->plain_launch != 0, a->smem_carveout, stream};
    if (s.chunks == 8) return launch_as<1, 8, 1, false>(p, s.warps, l);
    return s.nt == 1 ? launch<1, 4>(p, s, l) : launch<2, 4>(p, s, l);
}

extern "C" int pi0_cuda_skinny_euler_supported(const skinny_euler_args *a) {
    if (!a || a->rows <= 0 || a->rows > 16 || a->width <= 0 || a->width % 8 || a->action_dim <= 0 ||
        a->action_dim > kEulerCols || !a->x || !a->out_w || !a->out_bias || !a->gate || !a->x_t || !a->x_t_next)
        return 0;
    if ((uintptr_t)a->x % 16 || (uintptr_t)a->out_w % 16 || (uintptr_t)a->in_scale % 16) return 0;
    if (!a->next_w) return 1;
    /* the next Linear's blocks all read x_t: only the update alone may write it in place (each row by one block) */
    return a->x_t_next != a->x_t && a->action_dim <= kEulerMaxK && a->action_dim % 8 == 0 &&
           (uintptr_t)a->next_w % 16 == 0 && a->next_n > 0 && (a->next_f32 || a->next_bf16);
}

extern "C" cudaError_t pi0_cuda_skinny_euler(const skinny_euler_args *a, cudaStream_t stream) {
    if (!pi0_cuda_skinny_euler_supported(a)) return cudaErrorInvalidValue;
    const EulerParams e = {a->rows, a->width, a->action_dim, a->x, a->out_w, a->in_scale, a->out_bias, a->gate, a->eps,
                           a->x_t, a->x_t_next, a->next_w, a->next_bias, a->next_n, a->swish, a->next_f32, a->next_bf16};
    const unsigned blocks = a->next_w ? (unsigned)((a->next_n + kEulerNextCols - 1) / kEulerNextCols) : 1;
    const size_t smem = (size_t)(kEulerWarps * 16 * kEulerCols + kEulerWarps * 16 + 16 * kEulerMaxK) * sizeof(float);
    cudaLaunchAttribute attrs[1];
    cudaLaunchConfig_t cfg = launch_config(dim3(blocks), dim3(kEulerWarps * 32), smem, stream);
    cfg.attrs = attrs;
    if (!a->plain_launch) make_dependent(&cfg, attrs);
    return a->in_scale ? cudaLaunchKernelEx(&cfg, euler_kernel<true>, e) : cudaLaunchKernelEx(&cfg, euler_kernel<false>, e);
}
