/*
 * weights.c - the table of every tensor for given dims (weights.h), the arena that holds them, and their
 * deterministic random initialisation. Sizes are products of dims that came from files: they are computed
 * with overflow checks (saturating), so an absurd size fails the allocation instead of wrapping around.
 */
#include "model/weights.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "model/names.h"
#include "util/error.h"
#include "util/rng.h"


/* Floats between tensors in the arena are rounded up to 64 bytes. */
#define ARENA_ALIGN 16

const char *weight_part_name(weight_part part) {
    static const char *names[PART_COUNT] = {"vision", "projector", "embedding", "llm", "expert", "action heads"};
    return part < PART_COUNT ? names[part] : "?";
}

typedef struct {
    weight_spec *specs;
    int count;
    weight_part part;
} spec_list;

static void add(spec_list *list, float **slot, weight_init init, int rank, const int64_t *shape,
                const char *fmt, ...) __attribute__((format(printf, 6, 7)));

static void add(spec_list *list, float **slot, weight_init init, int rank, const int64_t *shape,
                const char *fmt, ...) {
    weight_spec *s = &list->specs[list->count++];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->name, sizeof s->name, fmt, ap);
    va_end(ap);
    s->rank = rank;
    s->numel = 1;
    for (int i = 0; i < rank; i++) {
        s->shape[i] = shape[i];
        if (__builtin_mul_overflow(s->numel, (uint64_t)shape[i], &s->numel)) s->numel = UINT64_MAX;
    }
    s->part = list->part;
    s->init = init;
    s->slot = slot;
}

/* A Linear layer: weight (out, in) and, when `bias`, bias (out). */
static void add_linear(spec_list *list, float **w, float **b, int64_t out, int64_t in, const char *name) {
    add(list, w, INIT_FAN_IN, 2, (int64_t[]){out, in}, "%s.weight", name);
    if (b) add(list, b, INIT_BIAS, 1, (int64_t[]){out}, "%s.bias", name);
}

static void add_vector(spec_list *list, float **slot, weight_init init, int64_t n, const char *name) {
    add(list, slot, init, 1, (int64_t[]){n}, "%s", name);
}

/* A Gemma norm named `name`: plain (its scale `name`.weight) or adaptive (`name`.dense, (3W, W) + bias). */
static void add_norm(spec_list *list, float **scale, float **dense_w, float **dense_b, int adaptive, int64_t width,
                     const char *name) {
    char full[128];
    if (adaptive) {
        snprintf(full, sizeof full, "%s.dense", name);
        add_linear(list, dense_w, dense_b, 3 * width, width, full);
    } else {
        snprintf(full, sizeof full, "%s.weight", name);
        add_vector(list, scale, INIT_ZERO_MEAN_SCALE, width, full);
    }
}

static void add_gemma_stack(spec_list *list, gemma_layer *layers, const pi0_stack_dims *d, const char *root,
                            int adaptive) {
    char name[128];
    int64_t q = (int64_t)d->num_heads * d->head_dim, kv = (int64_t)d->num_kv_heads * d->head_dim;
    for (int i = 0; i < d->depth; i++) {
        gemma_layer *l = &layers[i];
#define NAME(suffix) (snprintf(name, sizeof name, "%slayers.%d.%s", root, i, suffix), name)
        add_norm(list, &l->input_norm, &l->input_norm_dense_w, &l->input_norm_dense_b, adaptive, d->width,
                 NAME("input_layernorm"));
        add_linear(list, &l->q_w, NULL, q, d->width, NAME("self_attn.q_proj"));
        add_linear(list, &l->k_w, NULL, kv, d->width, NAME("self_attn.k_proj"));
        add_linear(list, &l->v_w, NULL, kv, d->width, NAME("self_attn.v_proj"));
        add_linear(list, &l->o_w, NULL, d->width, q, NAME("self_attn.o_proj"));
        add_norm(list, &l->post_attn_norm, &l->post_norm_dense_w, &l->post_norm_dense_b, adaptive, d->width,
                 NAME("post_attention_layernorm"));
        add_linear(list, &l->gate_w, NULL, d->mlp_dim, d->width, NAME("mlp.gate_proj"));
        add_linear(list, &l->up_w, NULL, d->mlp_dim, d->width, NAME("mlp.up_proj"));
        add_linear(list, &l->down_w, NULL, d->width, d->mlp_dim, NAME("mlp.down_proj"));
#undef NAME
    }
}

