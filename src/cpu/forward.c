/*
 * forward.c - sample_actions of Pi0 and Pi0.5 in float32 on the CPU, top to bottom (docs/model.md):
 *
 *   vision:  valid camera images (or frames, resized as openpi does) -> SigLIP ViT -> projector -> 256 tokens each
 *   prefix:  [image tokens, scaled prompt embeddings] -> Gemma LLM -> per-layer K/V cache
 *   denoise: num_steps x (suffix tokens -> action expert over the cache -> velocity v; x <- x + dt v)
 *            Pi0:   suffix = [state token, action_time_mlp([action_in_proj(x), time_emb(t)])], the state
 *                   token in the first step only (its K/V serve the later ones: plan.h)
 *            Pi0.5: suffix = action_in_proj(x); the expert's norms are adaptive, conditioned on
 *                   time_mlp(time_emb(t)), and its residuals gated
 *
 * Every stage works on the packed rows of plan.h: only valid tokens exist.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu/cpu.h"
#include "cpu/ops.h"
#include "model/flow.h"
#include "model/image.h"
#include "util/clock.h"
#include "util/error.h"

/* Scratch of one Gemma block over `rows` rows; sized for the larger of prefix and suffix use. */
typedef struct {
    float *h, *q, *k, *v, *att, *gate, *up;
} gemma_scratch;

static void gemma_scratch_free(gemma_scratch *s) {
    free(s->h), free(s->q), free(s->k), free(s->v), free(s->att), free(s->gate), free(s->up);
    memset(s, 0, sizeof *s);
}

static int gemma_scratch_alloc(gemma_scratch *s, size_t rows, const pi0_stack_dims *d) {
    size_t q = (size_t)d->num_heads * d->head_dim, kv = (size_t)d->num_kv_heads * d->head_dim;
    s->h = malloc(rows * d->width * sizeof(float) + 1);
    s->q = malloc(rows * q * sizeof(float) + 1);
    s->k = malloc(rows * kv * sizeof(float) + 1);
    s->v = malloc(rows * kv * sizeof(float) + 1);
    s->att = malloc(rows * q * sizeof(float) + 1);
    s->gate = malloc(rows * d->mlp_dim * sizeof(float) + 1);
    s->up = malloc(rows * d->mlp_dim * sizeof(float) + 1);
    return s->h && s->q && s->k && s->v && s->att && s->gate && s->up ? 0 : -1;
}

/* Where this call's rows live in the K/V cache, and what they attend to. */
typedef struct {
    int rows;
    const int *positions;  /* RoPE position of each row */
    const int *cache_row;  /* K/V cache row each row's K and V are written to */
    const attn_segment *segments;
    int num_segments;
} gemma_rows;

/*
 * What an adaptive norm (Pi0.5's expert) makes of the time conditioning: (scale | shift | gate), W each,
 * for one step. NULL in a plain Gemma block.
 */
typedef const float *norm_mod;

/* RMSNorm of x into out: plain with the layer's (1 + w), or adaptive with (1 + scale) and shift. */
static void block_norm(float *out, const float *x, int rows, int W, const float *scale_w, norm_mod mod) {
    if (mod) cpu_rmsnorm_mod(out, x, rows, W, mod, mod + W, NORM_EPS);
    else cpu_rmsnorm(out, x, rows, W, scale_w, NORM_EPS);
}

/* x += in W^T, or with an adaptive norm's gate x += gate * (in W^T) (Pi0.5's gated residual); `tmp`
 * (rows, out_dim) holds the branch in the gated case. */
static void block_residual(float *x, const float *in, int rows, int in_dim, const float *w, int out_dim, norm_mod mod,
                           float *tmp) {
    if (!mod) return cpu_linear_add(x, in, rows, in_dim, w, NULL, out_dim);
    cpu_linear(tmp, in, rows, in_dim, w, NULL, out_dim);
    cpu_add_gated(x, tmp, rows, out_dim, mod + 2 * out_dim);
}

