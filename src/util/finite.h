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

/* Index of the first NaN or infinity among x[0..n), or n when all are finite. */
static inline size_t first_nonfinite(const float *x, size_t n) {
    enum { BLOCK = 4096 };
    for (size_t begin = 0; begin < n; begin += BLOCK) {
        size_t count = n - begin < BLOCK ? n - begin : BLOCK;
        uint32_t bad = 0;
        /* NaN and infinity are the floats whose exponent bits are all ones */
#pragma omp simd reduction(| : bad)
        for (size_t i = 0; i < count; i++) {
            uint32_t bits;
            memcpy(&bits, &x[begin + i], sizeof bits);
            bad |= (bits & 0x7f800000u) == 0x7f800000u;
        }
        if (!bad) continue;
        for (size_t i = begin; i < begin + count; i++)
            if (!isfinite(x[i])) return i;
    }
    return n;
}

#endif
