/*
 * config.h - a model's dims: derived from tensor shapes wherever shapes can tell, and from
 * config.json (`dims`, or the variant names gemma_2b / gemma_300m / So400m) where they cannot,
 * e.g. how q_proj's rows split into heads x head_dim.
 */
#ifndef PI0_MODEL_CONFIG_H
#define PI0_MODEL_CONFIG_H

#include <jansson.h>

#include "io/safetensors.h"
#include "pi0.h"

/* Limits on a model's dims, far above real models (Pi0: width 2048, mlp 16384, 27 layers, 16 heads of 72,
 * vocab 257152). Every dim read from a checkpoint's shapes or a JSON file is checked against them before any
 * size is computed from it, so that no product of dims overflows (the largest, vocab x width, is 2^40). */
#define DIM_MAX_WIDTH 65536
#define DIM_MAX_DEPTH 1024
#define DIM_MAX_MLP (1 << 20)
#define DIM_MAX_HEADS 1024
#define DIM_MAX_HEAD_DIM 4096
#define DIM_MAX_ATTENTION (1 << 18)         /* num_heads x head_dim: q_proj's rows */
#define DIM_MAX_MLP_WEIGHTS ((int64_t)1 << 34) /* width x mlp_dim */
#define DIM_MAX_IMAGE 4096                  /* image_size, and so patch_size */
#define DIM_MAX_VOCAB (1 << 24)
#define DIM_MAX_ACTION_DIM 4096

/* Which model the tensors hold (never config.json or the path): Pi0.5 has adaptive norms in the expert
 * and time_mlp_in; the reason, for `pi0 inspect`. */
pi0_model_kind config_model_kind(const st_file *file, const char *prefix);
const char *config_model_kind_reason(pi0_model_kind kind);

/* `config_path` may name a missing file: defaults (H = 50; 48 prompt tokens for Pi0, 200 for Pi0.5) then
 * apply. *horizon_given says whether config.json gave action_horizon. */
pi0_status config_derive_dims(const st_file *file, const char *prefix, const char *config_path, pi0_dims *dims,
                              int *horizon_given, pi0_error *err);

/* Checks that dims describe a model the engine can run: each dim within its limit above (the message names the
 * dim and the limit), heads that split the widths, stacks that can attend jointly. */
pi0_status dims_validate(const pi0_dims *dims, pi0_error *err);

/* Reads every dim from a config.json-style file (the `dims` block config_write writes, and its "model":
 * "pi0" or "pi05"; the real dims of that model fill whatever it leaves out). For random models of any size. */
pi0_status config_load_dims(const char *path, pi0_dims *dims, pi0_error *err);

/* {width, depth, mlp_dim, num_heads, num_kv_heads, head_dim} of one stack, as config.json holds it. */
json_t *config_stack_json(const pi0_stack_dims *d);

/* Writes config.json in openpi's format plus a `dims` block. */
pi0_status config_write(const pi0_dims *dims, const char *path, int bf16, pi0_error *err);

#endif
