/*
 * policy.h - openpi's Policy.infer: raw robot observations in, robot actions out (PI0_SPEC section 6).
 *
 * For each observation: the adapter picks the cameras, state and prompt; images go through
 * pi0_image_preprocess; the state is normalized with norm_stats["state"] and zero-padded to
 * action_dim; the prompt is tokenized (pi0_tokenize_prompt, max_token_len); then one batched
 * pi0_sample_actions call runs every valid observation together; actions are unnormalized with
 * norm_stats["actions"] and cut to the adapter's action_dims.
 *
 * A bad observation (missing key, wrong shape or dtype, too long a state) fails alone: its result
 * carries the error and the others in the batch still run.
 *
 * Noise: each observation has its own seed, and its noise depends on that seed only (not on its
 * position in the batch), so the same observation and seed give the same actions whether it runs
 * alone (`pi0 infer`) or batched with others (`pi0 serve`).
 *
 * A policy is used by one thread at a time (it owns the model).
 */
#ifndef PI0_POLICY_POLICY_H
#define PI0_POLICY_POLICY_H

#include <stdint.h>

#include "io/msgpack_numpy.h"
#include "pi0.h"
#include "policy/adapter.h"
#include "policy/norm_stats.h"
#include "policy/tokenizer.h"

typedef struct {
    const char *checkpoint; /* model.safetensors + config.json (+ assets/<id>/norm_stats.json) */
    const char *adapter;    /* "libero", "droid" or a JSON file */
    const char *tokenizer;  /* NULL: <checkpoint>/paligemma_tokenizer.model, then
                               ~/.cache/openpi/big_vision/paligemma_tokenizer.model */
    const char *norm_stats; /* NULL: the one norm_stats.json under <checkpoint>/assets/ */
    pi0_norm_mode norm_mode;
    int num_steps;          /* 0 = 10 */
    int horizon;            /* 0 = the checkpoint's action_horizon */
    pi0_options model;      /* backend, threads, load progress */
} pi0_policy_options;

typedef struct pi0_policy pi0_policy;

/* Loads the checkpoint, adapter, tokenizer and norm stats, each failure naming the file. */
pi0_status pi0_policy_open(const pi0_policy_options *opts, pi0_policy **out, pi0_error *err);
/* The same from parts already loaded (tests, embedding). The policy takes ownership of all four. */
pi0_status pi0_policy_create(pi0_model *model, pi0_adapter *adapter, pi0_tokenizer *tokenizer,
                             pi0_norm_stats *norm_stats, const pi0_policy_options *opts, pi0_policy **out,
                             pi0_error *err);
void pi0_policy_free(pi0_policy *p);

const pi0_model *pi0_policy_model(const pi0_policy *p);
const pi0_adapter *pi0_policy_adapter(const pi0_policy *p);
int pi0_policy_horizon(const pi0_policy *p);

typedef struct {
    pi0_error error;  /* error.status == PI0_OK when `actions` holds the answer */
    int horizon, action_dims;
    double *actions;  /* (horizon, action_dims), owned; float64 like openpi's numpy output */
} pi0_policy_result;

/*
 * Runs `count` observations as one batch. results[i] gets observation i's actions or its own error.
 * Returns non-OK only when the batch as a whole failed (out of memory, backend error); then every
 * result carries that error too. `infer_ms` (may be NULL) gets the wall time of the whole call.
 */
pi0_status pi0_policy_infer(pi0_policy *p, const pi0_observation *const *obs, const uint64_t *noise_seeds,
                            int count, pi0_policy_result *results, double *infer_ms, pi0_error *err);
void pi0_policy_result_free(pi0_policy_result *r);

#endif
