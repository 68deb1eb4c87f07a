/*
 * observation.c - the policy's input: named fields as an openpi client's dict holds them (pi0_policy.h).
 * The wire codec (src/server/msgpack_numpy.c) and embedding programs both build observations here.
 */
#include "policy/observation.h"

#include <stdlib.h>
#include <string.h>

#include "util/error.h"

static const struct {
    const char *str; /* numpy's dtype.str on a little-endian host */
    size_t size;
    char kind;       /* numpy's dtype.kind */
} dtype_info[] = {
    [PI0_DTYPE_BOOL] = {"|b1", 1, 'b'}, [PI0_DTYPE_U8] = {"|u1", 1, 'u'},  [PI0_DTYPE_I8] = {"|i1", 1, 'i'},
    [PI0_DTYPE_U16] = {"<u2", 2, 'u'},  [PI0_DTYPE_I16] = {"<i2", 2, 'i'}, [PI0_DTYPE_U32] = {"<u4", 4, 'u'},
    [PI0_DTYPE_I32] = {"<i4", 4, 'i'},  [PI0_DTYPE_U64] = {"<u8", 8, 'u'}, [PI0_DTYPE_I64] = {"<i8", 8, 'i'},
    [PI0_DTYPE_F16] = {"<f2", 2, 'f'},  [PI0_DTYPE_F32] = {"<f4", 4, 'f'}, [PI0_DTYPE_F64] = {"<f8", 8, 'f'},
};

static int dtype_valid(pi0_dtype dtype) { return (unsigned)dtype < sizeof dtype_info / sizeof dtype_info[0]; }

size_t pi0_dtype_size(pi0_dtype dtype) { return dtype_valid(dtype) ? dtype_info[dtype].size : 0; }
const char *pi0_dtype_str(pi0_dtype dtype) { return dtype_valid(dtype) ? dtype_info[dtype].str : "?"; }
char observation_dtype_kind(pi0_dtype dtype) { return dtype_valid(dtype) ? dtype_info[dtype].kind : '?'; }

void *observation_alloc_data(size_t bytes) {
    if (bytes > SIZE_MAX - OBSERVATION_ALIGN) return NULL;
    size_t rounded = bytes ? (bytes + OBSERVATION_ALIGN - 1) / OBSERVATION_ALIGN * OBSERVATION_ALIGN : OBSERVATION_ALIGN;
    return aligned_alloc(OBSERVATION_ALIGN, rounded);
}

int observation_shape_numel(int ndim, const int64_t *shape, uint64_t *numel) {
    uint64_t product = 1;
    int has_zero = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return 0;
        if (shape[i] == 0) {
            has_zero = 1;
            continue;
        }
        if (product > (uint64_t)INT64_MAX / (uint64_t)shape[i]) return 0;
        product *= (uint64_t)shape[i];
    }
    *numel = has_zero ? 0 : product;
    return 1;
}

int64_t pi0_field_numel(const pi0_field *f) {
    uint64_t numel = 0;
    if (!f || f->ndim < 0 || f->ndim > PI0_MAX_NDIM || !observation_shape_numel(f->ndim, f->shape, &numel)) return 0;
    return (int64_t)numel;
}

pi0_status observation_append(pi0_observation *obs, pi0_field field, pi0_error *err) {
    if (obs->count == obs->capacity) {
        int cap = obs->capacity ? 2 * obs->capacity : 16;
        pi0_field *grown = cap > obs->capacity ? realloc(obs->fields, (size_t)cap * sizeof *grown) : NULL;
        if (!grown) {
            free(field.key), free(field.data), free(field.string);
            return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory for an observation of %d fields", obs->count);
        }
        obs->fields = grown, obs->capacity = cap;
    }
    obs->fields[obs->count++] = field;
    return PI0_OK;
}

/* The checks both adders share: arguments present and the key new. */
static pi0_status check_new_key(const pi0_observation *obs, const char *key, pi0_error *err) {
    if (!obs || !key || !key[0]) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "observation: NULL or empty key");
    if (pi0_observation_find(obs, key))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "observation: key \"%s\" is already there", key);
    return PI0_OK;
}

pi0_status pi0_observation_add_array(pi0_observation *obs, const char *key, pi0_dtype dtype, int ndim,
                                     const int64_t *shape, const void *data, pi0_error *err) {
    pi0_status st = check_new_key(obs, key, err);
    if (st) return st;
    uint64_t numel = 0;
    if (!dtype_valid(dtype) || ndim < 0 || ndim > PI0_MAX_NDIM || (ndim && !shape) ||
        !observation_shape_numel(ndim, shape, &numel) || numel > SIZE_MAX / pi0_dtype_size(dtype) || (numel && !data))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "observation: \"%s\" has a bad dtype, shape or no data", key);
    size_t bytes = (size_t)numel * pi0_dtype_size(dtype);
    pi0_field f = {.kind = PI0_FIELD_ARRAY, .dtype = dtype, .ndim = ndim, .key = strdup(key),
                   .data = observation_alloc_data(bytes)};
    if (!f.key || !f.data) {
        free(f.key), free(f.data);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "observation: out of memory for \"%s\"", key);
    }
    if (ndim) memcpy(f.shape, shape, (size_t)ndim * sizeof *shape);
    if (bytes) memcpy(f.data, data, bytes);
    if (dtype == PI0_DTYPE_BOOL)
        for (size_t i = 0; i < bytes; i++) ((uint8_t *)f.data)[i] = ((uint8_t *)f.data)[i] != 0;
    return observation_append(obs, f, err);
}

pi0_status pi0_observation_add_string(pi0_observation *obs, const char *key, const char *value, pi0_error *err) {
    pi0_status st = check_new_key(obs, key, err);
    if (st) return st;
    if (!value) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "observation: \"%s\" is a NULL string", key);
    pi0_field f = {.kind = PI0_FIELD_STRING, .key = strdup(key), .string = strdup(value)};
    if (!f.key || !f.string) {
        free(f.key), free(f.string);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "observation: out of memory for \"%s\"", key);
    }
    return observation_append(obs, f, err);
}

const pi0_field *pi0_observation_find(const pi0_observation *obs, const char *key) {
    if (!obs || !key) return NULL;
    for (int i = 0; i < obs->count; i++)
        if (strcmp(obs->fields[i].key, key) == 0) return &obs->fields[i];
    return NULL;
}

void pi0_observation_free(pi0_observation *obs) {
    if (!obs) return;
    for (int i = 0; i < obs->count; i++) {
        free(obs->fields[i].key);
        free(obs->fields[i].data);
        free(obs->fields[i].string);
    }
    free(obs->fields);
    *obs = (pi0_observation){0};
}