/*
 * One Gemma block over x (rows, width), in place: x += attn(norm(x)) Wo; x += MLP(norm(x)), with Pi0.5's
 * adaptive norms and gated residuals when mod_attn / mod_mlp are given (docs/model.md#gemma-block).
 * K and V of these rows are stored into the layer's cache before attention, so the rows attend to
 * whatever the cache already holds (the prefix) and to each other. With kv_only the block stops
 * once its K/V are stored, before its queries: the prefix pass's last layer has no other use.
 */
static int gemma_block(const gemma_layer *l, const pi0_stack_dims *d, float *x, const gemma_rows *r, float *cache_k,
                       float *cache_v, const rope_table *rope, gemma_scratch *s, int kv_only, norm_mod mod_attn,
                       norm_mod mod_mlp) {
    int W = d->width, hd = d->head_dim, q_dim = d->num_heads * hd, kv_dim = d->num_kv_heads * hd;
    block_norm(s->h, x, r->rows, W, l->input_norm, mod_attn);
    cpu_linear(s->k, s->h, r->rows, W, l->k_w, NULL, kv_dim);
    cpu_linear(s->v, s->h, r->rows, W, l->v_w, NULL, kv_dim);
    cpu_rope(s->k, r->rows, kv_dim, d->num_kv_heads, hd, r->positions, rope);
    for (int i = 0; i < r->rows; i++) {
        memcpy(cache_k + (size_t)r->cache_row[i] * kv_dim, s->k + (size_t)i * kv_dim, kv_dim * sizeof(float));
        memcpy(cache_v + (size_t)r->cache_row[i] * kv_dim, s->v + (size_t)i * kv_dim, kv_dim * sizeof(float));
    }
    if (kv_only) return 0; /* nothing reads this layer's queries either */
    cpu_linear(s->q, s->h, r->rows, W, l->q_w, NULL, q_dim);
    cpu_rope(s->q, r->rows, q_dim, d->num_heads, hd, r->positions, rope);
    if (cpu_attention(s->att, q_dim, s->q, q_dim, cache_k, cache_v, kv_dim, r->segments, r->num_segments,
                      d->num_heads, d->num_kv_heads, hd, 1.0f / sqrtf((float)hd)))
        return -1;
    block_residual(x, s->att, r->rows, q_dim, l->o_w, W, mod_attn, s->h);
    block_norm(s->h, x, r->rows, W, l->post_attn_norm, mod_mlp);
    cpu_linear(s->gate, s->h, r->rows, W, l->gate_w, NULL, d->mlp_dim);
    cpu_linear(s->up, s->h, r->rows, W, l->up_w, NULL, d->mlp_dim);
    cpu_gelu_mul(s->gate, s->up, (size_t)r->rows * d->mlp_dim);
    block_residual(x, s->gate, r->rows, d->mlp_dim, l->down_w, W, mod_mlp, s->h);
    return 0;
}

/* ---- vision ------------------------------------------------------------------------------------ */

/* Cuts an HWC image into patches flattened as (channel, row, col), matching (W, 3, p, p) weights; a NULL
 * image (a masked camera in uniform mode) is zeros. */
static void extract_patches(const float *image, int image_size, int patch, float *out) {
    int grid = image_size / patch, patch_dim = 3 * patch * patch;
    if (!image) {
        memset(out, 0, (size_t)grid * grid * patch_dim * sizeof(float));
        return;
    }
    for (int py = 0; py < grid; py++)
        for (int px = 0; px < grid; px++) {
            float *dst = out + (size_t)(py * grid + px) * patch_dim;
            for (int c = 0; c < 3; c++)
                for (int r = 0; r < patch; r++)
                    for (int col = 0; col < patch; col++)
                        dst[(c * patch + r) * patch + col] =
                            image[((size_t)(py * patch + r) * image_size + px * patch + col) * 3 + c];
        }
}

/* The plan's camera images as model input: the caller's, or its frames made model input as openpi's policy
 * transforms do (model/image.h) into *owned (num_images of them). A NULL image (a masked camera) is zeros. */
