/*
 * backend.c - Pi0's sample_actions on an NVIDIA GPU: the same forward pass as src/cpu/forward.c,
 * with bf16 GEMMs through cuBLASLt, our own kernels for everything else, and the whole call
 * (vision, prefix, every denoise step) captured as one CUDA graph per input shape.
 *
 * A graph owns one device block (inputs, per-shape constants, activations, K/V cache) and one
 * pinned host block mirroring the inputs. A call fills the pinned inputs, replays the graph (whose
 * first node copies them in and whose last copies the actions out) and waits. The first call of a
 * shape runs eagerly (which also warms cuBLASLt and the kernels up), then captures the graph.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/attention.h"
#include "cuda/backend.h"
#include "cuda/skinny.h"
#include "model/flow.h"
#include "util/error.h"

#define ALIGN 256

typedef struct {
    float *images, *state, *x_t;
    int *prefix_src, *prefix_pos, *prefix_cache_row, *suffix_pos, *suffix_cache_row, *action_rows;
    attn_segment *prefix_segments, *suffix_segments;
} graph_inputs;

/* Scratch of one Gemma stack over `rows` rows, all bf16 (GEMM inputs and outputs). */
typedef struct {
    pi0_bf16 *h, *qkv, *att, *mlp2, *mlp;
} gemma_buffers;

struct cuda_graph {
    graph_shape shape;
    uint64_t last_used;
    cudaGraphExec_t exec;
    char *device, *host;    /* one device block; pinned host: inputs, then actions */
    size_t device_size, inputs_size;
    graph_inputs in, in_host;
    float *actions_host;
    /* per-shape constants */
    attn_segment *vit_segments;
    float *time_bias; /* (steps, We): time half of action_time_mlp_in + folded biases, per step */
    float *out_bias;  /* (A) dt * action_out_proj.bias: the Euler step is fused into that GEMM */
    /* activations */
    float *patches, *vit_x, *vision, *x, *suffix, *state_token, *action_tokens;
    pi0_bf16 *suffix_bf16; /* the suffix rows rounded to bf16: the skinny Linears' input */
    float *suffix_attn_ws;  /* the denoise attention's workspace (pi0_cuda_attention_ws) */
    size_t suffix_attn_ws_bytes;
    pi0_bf16 *vit_h, *vit_qkv, *vit_att, *vit_mlp, *cache_k, *cache_v, *time_hidden, *final_h;
    gemma_buffers prefix, suffix_buffers; /* the LLM's over the prefix rows, the expert's over the suffix */
    cudaEvent_t events[4]; /* start, vision done, prefix done, end */
};

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

/* ---- graph memory --------------------------------------------------------------------------- */

/* Hands out aligned offsets from a base; with base 0 it only measures. */
typedef struct {
    uintptr_t base;
    size_t used;
} carver;

static void *carve(carver *c, size_t bytes) {
    void *p = (void *)(c->base + c->used);
    c->used += (bytes + ALIGN - 1) / ALIGN * ALIGN;
    return p;
}

static void carve_inputs(carver *c, graph_inputs *in, const graph_shape *sh, const pi0_dims *d) {
    size_t B = (size_t)sh->batch, T = (size_t)sh->total_prefix, R = B * (sh->horizon + 1), BH = B * sh->horizon;
    in->images = carve(c, (size_t)sh->num_images * d->image_size * d->image_size * 3 * sizeof(float));
    in->state = carve(c, B * d->action_dim * sizeof(float));
    in->x_t = carve(c, BH * d->action_dim * sizeof(float));
    in->prefix_src = carve(c, T * sizeof(int));
    in->prefix_pos = carve(c, T * sizeof(int));
    in->prefix_cache_row = carve(c, T * sizeof(int));
    in->suffix_pos = carve(c, R * sizeof(int));
    in->suffix_cache_row = carve(c, R * sizeof(int));
    in->action_rows = carve(c, BH * sizeof(int));
    in->prefix_segments = carve(c, B * sizeof(attn_segment));
    in->suffix_segments = carve(c, B * sizeof(attn_segment));
}

static void carve_gemma(carver *c, gemma_buffers *b, size_t rows, const pi0_stack_dims *d) {
    size_t hd = (size_t)d->head_dim, q_dim = (size_t)d->num_heads * hd, kv_dim = (size_t)d->num_kv_heads * hd;
    b->h = carve(c, rows * d->width * sizeof(pi0_bf16));
    b->qkv = carve(c, rows * (q_dim + 2 * kv_dim) * sizeof(pi0_bf16));
    b->att = carve(c, rows * q_dim * sizeof(pi0_bf16));
    b->mlp2 = carve(c, rows * 2 * d->mlp_dim * sizeof(pi0_bf16));
    b->mlp = carve(c, rows * d->mlp_dim * sizeof(pi0_bf16));
}

