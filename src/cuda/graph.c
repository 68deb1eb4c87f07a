/*
 * graph.c - the CUDA backend as the library sees it: one CUDA graph per input shape, the memory the
 * graphs work in, and the backend's entry points (init, sample, release).
 *
 * Memory. Graphs run one at a time, so they share one workspace (inputs, activations, K/V cache) sized
 * for the largest shape seen, with a pinned host mirror of the inputs and the actions; a shape that does
 * not fit grows it, which drops every graph made so far (their pointers are in them). What depends only on
 * the step count (step_tables) is computed once per count. A server that prepares its largest shape
 * first (pi0_policy_warmup) allocates once.
 *
 * A call fills the pinned inputs, sends them and the images on their way (send_images), replays the graph (whose
 * last node copies the actions out, with what the device found of NaN or infinity in the images) and waits. The
 * first call of a shape runs the forward pass (forward.c) eagerly, which also warms cuBLASLt and the kernels up, then
 * captures it. PI0_CUDA_GRAPHS=0 in the environment runs every call eagerly (read at each call).
 */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/attention.h"
#include "cuda/backend.h"
#include "util/error.h"
#include "util/switches.h"

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

static void carve_suffix_rows(carver *c, suffix_rows *r, int per_sample, const graph_shape *sh) {
    size_t B = (size_t)sh->batch;
    r->per_sample = per_sample;
    r->pos = carve(c, B * per_sample * sizeof(int));
    r->cache_row = carve(c, B * per_sample * sizeof(int));
    r->segments = carve(c, B * sizeof(attn_segment));
    r->action_rows = carve(c, B * sh->horizon * sizeof(int));
}

static void carve_inputs(carver *c, graph_inputs *in, const graph_shape *sh, int suffix_len, const pi0_dims *d) {
    size_t B = (size_t)sh->batch, T = (size_t)sh->total_prefix, BH = B * sh->horizon;
    if (sh->frames) in->frame_jobs = carve(c, (size_t)sh->num_images * sizeof(pi0_frame_job));
    else in->images = carve(c, (size_t)sh->num_images * d->image_size * d->image_size * 3 * sizeof(float));
    /* image_flags in the state's carve, where one sample's leaves room (so that they move nothing else), and just
     * before x_t: the two come back in one copy (outputs_size) */
    size_t state = B * d->action_dim * sizeof(float);
    in->state = carve(c, state + (size_t)sh->num_images * sizeof(int));
    in->image_flags = (int *)((char *)in->state + state);
    in->x_t = carve(c, BH * d->action_dim * sizeof(float));
    in->prefix_src = carve(c, T * sizeof(int));
    in->prefix_pos = carve(c, T * sizeof(int));
    in->prefix_cache_row = carve(c, T * sizeof(int));
    in->vit_segments = carve(c, (size_t)sh->num_images * sizeof(attn_segment));
    in->prefix_segments = carve(c, B * sizeof(attn_segment));
    carve_suffix_rows(c, &in->first_step, suffix_len, sh);
    carve_suffix_rows(c, &in->later_steps, sh->horizon, sh);
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

/* The step tables of a step count (forward.c's cuda_step_constants fills them). */
static void carve_tables(carver *c, step_tables *t, const pi0_dims *d) {
    const pi0_stack_dims *e = &d->expert;
    size_t steps = (size_t)t->num_steps, We = (size_t)e->width, f = sizeof(float);
    t->out_bias = carve(c, (size_t)d->action_dim * f);
    t->out_gate = carve(c, (size_t)d->action_dim * f);
    t->denoise_layers = carve(c, steps * e->depth * sizeof(pi0_denoise_layer));
    if (d->kind == PI0_MODEL_PI0) {
        t->time_bias = carve(c, steps * We * f);
        return;
    }
    size_t qkv_dim = (size_t)(e->num_heads + 2 * e->num_kv_heads) * e->head_dim;
    t->mods = carve(c, (2 * (size_t)e->depth + 1) * 3 * steps * We * f);
    t->qkv_bias = carve(c, (size_t)e->depth * steps * qkv_dim * f);
    t->gate_up_bias = carve(c, (size_t)e->depth * steps * 2 * e->mlp_dim * f);
    t->time_emb = carve(c, 3 * steps * We * f);
    t->in_scale = carve(c, (2 * (size_t)e->depth + 1) * steps * We * sizeof(pi0_bf16));
    t->out_col_bias = carve(c, steps * d->action_dim * f);
}

static void tables_free(cuda_state *s, step_tables *t) {
    if (!t) return;
    cudaFree(t->device);
    free(t);
    (void)s;
}

/* The step tables of `steps`, made and filled the first time. */
static pi0_status tables_for(cuda_state *s, const pi0_model *m, int steps, const step_tables **out, pi0_error *err) {
    for (int i = 0; i < s->num_tables; i++)
        if (s->tables[i]->num_steps == steps) return *out = s->tables[i], PI0_OK;
    step_tables *t = calloc(1, sizeof *t), **grown = realloc(s->tables, (size_t)(s->num_tables + 1) * sizeof *grown);
    if (grown) s->tables = grown;
    if (!t || !grown) return free(t), pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    t->num_steps = steps;
    carver size = {0};
    carve_tables(&size, t, &m->dims);
    if (cudaMalloc((void **)&t->device, size.used) != cudaSuccess) {
        cudaGetLastError();
        free(t);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate %.1f MB of GPU memory for %d steps' tables",
                        (double)size.used / 1e6, steps);
    }
    carver at = {(uintptr_t)t->device, 0};
    carve_tables(&at, t, &m->dims);
    pi0_status st = cuda_step_constants(s, m, t, err);
    if (st) return tables_free(s, t), st;
    s->tables[s->num_tables++] = t;
    *out = t;
    return PI0_OK;
}