static void add_vision(spec_list *list, pi0_weights *w, const pi0_dims *dims) {
    const pi0_stack_dims *v = &dims->vision;
    int64_t p = dims->patch_size, grid = dims->image_size / dims->patch_size;
    char name[128];
    list->part = PART_VISION;
    add(list, &w->patch_w, INIT_FAN_IN, 4, (int64_t[]){v->width, 3, p, p}, NAME_VISION "embeddings.patch_embedding.weight");
    add_vector(list, &w->patch_b, INIT_BIAS, v->width, NAME_VISION "embeddings.patch_embedding.bias");
    add(list, &w->pos_emb, INIT_BIAS, 2, (int64_t[]){grid * grid, v->width}, NAME_VISION "embeddings.position_embedding.weight");
    for (int i = 0; i < v->depth; i++) {
        vit_layer *l = &w->vit[i];
#define NAME(suffix) (snprintf(name, sizeof name, NAME_VISION "encoder.layers.%d.%s", i, suffix), name)
        add_vector(list, &l->ln1_w, INIT_UNIT_SCALE, v->width, NAME("layer_norm1.weight"));
        add_vector(list, &l->ln1_b, INIT_BIAS, v->width, NAME("layer_norm1.bias"));
        add_linear(list, &l->q_w, &l->q_b, v->width, v->width, NAME("self_attn.q_proj"));
        add_linear(list, &l->k_w, &l->k_b, v->width, v->width, NAME("self_attn.k_proj"));
        add_linear(list, &l->v_w, &l->v_b, v->width, v->width, NAME("self_attn.v_proj"));
        add_linear(list, &l->o_w, &l->o_b, v->width, v->width, NAME("self_attn.out_proj"));
        add_vector(list, &l->ln2_w, INIT_UNIT_SCALE, v->width, NAME("layer_norm2.weight"));
        add_vector(list, &l->ln2_b, INIT_BIAS, v->width, NAME("layer_norm2.bias"));
        add_linear(list, &l->fc1_w, &l->fc1_b, v->mlp_dim, v->width, NAME("mlp.fc1"));
        add_linear(list, &l->fc2_w, &l->fc2_b, v->width, v->mlp_dim, NAME("mlp.fc2"));
#undef NAME
    }
    add_vector(list, &w->post_ln_w, INIT_UNIT_SCALE, v->width, NAME_VISION "post_layernorm.weight");
    add_vector(list, &w->post_ln_b, INIT_BIAS, v->width, NAME_VISION "post_layernorm.bias");
    list->part = PART_PROJECTOR;
    add_linear(list, &w->proj_w, &w->proj_b, dims->llm.width, v->width, NAME_PROJECTOR);
}

int weights_specs(const pi0_dims *dims, pi0_weights *w, weight_spec **specs) {
    int max = 8 + 16 * dims->vision.depth + 12 * (dims->llm.depth + dims->expert.depth) + 16;
    int pi05 = dims->kind == PI0_MODEL_PI05;
    spec_list list = {.specs = calloc((size_t)max, sizeof(weight_spec))};
    w->vit = calloc((size_t)dims->vision.depth + 1, sizeof(vit_layer));
    w->llm = calloc((size_t)dims->llm.depth + 1, sizeof(gemma_layer));
    w->expert = calloc((size_t)dims->expert.depth + 1, sizeof(gemma_layer));
    if (!list.specs || !w->vit || !w->llm || !w->expert) {
        free(list.specs);
        return -1;
    }
    int64_t A = dims->action_dim, We = dims->expert.width;

    add_vision(&list, w, dims);
    list.part = PART_EMBEDDING;
    add(&list, &w->embed, INIT_FAN_IN, 2, (int64_t[]){dims->vocab_size, dims->llm.width}, NAME_EMBEDDING);
    /* PaliGemma ties its output head to the embedding: a checkpoint may store only the head */
    list.specs[list.count - 1].alt_name = NAME_TIED_EMBEDDING;
    list.part = PART_LLM;
    add_gemma_stack(&list, w->llm, &dims->llm, NAME_LLM, 0);
    add_vector(&list, &w->llm_norm, INIT_ZERO_MEAN_SCALE, dims->llm.width, NAME_LLM "norm.weight");
    list.part = PART_EXPERT;
    add_gemma_stack(&list, w->expert, &dims->expert, NAME_EXPERT, pi05);
    add_norm(&list, &w->expert_norm, &w->expert_norm_dense_w, &w->expert_norm_dense_b, pi05, We, NAME_EXPERT "norm");
    list.part = PART_ACTION_HEADS;
    if (!pi05) add_linear(&list, &w->state_proj_w, &w->state_proj_b, We, A, "state_proj");
    add_linear(&list, &w->action_in_w, &w->action_in_b, We, A, "action_in_proj");
    add_linear(&list, &w->action_out_w, &w->action_out_b, A, We, "action_out_proj");
    if (pi05) {
        add_linear(&list, &w->time_mlp_in_w, &w->time_mlp_in_b, We, We, "time_mlp_in");
        add_linear(&list, &w->time_mlp_out_w, &w->time_mlp_out_b, We, We, "time_mlp_out");
    } else {
        add_linear(&list, &w->action_time_in_w, &w->action_time_in_b, We, 2 * We, "action_time_mlp_in");
        add_linear(&list, &w->action_time_out_w, &w->action_time_out_b, We, We, "action_time_mlp_out");
    }
    *specs = list.specs;
    return list.count;
}

