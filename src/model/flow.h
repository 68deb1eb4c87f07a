/*
 * flow.h - the flow-matching schedule every backend and the policy share (docs/model.md#sampling):
 * the Euler steps' flow times, the sin-cos time embedding, and the seeded noise x(t = 1).
 */
#ifndef PI0_MODEL_FLOW_H
#define PI0_MODEL_FLOW_H

#include <stddef.h>
#include <stdint.h>

/* Flow time of each Euler step (1, 1 + dt, ...), accumulated in float32 like openpi. */
void flow_times(int num_steps, float *t);

/* Sin-cos embedding of flow time t over `width` features (docs/model.md#time-embedding), in double. */
void time_embedding(float t, int width, float *out);

/* n standard normal floats from `seed`: the noise pi0_sample_actions draws when the caller gives none,
 * element i depending on (seed, i) only, so a sample gets the same noise alone or in a batch. */
void flow_noise(uint64_t seed, float *noise, size_t n);

#endif
