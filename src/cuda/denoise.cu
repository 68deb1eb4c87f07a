/*
 * denoise.cu - the action expert's layers of one denoise step as one persistent kernel (denoise.h).
 *
 * Why. At batch 1 a denoise step streams ~620 MB of expert weights (Pi0) through 11 rows: the floor is
 * the memory's bandwidth, ~0.13 ms a step on an H200. With a kernel per Linear (skinny.cu) each of the
 * ~100 launches of a step pays a ramp-up, one round trip of loads and a drain, and the memory sits idle
 * between them: ~0.55 ms a step. Here one launch runs the 18 layers, and the weights stream without a
 * break across the boundaries between operations (Hazy Research's "megakernel" argument).
 *
 * Design. One block per SM (cooperative launch, so all are resident): 8 warps of math and one producer warp
 * (9 warps leave 168 registers a thread: a sub-partition holds 3 of them). The work of a layer is six
 * phases separated by a grid barrier (a counter in global memory): QKV (+ norm, RoPE, K/V into the cache),
 * attention partials, attention merge, o_proj (+ residual), gate|up (+ norm, gelu x up), down
 * (+ residual). In a Linear phase block b owns the n8 column tiles b, b + G, b + 2G, ... (G blocks; for QKV,
 * pairs of tiles: 8 columns of each half of a head, so that RoPE's pairs meet in one block). A tile's
 * weight rows are cut along k into pieces of kPiece, and every piece the block will ever need is known in
 * advance (Plan): a ring of shared-memory slots, filled by the producer warp's bulk copies (cp.async.bulk,
 * completing on a "full" mbarrier per slot; the math warps free a slot on its "empty" mbarrier), runs ahead of
 * the math in exactly the order the math consumes them, across phases and layers. (With the copies issued by a
 * math warp instead, the issue itself stalled that warp, and with it every phase: bench/NOTES.md, session 7.)
 * Weights do not depend on the previous phase, so the loads of the next phase are in flight while this
 * one computes and while the grid barrier waits; the memory system never drains.
 *
 * The math of a piece is skinny.cu's: each warp takes 128 of its k, each lane 16 bytes (8 consecutive k) of
 * its x rows (from L2) and of its weight row (from the slot) per 32-k chunk, in the same permuted k order, so
 * one 16-byte load feeds two mma.sync m16n8k16. Slot rows are 2 kPiece + 64 bytes apart, so the two rows a
 * quarter warp reads lie on different banks. A block accumulates up to kMaxTiles tiles at once, keeping
 * its x fragments in registers across them; the warps' partial tiles (and sums of squares for the norm) meet
 * in shared memory in warp order (deterministic), and the epilogue is skinny.cu's.
 *
 * Attention (MQA/GQA, G = heads / kv_heads query heads per K/V head, "virtual rows" r = token * G + head as
 * in attention.cu): the keys are cut into chunks of 32; block b takes (kv head, chunk) units, stages the
 * chunk's K and V in shared memory and lets warp w hold virtual rows 16w .. 16w + 15 (Q from L2 straight into
 * A fragments): scores, a masked softmax in the log2 domain, P (rounded to bf16) times V, and the
 * unnormalized partial (O, max, sum) to the workspace. The merge phase gives each virtual row to a block,
 * which combines the chunks in chunk order and writes the row in bf16.
 *
 * Synchronization. Activations written in one phase are read in the next by other blocks: the grid barrier
 * is CUTLASS's pattern (a block barrier, a release add on a global counter by one thread, its acquire spin,
 * a block barrier), and what other blocks wrote is read through L2 (ld.global.cg,
 * cp.async.cg), never through the incoherent L1 or the read-only path. The host zeroes the counter before
 * each launch (a memset node in the graph).
 *
 * Outcome so far (H200, bench/NOTES.md session 7): correct and deterministic, but a layer takes ~36 us against
 * the skinny kernels' ~32: every phase is a chain of dependent round trips (barrier, x from L2, the math, the
 * stores) of 4-8 us, and the attention phase (17 busy blocks) ~8 us. Opt-in (PI0_PERSISTENT=1).
 */
#include <cuda_bf16.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "cuda/denoise.h"
#include "cuda/device.cuh"

