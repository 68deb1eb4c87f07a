/*
 * policy.c - openpi's Policy.infer (docs/policy.md) around pi0_sample_actions.
 *
 * Per observation, in openpi's order: the robot's input transform (adapter: which key is which camera,
 * which keys make the state, the frames as uint8 HWC), Normalize (state), InjectDefaultPrompt, TokenizePrompt,
 * PadStatesAndActions; then one batched sample_actions, whose backend does ResizeImages and the [-1, 1]
 * scaling (pi0_batch.frames: on the GPU with CUDA); then
 * Unnormalize (actions) and the robot's output transform (the first action_dims). The numbers follow
 * numpy's: the state is normalized in float64 from its own dtype and rounded to float32 once (as JAX
 * does when it takes the float64 array); actions are unnormalized in float64 and stay float64.
 */
#include "policy/policy.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/checkpoint.h"
#include "model/flow.h"
#include "model/model.h"
#include "model/image.h"
#include "util/clock.h"
#include "util/error.h"
#include "util/half.h"

#define MAX_ASSET_DEPTH 8   /* how deep under assets/ to look for norm_stats.json */

/*
 * Where prepared observations live: blocks of pi0_host_alloc's memory, page-locked when there is a GPU, so that the
 * CUDA backend sends their frames to the device from where they are instead of copying them into its staging buffer
 * first (0.05 ms a call for two 256 x 256 frames, 0.2 ms for two 480 x 640, on an H200: bench/NOTES.md, session 39).
 * The driver is slow to lock and unlock memory (and cudaFreeHost waits for the device), so a freed block waits here
 * for the next observation, up to POOL_BLOCKS of them. The policy and every block out of the pool hold a reference,
 * so that an observation freed after pi0_policy_free still has a pool to go back to.
 */
#define POOL_BLOCKS 16

typedef struct {
    pthread_mutex_t lock;
    int refs;  /* the policy's, and one per block out of the pool */
    int count; /* free blocks */
    void *block[POOL_BLOCKS];
    size_t size[POOL_BLOCKS];
} block_pool;

static block_pool *pool_new(void) {
    block_pool *pool = calloc(1, sizeof *pool);
    if (pool && pthread_mutex_init(&pool->lock, NULL)) free(pool), pool = NULL;
    if (pool) pool->refs = 1;
    return pool;
}

/* Drops a reference; the last one frees the pool and its free blocks. Called with the lock held. */
static void pool_unref_locked(block_pool *pool) {
    if (--pool->refs > 0) {
        pthread_mutex_unlock(&pool->lock);
        return;
    }
    for (int i = 0; i < pool->count; i++) pi0_host_free(pool->block[i]);
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_destroy(&pool->lock);
    free(pool);
}

static void pool_release(block_pool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->lock);
    pool_unref_locked(pool);
}

/* A block of at least `bytes` (its size in *size): the smallest free one that holds them, else a new one. */
static void *pool_get(block_pool *pool, size_t bytes, size_t *size) {
    pthread_mutex_lock(&pool->lock);
    int best = -1;
    for (int i = 0; i < pool->count; i++)
        if (pool->size[i] >= bytes && (best < 0 || pool->size[i] < pool->size[best])) best = i;
    void *block = NULL;
    if (best >= 0) {
        block = pool->block[best], *size = pool->size[best];
        pool->count--;
        pool->block[best] = pool->block[pool->count], pool->size[best] = pool->size[pool->count];
    }
    pool->refs++;
    pthread_mutex_unlock(&pool->lock);
    if (!block && (block = pi0_host_alloc(bytes))) *size = bytes;
    if (!block) pool_release(pool);
    return block;
}

/* A block back to the pool (freed when the pool is full or closing). */
static void pool_put(block_pool *pool, void *block, size_t size) {
    pthread_mutex_lock(&pool->lock);
    if (pool->count < POOL_BLOCKS && pool->refs > 1) {
        pool->block[pool->count] = block, pool->size[pool->count] = size;
        pool->count++;
        block = NULL;
    }
    pool_unref_locked(pool);
    pi0_host_free(block);
}

static int pool_count(block_pool *pool) {
    pthread_mutex_lock(&pool->lock);
    int count = pool->count;
    pthread_mutex_unlock(&pool->lock);
    return count;
}

/* One observation made model input (pi0_policy_prepare): one block of the policy's pool holding the model cameras'
 * frames, the prompt and the state. The frames are openpi's uint8 HWC, as the robot sent them; the backend resizes
 * them (pi0_batch.frames), the CUDA backend on the GPU. */
struct pi0_prepared {
    block_pool *pool;      /* where the block goes back (pi0_prepared_free) */
    size_t block_size;
    pi0_error error;       /* error.status != PI0_OK: this observation failed; nothing else is set */
    pi0_frame frames[PI0_ADAPTER_MAX_CAMERAS]; /* per model camera; pixels NULL for a missing optional camera */
    uint8_t *camera_valid; /* [cameras] */
    int32_t *prompt_ids;   /* [max_token_len] */
    uint8_t *prompt_mask;  /* [max_token_len] */
    int prompt_valid;      /* valid tokens, at the front */
    float *state;          /* [action_dim] normalized and zero-padded, what the model takes */
    double *state_f64;     /* [action_dim] the normalized state in float64, as the discrete state bins it */
    double prepare_ms;
};

struct pi0_policy {
    pi0_model *model;
    pi0_adapter *adapter;
    pi0_tokenizer *tokenizer;
    pi0_norm_stats stats;
    const pi0_norm_entry *state_stats, *action_stats;
    pi0_norm_mode mode;
    int discrete_state; /* Pi0.5: the normalized state is written into the prompt */
    int horizon, num_steps;
    int num_cameras;    /* the model's cameras: the adapter's cameras that exist (absent ones are never computed) */
    int camera[PI0_ADAPTER_MAX_CAMERAS]; /* model camera k is the adapter's camera camera[k] */
    /* the batch buffers, kept between calls; room for `capacity` observations */
    int capacity;
    pi0_frame *frames;  /* (capacity, cameras): the prepared observations' (not owned) */
    uint8_t *image_masks, *prompt_mask;
    int32_t *prompt_ids;
    float *state, *noise, *actions;
    int *source;        /* batch slot -> index of the observation */
    pi0_prepared **owned; /* pi0_policy_infer's own prepared observations */
    block_pool *pool;     /* the prepared observations' blocks */
};

