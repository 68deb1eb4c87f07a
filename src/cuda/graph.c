/*
 * graph.c - the CUDA backend as the library sees it: one CUDA graph per input shape, the memory each
 * graph works in, and the backend's entry points (init, sample, release).
 *
 * A graph owns one device block (inputs, per-shape constants, activations, K/V cache) and one pinned
 * host block mirroring the inputs. A call fills the pinned inputs, replays the graph (whose first node
 * copies them in and whose last copies the actions out) and waits. The first call of a shape runs the
 * forward pass (forward.c) eagerly, which also warms cuBLASLt and the kernels up, then captures it.
 * PI0_CUDA_GRAPHS=0 in the environment runs every call eagerly (read at each call).
 */
#include <stdlib.h>
#include <string.h>

#include "cuda/attention.h"
#include "cuda/backend.h"
#include "util/error.h"

#define ALIGN 256

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

static void carve_inputs(carver *c, graph_inputs *in, const graph_shape *sh, int suffix_len, const pi0_dims *d) {
    size_t B = (size_t)sh->batch, T = (size_t)sh->total_prefix, R = B * suffix_len, BH = B * sh->horizon;
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
    b->branch = carve(c, rows * d->width * sizeof(float));
}

/* Per-shape constants (forward.c's cuda_step_constants fills them). */
static void carve_constants(carver *c, cuda_graph *g, const pi0_dims *d) {
    const pi0_stack_dims *e = &d->expert;
    size_t steps = (size_t)g->shape.num_steps, We = (size_t)e->width, f = sizeof(float);
    g->vit_segments = carve(c, (size_t)g->shape.num_images * sizeof(attn_segment));
    g->out_bias = carve(c, (size_t)d->action_dim * f);
    if (d->kind == PI0_MODEL_PI0) {
        g->time_bias = carve(c, steps * We * f);
        return;
    }
    size_t qkv_dim = (size_t)(e->num_heads + 2 * e->num_kv_heads) * e->head_dim;
    g->mods = carve(c, (2 * (size_t)e->depth + 1) * 3 * steps * We * f);
    g->qkv_bias = carve(c, (size_t)e->depth * steps * qkv_dim * f);
    g->gate_up_bias = carve(c, (size_t)e->depth * steps * 2 * e->mlp_dim * f);
    g->time_emb = carve(c, 3 * steps * We * f);
    g->in_scale = carve(c, 2 * (size_t)e->depth * steps * We * sizeof(pi0_bf16));
}

static void carve_activations(carver *c, cuda_graph *g, const pi0_dims *d) {
    const graph_shape *sh = &g->shape;
    size_t NP = (size_t)sh->num_images * image_tokens(d), T = (size_t)sh->total_prefix;
    size_t B = (size_t)sh->batch, R = B * g->suffix_len, BH = B * sh->horizon;
    size_t Dv = (size_t)d->vision.width, D = (size_t)d->llm.width, We = (size_t)d->expert.width;
    size_t kv_dim = (size_t)d->llm.num_kv_heads * d->llm.head_dim, cache_rows = T + R, bf = sizeof(pi0_bf16);
    size_t f = sizeof(float);
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

static pi0_status graph_new(cuda_state *s, const pi0_model *m, const graph_shape *shape, cuda_graph **out,
                            pi0_error *err) {
    const pi0_dims *d = &m->dims;
    cuda_graph *g = calloc(1, sizeof *g);
    if (!g) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    g->shape = *shape;
    g->suffix_len = shape->horizon + (d->kind == PI0_MODEL_PI0);
    carver inputs = {0}, all = {0};
    carve_inputs(&inputs, &g->in, shape, g->suffix_len, d);
    size_t actions_bytes = (size_t)shape->batch * shape->horizon * d->action_dim * sizeof(float);
    g->inputs_size = inputs.used;
    all.used = inputs.used;
    carve_constants(&all, g, d);
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
        carve_inputs(&dev_in, &g->in, shape, g->suffix_len, d);
        carve_inputs(&host_in, &g->in_host, shape, g->suffix_len, d);
        carve_constants(&dev_all, g, d);
        carve_activations(&dev_all, g, d);
        g->actions_host = (float *)(g->host + g->inputs_size);
        for (int i = 0; i < 4 && !st; i++)
            if (cudaEventCreate(&g->events[i]) != cudaSuccess) st = pi0_fail(err, PI0_ERR_BACKEND, "cudaEventCreate failed");
    }
    if (!st) st = cuda_step_constants(s, m, g, err);
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
    size_t image = (size_t)d->image_size * d->image_size * 3, B = (size_t)p->batch, R = B * p->suffix_len;
    int P = image_tokens(d);
    for (int i = 0; i < p->num_images; i++) memcpy(in->images + i * image, p->images[i], image * sizeof(float));
    if (p->state) memcpy(in->state, p->state, B * d->action_dim * sizeof(float)); /* Pi0.5 has none */
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

/* ---- graphs ------------------------------------------------------------------------------------ */

/* Records the forward pass into a graph; a failure mid-capture ends the capture and drops it. */
static pi0_status capture(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    cudaGraph_t graph = NULL;
    CUDA_TRY(cudaStreamBeginCapture(s->stream, cudaStreamCaptureModeThreadLocal));
    pi0_status st = cuda_forward(s, m, g, err);
    cudaError_t e = cudaStreamEndCapture(s->stream, &graph);
    if (!st && e) st = pi0_fail(err, PI0_ERR_BACKEND, "graph capture failed: %s", cudaGetErrorString(e));
    if (!st && (e = cudaGraphInstantiate(&g->exec, graph, 0)))
        st = pi0_fail(err, PI0_ERR_BACKEND, "graph instantiation failed: %s", cudaGetErrorString(e));
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return st;
}

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

static int graphs_enabled(void) {
    const char *env = getenv("PI0_CUDA_GRAPHS");
    return !(env && !strcmp(env, "0"));
}

/* ---- the backend ------------------------------------------------------------------------------- */

static pi0_status cuda_sample(pi0_model *m, const pi0_plan *p, float *actions, pi0_timings *timings, pi0_error *err) {
    cuda_state *s = m->backend_state;
    graph_shape shape = shape_of(p);
    cuda_graph *g;
    int use_graphs = graphs_enabled();
    if (p->max_prefix + p->suffix_len > ROPE_MAX_POS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "a sample has %d tokens; the cuda backend supports up to %d",
                        p->max_prefix + p->suffix_len, ROPE_MAX_POS);
    TRY(graph_for(s, m, &shape, &g, err));
    fill_inputs(g, m, p);
    cudaGetLastError(); /* a stale error of someone else's call must not be taken for ours */
    if (use_graphs && g->exec) {
        CUDA_TRY(cudaGraphLaunch(g->exec, s->stream));
    } else {
        pi0_status st = cuda_forward(s, m, g, err);
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
    if (use_graphs && !g->exec) TRY(capture(s, m, g, err));
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

const pi0_backend_ops pi0_cuda_backend = {"cuda", cuda_init, cuda_sample, cuda_release, cuda_device_bytes};