namespace {

constexpr int kThreads = 256, kWarps = kThreads / 32; /* the math's warps */
constexpr int kBlockThreads = kThreads + 32;           /* and one producer warp that feeds the ring */
constexpr int kPiece = 1024;                 /* k of one ring slot */
constexpr int kRowBytes = 2 * kPiece + 64;   /* a slot's row stride: +64 bytes puts rows g and g + 1 on other banks */
constexpr int kSlotBytes = 8 * kRowBytes;    /* 8 weight rows (one n8 tile) x kPiece */
constexpr int kMaxSlots = 32;
constexpr int kMinSlots = 2;                 /* the producer refills a slot as soon as every math warp is done with it */
constexpr int kDefaultSlots = 4;
constexpr int kMaxTiles = 8;                 /* n8 tiles accumulated at once: the slots one piece round needs */
constexpr int kTileCols = 8 * kMaxTiles;
constexpr int kKeys = 32;                    /* keys per attention chunk */
constexpr int kMaxRows = 16;                 /* suffix rows */
constexpr int kMaxVirtual = 128;             /* G x rows: 8 warps x 16 */
constexpr int kMaxKeys = 16384;
constexpr int kMaxChunks = kMaxKeys / kKeys;
constexpr int kBarrierBytes = 2 * kMaxSlots * 8; /* a full and an empty mbarrier per slot */
constexpr int kMaxDepth = 64;                /* layers whose table is kept in shared memory */
constexpr int kMaxBlockTiles = 32;           /* n8 tiles of one Linear a block may own */
constexpr int kMaxRopeUnits = 8;             /* QKV units (tile pairs) a block may own: their RoPE factors stay resident */
constexpr int kMaxOwnTiles = 8;              /* o_proj / down tiles a block may own: their residual columns stay resident */
constexpr int kMaxDevices = 64;

enum { LIN_QKV, LIN_O, LIN_GATE_UP, LIN_DOWN, NUM_LINEAR };

/* What a block does in each Linear, the same in every layer: computed once at the start, so that the ring's
 * producer and the math look their tiles up instead of recomputing them. */
struct Plan {
    int k[NUM_LINEAR], tiles[NUM_LINEAR], pieces[NUM_LINEAR];
    int col[NUM_LINEAR][kMaxBlockTiles]; /* the first column (weight row) of each of the block's tiles */
};

/* What the epilogues read again and again, kept in shared memory for the whole kernel: the rows' positions and
 * cache rows, the RoPE factors of the block's QKV columns, and the residual stream's columns the block owns
 * (o_proj and down have the same columns, so the same block updates them every time). */
struct Resident {
    int positions[kMaxRows], cache_rows[kMaxRows];
    float2 rope[kMaxRows][kMaxRopeUnits][8]; /* (cos, sin) at the row's position, column i0 + c of the unit */
    float own[kMaxRows][kMaxOwnTiles * 8];
};

__host__ __device__ constexpr int layer_table_bytes(int depth) {
    return (int)((depth * sizeof(pi0_denoise_layer) + sizeof(Plan) + sizeof(Resident) + 127) / 128 * 128);
}

struct Params {
    int m, width, heads, kv_heads, head_dim, mlp, depth;
    const pi0_denoise_layer *layers;
    float *x;
    uint16_t *xb, *qkv, *att, *mlp_out, *cache_k, *cache_v;
    size_t cache_layer;
    const int *positions, *cache_rows;
    const attn_segment *segment;
    const float *rope_cos, *rope_sin;
    float eps, scale_log2;
    float *partials;  /* [kv head][chunk][virtual row][HD] */
    float2 *max_sum;  /* [kv head][chunk][virtual row] */
    unsigned *sync;
    int slots, max_chunks;
};

/* Shared memory: the slots' mbarriers, the layer table, the ring, then a scratch area that the Linear phases (partials) and
 * the attention phases (K/V chunk, merge weights) take in turn. */
template <int HD>
struct Smem {
    static constexpr int LDS = HD + 8; /* K/V chunk row stride (elements): +16 bytes against bank conflicts */
    static constexpr size_t LINEAR = (size_t)kWarps * 16 * kTileCols * 4 + kWarps * 16 * 4;
    static constexpr size_t ATTENTION = (size_t)2 * kKeys * LDS * 2;
    static constexpr size_t MERGE = (size_t)kMaxChunks * 8 + 16;
    static constexpr size_t SCRATCH = LINEAR > ATTENTION ? (LINEAR > MERGE ? LINEAR : MERGE)
                                                         : (ATTENTION > MERGE ? ATTENTION : MERGE);
};

/* Output columns n and inputs k of Linear `which` of a layer. */
__host__ __device__ __forceinline__ void linear_dims(int which, int width, int heads, int kv_heads, int head_dim, int mlp,
                                                     int *n, int *k) {
    const int q_dim = heads * head_dim;
    *n = which == LIN_QKV ? q_dim + 2 * kv_heads * head_dim : which == LIN_GATE_UP ? 2 * mlp : width;
    *k = which == LIN_O ? q_dim : which == LIN_DOWN ? mlp : width;
}

/* The n8 tiles this block owns in a Linear of n columns: QKV by pairs (a head's 16-column units), the others
 * one by one, both strided by the grid. */
__host__ __device__ __forceinline__ int block_tiles(int which, int n, int block, int grid) {
    const int units = which == LIN_QKV ? n / 16 : n / 8;
    const int mine = units > block ? (units - block + grid - 1) / grid : 0;
    return which == LIN_QKV ? 2 * mine : mine;
}

/* The device code exists for sm_90+ only (bulk copies, mbarrier transactions); the other architectures of a
 * fat binary get a kernel that traps, which the host never launches there. */
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define DENOISE_DEVICE_CODE 1
#else
#define DENOISE_DEVICE_CODE 0
#endif
#if DENOISE_DEVICE_CODE

constexpr int kWarpK = kPiece / kWarps; /* k of a piece per warp: 4 chunks of 32 */
constexpr int kChunks = kWarpK / 32;

/* ---- memory operations ---------------------------------------------------------------------------- */

__device__ __forceinline__ uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(uint64_t *bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}

/* The math warps' own barrier (the producer warp runs on its own). */
__device__ __forceinline__ void math_sync() { asm volatile("bar.sync 1, %0;\n" ::"n"(kThreads) : "memory"); }

__device__ __forceinline__ void mbar_expect(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(smem_addr(bar)), "r"(parity)
                     : "memory");
    } while (!done);
}

/* bytes (a multiple of 16) from global src to shared dst, counted on bar. */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
}

/* Activations other blocks wrote in an earlier phase: through L2. */
__device__ __forceinline__ uint4 load_l2(const uint16_t *p) { return __ldcg(reinterpret_cast<const uint4 *>(p)); }

__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}

/* Waits until every block has arrived `epoch` times (CUTLASS's grid barrier): a block barrier, a release add by
 * one thread, its acquire spin, a block barrier; what the others wrote before their release is then visible. */
__device__ __forceinline__ void grid_sync(unsigned *counter, unsigned epoch) {
    math_sync();
    if (threadIdx.x == 0) { /* release: the block's writes (ordered before by the block barrier) come first */
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(counter) : "memory");
        const unsigned target = epoch * gridDim.x;
        unsigned seen;
        do asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(seen) : "l"(counter) : "memory");
        while (seen < target);
    }
    math_sync();
}

__device__ __forceinline__ uint16_t to_bf16(float v) { return __bfloat16_as_ushort(__float2bfloat16(v)); }

/* ---- which weights, in which order --------------------------------------------------------------- */