/* Whether the denoise step of this graph runs as one persistent kernel (denoise.h): asked for (and the skinny
 * path not turned off), one sample, and dims the kernel takes. */
static int denoise_persistent(const cuda_state *s, const cuda_graph *g, const pi0_dims *d) {
    const pi0_stack_dims *e = &d->expert;
    return s->use_skinny && s->use_persistent && g->shape.batch == 1 &&
           pi0_cuda_denoise_supported(g->suffix_len, e->width, e->num_heads, e->num_kv_heads, e->head_dim, e->mlp_dim,
                                      e->depth, g->shape.max_prefix + g->suffix_len);
}

static void carve_activations(carver *c, cuda_graph *g, const pi0_dims *d) {
    const graph_shape *sh = &g->shape;
    size_t NP = (size_t)sh->num_images * image_tokens(d), T = (size_t)sh->total_prefix;
    size_t B = (size_t)sh->batch, R = B * g->suffix_len, BH = B * sh->horizon;
    size_t Dv = (size_t)d->vision.width, D = (size_t)d->llm.width, We = (size_t)d->expert.width;
    size_t kv_dim = (size_t)d->llm.num_kv_heads * d->llm.head_dim, cache_rows = T + R, bf = sizeof(pi0_bf16);
    size_t f = sizeof(float);
    g->images = sh->frames ? carve(c, (size_t)sh->num_images * d->image_size * d->image_size * 3 * f) : g->in.images;
    g->vit_x = carve(c, NP * Dv * f);
    g->vit_h = carve(c, NP * Dv * bf);
    g->vit_qkv = carve(c, NP * 3 * Dv * bf);
    g->vit_att = carve(c, NP * Dv * bf);
    g->vit_mlp = carve(c, NP * d->vision.mlp_dim * bf);
    /* im2col's pieces are read once, by the patch embedding, before the first fc1 writes vit_mlp: its space where they
     * fit (SigLIP's: 6 x 588 of 4304), their own otherwise */
    size_t piece_cols = (size_t)PI0_PATCH_PIECES * 3 * d->patch_size * d->patch_size;
    g->patches = piece_cols <= (size_t)d->vision.mlp_dim ? g->vit_mlp : carve(c, NP * piece_cols * bf);
    g->vision = carve(c, NP * D * f);
    g->x = carve(c, T * D * f);
    carve_gemma(c, &g->prefix, T, &d->llm);
    g->cache_k = carve(c, (size_t)d->llm.depth * cache_rows * kv_dim * bf);
    g->cache_v = carve(c, (size_t)d->llm.depth * cache_rows * kv_dim * bf);
    g->suffix = carve(c, R * We * f);
    g->suffix_bf16 = carve(c, R * We * bf);
    g->suffix_attn_ws_bytes = pi0_cuda_attention_workspace((int)B, d->expert.num_kv_heads, d->expert.head_dim);
    g->suffix_attn_ws = carve(c, g->suffix_attn_ws_bytes);
    g->denoise_ws = g->persistent ? carve(c, pi0_cuda_denoise_workspace(d->expert.num_kv_heads, d->expert.head_dim,
                                                                        sh->max_prefix + g->suffix_len))
                                  : NULL;
    if (d->kind == PI0_MODEL_PI0) { /* the suffix's parts (Pi0.5's action tokens are written into the suffix) */
        g->state_token = carve(c, B * We * f);
        g->action_tokens = carve(c, BH * We * f);
        g->time_hidden = carve(c, BH * We * bf);
    }
    carve_gemma(c, &g->suffix_buffers, R, &d->expert);
    g->final_h = carve(c, BH * We * bf);
    if (B == 1) { /* last, so that they move nothing else */
        g->x_t_alt = carve(c, BH * d->action_dim * f);
        g->suffix_bf16_alt = d->kind == PI0_MODEL_PI05 ? carve(c, R * We * bf) : NULL;
    }
}

