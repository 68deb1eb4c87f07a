/*
 * policy.h - what the library knows of a policy beyond pi0_policy.h: building one from parts already
 * loaded (tests, and programs that bring their own adapter, tokenizer or norm stats).
 *
 * pi0_policy_infer, per observation, in openpi's order (docs/policy.md): the adapter picks the cameras,
 * state and prompt; images go through pi0_image_preprocess; the state is normalized with
 * norm_stats["state"] (float64 math from the field's own dtype, rounded to float32 once) and zero-padded
 * to action_dim; the prompt is tokenized (Pi0.5 with the discrete state: pi0_tokenize_prompt_with_state);
 * then one batched pi0_sample_actions call runs every valid observation together; actions are
 * unnormalized with norm_stats["actions"] (float64; quantile mode's `(x + 1) / 2` in float32, as numpy
 * computes it) and cut to the adapter's action_dims.
 *
 * Accepted per observation: camera images of 3 dims, uint8 or float32/float64 in [0, 1], HWC or CHW (CHW
 * when shape[0] == 3, as openpi decides), up to PI0_MAX_IMAGE_SIDE on a side; state fields of 0 or 1 dims
 * and any numeric dtype, finite, together at most min(action_dim, len(norm stats "state")) values; the
 * prompt a string (or the adapter's default_prompt).
 */
#ifndef PI0_POLICY_POLICY_H
#define PI0_POLICY_POLICY_H

#include "pi0_policy.h"
#include "policy/adapter.h"
#include "policy/norm_stats.h"
#include "policy/tokenizer.h"

/* A policy from parts already loaded. It takes ownership of all four, also when it fails (it frees them
 * then): model, adapter and tokenizer as pointers; norm_stats' contents are moved and *norm_stats is left
 * empty. `opts` may be NULL; only norm_mode, num_steps and horizon are read. */
pi0_status pi0_policy_create(pi0_model *model, pi0_adapter *adapter, pi0_tokenizer *tokenizer,
                             pi0_norm_stats *norm_stats, const pi0_policy_options *opts, pi0_policy **out,
                             pi0_error *err);

const pi0_adapter *pi0_policy_adapter(const pi0_policy *p);

/* The blocks waiting in the policy's pool for the next prepared observation (policy.c's block_pool). */
int pi0_policy_pooled_blocks(const pi0_policy *p);

#endif