struct Linear {
    const uint16_t *w, *scale; /* scale: Pi0.5's bf16(1 + scale) of x, or NULL */
    const float *bias;         /* the column bias (Pi0.5's shift . w^T), or NULL */
    int n, k, rms_norm;
};

__device__ __forceinline__ Linear linear_of(const Params &p, const pi0_denoise_layer &l, int which) {
    Linear L;
    linear_dims(which, p.width, p.heads, p.kv_heads, p.head_dim, p.mlp, &L.n, &L.k);
    L.rms_norm = which == LIN_QKV || which == LIN_GATE_UP;
    L.w = (const uint16_t *)(which == LIN_QKV ? l.qkv_w : which == LIN_O ? l.o_w : which == LIN_GATE_UP ? l.gate_up_w : l.down_w);
    L.scale = (const uint16_t *)(which == LIN_QKV ? l.attn_scale : which == LIN_GATE_UP ? l.mlp_scale : NULL);
    L.bias = which == LIN_QKV ? l.qkv_bias : which == LIN_GATE_UP ? l.gate_up_bias : NULL;
    return L;
}

/* The first column (weight row) of this block's tile j. */
__device__ __forceinline__ int tile_first_col(const Params &p, int which, int j) {
    if (which != LIN_QKV) return 8 * ((int)blockIdx.x + j * (int)gridDim.x);
    const int u = (int)blockIdx.x + (j / 2) * (int)gridDim.x, per_head = p.head_dim / 16;
    return (u / per_head) * p.head_dim + (j & 1) * (p.head_dim / 2) + (u % per_head) * 8;
}

__device__ void plan_init(const Params &p, Plan *plan) {
    if (threadIdx.x < NUM_LINEAR) {
        const int w = threadIdx.x;
        int n, k;
        linear_dims(w, p.width, p.heads, p.kv_heads, p.head_dim, p.mlp, &n, &k);
        plan->k[w] = k, plan->pieces[w] = (k + kPiece - 1) / kPiece;
        plan->tiles[w] = block_tiles(w, n, (int)blockIdx.x, (int)gridDim.x);
    }
    for (int i = threadIdx.x; i < NUM_LINEAR * kMaxBlockTiles; i += kBlockThreads)
        plan->col[i / kMaxBlockTiles][i % kMaxBlockTiles] = tile_first_col(p, i / kMaxBlockTiles, i % kMaxBlockTiles);
}

/* Fills the Resident block (after plan_init and a block barrier). */
__device__ void resident_init(const Params &p, const Plan &plan, Resident *res) {
    const int half = p.head_dim / 2, units = plan.tiles[LIN_QKV] / 2;
    for (int i = threadIdx.x; i < p.m * units * 8; i += blockDim.x) {
        const int m = i / (units * 8), u = i / 8 % units, c = i % 8, col = plan.col[LIN_QKV][2 * u] + c;
        if (col / p.head_dim >= p.heads + p.kv_heads) continue; /* v: no rotation */
        const size_t at = (size_t)__ldg(p.positions + m) * half + col % p.head_dim;
        res->rope[m][u][c] = make_float2(__ldg(p.rope_cos + at), __ldg(p.rope_sin + at));
    }
    for (int i = threadIdx.x; i < p.m * plan.tiles[LIN_O] * 8; i += blockDim.x) {
        const int m = i / (plan.tiles[LIN_O] * 8), j = i % (plan.tiles[LIN_O] * 8);
        res->own[m][j] = p.x[(size_t)m * p.width + plan.col[LIN_O][j / 8] + j % 8];
    }
    for (int m = threadIdx.x; m < p.m; m += blockDim.x) res->positions[m] = p.positions[m], res->cache_rows[m] = p.cache_rows[m];
}

/* A position in the sequence of (layer, Linear, tile group, piece, tile) the block consumes, which the ring's
 * producer walks ahead of the math. */
struct Cursor {
    int layer, which, group, piece, tile;
};

/* Moves c to its next position with work (c->layer == depth: the end). */
__device__ __forceinline__ void cursor_settle(const Params &p, const Plan &plan, Cursor *c) {
    while (c->layer < p.depth && c->group >= plan.tiles[c->which]) {
        c->group = c->piece = c->tile = 0;
        if (++c->which == NUM_LINEAR) c->which = 0, c->layer++;
    }
}

__device__ __forceinline__ void cursor_next(const Params &p, const Plan &plan, Cursor *c) {
    if (++c->tile < min(kMaxTiles, plan.tiles[c->which] - c->group)) return;
    c->tile = 0;
    if (++c->piece < plan.pieces[c->which]) return;
    c->piece = 0;
    c->group += kMaxTiles;
    cursor_settle(p, plan, c);
}

struct Ring {
    const pi0_denoise_layer *layers; /* the layer table, copied to shared memory */
    const Plan *plan;
    Resident *res;
    uint64_t *full, *empty;          /* per slot: its copies landed; every math warp is done with it */
    unsigned char *slots;
    unsigned consumed;               /* entries the math has taken, counted from the start of the kernel */
};

/* The producer warp: every entry of the kernel in the order the math takes them, each into the next slot once
 * the math is done with the entry before it there. Lane 0 announces the bytes, lane r copies weight row r of the
 * tile. Its waits stall no one else: the math only ever waits for the entry it needs. */
__device__ void ring_produce(const Params &p, const Ring &r) {
    const int lane = threadIdx.x & 31;
    Cursor c = {0, 0, 0, 0, 0};
    cursor_settle(p, *r.plan, &c);
    for (unsigned seq = 0; c.layer < p.depth; seq++) {
        const unsigned slot = seq % (unsigned)p.slots, round = seq / (unsigned)p.slots;
        if (round > 0) mbar_wait(&r.empty[slot], (round - 1) & 1u);
        const int k = r.plan->k[c.which], col = r.plan->col[c.which][c.group + c.tile], k0 = c.piece * kPiece;
        const uint16_t *w = linear_of(p, r.layers[c.layer], c.which).w;
        const uint32_t row_bytes = (uint32_t)min(kPiece, k - k0) * 2;
        if (lane == 0) mbar_expect(&r.full[slot], 8 * row_bytes);
        __syncwarp();
        if (lane < 8)
            bulk_copy(r.slots + (size_t)slot * kSlotBytes + lane * kRowBytes, w + (size_t)(col + lane) * k + k0, row_bytes,
                      &r.full[slot]);
        cursor_next(p, *r.plan, &c);
    }
}