/* ---- opening ------------------------------------------------------------------------------------------- */

static void free_buffers(pi0_policy *p) {
    free(p->frames), free(p->image_masks), free(p->prompt_mask), free(p->prompt_ids);
    free(p->state), free(p->noise), free(p->actions), free(p->source), free(p->owned);
    p->frames = NULL, p->image_masks = p->prompt_mask = NULL, p->prompt_ids = NULL;
    p->state = p->noise = p->actions = NULL, p->source = NULL, p->owned = NULL;
    p->capacity = 0;
}

void pi0_policy_free(pi0_policy *p) {
    if (!p) return;
    free_buffers(p);
    pi0_model_free(p->model);
    pi0_adapter_free(p->adapter);
    pi0_tokenizer_free(p->tokenizer);
    pi0_norm_stats_free(&p->stats);
    pool_release(p->pool);
    free(p);
}

const pi0_model *pi0_policy_model(const pi0_policy *p) { return p ? p->model : NULL; }
const pi0_adapter *pi0_policy_adapter(const pi0_policy *p) { return p ? p->adapter : NULL; }
int pi0_policy_pooled_blocks(const pi0_policy *p) { return p ? pool_count(p->pool) : 0; }
int pi0_policy_horizon(const pi0_policy *p) { return p ? p->horizon : 0; }
int pi0_policy_action_dims(const pi0_policy *p) { return p ? p->adapter->action_dims : 0; }
const char *pi0_policy_adapter_name(const pi0_policy *p) { return p && p->adapter->name ? p->adapter->name : "?"; }
pi0_norm_mode pi0_policy_norm_mode(const pi0_policy *p) { return p ? p->mode : PI0_NORM_DEFAULT; }
int pi0_policy_discrete_state(const pi0_policy *p) { return p ? p->discrete_state : 0; }

/* The horizon: the caller's, else config.json's, else what openpi's config for this robot uses, else the
 * default (50). */
static int resolve_horizon(const pi0_policy_options *opts, const pi0_model *m, const pi0_adapter *a) {
    if (opts && opts->horizon) return opts->horizon;
    if (m->horizon_given) return m->dims.action_horizon;
    return a->horizon[m->dims.kind] ? a->horizon[m->dims.kind] : m->dims.action_horizon;
}

/* The normalization a model asks for when the caller leaves it to the model: openpi's configs use
 * quantiles for every model but Pi0. */
static pi0_norm_mode resolve_mode(pi0_norm_mode asked, pi0_model_kind kind) {
    if (asked != PI0_NORM_DEFAULT) return asked;
    return kind == PI0_MODEL_PI0 ? PI0_NORM_ZSCORE : PI0_NORM_QUANTILE;
}

/* Norm stats need a "state" and an "actions" entry, with q01/q99 in quantile mode. */
static pi0_status check_stats(const pi0_norm_stats *stats, pi0_norm_mode mode, pi0_model_kind kind, pi0_error *err) {
    const char *keys[2] = {"state", "actions"};
    for (int k = 0; k < 2; k++) {
        const pi0_norm_entry *e = pi0_norm_stats_find(stats, keys[k]);
        if (!e) return pi0_fail(err, PI0_ERR_FORMAT, "norm stats have no \"%s\" entry", keys[k]);
        if (mode == PI0_NORM_QUANTILE && (!e->q01 || !e->q99))
            return pi0_fail(err, PI0_ERR_FORMAT, "quantile normalization%s needs q01 and q99, which norm stats \"%s\" lack",
                            kind == PI0_MODEL_PI05 ? " (what Pi0.5 checkpoints use, as openpi's configs do)" : "",
                            keys[k]);
    }
    return PI0_OK;
}

pi0_status pi0_policy_create(pi0_model *model, pi0_adapter *adapter, pi0_tokenizer *tokenizer,
                             pi0_norm_stats *norm_stats, const pi0_policy_options *opts, pi0_policy **out,
                             pi0_error *err) {
    pi0_policy *p = calloc(1, sizeof *p);
    if (p) {
        p->model = model, p->adapter = adapter, p->tokenizer = tokenizer;
        if (norm_stats) p->stats = *norm_stats, memset(norm_stats, 0, sizeof *norm_stats);
    } else {
        pi0_model_free(model), pi0_adapter_free(adapter), pi0_tokenizer_free(tokenizer), pi0_norm_stats_free(norm_stats);
    }
    if (out) *out = NULL;
    pi0_status st = PI0_OK;
    if (p && !(p->pool = pool_new())) pi0_policy_free(p), p = NULL;
    if (!p) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for the policy");
    if (!model || !adapter || !tokenizer || !norm_stats || !out) {
        st = pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "policy: NULL model, adapter, tokenizer, norm stats or output");
        goto fail;
    }
    const pi0_dims *d = pi0_model_dims(model);
    p->mode = resolve_mode(opts ? opts->norm_mode : PI0_NORM_DEFAULT, d->kind);
    p->horizon = resolve_horizon(opts, model, adapter);
    p->discrete_state = adapter->discrete_state < 0 ? d->kind == PI0_MODEL_PI05 : adapter->discrete_state;
    if (p->discrete_state && d->kind != PI0_MODEL_PI05) {
        st = pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "adapter %s asks for the discrete state in the prompt, which only "
                      "Pi0.5 checkpoints read; this one is Pi0", adapter->name ? adapter->name : "(unnamed)");
        goto fail;
    }
    p->num_steps = opts && opts->num_steps ? opts->num_steps : 10;
    if (p->mode != PI0_NORM_ZSCORE && p->mode != PI0_NORM_QUANTILE) {
        st = pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "policy: unknown normalization mode %d", (int)p->mode);
        goto fail;
    }
    if (p->horizon < 1 || p->horizon > PI0_MAX_HORIZON || p->num_steps < 1 || p->num_steps > PI0_MAX_STEPS) {
        st = pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "policy: horizon %d or steps %d outside 1..%d / 1..%d", p->horizon,
                      p->num_steps, PI0_MAX_HORIZON, PI0_MAX_STEPS);
        goto fail;
    }
    const char *name = adapter->name ? adapter->name : "(unnamed)";
    if (adapter->num_cameras < 0 || adapter->num_cameras > PI0_ADAPTER_MAX_CAMERAS || adapter->num_state_keys < 0 ||
        adapter->num_state_keys > PI0_ADAPTER_MAX_STATE_KEYS || (!adapter->prompt_key && !adapter->default_prompt)) {
        st = pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "adapter %s: bad camera or state key count, or no prompt source",
                      name);
        goto fail;
    }
    for (int c = 0; c < adapter->num_cameras; c++)
        if (adapter->camera_keys[c]) p->camera[p->num_cameras++] = c;
    if (adapter->action_dims < 1 || adapter->action_dims > d->action_dim) {
        st = pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "adapter %s returns %d action dims, but the model has %d", name,
                      adapter->action_dims, d->action_dim);
        goto fail;
    }
    if ((st = check_stats(&p->stats, p->mode, d->kind, err))) goto fail;
    p->state_stats = pi0_norm_stats_find(&p->stats, "state");
    p->action_stats = pi0_norm_stats_find(&p->stats, "actions");
    *out = p;
    return PI0_OK;
