/*
 * kernels.h - the CUDA backend's own kernels (everything but GEMMs and attention), as C launchers.
 *
 * Numerics (docs/model.md#precision, openpi's bf16 path or better): the residual streams stay float32; norms
 * compute their statistics in float32 and hand bfloat16 to the GEMMs; RoPE, softmax, GELU and the
 * time MLP run in float32. Every launcher enqueues on `stream` and returns the launch error.
 */
#ifndef PI0_CUDA_KERNELS_H
#define PI0_CUDA_KERNELS_H

#include <cuda_runtime_api.h>
#include <stdint.h>

#include "cuda/bf16.h"
#include "model/image.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out (rows, dim) bf16 = LayerNorm(in) * w + b; in float32. */
cudaError_t pi0_cuda_layernorm(pi0_bf16 *out, const float *in, int rows, int dim, const float *w, const float *b,
                               float eps, cudaStream_t stream);

/*
 * The RMSNorm, gated-residual, GELU x up and RoPE launchers below launch as programmatic dependents (device.cuh)
 * when the call covers at most PI0_CUDA_DEPENDENT_ROWS rows: a denoise step on the cuBLASLt path (horizon 50, a few
 * samples), where each follows or precedes a GEMM of as few rows and its launch would otherwise be a full boundary
 * (a layer at 51 rows 46.0 -> 45.4 us, bench/NOTES.md session 20). Larger calls (the prefix) launch plainly: there a
 * dependent's blocks would wait on multiprocessors the GEMM before it still needs (session 4). `plain_launch` forces a
 * plain launch: the first kernel after a wait on another stream's event, whose edge would otherwise be programmatic
 * (the first denoise step beside the prefix, bench/NOTES.md session 19).
 */
#define PI0_CUDA_DEPENDENT_ROWS 64

/* out row i (bf16) = RMSNorm(in row r) * (1 + w), r = in_rows ? in_rows[i] : i; w NULL: no weight
 * (it was folded into the next Linear). */
cudaError_t pi0_cuda_rmsnorm(pi0_bf16 *out, const float *in, const int *in_rows, int rows, int dim, const float *w,
                             float eps, int plain_launch, cudaStream_t stream);

/* The same with Pi0.5's adaptive norm: RMSNorm(in row) * (1 + scale) + shift (docs/model.md#adaptive-rmsnorm). */
cudaError_t pi0_cuda_rmsnorm_mod(pi0_bf16 *out, const float *in, const int *in_rows, int rows, int dim, const float *scale,
                                 const float *shift, float eps, int plain_launch, cudaStream_t stream);

/* x (rows, dim) += gate * (parts[0] + ... + parts[num_parts - 1]) (float32 (rows, dim) matrices, one after another:
 * the split-K partial sums of a GEMM, gemm.h's k_parts, added in that order; gate per column, NULL: 1), then out =
 * RMSNorm(x) * (1 + w) + shift (shift NULL: none; Pi0.5's adaptive norm with w its scale): a GEMM's residual add
 * inside the norm that reads x next, without the GEMM's own reduction (forward.c). Only where
 * pi0_cuda_add_parts_rmsnorm_fits (cudaErrorInvalidValue otherwise, or for misaligned pointers). `plain_launch` as
 * pi0_cuda_rmsnorm's. */
int pi0_cuda_add_parts_rmsnorm_fits(int dim, int num_parts);
cudaError_t pi0_cuda_add_parts_rmsnorm(pi0_bf16 *out, float *x, const float *parts, int num_parts, const float *gate,
                                       int rows, int dim, const float *w, const float *shift, float eps, int plain_launch,
                                       cudaStream_t stream);

/* out[i] = bf16(1 + scale[i]) for i < n: an adaptive norm's scale as the skinny Linears take it (skinny.h). */
cudaError_t pi0_cuda_one_plus_bf16(pi0_bf16 *out, const float *scale, size_t n, cudaStream_t stream);

/* x (rows, dim) += gate * y, gate per column: Pi0.5's gated residual. */
cudaError_t pi0_cuda_add_gated(float *x, const float *y, const float *gate, int rows, int dim, cudaStream_t stream);

