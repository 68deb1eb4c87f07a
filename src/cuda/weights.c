/*
 * weights.c - the CUDA backend's copy of the model: bf16 GEMM operands, float32 norms and biases
 * where the output is float32.
 *
 * The host keeps only what this backend reads there (cuda_keeps_on_host: vectors, the patch embedding
 * and the small action heads); every GEMM weight is streamed once, at load, from the checkpoint's
 * mapping as it is stored (bf16, f16 or f32) through a GPU staging buffer, and converted there
 * (pi0_cuda_weight_rows). So a GPU model costs the host no float32 copy of its 3 billion weights, and a
 * bf16 checkpoint's values arrive bit for bit.
 *
 * Load-time rewrites (docs/model.md#load-time-rewrites, exact up to rounding):
 *  - Q|K|V and gate|up are fused into one weight each, so a block runs 4 GEMMs instead of 7. The
 *    gate|up rows are interleaved (gate_0, up_0, gate_1, ...), so every kernel that applies
 *    gelu(gate) * up finds each pair side by side.
 *  - In Pi0's action expert, each RMSNorm's 1 + w is folded into the Linear after it (in float32,
 *    before rounding to bf16): its norms become plain normalizations, which the skinny Linears of
 *    the denoise loop apply as a per-row factor (skinny.h). The VLM keeps its norm weights; Pi0.5's
 *    expert keeps its Linears as they are, its adaptive norms' dense layers beside them.
 *  - The float32 patch embedding's weights become bf16 pieces, each weight the exact sum of three (kernels.h's
 *    PI0_PATCH_PIECES): its product runs on tensor cores, near float32's accuracy.
 *  - action_in_proj is folded into the first half of action_time_mlp_in: W_fold = W_a W_in,
 *    so each denoise step maps the 32 action dims straight to the time MLP's hidden layer; the
 *    time half of that layer depends only on the step and is precomputed per graph (forward.c).
 */
#include <stdlib.h>
#include <string.h>

#include "cuda/backend.h"
#include "model/checkpoint.h"
#include "model/rope.h"
#include "util/half.h"
#include "util/error.h"

#define STAGE_VALUES ((size_t)16 << 20) /* values per host-to-GPU copy while streaming: 64 MB of float32 */

void *cuda_alloc(cuda_state *s, size_t bytes, pi0_error *err) {
    void *p = NULL;
    if (s->num_allocations == s->max_allocations) {
        pi0_fail(err, PI0_ERR_BACKEND, "internal: more GPU weight buffers than planned (%d)", s->max_allocations);
        return NULL;
    }
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate %.1f MB on the GPU (%.2f GB in use)", (double)bytes / 1e6,
                 (double)s->device_bytes / 1e9);
        return NULL;
    }
    s->device_bytes += bytes;
    if (s->device_bytes > s->peak_device_bytes) s->peak_device_bytes = s->device_bytes;
    s->allocations[s->num_allocations++] = p;
    return p;
}

/* Uploads the concatenation of host tensors `parts` as bf16 or float32 (the small ones the host keeps). */
typedef struct {
    const float *data;
    size_t count;
} part;

static void *upload(cuda_state *s, const part *parts, int num_parts, int bf16, pi0_error *err) {
    size_t total = 0, at = 0, elem = bf16 ? 2 : 4;
    for (int i = 0; i < num_parts; i++) total += parts[i].count;
    void *host = malloc(total * elem + 1), *dev = host ? cuda_alloc(s, total * elem, err) : NULL;
    if (!host) pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory preparing GPU weights");
    if (dev) {
        for (int i = 0; i < num_parts; i++, at += parts[i - 1].count) {
            if (bf16)
                for (size_t j = 0; j < parts[i].count; j++) ((uint16_t *)host)[at + j] = f32_to_bf16(parts[i].data[j]);
            else memcpy((float *)host + at, parts[i].data, parts[i].count * sizeof(float));
        }
        if (cudaMemcpy(dev, host, total * elem, cudaMemcpyHostToDevice) != cudaSuccess) {
            pi0_fail(err, PI0_ERR_BACKEND, "copying weights to the GPU failed");
            dev = NULL;
        }
    }
    free(host);
    return dev;
}