static void graph_free(cuda_graph *g) {
    if (!g) return;
    if (g->exec) cudaGraphExecDestroy(g->exec);
    for (int i = 0; i < 4; i++)
        if (g->events[i]) cudaEventDestroy(g->events[i]);
    free(g);
}

static void graphs_drop(cuda_state *s) {
    for (int i = 0; i < s->num_graphs; i++) graph_free(s->graphs[i]);
    s->num_graphs = 0;
}

/* Grows the workspace to `device_bytes` (and its pinned mirror to `host_bytes`); every graph made so far
 * points into the old one, so they go. */
static pi0_status workspace_reserve(cuda_state *s, const graph_shape *shape, size_t device_bytes, size_t host_bytes,
                                    pi0_error *err) {
    if (device_bytes <= s->work_size && host_bytes <= s->work_host_size) return PI0_OK;
    graphs_drop(s);
    if (s->work) cudaFree(s->work), s->device_bytes -= s->work_size;
    if (s->work_host) cudaFreeHost(s->work_host);
    s->work = s->work_host = NULL;
    s->work_size = s->work_host_size = 0;
    if (cudaMalloc((void **)&s->work, device_bytes) != cudaSuccess) {
        cudaGetLastError();
        s->work = NULL;
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of GPU memory for a batch of %d (%d prefix tokens): its "
                        "activations need %.2f GB and %.2f GB are in use; a smaller batch may fit", shape->batch,
                        shape->total_prefix, (double)device_bytes / 1e9, (double)s->device_bytes / 1e9);
    }
    s->work_size = device_bytes;
    s->device_bytes += device_bytes;
    if (s->device_bytes > s->peak_device_bytes) s->peak_device_bytes = s->device_bytes;
    if (cudaMallocHost((void **)&s->work_host, host_bytes) != cudaSuccess) {
        cudaGetLastError();
        s->work_host = NULL;
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate %.1f MB of pinned host memory", (double)host_bytes / 1e6);
    }
    s->work_host_size = host_bytes;
    return PI0_OK;
}

static pi0_status graph_new(cuda_state *s, const pi0_model *m, const graph_shape *shape, cuda_graph **out,
                            pi0_error *err) {
    const pi0_dims *d = &m->dims;
    cuda_graph *g = calloc(1, sizeof *g);
    if (!g) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    g->shape = *shape;
    g->suffix_len = shape->horizon + (d->kind == PI0_MODEL_PI0);
    g->persistent = denoise_persistent(s, g, d);
    carver inputs = {0}, all = {0};
    carve_inputs(&inputs, &g->in, shape, g->suffix_len, d);
    size_t actions_bytes = (size_t)shape->batch * shape->horizon * d->action_dim * sizeof(float);
    g->inputs_size = inputs.used;
    g->images_size = shape->frames ? 0 : (uintptr_t)g->in.state; /* carved at 0: the offset past the images */
    g->actions_at = (uintptr_t)g->in.x_t - (uintptr_t)g->in.image_flags;
    g->outputs_size = g->actions_at + actions_bytes;
    all.used = inputs.used;
    carve_activations(&all, g, d);
    pi0_status st = tables_for(s, m, shape->num_steps, &g->tables, err);
    if (!st) st = workspace_reserve(s, shape, all.used, g->inputs_size + g->outputs_size, err);
    for (int i = 0; i < 4 && !st; i++)
        if (cudaEventCreate(&g->events[i]) != cudaSuccess) st = pi0_fail(err, PI0_ERR_BACKEND, "cudaEventCreate failed");
    if (st) {
        graph_free(g);
        return st;
    }
    /* the same carving again, now at the workspace's addresses */
    g->device = s->work, g->host = s->work_host;
    carver dev_in = {(uintptr_t)g->device, 0}, host_in = {(uintptr_t)g->host, 0}, dev_all = {(uintptr_t)g->device, g->inputs_size};
    carve_inputs(&dev_in, &g->in, shape, g->suffix_len, d);
    carve_inputs(&host_in, &g->in_host, shape, g->suffix_len, d);
    carve_activations(&dev_all, g, d);
    g->outputs_host = g->host + g->inputs_size;
    *out = g;
    return PI0_OK;
}

