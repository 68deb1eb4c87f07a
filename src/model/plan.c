#include "model/plan.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "model/flow.h"
#include "util/error.h"


static pi0_status check_batch(const pi0_dims *dims, const pi0_batch *b, pi0_error *err) {
    if (b->batch <= 0 || b->batch > PI0_MAX_BATCH)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "batch size %d is outside 1..%d", b->batch, PI0_MAX_BATCH);
    if (b->num_cameras < 0 || b->num_cameras > PI0_MAX_CAMERAS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "num_cameras %d is outside 0..%d", b->num_cameras, PI0_MAX_CAMERAS);
    if (b->prompt_len < 0 || b->prompt_len > PI0_MAX_PROMPT_LEN)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "prompt_len %d is outside 0..%d", b->prompt_len, PI0_MAX_PROMPT_LEN);
    if (b->horizon < 0 || b->horizon > PI0_MAX_HORIZON)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "horizon %d is outside 0..%d", b->horizon, PI0_MAX_HORIZON);
    if (b->num_steps < 0 || b->num_steps > PI0_MAX_STEPS)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "num_steps %d is outside 0..%d", b->num_steps, PI0_MAX_STEPS);
    if (!b->state && dims->kind == PI0_MODEL_PI0) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "state is NULL");
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
    p->prefix_segments = calloc((size_t)B, sizeof(attn_segment));
    p->suffix_segments = calloc((size_t)B, sizeof(attn_segment));
    return p->images && p->image_start && p->prompt_ids && p->prompt_start && p->prefix_start && p->prefix_len &&
           p->cache_start && p->prefix_segments && p->suffix_segments;
}

/* Where each valid token lives and what it attends to (see the top of plan.h). */
static int layout_tokens(pi0_plan *p) {
    int S = p->suffix_len, state_token = S - p->horizon; /* 1 for Pi0, 0 for Pi0.5 */
    size_t prefix = (size_t)p->total_prefix + 1, suffix = (size_t)p->batch * S;
    p->prefix_pos = malloc(prefix * sizeof(int));
    p->prefix_cache_row = malloc(prefix * sizeof(int));
    p->suffix_pos = malloc(suffix * sizeof(int));
    p->suffix_cache_row = malloc(suffix * sizeof(int));
    p->action_rows = malloc((size_t)p->batch * p->horizon * sizeof(int));
    if (!p->prefix_pos || !p->prefix_cache_row || !p->suffix_pos || !p->suffix_cache_row || !p->action_rows) return -1;
    for (int b = 0; b < p->batch; b++) {
        int len = p->prefix_len[b];
        for (int i = 0; i < len; i++) {
            p->prefix_pos[p->prefix_start[b] + i] = i;
            p->prefix_cache_row[p->prefix_start[b] + i] = p->cache_start[b] + i;
        }
        p->prefix_segments[b] = (attn_segment){.q_row = p->prefix_start[b], .num_q = len, .k_row = p->cache_start[b], .num_k = len};
        for (int i = 0; i < S; i++) {
            p->suffix_pos[b * S + i] = len + i;
            p->suffix_cache_row[b * S + i] = p->cache_start[b] + len + i;
        }
        /* Pi0's state token (suffix row 0) sees the prefix and itself; action tokens see everything */
        p->suffix_segments[b] = (attn_segment){.q_row = b * S, .num_q = S, .k_row = p->cache_start[b], .num_k = len + S,
                                               .state_keys = state_token ? len + 1 : 0};
        for (int i = 0; i < p->horizon; i++) p->action_rows[b * p->horizon + i] = b * S + state_token + i;
    }
    return 0;
}

pi0_status plan_build(const pi0_dims *dims, const pi0_batch *b, pi0_plan *p, pi0_error *err) {
    memset(p, 0, sizeof *p);
    pi0_status st = check_batch(dims, b, err);
    if (st) return st;
    int B = b->batch, tokens_per_image = image_tokens(dims);
    p->batch = B;
    p->horizon = b->horizon ? b->horizon : dims->action_horizon;
    p->suffix_len = p->horizon + (dims->kind == PI0_MODEL_PI0);
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
        cache_rows += len + p->suffix_len;
        if (len > p->max_prefix) p->max_prefix = len;
    }
    p->image_start[B] = p->num_images;
    if (cache_rows > (1 << 30))
        return plan_free(p), pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "batch has too many tokens (%lld)", (long long)cache_rows);
    p->total_prefix = (int)prefix_rows;
    p->cache_rows = (int)cache_rows;
    if (layout_tokens(p)) goto oom;

    size_t noise_len = (size_t)B * p->horizon * dims->action_dim;
    p->noise = b->noise;
    if (!b->noise) {
        if (!(p->noise = p->noise_owned = malloc(noise_len * sizeof(float) + 1))) goto oom;
        flow_noise(b->noise_seed, p->noise_owned, noise_len);
    }
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
    free(p->prefix_pos), free(p->prefix_cache_row), free(p->prefix_segments);
    free(p->suffix_pos), free(p->suffix_cache_row), free(p->suffix_segments), free(p->action_rows);
    free(p->noise_owned);
    memset(p, 0, sizeof *p);
}