/* One tensor the host does not keep, streamed into a bf16 destination: its rows go to dst + at, `pitch`
 * rows apart (2: interleaved with another tensor's), each column scaled by 1 + fold[col] when fold (a
 * host vector) is given. */
typedef struct {
    float *const *slot; /* the tensor: the spec whose slot this is */
    size_t at;
    int pitch;
    const float *fold;
} streamed;

/* What streaming needs: a staging buffer on the GPU, host scratch for random weights, the fold vector's
 * GPU copy, and the bytes done for the progress callback. */
typedef struct {
    void *stage;
    float *scratch;
    float *fold;
    size_t fold_cap;
    uint64_t done, total;
} loader;

static int source_type(st_dtype t) {
    return t == ST_BF16 ? 1 : t == ST_F16 ? 2 : 0;
}

static pi0_status stream_one(cuda_state *s, const pi0_model *m, loader *ld, pi0_bf16 *dst, const streamed *p,
                             pi0_error *err) {
    const weight_spec *spec = model_spec_of(m, p->slot);
    if (!spec) return pi0_fail(err, PI0_ERR_BACKEND, "internal: streaming a tensor that has no spec");
    size_t rows = (size_t)spec->shape[0], cols = (size_t)(spec->numel / (uint64_t)spec->shape[0]);
    const float *fold = NULL;
    if (p->fold) {
        if (cols > ld->fold_cap) return pi0_fail(err, PI0_ERR_BACKEND, "internal: fold vector of %zu", cols);
        CUDA_TRY(cudaMemcpyAsync(ld->fold, p->fold, cols * sizeof(float), cudaMemcpyHostToDevice, s->stream));
        fold = ld->fold;
    }
    size_t chunk_rows = STAGE_VALUES / cols ? STAGE_VALUES / cols : 1;
    for (size_t r = 0; r < rows; r += chunk_rows) {
        size_t n = rows - r < chunk_rows ? rows - r : chunk_rows;
        st_dtype dtype;
        const void *src = model_tensor_range(m, spec, r * cols, n * cols, ld->scratch, &dtype);
        size_t bytes = n * cols * st_dtype_size(dtype);
        /* on the kernel's stream: a pageable copy may still be landing when cudaMemcpy returns, and the
         * backend's stream does not wait for the default one */
        CUDA_TRY(cudaMemcpyAsync(ld->stage, src, bytes, cudaMemcpyHostToDevice, s->stream));
        CUDA_TRY(pi0_cuda_weight_rows(dst + p->at + r * (size_t)p->pitch * cols, (size_t)p->pitch, ld->stage,
                                      source_type(dtype), n, cols, fold, s->stream));
        CUDA_TRY(cudaStreamSynchronize(s->stream)); /* the stage and the fold vector are reused */
        ld->done += bytes;
        if (m->progress) m->progress(m->progress_user, "weights to the GPU", ld->done, ld->total);
    }
    return PI0_OK;
}

/* A bf16 GPU tensor of `total` values assembled from streamed tensors. */
static pi0_bf16 *stream(cuda_state *s, const pi0_model *m, loader *ld, size_t total, const streamed *parts, int n,
                        pi0_error *err) {
    pi0_bf16 *dev = cuda_alloc(s, total * sizeof(pi0_bf16), err);
    for (int i = 0; dev && i < n; i++)
        if (stream_one(s, m, ld, dev, &parts[i], err)) return NULL;
    return dev;
}