/* ---- inputs ---------------------------------------------------------------------------------- */

/* Whether `ptr` is page-locked host memory (pi0_host_alloc's, or the caller's own cudaHostAlloc or cudaHostRegister),
 * which the copy engine reads as it is. */
static int pinned(const void *ptr) {
    struct cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, ptr) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return a.type == cudaMemoryTypeHost;
}

/* The images on their way to the device, in stream order ahead of the graph: an image in pinned memory straight from
 * where it is; any other through the pinned inputs, image by image, each image's copy to the device queued as soon
 * as the host has copied it, so that the host's copies and the DMA overlap. On the OpenMP threads when the plan says
 * so. NaN and infinity are looked for on the device (im2col, image_flags), not here. Returns an error of the copies
 * to the device (the largest code, if several failed). */
static cudaError_t send_images(const cuda_state *s, const cuda_graph *g, const pi0_plan *p, size_t image) {
    int device = 0, worst = (int)cudaGetDevice(&device); /* the workers' CUDA calls go to the caller's device */
    int threads = p->num_images < omp_get_max_threads() ? p->num_images : omp_get_max_threads(); /* an image each */
    if (threads < 1) threads = 1;
#pragma omp parallel for schedule(dynamic, 1) reduction(max : worst) num_threads(threads) if (p->host_threads)
    for (int i = 0; i < p->num_images; i++) {
        const float *src = p->images[i];
        if (!src || !pinned(src)) {
            float *host = g->in_host.images + (size_t)i * image;
            if (src) memcpy(host, src, image * sizeof(float));
            else memset(host, 0, image * sizeof(float)); /* a masked camera in uniform mode: zeros */
            src = host;
        }
        int before = device; /* an OpenMP worker's own device, given back after (the threads are the program's too) */
        cudaError_t e = p->host_threads ? cudaGetDevice(&before) : cudaSuccess;
        if (!e && before != device) e = cudaSetDevice(device);
        if (!e) e = cudaMemcpyAsync(g->in.images + (size_t)i * image, src, image * sizeof(float), cudaMemcpyHostToDevice,
                                    s->stream);
        if (before != device) cudaSetDevice(before);
        if ((int)e > worst) worst = (int)e;
    }
    return (cudaError_t)worst;
}

/* Whether the device found a NaN or infinity in an image the model reads (a masked camera's is computed in uniform
 * mode but never read, so its flag does not count). */
static int nonfinite_image(const cuda_graph *g, const pi0_plan *p) {
    const int *flags = (const int *)g->outputs_host;
    if (p->has_frames) return 0; /* bytes: always finite */
    for (int i = 0; i < p->num_images; i++)
        if (flags[i] && plan_image_read(p, i)) return 1;
    return 0;
}

static void copy_suffix_rows(const suffix_rows *to, const suffix_rows *from, const pi0_plan *p) {
    size_t B = (size_t)p->batch, R = B * from->per_sample;
    memcpy(to->pos, from->pos, R * sizeof(int));
    memcpy(to->cache_row, from->cache_row, R * sizeof(int));
    memcpy(to->segments, from->segments, B * sizeof(attn_segment));
    memcpy(to->action_rows, from->action_rows, B * p->horizon * sizeof(int));
}

static void fill_inputs(const cuda_graph *g, const pi0_model *m, const pi0_plan *p) {
    const pi0_dims *d = &m->dims;
    const graph_inputs *in = &g->in_host;
    size_t B = (size_t)p->batch;
    if (p->state) memcpy(in->state, p->state, B * d->action_dim * sizeof(float)); /* Pi0.5 has none */
    memcpy(in->x_t, p->noise, B * p->horizon * d->action_dim * sizeof(float));
    memset(in->image_flags, 0, (size_t)p->num_images * sizeof(int));
    memcpy(in->prefix_src, p->prefix_src, (size_t)p->total_prefix * sizeof(int));
    memcpy(in->prefix_pos, p->prefix_pos, (size_t)p->total_prefix * sizeof(int));
    memcpy(in->prefix_cache_row, p->prefix_cache_row, (size_t)p->total_prefix * sizeof(int));
    int P = p->tokens_per_image;
    for (int i = 0; i < p->num_images; i++) in->vit_segments[i] = (attn_segment){i * P, P, i * P, P, 0};
    memcpy(in->prefix_segments, p->prefix_segments, B * sizeof(attn_segment));
    copy_suffix_rows(&in->first_step, &p->first_step, p);
    copy_suffix_rows(&in->later_steps, &p->later_steps, p);
}