static pi0_status plan_images(const pi0_plan *p, int image_size, const float **images, float **owned,
                              pi0_error *err) {
    size_t image = (size_t)image_size * image_size * 3;
    if (!p->has_frames) {
        memcpy(images, p->images, (size_t)p->num_images * sizeof *images);
        return PI0_OK;
    }
    if (!(*owned = malloc((size_t)p->num_images * image * sizeof(float) + 1)))
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for %d camera images", p->num_images);
    pi0_status failed = PI0_OK;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < p->num_images; i++) {
        const pi0_frame *f = &p->frames[i];
        pi0_image frame = {.data = f->pixels, .type = PI0_PIXEL_U8, .layout = PI0_LAYOUT_HWC, .height = f->height,
                           .width = f->width, .channels = 3};
        images[i] = f->pixels ? *owned + (size_t)i * image : NULL;
        if (f->pixels && pi0_image_preprocess(&frame, image_size, *owned + (size_t)i * image, NULL))
            failed = PI0_ERR_OUT_OF_MEMORY; /* the sizes were checked: only memory can fail */
    }
    return failed ? pi0_fail(err, failed, "out of memory resizing %d camera frames", p->num_images) : PI0_OK;
}

/* SigLIP over the plan's valid images, then the projector: out is (num_images * P, llm width). */
static pi0_status vision_forward(const pi0_model *m, const pi0_plan *p, float *out, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    const pi0_weights *w = &m->weights;
    const pi0_stack_dims *v = &d->vision;
    int P = image_tokens(d), patch_dim = 3 * d->patch_size * d->patch_size;
    int Dv = v->width, n = p->num_images;
    size_t rows = (size_t)n * P;
    if (n == 0) return PI0_OK;
    float *patches = malloc(rows * patch_dim * sizeof(float)), *x = malloc(rows * Dv * sizeof(float));
    float *h = malloc(rows * Dv * sizeof(float)), *q = malloc(rows * Dv * sizeof(float));
    float *k = malloc(rows * Dv * sizeof(float)), *val = malloc(rows * Dv * sizeof(float));
    float *att = malloc(rows * Dv * sizeof(float)), *mlp = malloc(rows * v->mlp_dim * sizeof(float));
    attn_segment *segments = malloc((size_t)n * sizeof *segments);
    const float **images = malloc((size_t)n * sizeof *images);
    float *frame_pixels = NULL;
    pi0_status st = PI0_OK;
    if (!patches || !x || !h || !q || !k || !val || !att || !mlp || !segments || !images) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory in the vision encoder (%d images)", n);
        goto done;
    }
    if ((st = plan_images(p, d->image_size, images, &frame_pixels, err))) goto done;
#pragma omp parallel for schedule(static)
    for (int i = 0; i < n; i++) extract_patches(images[i], d->image_size, d->patch_size, patches + (size_t)i * P * patch_dim);
    cpu_linear(x, patches, (int)rows, patch_dim, w->patch_w, w->patch_b, Dv);
    for (size_t r = 0; r < rows; r++)
        for (int j = 0; j < Dv; j++) x[r * Dv + j] += w->pos_emb[(r % P) * Dv + j];
    for (int i = 0; i < n; i++) segments[i] = (attn_segment){.q_row = i * P, .num_q = P, .k_row = i * P, .num_k = P};

    for (int layer = 0; layer < v->depth; layer++) {
        const vit_layer *l = &w->vit[layer];
        cpu_layernorm(h, x, (int)rows, Dv, l->ln1_w, l->ln1_b, NORM_EPS);
        cpu_linear(q, h, (int)rows, Dv, l->q_w, l->q_b, Dv);
        cpu_linear(k, h, (int)rows, Dv, l->k_w, l->k_b, Dv);
        cpu_linear(val, h, (int)rows, Dv, l->v_w, l->v_b, Dv);
        if (cpu_attention(att, Dv, q, Dv, k, val, Dv, segments, n, v->num_heads, v->num_heads, v->head_dim,
                          1.0f / sqrtf((float)v->head_dim))) {
            st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory in vision attention");
            goto done;
        }
        cpu_linear_add(x, att, (int)rows, Dv, l->o_w, l->o_b, Dv);
        cpu_layernorm(h, x, (int)rows, Dv, l->ln2_w, l->ln2_b, NORM_EPS);
        cpu_linear(mlp, h, (int)rows, Dv, l->fc1_w, l->fc1_b, v->mlp_dim);
        cpu_gelu_inplace(mlp, rows * v->mlp_dim);
        cpu_linear_add(x, mlp, (int)rows, v->mlp_dim, l->fc2_w, l->fc2_b, Dv);
    }
    cpu_layernorm(h, x, (int)rows, Dv, w->post_ln_w, w->post_ln_b, NORM_EPS);
    cpu_linear(out, h, (int)rows, Dv, w->proj_w, w->proj_b, d->llm.width);