#define UP_BF16(...) upload(s, (part[]){__VA_ARGS__}, sizeof((part[]){__VA_ARGS__}) / sizeof(part), 1, err)
#define UP_F32(...) upload(s, (part[]){__VA_ARGS__}, sizeof((part[]){__VA_ARGS__}) / sizeof(part), 0, err)
#define STREAM(total, ...) \
    stream(s, m, ld, total, (streamed[]){__VA_ARGS__}, sizeof((streamed[]){__VA_ARGS__}) / sizeof(streamed), err)

/* Where a Gemma stack's norms go: kept as float32 vectors (the LLM), folded into the Linears after them
 * (Pi0's expert), or adaptive, their dense layers uploaded (Pi0.5's expert). */
typedef enum { NORMS_KEPT, NORMS_FOLDED, NORMS_ADAPTIVE } norm_layout;

static int upload_gemma(cuda_state *s, const pi0_model *m, loader *ld, gpu_gemma_layer *g, const gemma_layer *l,
                        const pi0_stack_dims *d, norm_layout norms, pi0_error *err) {
    size_t W = (size_t)d->width, q_rows = (size_t)d->num_heads * d->head_dim, kv_rows = (size_t)d->num_kv_heads * d->head_dim;
    size_t mlp = (size_t)d->mlp_dim;
    int fold = norms == NORMS_FOLDED;
    const float *in_norm = fold ? l->input_norm : NULL, *post_norm = fold ? l->post_attn_norm : NULL;
    int ok = 1;
    if (norms == NORMS_KEPT) {
        g->input_norm = UP_F32({l->input_norm, W});
        g->post_norm = UP_F32({l->post_attn_norm, W});
        ok = g->input_norm && g->post_norm;
    }
    if (ok && norms == NORMS_ADAPTIVE) {
        g->input_dense_w = STREAM(3 * W * W, {&l->input_norm_dense_w, 0, 1, NULL});
        g->post_dense_w = STREAM(3 * W * W, {&l->post_norm_dense_w, 0, 1, NULL});
        g->input_dense_b = UP_F32({l->input_norm_dense_b, 3 * W}), g->post_dense_b = UP_F32({l->post_norm_dense_b, 3 * W});
        ok = g->input_dense_w && g->input_dense_b && g->post_dense_w && g->post_dense_b;
    }
    if (ok) g->qkv_w = STREAM((q_rows + 2 * kv_rows) * W, {&l->q_w, 0, 1, in_norm}, {&l->k_w, q_rows * W, 1, in_norm},
                              {&l->v_w, (q_rows + kv_rows) * W, 1, in_norm});
    if (ok) g->o_w = STREAM(q_rows * W, {&l->o_w, 0, 1, NULL});
    if (ok) g->gate_up_w = STREAM(2 * mlp * W, {&l->gate_w, 0, 2, post_norm}, {&l->up_w, W, 2, post_norm});
    if (ok) g->down_w = STREAM(mlp * W, {&l->down_w, 0, 1, NULL});
    return ok && g->qkv_w && g->o_w && g->gate_up_w && g->down_w ? 0 : -1;
}

static int upload_vit(cuda_state *s, const pi0_model *m, loader *ld, gpu_vit_layer *g, const vit_layer *l,
                      const pi0_stack_dims *d, pi0_error *err) {
    size_t W = (size_t)d->width, mlp = (size_t)d->mlp_dim;
    g->ln1_w = UP_F32({l->ln1_w, W}), g->ln1_b = UP_F32({l->ln1_b, W});
    g->ln2_w = UP_F32({l->ln2_w, W}), g->ln2_b = UP_F32({l->ln2_b, W});
    g->qkv_w = STREAM(3 * W * W, {&l->q_w, 0, 1, NULL}, {&l->k_w, W * W, 1, NULL}, {&l->v_w, 2 * W * W, 1, NULL});
    g->qkv_b = UP_BF16({l->q_b, W}, {l->k_b, W}, {l->v_b, W});
    g->o_w = g->qkv_w ? STREAM(W * W, {&l->o_w, 0, 1, NULL}) : NULL;
    g->o_b = UP_F32({l->o_b, W});
    g->fc1_w = g->o_w ? STREAM(mlp * W, {&l->fc1_w, 0, 1, NULL}) : NULL;
    g->fc1_b = UP_BF16({l->fc1_b, mlp});
    g->fc2_w = g->fc1_w ? STREAM(W * mlp, {&l->fc2_w, 0, 1, NULL}) : NULL;
    g->fc2_b = UP_F32({l->fc2_b, W});
    return g->ln1_w && g->ln1_b && g->ln2_w && g->ln2_b && g->qkv_w && g->qkv_b && g->o_w && g->o_b && g->fc1_w &&
                   g->fc1_b && g->fc2_w && g->fc2_b
               ? 0
               : -1;
}