static void carve_activations(carver *c, cuda_graph *g, const pi0_dims *d) {
    const graph_shape *sh = &g->shape;
    size_t NP = (size_t)sh->num_images * image_tokens(d), T = (size_t)sh->total_prefix;
    size_t B = (size_t)sh->batch, R = B * (sh->horizon + 1), BH = B * sh->horizon;
    size_t Dv = (size_t)d->vision.width, D = (size_t)d->llm.width, We = (size_t)d->expert.width;
    size_t kv_dim = (size_t)d->llm.num_kv_heads * d->llm.head_dim, cache_rows = T + R, bf = sizeof(pi0_bf16);
    size_t f = sizeof(float);
    g->vit_segments = carve(c, (size_t)sh->num_images * sizeof(attn_segment));
    g->time_bias = carve(c, (size_t)sh->num_steps * We * f);
    g->out_bias = carve(c, (size_t)d->action_dim * f);
    g->patches = carve(c, NP * 3 * d->patch_size * d->patch_size * f);
    g->vit_x = carve(c, NP * Dv * f);
    g->vit_h = carve(c, NP * Dv * bf);
    g->vit_qkv = carve(c, NP * 3 * Dv * bf);
    g->vit_att = carve(c, NP * Dv * bf);
    g->vit_mlp = carve(c, NP * d->vision.mlp_dim * bf);
    g->vision = carve(c, NP * D * f);
    g->x = carve(c, T * D * f);
    carve_gemma(c, &g->prefix, T, &d->llm);
    g->cache_k = carve(c, (size_t)d->llm.depth * cache_rows * kv_dim * bf);
    g->cache_v = carve(c, (size_t)d->llm.depth * cache_rows * kv_dim * bf);
    g->suffix = carve(c, R * We * f);
    g->suffix_bf16 = carve(c, R * We * bf);
    g->suffix_attn_ws_bytes = pi0_cuda_attention_workspace((int)B, d->expert.num_kv_heads, d->expert.head_dim);
    g->suffix_attn_ws = carve(c, g->suffix_attn_ws_bytes);
    g->state_token = carve(c, B * We * f);
    g->action_tokens = carve(c, BH * We * f);
    carve_gemma(c, &g->suffix_buffers, R, &d->expert);
    g->time_hidden = carve(c, BH * We * bf);
    g->final_h = carve(c, BH * We * bf);
}

static void graph_free(cuda_state *s, cuda_graph *g) {
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    for (int i = 0; i < 4; i++)
        if (g->events[i]) cudaEventDestroy(g->events[i]);
    if (g->device) {
        cudaFree(g->device);
        s->device_bytes -= g->device_size;
    }
    if (g->host) cudaFreeHost(g->host);
    free(g);
}

/* The time half of action_time_mlp_in for each step, with every bias of the folded layer:
 * c_k = W_t time_emb(t_k) + b_time_in + W_a b_action_in (double, then float). */
static int time_biases(const pi0_model *m, int steps, float *out) {
    const pi0_weights *w = &m->weights;
    int We = m->dims.expert.width;
    float *t = malloc(sizeof(float) * steps), *emb = malloc(sizeof(float) * We);
    if (!t || !emb) return free(t), free(emb), -1;
    flow_times(steps, t);
    for (int k = 0; k < steps; k++) {
        time_embedding(t[k], We, emb);
        for (int i = 0; i < We; i++) {
            const float *row = w->action_time_in_w + (size_t)i * 2 * We;
            double acc = w->action_time_in_b[i];
            for (int j = 0; j < We; j++) acc += (double)row[We + j] * emb[j] + (double)row[j] * w->action_in_b[j];
            out[(size_t)k * We + i] = (float)acc;
        }
    }
    free(t), free(emb);
    return 0;
}