/* ---- camera frames --------------------------------------------------------------------------------- */

/* What one frame needs on the device: its bytes, then each resampled axis's first, count and weights. */
typedef struct {
    int new_h, new_w, pad_y, pad_x;
    pi0_axis_weights x, y; /* zeroed where Pillow skips the pass (that side keeps its size) */
    int pinned;            /* the frame's bytes are page-locked: copied to the device from where they are */
} frame_plan;

static size_t frame_bytes(const pi0_frame *f, const frame_plan *fp) {
    size_t bytes = (size_t)f->height * f->width * 3 + ALIGN;
    if (fp->x.weights) bytes += (size_t)fp->new_w * (2 * sizeof(int) + fp->x.max_taps * sizeof(int32_t)) + 3 * ALIGN;
    if (fp->y.weights) bytes += (size_t)fp->new_h * (2 * sizeof(int) + fp->y.max_taps * sizeof(int32_t)) + 3 * ALIGN;
    return bytes;
}

/* Copies `size` bytes to the staging buffer at c (host), returning the device address they will have there. */
static void *stage(carver *c, const cuda_state *s, const void *src, size_t size) {
    void *host = carve(c, size);
    memcpy(host, src, size);
    return s->frames + ((uintptr_t)host - (uintptr_t)s->frames_host);
}

static void stage_axis(carver *c, const cuda_state *s, const pi0_axis_weights *k, int out, const int **first,
                       const int **count, const int32_t **weights, int *taps) {
    if (!k->weights) return;
    *first = stage(c, s, k->first, (size_t)out * sizeof(int));
    *count = stage(c, s, k->count, (size_t)out * sizeof(int));
    *weights = stage(c, s, k->weights, (size_t)out * k->max_taps * sizeof(int32_t));
    *taps = (int)k->max_taps;
}

/* Grows the frame staging buffers to hold `bytes` (twice that, so that a little larger frames later do not
 * reallocate on a request's path). The stream is idle: every call waits for its graph. */
static pi0_status frames_reserve(cuda_state *s, size_t bytes, pi0_error *err) {
    if (bytes <= s->frames_size) return PI0_OK;
    if (s->frames) cudaFree(s->frames), s->device_bytes -= s->frames_size;
    if (s->frames_host) cudaFreeHost(s->frames_host);
    s->frames = s->frames_host = NULL;
    s->frames_size = 0;
    bytes *= 2;
    if (cudaMalloc((void **)&s->frames, bytes) != cudaSuccess || cudaMallocHost((void **)&s->frames_host, bytes)) {
        cudaGetLastError();
        if (s->frames) cudaFree(s->frames), s->frames = NULL;
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for %.1f MB of camera frames", (double)bytes / 1e6);
    }
    s->frames_size = bytes;
    s->device_bytes += bytes;
    if (s->device_bytes > s->peak_device_bytes) s->peak_device_bytes = s->device_bytes;
    return PI0_OK;
}

/* The plan's frames, their geometry and Pillow's weights into the staging buffers, one job per frame in the
 * graph's host inputs, and the staged bytes copied to the device on the stream (before the graph runs). A frame in
 * page-locked memory (pi0_host_alloc's) is not staged: its own copy to the device goes from where it is, into room
 * left after the staged bytes. */
