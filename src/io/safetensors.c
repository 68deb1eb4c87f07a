/*
 * safetensors.c - the reader validates the whole header against the file size before handing out a
 * single tensor, so every st_tensor points at bytes inside the mapping; the writer builds the header
 * with jansson and replaces the target atomically (temporary file in the same directory + rename).
 */
#include "io/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util/error.h"
#include "util/half.h"

/* About the reference implementation's limit (100 MB); real checkpoints need well under 1 MiB. */
#define ST_MAX_HEADER ((uint64_t)100 << 20)
/* st_to_f32 converts blocks of this many elements, in parallel when there are several. */
#define ST_CONVERT_BLOCK ((size_t)1 << 16)
/* The writer hands data to fwrite in pieces of this size, so multi-GB tensors never meet a libc
   or kernel limit on a single write. */
#define ST_WRITE_CHUNK ((size_t)64 << 20)

static const struct {
    const char *name;
    size_t size;
} dtype_info[] = {
    [ST_F32] = {"F32", 4}, [ST_BF16] = {"BF16", 2}, [ST_F16] = {"F16", 2}, [ST_I32] = {"I32", 4},
    [ST_I64] = {"I64", 8}, [ST_BOOL] = {"BOOL", 1}, [ST_U8] = {"U8", 1},
};
#define NUM_DTYPES ((int)(sizeof dtype_info / sizeof dtype_info[0]))

static int dtype_valid(st_dtype dtype) { return (unsigned)dtype < (unsigned)NUM_DTYPES; }

const char *st_dtype_name(st_dtype dtype) { return dtype_valid(dtype) ? dtype_info[dtype].name : "?"; }

size_t st_dtype_size(st_dtype dtype) { return dtype_valid(dtype) ? dtype_info[dtype].size : 0; }

const char *st_shape_str(int rank, const int64_t *shape, char *buf, size_t size) {
    if (size == 0) return buf;
    /* snprintf returns the length it wanted; once that reaches `size` the output is full. */
    size_t used = (size_t)snprintf(buf, size, "[");
    for (int i = 0; i < rank && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < size) snprintf(buf + used, size - used, "]");
    return buf;
}

/* --- reader ------------------------------------------------------------------------------------ */

/* What the header parser needs to name the file in messages and to bound the offsets. */
typedef struct {
    const char *path;
    const unsigned char *data; /* start of the data region */
    uint64_t data_size;
    pi0_error *err;
} st_parser;

static uint64_t read_u64_le(const unsigned char *p) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--) value = value << 8 | p[i];
    return value;
}

static uint64_t tensor_offset(const st_parser *p, const st_tensor *t) {
    return (uint64_t)((const unsigned char *)t->data - p->data);
}

static pi0_status parse_dtype(const st_parser *p, const char *name, const json_t *value, st_tensor *t) {
    const char *text = json_string_value(value); /* NULL when not a string */
    if (!text) return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': dtype is not a string", p->path, name);
    for (int d = 0; d < NUM_DTYPES; d++) {
        if (strcmp(text, dtype_info[d].name) == 0) {
            t->dtype = (st_dtype)d;
            return PI0_OK;
        }
    }
    return pi0_fail(p->err, PI0_ERR_FORMAT,
                    "%s: tensor '%s': unsupported dtype '%s' (supported: F32, BF16, F16, I32, I64, BOOL, U8)",
                    p->path, name, text);
}

