/*
 * forward.c - sample_actions of Pi0 and Pi0.5 on an NVIDIA GPU, top to bottom: the forward pass of
 * src/cpu/forward.c, function for function, with bf16 GEMMs through cuBLASLt (or skinny.h's fused
 * Linears for the denoise loop's few rows) and our own kernels for everything else
 * (docs/model.md#precision for where it rounds). Everything is enqueued on the backend's stream; graph.c
 * runs it eagerly or records it into a CUDA graph, and owns the memory it works in (backend.h).
 *
 *   vision:  valid camera images (or frames, resized on the GPU) -> SigLIP ViT -> projector -> 256 tokens each
 *   prefix:  [image tokens, scaled prompt embeddings] -> Gemma LLM -> per-layer K/V cache
 *   denoise: num_steps x (suffix tokens -> action expert over the cache -> x += dt v, fused into
 *            action_out_proj's GEMM); Pi0's state token in the first step only
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/attention.h"
#include "cuda/backend.h"
#include "cuda/gate_up.h"
#include "cuda/skinny.h"
#include "model/flow.h"
#include "util/error.h"

#define BESIDE_MAX_ROWS 64 /* first_step_beside */
/* The shared-memory carveout (percent) the first step's skinny Linears ask for beside the prefix: the driver's
 * choice for them (the most L1) kept their blocks off the multiprocessors that the prefix's kernels hold at a larger
 * carveout; 58 (132 KB on Hopper) lets them share those (prefix stage 3.92 -> 3.87 ms on an H100; 25-66 did as well,
 * 72 and 100 less, and the hint on every step's Linears cost steps 1-9 more than it gave: bench/NOTES.md, sessions
 * 26 and 27). */
#define BESIDE_CARVEOUT 58
/* Beside the prefix, one sample's first step counts on 1 / BESIDE_ATTENTION_SHARE of the multiprocessors for its
 * few-queries attention (pi0_cuda_attention_ws's max_sms): the prefix's attention, during which it runs, holds about
 * the other half (67 blocks of 132 at the seed), and with the whole GPU in mind its partials took a second wave on the
 * SMs the prefix's next GEMM wanted. The seed's 88 rows then go in 3 row groups of 2 tiles (60 blocks) rather than 6
 * of 1 (120): prefix 3.71-3.73 -> 3.67-3.69 ms on an H100, three cameras and Pi0.5 -0.01 to -0.04. Not for two samples,
 * whose prefix attention holds every SM (134 blocks): no gain there (bench/NOTES.md, session 36). */
#define BESIDE_ATTENTION_SHARE 2
#define PREFIX_DOWN_PARTS 2 /* stack_parts */
#define PREFIX_PARTS_MAX_ROWS 1024
#define EXPERT_PARTS 4
#define EXPERT_PARTS_MAX_ROWS 192

static pi0_status gemm(cuda_state *s, gemm_args a, pi0_error *err) {
    return gemm_run(&s->gemm, &a, s->stream, err);
}

/* On s->stream; beside the prefix (the side stream, first_step_beside) with BESIDE_CARVEOUT. */
static pi0_status skinny(const cuda_state *s, skinny_args a, pi0_error *err) {
    if (s->side && s->stream == s->side) a.smem_carveout = BESIDE_CARVEOUT;
    cudaError_t e = pi0_cuda_skinny_linear(&a, s->stream);
    if (e)
        return pi0_fail(err, PI0_ERR_BACKEND, "skinny linear (%d x %d x %d): %s", a.m, a.n, a.k, cudaGetErrorString(e));
    return PI0_OK;
}

/* ---- the Gemma block ----------------------------------------------------------------------------- */

/* Rows that run through a Gemma stack, and where their K/V go. */
typedef struct {
    int rows, num_segments, max_q, max_k; /* max_k: a bound on a segment's keys (the attention's split; 0: unknown) */
    const int *positions, *cache_rows;
    const attn_segment *segments;
    float *x;
    pi0_bf16 *x_bf16; /* x rounded to bf16, kept by the skinny path; NULL: the stack has no skinny path */
    const gemma_buffers *b;
    float *attn_ws;   /* attention workspace (NULL: none, the prefix: see gemma_block) */
    size_t attn_ws_bytes;
    int attn_sms;     /* the multiprocessors the attention's partials may count on (pi0_cuda_attention_ws; 0: all) */
    cudaEvent_t kv_written; /* recorded once the layer's K/V are in the cache (NULL: none) */
    int after_wait;         /* the block's first kernel follows a wait on another stream: launched plainly */
    int o_parts, down_parts; /* > 1: o_proj / down as that many partial sums, added by the next norm (stack_parts) */
    int parts_pending;       /* x lacks the previous block's down partial sums: this block's first norm adds them ... */
    const float *pending_gate; /* ... times this gate (Pi0.5's; NULL: none) */
} gemma_rows;

/* What one of Pi0.5's adaptive norms makes of this step's time conditioning (docs/model.md#adaptive-rmsnorm):
 * scale, shift and gate (We each), and for the skinny Linears bf16(1 + scale) and shift . w^T of the Linear the
 * norm feeds. */
typedef struct {
    const float *scale, *shift, *gate, *linear_bias;
    const pi0_bf16 *linear_scale;
} norm_mod;

/* A block's two norms; NULL for a plain Gemma block (Pi0, and every LLM block). */
typedef struct {
    norm_mod attn, mlp;
} block_mods;

/* Whether a Gemma block over `rows` rows can take the skinny Linears (gemma_block_skinny below). */
static int skinny_fits(const cuda_state *s, const pi0_stack_dims *d, int rows) {
    return s->use_skinny && rows <= SKINNY_MAX_ROWS && pi0_cuda_skinny_block_supported(d->width, d->mlp_dim, d->head_dim);
}

/* Whether a Gemma block's gate|up takes the fused kernel (gate_up.h) rather than cuBLASLt and gelu x up: on an
 * sm_90a device, at the dims where it was measured faster. */
static int use_gate_up(const cuda_state *s, const pi0_stack_dims *d, int rows) {
    return s->use_gate_up && pi0_cuda_gate_up_gelu_pays(rows, d->width) &&
           pi0_cuda_gate_up_gelu_fits(rows, d->mlp_dim, d->width);
}

/* The expert's block over a few rows (a denoise step of up to SKINNY_MAX_ROWS: one sample up to horizon 31, or two
 * at horizon 10-15): 4 skinny Linears (skinny.h) with the
 * norms (Pi0: folded at load; Pi0.5: scale and shift applied inside), RoPE and the K/V cache writes, and
 * gelu x up inside them, the (gated) residual adds in their epilogues, which also keep x_bf16 current for
 * the next Linear. 5 launches (6 with the attention's merge) instead of gemma_block's 10. */