done:
    free(patches), free(x), free(h), free(q), free(k), free(val), free(att), free(mlp), free(segments);
    free(images), free(frame_pixels);
    return st;
}

/* ---- prefix ------------------------------------------------------------------------------------ */

/* Every prefix row of x (total_prefix, D): an image token, or a prompt embedding * sqrt(width). */
static void embed_prefix(const pi0_model *m, const pi0_plan *p, const float *vision_tokens, float *x) {
    int D = m->dims.llm.width;
    float scale = (float)sqrt((double)D);
    for (int r = 0; r < p->total_prefix; r++) {
        float *row = x + (size_t)r * D;
        int src = p->prefix_src[r];
        if (src >= 0) {
            memcpy(row, vision_tokens + (size_t)src * D, D * sizeof(float));
            continue;
        }
        const float *e = m->weights.embed + (size_t)(-src - 1) * D;
        for (int j = 0; j < D; j++) row[j] = e[j] * scale;
    }
}

/* The LLM over every valid prefix token, filling each layer's K/V cache; nothing else is kept. */
static pi0_status prefix_forward(const pi0_model *m, const pi0_plan *p, float *x, float **cache_k, float **cache_v,
                                 const rope_table *rope, pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.llm;
    gemma_scratch s = {0};
    pi0_status st = PI0_OK;
    if (gemma_scratch_alloc(&s, (size_t)p->total_prefix, d)) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory in the prefix pass (%d tokens)", p->total_prefix);
        goto done;
    }
    gemma_rows r = {p->total_prefix, p->prefix_pos, p->prefix_cache_row, p->prefix_segments, p->batch};
    for (int layer = 0; layer < d->depth; layer++)
        if (gemma_block(&m->weights.llm[layer], d, x, &r, cache_k[layer], cache_v[layer], rope, &s,
                        layer == d->depth - 1, NULL, NULL)) {
            st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory in prefix attention");
            break;
        }
done:
    gemma_scratch_free(&s);
    return st;
}

/* ---- denoise ----------------------------------------------------------------------------------- */

typedef struct {
    float *suffix;      /* (B S, We) the expert's residual stream; S = suffix_len */
    float *action_emb;  /* (B H, We) */
    float *mlp_in;      /* (B H, 2 We) Pi0: [action embedding, time embedding] */
    float *hidden;      /* (B H, We) */
    float *state_token; /* (B, We) Pi0 */
    float *velocity;    /* (B H, A) */
    float *time_emb;    /* (We) */
    float *cond;        /* Pi0.5: (2 steps, We): the time MLP's hidden layer, then its output c, per step */
    float *mods;        /* Pi0.5: (2 depth + 1, steps, 3 We): every adaptive norm's (scale|shift|gate) per step */
    gemma_scratch block;
} denoise_buffers;

static void denoise_free(denoise_buffers *b) {
    free(b->suffix), free(b->action_emb), free(b->mlp_in), free(b->hidden), free(b->state_token);
    free(b->velocity), free(b->time_emb), free(b->cond), free(b->mods);
    gemma_scratch_free(&b->block);
}

