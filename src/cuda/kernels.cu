/*
 * kernels.cu - the CUDA backend's row-wise and elementwise kernels.
 *
 * These are memory-bound and small next to the GEMMs: the design goal is one pass over the data
 * with float32 arithmetic, one block per row for the RMSNorms (a row of 1024..2048 floats fits a
 * block's registers twice over), a warp per row for the ViT's LayerNorm (1152 floats), and grid-stride
 * loops elsewhere. For the denoise loop's few rows,
 * skinny.cu fuses the norms and gelu x up into its Linears; these kernels serve every other shape.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "cuda/device.cuh"
#include "cuda/kernels.h"

#define NORM_THREADS 256

static __host__ __device__ __forceinline__ __nv_bfloat16 *as_bf16(pi0_bf16 *p) { return reinterpret_cast<__nv_bfloat16 *>(p); }
static __host__ __device__ __forceinline__ const __nv_bfloat16 *as_bf16(const pi0_bf16 *p) {
    return reinterpret_cast<const __nv_bfloat16 *>(p);
}

/* Sum over the warp; every lane gets the result. */
static __device__ __forceinline__ float warp_sum(float v) {
    for (int offset = 16; offset; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

/* Sum over the block; every thread gets the result. Safe to call repeatedly. */
static __device__ float block_sum(float v) {
    __shared__ float warp_sums[32];
    v = warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    __syncthreads(); /* the previous call's readers are done with warp_sums */
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? warp_sums[lane] : 0.0f);
}

/* RMSNorm rows of up to 4 * NORM_VEC * NORM_THREADS floats (Gemma's 2048 and 1024) are normalized from
 * registers: one float4 load per element group, the statistics from the registers, one 8-byte store
 * per 4 outputs (a global round trip, not three passes over the row). Other rows loop over memory. */
#define NORM_VEC 2

static int norm_row_fits(int dim) { return dim % 4 == 0 && dim <= 4 * NORM_VEC * NORM_THREADS; }

/* What the vector loads and stores of a row from registers need: float4 input, weight and bias (NULL passes), 8-byte
 * output. */
static int norm_aligned(const void *in, const void *out, const float *w, const float *b) {
    return (uintptr_t)in % 16 == 0 && (uintptr_t)out % 8 == 0 && (uintptr_t)w % 16 == 0 && (uintptr_t)b % 16 == 0;
}

static int norm_in_registers(int dim, const void *in, const void *out, const float *w, const float *b) {
    return norm_row_fits(dim) && norm_aligned(in, out, w, b);
}

/* This thread's float4 groups of the row (zeros past its end). */
static __device__ __forceinline__ void load_row(float4 (&v)[NORM_VEC], const float *x, int dim) {
#pragma unroll
    for (int q = 0; q < NORM_VEC; q++) {
        int i = threadIdx.x + q * NORM_THREADS;
        v[q] = i < dim / 4 ? reinterpret_cast<const float4 *>(x)[i] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
}

/* The sum over this thread's groups of v^2, the zero padding past the row left out. */
static __device__ __forceinline__ float sum_squares(const float4 (&v)[NORM_VEC], int dim) {
    float sq = 0;
#pragma unroll
    for (int q = 0; q < NORM_VEC; q++) {
        if (threadIdx.x + q * NORM_THREADS >= dim / 4) continue;
        sq += v[q].x * v[q].x + v[q].y * v[q].y + v[q].z * v[q].z + v[q].w * v[q].w;
    }
    return sq;
}

/* This thread's float4 groups of a per-column vector (a norm's weight, bias or shift), zeros for NULL. The norms load
 * them with the row, before its statistics: a load after a store to `out` (which may alias it) waits for that store's
 * turn, so loaded while storing they were one more memory round trip a group at the kernel's end. */
static __device__ __forceinline__ void load_vec(float4 (&g)[NORM_VEC], const float *w, int dim) {
    if (w) load_row(g, w, dim);
    else
#pragma unroll
        for (int q = 0; q < NORM_VEC; q++) g[q] = make_float4(0.f, 0.f, 0.f, 0.f);
}

/* out[4i..4i+3] = v * scale * (1 + w) + shift for this thread's groups (Gemma's RMSNorm, Pi0.5's adaptive shift), w and
 * shift loaded (load_vec). */
static __device__ __forceinline__ void store_row(__nv_bfloat16 *out, const float4 (&v)[NORM_VEC], int dim, float scale,
                                                 const float4 (&g)[NORM_VEC], const float4 (&o)[NORM_VEC]) {
#pragma unroll
    for (int q = 0; q < NORM_VEC; q++) {
        int i = threadIdx.x + q * NORM_THREADS;
        if (i >= dim / 4) continue;
        uint2 r;
        r.x = pack_bf16(v[q].x * scale * (1.0f + g[q].x) + o[q].x, v[q].y * scale * (1.0f + g[q].y) + o[q].y);
        r.y = pack_bf16(v[q].z * scale * (1.0f + g[q].z) + o[q].z, v[q].w * scale * (1.0f + g[q].w) + o[q].w);
        reinterpret_cast<uint2 *>(out)[i] = r;
    }
}

/* LayerNorm (the ViT's): a warp a row, LN_ROWS rows a block. A row of up to 4 * 32 * LN_WARP_VEC floats (SigLIP's 1152:
 * 9 float4 a lane) is normalized from registers, loaded with its w and b in one round trip, its mean and variance by
 * shuffles: no block barrier. A block a row, as the RMSNorms run, took two block sums (four barriers) between the load
 * and the stores: vision -0.01 to -0.02 ms this way (bench/NOTES.md, session 46). Other rows loop over memory. */
#define LN_WARP_VEC 9
#define LN_ROWS 2

static int layernorm_in_registers(int dim, const void *in, const void *out, const float *w, const float *b) {
    return dim % 4 == 0 && dim <= 4 * 32 * LN_WARP_VEC && norm_aligned(in, out, w, b);
}

static __global__ void layernorm_kernel(__nv_bfloat16 *out, const float *in, int rows, int dim, const float *w,
                                        const float *b, float eps, int in_registers) {
    const int row = blockIdx.x * LN_ROWS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= rows) return;
    const float *x = in + (size_t)row * dim;
    out += (size_t)row * dim;
    if (in_registers) {
        const int n4 = dim / 4;
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        float4 v[LN_WARP_VEC], g[LN_WARP_VEC], o[LN_WARP_VEC];
        float sum = 0, sq = 0;
#pragma unroll
        for (int q = 0; q < LN_WARP_VEC; q++) {
            const int i = lane + q * 32;
            v[q] = i < n4 ? reinterpret_cast<const float4 *>(x)[i] : zero;
            g[q] = i < n4 ? reinterpret_cast<const float4 *>(w)[i] : zero;
            o[q] = i < n4 ? reinterpret_cast<const float4 *>(b)[i] : zero;
            sum += v[q].x + v[q].y + v[q].z + v[q].w;
        }
        const float mean = warp_sum(sum) / (float)dim;
#pragma unroll
        for (int q = 0; q < LN_WARP_VEC; q++) {
            if (lane + q * 32 >= n4) continue;
            const float4 d = make_float4(v[q].x - mean, v[q].y - mean, v[q].z - mean, v[q].w - mean);
            sq += d.x * d.x + d.y * d.y + d.z * d.z + d.w * d.w;
        }
        const float inv = rsqrtf(warp_sum(sq) / (float)dim + eps);
#pragma unroll
        for (int q = 0; q < LN_WARP_VEC; q++) {
            const int i = lane + q * 32;
            if (i >= n4) continue;
            uint2 r;
            r.x = pack_bf16((v[q].x - mean) * inv * g[q].x + o[q].x, (v[q].y - mean) * inv * g[q].y + o[q].y);
            r.y = pack_bf16((v[q].z - mean) * inv * g[q].z + o[q].z, (v[q].w - mean) * inv * g[q].w + o[q].w);
            reinterpret_cast<uint2 *>(out)[i] = r;
        }
        return;
    }
    float sum = 0, sq = 0;
    for (int j = lane; j < dim; j += 32) sum += x[j];
    const float mean = warp_sum(sum) / (float)dim;
    for (int j = lane; j < dim; j += 32) sq += (x[j] - mean) * (x[j] - mean);
    const float inv = rsqrtf(warp_sum(sq) / (float)dim + eps);
    for (int j = lane; j < dim; j += 32) out[j] = __float2bfloat16((x[j] - mean) * inv * w[j] + b[j]);
}

/* RMSNorm with Gemma's (1 + w), plus `shift` when given: Pi0.5's adaptive norm, w being its scale. w NULL:
 * a factor of 1 (the weight folded into the next Linear). */
static __global__ void rmsnorm_kernel(__nv_bfloat16 *out, const float *in, const int *in_rows, int dim, const float *w,
                                      const float *shift, float eps, int in_registers) {
    pdl_trigger(); /* a dependent at few rows (launch_for_rows) */
    pdl_wait();
    int row = in_rows ? in_rows[blockIdx.x] : (int)blockIdx.x;
    const float *x = in + (size_t)row * dim;
    out += (size_t)blockIdx.x * dim;
    if (in_registers) {
        float4 v[NORM_VEC], g[NORM_VEC], o[NORM_VEC];
        load_row(v, x, dim);
        load_vec(g, w, dim), load_vec(o, shift, dim);
        float inv = rsqrtf(block_sum(sum_squares(v, dim)) / (float)dim + eps);
        store_row(out, v, dim, inv, g, o);
        return;
    }
    float sq = 0;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) sq += x[j] * x[j];
    float inv = rsqrtf(block_sum(sq) / (float)dim + eps);
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        out[j] = __float2bfloat16(x[j] * inv * (w ? 1.0f + w[j] : 1.0f) + (shift ? shift[j] : 0.0f));
}