static pi0_status gemma_block_skinny(cuda_state *s, const gpu_gemma_layer *l, const pi0_stack_dims *d, const gemma_rows *r,
                                     pi0_bf16 *cache_k, pi0_bf16 *cache_v, const block_mods *mods, pi0_error *err) {
    int W = d->width, hd = d->head_dim, q_dim = d->num_heads * hd, kv_dim = d->num_kv_heads * hd;
    int qkv_dim = q_dim + 2 * kv_dim;
    const gemma_buffers *b = r->b;
    const norm_mod none = {0}, *attn = mods ? &mods->attn : &none, *mlp = mods ? &mods->mlp : &none;
    const int few = r->rows <= SKINNY_NARROW_MAX_ROWS; /* o_proj at 8 warps; down too for Pi0 (skinny.h) */
    const int narrow_o = few ? SKINNY_NARROW_WARPS : 0, narrow_down = few && !mods ? SKINNY_NARROW_WARPS : 0;
    TRY(skinny(s, (skinny_args){.m = r->rows, .n = qkv_dim, .k = W, .x = r->x_bf16, .w = l->qkv_w, .rms_norm = 1,
                                .eps = NORM_EPS, .in_scale = attn->linear_scale, .col_bias = attn->linear_bias,
                                .epilogue = SKINNY_ROPE_QKV, .out = b->qkv, .heads = d->num_heads,
                                .kv_heads = d->num_kv_heads, .head_dim = hd, .positions = r->positions,
                                .cache_rows = r->cache_rows, .rope_cos = s->w.rope_cos, .rope_sin = s->w.rope_sin,
                                .cache_k = cache_k, .cache_v = cache_v, .plain_launch = r->after_wait}, err));
    CUDA_TRY(pi0_cuda_attention_ws(b->att, q_dim, b->qkv, qkv_dim, cache_k, cache_v, kv_dim, r->segments, r->num_segments,
                                   r->max_q, r->max_k, d->num_heads, d->num_kv_heads, hd, 1.0f / sqrtf((float)hd),
                                   r->attn_ws, r->attn_ws_bytes, r->attn_sms, s->stream));
    TRY(skinny(s, (skinny_args){.m = r->rows, .n = W, .k = q_dim, .x = b->att, .w = l->o_w, .epilogue = SKINNY_RESIDUAL,
                                .residual = r->x, .residual_bf16 = r->x_bf16, .gate = attn->gate, .max_warps = narrow_o},
              err));
    TRY(skinny(s, (skinny_args){.m = r->rows, .n = 2 * d->mlp_dim, .k = W, .x = r->x_bf16, .w = l->gate_up_w,
                                .rms_norm = 1, .eps = NORM_EPS, .in_scale = mlp->linear_scale,
                                .col_bias = mlp->linear_bias, .epilogue = SKINNY_GELU_MUL, .out = b->mlp}, err));
    TRY(skinny(s, (skinny_args){.m = r->rows, .n = W, .k = d->mlp_dim, .x = b->mlp, .w = l->down_w,
                                .epilogue = SKINNY_RESIDUAL, .residual = r->x, .residual_bf16 = r->x_bf16,
                                .gate = mlp->gate, .max_warps = narrow_down}, err));
    return PI0_OK;
}

/* The norm before a Linear into b->h: plain RMSNorm with (1 + w) (w NULL: folded away), or adaptive. `plain`: launched
 * plainly (the block's first kernel after a wait on another stream, kernels.h). `parts` > 0: the Linear before left
 * that many partial sums in mlp2 (block_residual), added to x first, times parts_gate (Pi0.5's; NULL: none). */
static pi0_status block_norm(cuda_state *s, const gemma_rows *r, int W, const float *w, const norm_mod *mod, int plain,
                             int parts, const float *parts_gate, pi0_error *err) {
    if (parts)
        CUDA_TRY(pi0_cuda_add_parts_rmsnorm(r->b->h, r->x, (const float *)r->b->mlp2, parts, parts_gate, r->rows, W,
                                            mod ? mod->scale : w, mod ? mod->shift : NULL, NORM_EPS, plain, s->stream));
    else if (mod)
        CUDA_TRY(pi0_cuda_rmsnorm_mod(r->b->h, r->x, NULL, r->rows, W, mod->scale, mod->shift, NORM_EPS, plain, s->stream));
    else
        CUDA_TRY(pi0_cuda_rmsnorm(r->b->h, r->x, NULL, r->rows, W, w, NORM_EPS, plain, s->stream));
    return PI0_OK;
}

/* x += in w^T (the residual add fused into the GEMM), or Pi0.5's x += gate * (in w^T). With `parts` > 1 the product
 * instead as that many partial sums in mlp2 (residual_parts), which the next norm adds, gated (block_norm). */
static pi0_status block_residual(cuda_state *s, const gemma_rows *r, const pi0_bf16 *in, const pi0_bf16 *w, int W, int k,
                                 const norm_mod *mod, int parts, pi0_error *err) {
    if (parts > 1) /* mlp2 is free here: gelu x up has read it, or gate|up has not yet written it */
        return gemm(s, (gemm_args){.m = r->rows, .n = W, .k = k, .x = in, .w = w, .out = r->b->mlp2, .out_f32 = 1,
                                   .alpha = 1, .k_parts = parts}, err);
    if (!mod)
        return gemm(s, (gemm_args){.m = r->rows, .n = W, .k = k, .x = in, .w = w, .out = r->x, .out_f32 = 1, .alpha = 1,
                                   .beta = 1}, err);
    TRY(gemm(s, (gemm_args){.m = r->rows, .n = W, .k = k, .x = in, .w = w, .out = r->b->branch, .out_f32 = 1, .alpha = 1},
             err));
    CUDA_TRY(pi0_cuda_add_gated(r->x, r->b->branch, mod->gate, r->rows, W, s->stream));
    return PI0_OK;
}

/* x += attn(norm(x)) Wo; x += MLP(norm(x)), Pi0.5's adaptive norms and gated residuals with `mods`
 * (docs/model.md#gemma-block); K/V go to the layer's cache first. With kv_only the block stops there, and its
 * product covers only the K and V columns (the prefix's last layer: nothing reads its queries). */
