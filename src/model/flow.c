#include "model/flow.h"

#include <math.h>

#include "util/rng.h"

void flow_times(int num_steps, float *t) {
    float dt = -1.0f / (float)num_steps, now = 1.0f;
    for (int i = 0; i < num_steps; i++, now += dt) t[i] = now;
}

void time_embedding(float t, int width, float *out) {
    int half = width / 2;
    for (int i = 0; i < half; i++) {
        double fraction = half > 1 ? (double)i / (half - 1) : 0.0;
        double period = 4e-3 * pow(4.0 / 4e-3, fraction);
        double angle = (double)t * 2.0 * M_PI / period;
        out[i] = (float)sin(angle);
        out[half + i] = (float)cos(angle);
    }
}

void flow_noise(uint64_t seed, float *noise, size_t n) {
    uint64_t stream = rng_mix64(seed ^ 0x6e6f697365ull); /* "noise" */
    for (size_t i = 0; i < n; i++) noise[i] = rng_normal(stream, i);
}