static pi0_status graph_constants(cuda_graph *g, const pi0_model *m, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    int P = image_tokens(d), We = d->expert.width, A = d->action_dim, steps = g->shape.num_steps;
    size_t bytes = (size_t)g->shape.num_images * sizeof(attn_segment) + ((size_t)steps * We + A) * sizeof(float);
    char *host = malloc(bytes + 1);
    if (!host) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    attn_segment *segs = (attn_segment *)host;
    float *time_bias = (float *)(segs + g->shape.num_images), *out_bias = time_bias + (size_t)steps * We;
    for (int i = 0; i < g->shape.num_images; i++) segs[i] = (attn_segment){i * P, P, i * P, P, 0};
    float dt = -1.0f / (float)steps;
    for (int i = 0; i < A; i++) out_bias[i] = dt * m->weights.action_out_b[i];
    cudaError_t e = time_biases(m, steps, time_bias) ? cudaErrorMemoryAllocation : cudaSuccess;
    if (!e) e = cudaMemcpy(g->vit_segments, segs, g->shape.num_images * sizeof(attn_segment), cudaMemcpyHostToDevice);
    if (!e) e = cudaMemcpy(g->time_bias, time_bias, (size_t)steps * We * sizeof(float), cudaMemcpyHostToDevice);
    if (!e) e = cudaMemcpy(g->out_bias, out_bias, A * sizeof(float), cudaMemcpyHostToDevice);
    free(host);
    if (e) return pi0_fail(err, PI0_ERR_BACKEND, "uploading graph constants: %s", cudaGetErrorString(e));
    return PI0_OK;
}

static pi0_status graph_new(cuda_state *s, const pi0_model *m, const graph_shape *shape, cuda_graph **out,
                            pi0_error *err) {
    const pi0_dims *d = &m->dims;
    cuda_graph *g = calloc(1, sizeof *g);
    if (!g) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    g->shape = *shape;
    carver inputs = {0}, all = {0};
    carve_inputs(&inputs, &g->in, shape, d);
    size_t actions_bytes = (size_t)shape->batch * shape->horizon * d->action_dim * sizeof(float);
    g->inputs_size = inputs.used;
    all.used = inputs.used;
    carve_activations(&all, g, d);
    g->device_size = all.used;
    pi0_status st = PI0_OK;
    if (cudaMalloc((void **)&g->device, g->device_size) != cudaSuccess) {
        cudaGetLastError();
        g->device = NULL;
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate %.2f GB of GPU memory for a batch of %d (%d prefix tokens)",
                      (double)g->device_size / 1e9, shape->batch, shape->total_prefix);
    } else if (cudaMallocHost((void **)&g->host, g->inputs_size + actions_bytes) != cudaSuccess) {
        cudaGetLastError();
        g->host = NULL;
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate pinned host memory");
    }
    if (!st) {
        s->device_bytes += g->device_size;
        if (s->device_bytes > s->peak_device_bytes) s->peak_device_bytes = s->device_bytes;
        /* the same carving again, now at the real addresses */
        carver dev_in = {(uintptr_t)g->device, 0}, host_in = {(uintptr_t)g->host, 0}, dev_all = {(uintptr_t)g->device, g->inputs_size};
        carve_inputs(&dev_in, &g->in, shape, d);
        carve_inputs(&host_in, &g->in_host, shape, d);
        carve_activations(&dev_all, g, d);
        g->actions_host = (float *)(g->host + g->inputs_size);
        for (int i = 0; i < 4 && !st; i++)
            if (cudaEventCreate(&g->events[i]) != cudaSuccess) st = pi0_fail(err, PI0_ERR_BACKEND, "cudaEventCreate failed");
    }
    if (!st) st = graph_constants(g, m, err);
    if (st) {
        graph_free(s, g);
        return st;
    }
    *out = g;
    return PI0_OK;
}

/* ---- inputs ---------------------------------------------------------------------------------- */

static void fill_inputs(const cuda_graph *g, const pi0_model *m, const pi0_plan *p) {
    const pi0_dims *d = &m->dims;
    const graph_inputs *in = &g->in_host;
    size_t image = (size_t)d->image_size * d->image_size * 3, B = (size_t)p->batch, R = B * (p->horizon + 1);
    int P = image_tokens(d);
    for (int i = 0; i < p->num_images; i++) memcpy(in->images + i * image, p->images[i], image * sizeof(float));
    memcpy(in->state, p->state, B * d->action_dim * sizeof(float));
    memcpy(in->x_t, p->noise, B * p->horizon * d->action_dim * sizeof(float));
    for (int b = 0; b < p->batch; b++) {
        int *src = in->prefix_src + p->prefix_start[b];
        for (int i = p->image_start[b]; i < p->image_start[b + 1]; i++)
            for (int t = 0; t < P; t++) *src++ = i * P + t;
        for (int i = p->prompt_start[b]; i < p->prompt_start[b + 1]; i++) *src++ = -p->prompt_ids[i] - 1;
    }
    memcpy(in->prefix_pos, p->prefix_pos, (size_t)p->total_prefix * sizeof(int));
    memcpy(in->prefix_cache_row, p->prefix_cache_row, (size_t)p->total_prefix * sizeof(int));
    memcpy(in->suffix_pos, p->suffix_pos, R * sizeof(int));
    memcpy(in->suffix_cache_row, p->suffix_cache_row, R * sizeof(int));
    memcpy(in->action_rows, p->action_rows, B * p->horizon * sizeof(int));
    memcpy(in->prefix_segments, p->prefix_segments, B * sizeof(attn_segment));
    memcpy(in->suffix_segments, p->suffix_segments, B * sizeof(attn_segment));
}

