/* json_kind.h - a JSON value's type in words, for error messages about files the user wrote. */
#ifndef PI0_UTIL_JSON_KIND_H
#define PI0_UTIL_JSON_KIND_H

#include <jansson.h>

static inline const char *json_kind(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER:
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    case JSON_NULL: return "null";
    }
    return "an unknown JSON value";
}

#endif
