/* clock.h - a monotonic wall clock in milliseconds. */
#ifndef PI0_UTIL_CLOCK_H
#define PI0_UTIL_CLOCK_H

#include <time.h>

static inline double pi0_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

#endif