fail:
    pi0_policy_free(p);
    return st;
}

static int is_file(const char *path) {
    struct stat s;
    return stat(path, &s) == 0 && S_ISREG(s.st_mode);
}

/* The tokenizer: the given path, else <checkpoint>/paligemma_tokenizer.model, else openpi's download cache
 * ($OPENPI_DATA_HOME or ~/.cache/openpi, then big_vision/paligemma_tokenizer.model). */
static pi0_status open_tokenizer(const pi0_policy_options *o, pi0_tokenizer **out, pi0_error *err) {
    if (o->tokenizer) return pi0_tokenizer_load(o->tokenizer, out, err);
    char in_checkpoint[4096], in_cache[4096] = "";
    snprintf(in_checkpoint, sizeof in_checkpoint, "%s/paligemma_tokenizer.model", o->checkpoint);
    const char *data_home = getenv("OPENPI_DATA_HOME"), *home = getenv("HOME");
    if (data_home && data_home[0])
        snprintf(in_cache, sizeof in_cache, "%s/big_vision/paligemma_tokenizer.model", data_home);
    else if (home && home[0])
        snprintf(in_cache, sizeof in_cache, "%s/.cache/openpi/big_vision/paligemma_tokenizer.model", home);
    if (is_file(in_checkpoint)) return pi0_tokenizer_load(in_checkpoint, out, err);
    if (in_cache[0] && is_file(in_cache)) return pi0_tokenizer_load(in_cache, out, err);
    return pi0_fail(err, PI0_ERR_IO, "no tokenizer: looked for %s%s%s (give the path with --tokenizer)", in_checkpoint,
                    in_cache[0] ? " and " : "", in_cache);
}

typedef struct {
    char **paths;
    int count, capacity;
} path_list;

static int path_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Collects every file named norm_stats.json under `dir` (openpi asset ids may contain '/'). -1: out of memory. */
static int find_norm_stats(const char *dir, int depth, path_list *found) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int rc = 0;
    for (struct dirent *e; rc == 0 && (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        size_t n = strlen(dir) + strlen(e->d_name) + 2;
        char *path = malloc(n);
        if (!path) { rc = -1; break; }
        snprintf(path, n, "%s/%s", dir, e->d_name);
        struct stat s;
        int exists = stat(path, &s) == 0;
        if (exists && S_ISDIR(s.st_mode) && depth < MAX_ASSET_DEPTH) {
            rc = find_norm_stats(path, depth + 1, found);
        } else if (exists && S_ISREG(s.st_mode) && !strcmp(e->d_name, "norm_stats.json")) {
            if (found->count == found->capacity) {
                int cap = found->capacity ? 2 * found->capacity : 4;
                char **grown = realloc(found->paths, (size_t)cap * sizeof *grown);
                if (!grown) { free(path); rc = -1; break; }
                found->paths = grown, found->capacity = cap;
            }
            found->paths[found->count++] = path;
            continue;
        }
        free(path);
    }
    closedir(d);
    return rc;
}

/* The single norm_stats.json under <checkpoint>/assets/, into `path`. */
static pi0_status find_one_norm_stats(const char *checkpoint_dir, char *path, size_t size, pi0_error *err) {
    char assets[4096];
    snprintf(assets, sizeof assets, "%s/assets", checkpoint_dir);
    path_list found = {0};
    pi0_status st;
    if (find_norm_stats(assets, 0, &found)) {
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory looking for norm stats under %s", assets);
    } else if (found.count == 0) {
        st = pi0_fail(err, PI0_ERR_IO, "no norm stats: no norm_stats.json under %s/ (give the file with --norm-stats)",
                      assets);
    } else if (found.count > 1) {
        qsort(found.paths, (size_t)found.count, sizeof *found.paths, path_cmp);
        char list[384] = "";
        size_t skip = strlen(assets) + 1, used = 0;
        for (int i = 0; i < found.count && used < sizeof list; i++)
            used += (size_t)snprintf(list + used, sizeof list - used, "%s%s", i ? ", " : "", found.paths[i] + skip);
        st = pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%d norm_stats.json files under %s/ (%s): choose one with --norm-stats",
                      found.count, assets, list);
    } else if ((size_t)snprintf(path, size, "%s", found.paths[0]) >= size) {
        st = pi0_fail(err, PI0_ERR_IO, "norm stats path too long: %s", found.paths[0]);
    } else {
        st = PI0_OK;
    }
    for (int i = 0; i < found.count; i++) free(found.paths[i]);
    free(found.paths);
    return st;
}

/* The norm stats: the given file, else the single norm_stats.json under <checkpoint>/assets/; then checked
 * for what the policy needs, naming the file. */