/* Fills rank, shape and numel; numel of a rank-0 tensor (a scalar) is 1. */
static pi0_status parse_shape(const st_parser *p, const char *name, const json_t *value, st_tensor *t) {
    if (!json_is_array(value))
        return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': shape is not an array", p->path, name);
    size_t rank = json_array_size(value);
    if (rank > ST_MAX_RANK)
        return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': rank %zu exceeds the maximum of %d", p->path,
                        name, rank, ST_MAX_RANK);
    uint64_t numel = 1;
    for (size_t i = 0; i < rank; i++) {
        const json_t *dim = json_array_get(value, i);
        if (!json_is_integer(dim))
            return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': dimension %zu of the shape is not an integer",
                            p->path, name, i);
        json_int_t size = json_integer_value(dim);
        if (size < 0)
            return pi0_fail(p->err, PI0_ERR_FORMAT,
                            "%s: tensor '%s': dimension %zu of the shape is negative (%" JSON_INTEGER_FORMAT ")",
                            p->path, name, i, size);
        if (size != 0 && numel > UINT64_MAX / (uint64_t)size)
            return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': the element count of the shape overflows 64 bits",
                            p->path, name);
        numel *= (uint64_t)size;
        t->shape[i] = size;
    }
    t->rank = (int)rank;
    t->numel = numel;
    return PI0_OK;
}

static pi0_status parse_offsets(const st_parser *p, const char *name, const json_t *value, uint64_t *begin,
                                uint64_t *end) {
    const json_t *first = json_array_get(value, 0), *second = json_array_get(value, 1);
    if (!json_is_array(value) || json_array_size(value) != 2 || !json_is_integer(first) || !json_is_integer(second) ||
        json_integer_value(first) < 0 || json_integer_value(second) < 0)
        return pi0_fail(p->err, PI0_ERR_FORMAT,
                        "%s: tensor '%s': data_offsets must be [begin, end] with non-negative integers", p->path, name);
    *begin = (uint64_t)json_integer_value(first);
    *end = (uint64_t)json_integer_value(second);
    if (*end < *begin)
        return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] end before they begin",
                        p->path, name, (unsigned long long)*begin, (unsigned long long)*end);
    if (*end > p->data_size)
        return pi0_fail(p->err, PI0_ERR_FORMAT,
                        "%s: tensor '%s': data_offsets [%llu, %llu] exceed the data region (%llu bytes)", p->path, name,
                        (unsigned long long)*begin, (unsigned long long)*end, (unsigned long long)p->data_size);
    return PI0_OK;
}

/* One {"dtype", "shape", "data_offsets"} entry; anything else in it is rejected, since a field we do
   not understand may change what the bytes mean. */
static pi0_status parse_tensor(const st_parser *p, const char *name, json_t *value, st_tensor *t) {
    if (name[0] == '\0') return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: empty tensor name", p->path);
    if (!json_is_object(value))
        return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': entry is not a JSON object", p->path, name);
    json_t *dtype = NULL, *shape = NULL, *offsets = NULL, *field;
    const char *key;
    json_object_foreach(value, key, field) {
        if (strcmp(key, "dtype") == 0) dtype = field;
        else if (strcmp(key, "shape") == 0) shape = field;
        else if (strcmp(key, "data_offsets") == 0) offsets = field;
        else return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': unknown field '%s'", p->path, name, key);
    }
    const char *missing = !dtype ? "dtype" : !shape ? "shape" : !offsets ? "data_offsets" : NULL;
    if (missing) return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': missing '%s'", p->path, name, missing);

    uint64_t begin = 0, end = 0;
    pi0_status status = parse_dtype(p, name, dtype, t);
    if (status == PI0_OK) status = parse_shape(p, name, shape, t);
    if (status == PI0_OK) status = parse_offsets(p, name, offsets, &begin, &end);
    if (status != PI0_OK) return status;

    uint64_t size = dtype_info[t->dtype].size;
    if (t->numel > UINT64_MAX / size)
        return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: tensor '%s': the byte size of the shape overflows 64 bits",
                        p->path, name);
    t->nbytes = t->numel * size;
    if (t->nbytes != end - begin) {
        char shape_text[160];
        return pi0_fail(p->err, PI0_ERR_FORMAT,
                        "%s: tensor '%s': shape %s of %s needs %llu bytes but data_offsets [%llu, %llu] span %llu",
                        p->path, name, st_shape_str(t->rank, t->shape, shape_text, sizeof shape_text),
                        dtype_info[t->dtype].name, (unsigned long long)t->nbytes, (unsigned long long)begin,
                        (unsigned long long)end, (unsigned long long)(end - begin));
    }
    t->data = p->data + begin;
    t->name = strdup(name);
    if (!t->name) return pi0_fail(p->err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", p->path);
    return PI0_OK;
}

