/*
 * pi0_policy.h - openpi's Policy.infer in C: raw robot observations in, robot actions out.
 *
 * The layer a robot program embeds. An observation is a set of named fields, exactly what an openpi client
 * puts in its dict: camera frames (uint8 or float in [0, 1], HWC or CHW, any size), state vectors and a
 * prompt string. The policy's adapter says which key is which camera and which keys make up the state;
 * then, as openpi does (docs/policy.md): images resized with padding to the model's input, the state
 * normalized with the checkpoint's norm_stats.json (and, for Pi0.5, written into the prompt), the prompt
 * tokenized, sample_actions run for the whole batch at once, the actions unnormalized and cut to the
 * robot's action dims, in float64.
 *
 *     pi0_policy *policy;
 *     pi0_error err;
 *     pi0_policy_options o = {.checkpoint = "/models/pi05_droid", .adapter = "droid"};
 *     if (pi0_policy_open(&o, &policy, &err)) { fprintf(stderr, "%s\n", err.message); return 1; }
 *     pi0_observation obs = {0};
 *     pi0_observation_add_array(&obs, "observation/exterior_image_1_left", PI0_DTYPE_U8, 3,
 *                               (int64_t[]){180, 320, 3}, frame, &err);   // ... the other keys alike
 *     pi0_observation_add_string(&obs, "prompt", "put the marker in the cup", &err);
 *     const pi0_observation *batch[1] = {&obs};
 *     pi0_policy_result r;
 *     pi0_policy_infer(policy, batch, NULL, 1, &r, NULL, &err);   // r.actions: (r.horizon, r.action_dims)
 *
 * Everything here is in libpi0; nothing needs the server's libraries. The same conventions as pi0.h:
 * errors as codes plus a message, no printing, no exit.
 */
#ifndef PI0_POLICY_H
#define PI0_POLICY_H

#include <stddef.h>
#include <stdint.h>

#include "pi0.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- observations ------------------------------------------------------------------------------------- */

/* numpy's dtypes as openpi clients send them. */
typedef enum {
    PI0_DTYPE_BOOL, PI0_DTYPE_U8, PI0_DTYPE_I8, PI0_DTYPE_U16, PI0_DTYPE_I16, PI0_DTYPE_U32, PI0_DTYPE_I32,
    PI0_DTYPE_U64, PI0_DTYPE_I64, PI0_DTYPE_F16, PI0_DTYPE_F32, PI0_DTYPE_F64,
} pi0_dtype;

/* Bytes per element; numpy's dtype string ("|b1", "|u1", "<f4", ...) on a little-endian host. */
PI0_API size_t pi0_dtype_size(pi0_dtype dtype);
PI0_API const char *pi0_dtype_str(pi0_dtype dtype);

#define PI0_MAX_NDIM 8

typedef enum { PI0_FIELD_ARRAY, PI0_FIELD_STRING } pi0_field_kind;

/*
 * One named value of an observation. Keys of nested dicts are joined with "/" (openpi's flat LIBERO key
 * "observation/image" and ALOHA's nested {"images": {"cam_high": ...}} are both looked up by path).
 * ARRAY: `data` holds product(shape) elements of `dtype` in host byte order (ndim 0: a scalar), 64-byte
 * aligned; BOOL bytes are 0 or 1; F16 holds IEEE half bits. STRING: `string` is NUL-terminated UTF-8.
 */
typedef struct {
    char *key;
    pi0_field_kind kind;
    pi0_dtype dtype;
    int ndim;
    int64_t shape[PI0_MAX_NDIM];
    void *data;
    char *string;
} pi0_field;

/* A set of fields; start from {0}, fill with the functions below, release with pi0_observation_free. */
typedef struct {
    pi0_field *fields;
    int count, capacity;
} pi0_observation;

/* Adds a copy of an array (ndim 0..PI0_MAX_NDIM, dims >= 0) under `key`. A key already present, a bad
 * dtype or shape: PI0_ERR_INVALID_ARGUMENT. */
PI0_API pi0_status pi0_observation_add_array(pi0_observation *obs, const char *key, pi0_dtype dtype, int ndim,
                                             const int64_t *shape, const void *data, pi0_error *err);
/* Adds a copy of a NUL-terminated UTF-8 string under `key`. */
PI0_API pi0_status pi0_observation_add_string(pi0_observation *obs, const char *key, const char *value,
                                              pi0_error *err);
/* The field named `key`, or NULL. */
PI0_API const pi0_field *pi0_observation_find(const pi0_observation *obs, const char *key);
/* Number of elements (product of the shape; 1 for ndim 0; 0 for a malformed shape). */
PI0_API int64_t pi0_field_numel(const pi0_field *field);
/* Frees every field and leaves *obs empty. */
PI0_API void pi0_observation_free(pi0_observation *obs);

/* ---- the policy ---------------------------------------------------------------------------------------- */

typedef enum {
    PI0_NORM_DEFAULT = 0, /* the model's own: z-score for Pi0, quantile for Pi0.5 (as openpi's configs) */
    PI0_NORM_ZSCORE,      /* (x - mean) / (std + 1e-6) */
    PI0_NORM_QUANTILE,    /* (x - q01) / (q99 - q01 + 1e-6) * 2 - 1: openpi's use_quantile_norm */
} pi0_norm_mode;

