/*
 * skinny.h - Linear layers over a few rows (the denoise loop's 11 tokens at batch 1), fused with
 * what surrounds them in a Gemma block: out = epilogue(scale_m * x (m, k) . w (n, k)^T).
 *
 * x is bf16 with row stride k; w keeps PyTorch's (out, in) layout. The row scale is 1, or with
 * rms_norm the RMSNorm factor 1 / sqrt(mean_k x^2 + eps) of the row: RMSNorm's (1 + weight) is
 * folded into w at load (docs/model.md#rmsnorm-folding) and the per-row factor commutes with the product, so the norm
 * needs no kernel of its own and no extra pass over x. Pi0.5's adaptive norm, x * r * (1 + scale) + shift
 * with a per-step scale and shift (docs/model.md#adaptive-rmsnorm), is the same product with x scaled by
 * in_scale = bf16(1 + scale) column by column before the multiply, and shift . w^T (col_bias, one float per output
 * column, computed once per shape) added after the row factor. Epilogues:
 *   SKINNY_STORE     out (m, n) bf16, and out_f32 (m, n) float32 when given (the denoise step's action tokens:
 *                    the suffix rows in both forms)
 *   SKINNY_GELU_MUL  out (m, n / 2) bf16 = gelu_tanh(gate) * up, w's rows interleaved (gate_j, up_j)
 *   SKINNY_RESIDUAL  residual (m, n) float32 += result (gate * result with a gate vector: Pi0.5's gated
 *                    residual), and residual_bf16 = the new rows in bf16 (the next skinny layer's x)
 *   SKINNY_ROPE_QKV  a Q|K|V projection (n = (heads + 2 kv_heads) head_dim) with rotate-half RoPE at
 *                    positions[m] on the float32 result: q to out (row stride n; out's k and v
 *                    columns are not written), k and v to row cache_rows[m] of cache_k / cache_v
 *                    (rows of kv_heads * head_dim). This is pi0_cuda_rope_qkv fused in, one launch
 *                    and one bf16 rounding fewer.
 * bf16 operands, float32 accumulation, statistics and epilogue; deterministic (fixed summation
 * order, no atomics).
 *
 * Launched as programmatic dependents (device.cuh), the kernels read w, in_scale, positions, cache_rows and the
 * RoPE tables before waiting for the kernel before them: those must not be written by a kernel of the same
 * chain (they are weights, per-step constants and the graph's inputs). The rest is read after the wait.
 */
#ifndef PI0_CUDA_SKINNY_H
#define PI0_CUDA_SKINNY_H

#include <cuda_runtime_api.h>

#include "cuda/bf16.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { SKINNY_STORE, SKINNY_GELU_MUL, SKINNY_RESIDUAL, SKINNY_ROPE_QKV };

/* Rows up to which the backend prefers these kernels to cuBLASLt: a block takes one or two 16-row tiles. With four
 * (44-51 rows) they were slower than cuBLASLt: every block reads all of x, and at 51 rows those copies are ~50 MB a
 * Linear through L2 (bench/NOTES.md, session 16). */
#define SKINNY_MAX_ROWS 32

/* The warps a block of the expert's o_proj and Pi0's down takes up to SKINNY_NARROW_MAX_ROWS rows
 * (skinny_args.max_warps; forward.c, and the lab as forward.c runs Pi0's layer): 8 warps of 8 chunks fit on a
 * multiprocessor beside the last blocks of the kernel before (the attention's merge, the 4-warp gate|up), so their
 * weights start streaming under its tail. Alone each is slower (down 5.09 -> 5.83 us), in the layer they gain (25.0 ->
 * 24.1 us on an H100, the seed's denoise 4.12 -> 3.99 ms). Pi0.5 takes it for o_proj only: there o_proj alone gains
 * (denoise 4.01-4.02 -> 3.93 ms on an H200), down alone less (3.95) and both lose (4.06); why is not known
 * (bench/NOTES.md, sessions 34, 35 and 47). */
#define SKINNY_NARROW_WARPS 8
#define SKINNY_NARROW_MAX_ROWS 16

