/*
 * config.c - a model's dims from a checkpoint's tensor shapes and its config.json, from a dims file, and
 * their validation. Shapes and JSON are untrusted: a zero-size tensor may claim any size, so every dim is
 * bounded (config.h's DIM_MAX_*) before any arithmetic is done with it.
 */
#include "model/config.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/names.h"
#include "util/error.h"


pi0_dims pi0_dims_pi0(void) {
    return (pi0_dims){
        .vision = {.width = 1152, .depth = 27, .mlp_dim = 4304, .num_heads = 16, .num_kv_heads = 16, .head_dim = 72},
        .patch_size = 14,
        .image_size = 224,
        .llm = {.width = 2048, .depth = 18, .mlp_dim = 16384, .num_heads = 8, .num_kv_heads = 1, .head_dim = 256},
        .expert = {.width = 1024, .depth = 18, .mlp_dim = 4096, .num_heads = 8, .num_kv_heads = 1, .head_dim = 256},
        .vocab_size = 257152,
        .action_dim = 32,
        .action_horizon = 50,
        .max_token_len = 48,
    };
}

pi0_dims pi0_dims_pi05(void) {
    pi0_dims d = pi0_dims_pi0();
    d.kind = PI0_MODEL_PI05;
    d.max_token_len = 200;
    return d;
}

/* Head layout of openpi's Gemma variants (gemma.py get_config); the LoRA variants share it. */
static int gemma_variant_heads(const char *variant, pi0_stack_dims *d) {
    if (!variant) return 0;
    if (!strcmp(variant, "gemma_2b") || !strcmp(variant, "gemma_2b_lora") || !strcmp(variant, "gemma_300m") ||
        !strcmp(variant, "gemma_300m_lora")) {
        d->num_heads = 8, d->num_kv_heads = 1, d->head_dim = 256;
        return 1;
    }
    return 0;
}

/* Size of axis `axis` of tensor prefix+name, or -1 when absent. */
static int64_t dim_of(const st_file *f, const char *prefix, const char *name, int axis) {
    char full[256];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    const st_tensor *t = st_find(f, full);
    return t && axis < t->rank ? t->shape[axis] : -1;
}

/* dim_of as an int in *out (-1: absent), refused past `max` with the tensor and the limit named: a zero-size
 * tensor may claim any size, and the dims derived from it must not overflow anything computed later. */
static pi0_status shape_dim(const st_file *f, const char *prefix, const char *name, int axis, int64_t max, int *out,
                            pi0_error *err) {
    int64_t size = dim_of(f, prefix, name, axis);
    if (size > max)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "tensor %s%s: axis %d has size %lld, over the limit %lld", prefix, name,
                        axis, (long long)size, (long long)max);
    *out = (int)size;
    return PI0_OK;
}

pi0_model_kind config_model_kind(const st_file *f, const char *prefix) {
    return dim_of(f, prefix, NAME_PI05_NORM, 0) > 0 || dim_of(f, prefix, NAME_PI05_TIME_MLP, 0) > 0 ? PI0_MODEL_PI05
                                                                                                  : PI0_MODEL_PI0;
}

const char *config_model_kind_reason(pi0_model_kind kind) {
    return kind == PI0_MODEL_PI05
               ? "the action expert's norms are adaptive (" NAME_PI05_NORM ") and time_mlp_in/out condition them on "
                 "the flow time"
               : "plain RMSNorms in the action expert, a state token (state_proj) and action_time_mlp_in/out";
}

/* Depth of a stack: one more than the highest i of any tensor named prefix+root+"layers.{i}.". Taking
 * the highest, not the first gap, makes a missing tensor in the middle an error that names it. */
static int count_layers(const st_file *f, const char *prefix, const char *root) {
    char head[256];
    int depth = 0;
    size_t head_len = (size_t)snprintf(head, sizeof head, "%s%slayers.", prefix, root);
    for (int i = 0; i < f->num_tensors; i++) {
        const char *name = f->tensors[i].name;
        if (strncmp(name, head, head_len)) continue;
        char *end;
        long layer = strtol(name + head_len, &end, 10);
        if (end != name + head_len && *end == '.' && layer >= 0 && layer < 4096 && layer + 1 > depth) depth = (int)layer + 1;
    }
    return depth;
}