static pi0_status open_norm_stats(const pi0_policy_options *o, pi0_model_kind kind, pi0_norm_stats *out,
                                  pi0_error *err) {
    char path[4096];
    pi0_status st = o->norm_stats ? PI0_OK : find_one_norm_stats(o->checkpoint, path, sizeof path, err);
    if (st) return st;
    if (o->norm_stats) snprintf(path, sizeof path, "%s", o->norm_stats);
    if ((st = pi0_norm_stats_load(path, out, err))) return st;
    pi0_error inner = {0};
    if ((st = check_stats(out, resolve_mode(o->norm_mode, kind), kind, &inner))) {
        pi0_norm_stats_free(out);
        return pi0_fail(err, st, "%s: %s", path, inner.message);
    }
    return PI0_OK;
}

pi0_status pi0_policy_open(const pi0_policy_options *opts, pi0_policy **out, pi0_error *err) {
    if (!opts || !opts->checkpoint || !opts->adapter || !out)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "policy: NULL options, checkpoint, adapter or output");
    *out = NULL;
    pi0_adapter *adapter = NULL;
    pi0_tokenizer *tokenizer = NULL;
    pi0_norm_stats stats = {0};
    pi0_model *model = NULL;
    pi0_dims dims;
    /* the small files first, so that a typo fails before gigabytes of weights are read; the checkpoint's
       header says which model it is, which decides how the norm stats are used */
    pi0_status st = pi0_adapter_open(opts->adapter, &adapter, err);
    if (!st) st = open_tokenizer(opts, &tokenizer, err);
    if (!st) st = checkpoint_peek_dims(opts->checkpoint, &dims, err);
    if (!st) st = open_norm_stats(opts, dims.kind, &stats, err);
    if (!st) st = pi0_model_load(opts->checkpoint, &opts->model, &model, err);
    if (st) {
        pi0_adapter_free(adapter), pi0_tokenizer_free(tokenizer), pi0_norm_stats_free(&stats);
        return st;
    }
    pi0_error inner = {0};
    st = pi0_policy_create(model, adapter, tokenizer, &stats, opts, out, &inner);
    if (st) return pi0_fail(err, st, "%s: %s", opts->checkpoint, inner.message);
    return PI0_OK;
}

/* ---- one observation ----------------------------------------------------------------------------------- */

static const char *shape_str(const pi0_field *f, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < f->ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)f->shape[i]);
    if (used < size) snprintf(buf + used, size - used, f->ndim == 1 ? ",)" : ")");
    return buf;
}

/* The array field `key`, or NULL with an error naming the key and what was expected there. */
static const pi0_field *find_array(const pi0_observation *obs, const char *key, const char *what, pi0_error *err) {
    const pi0_field *f = pi0_observation_find(obs, key);
    if (!f) pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "missing key \"%s\" (%s)", key, what);
    else if (f->kind != PI0_FIELD_ARRAY)
        pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\" is a string, expected %s", key, what), f = NULL;
    return f;
}

/* numpy's float64 -> uint8 cast of (255 * x) on x86-64, like image.c's float32 one: truncate through int32. */
static uint8_t f64_to_u8_like_numpy(double x) {
    double scaled = 255.0 * x;
    if (!(scaled >= -2147483648.0 && scaled < 2147483648.0)) return 0;
    return (uint8_t)(int32_t)scaled;
}

/* Checks one camera frame and describes it for render_image (which then only fails for lack of memory). */
static pi0_status check_image(const pi0_field *f, pi0_image *img, pi0_error *err) {
    char shape[128];
    if (f->ndim != 3)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\" has shape %s: expected an image, (H, W, 3) or (3, H, W)",
                        f->key, shape_str(f, shape, sizeof shape));
    if (pi0_field_numel(f) == 0)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\" is an empty image (shape %s)", f->key,
                        shape_str(f, shape, sizeof shape));
    if (f->dtype != PI0_DTYPE_U8 && f->dtype != PI0_DTYPE_F32 && f->dtype != PI0_DTYPE_F64)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\" has dtype %s: expected uint8, or float32/float64 in [0, 1]",
                        f->key, pi0_dtype_str(f->dtype));
    /* openpi (libero_policy._parse_image): `if image.shape[0] == 3: c h w -> h w c` */
    int chw = f->shape[0] == 3;
    int64_t h = chw ? f->shape[1] : f->shape[0], w = chw ? f->shape[2] : f->shape[1], c = chw ? 3 : f->shape[2];
    if (c != 3)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT,
                        "\"%s\" has shape %s: expected 3 color channels, (H, W, 3) or (3, H, W)", f->key,
                        shape_str(f, shape, sizeof shape));
    if (h > PI0_MAX_IMAGE_SIDE || w > PI0_MAX_IMAGE_SIDE)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\" is a %lldx%lld image, larger than %dx%d", f->key,
                        (long long)w, (long long)h, PI0_MAX_IMAGE_SIDE, PI0_MAX_IMAGE_SIDE);
    /* float64 frames are turned into bytes by render_frame; float32 ones by pi0_image_to_frame */
    *img = (pi0_image){.data = f->data, .type = f->dtype == PI0_DTYPE_F32 ? PI0_PIXEL_F32 : PI0_PIXEL_U8,
                       .layout = chw ? PI0_LAYOUT_CHW : PI0_LAYOUT_HWC, .height = (int)h, .width = (int)w,
                       .channels = 3};
    return PI0_OK;
}

/* One checked camera frame as openpi's uint8 HWC into `hwc` (height * width * 3 bytes). */
static pi0_status render_frame(const pi0_field *f, const pi0_image *checked, uint8_t *hwc, pi0_error *err) {
    pi0_image img = *checked;
    uint8_t *bytes = NULL;
    if (f->dtype == PI0_DTYPE_F64) {
        /* (255 * x).astype(np.uint8) in float64, as numpy computes it for a float64 image */
        size_t n = (size_t)img.height * img.width * 3;
        if (!(bytes = malloc(n))) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for \"%s\"", f->key);
        for (size_t i = 0; i < n; i++) {
            double x;
            memcpy(&x, (const char *)f->data + i * sizeof x, sizeof x);
            bytes[i] = f64_to_u8_like_numpy(x);
        }
        img.data = bytes;
    }
    pi0_error inner = {0};
    pi0_status st = pi0_image_to_frame(&img, hwc, &inner);
    free(bytes);
    if (st) return pi0_fail(err, st, "\"%s\": %s", f->key, inner.message);
    return PI0_OK;
}

