/* rng.h - small deterministic generators: counter-based, so results do not depend on thread count. */
#ifndef PI0_UTIL_RNG_H
#define PI0_UTIL_RNG_H

#include <math.h>
#include <stdint.h>

/* splitmix64's finaliser: a good 64-bit mix of a counter. */
static inline uint64_t rng_mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* FNV-1a of a string, to derive a per-tensor stream from a name. */
static inline uint64_t rng_hash_str(const char *s) {
    uint64_t h = 0xcbf29ce484222325ull;
    while (*s) h = (h ^ (uint8_t)*s++) * 0x100000001b3ull;
    return h;
}

/* Uniform in [-1, 1) from element `i` of stream `stream`: splitmix64's i-th output, one mix per draw. */
static inline float rng_uniform_pm1(uint64_t stream, uint64_t i) {
    uint64_t bits = rng_mix64(stream + i * 0x9e3779b97f4a7c15ull);
    return (float)(int32_t)(bits >> 32) * (1.0f / 2147483648.0f);
}

/* Standard normal from element `i` of stream `stream` (Box-Muller on two counter draws). */
static inline float rng_normal(uint64_t stream, uint64_t i) {
    uint64_t a = rng_mix64(stream ^ rng_mix64(2 * i)), b = rng_mix64(stream ^ rng_mix64(2 * i + 1));
    double u1 = ((double)(a >> 11) + 1.0) * (1.0 / 9007199254740992.0); /* (0, 1] */
    double u2 = (double)(b >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

#endif