static pi0_status gemma_dims_from_shapes(const st_file *f, const char *prefix, const char *root, const char *what,
                                         pi0_stack_dims *d, int *q_rows, int *kv_rows, pi0_error *err) {
    char name[256];
    d->depth = count_layers(f, prefix, root);
    if (d->depth == 0)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "no %s layers: missing tensor %s%slayers.0.self_attn.q_proj.weight",
                        what, prefix, root);
#define SHAPE(suffix, axis, max, out) \
    (snprintf(name, sizeof name, "%slayers.0.%s", root, suffix), shape_dim(f, prefix, name, axis, max, out, err))
    if (SHAPE("self_attn.q_proj.weight", 1, DIM_MAX_WIDTH, &d->width) ||
        SHAPE("self_attn.q_proj.weight", 0, DIM_MAX_ATTENTION, q_rows) ||
        SHAPE("self_attn.k_proj.weight", 0, DIM_MAX_ATTENTION, kv_rows) ||
        SHAPE("mlp.gate_proj.weight", 0, DIM_MAX_MLP, &d->mlp_dim))
        return err ? err->status : PI0_ERR_CHECKPOINT;
#undef SHAPE
    if (d->width <= 0 || *q_rows <= 0 || *kv_rows <= 0 || d->mlp_dim <= 0)
        return pi0_fail(err, PI0_ERR_CHECKPOINT,
                        "missing or empty %s tensor among %s%slayers.0.{self_attn.q_proj,self_attn.k_proj,mlp.gate_proj}.weight",
                        what, prefix, root);
    return PI0_OK;
}

/* Reads a positive integer field; absent leaves *out untouched. */
static pi0_status json_dim(json_t *obj, const char *key, int *out, const char *path, pi0_error *err) {
    json_t *v = obj ? json_object_get(obj, key) : NULL;
    if (!v) return PI0_OK;
    if (!json_is_integer(v) || json_integer_value(v) <= 0 || json_integer_value(v) > (1 << 24))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"%s\" must be a positive integer", path, key);
    *out = (int)json_integer_value(v);
    return PI0_OK;
}

/* Takes head counts from a config `dims` block, and checks what shapes already told. */
static pi0_status stack_from_json(json_t *obj, pi0_stack_dims *d, const char *what, const char *path, pi0_error *err) {
    if (!obj) return PI0_OK;
    pi0_stack_dims c = *d;
    if (json_dim(obj, "num_heads", &d->num_heads, path, err) || json_dim(obj, "num_kv_heads", &d->num_kv_heads, path, err) ||
        json_dim(obj, "head_dim", &d->head_dim, path, err) || json_dim(obj, "width", &c.width, path, err) ||
        json_dim(obj, "depth", &c.depth, path, err) || json_dim(obj, "mlp_dim", &c.mlp_dim, path, err))
        return err ? err->status : PI0_ERR_FORMAT;
    if (c.width != d->width || c.depth != d->depth || c.mlp_dim != d->mlp_dim)
        return pi0_fail(err, PI0_ERR_CHECKPOINT,
                        "%s: dims.%s says width %d depth %d mlp %d but the tensors have width %d depth %d mlp %d", path,
                        what, c.width, c.depth, c.mlp_dim, d->width, d->depth, d->mlp_dim);
    return PI0_OK;
}