/* x row += gate * (parts[0] row + ... + parts[num_parts - 1] row), the parts added in that order (the split-K partial
 * sums of the GEMM before, gemm.h's k_parts; gate per column, NULL: 1), then out = RMSNorm(x) * (1 + w) + shift
 * (shift NULL: none): the residual add that GEMM's reduction (and Pi0.5's gated add) would have made, in the norm that
 * reads x next. From registers only (pi0_cuda_add_parts_rmsnorm_fits). */
#define MAX_PARTS 8
static __global__ void add_parts_rmsnorm_kernel(__nv_bfloat16 *out, float *x, const float *parts, int num_parts,
                                                size_t part_elems, const float *gate, int dim, const float *w,
                                                const float *shift, float eps) {
    pdl_trigger(); /* a dependent at few rows (launch_for_rows) */
    pdl_wait();
    const size_t at = (size_t)blockIdx.x * dim;
    float4 v[NORM_VEC], y[MAX_PARTS][NORM_VEC], g[NORM_VEC], nw[NORM_VEC], ns[NORM_VEC];
    load_row(v, x + at, dim);
#pragma unroll
    for (int p = 0; p < MAX_PARTS; p++) /* every load issued before the first add */
        if (p < num_parts) load_row(y[p], parts + p * part_elems + at, dim);
    if (gate) load_row(g, gate, dim);
    load_vec(nw, w, dim), load_vec(ns, shift, dim);
#pragma unroll
    for (int p = 1; p < MAX_PARTS; p++)
        if (p < num_parts)
#pragma unroll
            for (int q = 0; q < NORM_VEC; q++)
                y[0][q] = make_float4(y[0][q].x + y[p][q].x, y[0][q].y + y[p][q].y, y[0][q].z + y[p][q].z,
                                      y[0][q].w + y[p][q].w);
#pragma unroll
    for (int q = 0; q < NORM_VEC; q++) {
        if (gate) /* rounded before the add (no fma): one rounding order, which the tests check bit for bit */
            y[0][q] = make_float4(__fmul_rn(g[q].x, y[0][q].x), __fmul_rn(g[q].y, y[0][q].y), __fmul_rn(g[q].z, y[0][q].z),
                                  __fmul_rn(g[q].w, y[0][q].w));
        v[q] = make_float4(v[q].x + y[0][q].x, v[q].y + y[0][q].y, v[q].z + y[0][q].z, v[q].w + y[0][q].w);
        int i = threadIdx.x + q * NORM_THREADS;
        if (i < dim / 4) reinterpret_cast<float4 *>(x + at)[i] = v[q];
    }
    float inv = rsqrtf(block_sum(sum_squares(v, dim)) / (float)dim + eps);
    store_row(out + at, v, dim, inv, nw, ns);
}

