/*
 * plan.h - which tokens of a batch exist, and where they live.
 *
 * Invalid tokens (masked cameras, prompt padding) affect no valid token (docs/masks.md), so by default the
 * engine drops them before any work: the valid prefix tokens of all samples are packed one sample after
 * another, sample b owning rows [prefix_start[b], prefix_start[b] + prefix_len[b]): its valid cameras'
 * 256 tokens each, in camera order, then its valid prompt tokens; positions are row - prefix_start[b],
 * which is exactly cumsum(valid) - 1. prefix_src says what each row is (an image token or a prompt id).
 *
 * In uniform mode (pi0_batch.uniform_shape) every camera and prompt slot is a row, so that every batch of
 * the same size, cameras and prompt length has the same shape: after a sample's prefix_keys valid rows
 * come its masked cameras' tokens and its padding tokens, computed but never keys (nothing attends to
 * them, and their K/V go past the sample's suffix rows in the cache).
 *
 * The K/V cache of one layer holds, per sample, its valid prefix rows followed by its suffix rows (Pi0:
 * the state token and H action tokens; Pi0.5: the H action tokens), then any rows that are not keys, so
 * the denoise attention of a sample reads one contiguous range of keys.
 */
#ifndef PI0_MODEL_PLAN_H
#define PI0_MODEL_PLAN_H

#include <stdint.h>

#include "pi0.h"

/*
 * One attention problem, in the same form for every backend: queries [q_row, q_row + num_q)
 * against keys/values [k_row, k_row + num_k). When state_keys > 0 the first query sees only the
 * first state_keys keys (Pi0's state token must not see the action tokens); every other query sees
 * all num_k keys.
 */
typedef struct {
    int q_row, num_q, k_row, num_k, state_keys;
} attn_segment;

/*
 * One denoise step's suffix rows, sample b's at [b per_sample, (b + 1) per_sample): each row's RoPE position and K/V
 * cache row, one attention segment per sample, and which rows are the action tokens.
 */
typedef struct {
    int per_sample;
    int *pos, *cache_row;    /* [batch per_sample] */
    attn_segment *segments;  /* [batch] */
    int *action_rows;        /* [batch horizon] */
} suffix_rows;

typedef struct {
    int batch, horizon, num_steps;
    int suffix_len;             /* suffix rows per sample: H + 1 with Pi0's state token, H for Pi0.5 */
    int tokens_per_image;
    int num_images;             /* camera images to encode over the batch */
    /* [num_images], sample-major, the valid ones first; the caller's images or its frames (has_frames), the
     * other NULL. A masked camera (uniform mode) keeps the caller's image if it gave one; its frame, or an image it
     * did not give, is NULL: zeros. */
    const float **images;
    pi0_frame *frames;
    int *image_camera;          /* [num_images]: the camera of each image; -1 - camera for a masked one (uniform mode) */
    int has_frames;
    /* Whether the host's passes over the images (the finiteness check, the CUDA backend's copy into pinned memory) run
     * on the OpenMP threads: past PLAN_HOST_THREADS_BYTES of images, where they are most of a call's host time. */
    int host_threads;
    int *image_start;           /* [batch + 1]: sample b owns images [image_start[b], image_start[b+1]) */
    int *prefix_src;            /* [total_prefix]: >= 0 image token images * P + t, else prompt id -src - 1 */
    int *prefix_start, *prefix_len; /* [batch] packed prefix rows */
    int *prefix_keys;           /* [batch] the first prefix_keys[b] rows of sample b are its valid tokens */
    int total_prefix;
    int *cache_start;           /* [batch] first K/V cache row of sample b */
    int cache_rows;             /* sum of prefix_len[b] + suffix_len */
    int max_prefix;
    /* per prefix row (total_prefix): RoPE position and K/V cache row; one attention segment per sample */
    int *prefix_pos, *prefix_cache_row;
    attn_segment *prefix_segments;
    /* The first denoise step runs every suffix row (Pi0's state token, then the H actions); the later steps run the
     * actions alone. The state token sees only the prefix and itself, neither of which changes from step to step,
     * so its path through the expert, and the K/V it leaves in the cache, are the first step's every time. Pi0.5 has
     * no state token: the two are the same. */
    suffix_rows first_step, later_steps;
    const float *state;         /* (B, action_dim); Pi0.5 does not read it */
    const float *noise;         /* (B, H, action_dim): the caller's, or noise_owned */
    float *noise_owned;
} pi0_plan;

/* 64 samples of two cameras are 77 MB of float32 images: checked and copied by one thread, they cost ~17 ms more of a
 * ~300 ms call than on an H200 host's 16 (bench/NOTES.md, session 18). One sample's 1.2 MB was slower on threads (p50
 * 9.77 -> 9.86 ms). */
#define PLAN_HOST_THREADS_BYTES ((size_t)4 << 20)

/* Tokens one camera image contributes: one per patch. */
static inline int image_tokens(const pi0_dims *d) {
    return (d->image_size / d->patch_size) * (d->image_size / d->patch_size);
}

/* The pixels of image i that the model reads: a valid camera's image; NULL for a masked camera's (its tokens are never
 * keys, so what it holds does not reach the actions, and it is not checked). */
static inline const float *plan_image_read(const pi0_plan *p, int i) {
    return p->image_camera[i] >= 0 ? p->images[i] : NULL;
}

/* The suffix rows that denoise step `step` runs. */
static inline const suffix_rows *plan_step_rows(const pi0_plan *p, int step) {
    return step == 0 ? &p->first_step : &p->later_steps;
}

/* Validates `batch` against `dims` (shapes, token ids, limits) and builds the plan. */
pi0_status plan_build(const pi0_dims *dims, const pi0_batch *batch, pi0_plan *plan, pi0_error *err);
void plan_free(pi0_plan *plan);

/* A NaN or infinity in a valid camera's image would come out as NaN actions: PI0_ERR_INVALID_ARGUMENT naming the first
 * one (sample, camera, pixel), else PI0_OK. One vector pass over the images (on the OpenMP threads with host_threads),
 * then a search image by image only when it found one. Frames are bytes: always finite. */
pi0_status plan_check_images(const pi0_plan *plan, const pi0_dims *dims, pi0_error *err);

/* The search alone: for a backend that found a NaN or infinity in the images itself (the CUDA backend, on the
 * device). */
pi0_status plan_name_nonfinite_image(const pi0_plan *plan, const pi0_dims *dims, pi0_error *err);

#endif
