/*
 * finite.h - finding NaN or infinity in large float arrays (camera images, noise, actions). Inputs are
 * almost always clean, so each block gets one branch-free vector pass, and only a block that has a bad
 * value is searched element by element.
 */
#ifndef PI0_UTIL_FINITE_H
#define PI0_UTIL_FINITE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Bit 31 set in the result when one of x[0..count) is NaN or infinity: those are the floats whose exponent bits
 * are all ones, and only for them does adding 1 to the exponent field carry into the sign bit. Integer and, add
 * and or only (no compares), so compilers vectorize it: GCC 13 made a slow loop of the compare form
 * ((bits & exp) == exp), 4x slower than this on a 1.2 MB image (bench/NOTES.md, session 14). */
static inline uint32_t nonfinite_bits(const float *x, size_t count) {
    uint32_t bad = 0;
    for (size_t i = 0; i < count; i++) {
        uint32_t bits;
        memcpy(&bits, &x[i], sizeof bits);
        bad |= (bits & 0x7f800000u) + 0x00800000u;
    }
    return bad;
}

/* Index of the first NaN or infinity among x[0..n), or n when all are finite. */
static inline size_t first_nonfinite(const float *x, size_t n) {
    enum { BLOCK = 4096 };
    for (size_t begin = 0; begin < n; begin += BLOCK) {
        size_t count = n - begin < BLOCK ? n - begin : BLOCK;
        /* a constant trip count for the full blocks: the vectorizer needs no remainder loop there */
        uint32_t bad = count == BLOCK ? nonfinite_bits(x + begin, BLOCK) : nonfinite_bits(x + begin, count);
        if (!(bad & 0x80000000u)) continue;
        for (size_t i = begin; i < begin + count; i++)
            if (!isfinite(x[i])) return i;
    }
    return n;
}

#endif
