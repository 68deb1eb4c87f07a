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

enum { FINITE_BLOCK = 4096 }; /* floats a vector pass takes */

/* nonfinite_bits of one block of up to FINITE_BLOCK floats: a constant trip count for full blocks, so that the
 * vectorizer needs no remainder loop there. */
static inline uint32_t nonfinite_block_bits(const float *x, size_t count) {
    return count == FINITE_BLOCK ? nonfinite_bits(x, FINITE_BLOCK) : nonfinite_bits(x, count);
}

/* Index of the first NaN or infinity among x[0..n), or n when all are finite. */
static inline size_t first_nonfinite(const float *x, size_t n) {
    for (size_t begin = 0; begin < n; begin += FINITE_BLOCK) {
        size_t count = n - begin < FINITE_BLOCK ? n - begin : FINITE_BLOCK;
        if (!(nonfinite_block_bits(x + begin, count) & 0x80000000u)) continue;
        for (size_t i = begin; i < begin + count; i++)
            if (!isfinite(x[i])) return i;
    }
    return n;
}

#endif