/* out (rows, mlp) = gelu_tanh(gate) * up, where in (rows, 2 mlp) holds the pairs (gate_j, up_j)
 * interleaved (the fused gate|up weight's row order, see weights.c). */
cudaError_t pi0_cuda_gelu_mul(pi0_bf16 *out, const pi0_bf16 *in, int rows, int mlp, cudaStream_t stream);

/*
 * RoPE on the q and k heads of fused qkv rows (rows, (heads + 2 kv_heads) * head_dim), row r at
 * position positions[r]; q is rotated in place, k (rotated) and v are stored into cache row
 * cache_rows[r] of cache_k / cache_v (kv_heads * head_dim each). rope_cos/rope_sin are
 * (max_pos, head_dim / 2) tables.
 */
cudaError_t pi0_cuda_rope_qkv(pi0_bf16 *qkv, int rows, int heads, int kv_heads, int head_dim, const int *positions,
                              const int *cache_rows, pi0_bf16 *cache_k, pi0_bf16 *cache_v, const float *rope_cos,
                              const float *rope_sin, cudaStream_t stream);

/*
 * One camera frame made model input on the device: openpi's resize_with_pad (Pillow's bilinear filter in
 * its fixed-point arithmetic, model/image.h) and the [-1, 1] scaling, bit for bit as model/image.c does on
 * the host. The host computes the geometry and the per-axis weights (pi0_axis_weights) and copies them with
 * the frame; this describes where they are.
 */
typedef struct {
    const uint8_t *pixels;                 /* (height, width, 3); NULL: a masked camera, zeros */
    const int *x_first, *x_count, *y_first, *y_count;
    const int32_t *x_weights, *y_weights;  /* (new_w, x_taps) and (new_h, y_taps); NULL: no pass on that axis */
    int height, width, new_h, new_w, pad_y, pad_x, x_taps, y_taps;
} pi0_frame_job;

/* images (n, S, S, 3) float from the n frames of `jobs` (device memory, read when the kernel runs: a graph
 * that captured this call resizes whatever the jobs say at each replay). */
cudaError_t pi0_cuda_frames_to_images(float *images, const pi0_frame_job *jobs, int n, int image_size,
                                      cudaStream_t stream);

/*
 * The patch embedding is float32 in openpi; here it runs on bf16 tensor cores, near float32's accuracy. Every float32
 * operand is split into three bf16 pieces, x = x0 + x1 + x2 exactly (util/half.h's f32_to_bf16x3), and x w into the
 * six products whose pieces' orders sum to at most 2: x0 w0 + x0 w1 + x0 w2 + x1 w0 + x1 w1 + x2 w0. Each product of
 * two bf16 values is exact in float32, the three left out are 2^-24 of x w or less, and the sum is accumulated in
 * float32 by the tensor cores: 6.5e-6 from the exact product at SigLIP's shape on an H200 (the accumulation over
 * k = 3528 is all of it: the six products summed exactly are 5e-9 off), where a plain bf16 product is ~2e-3 and the next
 * op rounds to bf16 (test_kernels bounds it at 1e-5, as it did cuBLASLt's float32 product). As one GEMM of k = PI0_PATCH_PIECES x 3 p^2: patches laid out
 * [x0 x0 x0 x1 x1 x2] along k against weights laid out [w0 w1 w2 w0 w1 w0] (cuda/weights.c); for two images it
 * replaces cuBLASLt's float32 product (27 us alone), vision 1.50-1.51 -> 1.49 ms (bench/NOTES.md, session 41).
 */
#define PI0_PATCH_PIECES 6

/* Which piece of x, and which of w, each of the PI0_PATCH_PIECES blocks along k holds (initializers of int[6]). */
#define PI0_PATCH_X_PIECES {0, 0, 0, 1, 1, 2}
#define PI0_PATCH_W_PIECES {0, 1, 2, 0, 1, 0}

/* The patch embedding's float32 weights (rows, cols) as its GEMM takes them: each row PI0_PATCH_PIECES blocks of cols,
 * [w0 w1 w2 w0 w1 w0], each piece held as the float it equals (rounded to bf16 exactly). malloc's; NULL when out of
 * memory. Host code (cuda/weights.c). */
