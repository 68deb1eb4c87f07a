#include "model/plan.h"

#include <stdlib.h>
#include <string.h>

#include "model/flow.h"
#include "util/error.h"
#include "util/finite.h"


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
    if (b->num_cameras > 0 && (!b->images == !b->frames || !b->image_masks))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s", !b->image_masks ? "image_masks is NULL"
                        : b->images ? "both images and frames are given: one or the other"
                                    : "images and frames are both NULL: one or the other is needed");
    if (b->prompt_len > 0 && (!b->prompt_ids || !b->prompt_mask))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "prompt_ids or prompt_mask is NULL");
    for (int s = 0; s < b->batch; s++) {
        for (int c = 0; c < b->num_cameras; c++) {
            if (!b->image_masks[s * b->num_cameras + c]) continue;
            const pi0_frame *f = b->frames ? &b->frames[s * b->num_cameras + c] : NULL;
            if (b->images ? !b->images[c] : !f->pixels)
                return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "camera %d is valid for sample %d but its %s is NULL",
                                c, s, b->images ? "image" : "frame");
            if (f && (f->height < 1 || f->width < 1 || f->height > PI0_MAX_IMAGE_SIDE || f->width > PI0_MAX_IMAGE_SIDE))
                return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "the frame of camera %d, sample %d is %dx%d: sides must "
                                "be in 1..%d", c, s, f->width, f->height, PI0_MAX_IMAGE_SIDE);
        }
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
    size_t rows = (size_t)B * ((size_t)num_cameras * p->tokens_per_image + prompt_len) + 1;
    p->images = calloc((size_t)B * num_cameras + 1, sizeof(float *));
    p->frames = calloc((size_t)B * num_cameras + 1, sizeof(pi0_frame));
    p->image_camera = calloc((size_t)B * num_cameras + 1, sizeof(int));
    p->image_start = calloc((size_t)B + 1, sizeof(int));
    p->prefix_src = malloc(rows * sizeof(int));
    p->prefix_start = calloc((size_t)B, sizeof(int));
    p->prefix_len = calloc((size_t)B, sizeof(int));
    p->prefix_keys = calloc((size_t)B, sizeof(int));
    p->cache_start = calloc((size_t)B, sizeof(int));
    p->prefix_segments = calloc((size_t)B, sizeof(attn_segment));
    return p->images && p->frames && p->image_camera && p->image_start && p->prefix_src && p->prefix_start &&
           p->prefix_len && p->prefix_keys && p->cache_start && p->prefix_segments;
}

static int alloc_suffix_rows(suffix_rows *r, int batch, int per_sample, int horizon) {
    size_t rows = (size_t)batch * per_sample;
    r->per_sample = per_sample;
    r->pos = malloc(rows * sizeof(int));
    r->cache_row = malloc(rows * sizeof(int));
    r->segments = calloc((size_t)batch, sizeof(attn_segment));
    r->action_rows = malloc((size_t)batch * horizon * sizeof(int));
    return r->pos && r->cache_row && r->segments && r->action_rows;
}

static void free_suffix_rows(suffix_rows *r) {
    free(r->pos), free(r->cache_row), free(r->segments), free(r->action_rows);
}

/* Sample b's rows of a step that runs its suffix tokens from `first` on (0: all of them; 1: Pi0's actions without
 * the state token), whose cache rows start at `cache` with the sample's `keys` prefix keys; S suffix tokens, the
 * last H of them actions. Whatever a step runs, its queries see the whole suffix in the cache. */
static void layout_suffix(suffix_rows *r, int b, int first, int S, int H, int keys, int cache) {
    int n = r->per_sample;
    for (int i = 0; i < n; i++) {
        r->pos[b * n + i] = keys + first + i;
        r->cache_row[b * n + i] = cache + keys + first + i;
    }
    /* Pi0's state token (suffix token 0) sees the prefix and itself; action tokens see everything */
    r->segments[b] = (attn_segment){.q_row = b * n, .num_q = n, .k_row = cache, .num_k = keys + S,
                                    .state_keys = first == 0 && S > H ? keys + 1 : 0};
    for (int i = 0; i < H; i++) r->action_rows[b * H + i] = b * n + n - H + i;
}

/* Where each prefix and suffix row lives and what it attends to (see the top of plan.h). */
static int layout_tokens(pi0_plan *p) {
    int S = p->suffix_len, H = p->horizon, state_token = S - H; /* 1 for Pi0, 0 for Pi0.5 */
    size_t prefix = (size_t)p->total_prefix + 1;
    p->prefix_pos = malloc(prefix * sizeof(int));
    p->prefix_cache_row = malloc(prefix * sizeof(int));
    if (!p->prefix_pos || !p->prefix_cache_row || !alloc_suffix_rows(&p->first_step, p->batch, S, H) ||
        !alloc_suffix_rows(&p->later_steps, p->batch, H, H))
        return -1;
    for (int b = 0; b < p->batch; b++) {
        int rows = p->prefix_len[b], keys = p->prefix_keys[b], start = p->prefix_start[b], cache = p->cache_start[b];
        /* cache: the keys, then the suffix, then rows computed but never attended to (uniform mode) */
        for (int i = 0; i < rows; i++) {
            p->prefix_pos[start + i] = i;
            p->prefix_cache_row[start + i] = cache + (i < keys ? i : S + i);
        }
        p->prefix_segments[b] = (attn_segment){.q_row = start, .num_q = rows, .k_row = cache, .num_k = keys};
        layout_suffix(&p->first_step, b, 0, S, H, keys, cache);
        layout_suffix(&p->later_steps, b, state_token, S, H, keys, cache);
    }
    return 0;
}