static pi0_status gemma_block(cuda_state *s, const gpu_gemma_layer *l, const pi0_stack_dims *d, const gemma_rows *r,
                              pi0_bf16 *cache_k, pi0_bf16 *cache_v, int kv_only, const block_mods *mods, pi0_error *err) {
    int W = d->width, hd = d->head_dim, q_dim = d->num_heads * hd, kv_dim = d->num_kv_heads * hd;
    int qkv_dim = q_dim + 2 * kv_dim;
    /* a few rows: the skinny Linears, where the dims allow them; else cuBLASLt and the separate kernels below */
    if (r->x_bf16 && !kv_only && skinny_fits(s, d, r->rows))
        return gemma_block_skinny(s, l, d, r, cache_k, cache_v, mods, err);
    TRY(block_norm(s, r, W, l->input_norm, mods ? &mods->attn : NULL, r->after_wait, r->parts_pending, r->pending_gate,
                   err));
    const int q_heads = kv_only ? 0 : d->num_heads, q_cols = q_heads * hd; /* w's rows are q's, then k's and v's */
    TRY(gemm(s, (gemm_args){.m = r->rows, .n = qkv_dim - q_dim + q_cols, .k = W, .x = r->b->h,
                            .w = l->qkv_w + (size_t)(q_dim - q_cols) * W, .out = r->b->qkv, .alpha = 1}, err));
    CUDA_TRY(pi0_cuda_rope_qkv(r->b->qkv, r->rows, q_heads, d->num_kv_heads, hd, r->positions, r->cache_rows, cache_k,
                               cache_v, s->w.rope_cos, s->w.rope_sin, s->stream));
    if (r->kv_written) CUDA_TRY(cudaEventRecord(r->kv_written, s->stream));
    if (kv_only) return PI0_OK;
    /* A denoise step's attention (it has a workspace) launches as a dependent of RoPE and loads the prefix's keys
     * before its wait. The prefix's has no key to load early; as a dependent it gained nothing measurable (bench/NOTES.md,
     * session 20), so it launches plainly. */
    if (r->attn_ws)
        CUDA_TRY(pi0_cuda_attention_ws(r->b->att, q_dim, r->b->qkv, qkv_dim, cache_k, cache_v, kv_dim, r->segments,
                                       r->num_segments, r->max_q, r->max_k, d->num_heads, d->num_kv_heads, hd,
                                       1.0f / sqrtf((float)hd), r->attn_ws, r->attn_ws_bytes, r->attn_sms, s->stream));
    else
        CUDA_TRY(pi0_cuda_attention(r->b->att, q_dim, r->b->qkv, qkv_dim, cache_k, cache_v, kv_dim, r->segments,
                                    r->num_segments, r->max_q, d->num_heads, d->num_kv_heads, hd, 1.0f / sqrtf((float)hd),
                                    s->stream));
    TRY(block_residual(s, r, r->b->att, l->o_w, W, q_dim, mods ? &mods->attn : NULL, r->o_parts, err));
    TRY(block_norm(s, r, W, l->post_norm, mods ? &mods->mlp : NULL, 0, r->o_parts, mods ? mods->attn.gate : NULL, err));
    if (use_gate_up(s, d, r->rows)) {
        CUDA_TRY(pi0_cuda_gate_up_gelu(r->b->mlp, r->b->h, l->gate_up_w, r->rows, d->mlp_dim, W, s->stream));
    } else {
        TRY(gemm(s, (gemm_args){.m = r->rows, .n = 2 * d->mlp_dim, .k = W, .x = r->b->h, .w = l->gate_up_w,
                                .out = r->b->mlp2, .alpha = 1}, err));
        CUDA_TRY(pi0_cuda_gelu_mul(r->b->mlp, r->b->mlp2, r->rows, d->mlp_dim, s->stream));
    }
    return block_residual(s, r, r->b->mlp, l->down_w, W, d->mlp_dim, mods ? &mods->mlp : NULL, r->down_parts, err);
}

/* ---- vision -------------------------------------------------------------------------------------- */