/* ---- the Linear phases ------------------------------------------------------------------------------ */

/* Row `row`'s column `col` of the group's product: the warps' partials in warp order. */
__device__ __forceinline__ float column_total(const float *part, int row, int col) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) v += part[(w * 16 + row) * kTileCols + col];
    return v;
}

__device__ __forceinline__ float row_factor(const Linear &L, const float *ss, float eps, int row) {
    if (!L.rms_norm) return 1.f;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; w++) s += ss[w * 16 + row];
    return rsqrtf(s / (float)L.k + eps);
}

__device__ __forceinline__ float bias_of(const Linear &L, int n) { return L.bias ? __ldg(L.bias + n) : 0.f; }

/* Rotates the pair (lo, hi) = columns (i, i + head_dim / 2) of `head` in row m (q, k) and stores it: q to
 * the qkv rows, k and v to the row's cache row (skinny.cu's store_rope). */
__device__ __forceinline__ void store_rope(const Params &p, const Resident &res, int layer, int m, int unit, int c,
                                           int head, int i, float lo, float hi) {
    const int hd = p.head_dim, half = hd / 2, kv_dim = p.kv_heads * hd, qkv_dim = (p.heads + 2 * p.kv_heads) * hd;
    const size_t cache = (size_t)layer * p.cache_layer + (size_t)res.cache_rows[m] * kv_dim;
    uint16_t *dst;
    if (head < p.heads + p.kv_heads) {
        const float2 cs = res.rope[m][unit][c];
        const float x1 = lo, x2 = hi;
        lo = x1 * cs.x - x2 * cs.y;
        hi = x2 * cs.x + x1 * cs.y;
        dst = head < p.heads ? p.qkv + (size_t)m * qkv_dim + (size_t)head * hd
                             : p.cache_k + cache + (size_t)(head - p.heads) * hd;
    } else {
        dst = p.cache_v + cache + (size_t)(head - p.heads - p.kv_heads) * hd;
    }
    dst[i] = to_bf16(lo);
    dst[i + half] = to_bf16(hi);
}

/* The epilogue of a group of `count` tiles starting at the block's tile `first`. */
__device__ void linear_epilogue(const Params &p, Resident *res, int layer, int which, const Linear &L,
                                const pi0_denoise_layer &l, const int *cols, const float *part, const float *ss, int first,
                                int count) {
    const int tid = threadIdx.x;
    if (which == LIN_QKV) { /* tiles 2u, 2u + 1: columns i0 .. i0 + 7 of both halves of a head */
        const int per_row = count / 2 * 8;
        for (int e = tid; e < p.m * per_row; e += kThreads) {
            const int row = e / per_row, u = e % per_row / 8, c = e % 8;
            const int col_lo = cols[first + 2 * u] + c, col_hi = col_lo + p.head_dim / 2;
            const float f = row_factor(L, ss, p.eps, row);
            store_rope(p, *res, layer, row, first / 2 + u, c, col_lo / p.head_dim, col_lo % p.head_dim,
                       column_total(part, row, 16 * u + c) * f + bias_of(L, col_lo),
                       column_total(part, row, 16 * u + 8 + c) * f + bias_of(L, col_hi));
        }
    } else if (which == LIN_GATE_UP) { /* interleaved (gate_j, up_j) pairs */
        const int per_row = count * 4;
        for (int e = tid; e < p.m * per_row; e += kThreads) {
            const int row = e / per_row, t = e % per_row / 4, c = e % 4 * 2;
            const int n = cols[first + t] + c;
            const float f = row_factor(L, ss, p.eps, row);
            const float gate = column_total(part, row, 8 * t + c) * f + bias_of(L, n);
            const float up = column_total(part, row, 8 * t + c + 1) * f + bias_of(L, n + 1);
            p.mlp_out[(size_t)row * p.mlp + n / 2] = to_bf16(gelu_tanh(gate) * up);
        }
    } else { /* o_proj, down: the (gated) residual add */
        const float *gate = which == LIN_O ? l.attn_gate : l.mlp_gate;
        const int per_row = count * 8;
        for (int e = tid; e < p.m * per_row; e += kThreads) {
            const int row = e / per_row, t = e % per_row / 8, c = e % 8;
            const int n = cols[first + t] + c;
            const float v = column_total(part, row, 8 * t + c);
            const size_t i = (size_t)row * p.width + n;
            float *own = &res->own[row][(first + t) * 8 + c];
            const float r = *own + (gate ? __ldg(gate + n) * v : v);
            *own = r;
            p.x[i] = r;
            p.xb[i] = to_bf16(r);
        }
    }
}

/* A warp's x fragments of one piece: rows g and g + 8 at k0 + 32 c (zeros past k or past the rows). */
__device__ __forceinline__ void load_piece(const uint16_t *x0, const uint16_t *x1, int k0, int k, bool row0, bool row1,
                                           uint4 *a, uint4 *b) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int c = 0; c < kChunks; c++) {
        const int at = k0 + c * 32;
        a[c] = at < k && row0 ? load_l2(x0 + at) : zero;
        b[c] = at < k && row1 ? load_l2(x1 + at) : zero;
    }
}

/* x of the Linear `which` (the rows' bf16 input). */
__device__ __forceinline__ const uint16_t *linear_input(const Params &p, int which) {
    return which == LIN_O ? p.att : which == LIN_DOWN ? p.mlp_out : p.xb;
}