static __global__ void one_plus_bf16_kernel(__nv_bfloat16 *out, const float *scale, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(1.0f + scale[i]);
}

/* util/half.h's f32_to_bf16, bit for bit (NaN included), and its widenings. */
static __device__ __forceinline__ uint16_t bf16_bits_rne(float x) {
    uint32_t bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static __global__ void weight_rows_kernel(uint16_t *dst, size_t pitch, const void *src, int src_type, size_t rows,
                                          size_t cols, const float *fold) {
    size_t n = rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / cols, c = i - r * cols;
        float x = src_type == 0   ? ((const float *)src)[i]
                  : src_type == 1 ? __uint_as_float((uint32_t)((const uint16_t *)src)[i] << 16)
                                  : __half2float(((const __half *)src)[i]);
        if (fold) x = __fmul_rn(x, __fadd_rn(1.0f, fold[c])); /* as the host would: no fused multiply-add */
        dst[r * pitch * cols + c] = bf16_bits_rne(x);
    }
}

static __global__ void add_gated_kernel(float *x, const float *y, const float *gate, size_t n, int dim) {
    pdl_trigger();
    pdl_wait();
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] += gate[i % dim] * y[i];
}

/* out[i] = gelu(in[2i]) * in[2i + 1]: the gate|up rows are interleaved (gate_j, up_j), so output i of
 * the flat (rows, mlp) array reads the flat input pair 2i, 2i + 1 whatever the row. Four outputs a
 * thread with one 16-byte load and one 8-byte store when the buffers allow it (vec4). */
static __global__ void gelu_mul_kernel(__nv_bfloat16 *out, const __nv_bfloat16 *in, size_t n, int vec4) {
    pdl_trigger();
    pdl_wait();
    size_t stride = (size_t)gridDim.x * blockDim.x, i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (vec4) {
        for (; 4 * i < n; i += stride) {
            const uint4 pairs = reinterpret_cast<const uint4 *>(in)[i];
            uint2 r;
            r.x = pack_bf16(gelu_tanh(bf16_lo(pairs.x)) * bf16_hi(pairs.x), gelu_tanh(bf16_lo(pairs.y)) * bf16_hi(pairs.y));
            r.y = pack_bf16(gelu_tanh(bf16_lo(pairs.z)) * bf16_hi(pairs.z), gelu_tanh(bf16_lo(pairs.w)) * bf16_hi(pairs.w));
            reinterpret_cast<uint2 *>(out)[i] = r;
        }
        return;
    }
    for (; i < n; i += stride) out[i] = __float2bfloat16(gelu_tanh(__bfloat162float(in[2 * i])) * __bfloat162float(in[2 * i + 1]));
}