static pi0_status parse_metadata(const st_parser *p, json_t *value, st_file *file) {
    if (!json_is_object(value))
        return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: __metadata__ is not a JSON object", p->path);
    size_t count = json_object_size(value);
    if (count == 0) return PI0_OK;
    file->meta_keys = calloc(count, sizeof *file->meta_keys);
    file->meta_values = calloc(count, sizeof *file->meta_values);
    if (!file->meta_keys || !file->meta_values)
        return pi0_fail(p->err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", p->path);
    const char *key;
    json_t *entry;
    json_object_foreach(value, key, entry) {
        const char *text = json_string_value(entry);
        if (!text)
            return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: __metadata__ value of '%s' is not a string", p->path, key);
        /* Counted before the checks so st_close frees whichever of the two strdups succeeded. */
        int i = file->num_meta++;
        file->meta_keys[i] = strdup(key);
        file->meta_values[i] = strdup(text);
        if (!file->meta_keys[i] || !file->meta_values[i])
            return pi0_fail(p->err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", p->path);
    }
    return PI0_OK;
}

static int compare_by_offset(const void *a, const void *b) {
    const st_tensor *x = a, *y = b;
    const unsigned char *px = x->data, *py = y->data;
    if (px != py) return px < py ? -1 : 1;
    return (x->nbytes > y->nbytes) - (x->nbytes < y->nbytes);
}

static int compare_by_name(const void *a, const void *b) {
    return strcmp(((const st_tensor *)a)->name, ((const st_tensor *)b)->name);
}

/* Sorted by begin, non-empty tensors must each start at or after the end of the previous non-empty
   one; empty tensors occupy no bytes and cannot overlap anything. */
static pi0_status check_overlaps(const st_parser *p, st_file *file) {
    qsort(file->tensors, (size_t)file->num_tensors, sizeof *file->tensors, compare_by_offset);
    const st_tensor *previous = NULL;
    for (int i = 0; i < file->num_tensors; i++) {
        const st_tensor *t = &file->tensors[i];
        if (t->nbytes == 0) continue;
        if (previous && tensor_offset(p, t) < tensor_offset(p, previous) + previous->nbytes)
            return pi0_fail(p->err, PI0_ERR_FORMAT,
                            "%s: tensors '%s' [%llu, %llu] and '%s' [%llu, %llu] overlap", p->path, previous->name,
                            (unsigned long long)tensor_offset(p, previous),
                            (unsigned long long)(tensor_offset(p, previous) + previous->nbytes), t->name,
                            (unsigned long long)tensor_offset(p, t),
                            (unsigned long long)(tensor_offset(p, t) + t->nbytes));
        previous = t;
    }
    return PI0_OK;
}

static pi0_status parse_header(const st_parser *p, json_t *root, st_file *file) {
    if (!json_is_object(root)) return pi0_fail(p->err, PI0_ERR_FORMAT, "%s: the header must be a JSON object", p->path);
    size_t count = json_object_size(root) - (json_object_get(root, "__metadata__") != NULL);
    if (count > 0 && !(file->tensors = calloc(count, sizeof *file->tensors)))
        return pi0_fail(p->err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", p->path);
    const char *key;
    json_t *value;
    json_object_foreach(root, key, value) {
        pi0_status status = strcmp(key, "__metadata__") == 0
                                ? parse_metadata(p, value, file)
                                : parse_tensor(p, key, value, &file->tensors[file->num_tensors++]);
        if (status != PI0_OK) return status;
    }
    if (file->num_tensors == 0) return PI0_OK;
    pi0_status status = check_overlaps(p, file);
    if (status == PI0_OK) qsort(file->tensors, (size_t)file->num_tensors, sizeof *file->tensors, compare_by_name);
    return status;
}

static pi0_status map_file(const char *path, st_file *file, pi0_error *err) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return pi0_fail(err, PI0_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int saved = errno;
        close(fd);
        return pi0_fail(err, PI0_ERR_IO, "%s: cannot stat: %s", path, strerror(saved));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return pi0_fail(err, PI0_ERR_IO, "%s: not a regular file", path);
    }
    if (st.st_size < 8) {
        close(fd);
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: file is %lld bytes, too small for a safetensors header", path,
                        (long long)st.st_size);
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int saved = errno;
    close(fd); /* the mapping keeps the file alive */
    if (map == MAP_FAILED) return pi0_fail(err, PI0_ERR_IO, "%s: cannot map: %s", path, strerror(saved));
    file->map = map;
    file->map_size = (size_t)st.st_size;
    return PI0_OK;
}

static pi0_status parse_file(const char *path, st_file *file, pi0_error *err) {
    const unsigned char *bytes = file->map;
    uint64_t header_size = read_u64_le(bytes);
    if (header_size > ST_MAX_HEADER)
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: header size %llu exceeds the 100 MiB limit", path,
                        (unsigned long long)header_size);
    if (header_size > file->map_size - 8)
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: header size %llu exceeds the file size (%zu bytes)", path,
                        (unsigned long long)header_size, file->map_size);
    json_error_t json_err;
    json_t *root = json_loadb((const char *)bytes + 8, (size_t)header_size, JSON_REJECT_DUPLICATES, &json_err);
    if (!root)
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: header is not valid JSON: %s (line %d, column %d)", path,
                        json_err.text, json_err.line, json_err.column);
    st_parser parser = {path, bytes + 8 + header_size, file->map_size - 8 - header_size, err};
    pi0_status status = parse_header(&parser, root, file);
    json_decref(root);
    return status;
}