__device__ void linear_phase(const Params &p, int layer, int which, Ring *ring, float *scratch) {
    const pi0_denoise_layer &l = ring->layers[layer];
    const Linear L = linear_of(p, l, which);
    const int tiles = ring->plan->tiles[which], pieces = ring->plan->pieces[which];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const bool row0 = g < p.m, row1 = g + 8 < p.m;
    const uint16_t *x = linear_input(p, which), *x0 = x + (size_t)g * L.k, *x1 = x0 + (size_t)8 * L.k;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float *part = scratch, *ss = scratch + kWarps * 16 * kTileCols;
    for (int group = 0; group < tiles; group += kMaxTiles) {
        const int count = min(kMaxTiles, tiles - group);
        float acc[kMaxTiles][4];
#pragma unroll
        for (int j = 0; j < kMaxTiles; j++) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
        float ss0 = 0.f, ss1 = 0.f;
        const int kw = warp * kWarpK; /* this warp's k within a piece */
        uint4 xa[kChunks], xc[kChunks], next_a[kChunks], next_c[kChunks];
        load_piece(x0, x1, kw + t * 8, L.k, row0, row1, xa, xc);
        for (int piece = 0; piece < pieces; piece++) {
            /* the next piece's x is in flight while this one is multiplied */
            if (piece + 1 < pieces) load_piece(x0, x1, (piece + 1) * kPiece + kw + t * 8, L.k, row0, row1, next_a, next_c);
#pragma unroll
            for (int c = 0; c < kChunks; c++) {
                const int k = piece * kPiece + kw + c * 32 + t * 8;
                const bool in = k < L.k;
                if (L.rms_norm) { /* the statistics of x itself, before any adaptive scale */
                    ss0 += sum_squares(xa[c]);
                    ss1 += sum_squares(xc[c]);
                }
                if (L.scale && in) {
                    const uint4 s = __ldg(reinterpret_cast<const uint4 *>(L.scale + k));
                    xa[c] = mul_bf16x8(xa[c], s);
                    xc[c] = mul_bf16x8(xc[c], s);
                }
            }
#pragma unroll
            for (int j = 0; j < kMaxTiles; j++) {
                if (j >= count) break;
                const unsigned slot = ring->consumed % (unsigned)p.slots;
                mbar_wait(&ring->full[slot], (ring->consumed / (unsigned)p.slots) & 1u);
                const unsigned char *w = ring->slots + (size_t)slot * kSlotBytes + g * kRowBytes + (kw + t * 8) * 2;
#pragma unroll
                for (int c = 0; c < kChunks; c++) {
                    const bool in = piece * kPiece + kw + c * 32 + t * 8 < L.k;
                    const uint4 wv = in ? *reinterpret_cast<const uint4 *>(w + c * 64) : zero;
                    const uint32_t a_lo[4] = {xa[c].x, xc[c].x, xa[c].y, xc[c].y};
                    const uint32_t a_hi[4] = {xa[c].z, xc[c].z, xa[c].w, xc[c].w};
                    mma_bf16(acc[j], a_lo, wv.x, wv.y);
                    mma_bf16(acc[j], a_hi, wv.z, wv.w);
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(&ring->empty[slot]); /* this warp is done with the slot */
                ring->consumed++;
            }
#pragma unroll
            for (int c = 0; c < kChunks; c++) xa[c] = next_a[c], xc[c] = next_c[c];
        }
        /* partials [warp][row][column], then the sums of squares [warp][row] */
        float *mine = part + warp * 16 * kTileCols;
#pragma unroll
        for (int j = 0; j < kMaxTiles; j++) {
            if (j >= count) break;
            const int col = j * 8 + 2 * t;
            *reinterpret_cast<float2 *>(mine + g * kTileCols + col) = make_float2(acc[j][0], acc[j][1]);
            *reinterpret_cast<float2 *>(mine + (g + 8) * kTileCols + col) = make_float2(acc[j][2], acc[j][3]);
        }
        if (L.rms_norm) {
            ss0 += __shfl_xor_sync(0xffffffffu, ss0, 1);
            ss0 += __shfl_xor_sync(0xffffffffu, ss0, 2);
            ss1 += __shfl_xor_sync(0xffffffffu, ss1, 1);
            ss1 += __shfl_xor_sync(0xffffffffu, ss1, 2);
            if (t == 0) ss[warp * 16 + g] = ss0, ss[warp * 16 + g + 8] = ss1;
        }
        math_sync();
        linear_epilogue(p, ring->res, layer, which, L, l, ring->plan->col[which], part, ss, group, count);
        math_sync(); /* the scratch is free again */
    }
}

/* ---- attention ---------------------------------------------------------------------------------------- */

/* Partial attention of every virtual row over the keys of one (kv head, chunk) unit per block. */
template <int HD>
__device__ void attention_phase(const Params &p, int layer, unsigned char *scratch) {
    constexpr int LDS = Smem<HD>::LDS;
    const attn_segment seg = *p.segment;
    const int G = p.heads / p.kv_heads, rows = seg.num_q * G, num_k = seg.num_k, kv_dim = p.kv_heads * HD;
    const int qkv_dim = (p.heads + 2 * p.kv_heads) * HD;
    const int chunks = (num_k + kKeys - 1) / kKeys, units = p.kv_heads * chunks;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int state_vis = seg.state_keys > 0 ? min(seg.state_keys, num_k) : num_k;
    uint16_t *sK = reinterpret_cast<uint16_t *>(scratch), *sV = sK + kKeys * LDS;
    const uint16_t *kcache = p.cache_k + (size_t)layer * p.cache_layer, *vcache = p.cache_v + (size_t)layer * p.cache_layer;
    const int lrow = lane & 7, lsel1 = (lane >> 3) & 1, lsel2 = lane >> 4;
    const uint32_t k_addr = smem_addr(sK + (lrow + lsel2 * 8) * LDS + lsel1 * 8);
    const uint32_t v_addr = smem_addr(sV + (lrow + lsel1 * 8) * LDS + lsel2 * 8);
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
        const int kvh = u / chunks, chunk = u % chunks, key0 = chunk * kKeys;
        for (int i = tid; i < 2 * kKeys * (HD / 8); i += kThreads) {
            const int which = i / (kKeys * (HD / 8)), j = i % (kKeys * (HD / 8)), r = j / (HD / 8), c = j % (HD / 8);
            const int key = key0 + r;
            const uint16_t *src = (which ? vcache : kcache) + (size_t)(seg.k_row + (key < num_k ? key : 0)) * kv_dim +
                                  (size_t)kvh * HD + c * 8;
            cp_async16((which ? sV : sK) + r * LDS + c * 8, src, key < num_k);
        }
        asm volatile("cp.async.commit_group;\n" ::: "memory");
        /* Q of virtual rows r0 = 16 warp + g and r1 = r0 + 8 as A fragments, straight from L2: every load in flight
         * at once, and with the K/V copies */
        const int r0 = warp * 16 + g, r1 = r0 + 8;
        const bool v0 = r0 < rows, v1 = r1 < rows;
        const uint16_t *q0 = p.qkv + (size_t)(v0 ? r0 / G : 0) * qkv_dim + (size_t)(kvh * G + r0 % G) * HD;
        const uint16_t *q1 = p.qkv + (size_t)(v1 ? r1 / G : 0) * qkv_dim + (size_t)(kvh * G + r1 % G) * HD;
        uint32_t qf[HD / 16][4];
#pragma unroll
        for (int kc = 0; kc < HD / 16; kc++) {
            const int d = kc * 16 + 2 * t;
            qf[kc][0] = v0 ? __ldcg(reinterpret_cast<const unsigned *>(q0 + d)) : 0u;
            qf[kc][1] = v1 ? __ldcg(reinterpret_cast<const unsigned *>(q1 + d)) : 0u;
            qf[kc][2] = v0 ? __ldcg(reinterpret_cast<const unsigned *>(q0 + d + 8)) : 0u;
            qf[kc][3] = v1 ? __ldcg(reinterpret_cast<const unsigned *>(q1 + d + 8)) : 0u;
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        math_sync();
        if (warp * 16 < rows) {
            float s[kKeys / 8][4];
#pragma unroll
            for (int n = 0; n < kKeys / 8; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
            for (int kc = 0; kc < HD / 16; kc++) {
#pragma unroll
                for (int np = 0; np < kKeys / 16; np++) {
                    uint32_t b[4];
                    ldsm_x4(b, k_addr + (np * 16 * LDS + kc * 16) * 2);
                    mma_bf16(s[2 * np], qf[kc], b[0], b[1]);
                    mma_bf16(s[2 * np + 1], qf[kc], b[2], b[3]);
                }
            }
            const int vis0 = r0 < G ? state_vis : num_k, vis1 = r1 < G ? state_vis : num_k;
            float mx0 = -INFINITY, mx1 = -INFINITY;
            mask_scores(s, key0, t, vis0, vis1, p.scale_log2, mx0, mx1);
            /* a row that sees no key of this chunk keeps max -inf and sum 0: it weighs 0 in the merge */
            const float base0 = mx0 == -INFINITY ? 0.f : mx0, base1 = mx1 == -INFINITY ? 0.f : mx1;
            float l0 = 0.f, l1 = 0.f;
            exp_scores(s, base0, base1, l0, l1);
            l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
            l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
            l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
            l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
            /* O = P V in two halves of the head's dims, to halve the accumulators' registers */
            const size_t unit = (size_t)kvh * p.max_chunks + chunk;
            float *w0 = p.partials + (unit * kMaxVirtual + r0) * HD, *w1 = p.partials + (unit * kMaxVirtual + r1) * HD;
            uint32_t pa[kKeys / 16][4];
#pragma unroll
            for (int kc = 0; kc < kKeys / 16; kc++) {
                pa[kc][0] = pack_bf16(s[2 * kc][0], s[2 * kc][1]), pa[kc][1] = pack_bf16(s[2 * kc][2], s[2 * kc][3]);
                pa[kc][2] = pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]);
                pa[kc][3] = pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3]);
            }
#pragma unroll
            for (int h0 = 0; h0 < HD; h0 += HD / 2) {
                float o[HD / 16][4];
#pragma unroll
                for (int d = 0; d < HD / 16; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
#pragma unroll
                for (int kc = 0; kc < kKeys / 16; kc++) {
#pragma unroll
                    for (int dp = 0; dp < HD / 32; dp++) {
                        uint32_t b[4];
                        ldsm_x4_trans(b, v_addr + (kc * 16 * LDS + h0 + dp * 16) * 2);
                        mma_bf16(o[2 * dp], pa[kc], b[0], b[1]);
                        mma_bf16(o[2 * dp + 1], pa[kc], b[2], b[3]);
                    }
                }
#pragma unroll
                for (int d = 0; d < HD / 16; d++) {
                    if (v0) __stcg(reinterpret_cast<float2 *>(w0 + h0 + d * 8 + 2 * t), make_float2(o[d][0], o[d][1]));
                    if (v1) __stcg(reinterpret_cast<float2 *>(w1 + h0 + d * 8 + 2 * t), make_float2(o[d][2], o[d][3]));
                }
            }
            if (t == 0) {
                if (v0) __stcg(p.max_sum + unit * kMaxVirtual + r0, make_float2(mx0, l0));
                if (v1) __stcg(p.max_sum + unit * kMaxVirtual + r1, make_float2(mx1, l1));
            }
        }
        math_sync(); /* K and V are free for the next unit */
    }
}