/* Fills num_heads/head_dim of a Gemma stack when config.json did not: Gemma's head_dim is 256. */
static pi0_status gemma_heads(pi0_stack_dims *d, int q_rows, int kv_rows, const char *what, pi0_error *err) {
    if (d->head_dim == 0 && q_rows % 256 == 0 && kv_rows % 256 == 0) d->head_dim = 256;
    if (d->head_dim <= 0)
        return pi0_fail(err, PI0_ERR_CHECKPOINT,
                        "cannot tell %s's head_dim from q_proj (%d rows): set dims.%s.head_dim in config.json", what,
                        q_rows, what);
    if (d->num_heads == 0) d->num_heads = q_rows / d->head_dim;
    if (d->num_kv_heads == 0) d->num_kv_heads = kv_rows / d->head_dim;
    if ((int64_t)d->num_heads * d->head_dim != q_rows || (int64_t)d->num_kv_heads * d->head_dim != kv_rows)
        return pi0_fail(err, PI0_ERR_CHECKPOINT,
                        "%s: %d heads x %d head_dim (%d kv heads) do not match q_proj rows %d / k_proj rows %d", what,
                        d->num_heads, d->head_dim, d->num_kv_heads, q_rows, kv_rows);
    return PI0_OK;
}

static pi0_status vision_dims(const st_file *f, const char *prefix, pi0_dims *dims, pi0_error *err) {
    pi0_stack_dims *v = &dims->vision;
    int positions;
    /* one position per patch of an image of at most DIM_MAX_IMAGE on a side */
    if (shape_dim(f, prefix, NAME_VISION "embeddings.patch_embedding.weight", 0, DIM_MAX_WIDTH, &v->width, err) ||
        shape_dim(f, prefix, NAME_VISION "embeddings.patch_embedding.weight", 2, DIM_MAX_IMAGE, &dims->patch_size, err) ||
        shape_dim(f, prefix, NAME_VISION "embeddings.position_embedding.weight", 0, DIM_MAX_IMAGE * DIM_MAX_IMAGE,
                  &positions, err) ||
        shape_dim(f, prefix, NAME_VISION "encoder.layers.0.mlp.fc1.weight", 0, DIM_MAX_MLP, &v->mlp_dim, err))
        return err ? err->status : PI0_ERR_CHECKPOINT;
    if (v->width <= 0 || dims->patch_size <= 0 || positions <= 0)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "missing %s" NAME_VISION "embeddings.{patch,position}_embedding.weight",
                        prefix);
    int grid = (int)lround(sqrt((double)positions));
    if (grid * grid != positions)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "position_embedding has %d rows, not a square grid of patches",
                        positions);
    dims->image_size = grid * dims->patch_size; /* both at most DIM_MAX_IMAGE; dims_validate bounds the product */
    v->depth = count_layers(f, prefix, NAME_VISION "encoder.");
    if (v->depth == 0 || v->mlp_dim <= 0)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "no vision encoder layers (missing %s" NAME_VISION "encoder.layers.0.*)",
                        prefix);
    return PI0_OK;
}

/* The vision head count cannot come from shapes: So400m (width 1152) has 16 heads of 72. */
static pi0_status vision_heads(pi0_stack_dims *v, pi0_error *err) {
    if (v->num_heads == 0 && v->width == 1152) v->num_heads = 16;
    if (v->num_heads == 0)
        return pi0_fail(err, PI0_ERR_CHECKPOINT,
                        "cannot tell the vision head count for width %d: set dims.vision.num_heads in config.json",
                        v->width);
    if (v->width % v->num_heads)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "vision width %d is not divisible by %d heads", v->width, v->num_heads);
    v->head_dim = v->width / v->num_heads;
    v->num_kv_heads = v->num_heads;
    return PI0_OK;
}

static json_t *load_config(const char *path, pi0_error *err) {
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root) {
        pi0_fail(err, PI0_ERR_FORMAT, "%s:%d:%d: %s", path, jerr.line, jerr.column, jerr.text);
        return NULL;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        pi0_fail(err, PI0_ERR_FORMAT, "%s: not a JSON object", path);
        return NULL;
    }
    return root;
}