/* Element k of a numeric field as float64 (numpy's promotion of the robot's array against float64 stats). */
static double element(const pi0_field *f, int64_t k) {
    const char *at = (const char *)f->data + (size_t)k * pi0_dtype_size(f->dtype);
#define LOAD(type) do { type v; memcpy(&v, at, sizeof v); return (double)v; } while (0)
    switch (f->dtype) {
    case PI0_DTYPE_BOOL: return *(const uint8_t *)at != 0;
    case PI0_DTYPE_U8: LOAD(uint8_t);
    case PI0_DTYPE_I8: LOAD(int8_t);
    case PI0_DTYPE_U16: LOAD(uint16_t);
    case PI0_DTYPE_I16: LOAD(int16_t);
    case PI0_DTYPE_U32: LOAD(uint32_t);
    case PI0_DTYPE_I32: LOAD(int32_t);
    case PI0_DTYPE_U64: LOAD(uint64_t);
    case PI0_DTYPE_I64: LOAD(int64_t);
    case PI0_DTYPE_F16: { uint16_t v; memcpy(&v, at, 2); return f16_to_f32(v); }
    case PI0_DTYPE_F32: LOAD(float);
    case PI0_DTYPE_F64: LOAD(double);
    }
#undef LOAD
    return NAN;
}

/* Value i of the concatenated state: its field, and in *j its index there. */
static const pi0_field *state_field_of(const pi0_field *const *fields, int count, int i, int64_t *j) {
    int k = 0;
    for (*j = i; k < count - 1 && *j >= pi0_field_numel(fields[k]); k++) *j -= pi0_field_numel(fields[k]);
    return fields[k];
}

/* The model takes the normalized state in float32: a finite state far outside its norm stats (1e38 against a
 * std of 0.1) overflows there, and would come out as NaN actions. */
static pi0_status check_state_range(const pi0_field *const *fields, int count, const double *normalized,
                                    const float *rounded, int n, pi0_error *err) {
    for (int i = 0; i < n; i++) {
        if (isfinite(rounded[i])) continue;
        int64_t j;
        const pi0_field *f = state_field_of(fields, count, i, &j);
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\"[%lld] is %g, which normalizes to %g: not finite as the "
                        "model's float32 input (is the state in the units of the norm stats?)", f->key, (long long)j,
                        element(f, j), normalized[i]);
    }
    return PI0_OK;
}

/* The adapter's state keys concatenated and normalized (openpi's Normalize, in float64) into out->state_f64 (*n
 * values), then rounded to float32 and zero-padded to A for the model. */
static pi0_status prepare_state(const pi0_policy *p, const pi0_observation *obs, pi0_prepared *out, int *n,
                                pi0_error *err) {
    const pi0_adapter *a = p->adapter;
    int A = pi0_model_dims(p->model)->action_dim;
    const pi0_field *fields[PI0_ADAPTER_MAX_STATE_KEYS];
    int64_t total = 0;
    char shape[128];
    for (int k = 0; k < a->num_state_keys; k++) {
        const pi0_field *f = fields[k] = find_array(obs, a->state_keys[k], "a number or a vector of numbers", err);
        if (!f) return err ? err->status : PI0_ERR_INVALID_ARGUMENT;
        if (f->ndim > 1)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\" has shape %s: expected a number or a vector", f->key,
                            shape_str(f, shape, sizeof shape));
        total += pi0_field_numel(f);
    }
    if (total > A)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "the state (\"%s\"%s) has %lld values, more than the model's "
                        "action_dim %d", a->state_keys[0], a->num_state_keys > 1 ? " ..." : "", (long long)total, A);
    const pi0_norm_entry *e = p->state_stats;
    if (total > e->dim)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "the state (\"%s\"%s) has %lld values but norm stats \"state\" "
                        "have %d", a->state_keys[0], a->num_state_keys > 1 ? " ..." : "", (long long)total, e->dim);
    double *values = out->state_f64; /* normalized in place */
    int i = 0;
    for (int k = 0; k < a->num_state_keys; k++) {
        const pi0_field *f = fields[k];
        for (int64_t j = 0; j < pi0_field_numel(f); j++, i++) {
            values[i] = element(f, j); /* numpy: any dtype meets the float64 stats as float64 */
            if (!isfinite(values[i]))
                return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\"[%lld] is %g: the state must be finite", f->key,
                                (long long)j, values[i]);
        }
    }
    pi0_status st = pi0_normalize(e, p->mode, values, values, i, err);
    if (st) return st;
    for (int j = 0; j < i; j++) out->state[j] = (float)values[j];
    if ((st = check_state_range(fields, a->num_state_keys, values, out->state, i, err))) return st;
    for (int j = i; j < A; j++) out->state[j] = 0.0f; /* PadStatesAndActions */
    *n = i;
    return PI0_OK;
}

/* The prompt (or the adapter's default), tokenized (Pi0.5 with the discrete state: the robot's own n
 * normalized state values written into it) and checked against the model's vocabulary. */
static pi0_status prepare_prompt(const pi0_policy *p, const pi0_observation *obs, int n_state, pi0_prepared *out,
                                 pi0_error *err) {
    const pi0_adapter *a = p->adapter;
    const char *prompt = NULL;
    const pi0_field *f = a->prompt_key ? pi0_observation_find(obs, a->prompt_key) : NULL;
    if (f && f->kind != PI0_FIELD_STRING)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "\"%s\" is an array, expected the instruction string", f->key);
    prompt = f ? f->string : a->default_prompt;
    if (!prompt)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "missing key \"%s\" (the instruction; adapter %s has no default "
                        "prompt)", a->prompt_key ? a->prompt_key : "prompt", a->name ? a->name : "(unnamed)");
    const pi0_dims *d = pi0_model_dims(p->model);
    int32_t *ids = out->prompt_ids;
    pi0_status st = p->discrete_state
                        ? pi0_tokenize_prompt_with_state(p->tokenizer, prompt, out->state_f64, n_state, d->max_token_len,
                                                         ids, out->prompt_mask, &out->prompt_valid, err)
                        : pi0_tokenize_prompt(p->tokenizer, prompt, d->max_token_len, ids, out->prompt_mask,
                                              &out->prompt_valid, err);
    if (st) return st;
    for (int i = 0; i < out->prompt_valid; i++)
        if (ids[i] < 0 || ids[i] >= d->vocab_size)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT,
                            "prompt token %d has id %d (\"%s\"), outside the model's vocabulary of %d: the tokenizer "
                            "(%d pieces) does not belong to this checkpoint", i, ids[i],
                            pi0_tokenizer_piece(p->tokenizer, ids[i]) ? pi0_tokenizer_piece(p->tokenizer, ids[i]) : "?",
                            d->vocab_size,
                            pi0_tokenizer_vocab_size(p->tokenizer));
    return PI0_OK;
}