pi0_status st_open(const char *path, st_file *file, pi0_error *err) {
    memset(file, 0, sizeof *file);
    st_file opened = {0};
    pi0_status status = map_file(path, &opened, err);
    if (status == PI0_OK) status = parse_file(path, &opened, err);
    if (status != PI0_OK) {
        st_close(&opened);
        return status;
    }
    *file = opened;
    return PI0_OK;
}

void st_close(st_file *file) {
    if (file->map) munmap(file->map, file->map_size);
    for (int i = 0; i < file->num_tensors; i++) free(file->tensors[i].name);
    free(file->tensors);
    for (int i = 0; i < file->num_meta; i++) {
        free(file->meta_keys[i]);
        free(file->meta_values[i]);
    }
    free(file->meta_keys);
    free(file->meta_values);
    memset(file, 0, sizeof *file);
}

static int compare_name_to_tensor(const void *name, const void *tensor) {
    return strcmp(name, ((const st_tensor *)tensor)->name);
}

const st_tensor *st_find(const st_file *file, const char *name) {
    if (file->num_tensors == 0) return NULL; /* bsearch must not see a NULL array */
    return bsearch(name, file->tensors, (size_t)file->num_tensors, sizeof *file->tensors, compare_name_to_tensor);
}

const char *st_meta(const st_file *file, const char *key) {
    for (int i = 0; i < file->num_meta; i++)
        if (strcmp(file->meta_keys[i], key) == 0) return file->meta_values[i];
    return NULL;
}

/* --- conversion to float32 ----------------------------------------------------------------------- */

/* Converts n elements. Sources may be unaligned, so every load goes through memcpy, which compiles
   to a plain (vectorizable) load; the host is little-endian like the file (see pi0.h). */
