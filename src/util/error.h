/* error.h - filling a pi0_error: every failure path returns through pi0_fail. */
#ifndef PI0_UTIL_ERROR_H
#define PI0_UTIL_ERROR_H

#include "pi0.h"

/* Records `status` and a printf-style message in `err` (when not NULL) and returns `status`. */
pi0_status pi0_fail(pi0_error *err, pi0_status status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
