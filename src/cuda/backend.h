/*
 * backend.h - the CUDA backend's state, shared by its parts: the weights on the GPU (weights.c), the
 * forward pass (forward.c, which reads like src/cpu/forward.c) and the captured graphs with their
 * memory (graph.c).
 */
#ifndef PI0_CUDA_BACKEND_H
#define PI0_CUDA_BACKEND_H

#include <cuda_runtime_api.h>

#include "cuda/denoise.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "model/model.h"
#include "util/error.h"

#define ROPE_MAX_POS 16384 /* positions a plan may use: prefix + suffix of one sample */
#define MAX_GRAPHS 1024    /* captured shapes kept by default (PI0_CUDA_MAX_GRAPHS); past it the least recently
                              used one goes first */

typedef struct {
    float *ln1_w, *ln1_b, *ln2_w, *ln2_b;
    pi0_bf16 *qkv_w, *qkv_b, *o_w, *fc1_w, *fc1_b, *fc2_w;
    float *o_b, *fc2_b; /* added into the float32 residual */
} gpu_vit_layer;

typedef struct {
    float *input_norm, *post_norm;             /* the LLM's; NULL in the expert (folded into the Linears) */
    pi0_bf16 *qkv_w, *o_w, *gate_up_w, *down_w;
    pi0_bf16 *input_dense_w, *post_dense_w;    /* Pi0.5's expert: the adaptive norms' (3 We, We) */
    float *input_dense_b, *post_dense_b;
} gpu_gemma_layer;

typedef struct {
    pi0_bf16 *patch_w; /* (Dv, PI0_PATCH_PIECES x 3 p^2): float32 weights in bf16 pieces (kernels.h) */
    float *patch_b, *pos_emb;
    gpu_vit_layer *vit;
    float *post_ln_w, *post_ln_b;
    pi0_bf16 *proj_w;
    float *proj_b;
    pi0_bf16 *embed;
    gpu_gemma_layer *llm, *expert;
    pi0_bf16 *action_out_w;
    float *action_out_b;
    /* Pi0 */
    float *expert_norm;
    pi0_bf16 *action_out_fold_w; /* action_out_w with the final norm's (1 + w) folded in: the skinny Euler step's */
    pi0_bf16 *state_proj_w, *time_fold_w, *time_out_w;
    float *state_proj_b, *time_out_b;
    /* Pi0.5 */
    pi0_bf16 *action_in_w, *expert_norm_dense_w, *time_mlp_in_w, *time_mlp_out_w;
    float *action_in_b, *expert_norm_dense_b, *time_mlp_in_b, *time_mlp_out_b;
    float *rope_cos, *rope_sin;
} gpu_weights;

/* What fixes a graph's kernels and sizes; everything else about a batch is data copied in. */
typedef struct {
    int batch, horizon, num_steps, num_images, total_prefix, max_prefix;
    int frames; /* the cameras come as frames, resized on the device, instead of model-input images */
} graph_shape;

/* A graph's inputs, at the start of the workspace and mirrored in pinned host memory. The cameras are images
 * or, in a graph of frames, jobs that say where this call's frames are (the frame staging buffer). */
typedef struct {
    float *images;
    pi0_frame_job *frame_jobs;
    float *state, *x_t;
    int *image_flags; /* [num_images] just before x_t: non-zero where an image holds a NaN or infinity (im2col sets
                       * them); the host zeroes them, and they come back with the actions */
    int *prefix_src, *prefix_pos, *prefix_cache_row;
    attn_segment *vit_segments, *prefix_segments;
    suffix_rows first_step, later_steps; /* plan.h's, in device memory (per_sample as in the plan) */
} graph_inputs;

/* What a forward pass of num_steps steps reads besides the weights and its inputs, computed once per step
 * count (forward.c's cuda_step_constants) and shared by every graph of that count. */
typedef struct {
    int num_steps;
    char *device;          /* the block holding the tables below */
    float *out_bias;       /* (A) dt * action_out_proj.bias: the Euler step is fused into that GEMM */
    float *out_gate;       /* (A) dt: the skinny Euler step's residual gate (x_t += dt (v + bias)) */
    float *out_col_bias;   /* Pi0.5: (steps, A) final norm's shift . action_out_w^T + action_out_proj.bias */
    float *time_bias;      /* Pi0: (steps, We) time half of action_time_mlp_in + folded biases, per step */
    float *mods;           /* Pi0.5: (2 depth + 1 norms, 3, steps, We): each norm's scale, shift, gate per step */
    float *qkv_bias, *gate_up_bias; /* Pi0.5: (depth, steps, n): shift . w^T of the QKV and gate|up Linears */
    float *time_emb;       /* Pi0.5: (steps, We) and the time MLP's hidden layer and output, the same size */
    pi0_bf16 *in_scale;    /* Pi0.5: (2 depth + 1, steps, We): bf16(1 + scale) of the norms, for the skinny Linears */
    pi0_denoise_layer *denoise_layers; /* (steps, depth): the persistent denoise kernel's layer table */
} step_tables;

/* Scratch of one Gemma stack over `rows` rows: bf16 GEMM inputs and outputs, and Pi0.5's gated branch. */
typedef struct {
    pi0_bf16 *h, *qkv, *att, *mlp2, *mlp;
    float *branch; /* (rows, width): a residual branch before its gate */
} gemma_buffers;

/* One shape's forward pass: where its inputs and activations lie in the backend's workspace (shared by
 * every graph: graphs run one at a time), its step tables, and its captured graph. */