static void convert_block(st_dtype dtype, const unsigned char *src, float *out, size_t n) {
    switch (dtype) {
    case ST_F32: memcpy(out, src, n * sizeof *out); break;
    case ST_BF16:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            uint16_t bits;
            memcpy(&bits, src + 2 * i, sizeof bits);
            out[i] = bf16_to_f32(bits);
        }
        break;
    case ST_F16:
#pragma omp simd
        for (size_t i = 0; i < n; i++) {
            uint16_t bits;
            memcpy(&bits, src + 2 * i, sizeof bits);
            out[i] = f16_to_f32(bits);
        }
        break;
    case ST_I32:
        for (size_t i = 0; i < n; i++) {
            int32_t value;
            memcpy(&value, src + 4 * i, sizeof value);
            out[i] = (float)value;
        }
        break;
    case ST_I64:
        for (size_t i = 0; i < n; i++) {
            int64_t value;
            memcpy(&value, src + 8 * i, sizeof value);
            out[i] = (float)value;
        }
        break;
    case ST_BOOL:
        for (size_t i = 0; i < n; i++) out[i] = src[i] ? 1.0f : 0.0f;
        break;
    case ST_U8:
        for (size_t i = 0; i < n; i++) out[i] = (float)src[i];
        break;
    }
}

void st_to_f32(const st_tensor *t, float *out) {
    size_t n = (size_t)t->numel, size = st_dtype_size(t->dtype);
    size_t num_blocks = (n + ST_CONVERT_BLOCK - 1) / ST_CONVERT_BLOCK;
    /* Several blocks in parallel: checkpoints are GBs and the first touch of a mapped page is a page
       fault, so more cores also read the file faster. */
#pragma omp parallel for schedule(static) if (num_blocks > 1)
    for (size_t b = 0; b < num_blocks; b++) {
        size_t begin = b * ST_CONVERT_BLOCK, count = n - begin < ST_CONVERT_BLOCK ? n - begin : ST_CONVERT_BLOCK;
        convert_block(t->dtype, (const unsigned char *)t->data + begin * size, out + begin, count);
    }
}

/* --- writer ------------------------------------------------------------------------------------ */

void st_writer_init(st_writer *w) { memset(w, 0, sizeof *w); }

static uint64_t entry_nbytes(const st_entry *e) {
    uint64_t numel = 1;
    for (int i = 0; i < e->rank; i++) numel *= (uint64_t)e->shape[i];
    return numel * dtype_info[e->dtype].size;
}

/* jansson refuses keys and strings that are not UTF-8; asking it up front gives a clear error at
   st_writer_add instead of a failure at write time. */
static int valid_utf8(const char *text) {
    json_t *string = json_string(text);
    json_decref(string);
    return string != NULL;
}

static pi0_status check_entry(const st_writer *w, const char *name, st_dtype dtype, int rank, const int64_t *shape,
                              const void *data, pi0_error *err) {
    if (!name || !name[0]) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: empty tensor name");
    if (strcmp(name, "__metadata__") == 0 || !valid_utf8(name))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: '%s' cannot be a tensor name", name);
    if (!dtype_valid(dtype))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: tensor '%s': invalid dtype %d", name,
                        (int)dtype);
    if (rank < 0 || rank > ST_MAX_RANK)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: tensor '%s': invalid rank %d", name, rank);
    if (rank > 0 && !shape)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: tensor '%s': shape is NULL", name);
    /* The file's offsets are signed 64-bit JSON integers, so sizes stay below 2^63. */
    uint64_t limit = (uint64_t)INT64_MAX / dtype_info[dtype].size, numel = 1;
    for (int i = 0; i < rank; i++) {
        if (shape[i] < 0)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: tensor '%s': negative dimension %lld", name,
                            (long long)shape[i]);
        if (shape[i] != 0 && numel > limit / (uint64_t)shape[i])
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: tensor '%s': shape is too large", name);
        numel *= (uint64_t)shape[i];
    }
    if (numel > 0 && !data)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: tensor '%s': data is NULL", name);
    for (int i = 0; i < w->count; i++)
        if (strcmp(w->entries[i].name, name) == 0)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_add: duplicate tensor name '%s'", name);
    return PI0_OK;
}