/* Rotate-half RoPE of one head in place: [x1 cos - x2 sin, x2 cos + x1 sin]. */
static __device__ __forceinline__ void rope_pair(__nv_bfloat16 *head, int i, int half, const float *c, const float *s,
                                                 __nv_bfloat16 *dst) {
    float x1 = __bfloat162float(head[i]), x2 = __bfloat162float(head[i + half]);
    dst[i] = __float2bfloat16(x1 * c[i] - x2 * s[i]);
    dst[i + half] = __float2bfloat16(x2 * c[i] + x1 * s[i]);
}

/* Four pairs i..i+3 of a head (i a multiple of 4) and their factors: 8-byte loads of bf16, 16-byte loads of the tables. */
typedef struct {
    uint2 x1, x2;
    float4 c, s;
} rope_group;

static __device__ __forceinline__ rope_group load_rope_group(const __nv_bfloat16 *head, int i, int half, const float *c,
                                                             const float *s) {
    rope_group g;
    g.x1 = *reinterpret_cast<const uint2 *>(head + i), g.x2 = *reinterpret_cast<const uint2 *>(head + i + half);
    g.c = *reinterpret_cast<const float4 *>(c + i), g.s = *reinterpret_cast<const float4 *>(s + i);
    return g;
}

/* The group rotated (as rope_pair) into dst. */
static __device__ __forceinline__ void store_rope_group(const rope_group &g, int i, int half, __nv_bfloat16 *dst) {
    const float x1[4] = {bf16_lo(g.x1.x), bf16_hi(g.x1.x), bf16_lo(g.x1.y), bf16_hi(g.x1.y)};
    const float x2[4] = {bf16_lo(g.x2.x), bf16_hi(g.x2.x), bf16_lo(g.x2.y), bf16_hi(g.x2.y)};
    const float cs[4] = {g.c.x, g.c.y, g.c.z, g.c.w}, sn[4] = {g.s.x, g.s.y, g.s.z, g.s.w};
    float y1[4], y2[4];
#pragma unroll
    for (int e = 0; e < 4; e++) y1[e] = x1[e] * cs[e] - x2[e] * sn[e], y2[e] = x2[e] * cs[e] + x1[e] * sn[e];
    *reinterpret_cast<uint2 *>(dst + i) = make_uint2(pack_bf16(y1[0], y1[1]), pack_bf16(y1[2], y1[3]));
    *reinterpret_cast<uint2 *>(dst + i + half) = make_uint2(pack_bf16(y2[0], y2[1]), pack_bf16(y2[2], y2[3]));
}

/* One block a row: RoPE on its q heads in place and on its k heads into the cache, its v copied to the cache. With
 * `vec` (head_dim a multiple of 8, 16-byte aligned rows) a thread takes 4 pairs and V 8 values at a time: at Gemma's
 * 256 one pass of 256 threads for q instead of four of 2-byte loads. */
static __global__ void rope_qkv_kernel(__nv_bfloat16 *qkv, int heads, int kv_heads, int head_dim, const int *positions,
                                       const int *cache_rows, __nv_bfloat16 *cache_k, __nv_bfloat16 *cache_v,
                                       const float *rope_cos, const float *rope_sin, int vec) {
    pdl_trigger(); /* the attention after it may launch (and load the keys it did not write) while it runs */
    pdl_wait();
    int half = head_dim / 2, kv_dim = kv_heads * head_dim;
    __nv_bfloat16 *row = qkv + (size_t)blockIdx.x * (heads + 2 * kv_heads) * head_dim;
    const float *c = rope_cos + (size_t)positions[blockIdx.x] * half, *s = rope_sin + (size_t)positions[blockIdx.x] * half;
    __nv_bfloat16 *k_out = cache_k + (size_t)cache_rows[blockIdx.x] * kv_dim;
    __nv_bfloat16 *v_out = cache_v + (size_t)cache_rows[blockIdx.x] * kv_dim;
    __nv_bfloat16 *k = row + heads * head_dim, *v = k + kv_dim;
    if (vec) {
        /* A thread's q group, k group and 8 values of v (4-pair groups a head), every load before the first store: a
         * store into the row may alias the loads after it, which then wait for it (with a loop each, the first warp
         * took three memory round trips in a row: q, then k, then v). One pass at Gemma's shapes (256 threads). */
        const int groups = half / 4, q_items = heads * groups, k_items = kv_heads * groups, v_items = kv_dim / 8;
        const int items = max(q_items, max(k_items, v_items));
        for (int u = threadIdx.x; u < items; u += blockDim.x) {
            const bool has_q = u < q_items, has_k = u < k_items, has_v = u < v_items;
            const int i = (u % groups) * 4, h = u / groups;
            rope_group q_group, k_group;
            uint4 v_values;
            if (has_q) q_group = load_rope_group(row + h * head_dim, i, half, c, s);
            if (has_k) k_group = load_rope_group(k + h * head_dim, i, half, c, s);
            if (has_v) v_values = reinterpret_cast<const uint4 *>(v)[u];
            if (has_q) store_rope_group(q_group, i, half, row + h * head_dim);
            if (has_k) store_rope_group(k_group, i, half, k_out + h * head_dim);
            if (has_v) reinterpret_cast<uint4 *>(v_out)[u] = v_values;
        }
        return;
    }
    for (int t = threadIdx.x; t < heads * half; t += blockDim.x) {
        __nv_bfloat16 *head = row + (t / half) * head_dim;
        rope_pair(head, t % half, half, c, s, head);
    }
    for (int t = threadIdx.x; t < kv_heads * half; t += blockDim.x) {
        int h = t / half;
        rope_pair(k + h * head_dim, t % half, half, c, s, k_out + h * head_dim);
    }
    for (int t = threadIdx.x; t < kv_dim; t += blockDim.x) v_out[t] = v[t];
}