/* Each virtual row's chunks combined in chunk order: M = max m_c, O = sum O_c 2^(m_c - M) / sum l_c 2^(m_c - M). */
template <int HD>
__device__ void merge_phase(const Params &p, unsigned char *scratch) {
    const attn_segment seg = *p.segment;
    const int G = p.heads / p.kv_heads, rows = seg.num_q * G, chunks = (seg.num_k + kKeys - 1) / kKeys;
    const int q_dim = p.heads * HD, tid = threadIdx.x;
    float2 *ml = reinterpret_cast<float2 *>(scratch); /* each chunk's (max, sum), then (weight, -) */
    float *inv_sum = reinterpret_cast<float *>(ml + kMaxChunks);
    for (int u = blockIdx.x; u < p.kv_heads * rows; u += gridDim.x) {
        const int kvh = u / rows, r = u % rows;
        const size_t first = (size_t)kvh * p.max_chunks;
        if (tid < 32) { /* one pass over L2: the (max, sum) pairs into shared memory */
            float M = -INFINITY;
            for (int c = tid; c < chunks; c += 32) {
                const float2 v = __ldcg(p.max_sum + (first + c) * kMaxVirtual + r);
                ml[c] = v;
                if (v.y > 0.f) M = fmaxf(M, v.x);
            }
            for (int off = 16; off; off >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, off));
            float L = 0.f;
            for (int c = tid; c < chunks; c += 32) { /* the lane's own entries: no barrier needed */
                const float2 v = ml[c];
                const float w = v.y > 0.f ? exp2f(v.x - M) : 0.f;
                ml[c].x = w;
                L += v.y * w;
            }
            for (int off = 16; off; off >>= 1) L += __shfl_xor_sync(0xffffffffu, L, off);
            if (tid == 0) *inv_sum = 1.f / L; /* every row sees key 0, so some chunk has a sum > 0 */
        }
        math_sync();
        const int token = r / G, head = kvh * G + r % G;
        for (int d = tid; d < HD; d += kThreads) {
            float acc = 0.f;
#pragma unroll 8
            for (int c = 0; c < chunks; c++) acc += __ldcg(p.partials + ((first + c) * kMaxVirtual + r) * HD + d) * ml[c].x;
            p.att[(size_t)token * q_dim + (size_t)head * HD + d] = to_bf16(acc * *inv_sum);
        }
        math_sync();
    }
}