/* ---- the forward pass, enqueued on the stream ---------------------------------------------------- */

static pi0_status gemm(cuda_state *s, gemm_args a, pi0_error *err) {
    return gemm_run(&s->gemm, &a, s->stream, err);
}

/* Rows that run through a Gemma stack, and where their K/V go. */
typedef struct {
    int rows, num_segments, max_q;
    const int *positions, *cache_rows;
    const attn_segment *segments;
    float *x;
    pi0_bf16 *x_bf16; /* x rounded to bf16, kept by the skinny path; NULL: the stack has no skinny path */
    const gemma_buffers *b;
    float *attn_ws;   /* attention workspace (NULL: none) */
    size_t attn_ws_bytes;
} gemma_rows;

static pi0_status skinny(const skinny_args *a, cudaStream_t stream, pi0_error *err) {
    cudaError_t e = pi0_cuda_skinny_linear(a, stream);
    if (e) return pi0_fail(err, PI0_ERR_BACKEND, "skinny linear (%d x %d x %d): %s", a->m, a->n, a->k, cudaGetErrorString(e));
    return PI0_OK;
}

/* The expert's block over a few rows (a batch-1 denoise step): 4 skinny Linears (skinny.h) with the
 * norms (folded at load), RoPE and the K/V cache writes, and gelu x up inside them, the residual adds
 * in their epilogues, which also keep x_bf16 current for the next Linear. 5 launches (6 with the
 * attention's merge) instead of gemma_block's 10. */
static pi0_status gemma_block_skinny(cuda_state *s, const gpu_gemma_layer *l, const pi0_stack_dims *d, const gemma_rows *r,
                                     pi0_bf16 *cache_k, pi0_bf16 *cache_v, pi0_error *err) {
    int W = d->width, hd = d->head_dim, q_dim = d->num_heads * hd, kv_dim = d->num_kv_heads * hd;
    int qkv_dim = q_dim + 2 * kv_dim;
    const gemma_buffers *b = r->b;
    TRY(skinny(&(skinny_args){.m = r->rows, .n = qkv_dim, .k = W, .x = r->x_bf16, .w = l->qkv_w, .rms_norm = 1,
                              .eps = NORM_EPS, .epilogue = SKINNY_ROPE_QKV, .out = b->qkv, .heads = d->num_heads,
                              .kv_heads = d->num_kv_heads, .head_dim = hd, .positions = r->positions,
                              .cache_rows = r->cache_rows, .rope_cos = s->w.rope_cos, .rope_sin = s->w.rope_sin,
                              .cache_k = cache_k, .cache_v = cache_v}, s->stream, err));
    CUDA_TRY(pi0_cuda_attention_ws(b->att, q_dim, b->qkv, qkv_dim, cache_k, cache_v, kv_dim, r->segments, r->num_segments,
                                   r->max_q, d->num_heads, d->num_kv_heads, hd, 1.0f / sqrtf((float)hd), r->attn_ws,
                                   r->attn_ws_bytes, s->stream));
    TRY(skinny(&(skinny_args){.m = r->rows, .n = W, .k = q_dim, .x = b->att, .w = l->o_w, .epilogue = SKINNY_RESIDUAL,
                              .residual = r->x, .residual_bf16 = r->x_bf16}, s->stream, err));
    TRY(skinny(&(skinny_args){.m = r->rows, .n = 2 * d->mlp_dim, .k = W, .x = r->x_bf16, .w = l->gate_up_w, .rms_norm = 1,
                              .eps = NORM_EPS, .epilogue = SKINNY_GELU_MUL, .out = b->mlp}, s->stream, err));
    TRY(skinny(&(skinny_args){.m = r->rows, .n = W, .k = d->mlp_dim, .x = b->mlp, .w = l->down_w, .epilogue = SKINNY_RESIDUAL,
                              .residual = r->x, .residual_bf16 = r->x_bf16}, s->stream, err));
    return PI0_OK;
}