/* Finds and checks model camera k's frame: *field NULL for a missing optional camera. */
static pi0_status find_camera(const pi0_policy *p, const pi0_observation *obs, int k, const pi0_field **field,
                              pi0_image *image, pi0_error *err) {
    int c = p->camera[k];
    const char *key = p->adapter->camera_keys[c];
    *field = NULL;
    if (p->adapter->camera_optional[c] && !pi0_observation_find(obs, key)) return PI0_OK;
    if (!(*field = find_array(obs, key, "a camera image", err))) return err ? err->status : PI0_ERR_INVALID_ARGUMENT;
    return check_image(*field, image, err);
}

pi0_status pi0_policy_prepare(const pi0_policy *p, const pi0_observation *obs, pi0_prepared **out, pi0_error *err) {
    double t0 = pi0_now_ms();
    if (!p || !obs || !out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "policy prepare: NULL policy, observation or output");
    *out = NULL;
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t C = (size_t)p->num_cameras, L = (size_t)d->max_token_len, A = (size_t)d->action_dim;
    const pi0_field *fields[PI0_ADAPTER_MAX_CAMERAS];
    pi0_image images[PI0_ADAPTER_MAX_CAMERAS];
    pi0_error camera_err = {0};
    pi0_status st = PI0_OK;
    size_t frame_bytes = 0;
    for (size_t k = 0; k < C && !st; k++)
        if (!(st = find_camera(p, obs, (int)k, &fields[k], &images[k], &camera_err)) && fields[k])
            frame_bytes += (size_t)images[k].height * images[k].width * 3;
    /* one block: the struct, then float state, double state, int32 ids, then the byte arrays and the frames */
    size_t bytes = sizeof(pi0_prepared) + A * sizeof(float) + A * sizeof(double) + L * sizeof(int32_t) + L + C + 64 +
                   (st ? 0 : frame_bytes);
    size_t block_size = 0;
    char *block = pool_get(p->pool, bytes, &block_size);
    *out = (pi0_prepared *)block;
    if (!block) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory preparing an observation");
    memset(block, 0, bytes - (st ? 0 : frame_bytes)); /* the frames are written over */
    pi0_prepared *pr = *out;
    pr->pool = p->pool, pr->block_size = block_size;
    char *at = block + (sizeof(pi0_prepared) + 15) / 16 * 16;
    pr->state_f64 = (double *)at, at += A * sizeof(double);
    pr->state = (float *)at, at += A * sizeof(float);
    pr->prompt_ids = (int32_t *)at, at += L * sizeof(int32_t);
    pr->prompt_mask = (uint8_t *)at, at += L;
    pr->camera_valid = (uint8_t *)at, at += C;
    if (st) pr->error = camera_err;
    for (size_t k = 0; k < C && !st; k++) {
        pr->camera_valid[k] = fields[k] != NULL;
        if (!fields[k]) continue;
        pr->frames[k] = (pi0_frame){(uint8_t *)at, images[k].height, images[k].width};
        st = render_frame(fields[k], &images[k], (uint8_t *)at, &pr->error);
        at += (size_t)images[k].height * images[k].width * 3;
    }
    int n_state = 0;
    if (!st) st = prepare_state(p, obs, pr, &n_state, &pr->error);
    if (!st) st = prepare_prompt(p, obs, n_state, pr, &pr->error);
    pr->prepare_ms = pi0_now_ms() - t0;
    if (st && err) *err = pr->error;
    return st;
}

void pi0_prepared_free(pi0_prepared *prepared) {
    if (prepared) pool_put(prepared->pool, prepared, prepared->block_size);
}

/* ---- the batch ----------------------------------------------------------------------------------------- */

static pi0_status ensure_capacity(pi0_policy *p, int count, pi0_error *err) {
    if (count <= p->capacity) return PI0_OK;
    free_buffers(p);
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t n = (size_t)count, L = (size_t)d->max_token_len;
    size_t per_chunk = (size_t)p->horizon * d->action_dim;
    p->frames = calloc(n * p->num_cameras + 1, sizeof *p->frames);
    p->image_masks = calloc(n * p->num_cameras + 1, 1);
    p->prompt_ids = calloc(n * L + 1, sizeof(int32_t));
    p->prompt_mask = calloc(n * L + 1, 1);
    p->state = calloc(n * d->action_dim, sizeof(float));
    p->noise = malloc(n * per_chunk * sizeof(float));
    p->actions = malloc(n * per_chunk * sizeof(float));
    p->source = malloc(n * sizeof(int));
    p->owned = calloc(n, sizeof *p->owned);
    if (!p->frames || !p->image_masks || !p->prompt_ids || !p->prompt_mask || !p->state || !p->noise || !p->actions ||
        !p->source || !p->owned) {
        free_buffers(p);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for a batch of %d observations", count);
    }
    p->capacity = count;
    return PI0_OK;
}

/* A robot must never receive NaN or infinity: an observation's actions (R of each of H steps, unnormalized from
 * the model's `raw` rows of A floats) must all be finite. The message names the step and dim, and the model's
 * value: finite there means unnormalizing overflowed (norm stats "actions" too large), else the model did. */
static pi0_status check_actions(const float *raw, int A, const double *actions, int H, int R, pi0_error *err) {
    for (int k = 0; k < H * R; k++) {
        int t = k / R, i = k % R;
        if (!isfinite(actions[k]))
            return pi0_fail(err, PI0_ERR_NUMERIC, "action step %d, dim %d is %g (the model gave %g, then unnormalized): "
                            "actions must be finite", t, i, actions[k], raw[(size_t)t * A + i]);
    }
    return PI0_OK;
}