pi0_status st_writer_add(st_writer *w, const char *name, st_dtype dtype, int rank, const int64_t *shape,
                         const void *data, pi0_error *err) {
    pi0_status status = check_entry(w, name, dtype, rank, shape, data, err);
    if (status != PI0_OK) return status;
    if (w->count == w->capacity) {
        int capacity = w->capacity ? 2 * w->capacity : 64;
        st_entry *entries = realloc(w->entries, (size_t)capacity * sizeof *entries);
        if (!entries) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "st_writer_add: out of memory");
        w->entries = entries;
        w->capacity = capacity;
    }
    st_entry *e = &w->entries[w->count];
    memset(e, 0, sizeof *e);
    if (!(e->name = strdup(name))) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "st_writer_add: out of memory");
    e->dtype = dtype;
    e->rank = rank;
    if (rank > 0) memcpy(e->shape, shape, (size_t)rank * sizeof *shape);
    e->data = data;
    w->count++;
    return PI0_OK;
}

pi0_status st_writer_meta(st_writer *w, const char *key, const char *value, pi0_error *err) {
    if (!key || !value || !valid_utf8(key) || !valid_utf8(value))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_meta: key and value must be UTF-8 strings");
    for (int i = 0; i < w->num_meta; i++)
        if (strcmp(w->meta_keys[i], key) == 0)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "st_writer_meta: duplicate metadata key '%s'", key);
    size_t count = (size_t)w->num_meta + 1;
    char **keys = realloc(w->meta_keys, count * sizeof *keys);
    if (keys) w->meta_keys = keys;
    char **values = keys ? realloc(w->meta_values, count * sizeof *values) : NULL;
    if (values) w->meta_values = values;
    char *key_copy = values ? strdup(key) : NULL, *value_copy = key_copy ? strdup(value) : NULL;
    if (!value_copy) {
        free(key_copy);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "st_writer_meta: out of memory");
    }
    w->meta_keys[w->num_meta] = key_copy;
    w->meta_values[w->num_meta] = value_copy;
    w->num_meta++;
    return PI0_OK;
}

static json_t *entry_json(const st_entry *e, uint64_t begin, uint64_t end) {
    json_t *shape = json_array();
    for (int i = 0; shape && i < e->rank; i++) {
        if (json_array_append_new(shape, json_integer(e->shape[i])) != 0) {
            json_decref(shape);
            shape = NULL;
        }
    }
    if (!shape) return NULL;
    return json_pack("{s:s, s:o, s:[I, I]}", "dtype", dtype_info[e->dtype].name, "shape", shape, "data_offsets",
                     (json_int_t)begin, (json_int_t)end);
}

/* The header text: tensors in insertion order, then __metadata__. NULL when out of memory or when
   the offsets would not fit the signed 64-bit integers of the format. */
static char *header_text(const st_writer *w) {
    json_t *root = json_object();
    int ok = root != NULL;
    uint64_t offset = 0;
    for (int i = 0; ok && i < w->count; i++) {
        uint64_t nbytes = entry_nbytes(&w->entries[i]);
        ok = nbytes <= (uint64_t)INT64_MAX - offset &&
             json_object_set_new(root, w->entries[i].name, entry_json(&w->entries[i], offset, offset + nbytes)) == 0;
        offset += nbytes;
    }
    if (ok && w->num_meta > 0) {
        json_t *meta = json_object();
        for (int i = 0; meta && i < w->num_meta; i++) {
            if (json_object_set_new(meta, w->meta_keys[i], json_string(w->meta_values[i])) != 0) {
                json_decref(meta);
                meta = NULL;
            }
        }
        ok = json_object_set_new(root, "__metadata__", meta) == 0;
    }
    char *text = ok ? json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(root);
    return text;
}

