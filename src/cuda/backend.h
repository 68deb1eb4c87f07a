/*
 * backend.h - state of the CUDA backend: weights on the GPU and one captured graph per input shape.
 */
#ifndef PI0_CUDA_BACKEND_H
#define PI0_CUDA_BACKEND_H

#include <cuda_runtime_api.h>

#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "model/model.h"

#define ROPE_MAX_POS 16384 /* positions a plan may use: prefix + suffix of one sample */
#define MAX_GRAPHS 8       /* captured shapes kept; the least recently used one goes first */

typedef struct {
    float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    pi0_bf16 *qkv_w, *qkv_b, *o_w, *fc1_w, *fc1_b, *fc2_w;
    float *o_b, *fc2_b; /* added into the float32 residual */
} gpu_vit_layer;

typedef struct {
    float *input_norm, *post_norm;
    pi0_bf16 *qkv_w, *o_w, *gate_up_w, *down_w;
} gpu_gemma_layer;

typedef struct {
    float *patch_w, *patch_b, *pos_emb;
    gpu_vit_layer *vit;
    float *post_ln_w, *post_ln_b;
    pi0_bf16 *proj_w;
    float *proj_b;
    pi0_bf16 *embed;
    gpu_gemma_layer *llm, *expert;
    float *expert_norm;
    pi0_bf16 *state_proj_w, *time_fold_w, *time_out_w, *action_out_w;
    float *state_proj_b, *time_out_b;
    float *rope_cos, *rope_sin;
} gpu_weights;

/* What fixes a graph's kernels and sizes; everything else about a batch is data copied in. */
typedef struct {
    int batch, horizon, num_steps, num_images, total_prefix, max_prefix;
} graph_shape;

typedef struct cuda_graph cuda_graph;

typedef struct {
    gpu_weights w;
    gemm_context gemm;
    cudaStream_t stream;
    cuda_graph *graphs[MAX_GRAPHS];
    uint64_t clock; /* for least-recently-used eviction */
    int use_graphs;
    int use_skinny; /* skinny.h's Linears for blocks of <= SKINNY_MAX_ROWS rows */
    void **allocations; /* weight buffers, freed at release */
    int num_allocations, max_allocations;
    uint64_t device_bytes, peak_device_bytes;
} cuda_state;

/* cudaMalloc that counts bytes and remembers the pointer for release. */
void *cuda_alloc(cuda_state *s, size_t bytes, pi0_error *err);

pi0_status cuda_weights_upload(cuda_state *s, const pi0_model *m, pi0_error *err);

/* Tests: 0 runs every batch eagerly (no graph), 1 (default) captures one graph per shape. */
void pi0_cuda_set_graphs(pi0_model *model, int enabled);

#endif
