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

/* Which model the tensors hold (never config.json or the path): Pi0.5 has adaptive norms in the expert
 * and time_mlp_in; the reason, for `pi0 inspect`. */
pi0_model_kind config_model_kind(const st_file *file, const char *prefix);
const char *config_model_kind_reason(pi0_model_kind kind);

/* `config_path` may name a missing file: defaults (H = 50; 48 prompt tokens for Pi0, 200 for Pi0.5) then
 * apply. *horizon_given says whether config.json gave action_horizon. */
pi0_status config_derive_dims(const st_file *file, const char *prefix, const char *config_path, pi0_dims *dims,
                              int *horizon_given, pi0_error *err);

/* Checks that dims describe a model the engine can run. */
pi0_status dims_validate(const pi0_dims *dims, pi0_error *err);

/* Reads every dim from a config.json-style file (the `dims` block config_write writes, and its "model":
 * "pi0" or "pi05"; the real dims of that model fill whatever it leaves out). For random models of any size. */
pi0_status config_load_dims(const char *path, pi0_dims *dims, pi0_error *err);

/* {width, depth, mlp_dim, num_heads, num_kv_heads, head_dim} of one stack, as config.json holds it. */
json_t *config_stack_json(const pi0_stack_dims *d);

/* Writes config.json in openpi's format plus a `dims` block. */
pi0_status config_write(const pi0_dims *dims, const char *path, int bf16, pi0_error *err);

#endif