/* x += attn(RMSNorm(x)) Wo; x += MLP(RMSNorm(x)); K/V go to the layer's cache first. */
static pi0_status gemma_block(cuda_state *s, const gpu_gemma_layer *l, const pi0_stack_dims *d, const gemma_rows *r,
                              pi0_bf16 *cache_k, pi0_bf16 *cache_v, int kv_only, pi0_error *err) {
    int W = d->width, hd = d->head_dim, q_dim = d->num_heads * hd, kv_dim = d->num_kv_heads * hd;
    int qkv_dim = q_dim + 2 * kv_dim;
    if (r->x_bf16 && s->use_skinny && r->rows <= SKINNY_MAX_ROWS && !kv_only)
        return gemma_block_skinny(s, l, d, r, cache_k, cache_v, err);
    CUDA_TRY(pi0_cuda_rmsnorm(r->b->h, r->x, NULL, r->rows, W, l->input_norm, NORM_EPS, s->stream));
    TRY(gemm(s, (gemm_args){.m = r->rows, .n = qkv_dim, .k = W, .x = r->b->h, .w = l->qkv_w, .out = r->b->qkv, .alpha = 1}, err));
    CUDA_TRY(pi0_cuda_rope_qkv(r->b->qkv, r->rows, d->num_heads, d->num_kv_heads, hd, r->positions, r->cache_rows, cache_k,
                               cache_v, s->w.rope_cos, s->w.rope_sin, s->stream));
    if (kv_only) return PI0_OK;
    CUDA_TRY(pi0_cuda_attention_ws(r->b->att, q_dim, r->b->qkv, qkv_dim, cache_k, cache_v, kv_dim, r->segments,
                                   r->num_segments, r->max_q, d->num_heads, d->num_kv_heads, hd, 1.0f / sqrtf((float)hd),
                                   r->attn_ws, r->attn_ws_bytes, s->stream));
    TRY(gemm(s, (gemm_args){.m = r->rows, .n = W, .k = q_dim, .x = r->b->att, .w = l->o_w, .out = r->x, .out_f32 = 1,
                            .alpha = 1, .beta = 1}, err));
    CUDA_TRY(pi0_cuda_rmsnorm(r->b->h, r->x, NULL, r->rows, W, l->post_norm, NORM_EPS, s->stream));
    TRY(gemm(s, (gemm_args){.m = r->rows, .n = 2 * d->mlp_dim, .k = W, .x = r->b->h, .w = l->gate_up_w, .out = r->b->mlp2,
                            .alpha = 1}, err));
    CUDA_TRY(pi0_cuda_gelu_mul(r->b->mlp, r->b->mlp2, r->rows, d->mlp_dim, s->stream));
    TRY(gemm(s, (gemm_args){.m = r->rows, .n = W, .k = d->mlp_dim, .x = r->b->mlp, .w = l->down_w, .out = r->x, .out_f32 = 1,
                            .alpha = 1, .beta = 1}, err));
    return PI0_OK;
}