/* Pi0: W_fold (We, A) = W_a (We, We) . W_in (We, A), in double: the first half of action_time_mlp_in
 * applied to action_in_proj. */
static float *fold_time_in(const pi0_weights *w, int We, int A) {
    float *fold = malloc((size_t)We * A * sizeof(float));
    if (!fold) return NULL;
    for (int i = 0; i < We; i++)
        for (int j = 0; j < A; j++) {
            double acc = 0;
            for (int k = 0; k < We; k++) acc += (double)w->action_time_in_w[(size_t)i * 2 * We + k] * w->action_in_w[(size_t)k * A + j];
            fold[(size_t)i * A + j] = (float)acc;
        }
    return fold;
}

/* Pi0: action_out_proj's weights (A, We) times the final norm's 1 + w, column by column in float32 (the loader's
 * fold for the layers' norms), for the skinny Euler step whose Linear applies the norm's row factor. */
static float *fold_final_norm(const pi0_weights *w, int We, int A) {
    float *fold = malloc((size_t)A * We * sizeof(float));
    if (!fold) return NULL;
    for (int i = 0; i < A; i++)
        for (int k = 0; k < We; k++) fold[(size_t)i * We + k] = w->action_out_w[(size_t)i * We + k] * (1.0f + w->expert_norm[k]);
    return fold;
}

/* RoPE tables for every position a plan may use: the CPU backend's, so both rotate alike. */
static int upload_rope(cuda_state *s, int head_dim, pi0_error *err) {
    rope_table t = {0};
    size_t n = (size_t)ROPE_MAX_POS * (head_dim / 2);
    int ok = rope_table_init(&t, ROPE_MAX_POS, head_dim) == 0;
    s->w.rope_cos = ok ? UP_F32({t.cos, n}) : NULL;
    s->w.rope_sin = ok ? UP_F32({t.sin, n}) : NULL;
    rope_table_free(&t);
    return s->w.rope_cos && s->w.rope_sin ? 0 : -1;
}

/* The action heads and the expert's final norm: Pi0's (state token, the folded action-time MLP) or
 * Pi0.5's (action_in_proj, the time conditioning's MLP, an adaptive final norm). */