static int denoise_alloc(denoise_buffers *b, const pi0_dims *d, const pi0_plan *p) {
    size_t We = (size_t)d->expert.width, rows = (size_t)p->batch * p->suffix_len, actions = (size_t)p->batch * p->horizon;
    size_t norms = 2 * (size_t)d->expert.depth + 1;
    memset(b, 0, sizeof *b);
    b->suffix = malloc(rows * We * sizeof(float));
    b->action_emb = malloc(actions * We * sizeof(float));
    b->mlp_in = malloc(actions * 2 * We * sizeof(float));
    b->hidden = malloc(actions * We * sizeof(float));
    b->state_token = malloc((size_t)p->batch * We * sizeof(float));
    b->velocity = malloc(actions * d->action_dim * sizeof(float));
    b->time_emb = malloc((size_t)p->num_steps * We * sizeof(float));
    if (d->kind == PI0_MODEL_PI05) {
        b->cond = malloc(2 * (size_t)p->num_steps * We * sizeof(float));
        b->mods = malloc(norms * p->num_steps * 3 * We * sizeof(float));
    }
    return b->suffix && b->action_emb && b->mlp_in && b->hidden && b->state_token && b->velocity && b->time_emb &&
                   (d->kind != PI0_MODEL_PI05 || (b->cond && b->mods)) && !gemma_scratch_alloc(&b->block, rows, &d->expert)
               ? 0
               : -1;
}

/* Adaptive norm n's modulation at `step` (n = 2 layer for the attention's, 2 layer + 1 for the MLP's, 2 depth
 * for the final norm); NULL for Pi0. */
static norm_mod step_mod(const denoise_buffers *b, const pi0_dims *d, const pi0_plan *p, int norm, int step) {
    return b->mods ? b->mods + ((size_t)norm * p->num_steps + step) * 3 * d->expert.width : NULL;
}

/*
 * Pi0.5's conditioning for every step at once (docs/model.md#conditioning-per-step): it depends on the
 * flow time only, which every sample shares, so one row per step serves the whole batch.
 * c = swish(time_mlp_out(swish(time_mlp_in(time_emb(t))))), then each adaptive norm's dense(c).
 */
static void pi05_modulations(const pi0_model *m, const pi0_plan *p, const float *times, denoise_buffers *b) {
    const pi0_weights *w = &m->weights;
    int We = m->dims.expert.width, depth = m->dims.expert.depth, steps = p->num_steps;
    float *emb = b->time_emb, *hidden = b->cond, *cond = b->cond + (size_t)steps * We;
    for (int k = 0; k < steps; k++) time_embedding(times[k], We, emb + (size_t)k * We);
    cpu_linear(hidden, emb, steps, We, w->time_mlp_in_w, w->time_mlp_in_b, We);
    cpu_swish_inplace(hidden, (size_t)steps * We);
    cpu_linear(cond, hidden, steps, We, w->time_mlp_out_w, w->time_mlp_out_b, We);
    cpu_swish_inplace(cond, (size_t)steps * We);
    for (int l = 0; l < depth; l++) {
        const gemma_layer *g = &w->expert[l];
        cpu_linear(b->mods + (size_t)(2 * l) * steps * 3 * We, cond, steps, We, g->input_norm_dense_w,
                   g->input_norm_dense_b, 3 * We);
        cpu_linear(b->mods + (size_t)(2 * l + 1) * steps * 3 * We, cond, steps, We, g->post_norm_dense_w,
                   g->post_norm_dense_b, 3 * We);
    }
    cpu_linear(b->mods + (size_t)(2 * depth) * steps * 3 * We, cond, steps, We, w->expert_norm_dense_w,
               w->expert_norm_dense_b, 3 * We);
}

/* Pi0's suffix: [state token, action_time_mlp_out(swish(action_time_mlp_in([action_in_proj(x), time_emb(t)])))]
 * per sample, the state token only where the step runs it (`rows`, plan.h). */