float *pi0_cuda_patch_weight_pieces(const float *w, size_t rows, size_t cols);

/* Patches of HWC images (n, S, S, 3) into rows (n * (S/p)^2, PI0_PATCH_PIECES x 3 p p) of bf16 pieces (above), each
 * patch flattened as (channel, row, col). With `nonfinite` (n ints, device memory), nonfinite[i] is made non-zero where
 * image i holds a NaN or infinity (and left as it was elsewhere: the caller zeroes it). */
cudaError_t pi0_cuda_im2col(pi0_bf16 *out, const float *images, int n, int image_size, int patch, int *nonfinite,
                            cudaStream_t stream);

/* x (rows, dim) += bias + pos[row % positions]. */
cudaError_t pi0_cuda_add_bias_pos(float *x, const float *bias, const float *pos, int rows, int positions, int dim,
                                  cudaStream_t stream);

/* Prefix row r = src[r] >= 0 ? vision[src[r]] : embed[-src[r] - 1] * scale (bf16 table). */
cudaError_t pi0_cuda_assemble_prefix(float *x, const int *src, int rows, int dim, const float *vision,
                                     const pi0_bf16 *embed, float scale, cudaStream_t stream);

/* out (rows, n) = act(in (rows, k) float32 . w (n, k)^T + bias): a Linear with a tiny input width
 * (the 32 action dims; Pi0.5's time MLP, once per step count: the expert's width). act = 1: swish.
 * Written to out_f32 and (rounded) to out_bf16, each when not NULL (one at least). k up to PI0_CUDA_SMALL_K_MAX
 * (cudaErrorInvalidValue past it): the input row is staged in the 48 KB of shared memory a kernel has without
 * opting in to more. */
#define PI0_CUDA_SMALL_K_MAX (48 * 1024 / 4)
cudaError_t pi0_cuda_linear_small_k(float *out_f32, pi0_bf16 *out_bf16, const float *in, const pi0_bf16 *w,
                                    const float *bias, int rows, int k, int n, int swish, cudaStream_t stream);

/* Pi0's first kernel of a batch-1 denoise step on the skinny path (forward.c's suffix_tokens): hidden
 * (horizon, width) bf16 = swish(x_t (horizon, action_dim) . w (width, action_dim)^T + bias), and the state token
 * (width), unless NULL (a step without it), copied to the suffix's row 0, float32 and bf16 (the action rows come
 * from the next Linear). */
cudaError_t pi0_cuda_action_time_in(pi0_bf16 *hidden, float *suffix, pi0_bf16 *suffix_bf16, const float *state_token,
                                    const float *x_t, const pi0_bf16 *w, const float *bias, int horizon, int action_dim,
                                    int width, cudaStream_t stream);

/* Pi0's suffix (B S, W), S = H + 1: row b S = state[b] and rows b S + 1 + i = actions[b H + i], also rounded to
 * bf16 into suffix_bf16 (the input of the skinny Linears, skinny.h); with state NULL (a step without the state
 * token) S = H and the rows are the actions'. (Pi0.5's suffix is its action tokens: forward.c writes them in
 * place.) */
cudaError_t pi0_cuda_assemble_suffix(float *suffix, pi0_bf16 *suffix_bf16, const float *state, const float *actions,
                                     int batch, int horizon, int width, cudaStream_t stream);

/* Load time: `rows` rows of `cols` checkpoint values (src_type 0: float32, 1: bfloat16, 2: float16) to bf16
 * rows `pitch` rows apart in dst (pitch 2 interleaves two tensors), each value first multiplied by
 * 1 + fold[col] in float32 when fold is not NULL; rounded as util/half.h's f32_to_bf16, so a bf16
 * checkpoint's weights arrive bit for bit. */
cudaError_t pi0_cuda_weight_rows(pi0_bf16 *dst, size_t pitch, const void *src, int src_type, size_t rows, size_t cols,
                                 const float *fold, cudaStream_t stream);

/* Keeps the GPU busy for about `microseconds`: queued before a timed run, it lets the host enqueue
 * every repetition first, so the events measure GPU time rather than launch overhead. */
cudaError_t pi0_cuda_spin(int microseconds, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