/* Sample s's prefix rows, keys first: its valid cameras' tokens, its valid prompt tokens; then, in uniform
 * mode, its masked cameras' tokens and padding tokens, computed but never keys. */
static void plan_sample(pi0_plan *p, const pi0_dims *dims, const pi0_batch *b, int s, int *row) {
    int P = p->tokens_per_image, C = b->num_cameras, L = b->prompt_len;
    size_t image = (size_t)dims->image_size * dims->image_size * 3;
    p->image_start[s] = p->num_images;
    p->prefix_start[s] = *row;
    for (int valid = 1; valid >= 0; valid--) {
        if (!valid && !b->uniform_shape) break;
        for (int c = 0; c < C; c++) {
            if (!b->image_masks[(size_t)s * C + c] != !valid) continue;
            for (int t = 0; t < P; t++) p->prefix_src[(*row)++] = p->num_images * P + t;
            if (b->frames && valid) p->frames[p->num_images] = b->frames[(size_t)s * C + c];
            else if (b->images && b->images[c]) p->images[p->num_images] = b->images[c] + (size_t)s * image;
            p->image_camera[p->num_images] = valid ? c : -1 - c;
            p->num_images++; /* a masked camera's image and frame stay NULL: zeros */
        }
        for (int i = 0; i < L; i++) {
            size_t at = (size_t)s * L + i;
            if (!b->prompt_mask[at] == !valid) p->prefix_src[(*row)++] = -(valid ? b->prompt_ids[at] : 0) - 1; /* pad: id 0 */
        }
        if (valid) p->prefix_keys[s] = *row - p->prefix_start[s];
    }
    p->prefix_len[s] = *row - p->prefix_start[s];
}

pi0_status plan_build(const pi0_dims *dims, const pi0_batch *b, pi0_plan *p, pi0_error *err) {
    memset(p, 0, sizeof *p);
    pi0_status st = check_batch(dims, b, err);
    if (st) return st;
    int B = b->batch;
    p->batch = B;
    p->tokens_per_image = image_tokens(dims);
    p->horizon = b->horizon ? b->horizon : dims->action_horizon;
    p->suffix_len = p->horizon + (dims->kind == PI0_MODEL_PI0);
    p->num_steps = b->num_steps ? b->num_steps : 10;
    p->state = b->state;
    p->has_frames = b->frames != NULL;
    if ((int64_t)B * ((int64_t)b->num_cameras * p->tokens_per_image + b->prompt_len + p->suffix_len) > (1 << 30))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "batch has too many tokens (%d samples of up to %d)", B,
                        b->num_cameras * p->tokens_per_image + b->prompt_len + p->suffix_len);
    if (!alloc_all(p, B, b->num_cameras, b->prompt_len)) goto oom;

    int rows = 0, cache_rows = 0;
    for (int s = 0; s < B; s++) {
        plan_sample(p, dims, b, s, &rows);
        p->cache_start[s] = cache_rows;
        cache_rows += p->prefix_len[s] + p->suffix_len;
        if (p->prefix_len[s] > p->max_prefix) p->max_prefix = p->prefix_len[s];
    }
    p->image_start[B] = p->num_images;
    size_t image_bytes = (size_t)dims->image_size * dims->image_size * 3 * sizeof(float);
    p->host_threads = b->images && (size_t)p->num_images * image_bytes > PLAN_HOST_THREADS_BYTES;
    p->total_prefix = rows;
    p->cache_rows = cache_rows;
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
    free(p->frames);
    free(p->image_camera);
    free(p->image_start);
    free(p->prefix_src);
    free(p->prefix_start);
    free(p->prefix_len);
    free(p->prefix_keys);
    free(p->cache_start);
    free(p->prefix_pos), free(p->prefix_cache_row), free(p->prefix_segments);
    free_suffix_rows(&p->first_step), free_suffix_rows(&p->later_steps);
    free(p->noise_owned);
    memset(p, 0, sizeof *p);
}

pi0_status plan_name_nonfinite_image(const pi0_plan *p, const pi0_dims *d, pi0_error *err) {
    size_t S = (size_t)d->image_size, image = S * S * 3, at;
    for (int s = 0; s < p->batch; s++)
        for (int i = p->image_start[s]; i < p->image_start[s + 1]; i++) {
            const float *pixels = plan_image_read(p, i);
            if (pixels && (at = first_nonfinite(pixels, image)) < image)
                return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "the image of camera %d, sample %d is %g at (y %zu, x %zu, "
                                "channel %zu): inputs must be finite", p->image_camera[i], s, pixels[at], at / (S * 3),
                                at / 3 % S, at % 3);
        }
    return PI0_OK;
}

pi0_status plan_check_images(const pi0_plan *p, const pi0_dims *d, pi0_error *err) {
    if (p->has_frames) return PI0_OK;
    size_t image = (size_t)d->image_size * d->image_size * 3;
    long long per_image = (long long)((image + FINITE_BLOCK - 1) / FINITE_BLOCK), blocks = p->num_images * per_image;
    uint32_t bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (p->host_threads)
    for (long long i = 0; i < blocks; i++) {
        const float *pixels = plan_image_read(p, (int)(i / per_image));
        size_t begin = (size_t)(i % per_image) * FINITE_BLOCK;
        if (pixels) bad |= nonfinite_block_bits(pixels + begin, image - begin < FINITE_BLOCK ? image - begin : FINITE_BLOCK);
    }
    return bad & 0x80000000u ? plan_name_nonfinite_image(p, d, err) : PI0_OK;
}
