/*
 * denoise.h - the action expert's layers of one denoise step as one persistent kernel (denoise.cu), for
 * the batch-1 regime (a few suffix rows against the prefix's K/V cache), Pi0 and Pi0.5 alike.
 *
 * It computes what forward.c's gemma_block_skinny computes for every layer of the expert, in order
 * (docs/model.md#gemma-block): per layer, the QKV projection with the RMSNorm (Pi0.5: adaptive, scale and
 * shift) and RoPE, K/V into the layer's cache rows; attention of the rows over their segment's keys; o_proj
 * with the (gated) residual add; gate|up with the norm and gelu(gate) x up; down with the (gated) residual
 * add. x (float32) and x_bf16 hold the rows before and after, as with the skinny Linears; the weights are
 * the backend's (RMSNorm weight folded, gate|up interleaved, skinny.h). Numerics are those of skinny.h and
 * attention.h's few-queries kernels: bf16 operands, float32 accumulation, deterministic order.
 *
 * Status: correct (tests/gpu/test_cuda_denoise.c) but slower than the skinny kernels on an H200 (6.4 against
 * 5.7 ms for the seed workload's 10 steps, bench/NOTES.md "Session 7"), so the backend runs it only with
 * PI0_PERSISTENT=1 in the environment.
 */
#ifndef PI0_CUDA_DENOISE_H
#define PI0_CUDA_DENOISE_H

#include <stddef.h>

#include <cuda_runtime_api.h>

#include "cuda/bf16.h"
#include "model/plan.h" /* attn_segment */

#ifdef __cplusplus
extern "C" {
#endif

/* One expert layer at one step: its weights and, for Pi0.5, that step's conditioning (NULL for Pi0). */
typedef struct {
    const pi0_bf16 *qkv_w, *o_w, *gate_up_w, *down_w;
    const pi0_bf16 *attn_scale, *mlp_scale; /* (width) bf16(1 + scale) of the two adaptive norms */
    const float *qkv_bias, *gate_up_bias;   /* shift . w^T of the Linear each norm feeds */
    const float *attn_gate, *mlp_gate;      /* (width) the gated residuals */
} pi0_denoise_layer;

typedef struct {
    int rows;                        /* the suffix rows of the one sample, <= 16 */
    int width, heads, kv_heads, head_dim, mlp_dim, depth;
    const pi0_denoise_layer *layers; /* device memory, [depth] */
    float *x;                        /* (rows, width) the residual stream, updated in place */
    pi0_bf16 *x_bf16;                /* (rows, width) x in bf16, kept current */
    pi0_bf16 *qkv;                   /* (rows, (heads + 2 kv_heads) head_dim): q is written here */
    pi0_bf16 *att, *mlp;             /* (rows, heads head_dim), (rows, mlp_dim) */
    pi0_bf16 *cache_k, *cache_v;     /* layer 0's cache; layer l's starts cache_layer elements further */
    size_t cache_layer;
    const int *positions, *cache_rows; /* per row */
    const attn_segment *segment;     /* device memory: the rows' one segment (keys: the prefix, then the rows) */
    const float *rope_cos, *rope_sin;
    float eps;
    void *workspace;                 /* pi0_cuda_denoise_workspace bytes, 256-byte aligned */
    int max_keys;                    /* bounds segment->num_k */
} pi0_denoise_args;

/* Whether the kernel runs these dims on the current device: sm_90+ (bulk copies), rows <= 16, head_dim 32,
 * 64, 128 or 256, (heads / kv_heads) x rows <= 128, width and mlp_dim multiples of 8, depth <= 64,
 * max_keys <= 16384. */
int pi0_cuda_denoise_supported(int rows, int width, int heads, int kv_heads, int head_dim, int mlp_dim, int depth,
                               int max_keys);

/* Workspace bytes: the attention's float32 partials and the grid's synchronization counter. */
size_t pi0_cuda_denoise_workspace(int kv_heads, int head_dim, int max_keys);

/* Enqueues the step (a memset of the counter, one cooperative launch of one block per SM). */
cudaError_t pi0_cuda_denoise_step(const pi0_denoise_args *a, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