static void pi0_suffix(const pi0_model *m, const pi0_plan *p, const suffix_rows *rows, const float *x_t, float t,
                       denoise_buffers *b) {
    const pi0_weights *w = &m->weights;
    int We = m->dims.expert.width, A = m->dims.action_dim, H = p->horizon, n = rows->per_sample, actions = p->batch * H;
    cpu_linear(b->action_emb, x_t, actions, A, w->action_in_w, w->action_in_b, We);
    time_embedding(t, We, b->time_emb);
    for (int i = 0; i < actions; i++) {
        memcpy(b->mlp_in + (size_t)i * 2 * We, b->action_emb + (size_t)i * We, We * sizeof(float));
        memcpy(b->mlp_in + (size_t)i * 2 * We + We, b->time_emb, We * sizeof(float));
    }
    cpu_linear(b->hidden, b->mlp_in, actions, 2 * We, w->action_time_in_w, w->action_time_in_b, We);
    cpu_swish_inplace(b->hidden, (size_t)actions * We);
    cpu_linear(b->action_emb, b->hidden, actions, We, w->action_time_out_w, w->action_time_out_b, We);
    for (int s = 0; s < p->batch; s++) {
        float *sample = b->suffix + (size_t)s * n * We;
        if (n > H) memcpy(sample, b->state_token + (size_t)s * We, We * sizeof(float));
        memcpy(sample + (size_t)(n - H) * We, b->action_emb + (size_t)s * H * We, (size_t)H * We * sizeof(float));
    }
}

/* v(x_t, t_step): the action expert's velocity for every sample, into b->velocity (B H, A). */
static int velocity(const pi0_model *m, const pi0_plan *p, const float *x_t, const float *times, int step,
                    float **cache_k, float **cache_v, const rope_table *rope, denoise_buffers *b) {
    const pi0_dims *d = &m->dims;
    const pi0_weights *w = &m->weights;
    int We = d->expert.width, A = d->action_dim, actions = p->batch * p->horizon;
    const suffix_rows *rows = plan_step_rows(p, step);

    if (d->kind == PI0_MODEL_PI05) cpu_linear(b->suffix, x_t, actions, A, w->action_in_w, w->action_in_b, We);
    else pi0_suffix(m, p, rows, x_t, times[step], b);
    gemma_rows r = {p->batch * rows->per_sample, rows->pos, rows->cache_row, rows->segments, p->batch};
    for (int layer = 0; layer < d->expert.depth; layer++)
        if (gemma_block(&w->expert[layer], &d->expert, b->suffix, &r, cache_k[layer], cache_v[layer], rope, &b->block,
                        0, step_mod(b, d, p, 2 * layer, step), step_mod(b, d, p, 2 * layer + 1, step)))
            return -1;

    /* v = action_out_proj(final_norm(the action rows)) */
    norm_mod final = step_mod(b, d, p, 2 * d->expert.depth, step);
    for (int i = 0; i < actions; i++)
        block_norm(b->hidden + (size_t)i * We, b->suffix + (size_t)rows->action_rows[i] * We, 1, We, w->expert_norm, final);
    cpu_linear(b->velocity, b->hidden, actions, We, w->action_out_w, w->action_out_b, A);
    return 0;
}

/* Euler integration of the flow from t = 1 (noise) to t = 0 (actions), all in float32 like openpi. */
static pi0_status denoise(const pi0_model *m, const pi0_plan *p, float **cache_k, float **cache_v,
                          const rope_table *rope, float *actions, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    size_t n = (size_t)p->batch * p->horizon * d->action_dim;
    denoise_buffers b;
    float dt = -1.0f / (float)p->num_steps, *times = malloc(sizeof(float) * p->num_steps);
    if (!times || denoise_alloc(&b, d, p)) {
        free(times);
        denoise_free(&b);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory in the denoise loop");
    }
    flow_times(p->num_steps, times);
    if (d->kind == PI0_MODEL_PI05) pi05_modulations(m, p, times, &b);
    else cpu_linear(b.state_token, p->state, p->batch, d->action_dim, m->weights.state_proj_w, m->weights.state_proj_b,
                    d->expert.width);
    memcpy(actions, p->noise, n * sizeof(float));
    pi0_status st = PI0_OK;
    for (int step = 0; step < p->num_steps; step++) {
        if (velocity(m, p, actions, times, step, cache_k, cache_v, rope, &b)) {
            st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory in expert attention");
            break;
        }
        for (size_t i = 0; i < n; i++) actions[i] += dt * b.velocity[i];
    }
    free(times);
    denoise_free(&b);
    return st;
}

/* ---- sample_actions ---------------------------------------------------------------------------- */