static pi0_status apply_config(json_t *cfg, const char *path, pi0_dims *dims, int llm_q, int llm_kv, int exp_q,
                               int exp_kv, pi0_error *err) {
    int action_dim = dims->action_dim;
    if (json_dim(cfg, "action_dim", &action_dim, path, err) || json_dim(cfg, "action_horizon", &dims->action_horizon, path, err) ||
        json_dim(cfg, "max_token_len", &dims->max_token_len, path, err))
        return err ? err->status : PI0_ERR_FORMAT;
    if (action_dim != dims->action_dim)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "%s: action_dim %d but action_in_proj takes %d", path, action_dim,
                        dims->action_dim);
    json_t *variant = json_object_get(cfg, "paligemma_variant");
    gemma_variant_heads(json_string_value(variant), &dims->llm);
    variant = json_object_get(cfg, "action_expert_variant");
    gemma_variant_heads(json_string_value(variant), &dims->expert);
    json_t *d = json_object_get(cfg, "dims");
    if (d && !json_is_object(d)) return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"dims\" must be an object", path);
    if (d) {
        if (stack_from_json(json_object_get(d, "vision"), &dims->vision, "vision", path, err) ||
            stack_from_json(json_object_get(d, "llm"), &dims->llm, "llm", path, err) ||
            stack_from_json(json_object_get(d, "expert"), &dims->expert, "expert", path, err))
            return err ? err->status : PI0_ERR_FORMAT;
    }
    if (gemma_heads(&dims->llm, llm_q, llm_kv, "llm", err) || gemma_heads(&dims->expert, exp_q, exp_kv, "expert", err) ||
        vision_heads(&dims->vision, err))
        return err ? err->status : PI0_ERR_CHECKPOINT;
    return PI0_OK;
}

pi0_status config_derive_dims(const st_file *f, const char *prefix, const char *config_path, pi0_dims *dims,
                              int *horizon_given, pi0_error *err) {
    memset(dims, 0, sizeof *dims);
    dims->kind = config_model_kind(f, prefix);
    dims->max_token_len = dims->kind == PI0_MODEL_PI05 ? 200 : 48; /* openpi's Pi0Config defaults */
    pi0_status st = vision_dims(f, prefix, dims, err);
    if (st) return st;
    int llm_q, llm_kv, exp_q, exp_kv;
    if ((st = gemma_dims_from_shapes(f, prefix, NAME_LLM, "llm", &dims->llm, &llm_q, &llm_kv, err)) ||
        (st = gemma_dims_from_shapes(f, prefix, NAME_EXPERT, "expert", &dims->expert, &exp_q, &exp_kv, err)) ||
        (st = shape_dim(f, prefix, NAME_EMBEDDING, 0, DIM_MAX_VOCAB, &dims->vocab_size, err)) ||
        (dims->vocab_size <= 0 &&
         (st = shape_dim(f, prefix, NAME_TIED_EMBEDDING, 0, DIM_MAX_VOCAB, &dims->vocab_size, err))) ||
        (st = shape_dim(f, prefix, "action_in_proj.weight", 1, DIM_MAX_ACTION_DIM, &dims->action_dim, err)))
        return st;
    if (dims->vocab_size <= 0 || dims->action_dim <= 0)
        return pi0_fail(err, PI0_ERR_CHECKPOINT, "missing %s" NAME_EMBEDDING " (or " NAME_TIED_EMBEDDING
                        ") or %saction_in_proj.weight", prefix, prefix);

    json_t *cfg = NULL;
    if (access(config_path, F_OK) == 0 && !(cfg = load_config(config_path, err))) return err ? err->status : PI0_ERR_FORMAT;
    st = apply_config(cfg, config_path, dims, llm_q, llm_kv, exp_q, exp_kv, err);
    json_decref(cfg);
    *horizon_given = dims->action_horizon != 0;
    if (!dims->action_horizon) dims->action_horizon = 50; /* openpi's Pi0Config default */
    return st ? st : dims_validate(dims, err);
}

/* A dim (or a product of dims, in 64 bits) named `what`.`name`, which must lie in 1..max. */
typedef struct {
    const char *name;
    int64_t value, max;
} dim_limit;