static int upload_heads(cuda_state *s, const pi0_model *m, loader *ld, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    const pi0_weights *w = &m->weights;
    gpu_weights *g = &s->w;
    size_t We = (size_t)d->expert.width, A = (size_t)d->action_dim;
    g->action_out_w = UP_BF16({w->action_out_w, A * We}), g->action_out_b = UP_F32({w->action_out_b, A});
    if (!g->action_out_w || !g->action_out_b) return -1;
    if (d->kind == PI0_MODEL_PI05) {
        g->action_in_w = UP_BF16({w->action_in_w, We * A}), g->action_in_b = UP_F32({w->action_in_b, We});
        g->time_mlp_in_w = UP_BF16({w->time_mlp_in_w, We * We}), g->time_mlp_in_b = UP_F32({w->time_mlp_in_b, We});
        g->time_mlp_out_w = UP_BF16({w->time_mlp_out_w, We * We}), g->time_mlp_out_b = UP_F32({w->time_mlp_out_b, We});
        g->expert_norm_dense_w = STREAM(3 * We * We, {&w->expert_norm_dense_w, 0, 1, NULL});
        g->expert_norm_dense_b = UP_F32({w->expert_norm_dense_b, 3 * We});
        return g->action_in_w && g->action_in_b && g->time_mlp_in_w && g->time_mlp_in_b &&
                       g->time_mlp_out_w && g->time_mlp_out_b && g->expert_norm_dense_w && g->expert_norm_dense_b
                   ? 0
                   : -1;
    }
    float *fold = fold_time_in(w, (int)We, (int)A), *out_fold = fold_final_norm(w, (int)We, (int)A);
    if (!fold || !out_fold) {
        free(fold), free(out_fold);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory preparing GPU weights"), -1;
    }
    g->expert_norm = UP_F32({w->expert_norm, We});
    g->action_out_fold_w = UP_BF16({out_fold, A * We});
    free(out_fold);
    g->state_proj_w = UP_BF16({w->state_proj_w, We * A}), g->state_proj_b = UP_F32({w->state_proj_b, We});
    g->time_fold_w = UP_BF16({fold, We * A});
    g->time_out_w = UP_BF16({w->action_time_out_w, We * We}), g->time_out_b = UP_F32({w->action_time_out_b, We});
    free(fold);
    return g->expert_norm && g->action_out_fold_w && g->state_proj_w && g->state_proj_b && g->time_fold_w && g->time_out_w &&
                   g->time_out_b
               ? 0
               : -1;
}

/* What this backend reads from the host weights: vectors (norms, biases), the float32 patch and position
 * embeddings, and the action heads (small; their biases also feed the step tables, forward.c). */
int cuda_keeps_on_host(const pi0_weights *w, const weight_spec *spec) {
    return spec->rank == 1 || spec->part == PART_ACTION_HEADS || spec->slot == &w->patch_w || spec->slot == &w->pos_emb;
}

/* The streaming buffers, sized for the widest row of any stack. */
static pi0_status loader_init(loader *ld, const pi0_model *m, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    memset(ld, 0, sizeof *ld);
    for (int i = 0; i < m->num_specs; i++)
        if (!*m->specs[i].slot) {
            const st_tensor *t = NULL;
            uint64_t elem = 4;
            if (m->source && (t = checkpoint_tensor(m->source, &m->specs[i]))) elem = st_dtype_size(t->dtype);
            ld->total += m->specs[i].numel * elem;
        }
    int widest = d->vision.width > d->llm.width ? d->vision.width : d->llm.width;
    ld->fold_cap = (size_t)(widest > d->expert.width ? widest : d->expert.width);
    if (cudaMalloc(&ld->stage, STAGE_VALUES * sizeof(float)) != cudaSuccess ||
        cudaMalloc((void **)&ld->fold, ld->fold_cap * sizeof(float)) != cudaSuccess) {
        cudaGetLastError();
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate the %zu MB staging buffer on the GPU",
                        STAGE_VALUES * sizeof(float) >> 20);
    }
    if (!m->source && !(ld->scratch = malloc(STAGE_VALUES * sizeof(float))))
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for the random weights' scratch");
    return PI0_OK;
}

static void loader_free(loader *ld) {
    if (ld->stage) cudaFree(ld->stage);
    if (ld->fold) cudaFree(ld->fold);
    free(ld->scratch);
}

float *pi0_cuda_patch_weight_pieces(const float *w, size_t rows, size_t cols) {
    const int w_piece[PI0_PATCH_PIECES] = PI0_PATCH_W_PIECES;
    float *out = malloc(rows * PI0_PATCH_PIECES * cols * sizeof(float));
    for (size_t r = 0; out && r < rows; r++)
        for (size_t j = 0; j < cols; j++) {
            uint16_t piece[3];
            f32_to_bf16x3(w[r * cols + j], piece);
            for (int b = 0; b < PI0_PATCH_PIECES; b++)
                out[(r * PI0_PATCH_PIECES + b) * cols + j] = bf16_to_f32(piece[w_piece[b]]);
        }
    return out;
}