static void free_cache(float **cache, int depth) {
    for (int l = 0; cache && l < depth; l++) free(cache[l]);
    free(cache);
}

static float **alloc_cache(int depth, size_t floats_per_layer) {
    float **cache = calloc((size_t)depth, sizeof(float *));
    for (int l = 0; cache && l < depth; l++)
        if (!(cache[l] = malloc(floats_per_layer * sizeof(float) + 1))) {
            free_cache(cache, depth);
            return NULL;
        }
    return cache;
}

static void trace_copy(cpu_trace *trace, const pi0_model *m, const pi0_plan *p, const float *vision_tokens,
                       float **cache_k, float **cache_v) {
    const pi0_dims *d = &m->dims;
    int P = image_tokens(d);
    size_t cache_floats = (size_t)p->cache_rows * d->llm.num_kv_heads * d->llm.head_dim;
    if (trace->vision_tokens)
        memcpy(trace->vision_tokens, vision_tokens, (size_t)p->num_images * P * d->llm.width * sizeof(float));
    for (int l = 0; l < d->llm.depth; l++) {
        if (trace->cache_k) memcpy(trace->cache_k[l], cache_k[l], cache_floats * sizeof(float));
        if (trace->cache_v) memcpy(trace->cache_v[l], cache_v[l], cache_floats * sizeof(float));
    }
}

pi0_status cpu_sample_traced(const pi0_model *m, const pi0_plan *p, float *actions, pi0_timings *timings,
                             cpu_trace *trace, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    int P = image_tokens(d);
    size_t cache_floats = (size_t)p->cache_rows * d->llm.num_kv_heads * d->llm.head_dim;
    float *vision_tokens = malloc((size_t)p->num_images * P * d->llm.width * sizeof(float) + 1);
    float *x = malloc((size_t)p->total_prefix * d->llm.width * sizeof(float) + 1);
    float **cache_k = alloc_cache(d->llm.depth, cache_floats), **cache_v = alloc_cache(d->llm.depth, cache_floats);
    rope_table rope = {0};
    pi0_status st = PI0_OK;
    if (!vision_tokens || !x || !cache_k || !cache_v || rope_table_init(&rope, p->max_prefix + p->suffix_len, d->llm.head_dim)) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for a batch of %d (%d prefix tokens)", p->batch,
                      p->total_prefix);
        goto done;
    }
    double t0 = pi0_now_ms();
    if ((st = vision_forward(m, p, vision_tokens, err))) goto done;
    double t1 = pi0_now_ms();
    embed_prefix(m, p, vision_tokens, x);
    if ((st = prefix_forward(m, p, x, cache_k, cache_v, &rope, err))) goto done;
    double t2 = pi0_now_ms();
    if (trace) trace_copy(trace, m, p, vision_tokens, cache_k, cache_v);
    if ((st = denoise(m, p, cache_k, cache_v, &rope, actions, err))) goto done;
    double t3 = pi0_now_ms();
    if (timings) *timings = (pi0_timings){.vision_ms = t1 - t0, .prefix_ms = t2 - t1, .denoise_ms = t3 - t2, .total_ms = t3 - t0};
done:
    free(vision_tokens);
    free(x);
    free_cache(cache_k, d->llm.depth);
    free_cache(cache_v, d->llm.depth);
    rope_table_free(&rope);
    return st;
}

static pi0_status cpu_init(pi0_model *m, pi0_error *err) {
    (void)m, (void)err;
    return PI0_OK; /* works straight from the float32 host weights */
}

static pi0_status cpu_sample(pi0_model *m, const pi0_plan *p, float *actions, pi0_timings *timings, pi0_error *err) {
    return cpu_sample_traced(m, p, actions, timings, NULL, err);
}

static void cpu_release(pi0_model *m) {
    (void)m;
}

static uint64_t cpu_device_bytes(const pi0_model *m) {
    (void)m;
    return 0;
}

const pi0_backend_ops pi0_cpu_backend = {"cpu", cpu_init, cpu_sample, cpu_release, cpu_device_bytes, NULL, NULL, 0};