/* Creates `path`.tmp.<pid>.<n> next to `path` (so rename stays on one filesystem). O_EXCL with mode
   0666 rather than mkstemp, whose 0600 would survive the rename and surprise whoever reads the file. */
static FILE *create_temp(const char *path, char *tmp_path, size_t size) {
    static atomic_uint counter;
    for (int attempt = 0; attempt < 100; attempt++) {
        snprintf(tmp_path, size, "%s.tmp.%ld.%u", path, (long)getpid(), atomic_fetch_add(&counter, 1u));
        int fd = open(tmp_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0 && errno == EEXIST) continue;
        if (fd < 0) return NULL;
        FILE *f = fdopen(fd, "wb");
        if (!f) {
            int saved = errno;
            close(fd);
            unlink(tmp_path);
            errno = saved;
        }
        return f;
    }
    errno = EEXIST;
    return NULL;
}

/* 1 when all `size` bytes were written. */
static int write_all(FILE *f, const void *data, uint64_t size) {
    const unsigned char *bytes = data;
    while (size > 0) {
        size_t piece = size < ST_WRITE_CHUNK ? (size_t)size : ST_WRITE_CHUNK;
        if (fwrite(bytes, 1, piece, f) != piece) return 0;
        bytes += piece;
        size -= piece;
    }
    return 1;
}

/* Writes everything to `f` and closes it; 1 on success, else 0 with errno set. */
static int write_contents(const st_writer *w, FILE *f, const char *header, uint64_t header_size) {
    unsigned char size_bytes[8];
    for (int i = 0; i < 8; i++) size_bytes[i] = (unsigned char)(header_size >> (8 * i));
    int ok = write_all(f, size_bytes, sizeof size_bytes) && write_all(f, header, header_size);
    for (int i = 0; ok && i < w->count; i++) ok = write_all(f, w->entries[i].data, entry_nbytes(&w->entries[i]));
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int saved = errno;
    if (fclose(f) != 0 && ok) return 0;
    errno = saved;
    return ok;
}

pi0_status st_writer_write(const st_writer *w, const char *path, pi0_error *err) {
    char *text = header_text(w);
    if (!text)
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY,
                        "%s: cannot build the header (out of memory, or over 2^63 bytes of data)", path);
    /* Spaces pad the header so the data region starts 8-byte aligned (8 + header_size). */
    size_t text_size = strlen(text), header_size = (text_size + 7) & ~(size_t)7;
    char *header = malloc(header_size);
    if (header) {
        memcpy(header, text, text_size);
        memset(header + text_size, ' ', header_size - text_size);
    }
    free(text);
    if (!header) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: cannot build the header (out of memory)", path);
    if (header_size > ST_MAX_HEADER) {
        free(header);
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s: header of %zu bytes exceeds the 100 MiB limit", path,
                        header_size);
    }

    size_t tmp_size = strlen(path) + 64;
    char *tmp_path = malloc(tmp_size);
    if (!tmp_path) {
        free(header);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);
    }
    pi0_status status = PI0_OK;
    FILE *f = create_temp(path, tmp_path, tmp_size);
    if (!f) {
        status = pi0_fail(err, PI0_ERR_IO, "%s: cannot create a temporary file: %s", path, strerror(errno));
    } else if (!write_contents(w, f, header, header_size) || rename(tmp_path, path) != 0) {
        status = pi0_fail(err, PI0_ERR_IO, "%s: write failed: %s", path, strerror(errno));
        unlink(tmp_path);
    }
    free(tmp_path);
    free(header);
    return status;
}

void st_writer_free(st_writer *w) {
    for (int i = 0; i < w->count; i++) free((char *)w->entries[i].name); /* strdup'ed by st_writer_add */
    free(w->entries);
    for (int i = 0; i < w->num_meta; i++) {
        free(w->meta_keys[i]);
        free(w->meta_values[i]);
    }
    free(w->meta_keys);
    free(w->meta_values);
    memset(w, 0, sizeof *w);
}