/* Pillow's clip8: the fixed-point accumulator's integer part, saturated to 0..255. */
static __device__ __forceinline__ int clip8(long long acc) {
    if (acc < 0) return 0;
    long long v = acc >> PI0_RESIZE_PRECISION_BITS;
    return v > 255 ? 255 : (int)v;
}

/* One weighted sum of Pillow's resampling: 2^21 + sum_t w[t] * in[t * stride], in int32 where that is exact
 * (model/image.h), clipped. */
static __device__ __forceinline__ int resample(const uint8_t *in, size_t stride, const int32_t *w, int count, int taps) {
    if (taps <= PI0_RESIZE_INT32_TAPS) {
        int acc = 1 << (PI0_RESIZE_PRECISION_BITS - 1);
        for (int t = 0; t < count; t++) acc += in[t * stride] * w[t];
        return clip8(acc);
    }
    long long acc = 1 << (PI0_RESIZE_PRECISION_BITS - 1);
    for (int t = 0; t < count; t++) acc += (long long)in[t * stride] * w[t];
    return clip8(acc);
}

/* Pillow's horizontal pass at one pixel: source row `row`, resized column x, channel c. */
static __device__ __forceinline__ int horizontal(const pi0_frame_job &j, int row, int x, int c) {
    const uint8_t *in = j.pixels + (size_t)row * j.width * 3 + c;
    if (!j.x_weights) return in[(size_t)x * 3];
    return resample(in + (size_t)j.x_first[x] * 3, 3, j.x_weights + (size_t)x * j.x_taps, j.x_count[x], j.x_taps);
}

/* Block (row y, frame f), threads over the row's S * 3 values. Pillow runs the horizontal pass first and
 * stores it as bytes: the vertical pass sums those bytes, recomputed here per tap (a few taps each way). */
static __global__ void frames_to_images_kernel(float *images, const pi0_frame_job *jobs, int image_size) {
    const pi0_frame_job j = jobs[blockIdx.y];
    int y = blockIdx.x, row_values = image_size * 3, yy = y - j.pad_y;
    float *out = images + ((size_t)blockIdx.y * image_size + y) * row_values;
    if (!j.pixels) { /* a masked camera */
        for (int i = threadIdx.x; i < row_values; i += blockDim.x) out[i] = 0.0f;
        return;
    }
    for (int i = threadIdx.x; i < row_values; i += blockDim.x) {
        int xx = i / 3 - j.pad_x, c = i % 3, v = 0; /* the padding is byte 0 */
        if (yy >= 0 && yy < j.new_h && xx >= 0 && xx < j.new_w) {
            if (!j.y_weights) {
                v = horizontal(j, yy, xx, c);
            } else {
                const int32_t *w = j.y_weights + (size_t)yy * j.y_taps;
                int first = j.y_first[yy], count = j.y_count[yy];
                if (j.y_taps <= PI0_RESIZE_INT32_TAPS) {
                    int acc = 1 << (PI0_RESIZE_PRECISION_BITS - 1);
                    for (int t = 0; t < count; t++) acc += horizontal(j, first + t, xx, c) * w[t];
                    v = clip8(acc);
                } else {
                    long long acc = 1 << (PI0_RESIZE_PRECISION_BITS - 1);
                    for (int t = 0; t < count; t++) acc += (long long)horizontal(j, first + t, xx, c) * w[t];
                    v = clip8(acc);
                }
            }
        }
        out[i] = (float)v / 255.0f * 2.0f - 1.0f; /* Observation.from_dict's scaling, each step in float32 */
    }
}