/*
 * The shapes a batch runs as. On a backend with graphs (CUDA), every batch is made one of a few shapes, so
 * that a server captures each once, at warm-up, and never on a request's path (docs/protocol.md#batching):
 * the prompt rows are the longest valid prompt rounded up to PROMPT_BUCKET tokens, the batch size is exact
 * up to BATCH_EXACT and rounded up to a multiple of BATCH_EXACT beyond (the extra samples are copies of
 * the first, their actions dropped), and masked cameras and padding are computed, never used as keys
 * (pi0_batch.uniform_shape): the actions are the same. The CPU backend runs exact shapes, skipping what is
 * masked.
 */
#define PROMPT_BUCKET 32
#define BATCH_EXACT 8

static int uses_graphs(const pi0_policy *p) {
    return pi0_model_backend(p->model) == PI0_BACKEND_CUDA;
}

static int prompt_rows(const pi0_policy *p, int longest) {
    int max_len = pi0_model_dims(p->model)->max_token_len;
    if (!uses_graphs(p)) return max_len;
    int rows = (longest + PROMPT_BUCKET - 1) / PROMPT_BUCKET * PROMPT_BUCKET;
    return rows < 1 ? 1 : rows > max_len ? max_len : rows;
}

static int batch_rows(const pi0_policy *p, int valid) {
    if (!uses_graphs(p) || valid <= BATCH_EXACT) return valid;
    int rows = (valid + BATCH_EXACT - 1) / BATCH_EXACT * BATCH_EXACT;
    return rows > PI0_MAX_BATCH ? PI0_MAX_BATCH : rows;
}

/* Slot `slot` of the batch buffers from one prepared observation; prompts at stride max_token_len for now. */
static void fill_slot(pi0_policy *p, const pi0_prepared *pr, int slot) {
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t L = (size_t)d->max_token_len, C = (size_t)p->num_cameras;
    for (size_t k = 0; k < C; k++) {
        p->frames[slot * C + k] = pr->frames[k];
        p->image_masks[slot * C + k] = pr->camera_valid[k];
    }
    memcpy(p->prompt_ids + slot * L, pr->prompt_ids, L * sizeof(int32_t));
    memcpy(p->prompt_mask + slot * L, pr->prompt_mask, L);
    memcpy(p->state + slot * (size_t)d->action_dim, pr->state, (size_t)d->action_dim * sizeof(float));
}

/* Fills slots valid..rows with copies of slot 0 (a batch padded to its bucket). */
static void pad_slots(pi0_policy *p, int valid, int rows) {
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t L = (size_t)d->max_token_len, C = (size_t)p->num_cameras;
    size_t chunk = (size_t)p->horizon * d->action_dim;
    for (int slot = valid; slot < rows; slot++) {
        memcpy(p->frames + slot * C, p->frames, C * sizeof *p->frames);
        memcpy(p->image_masks + slot * C, p->image_masks, C);
        memcpy(p->prompt_ids + slot * L, p->prompt_ids, L * sizeof(int32_t));
        memcpy(p->prompt_mask + slot * L, p->prompt_mask, L);
        memcpy(p->state + slot * (size_t)d->action_dim, p->state, (size_t)d->action_dim * sizeof(float));
        memcpy(p->noise + slot * chunk, p->noise, chunk * sizeof(float));
    }
}

/* Runs the first `valid` slots, padded to batch_rows, with `prompt_len` prompt rows (the prompts are packed
 * to that stride first) into p->actions; returns the model's time in *model_ms. */
static pi0_status run_batch(pi0_policy *p, int valid, int prompt_len, double *model_ms, pi0_error *err) {
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t L = (size_t)d->max_token_len;
    int rows = batch_rows(p, valid);
    pad_slots(p, valid, rows);
    for (int v = 1; v < rows; v++) { /* stride L to stride prompt_len, in place (prompt_len <= L) */
        memmove(p->prompt_ids + (size_t)v * prompt_len, p->prompt_ids + v * L, (size_t)prompt_len * sizeof(int32_t));
        memmove(p->prompt_mask + (size_t)v * prompt_len, p->prompt_mask + v * L, (size_t)prompt_len);
    }
    pi0_batch batch = {.batch = rows, .num_cameras = p->num_cameras, .frames = p->frames, .image_masks = p->image_masks,
                       .prompt_len = prompt_len, .prompt_ids = p->prompt_ids, .prompt_mask = p->prompt_mask,
                       .state = p->state, .horizon = p->horizon, .noise = p->noise, .num_steps = p->num_steps,
                       .uniform_shape = uses_graphs(p)};
    double t0 = pi0_now_ms();
    pi0_status st = pi0_sample_actions(p->model, &batch, p->actions, NULL, err);
    *model_ms = pi0_now_ms() - t0;
    return st;
}

/* Observation v's actions, unnormalized into a new result array. */
static void finish_result(const pi0_policy *p, int v, pi0_policy_result *r) {
    int H = p->horizon, A = pi0_model_dims(p->model)->action_dim, R = p->adapter->action_dims;
    if (!(r->actions = malloc((size_t)H * R * sizeof(double)))) {
        pi0_fail(&r->error, PI0_ERR_OUT_OF_MEMORY, "out of memory for the actions");
        return;
    }
    for (int t = 0; t < H; t++)
        if (pi0_unnormalize(p->action_stats, p->mode, p->actions + ((size_t)v * H + t) * A, r->actions + (size_t)t * R, R,
                            &r->error)) {
            free(r->actions), r->actions = NULL;
            return;
        }
    if (check_actions(p->actions + (size_t)v * H * A, A, r->actions, H, R, &r->error))
        free(r->actions), r->actions = NULL;
}

void pi0_policy_result_free(pi0_policy_result *r) {
    if (!r) return;
    free(r->actions);
    r->actions = NULL;
}