static pi0_status vision_forward(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    const pi0_stack_dims *v = &d->vision;
    const gpu_weights *w = &s->w;
    int n = g->shape.num_images, P = image_tokens(d), rows = n * P, Dv = v->width;
    int patch_dim = 3 * d->patch_size * d->patch_size;
    if (n == 0) return PI0_OK;
    CUDA_TRY(pi0_cuda_im2col(g->patches, g->in.images, n, d->image_size, d->patch_size, s->stream));
    TRY(gemm(s, (gemm_args){.m = rows, .n = Dv, .k = patch_dim, .x = g->patches, .w = w->patch_w, .out = g->vit_x,
                            .out_f32 = 1, .f32_inputs = 1, .alpha = 1}, err));
    CUDA_TRY(pi0_cuda_add_bias_pos(g->vit_x, w->patch_b, w->pos_emb, rows, P, Dv, s->stream));
    for (int layer = 0; layer < v->depth; layer++) {
        const gpu_vit_layer *l = &w->vit[layer];
        CUDA_TRY(pi0_cuda_layernorm(g->vit_h, g->vit_x, rows, Dv, l->ln1_w, l->ln1_b, NORM_EPS, s->stream));
        TRY(gemm(s, (gemm_args){.m = rows, .n = 3 * Dv, .k = Dv, .x = g->vit_h, .w = l->qkv_w, .bias = l->qkv_b,
                                .out = g->vit_qkv, .alpha = 1}, err));
        CUDA_TRY(pi0_cuda_attention(g->vit_att, Dv, g->vit_qkv, 3 * Dv, g->vit_qkv + Dv, g->vit_qkv + 2 * Dv, 3 * Dv,
                                    g->vit_segments, n, P, v->num_heads, v->num_heads, v->head_dim,
                                    1.0f / sqrtf((float)v->head_dim), s->stream));
        TRY(gemm(s, (gemm_args){.m = rows, .n = Dv, .k = Dv, .x = g->vit_att, .w = l->o_w, .bias = l->o_b, .out = g->vit_x,
                                .out_f32 = 1, .alpha = 1, .beta = 1}, err));
        CUDA_TRY(pi0_cuda_layernorm(g->vit_h, g->vit_x, rows, Dv, l->ln2_w, l->ln2_b, NORM_EPS, s->stream));
        TRY(gemm(s, (gemm_args){.m = rows, .n = v->mlp_dim, .k = Dv, .x = g->vit_h, .w = l->fc1_w, .bias = l->fc1_b,
                                .gelu = 1, .out = g->vit_mlp, .alpha = 1}, err));
        TRY(gemm(s, (gemm_args){.m = rows, .n = Dv, .k = v->mlp_dim, .x = g->vit_mlp, .w = l->fc2_w, .bias = l->fc2_b,
                                .out = g->vit_x, .out_f32 = 1, .alpha = 1, .beta = 1}, err));
    }
    CUDA_TRY(pi0_cuda_layernorm(g->vit_h, g->vit_x, rows, Dv, w->post_ln_w, w->post_ln_b, NORM_EPS, s->stream));
    TRY(gemm(s, (gemm_args){.m = rows, .n = d->llm.width, .k = Dv, .x = g->vit_h, .w = w->proj_w, .bias = w->proj_b,
                            .out = g->vision, .out_f32 = 1, .alpha = 1}, err));
    return PI0_OK;
}

static pi0_status prefix_forward(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.llm;
    size_t cache_layer = ((size_t)g->shape.total_prefix + (size_t)g->shape.batch * (g->shape.horizon + 1)) *
                         d->num_kv_heads * d->head_dim;
    CUDA_TRY(pi0_cuda_assemble_prefix(g->x, g->in.prefix_src, g->shape.total_prefix, d->width, g->vision, s->w.embed,
                                      (float)sqrt((double)d->width), s->stream));
    gemma_rows r = {g->shape.total_prefix, g->shape.batch, g->shape.max_prefix, g->in.prefix_pos, g->in.prefix_cache_row,
                    g->in.prefix_segments, g->x, NULL, &g->prefix, NULL, 0};
    for (int layer = 0; layer < d->depth; layer++)
        TRY(gemma_block(s, &s->w.llm[layer], d, &r, g->cache_k + layer * cache_layer, g->cache_v + layer * cache_layer,
                        layer == d->depth - 1, err));
    return PI0_OK;
}

/* One Euler step: x_t += dt * action_out_proj(final_norm(expert(suffix(x_t, t_k)))[action rows]). */
static pi0_status denoise_step(cuda_state *s, const pi0_model *m, cuda_graph *g, int step, pi0_error *err) {
    const pi0_dims *dims = &m->dims;
    const pi0_stack_dims *d = &dims->expert;
    const gpu_weights *w = &s->w;
    int B = g->shape.batch, H = g->shape.horizon, BH = B * H, We = d->width, A = dims->action_dim;
    size_t cache_layer = ((size_t)g->shape.total_prefix + (size_t)B * (H + 1)) * d->num_kv_heads * d->head_dim;
    CUDA_TRY(pi0_cuda_linear_small_k(g->time_hidden, 1, g->in.x_t, w->time_fold_w, g->time_bias + (size_t)step * We, BH,
                                     A, We, 1, s->stream));
    TRY(gemm(s, (gemm_args){.m = BH, .n = We, .k = We, .x = g->time_hidden, .w = w->time_out_w, .bias = w->time_out_b,
                            .out = g->action_tokens, .out_f32 = 1, .alpha = 1}, err));
    CUDA_TRY(pi0_cuda_assemble_suffix(g->suffix, g->suffix_bf16, g->state_token, g->action_tokens, B, H, We, s->stream));
    gemma_rows r = {B * (H + 1), B, H + 1, g->in.suffix_pos, g->in.suffix_cache_row, g->in.suffix_segments,
                    g->suffix, g->suffix_bf16, &g->suffix_buffers, g->suffix_attn_ws, g->suffix_attn_ws_bytes};
    for (int layer = 0; layer < d->depth; layer++)
        TRY(gemma_block(s, &w->expert[layer], d, &r, g->cache_k + layer * cache_layer, g->cache_v + layer * cache_layer, 0,
                        err));
    CUDA_TRY(pi0_cuda_rmsnorm(g->final_h, g->suffix, g->in.action_rows, BH, We, w->expert_norm, NORM_EPS, s->stream));
    float dt = -1.0f / (float)g->shape.num_steps;
    TRY(gemm(s, (gemm_args){.m = BH, .n = A, .k = We, .x = g->final_h, .w = w->action_out_w, .bias = g->out_bias,
                            .out = g->in.x_t, .out_f32 = 1, .alpha = dt, .beta = 1}, err));
    return PI0_OK;
}

