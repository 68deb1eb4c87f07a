#include "model/plan.h"

#include <stdlib.h>
#include <string.h>

#include "util/error.h"
#include "util/rng.h"

/* Limits that keep a malformed request from asking for absurd amounts of memory. */
#define MAX_BATCH 4096
#define MAX_CAMERAS 64
#define MAX_PROMPT_LEN 65536
#define MAX_HORIZON 4096
#define MAX_STEPS 10000

static pi0_status check_batch(const pi0_dims *dims, const pi0_batch *b, pi0_error *err) {
    if (b->batch <= 0 || b->batch > MAX_BATCH)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "batch size %d is outside 1..%d", b->batch, MAX_BATCH);
    if (b->num_cameras < 0 || b->num_cameras > MAX_CAMERAS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "num_cameras %d is outside 0..%d", b->num_cameras, MAX_CAMERAS);
    if (b->prompt_len < 0 || b->prompt_len > MAX_PROMPT_LEN)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "prompt_len %d is outside 0..%d", b->prompt_len, MAX_PROMPT_LEN);
    if (b->horizon < 0 || b->horizon > MAX_HORIZON)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "horizon %d is outside 0..%d", b->horizon, MAX_HORIZON);
    if (b->num_steps < 0 || b->num_steps > MAX_STEPS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "num_steps %d is outside 0..%d", b->num_steps, MAX_STEPS);
    if (!b->state) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "state is NULL");
    if (b->num_cameras > 0 && (!b->images || !b->image_masks))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "images or image_masks is NULL");
    if (b->prompt_len > 0 && (!b->prompt_ids || !b->prompt_mask))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "prompt_ids or prompt_mask is NULL");
    for (int s = 0; s < b->batch; s++) {
        for (int c = 0; c < b->num_cameras; c++)
            if (b->image_masks[s * b->num_cameras + c] && !b->images[c])
                return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "camera %d is valid for sample %d but its image is NULL",
                                c, s);
        for (int i = 0; i < b->prompt_len; i++) {
            int64_t at = (int64_t)s * b->prompt_len + i;
            if (b->prompt_mask[at] && (b->prompt_ids[at] < 0 || b->prompt_ids[at] >= dims->vocab_size))
                return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT,
                                "prompt token %d of sample %d has id %d, outside the vocabulary 0..%d", i, s,
                                b->prompt_ids[at], dims->vocab_size - 1);
        }
    }
    return PI0_OK;
}

static int alloc_all(pi0_plan *p, int B, int num_cameras, int prompt_len) {
    p->images = malloc(sizeof(float *) * ((size_t)B * num_cameras + 1));
    p->image_start = calloc((size_t)B + 1, sizeof(int));
    p->prompt_ids = malloc(sizeof(int32_t) * ((size_t)B * prompt_len + 1));
    p->prompt_start = calloc((size_t)B + 1, sizeof(int));
    p->prefix_start = calloc((size_t)B, sizeof(int));
    p->prefix_len = calloc((size_t)B, sizeof(int));
    p->cache_start = calloc((size_t)B, sizeof(int));
    return p->images && p->image_start && p->prompt_ids && p->prompt_start && p->prefix_start && p->prefix_len &&
           p->cache_start;
}

/* Standard normal noise from the seed, as documented in pi0.h. */
static float *seeded_noise(uint64_t seed, size_t n) {
    float *noise = malloc(n * sizeof(float));
    uint64_t stream = rng_mix64(seed ^ 0x6e6f697365ull); /* "noise" */
    for (size_t i = 0; noise && i < n; i++) noise[i] = rng_normal(stream, i);
    return noise;
}

pi0_status plan_build(const pi0_dims *dims, const pi0_batch *b, pi0_plan *p, pi0_error *err) {
    memset(p, 0, sizeof *p);
    pi0_status st = check_batch(dims, b, err);
    if (st) return st;
    int B = b->batch, tokens_per_image = (dims->image_size / dims->patch_size) * (dims->image_size / dims->patch_size);
    p->batch = B;
    p->horizon = b->horizon ? b->horizon : dims->action_horizon;
    p->num_steps = b->num_steps ? b->num_steps : 10;
    p->state = b->state;
    if (!alloc_all(p, B, b->num_cameras, b->prompt_len)) goto oom;

    int64_t prefix_rows = 0, cache_rows = 0;
    for (int s = 0; s < B; s++) {
        p->image_start[s] = p->num_images;
        for (int c = 0; c < b->num_cameras; c++)
            if (b->image_masks[s * b->num_cameras + c])
                p->images[p->num_images++] = b->images[c] + (size_t)s * dims->image_size * dims->image_size * 3;
        int num_prompt = 0;
        for (int i = 0; i < b->prompt_len; i++) {
            int64_t at = (int64_t)s * b->prompt_len + i;
            if (b->prompt_mask[at]) p->prompt_ids[p->prompt_start[s] + num_prompt++] = b->prompt_ids[at];
        }
        p->prompt_start[s + 1] = p->prompt_start[s] + num_prompt;
        int len = (p->num_images - p->image_start[s]) * tokens_per_image + num_prompt;
        p->prefix_start[s] = (int)prefix_rows;
        p->prefix_len[s] = len;
        p->cache_start[s] = (int)cache_rows;
        prefix_rows += len;
        cache_rows += len + p->horizon + 1;
        if (len > p->max_prefix) p->max_prefix = len;
    }
    p->image_start[B] = p->num_images;
    if (cache_rows > (1 << 30))
        return plan_free(p), pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "batch has too many tokens (%lld)", (long long)cache_rows);
    p->total_prefix = (int)prefix_rows;
    p->cache_rows = (int)cache_rows;

    size_t noise_len = (size_t)B * p->horizon * dims->action_dim;
    p->noise = b->noise;
    if (!b->noise && !(p->noise = p->noise_owned = seeded_noise(b->noise_seed, noise_len))) goto oom;
    return PI0_OK;
oom:
    plan_free(p);
    return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory planning a batch of %d", B);
}

void plan_free(pi0_plan *p) {
    free(p->images);
    free(p->image_start);
    free(p->prompt_ids);
    free(p->prompt_start);
    free(p->prefix_start);
    free(p->prefix_len);
    free(p->cache_start);
    free(p->noise_owned);
    memset(p, 0, sizeof *p);
}