/* SigLIP over the graph's valid images, then the projector: g->vision is (num_images * P, llm width). */
static pi0_status vision_forward(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    const pi0_stack_dims *v = &d->vision;
    const gpu_weights *w = &s->w;
    int n = g->shape.num_images, P = image_tokens(d), rows = n * P, Dv = v->width;
    int patch_dim = 3 * d->patch_size * d->patch_size;
    if (n == 0) return PI0_OK;
    if (g->shape.frames) CUDA_TRY(pi0_cuda_frames_to_images(g->images, g->in.frame_jobs, n, d->image_size, s->stream));
    CUDA_TRY(pi0_cuda_im2col(g->patches, g->images, n, d->image_size, d->patch_size,
                             g->shape.frames ? NULL : g->in.image_flags, s->stream)); /* frames are bytes: finite */
    TRY(gemm(s, (gemm_args){.m = rows, .n = Dv, .k = PI0_PATCH_PIECES * patch_dim, .x = g->patches, .w = w->patch_w,
                            .out = g->vit_x, .out_f32 = 1, .alpha = 1}, err)); /* near float32's accuracy: kernels.h */
    CUDA_TRY(pi0_cuda_add_bias_pos(g->vit_x, w->patch_b, w->pos_emb, rows, P, Dv, s->stream));
    for (int layer = 0; layer < v->depth; layer++) {
        const gpu_vit_layer *l = &w->vit[layer];
        CUDA_TRY(pi0_cuda_layernorm(g->vit_h, g->vit_x, rows, Dv, l->ln1_w, l->ln1_b, NORM_EPS, s->stream));
        TRY(gemm(s, (gemm_args){.m = rows, .n = 3 * Dv, .k = Dv, .x = g->vit_h, .w = l->qkv_w, .bias = l->qkv_b,
                                .out = g->vit_qkv, .alpha = 1}, err));
        CUDA_TRY(pi0_cuda_attention(g->vit_att, Dv, g->vit_qkv, 3 * Dv, g->vit_qkv + Dv, g->vit_qkv + 2 * Dv, 3 * Dv,
                                    g->in.vit_segments, n, P, v->num_heads, v->num_heads, v->head_dim,
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

/* ---- prefix -------------------------------------------------------------------------------------- */

static size_t cache_layer_elems(const pi0_model *m, const cuda_graph *g) {
    return ((size_t)g->shape.total_prefix + (size_t)g->shape.batch * g->suffix_len) * m->dims.llm.num_kv_heads *
           m->dims.llm.head_dim;
}

/*
 * A Linear into the residual stream whose k is long next to its columns (the down projections, 16384 and 4096 into 2048
 * and 1024; the expert's o_proj, 2048 into 1024) fills the GPU only with k split, and cuBLASLt then adds the partial
 * sums in a reduction kernel of its own before the residual add. Here such a Linear writes k_parts float32 partial sums
 * instead (gemm.h, block_residual), and the norm that reads x next adds them, with Pi0.5's gate, before it normalizes
 * (block_norm): one kernel fewer a Linear (bench/NOTES.md, session 21). Where it paid, measured: the prefix's down
 * projection at up to 1024 rows (the seed workload's, three cameras'; at B = 2 it lost), and on the expert's cuBLASLt
 * path (horizon 50, batches) o_proj and down. The sums live in mlp2, free between gelu x up and the next gate|up: it
 * holds rows x 2 mlp_dim bf16, room for mlp_dim / width float32 parts. The expert's last down projection stays whole:
 * the final norm reads the action rows of x through a row map. PI0_PARTS=0 turns it all off (A/B runs).
 */

/* Up to `parts` partial sums of a Linear of k inputs into the stack's width: as many as mlp2 has room for, if k splits
 * into that many and the norm takes them; else 0 (no split). */
static int residual_parts(const pi0_stack_dims *d, int k, int parts) {
    if (parts > d->mlp_dim / d->width) parts = d->mlp_dim / d->width;
    return parts >= 2 && k % parts == 0 && pi0_cuda_add_parts_rmsnorm_fits(d->width, parts) ? parts : 0;
}

/* A stack's o_proj and down projection split into partial sums (above) for `rows` rows through cuBLASLt. */
static void stack_parts(const cuda_state *s, const pi0_stack_dims *d, int expert, int rows, int *o_parts,
                        int *down_parts) {
    int expert_parts = s->use_parts && expert && rows <= EXPERT_PARTS_MAX_ROWS ? EXPERT_PARTS : 0;
    int prefix_parts = s->use_parts && !expert && rows <= PREFIX_PARTS_MAX_ROWS ? PREFIX_DOWN_PARTS : 0;
    *o_parts = residual_parts(d, d->num_heads * d->head_dim, expert_parts);
    *down_parts = residual_parts(d, d->mlp_dim, expert ? expert_parts : prefix_parts);
}

/* The LLM over every valid prefix token ([image tokens, prompt embeddings * sqrt(width)]), filling each
 * layer's K/V cache; nothing else is kept. With kv_ready, event `layer` is recorded once that layer's K/V are in
 * the cache (the first denoise step's expert layer waits for it: first_step_beside). */
static pi0_status prefix_forward(cuda_state *s, const pi0_model *m, cuda_graph *g, cudaEvent_t *kv_ready, pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.llm;
    size_t cache_layer = cache_layer_elems(m, g);
    CUDA_TRY(pi0_cuda_assemble_prefix(g->x, g->in.prefix_src, g->shape.total_prefix, d->width, g->vision, s->w.embed,
                                      (float)sqrt((double)d->width), s->stream));
    gemma_rows r = {.rows = g->shape.total_prefix, .num_segments = g->shape.batch, .max_q = g->shape.max_prefix,
                    .positions = g->in.prefix_pos, .cache_rows = g->in.prefix_cache_row, .segments = g->in.prefix_segments,
                    .x = g->x, .b = &g->prefix};
    stack_parts(s, d, 0, r.rows, &r.o_parts, &r.down_parts); /* every down projection has a next block: the last is K/V only */
    for (int layer = 0; layer < d->depth; layer++) {
        r.kv_written = kv_ready ? kv_ready[layer] : NULL;
        r.parts_pending = layer > 0 ? r.down_parts : 0;
        TRY(gemma_block(s, &s->w.llm[layer], d, &r, g->cache_k + layer * cache_layer, g->cache_v + layer * cache_layer,
                        layer == d->depth - 1, NULL, err));
    }
    return PI0_OK;
}

/* ---- denoise ------------------------------------------------------------------------------------- */

/* Adaptive norm n's part j (0 scale, 1 shift, 2 gate) at `step`: n = 2 layer (attention), 2 layer + 1 (MLP),
 * 2 depth (the final norm); see step_tables.mods. */
static float *table_mod(const step_tables *t, int We, int n, int j, int step) {
    return t->mods + ((size_t)(n * 3 + j) * t->num_steps + step) * We;
}

static const float *mod_part(const cuda_graph *g, int We, int n, int j, int step) {
    return table_mod(g->tables, We, n, j, step);
}

static norm_mod step_norm(const cuda_graph *g, int We, int n, int step, const float *linear_bias) {
    return (norm_mod){mod_part(g, We, n, 0, step), mod_part(g, We, n, 1, step), mod_part(g, We, n, 2, step), linear_bias,
                      g->tables->in_scale + ((size_t)n * g->shape.num_steps + step) * We};
}

/* Pi0.5's conditioning of one layer at `step`. */
static block_mods layer_mods(const pi0_model *m, const cuda_graph *g, int layer, int step) {
    const pi0_stack_dims *d = &m->dims.expert;
    int We = d->width, steps = g->shape.num_steps, qkv_dim = (d->num_heads + 2 * d->num_kv_heads) * d->head_dim;
    return (block_mods){step_norm(g, We, 2 * layer, step, g->tables->qkv_bias + ((size_t)layer * steps + step) * qkv_dim),
                        step_norm(g, We, 2 * layer + 1, step,
                                  g->tables->gate_up_bias + ((size_t)layer * steps + step) * 2 * d->mlp_dim)};
}

/* The suffix rows denoise step `step` runs (plan.h): every one in the first step, the action rows after it. */
static const suffix_rows *step_rows(const cuda_graph *g, int step) {
    return step == 0 ? &g->in.first_step : &g->in.later_steps;
}

/* Whether a denoise step's rows take the skinny path: a batch of one whose suffix gemma_block runs through the
 * skinny Linears (which keep suffix_bf16 current). Then the action rows come from one too, and so does the Euler
 * step. */
static int suffix_is_skinny(const cuda_state *s, const pi0_model *m, const cuda_graph *g, const suffix_rows *rows) {
    return g->shape.batch == 1 && skinny_fits(s, &m->dims.expert, rows->per_sample);
}

/*
 * The step boundary at batch 1 (skinny.h's pi0_cuda_skinny_euler): the Euler update of the step that ended and the
 * next step's input Linear in one kernel, where they were the skinny update and a kernel of their own; the last
 * step's update runs alone. The kernel's blocks all read x_t while its first block writes the update, so x_t
 * alternates between two buffers: after k steps it lies in x_t_alt for odd k short of the last, and in the inputs'
 * x_t otherwise (the noise before the first step, the actions after the last). Pi0.5's input Linear writes the
 * suffix rows the update reads, so its bf16 rows alternate too (suffix_bf16_of). PI0_FUSED_EULER=0: the separate
 * kernels (A/B runs).
 */

/* Where x_t lies after `steps` Euler steps (above). */
static float *x_t_after(const cuda_graph *g, int steps) {
    return g->fused_euler && steps % 2 && steps < g->shape.num_steps ? g->x_t_alt : g->in.x_t;
}

/* The suffix rows in bf16 that this step's layers read and write. */
static pi0_bf16 *suffix_bf16_of(const cuda_graph *g, int step) {
    return g->suffix_bf16_alt && g->fused_euler && step % 2 ? g->suffix_bf16_alt : g->suffix_bf16;
}

/* The kernel's arguments for the update that ends `step`, with the next step's input Linear unless it is the last. */
static skinny_euler_args euler_args(const cuda_state *s, const pi0_model *m, const cuda_graph *g, int step, int plain) {
    const pi0_stack_dims *d = &m->dims.expert;
    const gpu_weights *w = &s->w;
    const suffix_rows *rows = step_rows(g, step);
    int H = g->shape.horizon, We = d->width, A = m->dims.action_dim, next = step + 1;
    int pi05 = m->dims.kind == PI0_MODEL_PI05;
    norm_mod mod = pi05 ? step_norm(g, We, 2 * d->depth, step, g->tables->out_col_bias + (size_t)step * A) : (norm_mod){0};
    skinny_euler_args a = {.rows = H, .width = We, .action_dim = A,
                           .x = suffix_bf16_of(g, step) + (size_t)(rows->per_sample - H) * We,
                           .out_w = pi05 ? w->action_out_w : w->action_out_fold_w, .in_scale = mod.linear_scale,
                           .out_bias = pi05 ? mod.linear_bias : w->action_out_b, .gate = g->tables->out_gate,
                           .eps = NORM_EPS, .x_t = x_t_after(g, step), .x_t_next = x_t_after(g, next),
                           .plain_launch = plain};
    if (next < g->shape.num_steps && pi05) /* action_in_proj into the suffix */
        a.next_w = w->action_in_w, a.next_bias = w->action_in_b, a.next_n = We, a.next_f32 = g->suffix,
        a.next_bf16 = suffix_bf16_of(g, next);
    else if (next < g->shape.num_steps) /* the action half of action_time_mlp_in (suffix_tokens) */
        a.next_w = w->time_fold_w, a.next_bias = g->tables->time_bias + (size_t)next * We, a.next_n = We, a.swish = 1,
        a.next_bf16 = g->time_hidden;
    return a;
}

/* g->fused_euler: whether this graph's step boundaries take the kernel. They do for one sample whose layers keep the
 * bf16 suffix rows (the skinny path) where the kernel takes the first boundary's arguments (the most it is asked: the
 * next step's Linear too), built as they would be (the buffers follow the flag). */
static void set_fused_euler(const cuda_state *s, const pi0_model *m, cuda_graph *g) {
    g->fused_euler = s->use_fused_euler && g->shape.batch == 1 && skinny_fits(s, &m->dims.expert, g->suffix_len);
    if (g->fused_euler) {
        skinny_euler_args first = euler_args(s, m, g, 0, 0);
        g->fused_euler = pi0_cuda_skinny_euler_supported(&first);
    }
}

/* The update that ends `step`, with the next step's input Linear unless it is the last. */
static pi0_status euler_boundary(cuda_state *s, const pi0_model *m, cuda_graph *g, int step, int plain, pi0_error *err) {
    skinny_euler_args a = euler_args(s, m, g, step, plain);
    CUDA_TRY(pi0_cuda_skinny_euler(&a, s->stream));
    return PI0_OK;
}

/* The suffix rows of this step: Pi0's [state token, action_time_mlp(action_in_proj(x), time)] with
 * action_in_proj folded into the MLP's first layer (weights.c) and its time half precomputed
 * (step_constants), the state token where the step runs it; Pi0.5's action_in_proj(x), whose rows b H + i are the
 * suffix's own. After the first step with fused_euler, the MLP's first layer (Pi0) or action_in_proj (Pi0.5) is
 * the previous step's euler_boundary; `plain`: its kernel follows a wait on another stream. */
static pi0_status suffix_tokens(cuda_state *s, const pi0_model *m, cuda_graph *g, int step, const suffix_rows *rows,
                                int skinny_rows, int plain, pi0_error *err) {
    const gpu_weights *w = &s->w;
    int B = g->shape.batch, H = g->shape.horizon, BH = B * H, We = m->dims.expert.width, A = m->dims.action_dim;
    int state_rows = rows->per_sample - H, fused = g->fused_euler && step > 0;
    const float *state = state_rows ? g->state_token : NULL;
    pi0_bf16 *suffix_bf16 = suffix_bf16_of(g, step);
    if (fused) TRY(euler_boundary(s, m, g, step - 1, plain, err));
    if (m->dims.kind == PI0_MODEL_PI05) {
        if (!fused)
            CUDA_TRY(pi0_cuda_linear_small_k(g->suffix, suffix_bf16, g->in.x_t, w->action_in_w, w->action_in_b, BH, A, We,
                                             0, s->stream));
        return PI0_OK;
    }
    const float *time_bias = g->tables->time_bias + (size_t)step * We;
    if (skinny_rows) { /* one sample: the state row (if any) with the hidden rows, the action rows into the suffix */
        size_t actions = (size_t)state_rows * We; /* where they start */
        if (!fused)
            CUDA_TRY(pi0_cuda_action_time_in(g->time_hidden, g->suffix, suffix_bf16, state, g->in.x_t, w->time_fold_w,
                                             time_bias, H, A, We, s->stream));
        return skinny(s, (skinny_args){.m = H, .n = We, .k = We, .x = g->time_hidden, .w = w->time_out_w,
                                       .col_bias = w->time_out_b, .epilogue = SKINNY_STORE,
                                       .out = suffix_bf16 + actions, .out_f32 = g->suffix + actions}, err);
    }
    CUDA_TRY(pi0_cuda_linear_small_k(NULL, g->time_hidden, g->in.x_t, w->time_fold_w, time_bias, BH, A, We, 1, s->stream));
    TRY(gemm(s, (gemm_args){.m = BH, .n = We, .k = We, .x = g->time_hidden, .w = w->time_out_w, .bias = w->time_out_b,
                            .out = g->action_tokens, .out_f32 = 1, .alpha = 1}, err));
    CUDA_TRY(pi0_cuda_assemble_suffix(g->suffix, g->suffix_bf16, state, g->action_tokens, B, H, We, s->stream));
    return PI0_OK;
}

/* x_t += dt * action_out_proj(final_norm(suffix)[action rows]): the update fused into action_out_proj's GEMM
 * (alpha dt, beta 1), or for one sample into a skinny Linear whose row factor is the norm (Pi0's 1 + w folded
 * into its weights, Pi0.5's scale and shift applied as in its layers) and whose residual add, gated by dt, is the
 * update. */
static pi0_status euler_update(cuda_state *s, const pi0_model *m, cuda_graph *g, int step, const suffix_rows *rows,
                               int skinny_rows, pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.expert;
    const gpu_weights *w = &s->w;
    int BH = g->shape.batch * g->shape.horizon, We = d->width, A = m->dims.action_dim;
    int pi05 = m->dims.kind == PI0_MODEL_PI05;
    if (skinny_rows) { /* the action rows are the suffix's last H */
        norm_mod mod = pi05 ? step_norm(g, We, 2 * d->depth, step, g->tables->out_col_bias + (size_t)step * A) : (norm_mod){0};
        const pi0_bf16 *action_rows = suffix_bf16_of(g, step) + (size_t)(rows->per_sample - BH) * We;
        return skinny(s, (skinny_args){.m = BH, .n = A, .k = We, .x = action_rows,
                                       .w = pi05 ? w->action_out_w : w->action_out_fold_w, .rms_norm = 1, .eps = NORM_EPS,
                                       .in_scale = mod.linear_scale, .col_bias = pi05 ? mod.linear_bias : w->action_out_b,
                                       .epilogue = SKINNY_RESIDUAL, .residual = g->in.x_t, .residual_bf16 = g->final_h,
                                       .gate = g->tables->out_gate}, err);
    }
    if (pi05)
        CUDA_TRY(pi0_cuda_rmsnorm_mod(g->final_h, g->suffix, rows->action_rows, BH, We, mod_part(g, We, 2 * d->depth, 0, step),
                                      mod_part(g, We, 2 * d->depth, 1, step), NORM_EPS, 0, s->stream));
    else CUDA_TRY(pi0_cuda_rmsnorm(g->final_h, g->suffix, rows->action_rows, BH, We, w->expert_norm, NORM_EPS, 0, s->stream));
    return gemm(s, (gemm_args){.m = BH, .n = A, .k = We, .x = g->final_h, .w = w->action_out_w, .bias = g->tables->out_bias,
                               .out = g->in.x_t, .out_f32 = 1, .alpha = -1.0f / (float)g->shape.num_steps, .beta = 1},
                err);
}

/* Every expert layer of one step in one persistent kernel (denoise.h): what the loop over gemma_block does
 * for a batch of one, with the layer table of this step (weights and Pi0.5's conditioning). */
static pi0_status expert_persistent(cuda_state *s, const pi0_model *m, cuda_graph *g, int step,
                                    const suffix_rows *rows, pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.expert;
    const gemma_buffers *b = &g->suffix_buffers;
    pi0_denoise_args a = {.rows = rows->per_sample, .width = d->width, .heads = d->num_heads, .kv_heads = d->num_kv_heads,
                          .head_dim = d->head_dim, .mlp_dim = d->mlp_dim, .depth = d->depth,
                          .layers = g->tables->denoise_layers + (size_t)step * d->depth, .x = g->suffix,
                          .x_bf16 = suffix_bf16_of(g, step), .qkv = b->qkv, .att = b->att, .mlp = b->mlp,
                          .cache_k = g->cache_k, .cache_v = g->cache_v, .cache_layer = cache_layer_elems(m, g),
                          .positions = rows->pos, .cache_rows = rows->cache_row, .segment = rows->segments,
                          .rope_cos = s->w.rope_cos, .rope_sin = s->w.rope_sin, .eps = NORM_EPS,
                          .workspace = g->denoise_ws, .max_keys = g->shape.max_prefix + g->suffix_len};
    CUDA_TRY(pi0_cuda_denoise_step(&a, s->stream));
    return PI0_OK;
}

/* One Euler step: x_t += dt * action_out_proj(final_norm(expert(suffix(x_t, t_k)))[action rows]). With kv_ready
 * (first_step_beside) expert layer l waits for event l, the LLM layer's K/V. */
static pi0_status denoise_step(cuda_state *s, const pi0_model *m, cuda_graph *g, int step, cudaEvent_t *kv_ready,
                               pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.expert;
    const gpu_weights *w = &s->w;
    const suffix_rows *rows = step_rows(g, step);
    int B = g->shape.batch, S = rows->per_sample, pi05 = m->dims.kind == PI0_MODEL_PI05;
    int skinny_rows = suffix_is_skinny(s, m, g, rows);
    size_t cache_layer = cache_layer_elems(m, g);
    /* step 1's first kernel follows the join of step 0 beside the prefix (run_first_step_beside) */
    TRY(suffix_tokens(s, m, g, step, rows, skinny_rows, step == 1 && g->first_step_beside, err));
    if (g->persistent) {
        TRY(expert_persistent(s, m, g, step, rows, err));
    } else {
        gemma_rows r = {.rows = B * S, .num_segments = B, .max_q = S, .max_k = g->shape.max_prefix + g->suffix_len,
                        .positions = rows->pos, .cache_rows = rows->cache_row, .segments = rows->segments, .x = g->suffix,
                        .x_bf16 = suffix_bf16_of(g, step), .b = &g->suffix_buffers, .attn_ws = g->suffix_attn_ws,
                        .attn_ws_bytes = g->suffix_attn_ws_bytes, .after_wait = kv_ready != NULL,
                        .attn_sms = kv_ready && B == 1 ? s->multiprocessors / BESIDE_ATTENTION_SHARE : 0};
        int down_parts = 0;
        if (!skinny_fits(s, d, r.rows)) stack_parts(s, d, 1, r.rows, &r.o_parts, &down_parts);
        for (int layer = 0; layer < d->depth; layer++) {
            block_mods mods = pi05 ? layer_mods(m, g, layer, step) : (block_mods){0};
            r.parts_pending = layer > 0 ? r.down_parts : 0; /* the previous block's */
            r.down_parts = layer < d->depth - 1 ? down_parts : 0; /* the final norm reads x through a row map */
            if (kv_ready) CUDA_TRY(cudaStreamWaitEvent(s->stream, kv_ready[layer], 0));
            TRY(gemma_block(s, &w->expert[layer], d, &r, g->cache_k + layer * cache_layer,
                            g->cache_v + layer * cache_layer, 0, pi05 ? &mods : NULL, err));
            r.pending_gate = pi05 ? mods.mlp.gate : NULL; /* what the next block adds its partial sums with */
        }
    }
    if (!g->fused_euler) return euler_update(s, m, g, step, rows, skinny_rows, err);
    return step == g->shape.num_steps - 1 ? euler_boundary(s, m, g, step, 0, err) : PI0_OK; /* else the next step's */
}

/* Pi0's state token, the suffix's first row in the first step (plan.h: the later ones read its K/V). */
static pi0_status state_token(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    if (d->kind == PI0_MODEL_PI0)
        CUDA_TRY(pi0_cuda_linear_small_k(g->state_token, NULL, g->in.state, s->w.state_proj_w, s->w.state_proj_b,
                                         g->shape.batch, d->action_dim, d->expert.width, 0, s->stream));
    return PI0_OK;
}

/*
 * The first denoise step beside the prefix, on the side stream. Expert layer l of a step reads the prefix's K/V of
 * LLM layer l only, so step 0 can follow the prefix layer by layer instead of waiting for all of it: its chain of
 * small kernels, which leaves most of the GPU idle (bench/NOTES.md), takes the multiprocessors the prefix leaves
 * idle (its attention on half of them, the norms, RoPE, gelu x up, each GEMM's last wave) rather than running
 * after it. Each layer's first kernel follows its wait with a plain launch: stream capture makes the edge from the
 * prefix's RoPE kernel programmatic otherwise, and the attention, two kernels on, reads those keys before its own
 * wait (attention.h). Joined back before step 1, whose first kernel is a plain one too. Its cuBLASLt GEMMs (past
 * the skinny path's rows) have a workspace of their own (gemm_side). In a graph only: the eager first call of a
 * shape, which times each GEMM shape's candidates, runs them alone. Up to BESIDE_MAX_ROWS suffix rows: a larger
 * step is GEMMs that want the SMs the prefix's GEMMs hold (bench/NOTES.md, session 19).
 */
static int first_step_beside(const cuda_state *s, const cuda_graph *g) {
    enum cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
    if (!s->side || g->persistent || g->shape.batch * g->suffix_len > BESIDE_MAX_ROWS) return 0;
    return cudaStreamIsCapturing(s->stream, &capturing) == cudaSuccess && capturing == cudaStreamCaptureStatusActive;
}

/* Enqueues step 0 on the side stream (every function above enqueues on s->stream, so it is swapped for the side's
 * while they run) and joins the side stream back into the main one. */
static pi0_status run_first_step_beside(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    cudaStream_t main = s->stream;
    s->stream = s->side;
    pi0_status st = state_token(s, m, g, err);
    if (!st) st = denoise_step(s, m, g, 0, s->kv_ready, err);
    cudaError_t e = st ? cudaSuccess : cudaEventRecord(s->joined, s->stream);
    s->stream = main;
    if (!st && !e) e = cudaStreamWaitEvent(s->stream, s->joined, 0);
    if (!st && e) st = pi0_fail(err, PI0_ERR_BACKEND, "joining the first denoise step: %s", cudaGetErrorString(e));
    return st;
}

/* ---- per-step-count constants ------------------------------------------------------------------------- */

/* Pi0: the time half of action_time_mlp_in for each step, with every bias of the folded layer:
 * c_k = W_t time_emb(t_k) + b_time_in + W_a b_action_in (double, then float). */
static int pi0_time_biases(const pi0_model *m, int steps, float *out) {
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

/*
 * Pi0.5's conditioning of every step (docs/model.md#conditioning-per-step): it depends on the flow time
 * only, so one row per step serves every sample, and the whole table is a constant of the step count.
 * c = swish(time_mlp_out(swish(time_mlp_in(time_emb(t))))); each adaptive norm's scale, shift and gate
 * = dense(c); and for the skinny Linears, bf16(1 + scale) and shift . w^T of the QKV and gate|up weights.
 */
static pi0_status pi05_step_constants(cuda_state *s, const pi0_model *m, step_tables *t, const float *time_emb_host,
                                      pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.expert;
    const gpu_weights *w = &s->w;
    int We = d->width, steps = t->num_steps, depth = d->depth;
    int qkv_dim = (d->num_heads + 2 * d->num_kv_heads) * d->head_dim, gate_up = 2 * d->mlp_dim;
    float *emb = t->time_emb, *hidden = emb + (size_t)steps * We, *cond = hidden + (size_t)steps * We;
    CUDA_TRY(cudaMemcpyAsync(emb, time_emb_host, (size_t)steps * We * sizeof(float), cudaMemcpyHostToDevice, s->stream));
    CUDA_TRY(pi0_cuda_linear_small_k(hidden, NULL, emb, w->time_mlp_in_w, w->time_mlp_in_b, steps, We, We, 1, s->stream));
    CUDA_TRY(pi0_cuda_linear_small_k(cond, NULL, hidden, w->time_mlp_out_w, w->time_mlp_out_b, steps, We, We, 1, s->stream));
    for (int n = 0; n <= 2 * depth; n++) {
        const gpu_gemma_layer *l = n < 2 * depth ? &w->expert[n / 2] : NULL;
        const pi0_bf16 *dense_w = !l ? w->expert_norm_dense_w : n % 2 ? l->post_dense_w : l->input_dense_w;
        const float *dense_b = !l ? w->expert_norm_dense_b : n % 2 ? l->post_dense_b : l->input_dense_b;
        for (int j = 0; j < 3; j++) /* scale, shift, gate: rows j We .. (j + 1) We of the dense layer */
            CUDA_TRY(pi0_cuda_linear_small_k(table_mod(t, We, n, j, 0), NULL, cond, dense_w + (size_t)j * We * We,
                                             dense_b + (size_t)j * We, steps, We, We, 0, s->stream));
    }
    for (int n = 0; n <= 2 * depth; n++) /* the final norm's too: the skinny Euler step's Linear */
        CUDA_TRY(pi0_cuda_one_plus_bf16(t->in_scale + (size_t)n * steps * We, table_mod(t, We, n, 0, 0), (size_t)steps * We,
                                        s->stream));
    for (int l = 0; l < depth; l++) {
        CUDA_TRY(pi0_cuda_linear_small_k(t->qkv_bias + (size_t)l * steps * qkv_dim, NULL, table_mod(t, We, 2 * l, 1, 0),
                                         w->expert[l].qkv_w, NULL, steps, We, qkv_dim, 0, s->stream));
        CUDA_TRY(pi0_cuda_linear_small_k(t->gate_up_bias + (size_t)l * steps * gate_up, NULL, table_mod(t, We, 2 * l + 1, 1, 0),
                                         w->expert[l].gate_up_w, NULL, steps, We, gate_up, 0, s->stream));
    }
    CUDA_TRY(pi0_cuda_linear_small_k(t->out_col_bias, NULL, table_mod(t, We, 2 * depth, 1, 0), w->action_out_w,
                                     w->action_out_b, steps, We, m->dims.action_dim, 0, s->stream));
    CUDA_TRY(cudaStreamSynchronize(s->stream)); /* time_emb_host is freed once this returns */
    return PI0_OK;
}

/* The persistent denoise kernel's layer table of every step (denoise.h): the weights, and Pi0.5's conditioning
 * of that step, at the addresses layer_mods gives the skinny path. */
static pi0_status denoise_layer_table(cuda_state *s, const pi0_model *m, step_tables *t, pi0_error *err) {
    const pi0_stack_dims *d = &m->dims.expert;
    size_t count = (size_t)t->num_steps * d->depth;
    pi0_denoise_layer *host = calloc(count, sizeof *host);
    if (!host) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    cuda_graph g = {.shape = {.num_steps = t->num_steps}, .tables = t}; /* what layer_mods reads */
    for (int step = 0; step < t->num_steps; step++)
        for (int layer = 0; layer < d->depth; layer++) {
            const gpu_gemma_layer *l = &s->w.expert[layer];
            pi0_denoise_layer *e = &host[(size_t)step * d->depth + layer];
            *e = (pi0_denoise_layer){.qkv_w = l->qkv_w, .o_w = l->o_w, .gate_up_w = l->gate_up_w, .down_w = l->down_w};
            if (m->dims.kind != PI0_MODEL_PI05) continue;
            block_mods mods = layer_mods(m, &g, layer, step);
            e->attn_scale = mods.attn.linear_scale, e->mlp_scale = mods.mlp.linear_scale;
            e->qkv_bias = mods.attn.linear_bias, e->gate_up_bias = mods.mlp.linear_bias;
            e->attn_gate = mods.attn.gate, e->mlp_gate = mods.mlp.gate;
        }
    cudaError_t e = cudaMemcpyAsync(t->denoise_layers, host, count * sizeof *host, cudaMemcpyHostToDevice, s->stream);
    if (!e) e = cudaStreamSynchronize(s->stream); /* the host table is freed below */
    free(host);
    if (e) return pi0_fail(err, PI0_ERR_BACKEND, "uploading the denoise layer table: %s", cudaGetErrorString(e));
    return PI0_OK;
}

pi0_status cuda_step_constants(cuda_state *s, const pi0_model *m, step_tables *t, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    int We = d->expert.width, A = d->action_dim, steps = t->num_steps;
    size_t per_step = (size_t)steps * We * sizeof(float);
    float *per_step_host = malloc(per_step + 2 * A * sizeof(float) + 1), *times = NULL;
    if (!per_step_host) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    float *out_bias = per_step_host + (size_t)steps * We, *out_gate = out_bias + A, dt = -1.0f / (float)steps;
    for (int i = 0; i < A; i++) out_bias[i] = dt * m->weights.action_out_b[i], out_gate[i] = dt;
    pi0_status st = PI0_OK;
    if (d->kind == PI0_MODEL_PI05) { /* per_step_host: the time embedding of each step */
        if (!(times = malloc(sizeof(float) * steps))) st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
        else flow_times(steps, times);
        for (int k = 0; !st && k < steps; k++) time_embedding(times[k], We, per_step_host + (size_t)k * We);
    } else if (pi0_time_biases(m, steps, per_step_host)) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    }
    /* on the backend's stream, which does not wait for the default one's copies */
    cudaError_t e = cudaSuccess;
    if (!st) e = cudaMemcpyAsync(t->out_bias, out_bias, A * sizeof(float), cudaMemcpyHostToDevice, s->stream);
    if (!st && !e) e = cudaMemcpyAsync(t->out_gate, out_gate, A * sizeof(float), cudaMemcpyHostToDevice, s->stream);
    if (!st && !e && d->kind == PI0_MODEL_PI0)
        e = cudaMemcpyAsync(t->time_bias, per_step_host, per_step, cudaMemcpyHostToDevice, s->stream);
    if (!st && !e && d->kind == PI0_MODEL_PI0) e = cudaStreamSynchronize(s->stream); /* the host tables are freed below */
    if (!st && e) st = pi0_fail(err, PI0_ERR_BACKEND, "uploading the step tables: %s", cudaGetErrorString(e));
    if (!st && d->kind == PI0_MODEL_PI05) st = pi05_step_constants(s, m, t, per_step_host, err);
    if (!st && s->use_persistent) st = denoise_layer_table(s, m, t, err); /* read by nothing else */
    free(times);
    free(per_step_host);
    return st;
}

/* ---- sample_actions ------------------------------------------------------------------------------ */

/* A stage boundary: "external" so that under capture it becomes an event-record node of the graph
 * (a plain record would only order streams), and each replay re-records it. */
static cudaError_t record(cudaEvent_t event, cudaStream_t stream) {
    enum cudaStreamCaptureStatus capturing;
    cudaError_t e = cudaStreamIsCapturing(stream, &capturing);
    if (e) return e;
    if (capturing != cudaStreamCaptureStatusActive) return cudaEventRecord(event, stream); /* the flag is capture-only */
    return cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal);
}

pi0_status cuda_forward(cuda_state *s, const pi0_model *m, cuda_graph *g, pi0_error *err) {
    int beside = g->first_step_beside = first_step_beside(s, g);
    set_fused_euler(s, m, g);
    CUDA_TRY(record(g->events[0], s->stream)); /* the inputs are on their way already (graph.c's cuda_sample) */
    TRY(vision_forward(s, m, g, err));
    CUDA_TRY(record(g->events[1], s->stream));
    if (beside) { /* the side stream starts after vision (first_step_beside) */
        CUDA_TRY(cudaEventRecord(s->forked, s->stream));
        CUDA_TRY(cudaStreamWaitEvent(s->side, s->forked, 0));
    }
    TRY(prefix_forward(s, m, g, beside ? s->kv_ready : NULL, err));
    CUDA_TRY(record(g->events[2], s->stream));
    if (beside) TRY(run_first_step_beside(s, m, g, err));
    else TRY(state_token(s, m, g, err));
    for (int step = beside; step < g->shape.num_steps; step++) TRY(denoise_step(s, m, g, step, NULL, err));
    CUDA_TRY(record(g->events[3], s->stream));
    CUDA_TRY(cudaMemcpyAsync(g->outputs_host, g->in.image_flags, g->outputs_size, cudaMemcpyDeviceToHost, s->stream));
    return PI0_OK;
}
