/*
 * attention.h - fused multi-head attention (MQA/GQA/MHA) on the GPU, bf16 in and out.
 *
 * One call runs many independent attention problems ("segments", see attn_segment in model/plan.h)
 * in one launch: the ViT's images, the prefix of every sample, the denoise suffix of every sample.
 * It computes the same function as cpu_attention (src/cpu/ops.h), with bf16 inputs and outputs and
 * fp32 logits, softmax and accumulation; nothing of size num_q x num_k ever reaches device memory.
 */
#ifndef PI0_CUDA_ATTENTION_H
#define PI0_CUDA_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "model/plan.h" /* attn_segment */

#include "cuda/bf16.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PI0_CUDA_ATTN_MAX_HEAD_DIM 256 /* head dims are multiples of 8 up to this (Gemma's 256) */

/*
 * For every segment s (the array lives in DEVICE memory), query i in [0, num_q) and head h in
 * [0, num_heads):
 *
 *   out[(q_row + i) * ldo + h * head_dim + d] =
 *       sum_j softmax_j(scale * q_i,h . k_j,g) * v_j,g[d]      over keys j in [0, visible(i)),
 *
 *   visible(i) = (i == 0 && state_keys > 0) ? min(state_keys, num_k) : num_k,  g = h / (num_heads / num_kv_heads),
 *   q_i,h at q + (q_row + i) * ldq + h * head_dim, k_j,g / v_j,g at k / v + (k_row + j) * ldkv + g * head_dim.
 *
 * Nothing else of `out` is written: segments with num_q == 0 or num_k == 0 write nothing.
 * max_num_q must bound num_q over all segments; it sizes the grid, so the call can be captured in a
 * CUDA graph and replayed while the segments' contents change (as long as max_num_q still holds).
 * Queries of different segments must not write the same output rows concurrently (they would race).
 *
 * Limits: head_dim a multiple of 8 up to PI0_CUDA_ATTN_MAX_HEAD_DIM (Pi0's 72 and 256 at full speed, others
 * padded, attention.cu); num_heads a multiple of num_kv_heads, num_kv_heads <= 65535; ldq >= num_heads * head_dim,
 * ldkv >= num_kv_heads * head_dim, ldo >= num_heads * head_dim. Any alignment works; 16-byte aligned
 * base pointers with leading dimensions that are multiples of 8 take the fast (16-byte, asynchronous
 * copy) path. Returns cudaErrorInvalidValue for arguments outside these limits, cudaSuccess with no
 * launch when num_segments or max_num_q is 0, else the launch error.
 */
cudaError_t pi0_cuda_attention(pi0_bf16 *out, int ldo, const pi0_bf16 *q, int ldq, const pi0_bf16 *k,
                               const pi0_bf16 *v, int ldkv, const attn_segment *segments, int num_segments,
                               int max_num_q, int num_heads, int num_kv_heads, int head_dim, float scale,
                               cudaStream_t stream);

/*
 * The same with a float32 workspace (device memory, 16-byte aligned): when it holds at least
 * pi0_cuda_attention_workspace(num_segments, num_kv_heads, head_dim) bytes, no split is forced, and the call is
 * small (num_heads / num_kv_heads * max_num_q <= 128 virtual rows, num_segments * num_kv_heads <= 16: a small-batch
 * denoise step), the keys are spread over 32 blocks per problem (and group of query rows; 20 at head dim 256 when
 * max_num_k, a bound on every segment's num_k, is at most 640: 0 means unknown, and any value gives the same
 * result) and the partial results merged by a second kernel (attention.cu, "few queries"); else it runs
 * pi0_cuda_attention's kernels. The workspace must not be used by anything else while the call runs. Either way its
 * kernels launch as programmatic dependents (sm_90+), so it belongs after a kernel of ours (a cuBLASLt GEMM before
 * it would share its multiprocessors with blocks waiting for it: bench/NOTES.md, session 4), and they read a
 * segment's keys before its last num_q ones while the kernel before them may still run: that kernel (and those it
 * depends on) must not write them. A denoise step meets this: the prefix's keys were written before the step, the
 * kernel before writes only the suffix's (the segment's last num_q keys). max_sms is the number of multiprocessors
 * the few-queries partials may count on (0: the device's): they split a small batch's rows into as many groups as
 * keep their blocks in one wave there, so a call beside other work passes what that work leaves (forward.c's first
 * step beside the prefix). Any value gives the same result.
 */
cudaError_t pi0_cuda_attention_ws(pi0_bf16 *out, int ldo, const pi0_bf16 *q, int ldq, const pi0_bf16 *k,
                                  const pi0_bf16 *v, int ldkv, const attn_segment *segments, int num_segments,
                                  int max_num_q, int max_num_k, int num_heads, int num_kv_heads, int head_dim,
                                  float scale, float *workspace, size_t workspace_bytes, int max_sms,
                                  cudaStream_t stream);

/* Workspace bytes that let pi0_cuda_attention_ws take the few-queries kernels (0: never for these
 * sizes). */
size_t pi0_cuda_attention_workspace(int num_segments, int num_kv_heads, int head_dim);

/*
 * Tuning/testing knob, process-wide, not thread-safe (set it before launching or capturing): how many
 * blocks (a thread-block cluster, sm_90+) share the keys of one 64-row tile. 0 (the default) chooses
 * per call from the grid size: small grids (denoise, batch-1 prefix) split the keys up to 16 ways, grids
 * that fill the GPU do not. n > 0 forces the largest power of two <= min(n, 16) that the device
 * supports; 1 disables the split. (PI0_ATTN_SPLIT=n in the environment caps the automatic choice at n,
 * for A/B runs.) Results differ between splits only by float rounding; for a given
 * split they are deterministic. The choice is made at launch time, so a captured graph keeps it.
 */
void pi0_cuda_attention_set_split(int split);

#ifdef __cplusplus
}
#endif

#endif