static pi0_status check_limits(const dim_limit *limits, int count, const char *what, pi0_error *err) {
    for (int i = 0; i < count; i++)
        if (limits[i].value < 1 || limits[i].value > limits[i].max)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s%s%s is %lld, outside the limits 1..%lld", what,
                            what[0] ? "." : "", limits[i].name, (long long)limits[i].value, (long long)limits[i].max);
    return PI0_OK;
}

static pi0_status stack_validate(const pi0_stack_dims *d, const char *what, pi0_error *err) {
    const dim_limit limits[] = {
        {"width", d->width, DIM_MAX_WIDTH},
        {"depth", d->depth, DIM_MAX_DEPTH},
        {"mlp_dim", d->mlp_dim, DIM_MAX_MLP},
        {"num_heads", d->num_heads, DIM_MAX_HEADS},
        {"num_kv_heads", d->num_kv_heads, DIM_MAX_HEADS},
        {"head_dim", d->head_dim, DIM_MAX_HEAD_DIM},
        {"num_heads x head_dim", (int64_t)d->num_heads * d->head_dim, DIM_MAX_ATTENTION},
        {"width x mlp_dim", (int64_t)d->width * d->mlp_dim, DIM_MAX_MLP_WEIGHTS},
    };
    pi0_status st = check_limits(limits, (int)(sizeof limits / sizeof limits[0]), what, err);
    if (st) return st;
    if (d->num_heads % d->num_kv_heads)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s: %d heads are not a multiple of %d kv heads", what,
                        d->num_heads, d->num_kv_heads);
    return PI0_OK;
}

pi0_status dims_validate(const pi0_dims *d, pi0_error *err) {
    const dim_limit limits[] = {
        {"patch_size", d->patch_size, DIM_MAX_IMAGE},
        {"image_size", d->image_size, DIM_MAX_IMAGE},
        {"vocab_size", d->vocab_size, DIM_MAX_VOCAB},
        {"action_dim", d->action_dim, DIM_MAX_ACTION_DIM},
        {"action_horizon", d->action_horizon, PI0_MAX_HORIZON},
        {"max_token_len", d->max_token_len, PI0_MAX_PROMPT_LEN},
    };
    pi0_status st;
    if ((st = stack_validate(&d->vision, "vision", err)) || (st = stack_validate(&d->llm, "llm", err)) ||
        (st = stack_validate(&d->expert, "expert", err)) ||
        (st = check_limits(limits, (int)(sizeof limits / sizeof limits[0]), "", err)))
        return st;
    if (d->vision.num_heads * d->vision.head_dim != d->vision.width)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "vision heads x head_dim must equal its width");
    if (d->llm.num_heads != d->expert.num_heads || d->llm.num_kv_heads != d->expert.num_kv_heads ||
        d->llm.head_dim != d->expert.head_dim)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT,
                        "the LLM and the action expert must share heads, kv heads and head_dim (joint attention)");
    if (d->llm.depth != d->expert.depth) /* expert layer l attends to LLM layer l's K/V */
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "the LLM has %d layers and the action expert %d: joint attention "
                        "needs one expert layer per LLM layer", d->llm.depth, d->expert.depth);
    if (d->llm.head_dim % 2) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "head_dim must be even for RoPE");
    if (d->image_size % d->patch_size)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "image_size %d must be a multiple of patch_size %d",
                        d->image_size, d->patch_size);
    return PI0_OK;
}

json_t *config_stack_json(const pi0_stack_dims *d) {
    return json_pack("{s:i,s:i,s:i,s:i,s:i,s:i}", "width", d->width, "depth", d->depth, "mlp_dim", d->mlp_dim,
                     "num_heads", d->num_heads, "num_kv_heads", d->num_kv_heads, "head_dim", d->head_dim);
}