typedef struct {
    int m, n, k;
    const pi0_bf16 *x, *w;
    int rms_norm;
    float eps;
    const pi0_bf16 *in_scale; /* (k) bf16 of 1 + scale: x is multiplied by it before the product; NULL: not */
    const float *col_bias;   /* (n) added to the result after the row factor; NULL: none */
    int epilogue;
    pi0_bf16 *out;           /* STORE, GELU_MUL, ROPE_QKV */
    float *out_f32;          /* STORE: the float32 result as well; NULL: not */
    float *residual;         /* RESIDUAL */
    pi0_bf16 *residual_bf16; /* RESIDUAL */
    const float *gate;       /* RESIDUAL: (n) the result is multiplied by it before the add; NULL: by 1 */
    /* ROPE_QKV */
    int heads, kv_heads, head_dim;       /* head_dim a multiple of 16 */
    const int *positions, *cache_rows;   /* per row */
    const float *rope_cos, *rope_sin;    /* (position, head_dim / 2) */
    pi0_bf16 *cache_k, *cache_v;
    /* Launched plainly instead of as a programmatic dependent: for a kernel right after a wait on another stream's
     * event, which stream capture would also make a programmatic edge (to that stream's kernel, whose writes this
     * kernel's successors may read before their own wait). */
    int plain_launch;
    /* > 0: the split of the multiprocessor's L1 and shared memory this launch asks for, in percent of the largest
     * shared memory (a hint to the block scheduler, cudaLaunchAttributePreferredSharedMemoryCarveout); 0: the
     * driver's choice. */
    int smem_carveout;
    /* > 0: at most this many warps a block (up to 16 otherwise). A block becomes resident only where the kernel
     * before has left it registers, and its weight loads wait with it: 16 warps of down's 126 registers take an SM's
     * whole register file, 8 can start beside that kernel's last blocks (SKINNY_NARROW_WARPS). */
    int max_warps;
} skinny_args;

/*
 * The denoise loop's step boundary at batch 1, one kernel where there were two or three: the Euler update of the step
 * that ended, then the next step's input Linear from the updated x_t (the first of Pi0's action-time MLP, Pi0.5's
 * action_in_proj).
 *   x_t_next = x_t + gate * (r . x . out_w^T + out_bias)   r: x's RMSNorm factor, x scaled by in_scale first
 *                                                          (Pi0.5's adaptive norm) as skinny_args describes
 *   next     = act(x_t_next . next_w^T + next_bias)      act: swish or none; next_f32 and/or next_bf16 (rows, next_n)
 * The update is the skinny Linear's (n = action_dim, k = width, rms_norm, SKINNY_RESIDUAL) to the bit where that kernel
 * splits k the same way (Pi0's and Pi0.5's width, 1024, which test_skinny checks; other widths within its tolerance),
 * and the next Linear is pi0_cuda_linear_small_k's to the bit; every block computes the whole update (its 64 KB of weights at Pi0's dims
 * loaded before the wait) and a slice of the next Linear. Without next_w, the update alone, which may
 * write x_t in place; with it, x_t_next must be another buffer (the blocks all read x_t). A programmatic dependent
 * unless plain_launch, as skinny_args says.
 */
typedef struct {
    int rows, width, action_dim;  /* rows <= 16, action_dim <= 32 (a multiple of 8 with next_w) */
    const pi0_bf16 *x;            /* (rows, width) the expert's action rows */
    const pi0_bf16 *out_w;        /* (action_dim, width) action_out_proj (Pi0: the final norm's 1 + w folded in) */
    const pi0_bf16 *in_scale;     /* (width) Pi0.5: bf16(1 + scale) of the final norm; NULL: none */
    const float *out_bias, *gate; /* (action_dim) each */
    float eps;
    const float *x_t;             /* (rows, action_dim) */
    float *x_t_next;              /* (rows, action_dim) */
    const pi0_bf16 *next_w;       /* (next_n, action_dim); NULL: the update only */
    const float *next_bias;       /* (next_n) or NULL */
    int next_n, swish;
    float *next_f32;              /* (rows, next_n) or NULL */
    pi0_bf16 *next_bf16;          /* (rows, next_n) or NULL */
    int plain_launch;
} skinny_euler_args;

int pi0_cuda_skinny_euler_supported(const skinny_euler_args *a);

/* cudaErrorInvalidValue when not supported, else the launch error. */
cudaError_t pi0_cuda_skinny_euler(const skinny_euler_args *a, cudaStream_t stream);

/* Whether the kernels take these arguments: k a multiple of 8, 16-byte aligned x and w, n even for
 * GELU_MUL, n matching the heads for ROPE_QKV, the outputs of the epilogue present. (Any m works; past 32 rows w is re-read per 32.) */
int pi0_cuda_skinny_supported(const skinny_args *a);

/* Whether the four Linears of a Gemma block with these dims (forward.c's gemma_block_skinny: QKV with RoPE,
 * o_proj, gate|up, down) all take these kernels, given 16-byte aligned buffers and weights (the backend's
 * are 256): head_dim a multiple of 16 (ROPE_QKV), every k (width, heads x head_dim, mlp_dim) a multiple
 * of 8. It depends on the dims alone, so it is the same for every layer and step and a stack never mixes
 * the two paths (the cuBLASLt one does not keep the bf16 copy of x that these read). */
int pi0_cuda_skinny_block_supported(int width, int mlp_dim, int head_dim);

/* The dynamic shared memory a launch of these (supported) arguments asks for, at most 48 KB, and in *staged_passes (when
 * not NULL) how many of a warp's passes after its first have their weights copied into it before the wait (skinny.cu).
 * Host arithmetic only: no GPU needed. */
size_t pi0_cuda_skinny_shared_bytes(const skinny_args *a, int *staged_passes);

/* cudaErrorInvalidValue when not supported, else the launch error. */
cudaError_t pi0_cuda_skinny_linear(const skinny_args *a, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