typedef struct {
    graph_shape shape;
    int suffix_len;        /* suffix rows per sample: H + 1 (Pi0's state token) or H */
    uint64_t last_used;
    cudaGraphExec_t exec;
    char *device, *host;   /* the workspace and its pinned host mirror (inputs, then actions) */
    size_t inputs_size;
    size_t images_size;    /* the inputs' first bytes: the images, which send_images sends image by image (graph.c) */
    size_t outputs_size;   /* image_flags to the end of x_t: what comes back to outputs_host */
    size_t actions_at;     /* where x_t (the actions) starts in it */
    graph_inputs in, in_host;
    char *outputs_host;    /* after the inputs in the pinned mirror: image_flags, then x_t (the actions) */
    const step_tables *tables;
    /* activations */
    float *images;         /* the cameras as model input: the inputs' images, or the frames resized into it */
    pi0_bf16 *patches;     /* (images x 256, PI0_PATCH_PIECES x 3 p^2): im2col's bf16 pieces */
    float *vit_x, *vision, *x, *suffix, *state_token, *action_tokens;
    pi0_bf16 *suffix_bf16; /* the suffix rows rounded to bf16: the skinny Linears' input */
    float *suffix_attn_ws; /* the denoise attention's workspace (pi0_cuda_attention_ws) */
    size_t suffix_attn_ws_bytes;
    int persistent;        /* the denoise step runs as one persistent kernel (denoise.h) */
    int first_step_beside; /* the first denoise step runs beside the prefix (forward.c) */
    int fused_euler;       /* the steps end in the fused Euler update (forward.c's euler_boundary) */
    float *x_t_alt;        /* batch 1: x_t's second buffer for fused_euler (forward.c's x_t_after) */
    pi0_bf16 *suffix_bf16_alt; /* batch 1, Pi0.5: the bf16 suffix rows' second buffer (forward.c's suffix_bf16_of) */
    void *denoise_ws;      /* its workspace (pi0_cuda_denoise_workspace) */
    pi0_bf16 *vit_h, *vit_qkv, *vit_att, *vit_mlp, *cache_k, *cache_v, *time_hidden, *final_h;
    gemma_buffers prefix, suffix_buffers; /* the LLM's over the prefix rows, the expert's over the suffix */
    cudaEvent_t events[4]; /* start, vision done, prefix done, end */
} cuda_graph;

typedef struct {
    gpu_weights w;
    gemm_context gemm;
    cudaStream_t stream;
    int multiprocessors;    /* the device's */
    cudaStream_t side;      /* the first denoise step beside the prefix (forward.c's first_step_beside); NULL: off */
    cudaEvent_t forked, joined, *kv_ready; /* its start, its end, and each LLM layer's K/V in the cache [llm depth] */
    int num_kv_ready;
    cuda_graph **graphs; /* [num_graphs] */
    int num_graphs, cap_graphs, max_graphs;
    uint64_t clock; /* for least-recently-used eviction */
    uint64_t captures; /* graphs made so far (pi0_model_graph_captures) */
    char *work, *work_host; /* the shared workspace (device) and its pinned mirror */
    size_t work_size, work_host_size;
    uint8_t *frames, *frames_host; /* a call's camera frames and their resampling weights (device, pinned) */
    size_t frames_size;
    step_tables **tables;   /* [num_tables], one per step count seen */
    int num_tables;
    int use_skinny; /* skinny.h's Linears for blocks of <= SKINNY_MAX_ROWS rows */
    int use_persistent; /* denoise.h's persistent kernel for the batch-1 denoise steps it supports (opt-in) */
    int use_parts;      /* split-K Linears into partial sums that the next norm adds (forward.c's stack_parts) */
    int use_gate_up;    /* gate_up.h's gate|up with gelu x up, where it fits (forward.c's gemma_block) */
    int use_fused_euler; /* the batch-1 step boundary as one kernel (forward.c's euler_boundary) */
    void **allocations; /* weight buffers, freed at release */
    int num_allocations, max_allocations;
    uint64_t device_bytes, peak_device_bytes;
} cuda_state;

/* In functions that return pi0_status and have `pi0_error *err`: fail with the CUDA call and its error,
 * or pass a failed status up. */
#define CUDA_TRY(call)                                                                                        \
    do {                                                                                                      \
        cudaError_t e_ = (call);                                                                              \
        if (e_ != cudaSuccess) return pi0_fail(err, PI0_ERR_BACKEND, "%s: %s", #call, cudaGetErrorString(e_)); \
    } while (0)
#define TRY(call)                                \
    do {                                         \
        pi0_status st_ = (call);                 \
        if (st_) return st_;                     \
    } while (0)

/* cudaMalloc that counts bytes and remembers the pointer for release. */
void *cuda_alloc(cuda_state *s, size_t bytes, pi0_error *err);

/* weights.c: the GPU's copy of the weights, streamed from model_tensor_range except for what the host keeps. */
pi0_status cuda_weights_upload(cuda_state *s, const pi0_model *m, pi0_error *err);
int cuda_keeps_on_host(const pi0_weights *w, const weight_spec *spec);

/* forward.c: the per-shape constants a graph's forward pass reads (computed once, when the graph is
 * made), and the whole sample_actions enqueued on s->stream (eagerly, or into a graph under capture). */
pi0_status cuda_step_constants(cuda_state *s, const pi0_model *m, step_tables *t, pi0_error *err);
pi0_status cuda_forward(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err);

#endif
