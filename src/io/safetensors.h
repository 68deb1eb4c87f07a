/*
 * safetensors.h - a memory-mapped reader and a small writer for the safetensors format.
 *
 * File layout: u64 little-endian header size N, N bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
 * then the data region; offsets are relative to the start of the data region.
 *
 * The reader trusts nothing: the header size, every offset, every shape product (overflow-checked),
 * dtype sizes, duplicate names and overlapping tensors are validated against the file size before
 * any tensor is handed out, so a corrupt or hostile file yields PI0_ERR_FORMAT, never a bad read.
 */
#ifndef PI0_IO_SAFETENSORS_H
#define PI0_IO_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "pi0.h"

#define ST_MAX_RANK 8

typedef enum { ST_F32, ST_BF16, ST_F16, ST_I32, ST_I64, ST_BOOL, ST_U8 } st_dtype;

typedef struct {
    char *name;
    st_dtype dtype;
    int rank;
    int64_t shape[ST_MAX_RANK];
    uint64_t numel;
    uint64_t nbytes;
    const void *data; /* inside the mapping; may be unaligned */
} st_tensor;

typedef struct {
    void *map;
    size_t map_size;
    st_tensor *tensors; /* sorted by name */
    int num_tensors;
    char **meta_keys, **meta_values; /* __metadata__ string pairs */
    int num_meta;
} st_file;

const char *st_dtype_name(st_dtype dtype);
size_t st_dtype_size(st_dtype dtype);

/* Maps and validates `path`. On failure `file` is left empty (st_close is still safe). */
pi0_status st_open(const char *path, st_file *file, pi0_error *err);
void st_close(st_file *file);

/* The tensor called `name`, or NULL. */
const st_tensor *st_find(const st_file *file, const char *name);
/* The metadata value for `key`, or NULL. */
const char *st_meta(const st_file *file, const char *key);

/* Converts `t` to float32 in `out` (t->numel elements). Handles F32, BF16, F16, I32, I64, BOOL, U8. */
void st_to_f32(const st_tensor *t, float *out);

/* "[2, 224, 224, 3]" into buf. */
const char *st_shape_str(int rank, const int64_t *shape, char *buf, size_t size);

/* Writer: add tensors (data is copied by reference until st_writer_write), then write the file. */
typedef struct {
    const char *name;
    st_dtype dtype;
    int rank;
    int64_t shape[ST_MAX_RANK];
    const void *data;
} st_entry;

typedef struct {
    st_entry *entries;
    int count, capacity;
    char **meta_keys, **meta_values;
    int num_meta;
} st_writer;

void st_writer_init(st_writer *w);
pi0_status st_writer_add(st_writer *w, const char *name, st_dtype dtype, int rank, const int64_t *shape,
                         const void *data, pi0_error *err);
pi0_status st_writer_meta(st_writer *w, const char *key, const char *value, pi0_error *err);
pi0_status st_writer_write(const st_writer *w, const char *path, pi0_error *err);
void st_writer_free(st_writer *w);

#endif