#endif /* DENOISE_DEVICE_CODE */

/* ---- the kernel ----------------------------------------------------------------------------------- */

template <int HD>
/* 9 warps: a quarter of the register file (one SM sub-partition) holds 3 of them, so at most 168 registers */
__global__ void __launch_bounds__(kBlockThreads, 1) denoise_kernel(Params p) {
#if DENOISE_DEVICE_CODE
    extern __shared__ __align__(128) unsigned char smem[];
    Ring ring;
    pi0_denoise_layer *layers = reinterpret_cast<pi0_denoise_layer *>(smem + kBarrierBytes);
    Plan *plan = reinterpret_cast<Plan *>(layers + p.depth);
    Resident *res = reinterpret_cast<Resident *>(plan + 1);
    ring.layers = layers, ring.plan = plan, ring.res = res;
    ring.full = reinterpret_cast<uint64_t *>(smem), ring.empty = ring.full + kMaxSlots;
    ring.slots = smem + kBarrierBytes + layer_table_bytes(p.depth);
    ring.consumed = 0;
    unsigned char *scratch = ring.slots + (size_t)p.slots * kSlotBytes;
    if (threadIdx.x == 0) {
        for (int i = 0; i < p.slots; i++) mbar_init(&ring.full[i], 1), mbar_init(&ring.empty[i], kWarps);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    for (int i = threadIdx.x; i < p.depth; i += kBlockThreads) layers[i] = p.layers[i];
    plan_init(p, plan);
    __syncthreads();
    resident_init(p, *plan, res);
    __syncthreads(); /* the last barrier of all 9 warps: from here the producer warp goes its own way */
    if (threadIdx.x >= kThreads) {
        ring_produce(p, ring);
        return;
    }
    unsigned epoch = 0;
    for (int layer = 0; layer < p.depth; layer++) {
        linear_phase(p, layer, LIN_QKV, &ring, reinterpret_cast<float *>(scratch));
        grid_sync(p.sync, ++epoch);
        attention_phase<HD>(p, layer, scratch);
        grid_sync(p.sync, ++epoch);
        merge_phase<HD>(p, scratch);
        grid_sync(p.sync, ++epoch);
        linear_phase(p, layer, LIN_O, &ring, reinterpret_cast<float *>(scratch));
        grid_sync(p.sync, ++epoch);
        linear_phase(p, layer, LIN_GATE_UP, &ring, reinterpret_cast<float *>(scratch));
        grid_sync(p.sync, ++epoch);
        linear_phase(p, layer, LIN_DOWN, &ring, reinterpret_cast<float *>(scratch));
        if (layer + 1 < p.depth) grid_sync(p.sync, ++epoch);
    }
#else
    (void)p;
    __trap(); /* the host launches it on sm_90+ only */
#endif
}

/* ---- the host ------------------------------------------------------------------------------------- */

struct DeviceInfo {
    int sms, smem_optin, major;
};

bool device_info(DeviceInfo *d) {
    static DeviceInfo cache[kMaxDevices];
    static int known[kMaxDevices];
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return (void)cudaGetLastError(), false;
    if (!__atomic_load_n(&known[dev], __ATOMIC_ACQUIRE)) {
        DeviceInfo i;
        if (cudaDeviceGetAttribute(&i.sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&i.smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&i.major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
            return (void)cudaGetLastError(), false;
        cache[dev] = i;
        __atomic_store_n(&known[dev], 1, __ATOMIC_RELEASE);
    }
    *d = cache[dev];
    return true;
}

size_t scratch_bytes(int head_dim) {
    switch (head_dim) {
    case 32: return Smem<32>::SCRATCH;
    case 64: return Smem<64>::SCRATCH;
    case 128: return Smem<128>::SCRATCH;
    default: return Smem<256>::SCRATCH;
    }
}

/* Ring slots that fit beside the layer table and the scratch (0 if fewer than a piece round needs). */
int ring_slots(const DeviceInfo &d, int head_dim, int depth) {
    const long long room =
        (long long)d.smem_optin - kBarrierBytes - layer_table_bytes(depth) - (long long)scratch_bytes(head_dim);
    const long long slots = room / kSlotBytes;
    return slots < kMinSlots ? 0 : slots > kMaxSlots ? kMaxSlots : (int)slots;
}

/* The slots a launch uses: kDefaultSlots, or PI0_PERSISTENT_SLOTS=n, at most what fits. How far the weight stream
 * runs ahead of the math is also how much memory traffic every other load queues behind: on an H200, 4 slots
 * (~8.9 MB in flight over the GPU) beat 11 by ~0.15 ms a call and 2 lose ~0.2 (bench/RESULTS.md, session 7). */
int slots_in_use(int fit) {
    static int cap = -1;
    if (cap < 0) {
        const char *env = getenv("PI0_PERSISTENT_SLOTS");
        cap = env && atoi(env) >= kMinSlots ? atoi(env) : kDefaultSlots;
    }
    return fit < cap ? fit : cap;
}

template <int HD>
cudaError_t launch(const Params &p, int sms, cudaStream_t stream) {
    const size_t smem = kBarrierBytes + layer_table_bytes(p.depth) + (size_t)p.slots * kSlotBytes + Smem<HD>::SCRATCH;
    cudaError_t e = cudaFuncSetAttribute(denoise_kernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeCooperative;
    attr.val.cooperative = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)sms);
    cfg.blockDim = dim3(kBlockThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, denoise_kernel<HD>, p);
}

} /* namespace */


extern "C" int pi0_cuda_denoise_supported(int rows, int width, int heads, int kv_heads, int head_dim, int mlp_dim,
                                          int depth, int max_keys) {
    DeviceInfo d;
    if (!device_info(&d) || d.major < 9) return 0;
    if (head_dim != 32 && head_dim != 64 && head_dim != 128 && head_dim != 256) return 0;
    if (rows <= 0 || rows > kMaxRows || heads <= 0 || kv_heads <= 0 || heads % kv_heads) return 0;
    if (heads / kv_heads * rows > kMaxVirtual || width <= 0 || width % 8 || mlp_dim <= 0 || mlp_dim % 8) return 0;
    if (max_keys <= 0 || max_keys > kMaxKeys || depth <= 0 || depth > kMaxDepth) return 0;
    for (int w = 0; w < NUM_LINEAR; w++) { /* block 0 owns the most tiles */
        int n, k;
        linear_dims(w, width, heads, kv_heads, head_dim, mlp_dim, &n, &k);
        const int tiles = block_tiles(w, n, 0, d.sms);
        if (tiles > kMaxBlockTiles || (w == LIN_QKV && tiles / 2 > kMaxRopeUnits) || (w == LIN_O && tiles > kMaxOwnTiles))
            return 0;
    }
    return ring_slots(d, head_dim, depth) > 0;
}

/* The workspace: the attention's partial O ([kv head][chunk][virtual row][head_dim] floats), their (max, sum)
 * pairs, then the grid's counter; each part 256-byte aligned. Fills p's pointers when p is given. */
static size_t workspace_layout(int kv_heads, int head_dim, int max_keys, void *base, Params *p) {
    const size_t chunks = (size_t)(max_keys + kKeys - 1) / kKeys, units = (size_t)kv_heads * chunks * kMaxVirtual;
    const size_t partials = (units * head_dim * sizeof(float) + 255) / 256 * 256;
    const size_t max_sum = (units * sizeof(float2) + 255) / 256 * 256;
    if (p) {
        char *ws = (char *)base;
        p->partials = (float *)ws, p->max_sum = (float2 *)(ws + partials), p->sync = (unsigned *)(ws + partials + max_sum);
        p->max_chunks = (int)chunks;
    }
    return partials + max_sum + 256;
}

extern "C" size_t pi0_cuda_denoise_workspace(int kv_heads, int head_dim, int max_keys) {
    return workspace_layout(kv_heads, head_dim, max_keys, NULL, NULL);
}

extern "C" cudaError_t pi0_cuda_denoise_step(const pi0_denoise_args *a, cudaStream_t stream) {
    DeviceInfo d;
    if (!a || !a->layers || !a->workspace || !a->segment ||
        !pi0_cuda_denoise_supported(a->rows, a->width, a->heads, a->kv_heads, a->head_dim, a->mlp_dim, a->depth,
                                    a->max_keys) ||
        !device_info(&d))
        return cudaErrorInvalidValue;
    Params p;
    p.m = a->rows, p.width = a->width, p.heads = a->heads, p.kv_heads = a->kv_heads, p.head_dim = a->head_dim;
    p.mlp = a->mlp_dim, p.depth = a->depth, p.layers = a->layers;
    p.x = a->x, p.xb = a->x_bf16, p.qkv = a->qkv, p.att = a->att, p.mlp_out = a->mlp;
    p.cache_k = a->cache_k, p.cache_v = a->cache_v, p.cache_layer = a->cache_layer;
    p.positions = a->positions, p.cache_rows = a->cache_rows, p.segment = a->segment;
    p.rope_cos = a->rope_cos, p.rope_sin = a->rope_sin;
    p.eps = a->eps, p.scale_log2 = 1.4426950408889634f / sqrtf((float)a->head_dim);
    workspace_layout(a->kv_heads, a->head_dim, a->max_keys, a->workspace, &p);
    p.slots = slots_in_use(ring_slots(d, a->head_dim, a->depth));
    cudaError_t e = cudaMemsetAsync(p.sync, 0, sizeof(unsigned), stream);
    if (e != cudaSuccess) return e;
    switch (a->head_dim) {
    case 32: return launch<32>(p, d.sms, stream);
    case 64: return launch<64>(p, d.sms, stream);
    case 128: return launch<128>(p, d.sms, stream);
    default: return launch<256>(p, d.sms, stream);
    }
}