static pi0_status stage_frames(cuda_state *s, const pi0_model *m, const cuda_graph *g, const pi0_plan *p,
                               pi0_error *err) {
    int n = p->num_images, S = m->dims.image_size;
    frame_plan *plans = calloc((size_t)n + 1, sizeof *plans);
    if (!plans) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    pi0_status st = PI0_OK;
    size_t bytes = 0;
    for (int i = 0; i < n && !st; i++) {
        const pi0_frame *f = &p->frames[i];
        frame_plan *fp = &plans[i];
        if (!f->pixels) continue;
        pi0_resize_with_pad_geometry(f->height, f->width, S, S, &fp->new_h, &fp->new_w, &fp->pad_y, &fp->pad_x);
        if (fp->new_w != f->width) st = pi0_axis_weights_init(&fp->x, f->width, fp->new_w, err);
        if (!st && fp->new_h != f->height) st = pi0_axis_weights_init(&fp->y, f->height, fp->new_h, err);
        bytes += frame_bytes(f, fp);
    }
    if (!st) st = frames_reserve(s, bytes, err);
    carver at = {(uintptr_t)s->frames_host, 0};
    for (int i = 0; i < n && !st; i++) {
        const pi0_frame *f = &p->frames[i];
        const frame_plan *fp = &plans[i];
        pi0_frame_job *job = &g->in_host.frame_jobs[i];
        *job = (pi0_frame_job){0};
        if (!f->pixels) continue;
        *job = (pi0_frame_job){.height = f->height, .width = f->width, .new_h = fp->new_h, .new_w = fp->new_w,
                               .pad_y = fp->pad_y, .pad_x = fp->pad_x};
        if (!(plans[i].pinned = pinned(f->pixels))) job->pixels = stage(&at, s, f->pixels, (size_t)f->height * f->width * 3);
        stage_axis(&at, s, &fp->x, fp->new_w, &job->x_first, &job->x_count, &job->x_weights, &job->x_taps);
        stage_axis(&at, s, &fp->y, fp->new_h, &job->y_first, &job->y_count, &job->y_weights, &job->y_taps);
    }
    cudaError_t e = !st && at.used ? cudaMemcpyAsync(s->frames, s->frames_host, at.used, cudaMemcpyHostToDevice, s->stream)
                                   : cudaSuccess;
    for (int i = 0; i < n && !st && !e; i++) { /* the page-locked frames, each from where it is */
        const pi0_frame *f = &p->frames[i];
        if (!f->pixels || !plans[i].pinned) continue;
        size_t size = (size_t)f->height * f->width * 3;
        uint8_t *dst = s->frames + ((uint8_t *)carve(&at, size) - s->frames_host);
        g->in_host.frame_jobs[i].pixels = dst;
        e = cudaMemcpyAsync(dst, f->pixels, size, cudaMemcpyHostToDevice, s->stream);
    }
    for (int i = 0; i < n; i++) pi0_axis_weights_free(&plans[i].x), pi0_axis_weights_free(&plans[i].y);
    free(plans);
    if (!st && e) st = pi0_fail(err, PI0_ERR_BACKEND, "copying the camera frames: %s", cudaGetErrorString(e));
    return st;
}

/* ---- graphs ------------------------------------------------------------------------------------ */

/* Records the forward pass into a graph; a failure mid-capture ends the capture and drops it. */
static pi0_status capture(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    cudaGraph_t graph = NULL;
    CUDA_TRY(cudaStreamBeginCapture(s->stream, cudaStreamCaptureModeThreadLocal));
    pi0_status st = cuda_forward(s, m, g, err);
    cudaError_t e = cudaStreamEndCapture(s->stream, &graph);
    if (!st && e) st = pi0_fail(err, PI0_ERR_BACKEND, "graph capture failed: %s", cudaGetErrorString(e));
    /* each kernel at the priority of the stream it was captured from (streams_init) */
    if (!st && (e = cudaGraphInstantiate(&g->exec, graph, cudaGraphInstantiateFlagUseNodePriority)))
        st = pi0_fail(err, PI0_ERR_BACKEND, "graph instantiation failed: %s", cudaGetErrorString(e));
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    return st;
}

static graph_shape shape_of(const pi0_plan *p) {
    return (graph_shape){p->batch, p->horizon, p->num_steps, p->num_images, p->total_prefix, p->max_prefix,
                         p->has_frames};
}

/* The graph for this shape, made (and the least recently used one dropped past max_graphs) when needed. */
static pi0_status graph_for(cuda_state *s, const pi0_model *m, const graph_shape *shape, cuda_graph **out, pi0_error *err) {
    int oldest = 0;
    for (int i = 0; i < s->num_graphs; i++) {
        cuda_graph *g = s->graphs[i];
        if (!memcmp(&g->shape, shape, sizeof *shape)) {
            g->last_used = ++s->clock;
            *out = g;
            return PI0_OK;
        }
        if (g->last_used < s->graphs[oldest]->last_used) oldest = i;
    }
    if (s->num_graphs == s->max_graphs) {
        graph_free(s->graphs[oldest]);
        s->graphs[oldest] = s->graphs[--s->num_graphs];
    }
    if (s->num_graphs == s->cap_graphs) {
        int cap = s->cap_graphs ? 2 * s->cap_graphs : 16;
        cuda_graph **grown = realloc(s->graphs, (size_t)cap * sizeof *grown);
        if (!grown) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
        s->graphs = grown, s->cap_graphs = cap;
    }
    cuda_graph *g = NULL;
    TRY(graph_new(s, m, shape, &g, err));
    s->captures++;
    g->last_used = ++s->clock;
    s->graphs[s->num_graphs++] = g; /* after graph_new: growing the workspace may have dropped the others */
    *out = g;
    return PI0_OK;
}