pi0_status config_write(const pi0_dims *d, const char *path, int bf16, pi0_error *err) {
    json_t *dims = json_pack("{s:o,s:o,s:o,s:i,s:i,s:i}", "vision", config_stack_json(&d->vision), "llm",
                             config_stack_json(&d->llm), "expert", config_stack_json(&d->expert), "vocab", d->vocab_size, "patch", d->patch_size,
                             "image_size", d->image_size);
    /* "model" is for readers and for config_load_dims; loading a checkpoint tells the kind from its tensors */
    json_t *root = json_pack("{s:s,s:i,s:i,s:i,s:s,s:s,s:s,s:o}", "model", pi0_model_kind_name(d->kind), "action_dim",
                             d->action_dim, "action_horizon", d->action_horizon, "max_token_len", d->max_token_len,
                             "paligemma_variant", "custom", "action_expert_variant", "custom", "precision",
                             bf16 ? "bfloat16" : "float32", "dims", dims);
    if (!root) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot build %s", path);
    int rc = json_dump_file(root, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(root);
    return rc ? pi0_fail(err, PI0_ERR_IO, "cannot write %s", path) : PI0_OK;
}

static pi0_status stack_from_file(json_t *obj, pi0_stack_dims *d, const char *what, const char *path, pi0_error *err) {
    if (!json_is_object(obj)) return pi0_fail(err, PI0_ERR_FORMAT, "%s: dims.%s must be an object", path, what);
    if (json_dim(obj, "width", &d->width, path, err) || json_dim(obj, "depth", &d->depth, path, err) ||
        json_dim(obj, "mlp_dim", &d->mlp_dim, path, err) || json_dim(obj, "num_heads", &d->num_heads, path, err) ||
        json_dim(obj, "num_kv_heads", &d->num_kv_heads, path, err) || json_dim(obj, "head_dim", &d->head_dim, path, err))
        return err ? err->status : PI0_ERR_FORMAT;
    return PI0_OK;
}

pi0_status config_load_dims(const char *path, pi0_dims *dims, pi0_error *err) {
    json_t *cfg = load_config(path, err);
    if (!cfg) return err ? err->status : PI0_ERR_FORMAT;
    json_t *d = json_object_get(cfg, "dims"), *model = json_object_get(cfg, "model");
    const char *kind = model ? json_string_value(model) : "pi0";
    pi0_status st = PI0_OK;
    if (!kind || (strcmp(kind, "pi0") && strcmp(kind, "pi05")))
        st = pi0_fail(err, PI0_ERR_FORMAT, "%s: \"model\" must be \"pi0\" or \"pi05\"", path);
    else *dims = strcmp(kind, "pi05") ? pi0_dims_pi0() : pi0_dims_pi05();
    if (!st && !json_is_object(d)) st = pi0_fail(err, PI0_ERR_FORMAT, "%s: no \"dims\" object", path);
    if (!st) st = stack_from_file(json_object_get(d, "vision"), &dims->vision, "vision", path, err);
    if (!st) st = stack_from_file(json_object_get(d, "llm"), &dims->llm, "llm", path, err);
    if (!st) st = stack_from_file(json_object_get(d, "expert"), &dims->expert, "expert", path, err);
    if (!st && (json_dim(d, "vocab", &dims->vocab_size, path, err) || json_dim(d, "patch", &dims->patch_size, path, err) ||
                json_dim(d, "image_size", &dims->image_size, path, err) ||
                json_dim(cfg, "action_dim", &dims->action_dim, path, err) ||
                json_dim(cfg, "action_horizon", &dims->action_horizon, path, err) ||
                json_dim(cfg, "max_token_len", &dims->max_token_len, path, err)))
        st = err ? err->status : PI0_ERR_FORMAT;
    if (!st) {
        /* a vision block need not spell out head_dim and kv heads: they follow from width and heads */
        if (dims->vision.num_heads > 0 && !json_object_get(json_object_get(d, "vision"), "head_dim"))
            dims->vision.head_dim = dims->vision.width / dims->vision.num_heads;
        dims->vision.num_kv_heads = dims->vision.num_heads;
        st = dims_validate(dims, err);
    }
    json_decref(cfg);
    return st;
}