/* The arguments every batch call checks; a bad call fails every result it can write. */
static pi0_status check_call(const pi0_policy *p, const void *items, int count, pi0_policy_result *results,
                             pi0_error *err) {
    if (p && count >= 0 && count <= PI0_MAX_BATCH && (count == 0 || (items && results))) return PI0_OK;
    pi0_error bad = {0};
    pi0_fail(&bad, PI0_ERR_INVALID_ARGUMENT, "policy infer: NULL policy, observations or results, or count %d "
             "outside 0..%d", count, PI0_MAX_BATCH);
    for (int i = 0; results && i < count && count <= PI0_MAX_BATCH; i++) results[i] = (pi0_policy_result){.error = bad};
    if (err) *err = bad;
    return bad.status;
}

pi0_status pi0_policy_infer_prepared(pi0_policy *p, const pi0_prepared *const *items, const uint64_t *noise_seeds,
                                     int count, pi0_policy_result *results, pi0_error *err) {
    pi0_status st = check_call(p, items, count, results, err);
    if (st) return st;
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t chunk = (size_t)p->horizon * d->action_dim;
    for (int i = 0; i < count; i++)
        results[i] = (pi0_policy_result){.error = {.status = PI0_OK}, .horizon = p->horizon,
                                         .action_dims = p->adapter->action_dims};
    pi0_error batch_err = {0};
    if ((st = ensure_capacity(p, batch_rows(p, count), &batch_err))) {
        for (int i = 0; i < count; i++) results[i].error = batch_err;
        if (err) *err = batch_err;
        return st;
    }
    int valid = 0, longest = 0;
    for (int i = 0; i < count; i++) {
        if (!items[i]) pi0_fail(&results[i].error, PI0_ERR_INVALID_ARGUMENT, "observation %d is NULL", i);
        else if (items[i]->error.status) results[i].error = items[i]->error;
        if (results[i].error.status) continue;
        results[i].prepare_ms = items[i]->prepare_ms;
        fill_slot(p, items[i], valid);
        if (items[i]->prompt_valid > longest) longest = items[i]->prompt_valid;
        flow_noise(noise_seeds ? noise_seeds[i] : 0, p->noise + valid * chunk, chunk); /* as a batch of one draws it */
        p->source[valid++] = i;
    }
    if (!valid) return PI0_OK;
    double model_ms = 0;
    if ((st = run_batch(p, valid, prompt_rows(p, longest), &model_ms, &batch_err))) {
        for (int v = 0; v < valid; v++) results[p->source[v]].error = batch_err;
        if (err) *err = batch_err;
        return st;
    }
    for (int v = 0; v < valid; v++) {
        results[p->source[v]].model_ms = model_ms;
        finish_result(p, v, &results[p->source[v]]);
    }
    return PI0_OK;
}

pi0_status pi0_policy_infer(pi0_policy *p, const pi0_observation *const *obs, const uint64_t *noise_seeds,
                            int count, pi0_policy_result *results, double *infer_ms, pi0_error *err) {
    double t0 = pi0_now_ms();
    if (infer_ms) *infer_ms = 0;
    pi0_status st = check_call(p, obs, count, results, err);
    if (!st) st = ensure_capacity(p, batch_rows(p, count), err);
    if (st) return st;
    /* every observation's preparation is independent: in parallel (a float frame's conversion can be work) */
#pragma omp parallel for schedule(dynamic, 1) if (count > 1)
    for (int i = 0; i < count; i++) {
        pi0_error e = {0};
        p->owned[i] = NULL;
        if (obs[i]) pi0_policy_prepare(p, obs[i], &p->owned[i], &e);
    }
    st = pi0_policy_infer_prepared(p, (const pi0_prepared *const *)p->owned, noise_seeds, count, results, err);
    for (int i = 0; i < count; i++) pi0_prepared_free(p->owned[i]), p->owned[i] = NULL;
    if (infer_ms) *infer_ms = pi0_now_ms() - t0;
    return st;
}

/* Dummy batches of every shape a call of up to max_batch observations can take (batch_rows x prompt_rows):
 * on a GPU, each shape's graph is captured and its GEMMs chosen now rather than on a request's path. The
 * largest first, so that the backend's workspace is allocated once. Nothing to do on the CPU backend. */
pi0_status pi0_policy_warmup(pi0_policy *p, int max_batch, double *seconds, pi0_error *err) {
    double t0 = pi0_now_ms();
    if (seconds) *seconds = 0;
    if (!p || max_batch < 1 || max_batch > PI0_MAX_BATCH)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "policy warmup: NULL policy or max_batch %d outside 1..%d",
                        max_batch, PI0_MAX_BATCH);
    if (!uses_graphs(p)) return PI0_OK;
    pi0_status st = ensure_capacity(p, batch_rows(p, max_batch), err);
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t L = (size_t)d->max_token_len;
    /* Frames of twice the model's side: the backend's frame buffers (CUDA: staging, sized with 2x headroom) then
     * hold a batch of frames up to ~630 x 630 pixels (a 640 x 480 camera) without growing on a request's path. */
    int side = 2 * d->image_size > PI0_MAX_IMAGE_SIDE ? PI0_MAX_IMAGE_SIDE : 2 * d->image_size;
    uint8_t *pixels = calloc((size_t)side * side * 3, 1);
    pi0_frame blank = {pixels, side, side};
    if (!st && !pixels) st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for warm-up frames");
    for (int rows = prompt_rows(p, (int)L); !st && rows >= 1;
         rows = rows > PROMPT_BUCKET ? prompt_rows(p, rows - PROMPT_BUCKET) : 0) {
        for (int b = batch_rows(p, max_batch); !st && b >= 1; b = b > BATCH_EXACT ? b - BATCH_EXACT : b - 1) {
            for (int k = 0; k < b * p->num_cameras; k++) p->frames[k] = blank;
            memset(p->image_masks, 1, (size_t)b * p->num_cameras);
            memset(p->prompt_ids, 0, (size_t)b * L * sizeof(int32_t));
            memset(p->prompt_mask, 1, (size_t)b * L);
            memset(p->state, 0, (size_t)b * d->action_dim * sizeof(float));
            memset(p->noise, 0, (size_t)b * p->horizon * d->action_dim * sizeof(float));
            double model_ms;
            st = run_batch(p, b, rows, &model_ms, err);
        }
    }
    free(pixels);
    if (seconds) *seconds = (pi0_now_ms() - t0) / 1e3;
    return st;
}