static int graphs_enabled(void) { return !switched_off("PI0_CUDA_GRAPHS"); }

/* ---- the backend ------------------------------------------------------------------------------- */

/* A call that fails with work queued waits for it before it returns (the copies read the pinned inputs, which the next
 * call rewrites, and may read the caller's images), and clears the error that work left. */
static void drain(cuda_state *s) {
    cudaStreamSynchronize(s->stream);
    cudaGetLastError();
}

static pi0_status cuda_sample(pi0_model *m, const pi0_plan *p, float *actions, pi0_timings *timings, pi0_error *err) {
    cuda_state *s = m->backend_state;
    graph_shape shape = shape_of(p);
    cuda_graph *g = NULL;
    int use_graphs = graphs_enabled();
    if (p->max_prefix + p->suffix_len > ROPE_MAX_POS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "a sample has %d tokens; the cuda backend supports up to %d",
                        p->max_prefix + p->suffix_len, ROPE_MAX_POS);
    TRY(graph_for(s, m, &shape, &g, err));
    cudaGetLastError(); /* a stale error of someone else's call must not be taken for ours */
    fill_inputs(g, m, p);
    /* the frames before the inputs' copy: staging them fills their frame jobs; a failure may leave some of their copies
     * queued, from the caller's memory */
    pi0_status staged = p->has_frames ? stage_frames(s, m, g, p, err) : PI0_OK;
    if (staged) return drain(s), staged;
    /* the inputs past the images first: the copy engine is idle while the host copies the images, and the graph
     * then starts with the vision's first kernel */
    cudaError_t sent = cudaMemcpyAsync(g->device + g->images_size, g->host + g->images_size,
                                       g->inputs_size - g->images_size, cudaMemcpyHostToDevice, s->stream);
    if (!sent && !p->has_frames) sent = send_images(s, g, p, (size_t)m->dims.image_size * m->dims.image_size * 3);
    if (sent)
        return drain(s), pi0_fail(err, PI0_ERR_BACKEND, "copying the inputs to the device: %s", cudaGetErrorString(sent));
    if (use_graphs && g->exec) {
        cudaError_t e = cudaGraphLaunch(g->exec, s->stream);
        if (e) return drain(s), pi0_fail(err, PI0_ERR_BACKEND, "cudaGraphLaunch: %s", cudaGetErrorString(e));
    } else {
        pi0_status st = cuda_forward(s, m, g, err);
        if (st) return drain(s), st;
    }
    CUDA_TRY(cudaStreamSynchronize(s->stream));
    CUDA_TRY(cudaGetLastError());
    if (nonfinite_image(g, p)) return plan_name_nonfinite_image(p, &m->dims, err);
    memcpy(actions, g->outputs_host + g->actions_at, (size_t)p->batch * p->horizon * m->dims.action_dim * sizeof(float));
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

/* The backend's stream and, unless PI0_BESIDE=0 (A/B runs), the side stream of forward.c's first_step_beside with
 * its events. The main stream then runs at the device's highest priority and the side stream at its lowest, so that
 * the first denoise step's short kernels take the multiprocessors the prefix leaves idle rather than delaying its
 * next kernel (bench/NOTES.md, session 19). */
static pi0_status streams_init(cuda_state *s, const pi0_model *m, pi0_error *err) {
    int beside = !switched_off("PI0_BESIDE"), least = 0, greatest = 0;
    cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (!e) e = cudaStreamCreateWithPriority(&s->stream, cudaStreamNonBlocking, beside ? greatest : 0);
    if (!e && beside) e = cudaStreamCreateWithPriority(&s->side, cudaStreamNonBlocking, least);
    if (!e && beside) e = cudaEventCreateWithFlags(&s->forked, cudaEventDisableTiming);
    if (!e && beside) e = cudaEventCreateWithFlags(&s->joined, cudaEventDisableTiming);
    if (!e && beside && !(s->kv_ready = calloc((size_t)m->dims.llm.depth, sizeof *s->kv_ready)))
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    for (; !e && beside && s->num_kv_ready < m->dims.llm.depth; s->num_kv_ready++)
        e = cudaEventCreateWithFlags(&s->kv_ready[s->num_kv_ready], cudaEventDisableTiming);
    if (e) return pi0_fail(err, PI0_ERR_BACKEND, "cannot create the CUDA streams: %s", cudaGetErrorString(e));
    return PI0_OK;
}

static void side_free(cuda_state *s) {
    for (int i = 0; i < s->num_kv_ready; i++) cudaEventDestroy(s->kv_ready[i]);
    free(s->kv_ready);
    if (s->forked) cudaEventDestroy(s->forked);
    if (s->joined) cudaEventDestroy(s->joined);
    if (s->side) cudaStreamDestroy(s->side);
}

static void cuda_release(pi0_model *m) {
    cuda_state *s = m->backend_state;
    if (!s) return;
    if (s->stream) cudaStreamSynchronize(s->stream);
    if (s->side) cudaStreamSynchronize(s->side);
    graphs_drop(s);
    free(s->graphs);
    for (int i = 0; i < s->num_tables; i++) tables_free(s, s->tables[i]);
    free(s->tables);
    if (s->work) cudaFree(s->work);
    if (s->work_host) cudaFreeHost(s->work_host);
    if (s->frames) cudaFree(s->frames);
    if (s->frames_host) cudaFreeHost(s->frames_host);
    for (int i = 0; i < s->num_allocations; i++) cudaFree(s->allocations[i]);
    free(s->allocations);
    free(s->w.vit), free(s->w.llm), free(s->w.expert);
    gemm_free(&s->gemm);
    side_free(s);
    if (s->stream) cudaStreamDestroy(s->stream);
    free(s);
    m->backend_state = NULL;
}

static pi0_status cuda_init(pi0_model *m, pi0_error *err) {
    cuda_state *s = calloc(1, sizeof *s);
    if (!s) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    m->backend_state = s;
    s->use_skinny = !switched_off("PI0_SKINNY"); /* PI0_SKINNY=0: cuBLASLt for every row count (A/B runs) */
    /* PI0_PERSISTENT=1: the persistent denoise kernel, opt-in while it is slower than the skinny kernels (NOTES.md) */
    const char *persistent_env = getenv("PI0_PERSISTENT");
    s->use_persistent = persistent_env && !strcmp(persistent_env, "1");
    s->use_parts = !switched_off("PI0_PARTS"); /* PI0_PARTS=0: cuBLASLt's own split-K reductions (A/B runs) */
    s->use_gate_up = !switched_off("PI0_GATE_UP"); /* PI0_GATE_UP=0: cuBLASLt's gate|up, then gelu x up (A/B runs) */
    s->use_fused_euler = !switched_off("PI0_FUSED_EULER"); /* PI0_FUSED_EULER=0: the boundary's separate kernels */
    const char *max_env = getenv("PI0_CUDA_MAX_GRAPHS");
    s->max_graphs = max_env && atoi(max_env) > 0 ? atoi(max_env) : MAX_GRAPHS;
    int device = 0;
    cudaError_t e = cudaGetDevice(&device);
    if (!e) e = cudaDeviceGetAttribute(&s->multiprocessors, cudaDevAttrMultiProcessorCount, device);
    pi0_status st = e ? pi0_fail(err, PI0_ERR_BACKEND, "cannot query the CUDA device: %s", cudaGetErrorString(e))
                      : streams_init(s, m, err);
    if (!st) st = gemm_init(&s->gemm, err);
    if (!st && s->side) st = gemm_side(&s->gemm, s->side, err);
    if (!st) st = cuda_weights_upload(s, m, err);
    if (st) cuda_release(m);
    return st;
}

static uint64_t cuda_device_bytes(const pi0_model *m) {
    const cuda_state *s = m->backend_state;
    return s ? s->peak_device_bytes : 0;
}

static uint64_t cuda_graph_captures(const pi0_model *m) {
    const cuda_state *s = m->backend_state;
    return s ? s->captures : 0;
}

void *pi0_cuda_host_alloc(size_t bytes) {
    void *ptr = NULL;
    if (cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return ptr;
}

void pi0_cuda_host_free(void *ptr) {
    cudaFreeHost(ptr);
}

int pi0_cuda_available(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    return count > 0;
}

const pi0_backend_ops pi0_cuda_backend = {"cuda",           cuda_init,           cuda_sample,        cuda_release,
                                          cuda_device_bytes, cuda_graph_captures, cuda_keeps_on_host, 1};