static __global__ void im2col_kernel(__nv_bfloat16 *out, const float *images, int n, int image_size, int patch,
                                     int *nonfinite) {
    const int x_piece[PI0_PATCH_PIECES] = PI0_PATCH_X_PIECES;
    int grid = image_size / patch, patch_dim = 3 * patch * patch;
    size_t total = (size_t)n * grid * grid * patch_dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t row = i / patch_dim;
        int e = (int)(i % patch_dim), c = e / (patch * patch), r = (e / patch) % patch, col = e % patch;
        int image = (int)(row / (grid * grid)), at = (int)(row % (grid * grid)), py = at / grid, px = at % grid;
        float v = images[(size_t)image * image_size * image_size * 3 +
                         ((size_t)(py * patch + r) * image_size + px * patch + col) * 3 + c];
        __nv_bfloat16 piece[3]; /* util/half.h's f32_to_bf16x3 */
        float left = v;
#pragma unroll
        for (int p = 0; p < 3; p++) piece[p] = __float2bfloat16_rn(left), left -= __bfloat162float(piece[p]);
        __nv_bfloat16 *dst = out + row * PI0_PATCH_PIECES * patch_dim + e;
#pragma unroll
        for (int b = 0; b < PI0_PATCH_PIECES; b++) dst[(size_t)b * patch_dim] = piece[x_piece[b]];
        /* NaN and infinity are the floats whose exponent bits are all ones (bits, not isfinite: fast-math safe) */
        if (nonfinite && (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) atomicOr(&nonfinite[image], 1);
    }
}

static __global__ void add_bias_pos_kernel(float *x, const float *bias, const float *pos, int rows, int positions,
                                           int dim) {
    size_t total = (size_t)rows * dim;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        size_t row = i / dim, col = i % dim;
        x[i] += bias[col] + pos[(row % positions) * dim + col];
    }
}

static __global__ void assemble_prefix_kernel(float *x, const int *src, int dim, const float *vision,
                                              const __nv_bfloat16 *embed, float scale) {
    int from = src[blockIdx.x];
    float *row = x + (size_t)blockIdx.x * dim;
    if (from >= 0) {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) row[j] = vision[(size_t)from * dim + j];
    } else {
        const __nv_bfloat16 *e = embed + (size_t)(-from - 1) * dim;
        for (int j = threadIdx.x; j < dim; j += blockDim.x) row[j] = __bfloat162float(e[j]) * scale;
    }
}

/* One block per (row, 256 outputs); the input row (k floats) is staged in shared memory. Rows go along x,
 * whose 2^31 - 1 blocks take any batch x horizon (y stops at 65535). */
static __device__ __forceinline__ void small_k_row(float *out_f32, __nv_bfloat16 *out_bf16, const float *in,
                                                   const __nv_bfloat16 *w, const float *bias, int row, int k, int n,
                                                   int swish) {
    extern __shared__ float x[];
    for (int j = threadIdx.x; j < k; j += blockDim.x) x[j] = in[(size_t)row * k + j];
    __syncthreads();
    int col = blockIdx.y * blockDim.x + threadIdx.x;
    if (col >= n) return;
    float acc = bias ? bias[col] : 0.0f;
    const __nv_bfloat16 *wr = w + (size_t)col * k;
    for (int j = 0; j < k; j++) acc += x[j] * __bfloat162float(wr[j]);
    if (swish) acc = acc / (1.0f + __expf(-acc));
    if (out_f32) out_f32[(size_t)row * n + col] = acc;
    if (out_bf16) out_bf16[(size_t)row * n + col] = __float2bfloat16(acc);
}

static __global__ void linear_small_k_kernel(float *out_f32, __nv_bfloat16 *out_bf16, const float *in,
                                             const __nv_bfloat16 *w, const float *bias, int k, int n, int swish) {
    small_k_row(out_f32, out_bf16, in, w, bias, blockIdx.x, k, n, swish);
}

/* Blocks x < horizon: the action-time MLP's hidden rows; block x = horizon: the state token into the suffix's row 0. */
static __global__ void action_time_in_kernel(__nv_bfloat16 *hidden, float *suffix, __nv_bfloat16 *suffix_bf16,
                                             const float *state_token, const float *x_t, const __nv_bfloat16 *w,
                                             const float *bias, int horizon, int action_dim, int width) {
    if ((int)blockIdx.x < horizon) return small_k_row(NULL, hidden, x_t, w, bias, blockIdx.x, action_dim, width, 1);
    int col = blockIdx.y * blockDim.x + threadIdx.x;
    if (col >= width) return;
    suffix[col] = state_token[col];
    suffix_bf16[col] = __float2bfloat16(state_token[col]);
}

static __global__ void assemble_suffix_kernel(float *suffix, __nv_bfloat16 *suffix_bf16, const float *state,
                                              const float *actions, int horizon, int width) {
    int b = blockIdx.y, i = blockIdx.x, lead = state != NULL; /* row i < lead: the state token, else action i - lead */
    const float *src = i < lead ? state + (size_t)b * width : actions + ((size_t)b * horizon + i - lead) * width;
    size_t row = ((size_t)b * (horizon + lead) + i) * width;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        suffix[row + j] = src[j];
        suffix_bf16[row + j] = __float2bfloat16(src[j]);
    }
}

