#include "util/error.h"

#include <stdarg.h>
#include <stdio.h>

const char *pi0_status_name(pi0_status status) {
    switch (status) {
    case PI0_OK: return "ok";
    case PI0_ERR_INVALID_ARGUMENT: return "invalid argument";
    case PI0_ERR_IO: return "i/o error";
    case PI0_ERR_FORMAT: return "bad format";
    case PI0_ERR_CHECKPOINT: return "checkpoint mismatch";
    case PI0_ERR_OUT_OF_MEMORY: return "out of memory";
    case PI0_ERR_BACKEND: return "backend error";
    case PI0_ERR_NUMERIC: return "numerical error";
    }
    return "unknown error";
}

pi0_status pi0_fail(pi0_error *err, pi0_status status, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, ap);
        va_end(ap);
        err->status = status;
    }
    return status;
}