typedef struct {
    const char *checkpoint; /* model.safetensors + config.json (+ assets/<id>/norm_stats.json) */
    const char *adapter;    /* "libero", "droid", or a generic adapter JSON file (docs/policy.md#adapters) */
    const char *tokenizer;  /* NULL: <checkpoint>/paligemma_tokenizer.model, then openpi's download cache
                               ($OPENPI_DATA_HOME, else ~/.cache/openpi)/big_vision/paligemma_tokenizer.model */
    const char *norm_stats; /* NULL: the one norm_stats.json anywhere under <checkpoint>/assets/ */
    pi0_norm_mode norm_mode;
    int num_steps;          /* Euler steps in 1..PI0_MAX_STEPS; 0 = 10 */
    int horizon;            /* 1..PI0_MAX_HORIZON; 0 = config.json's action_horizon, else the adapter's for this
                               model, else 50. Negative values are refused (PI0_ERR_INVALID_ARGUMENT). */
    pi0_options model;      /* backend, threads, load progress */
} pi0_policy_options;

typedef struct pi0_policy pi0_policy;

/* Loads the adapter, tokenizer and norm stats (first, so that a typo fails fast), then the checkpoint;
 * each failure names its file. */
PI0_API pi0_status pi0_policy_open(const pi0_policy_options *options, pi0_policy **out, pi0_error *err);
PI0_API void pi0_policy_free(pi0_policy *policy);

PI0_API const pi0_model *pi0_policy_model(const pi0_policy *policy);
PI0_API int pi0_policy_horizon(const pi0_policy *policy);
PI0_API int pi0_policy_action_dims(const pi0_policy *policy);  /* what each action step holds for the robot */
PI0_API const char *pi0_policy_adapter_name(const pi0_policy *policy);
PI0_API pi0_norm_mode pi0_policy_norm_mode(const pi0_policy *policy); /* ZSCORE or QUANTILE, never DEFAULT */
PI0_API int pi0_policy_discrete_state(const pi0_policy *policy); /* 1: the state is written into the prompt */

typedef struct {
    pi0_error error;    /* error.status == PI0_OK when `actions` holds the answer */
    int horizon, action_dims;
    double *actions;    /* (horizon, action_dims), owned; float64 like openpi's numpy output */
    double prepare_ms;  /* this observation's preprocessing (images, state, prompt) */
    double model_ms;    /* the batch's sample_actions, which this observation shared */
} pi0_policy_result;

/*
 * Runs `count` (0..PI0_MAX_BATCH) observations as one batch. results[i] is overwritten (free an earlier
 * result first) with observation i's actions or its own error: a bad observation (missing key, wrong
 * shape or dtype, non-finite state...) fails alone, with a message naming the key, and the others still
 * run. A state whose normalized values are not finite in float32 (the model's input) fails its observation
 * (PI0_ERR_INVALID_ARGUMENT), and so do actions that are not all finite (PI0_ERR_NUMERIC): a robot never
 * receives NaN or infinity. Returns non-OK only when the call as a whole failed (bad arguments, out of memory, a backend
 * error), and then every observation that was in the batch carries that error too; so a caller may look
 * at results[i].error alone.
 *
 * Noise: observation i's noise is drawn from noise_seeds[i] (NULL: seed 0 for all) and depends on that
 * seed only, so an observation gets the same noise alone or batched, and alone exactly the actions
 * pi0_sample_actions gives for a batch of one with that noise_seed. `infer_ms` (may be NULL) gets the
 * wall time of the whole call, preprocessing included. A policy is used by one thread at a time.
 */
PI0_API pi0_status pi0_policy_infer(pi0_policy *policy, const pi0_observation *const *observations,
                                    const uint64_t *noise_seeds, int count, pi0_policy_result *results,
                                    double *infer_ms, pi0_error *err);
PI0_API void pi0_policy_result_free(pi0_policy_result *result);

/*
 * The two halves of pi0_policy_infer, for a server that prepares requests while the model runs others.
 * pi0_policy_prepare checks and preprocesses one observation (frames made uint8 HWC, state normalized,
 * prompt tokenized; the model resizes the frames) into a new pi0_prepared; it only reads the policy, so any number of threads may call it at
 * once, also while another runs pi0_policy_infer_prepared. A bad observation gives a non-OK status and
 * still a pi0_prepared (NULL only when out of memory) that carries the error, so that passing it on makes
 * its result fail alone. pi0_policy_infer_prepared runs them as one batch like pi0_policy_infer, and is
 * used by one thread at a time; it does not free them. A prepared observation is one block of page-locked memory
 * (pi0_host_alloc's, so the CUDA backend sends its frames from where they are) from the policy's pool, to which
 * pi0_prepared_free returns it (any thread; also after pi0_policy_free, which frees the pool's blocks).
 */
typedef struct pi0_prepared pi0_prepared;
PI0_API pi0_status pi0_policy_prepare(const pi0_policy *policy, const pi0_observation *observation,
                                      pi0_prepared **out, pi0_error *err);
PI0_API pi0_status pi0_policy_infer_prepared(pi0_policy *policy, const pi0_prepared *const *prepared,
                                             const uint64_t *noise_seeds, int count, pi0_policy_result *results,
                                             pi0_error *err);
PI0_API void pi0_prepared_free(pi0_prepared *prepared);

/*
 * Runs dummy batches of every shape a call of 1..max_batch observations can take (batch size x prompt
 * length rounded up to 32 tokens), so that on a GPU every CUDA graph is captured and every GEMM tuned
 * before the first real request rather than on its path. `seconds` (may be NULL) gets how long it took.
 */
PI0_API pi0_status pi0_policy_warmup(pi0_policy *policy, int max_batch, double *seconds, pi0_error *err);

#ifdef __cplusplus
}
#endif
#endif /* PI0_POLICY_H */