/* A stage boundary: "external" so that under capture it becomes an event-record node of the graph
 * (a plain record would only order streams), and each replay re-records it. */
static cudaError_t record(cudaEvent_t event, cudaStream_t stream) {
    enum cudaStreamCaptureStatus capturing;
    cudaError_t e = cudaStreamIsCapturing(stream, &capturing);
    if (e) return e;
    if (capturing != cudaStreamCaptureStatusActive) return cudaEventRecord(event, stream); /* the flag is capture-only */
    return cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal);
}

static pi0_status enqueue(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    size_t actions_bytes = (size_t)g->shape.batch * g->shape.horizon * d->action_dim * sizeof(float);
    CUDA_TRY(cudaMemcpyAsync(g->device, g->host, g->inputs_size, cudaMemcpyHostToDevice, s->stream));
    CUDA_TRY(record(g->events[0], s->stream));
    TRY(vision_forward(s, m, g, err));
    CUDA_TRY(record(g->events[1], s->stream));
    TRY(prefix_forward(s, m, g, err));
    CUDA_TRY(record(g->events[2], s->stream));
    CUDA_TRY(pi0_cuda_linear_small_k(g->state_token, 0, g->in.state, s->w.state_proj_w, s->w.state_proj_b,
                                     g->shape.batch, d->action_dim, d->expert.width, 0, s->stream));
    for (int step = 0; step < g->shape.num_steps; step++) TRY(denoise_step(s, m, g, step, err));
    CUDA_TRY(record(g->events[3], s->stream));
    CUDA_TRY(cudaMemcpyAsync(g->actions_host, g->in.x_t, actions_bytes, cudaMemcpyDeviceToHost, s->stream));
    return PI0_OK;
}

/* Records the enqueue into a graph; a failure mid-capture ends the capture and drops it. */
static pi0_status capture(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    cudaGraph_t graph = NULL;
    CUDA_TRY(cudaStreamBeginCapture(s->stream, cudaStreamCaptureModeThreadLocal));
    pi0_status st = enqueue(s, m, g, err);
    cudaError_t e = cudaStreamEndCapture(s->stream, &graph);
    if (!st && e) st = pi0_fail(err, PI0_ERR_BACKEND, "graph capture failed: %s", cudaGetErrorString(e));
    if (!st && (e = cudaGraphInstantiate(&g->exec, graph, 0)))
        st = pi0_fail(err, PI0_ERR_BACKEND, "graph instantiation failed: %s", cudaGetErrorString(e));
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return st;
}

/* ---- the backend ------------------------------------------------------------------------------- */

static graph_shape shape_of(const pi0_plan *p) {
    return (graph_shape){p->batch, p->horizon, p->num_steps, p->num_images, p->total_prefix, p->max_prefix};
}