static pi0_status upload_all(cuda_state *s, const pi0_model *m, loader *ld, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    const pi0_weights *w = &m->weights;
    gpu_weights *g = &s->w;
    int Dv = d->vision.width, D = d->llm.width;
    int P = image_tokens(d), patch_dim = 3 * d->patch_size * d->patch_size;
    int failed = 0;
    float *patch_pieces = pi0_cuda_patch_weight_pieces(w->patch_w, (size_t)Dv, (size_t)patch_dim); /* float32 in openpi */
    if (!patch_pieces) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory preparing GPU weights");
    g->patch_w = UP_BF16({patch_pieces, (size_t)Dv * PI0_PATCH_PIECES * patch_dim});
    free(patch_pieces);
    g->patch_b = UP_F32({w->patch_b, (size_t)Dv});
    g->pos_emb = UP_F32({w->pos_emb, (size_t)P * Dv});
    for (int l = 0; l < d->vision.depth && !failed; l++)
        failed = upload_vit(s, m, ld, &g->vit[l], &w->vit[l], &d->vision, err);
    if (failed) return err && err->status ? err->status : PI0_ERR_BACKEND;
    g->post_ln_w = UP_F32({w->post_ln_w, (size_t)Dv}), g->post_ln_b = UP_F32({w->post_ln_b, (size_t)Dv});
    g->proj_w = STREAM((size_t)D * Dv, {&w->proj_w, 0, 1, NULL});
    g->proj_b = UP_F32({w->proj_b, (size_t)D});
    g->embed = g->proj_w ? STREAM((size_t)d->vocab_size * D, {&w->embed, 0, 1, NULL}) : NULL;
    for (int l = 0; l < d->llm.depth && !failed; l++)
        failed = upload_gemma(s, m, ld, &g->llm[l], &w->llm[l], &d->llm, NORMS_KEPT, err);
    norm_layout expert_norms = d->kind == PI0_MODEL_PI05 ? NORMS_ADAPTIVE : NORMS_FOLDED;
    for (int l = 0; l < d->expert.depth && !failed; l++)
        failed = upload_gemma(s, m, ld, &g->expert[l], &w->expert[l], &d->expert, expert_norms, err);
    if (failed || !g->patch_w || !g->patch_b || !g->pos_emb || !g->post_ln_w || !g->post_ln_b || !g->proj_w ||
        !g->proj_b || !g->embed || upload_heads(s, m, ld, err) || upload_rope(s, d->llm.head_dim, err))
        return err && err->status ? err->status : PI0_ERR_BACKEND;
    return PI0_OK;
}

pi0_status cuda_weights_upload(cuda_state *s, const pi0_model *m, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    gpu_weights *g = &s->w;
    s->max_allocations = 64 + 16 * d->vision.depth + 8 * (d->llm.depth + d->expert.depth);
    s->allocations = calloc((size_t)s->max_allocations, sizeof(void *));
    g->vit = calloc((size_t)d->vision.depth, sizeof *g->vit);
    g->llm = calloc((size_t)d->llm.depth, sizeof *g->llm);
    g->expert = calloc((size_t)d->expert.depth, sizeof *g->expert);
    if (!s->allocations || !g->vit || !g->llm || !g->expert)
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory preparing GPU weights");
    loader ld;
    pi0_status st = loader_init(&ld, m, err);
    if (!st) st = upload_all(s, m, &ld, err);
    /* every copy landed before any kernel of the backend's own stream reads the weights */
    if (!st && cudaDeviceSynchronize() != cudaSuccess)
        st = pi0_fail(err, PI0_ERR_BACKEND, "uploading the weights: %s", cudaGetErrorString(cudaGetLastError()));
    loader_free(&ld);
    return st;
}