static __global__ void spin_kernel(long long nanoseconds) {
    unsigned long long start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (unsigned long long now = start; now - start < (unsigned long long)nanoseconds;)
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
}

/* Grid size for grid-stride loops: enough blocks to fill the GPU, never more than the work. */
static unsigned grid_for(size_t n, int threads) {
    size_t blocks = (n + threads - 1) / threads;
    return (unsigned)(blocks < 4096 ? (blocks ? blocks : 1) : 4096);
}

/* Launches `kernel` over `grid` blocks of 256 threads for a call over `rows` rows: as a programmatic dependent up to
 * PI0_CUDA_DEPENDENT_ROWS rows unless `plain` (kernels.h), plainly otherwise. Such a kernel triggers its own
 * dependents and waits for its predecessors first thing. */
static_assert(NORM_THREADS == 256, "the norms' blocks are launch_for_rows's");
template <typename... Args>
static cudaError_t launch_for_rows(void (*kernel)(Args...), unsigned grid, int rows, int plain, cudaStream_t stream,
                                   Args... args) {
    cudaLaunchAttribute attr;
    cudaLaunchConfig_t cfg = launch_config(dim3(grid), dim3(256), 0, stream);
    if (!plain && rows <= PI0_CUDA_DEPENDENT_ROWS) make_dependent(&cfg, &attr);
    return cudaLaunchKernelEx(&cfg, kernel, args...);
}

