/*
 * policy.h - openpi's Policy.infer: raw robot observations in, robot actions out (PI0_SPEC section 6).
 *
 * For each observation: the adapter picks the cameras, state and prompt; images go through
 * pi0_image_preprocess; the state is normalized with norm_stats["state"] and zero-padded to
 * action_dim; the prompt is tokenized (pi0_tokenize_prompt, max_token_len); then one batched
 * pi0_sample_actions call runs every valid observation together; actions are unnormalized with
 * norm_stats["actions"] and cut to the adapter's action_dims.
 *
 * Inputs accepted per observation: camera images of 3 dims, uint8 or float32/float64 in [0, 1], HWC or
 * CHW (CHW when shape[0] == 3, as openpi decides), any size up to 4096x4096; state fields of 0 or 1 dims
 * and any numeric dtype, finite, together at most min(action_dim, len(norm stats "state")) values; the
 * prompt a string (or the adapter's default_prompt). Numbers follow numpy's promotions in openpi's
 * transforms: the state is normalized in float64 from its own dtype and rounded to float32 once; actions
 * are unnormalized in float64 (quantile mode's `(x + 1) / 2` in float32, as numpy computes it).
 *
 * A bad observation (missing key, string where an array belongs, wrong ndim/shape/channels/dtype, empty
 * or oversized image, non-finite or too long a state, prompt token ids outside the model's vocabulary)
 * fails alone: its result carries PI0_ERR_INVALID_ARGUMENT and a message naming the key and the problem,
 * and the others in the batch still run.
 *
 * Noise: each observation has its own seed, and its noise depends on that seed only (not on its
 * position in the batch): exactly the noise pi0_sample_actions draws for a batch of one with that
 * noise_seed. So an observation alone (`pi0 infer --seed S`, or a server batch of one) gives the same
 * bits as pi0_sample_actions would; inside a larger batch it gets the same noise, and the same actions
 * up to the backend's batch-size rounding (the CPU's OpenBLAS GEMMs round rows differently for different
 * row counts: about 1e-5 relative on the tiny test model). The same batch with the same seeds always
 * gives the same bits.
 *
 * A policy is used by one thread at a time (it owns the model and reuses its batch buffers).
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
    const char *tokenizer;  /* NULL: <checkpoint>/paligemma_tokenizer.model, then openpi's download cache
                               ($OPENPI_DATA_HOME, else ~/.cache/openpi)/big_vision/paligemma_tokenizer.model */
    const char *norm_stats; /* NULL: the one norm_stats.json anywhere under <checkpoint>/assets/ (several or
                               none: an error); it must have "state" and "actions" entries */
    pi0_norm_mode norm_mode; /* PI0_NORM_ZSCORE for Pi0 (the zero value) */
    int num_steps;          /* 0 = 10; at most 10000 */
    int horizon;            /* 0 = the checkpoint's action_horizon; at most 4096 */
    pi0_options model;      /* backend, threads, load progress */
} pi0_policy_options;

typedef struct pi0_policy pi0_policy;

/* Loads the adapter, tokenizer and norm stats (first, so that a typo fails fast), then the checkpoint with
 * opts->model (backend, progress); each failure names the file. */
pi0_status pi0_policy_open(const pi0_policy_options *opts, pi0_policy **out, pi0_error *err);
/* The same from parts already loaded (tests, embedding). The policy takes ownership of all four, also when
 * it fails (it frees them then): model, adapter and tokenizer as pointers; norm_stats' contents are moved
 * and *norm_stats is left empty. `opts` may be NULL; only norm_mode, num_steps and horizon are read. */
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
 * Runs `count` (0..4096) observations as one batch. results[i] is overwritten (free an earlier result
 * first) with observation i's actions or its own error; horizon and action_dims are set either way, and
 * actions is NULL on error. obs[i] == NULL fails that observation alone. noise_seeds may be NULL (seed 0
 * for all). Returns non-OK only when the call as a whole failed: bad arguments (NULL policy or
 * observations, count out of range: every result that can be written carries the error), or out of memory
 * for the batch or a backend error (every observation that was in the batch carries that error; those that
 * had failed alone keep theirs). So a caller may look at results[i].error alone. `infer_ms` (may be NULL) gets the wall time of the whole call,
 * preprocessing included.
 */
pi0_status pi0_policy_infer(pi0_policy *p, const pi0_observation *const *obs, const uint64_t *noise_seeds,
                            int count, pi0_policy_result *results, double *infer_ms, pi0_error *err);
void pi0_policy_result_free(pi0_policy_result *r);

#endif