/* The graph for this shape, made (and the least recently used one dropped) when needed. */
static pi0_status graph_for(cuda_state *s, const pi0_model *m, const graph_shape *shape, cuda_graph **out, pi0_error *err) {
    int free_slot = -1, oldest = 0;
    for (int i = 0; i < MAX_GRAPHS; i++) {
        cuda_graph *g = s->graphs[i];
        if (g && !memcmp(&g->shape, shape, sizeof *shape)) {
            g->last_used = ++s->clock;
            *out = g;
            return PI0_OK;
        }
        if (!g && free_slot < 0) free_slot = i;
        if (g && s->graphs[oldest] && g->last_used < s->graphs[oldest]->last_used) oldest = i;
    }
    if (free_slot < 0) {
        graph_free(s, s->graphs[oldest]);
        s->graphs[oldest] = NULL;
        free_slot = oldest;
    }
    TRY(graph_new(s, m, shape, &s->graphs[free_slot], err));
    s->graphs[free_slot]->last_used = ++s->clock;
    *out = s->graphs[free_slot];
    return PI0_OK;
}

static pi0_status cuda_sample(pi0_model *m, const pi0_plan *p, float *actions, pi0_timings *timings, pi0_error *err) {
    cuda_state *s = m->backend_state;
    graph_shape shape = shape_of(p);
    cuda_graph *g;
    if (p->max_prefix + p->horizon + 1 > ROPE_MAX_POS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "a sample has %d tokens; the cuda backend supports up to %d",
                        p->max_prefix + p->horizon + 1, ROPE_MAX_POS);
    TRY(graph_for(s, m, &shape, &g, err));
    fill_inputs(g, m, p);
    cudaGetLastError(); /* a stale error of someone else's call must not be taken for ours */
    if (s->use_graphs && g->exec) {
        CUDA_TRY(cudaGraphLaunch(g->exec, s->stream));
    } else {
        pi0_status st = enqueue(s, m, g, err);
        if (st) {
            cudaStreamSynchronize(s->stream);
            cudaGetLastError();
            return st;
        }
    }
    CUDA_TRY(cudaStreamSynchronize(s->stream));
    CUDA_TRY(cudaGetLastError());
    memcpy(actions, g->actions_host, (size_t)p->batch * p->horizon * m->dims.action_dim * sizeof(float));
    if (timings) {
        float vision = 0, prefix = 0, denoise = 0;
        CUDA_TRY(cudaEventElapsedTime(&vision, g->events[0], g->events[1]));
        CUDA_TRY(cudaEventElapsedTime(&prefix, g->events[1], g->events[2]));
        CUDA_TRY(cudaEventElapsedTime(&denoise, g->events[2], g->events[3]));
        *timings = (pi0_timings){vision, prefix, denoise, (double)vision + prefix + denoise};
    }
    /* the first call of a shape ran eagerly; later calls replay its graph */
    if (s->use_graphs && !g->exec) TRY(capture(s, m, g, err));
    return PI0_OK;
}

static void cuda_release(pi0_model *m) {
    cuda_state *s = m->backend_state;
    if (!s) return;
    if (s->stream) cudaStreamSynchronize(s->stream);
    for (int i = 0; i < MAX_GRAPHS; i++) graph_free(s, s->graphs[i]);
    for (int i = 0; i < s->num_allocations; i++) cudaFree(s->allocations[i]);
    free(s->allocations);
    free(s->w.vit), free(s->w.llm), free(s->w.expert);
    gemm_free(&s->gemm);
    if (s->stream) cudaStreamDestroy(s->stream);
    free(s);
    m->backend_state = NULL;
}

static pi0_status cuda_init(pi0_model *m, pi0_error *err) {
    cuda_state *s = calloc(1, sizeof *s);
    if (!s) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    m->backend_state = s;
    s->use_graphs = 1;
    const char *skinny_env = getenv("PI0_SKINNY"); /* PI0_SKINNY=0: cuBLASLt for every row count (A/B runs) */
    s->use_skinny = !(skinny_env && !strcmp(skinny_env, "0"));
    pi0_status st = PI0_OK;
    if (cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking) != cudaSuccess)
        st = pi0_fail(err, PI0_ERR_BACKEND, "cannot create a CUDA stream: %s", cudaGetErrorString(cudaGetLastError()));
    if (!st) st = gemm_init(&s->gemm, err);
    if (!st) st = cuda_weights_upload(s, m, err);
    if (st) cuda_release(m);
    return st;
}

static uint64_t cuda_device_bytes(const pi0_model *m) {
    const cuda_state *s = m->backend_state;
    return s ? s->peak_device_bytes : 0;
}

int pi0_cuda_available(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count > 0;
}

void pi0_cuda_set_graphs(pi0_model *m, int enabled) {
    cuda_state *s = m->backend_state;
    s->use_graphs = enabled;
}

const pi0_backend_ops pi0_cuda_backend = {"cuda", cuda_init, cuda_sample, cuda_release, cuda_device_bytes};