extern "C" {

cudaError_t pi0_cuda_layernorm(pi0_bf16 *out, const float *in, int rows, int dim, const float *w, const float *b,
                               float eps, cudaStream_t stream) {
    if (rows > 0)
        layernorm_kernel<<<(rows + LN_ROWS - 1) / LN_ROWS, 32 * LN_ROWS, 0, stream>>>(
            as_bf16(out), in, rows, dim, w, b, eps, layernorm_in_registers(dim, in, out, w, b));
    return cudaGetLastError();
}

cudaError_t pi0_cuda_rmsnorm(pi0_bf16 *out, const float *in, const int *in_rows, int rows, int dim, const float *w,
                             float eps, int plain_launch, cudaStream_t stream) {
    return pi0_cuda_rmsnorm_mod(out, in, in_rows, rows, dim, w, NULL, eps, plain_launch, stream);
}

cudaError_t pi0_cuda_rmsnorm_mod(pi0_bf16 *out, const float *in, const int *in_rows, int rows, int dim, const float *scale,
                                 const float *shift, float eps, int plain_launch, cudaStream_t stream) {
    if (rows > 0)
        return launch_for_rows(rmsnorm_kernel, (unsigned)rows, rows, plain_launch, stream, as_bf16(out), in, in_rows, dim,
                               scale, shift, eps, (int)norm_in_registers(dim, in, out, scale, shift));
    return cudaGetLastError();
}

int pi0_cuda_add_parts_rmsnorm_fits(int dim, int num_parts) {
    return norm_row_fits(dim) && num_parts >= 1 && num_parts <= MAX_PARTS;
}

cudaError_t pi0_cuda_add_parts_rmsnorm(pi0_bf16 *out, float *x, const float *parts, int num_parts, const float *gate,
                                       int rows, int dim, const float *w, const float *shift, float eps, int plain_launch,
                                       cudaStream_t stream) {
    if (!pi0_cuda_add_parts_rmsnorm_fits(dim, num_parts) || !norm_in_registers(dim, x, out, w, shift) ||
        !norm_in_registers(dim, parts, out, gate, NULL))
        return cudaErrorInvalidValue;
    if (rows > 0)
        return launch_for_rows(add_parts_rmsnorm_kernel, (unsigned)rows, rows, plain_launch, stream, as_bf16(out), x, parts,
                               num_parts, (size_t)rows * dim, gate, dim, w, shift, eps);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_one_plus_bf16(pi0_bf16 *out, const float *scale, size_t n, cudaStream_t stream) {
    if (n) one_plus_bf16_kernel<<<grid_for(n, 256), 256, 0, stream>>>(as_bf16(out), scale, n);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_weight_rows(pi0_bf16 *dst, size_t pitch, const void *src, int src_type, size_t rows, size_t cols,
                                 const float *fold, cudaStream_t stream) {
    size_t n = rows * cols;
    if (n) weight_rows_kernel<<<grid_for(n, 256), 256, 0, stream>>>(dst, pitch, src, src_type, rows, cols, fold);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_add_gated(float *x, const float *y, const float *gate, int rows, int dim, cudaStream_t stream) {
    size_t n = (size_t)rows * dim;
    if (n) return launch_for_rows(add_gated_kernel, grid_for(n, 256), rows, 0, stream, x, y, gate, n, dim);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_gelu_mul(pi0_bf16 *out, const pi0_bf16 *in, int rows, int mlp, cudaStream_t stream) {
    size_t n = (size_t)rows * mlp;
    int vec4 = n % 4 == 0 && (uintptr_t)in % 16 == 0 && (uintptr_t)out % 8 == 0;
    if (n)
        return launch_for_rows(gelu_mul_kernel, grid_for(vec4 ? n / 4 : n, 256), rows, 0, stream, as_bf16(out), as_bf16(in),
                               n, vec4);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_rope_qkv(pi0_bf16 *qkv, int rows, int heads, int kv_heads, int head_dim, const int *positions,
                              const int *cache_rows, pi0_bf16 *cache_k, pi0_bf16 *cache_v, const float *rope_cos,
                              const float *rope_sin, cudaStream_t stream) {
    const int vec = head_dim % 8 == 0 && (uintptr_t)qkv % 16 == 0 && (uintptr_t)cache_k % 16 == 0 &&
                    (uintptr_t)cache_v % 16 == 0 && (uintptr_t)rope_cos % 16 == 0 && (uintptr_t)rope_sin % 16 == 0;
    if (rows > 0)
        return launch_for_rows(rope_qkv_kernel, (unsigned)rows, rows, 0, stream, as_bf16(qkv), heads, kv_heads, head_dim,
                               positions, cache_rows, as_bf16(cache_k), as_bf16(cache_v), rope_cos, rope_sin, vec);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_frames_to_images(float *images, const pi0_frame_job *jobs, int n, int image_size,
                                      cudaStream_t stream) {
    if (n > 0) frames_to_images_kernel<<<dim3(image_size, n), 256, 0, stream>>>(images, jobs, image_size);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_im2col(pi0_bf16 *out, const float *images, int n, int image_size, int patch, int *nonfinite,
                            cudaStream_t stream) {
    size_t total = (size_t)n * image_size * image_size * 3;
    if (total)
        im2col_kernel<<<grid_for(total, 256), 256, 0, stream>>>(as_bf16(out), images, n, image_size, patch, nonfinite);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_add_bias_pos(float *x, const float *bias, const float *pos, int rows, int positions, int dim,
                                  cudaStream_t stream) {
    size_t total = (size_t)rows * dim;
    if (total) add_bias_pos_kernel<<<grid_for(total, 256), 256, 0, stream>>>(x, bias, pos, rows, positions, dim);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_assemble_prefix(float *x, const int *src, int rows, int dim, const float *vision,
                                     const pi0_bf16 *embed, float scale, cudaStream_t stream) {
    if (rows > 0) assemble_prefix_kernel<<<rows, 256, 0, stream>>>(x, src, dim, vision, as_bf16(embed), scale);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_linear_small_k(float *out_f32, pi0_bf16 *out_bf16, const float *in, const pi0_bf16 *w,
                                    const float *bias, int rows, int k, int n, int swish, cudaStream_t stream) {
    if (k > PI0_CUDA_SMALL_K_MAX || (!out_f32 && !out_bf16)) return cudaErrorInvalidValue;
    if (rows > 0) {
        dim3 grid((unsigned)rows, (unsigned)((n + 255) / 256));
        linear_small_k_kernel<<<grid, 256, (size_t)k * sizeof(float), stream>>>(out_f32, as_bf16(out_bf16), in, as_bf16(w),
                                                                              bias, k, n, swish);
    }
    return cudaGetLastError();
}

cudaError_t pi0_cuda_action_time_in(pi0_bf16 *hidden, float *suffix, pi0_bf16 *suffix_bf16, const float *state_token,
                                    const float *x_t, const pi0_bf16 *w, const float *bias, int horizon, int action_dim,
                                    int width, cudaStream_t stream) {
    if (action_dim > PI0_CUDA_SMALL_K_MAX) return cudaErrorInvalidValue;
    dim3 grid((unsigned)horizon + (state_token != NULL), (unsigned)((width + 255) / 256)); /* the last: the state's */
    action_time_in_kernel<<<grid, 256, (size_t)action_dim * sizeof(float), stream>>>(
        as_bf16(hidden), suffix, as_bf16(suffix_bf16), state_token, x_t, as_bf16(w), bias, horizon, action_dim, width);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_assemble_suffix(float *suffix, pi0_bf16 *suffix_bf16, const float *state, const float *actions,
                                     int batch, int horizon, int width, cudaStream_t stream) {
    if (batch > 0) assemble_suffix_kernel<<<dim3((unsigned)horizon + (state != NULL), (unsigned)batch), 256, 0, stream>>>(
        suffix, as_bf16(suffix_bf16), state, actions, horizon, width);
    return cudaGetLastError();
}

cudaError_t pi0_cuda_spin(int microseconds, cudaStream_t stream) {
    spin_kernel<<<1, 1, 0, stream>>>(1000LL * microseconds);
    return cudaGetLastError();
}

} /* extern "C" */