/* Floats a tensor takes in the arena, saturating at UINT64_MAX. */
static uint64_t arena_floats(uint64_t numel) {
    return numel > UINT64_MAX - ARENA_ALIGN ? UINT64_MAX : (numel + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
}

pi0_status weights_alloc(pi0_weights *w, const weight_spec *specs, int count, weight_keep_fn keep, pi0_error *err) {
    uint64_t total = 0;
    for (int i = 0; i < count; i++)
        if ((!keep || keep(w, &specs[i])) && __builtin_add_overflow(total, arena_floats(specs[i].numel), &total))
            total = UINT64_MAX;
    const size_t huge = 2 << 20; /* whole 2 MB pages (at least one) */
    if (total > SIZE_MAX / sizeof(float) - huge ||
        !(w->arena = aligned_alloc(huge, ((size_t)total * sizeof(float) + huge) / huge * huge)))
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate %.2f GB for float32 weights",
                        (double)total * sizeof(float) / 1e9);
    /* huge pages: faulting in gigabytes of weights 4 KB at a time costs seconds */
    madvise(w->arena, (size_t)total * sizeof(float), MADV_HUGEPAGE);
    uint64_t offset = 0;
    for (int i = 0; i < count; i++) {
        *specs[i].slot = NULL;
        if (keep && !keep(w, &specs[i])) continue;
        *specs[i].slot = w->arena + offset;
        offset += arena_floats(specs[i].numel);
    }
    return PI0_OK;
}

/* Random weights keep activations O(1) through any depth: linear weights have std 1/sqrt(fan_in),
 * norm scales stay near their identity, biases and position embeddings are small. */
void weights_random_range(const weight_spec *s, uint64_t seed, uint64_t first, uint64_t count, float *out) {
    uint64_t stream = rng_mix64(seed ^ rng_hash_str(s->name));
    float amplitude, offset = 0;
    switch (s->init) {
    case INIT_FAN_IN: {
        uint64_t fan_in = s->numel / (uint64_t)s->shape[0];
        amplitude = (float)sqrt(3.0 / (double)fan_in); /* uniform(-a, a) has std a/sqrt(3) */
        break;
    }
    case INIT_BIAS: amplitude = 0.02f; break;
    case INIT_ZERO_MEAN_SCALE: amplitude = 0.1f; break;
    case INIT_UNIT_SCALE: amplitude = 0.1f; offset = 1.0f; break;
    default: amplitude = 0; break;
    }
    int64_t n = (int64_t)count;
#pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; i++) out[i] = offset + amplitude * rng_uniform_pm1(stream, first + (uint64_t)i);
}

void weights_init_random(const weight_spec *specs, int count, uint64_t seed) {
    for (int i = 0; i < count; i++)
        if (*specs[i].slot) weights_random_range(&specs[i], seed, 0, specs[i].numel, *specs[i].slot);
}

void weights_free(pi0_weights *w) {
    free(w->arena);
    free(w->vit);
    free(w->llm);
    free(w->expert);
    memset(w, 0, sizeof *w);
}
