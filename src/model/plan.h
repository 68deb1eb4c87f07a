/*
 * plan.h - which tokens of a batch exist, and where they live.
 *
 * Invalid tokens (masked cameras, prompt padding) affect no valid token (PI0_SPEC §3), so the
 * engine drops them before any work: the valid prefix tokens of all samples are packed one sample
 * after another, sample b owning rows [prefix_start[b], prefix_start[b] + prefix_len[b]). Within a
 * sample the order is the valid cameras' 256 tokens each, in camera order, then the valid prompt
 * tokens; positions are row - prefix_start[b], which is exactly cumsum(valid) - 1.
 *
 * The K/V cache of one layer holds, per sample, its prefix rows followed by room for its H + 1
 * suffix rows, so the denoise attention of a sample reads one contiguous range of keys.
 */
#ifndef PI0_MODEL_PLAN_H
#define PI0_MODEL_PLAN_H

#include <stdint.h>

#include "pi0.h"

typedef struct {
    int batch, horizon, num_steps;
    int num_images;             /* valid camera images over the batch */
    const float **images;       /* [num_images], sample-major, camera order */
    int *image_start;           /* [batch + 1]: sample b owns images [image_start[b], image_start[b+1]) */
    int32_t *prompt_ids;        /* valid prompt ids, packed */
    int *prompt_start;          /* [batch + 1], into prompt_ids */
    int *prefix_start, *prefix_len; /* [batch] packed prefix rows */
    int total_prefix;
    int *cache_start;           /* [batch] first K/V cache row of sample b */
    int cache_rows;             /* sum of prefix_len[b] + horizon + 1 */
    int max_prefix;
    const float *state;         /* (B, action_dim) */
    const float *noise;         /* (B, H, action_dim): the caller's, or noise_owned */
    float *noise_owned;
} pi0_plan;

/* Validates `batch` against `dims` (shapes, token ids, limits) and builds the plan. */
pi0_status plan_build(const pi0_dims *dims, const pi0_batch *batch, pi0_plan *plan, pi0_error *err);
void plan_free(pi0_plan *plan);

#endif
