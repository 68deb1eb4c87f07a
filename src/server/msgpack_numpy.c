/*
 * msgpack_numpy.c - openpi's wire format. A request frame may be hostile, so decoding runs in three steps:
 *
 *   1. scan_frame walks the msgpack headers (never the payloads) and checks every length and element
 *      count against the bytes left, the nesting depth, and the number of values in the whole frame.
 *   2. msgpack-c (msgpack_unpack_next) builds the object tree. It is safe only after step 1: its C API has
 *      no limits, and for every array or map it allocates count * 24 bytes from the count in the header
 *      before reading a single element, so 5 bytes claiming 2^32 elements would ask for 96 GB. After the
 *      scan the tree holds at most MP_MAX_VALUES objects. str and bin payloads are referenced in place.
 *   3. The tree becomes the policy's observation (pi0_policy.h): nested keys joined with "/", numpy maps
 *      checked (dtype, shape, data size) and copied out in host byte order.
 *
 * The scan is the one piece written by hand: msgpack-c's C API has neither limits (its C++ API has
 * unpack_limit) nor a token-level reader we could bound it with, and the scan is a small, exhaustive
 * switch over the 256 header bytes of the msgpack spec.
 */
#include "server/msgpack_numpy.h"

#include <msgpack.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io/safetensors.h"
#include "policy/observation.h"
#include "util/error.h"

/* Containers nested in a frame (the observation map is 1; an ndarray's shape inside it is 3). */
#define MP_MAX_DEPTH 16
/* Elements of all containers of a frame (a map entry counts 2; a numpy array 8 plus its rank): bounds
   msgpack-c's object tree to 24 MiB. Observations hold tens of values. */
#define MP_MAX_VALUES ((uint64_t)1 << 20)
/* Leaves of an observation, and bytes of one joined key path. Real observations have tens of short keys;
   the bounds keep a small frame from multiplying into many copies of long paths ({"<1 MB key>": {100k
   entries}} would otherwise copy the long key 100k times). */
#define MP_MAX_FIELDS 4096
#define MP_MAX_KEY_PATH 1024
/* Room for a key path shortened for a message (see shorten). */
#define MP_SHOWN_PATH 160
/* Longest piece of a hostile string (a dtype, an unknown field name) quoted in a message. */
#define MP_QUOTE_MAX 40

#define SUPPORTED_DTYPES "b1, u1, i1, u2, i2, u4, i4, u8, i8, f2, f4, f8"
#define NUM_DTYPES ((int)PI0_DTYPE_F64 + 1)

static int host_is_little_endian(void) {
    const uint16_t one = 1;
    uint8_t first;
    memcpy(&first, &one, 1);
    return first == 1;
}

/* --- small helpers ----------------------------------------------------------------------------- */

/* 1 when s[0..n) is valid UTF-8 (no overlong forms, surrogates or code points past U+10FFFF, as Python's
   str requires) without a NUL, which would cut the C string short. */
static int is_text(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        if (c == 0) return 0;
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp, min;
        if ((c & 0xe0) == 0xc0) len = 2, cp = c & 0x1f, min = 0x80;
        else if ((c & 0xf0) == 0xe0) len = 3, cp = c & 0x0f, min = 0x800;
        else if ((c & 0xf8) == 0xf0) len = 4, cp = c & 0x07, min = 0x10000;
        else return 0;
        if (n - i < len) return 0;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return 0;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
        i += len;
    }
    return 1;
}

/* Up to MP_QUOTE_MAX bytes of untrusted text for a message, anything but printable ASCII as '?'. */
static const char *quote(const void *bytes, size_t n, char buf[MP_QUOTE_MAX + 4]) {
    const uint8_t *s = bytes;
    size_t k = 0;
    for (; k < n && k < MP_QUOTE_MAX; k++) buf[k] = s[k] >= 0x20 && s[k] < 0x7f ? (char)s[k] : '?';
    if (n > MP_QUOTE_MAX) memcpy(buf + k, "...", 3), k += 3;
    buf[k] = '\0';
    return buf;
}

/* Valid UTF-8 text in a message, whole up to `head` + `tail` bytes, else its first `head` and last `tail`
   bytes around "...", cut between characters: messages may go out in websocket text frames, which must be
   valid UTF-8. */
static const char *shorten(const char *s, size_t len, size_t head, size_t tail, char *buf, size_t size) {
    if (len <= head + tail) {
        snprintf(buf, size, "%.*s", (int)len, s);
        return buf;
    }
    size_t end = head, start = len - tail;
    while (end > 0 && ((uint8_t)s[end] & 0xc0) == 0x80) end--;
    while (start < len && ((uint8_t)s[start] & 0xc0) == 0x80) start++;
    snprintf(buf, size, "%.*s...%.*s", (int)end, s, (int)(len - start), s + start);
    return buf;
}

/* --- step 1: the header scan ------------------------------------------------------------------- */

typedef struct {
    uint64_t left;      /* elements still to read (a map's keys and values both count) */
    uint64_t read;      /* elements read so far, the one being read included */
    int is_map;
    const uint8_t *key; /* map: the last key read when it was a str or bin, for messages */
    size_t key_len;
} scan_level;

typedef struct {
    const uint8_t *data;
    size_t size, pos;
    uint64_t values;
    int depth;                           /* stack[0] is the root: one value */
    scan_level stack[MP_MAX_DEPTH + 1];
    pi0_error *err;
} frame_scan;

static uint64_t read_be(const uint8_t *p, int n) {
    uint64_t value = 0;
    for (int i = 0; i < n; i++) value = value << 8 | p[i];
    return value;
}

/* "msgpack frame, byte 37 (key 'a/b'): ..." with the keys of the maps around the failing byte. */
__attribute__((format(printf, 3, 4))) static pi0_status scan_fail(const frame_scan *s, size_t at, const char *fmt,
                                                                    ...) {
    char path[256] = "", what[320];
    size_t used = 0;
    for (int i = 1; i <= s->depth && used < sizeof path; i++) {
        const scan_level *l = &s->stack[i];
        if (!l->is_map || l->read % 2 != 0) continue; /* only a map whose value is being read names a key */
        char q[MP_QUOTE_MAX + 4];
        const char *key = l->key ? quote(l->key, l->key_len, q) : "?";
        used += (size_t)snprintf(path + used, sizeof path - used, "%s%s", used ? "/" : "", key);
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    if (path[0]) return pi0_fail(s->err, PI0_ERR_FORMAT, "msgpack frame, byte %zu (key '%s'): %s", at, path, what);
    return pi0_fail(s->err, PI0_ERR_FORMAT, "msgpack frame, byte %zu: %s", at, what);
}

/* What a header byte announces: `len_bytes` of big-endian length or count after it, or `fixed` payload
   bytes; ext payloads carry one more byte (the type). */
typedef enum { SCAN_SCALAR, SCAN_BYTES, SCAN_EXT, SCAN_ARRAY, SCAN_MAP, SCAN_INVALID } scan_kind;

static scan_kind classify(uint8_t b, int *len_bytes, uint64_t *fixed) {
    *len_bytes = 0;
    *fixed = 0;
    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) return SCAN_SCALAR;
    if (b <= 0x8f) return *fixed = b & 0x0f, SCAN_MAP;
    if (b <= 0x9f) return *fixed = b & 0x0f, SCAN_ARRAY;
    if (b <= 0xbf) return *fixed = b & 0x1f, SCAN_BYTES;
    switch (b) {
    case 0xc4: case 0xd9: *len_bytes = 1; return SCAN_BYTES; /* bin 8, str 8 */
    case 0xc5: case 0xda: *len_bytes = 2; return SCAN_BYTES;
    case 0xc6: case 0xdb: *len_bytes = 4; return SCAN_BYTES;
    case 0xc7: *len_bytes = 1; return SCAN_EXT;
    case 0xc8: *len_bytes = 2; return SCAN_EXT;
    case 0xc9: *len_bytes = 4; return SCAN_EXT;
    case 0xca: *fixed = 4; return SCAN_SCALAR; /* float 32 */
    case 0xcb: *fixed = 8; return SCAN_SCALAR;
    case 0xcc: case 0xd0: *fixed = 1; return SCAN_SCALAR; /* uint 8, int 8 */
    case 0xcd: case 0xd1: *fixed = 2; return SCAN_SCALAR;
    case 0xce: case 0xd2: *fixed = 4; return SCAN_SCALAR;
    case 0xcf: case 0xd3: *fixed = 8; return SCAN_SCALAR;
    case 0xd4: *fixed = 1 + 1; return SCAN_SCALAR; /* fixext 1: type + data */
    case 0xd5: *fixed = 1 + 2; return SCAN_SCALAR;
    case 0xd6: *fixed = 1 + 4; return SCAN_SCALAR;
    case 0xd7: *fixed = 1 + 8; return SCAN_SCALAR;
    case 0xd8: *fixed = 1 + 16; return SCAN_SCALAR;
    case 0xdc: *len_bytes = 2; return SCAN_ARRAY;
    case 0xdd: *len_bytes = 4; return SCAN_ARRAY;
    case 0xde: *len_bytes = 2; return SCAN_MAP;
    case 0xdf: *len_bytes = 4; return SCAN_MAP;
    default: return SCAN_INVALID; /* 0xc1, never used */
    }
}

/* Reads the header of the value at s->pos, an element of `parent`; skips its payload or, for a container,
   pushes a level for its elements. */
static pi0_status scan_value(frame_scan *s, scan_level *parent) {
    size_t at = s->pos;
    if (at >= s->size) return scan_fail(s, at, "the frame ends early (truncated)");
    int len_bytes;
    uint64_t n;
    scan_kind kind = classify(s->data[at], &len_bytes, &n);
    if (kind == SCAN_INVALID) return scan_fail(s, at, "byte 0x%02x is not a msgpack type", s->data[at]);
    size_t left = s->size - at - 1;
    if ((size_t)len_bytes > left) return scan_fail(s, at, "the frame ends inside a header (truncated)");
    if (len_bytes) n = read_be(s->data + at + 1, len_bytes);
    left -= (size_t)len_bytes;
    s->pos = at + 1 + (size_t)len_bytes;

    int is_key = parent->is_map && parent->read % 2 == 1;
    if (is_key) parent->key = NULL;
    if (kind == SCAN_SCALAR || kind == SCAN_BYTES || kind == SCAN_EXT) {
        uint64_t payload = kind == SCAN_EXT ? n + 1 : n;
        if (payload > left)
            return scan_fail(s, at, "a value of %llu bytes runs past the end of the frame (%zu bytes left)",
                             (unsigned long long)payload, left);
        if (is_key && kind == SCAN_BYTES) parent->key = s->data + s->pos, parent->key_len = (size_t)n;
        s->pos += (size_t)payload;
        return PI0_OK;
    }
    /* Every element takes at least one byte, so a count larger than the bytes left is a lie; checked
       before msgpack-c would allocate for it. */
    uint64_t elements = kind == SCAN_MAP ? 2 * n : n;
    if (elements > left)
        return scan_fail(s, at, "%s claims %llu %s but only %zu bytes are left", kind == SCAN_MAP ? "a map" : "a list",
                         (unsigned long long)n, kind == SCAN_MAP ? "entries" : "elements", left);
    s->values += elements;
    if (s->values > MP_MAX_VALUES)
        return scan_fail(s, at, "the frame holds more than %llu values", (unsigned long long)MP_MAX_VALUES);
    if (s->depth == MP_MAX_DEPTH)
        return scan_fail(s, at, "containers are nested more than %d deep", MP_MAX_DEPTH);
    s->stack[++s->depth] = (scan_level){.left = elements, .is_map = kind == SCAN_MAP};
    return PI0_OK;
}

/* Checks that the frame is exactly one well-formed msgpack value within the limits above. */
static pi0_status scan_frame(const uint8_t *data, size_t size, pi0_error *err) {
    frame_scan s = {.data = data, .size = size, .err = err};
    s.stack[0].left = 1;
    if (size == 0) return scan_fail(&s, 0, "empty frame");
    while (s.depth >= 0) {
        scan_level *level = &s.stack[s.depth];
        if (level->left == 0) {
            s.depth--;
            continue;
        }
        level->left--;
        level->read++;
        pi0_status status = scan_value(&s, level);
        if (status != PI0_OK) return status;
    }
    s.depth = 0;
    if (s.pos != size) return scan_fail(&s, s.pos, "%zu bytes follow the value", size - s.pos);
    return PI0_OK;
}

/* --- step 3: the object tree to fields --------------------------------------------------------- */

typedef struct {
    pi0_observation obs;
    char *path; /* the key path of the value being decoded (MP_MAX_KEY_PATH + 1 bytes once a key is seen) */
    size_t path_len;
    pi0_error *err;
} decoder;

/* A scalar as numbers decode: the dtype it will have (BOOL, I64, U64 or F64) and its value. */
typedef struct {
    pi0_dtype dtype;
    union {
        uint8_t b;
        int64_t i;
        uint64_t u;
        double f;
    } v;
} scalar;

/* "key 'images/cam_high': ..." (or "observation: ..." at the top level). */
__attribute__((format(printf, 3, 4))) static pi0_status fail_at(const decoder *d, pi0_status status,
                                                                  const char *fmt, ...) {
    char what[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    char path[MP_SHOWN_PATH];
    if (d->path_len)
        return pi0_fail(d->err, status, "key '%s': %s", shorten(d->path, d->path_len, 80, 60, path, sizeof path),
                        what);
    return pi0_fail(d->err, status, "observation: %s", what);
}

/* What a value is, with its article: "an int", "a list". */
static const char *type_name(const msgpack_object *o) {
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return "nil";
    case MSGPACK_OBJECT_BOOLEAN: return "a bool";
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: return "an int";
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: return "a float";
    case MSGPACK_OBJECT_STR: return "a str";
    case MSGPACK_OBJECT_BIN: return "a bin";
    case MSGPACK_OBJECT_ARRAY: return "a list";
    case MSGPACK_OBJECT_MAP: return "a map";
    case MSGPACK_OBJECT_EXT: return "an ext value";
    }
    return "an unknown value";
}

/* The bytes of a str or bin (keys travel as either); 0 for anything else. */
static int bytes_of(const msgpack_object *o, const uint8_t **ptr, size_t *len) {
    if (o->type == MSGPACK_OBJECT_STR) *ptr = (const uint8_t *)o->via.str.ptr, *len = o->via.str.size;
    else if (o->type == MSGPACK_OBJECT_BIN) *ptr = (const uint8_t *)o->via.bin.ptr, *len = o->via.bin.size;
    else return 0;
    return 1;
}

static int is_name(const msgpack_object *o, const char *name) {
    const uint8_t *ptr;
    size_t len;
    return bytes_of(o, &ptr, &len) && len == strlen(name) && memcmp(ptr, name, len) == 0;
}

static int map_has_key(const msgpack_object_map *map, const char *name) {
    for (uint32_t i = 0; i < map->size; i++)
        if (is_name(&map->ptr[i].key, name)) return 1;
    return 0;
}

/* Appends "/key" (or "key" at the top) to the path; *old gets the length to restore. */
static pi0_status path_push(decoder *d, const uint8_t *key, size_t len, size_t *old) {
    size_t sep = d->path_len ? 1 : 0;
    char shown[MP_SHOWN_PATH];
    if (sep + len > MP_MAX_KEY_PATH - d->path_len) /* path_len <= MP_MAX_KEY_PATH always */
        return fail_at(d, PI0_ERR_FORMAT, "the key path grows past %d bytes with the key '%s'", MP_MAX_KEY_PATH,
                       shorten((const char *)key, len, 40, 0, shown, sizeof shown));
    if (!d->path && !(d->path = malloc(MP_MAX_KEY_PATH + 1)))
        return fail_at(d, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    *old = d->path_len;
    if (sep) d->path[d->path_len] = '/';
    memcpy(d->path + d->path_len + sep, key, len);
    d->path_len += sep + len;
    d->path[d->path_len] = '\0';
    return PI0_OK;
}

static void path_pop(decoder *d, size_t old) {
    d->path_len = old;
    d->path[old] = '\0';
}

/* Adds a field named by the current path; takes ownership of `data` and `string` either way. */
static pi0_status add_field(decoder *d, pi0_field field) {
    if (d->obs.count == MP_MAX_FIELDS) {
        free(field.data);
        free(field.string);
        return fail_at(d, PI0_ERR_FORMAT, "the observation has more than %d fields", MP_MAX_FIELDS);
    }
    if (!(field.key = strdup(d->path))) {
        free(field.data);
        free(field.string);
        return fail_at(d, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    }
    pi0_error inner = {0};
    if (observation_append(&d->obs, field, &inner)) return fail_at(d, inner.status, "%s", inner.message);
    return PI0_OK;
}

static pi0_status add_array(decoder *d, pi0_dtype dtype, int ndim, const int64_t *shape, void *data) {
    pi0_field field = {.kind = PI0_FIELD_ARRAY, .dtype = dtype, .ndim = ndim, .data = data};
    if (ndim) memcpy(field.shape, shape, (size_t)ndim * sizeof *shape);
    return add_field(d, field);
}

static pi0_status add_scalar(decoder *d, const scalar *s) {
    void *data = observation_alloc_data(sizeof s->v);
    if (!data) return fail_at(d, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    memcpy(data, &s->v, pi0_dtype_size(s->dtype)); /* every member starts at the union's first byte */
    return add_array(d, s->dtype, 0, NULL, data);
}

static pi0_status add_string(decoder *d, const msgpack_object *o) {
    const uint8_t *ptr = NULL;
    size_t len = 0;
    bytes_of(o, &ptr, &len);
    if (!is_text(ptr, len))
        return fail_at(d, PI0_ERR_FORMAT,
                       o->type == MSGPACK_OBJECT_STR ? "the string is not valid UTF-8 or holds a NUL"
                                                     : "bin value is not UTF-8 text (numpy arrays travel as "
                                                       "__ndarray__ maps)");
    char *string = malloc(len + 1);
    if (!string) return fail_at(d, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    if (len) memcpy(string, ptr, len);
    string[len] = '\0';
    return add_field(d, (pi0_field){.kind = PI0_FIELD_STRING, .string = string});
}

/* Parses numpy's dtype.str: an optional byte order (<, >, | or =; | and = are the host's) and a kind
   and size numpy would print. `swap` says whether the data must be byte-swapped to host order. */
static pi0_status parse_dtype(const decoder *d, const msgpack_object *o, pi0_dtype *dtype, int *swap) {
    const uint8_t *text;
    size_t len;
    char q[MP_QUOTE_MAX + 4];
    if (!bytes_of(o, &text, &len)) return fail_at(d, PI0_ERR_FORMAT, "dtype is %s, not a string", type_name(o));
    size_t i = 0;
    char order = len && text[0] && strchr("<>|=", text[0]) ? (char)text[i++] : '=';
    char kind = i < len ? (char)text[i++] : '\0';
    const char *unsupported = kind == 'c' ? "complex" : kind == 'O' ? "object" : kind == 'V' ? "void" :
                              kind == 'U' ? "unicode" : kind == 'S' || kind == 'a' ? "bytes" :
                              kind == 'M' || kind == 'm' ? "datetime" : NULL;
    if (unsupported)
        return fail_at(d, PI0_ERR_FORMAT, "unsupported dtype '%s' (%s; supported: " SUPPORTED_DTYPES ")",
                       quote(text, len, q), unsupported);
    size_t size = 0;
    for (; i < len && text[i] >= '0' && text[i] <= '9' && size < 100; i++) size = size * 10 + (text[i] - '0');
    for (int t = 0; t < NUM_DTYPES && i == len; t++) {
        if (observation_dtype_kind((pi0_dtype)t) != kind || pi0_dtype_size((pi0_dtype)t) != size) continue;
        int big = order == '>' || (order != '<' && !host_is_little_endian());
        *dtype = (pi0_dtype)t;
        *swap = size > 1 && big == host_is_little_endian();
        return PI0_OK;
    }
    if (kind && strchr("buif", kind) && i == len && size)
        return fail_at(d, PI0_ERR_FORMAT, "unsupported dtype '%s' (supported: " SUPPORTED_DTYPES ")",
                       quote(text, len, q));
    return fail_at(d, PI0_ERR_FORMAT, "dtype '%s' is not a numpy dtype string", quote(text, len, q));
}

static pi0_status parse_shape(const decoder *d, const msgpack_object *o, int *ndim, int64_t *shape,
                              uint64_t *numel) {
    if (o->type != MSGPACK_OBJECT_ARRAY)
        return fail_at(d, PI0_ERR_FORMAT, "shape is %s, not a list of ints", type_name(o));
    if (o->via.array.size > PI0_MAX_NDIM)
        return fail_at(d, PI0_ERR_FORMAT, "shape has %u dimensions, more than the %d supported", o->via.array.size,
                       PI0_MAX_NDIM);
    *ndim = (int)o->via.array.size;
    for (int i = 0; i < *ndim; i++) {
        const msgpack_object *dim = &o->via.array.ptr[i];
        if (dim->type == MSGPACK_OBJECT_NEGATIVE_INTEGER)
            return fail_at(d, PI0_ERR_FORMAT, "dimension %d of the shape is negative (%lld)", i,
                           (long long)dim->via.i64);
        if (dim->type != MSGPACK_OBJECT_POSITIVE_INTEGER)
            return fail_at(d, PI0_ERR_FORMAT, "dimension %d of the shape is %s, not an int", i, type_name(dim));
        if (dim->via.u64 > INT64_MAX)
            return fail_at(d, PI0_ERR_FORMAT, "dimension %d of the shape (%llu) is too large", i,
                           (unsigned long long)dim->via.u64);
        shape[i] = (int64_t)dim->via.u64;
    }
    char text[200];
    if (!observation_shape_numel(*ndim, shape, numel))
        return fail_at(d, PI0_ERR_FORMAT, "the element count of shape %s overflows",
                       st_shape_str(*ndim, shape, text, sizeof text));
    return PI0_OK;
}

/* The fields of an __ndarray__ or __npgeneric__ map. Unknown fields are refused rather than ignored:
   one we do not understand might change what the bytes mean. */
typedef struct {
    const msgpack_object *data, *dtype, *shape;
} numpy_map;

static pi0_status read_numpy_map(const decoder *d, const msgpack_object_map *map, int is_array, numpy_map *nm) {
    const char *marker = is_array ? "__ndarray__" : "__npgeneric__", *what = is_array ? "numpy array" : "numpy scalar";
    *nm = (numpy_map){0};
    int seen_marker = 0;
    for (uint32_t i = 0; i < map->size; i++) {
        const msgpack_object *key = &map->ptr[i].key, *value = &map->ptr[i].val;
        const msgpack_object **slot = is_name(key, "data")                ? &nm->data
                                      : is_name(key, "dtype")             ? &nm->dtype
                                      : is_array && is_name(key, "shape") ? &nm->shape
                                                                          : NULL;
        const uint8_t *name;
        size_t len;
        char q[MP_QUOTE_MAX + 4];
        if (!bytes_of(key, &name, &len))
            return fail_at(d, PI0_ERR_FORMAT, "%s has %s as a key, not a string", what, type_name(key));
        if (is_name(key, marker)) {
            if (seen_marker++) return fail_at(d, PI0_ERR_FORMAT, "%s has the field '%s' twice", what, marker);
            continue;
        }
        if (!slot) return fail_at(d, PI0_ERR_FORMAT, "%s has an unknown field '%s'", what, quote(name, len, q));
        if (*slot) return fail_at(d, PI0_ERR_FORMAT, "%s has the field '%s' twice", what, quote(name, len, q));
        *slot = value;
    }
    const char *missing = !nm->data ? "data" : !nm->dtype ? "dtype" : is_array && !nm->shape ? "shape" : NULL;
    if (missing) return fail_at(d, PI0_ERR_FORMAT, "%s lacks the field '%s'", what, missing);
    return PI0_OK;
}

static void swap_bytes(uint8_t *data, uint64_t numel, size_t itemsize) {
    for (uint64_t e = 0; e < numel; e++, data += itemsize)
        for (size_t a = 0, b = itemsize - 1; a < b; a++, b--) {
            uint8_t t = data[a];
            data[a] = data[b];
            data[b] = t;
        }
}

static pi0_status decode_ndarray(decoder *d, const msgpack_object_map *map) {
    numpy_map nm;
    pi0_dtype dtype = PI0_DTYPE_U8;
    int swap = 0, ndim = 0;
    int64_t shape[PI0_MAX_NDIM];
    uint64_t numel = 0;
    pi0_status status = read_numpy_map(d, map, 1, &nm);
    if (status == PI0_OK) status = parse_dtype(d, nm.dtype, &dtype, &swap);
    if (status == PI0_OK) status = parse_shape(d, nm.shape, &ndim, shape, &numel);
    if (status != PI0_OK) return status;
    if (nm.data->type != MSGPACK_OBJECT_BIN)
        return fail_at(d, PI0_ERR_FORMAT, "numpy array data is %s, not bin", type_name(nm.data));
    size_t itemsize = pi0_dtype_size(dtype), bytes = nm.data->via.bin.size;
    if (numel > bytes / itemsize || numel * itemsize != bytes) {
        char text[200];
        return fail_at(d, PI0_ERR_FORMAT, "numpy array data holds %zu bytes but shape %s of %s needs %llu elements "
                       "of %zu bytes", bytes, st_shape_str(ndim, shape, text, sizeof text), pi0_dtype_str(dtype),
                       (unsigned long long)numel, itemsize);
    }
    uint8_t *copy = observation_alloc_data(bytes);
    if (!copy) return fail_at(d, PI0_ERR_OUT_OF_MEMORY, "out of memory for %zu bytes", bytes);
    if (bytes) memcpy(copy, nm.data->via.bin.ptr, bytes);
    if (swap) swap_bytes(copy, numel, itemsize);
    /* numpy reads any non-zero byte of a bool array as True; consumers get exactly 0 or 1. */
    if (dtype == PI0_DTYPE_BOOL)
        for (size_t i = 0; i < bytes; i++) copy[i] = copy[i] != 0;
    return add_array(d, dtype, ndim, shape, copy);
}

/* The range a value of an integer dtype can hold. */
static void int_range(pi0_dtype dtype, int64_t *min, uint64_t *max) {
    int bits = 8 * (int)pi0_dtype_size(dtype);
    if (observation_dtype_kind(dtype) == 'u') {
        *min = 0;
        *max = bits == 64 ? UINT64_MAX : ((uint64_t)1 << bits) - 1;
    } else {
        *min = bits == 64 ? INT64_MIN : -((int64_t)1 << (bits - 1));
        *max = ((uint64_t)1 << (bits - 1)) - 1;
    }
}

/* A numpy scalar as openpi packs it (data = obj.item()): its kind decides the result (bool -> BOOL,
   signed -> I64, unsigned -> U64, float -> F64), and the value must fit its dtype. */
static pi0_status decode_npgeneric(const decoder *d, const msgpack_object_map *map, scalar *out) {
    numpy_map nm;
    pi0_dtype dtype = PI0_DTYPE_U8;
    int swap = 0;
    pi0_status status = read_numpy_map(d, map, 0, &nm);
    if (status == PI0_OK) status = parse_dtype(d, nm.dtype, &dtype, &swap);
    if (status != PI0_OK) return status;
    const msgpack_object *v = nm.data;
    char kind = observation_dtype_kind(dtype);
    int is_int = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER || v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER;
    if (kind == 'b' && v->type == MSGPACK_OBJECT_BOOLEAN) {
        *out = (scalar){.dtype = PI0_DTYPE_BOOL, .v.b = v->via.boolean ? 1 : 0};
        return PI0_OK;
    }
    if (kind == 'f' && (is_int || v->type == MSGPACK_OBJECT_FLOAT32 || v->type == MSGPACK_OBJECT_FLOAT64)) {
        double f = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER   ? (double)v->via.u64
                   : v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? (double)v->via.i64
                                                                : v->via.f64;
        *out = (scalar){.dtype = PI0_DTYPE_F64, .v.f = f};
        return PI0_OK;
    }
    if ((kind == 'i' || kind == 'u') && is_int) {
        int64_t min;
        uint64_t max;
        int_range(dtype, &min, &max);
        int fits = v->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? v->via.u64 <= max : v->via.i64 >= min;
        if (!fits)
            return fail_at(d, PI0_ERR_FORMAT, "numpy scalar value %s%llu is out of the range of %s",
                           v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? "-" : "",
                           v->type == MSGPACK_OBJECT_NEGATIVE_INTEGER ? 0ull - (unsigned long long)v->via.i64
                                                                      : (unsigned long long)v->via.u64,
                           pi0_dtype_str(dtype));
        if (kind == 'u') *out = (scalar){.dtype = PI0_DTYPE_U64, .v.u = v->via.u64};
        else *out = (scalar){.dtype = PI0_DTYPE_I64, .v.i = v->via.i64};
        return PI0_OK;
    }
    return fail_at(d, PI0_ERR_FORMAT, "numpy scalar of dtype %s holds %s", pi0_dtype_str(dtype), type_name(v));
}

/* Plain msgpack numbers and bools: ints are I64 unless only uint64 holds them. */
static int plain_scalar(const msgpack_object *o, scalar *out) {
    switch (o->type) {
    case MSGPACK_OBJECT_BOOLEAN: *out = (scalar){.dtype = PI0_DTYPE_BOOL, .v.b = o->via.boolean ? 1 : 0}; return 1;
    case MSGPACK_OBJECT_POSITIVE_INTEGER:
        if (o->via.u64 > INT64_MAX) *out = (scalar){.dtype = PI0_DTYPE_U64, .v.u = o->via.u64};
        else *out = (scalar){.dtype = PI0_DTYPE_I64, .v.i = (int64_t)o->via.u64};
        return 1;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (scalar){.dtype = PI0_DTYPE_I64, .v.i = o->via.i64}; return 1;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64: *out = (scalar){.dtype = PI0_DTYPE_F64, .v.f = o->via.f64}; return 1;
    default: return 0;
    }
}

static double scalar_to_double(const scalar *s) {
    switch (s->dtype) {
    case PI0_DTYPE_BOOL: return s->v.b;
    case PI0_DTYPE_I64: return (double)s->v.i;
    case PI0_DTYPE_U64: return (double)s->v.u;
    default: return s->v.f;
    }
}

/* A list of numbers (plain, bool, or numpy scalars, as a Python list of np.float32 packs) -> F64, ndim 1. */
static pi0_status decode_list(decoder *d, const msgpack_object_array *list) {
    double *values = observation_alloc_data((size_t)list->size * sizeof *values); /* size <= MP_MAX_VALUES */
    if (!values) return fail_at(d, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    for (uint32_t i = 0; i < list->size; i++) {
        const msgpack_object *e = &list->ptr[i];
        scalar s;
        pi0_status status = PI0_OK;
        if (e->type == MSGPACK_OBJECT_MAP && map_has_key(&e->via.map, "__npgeneric__"))
            status = decode_npgeneric(d, &e->via.map, &s);
        else if (!plain_scalar(e, &s))
            status = fail_at(d, PI0_ERR_FORMAT, "element %u of the list is %s; lists must hold numbers only", i,
                             e->type == MSGPACK_OBJECT_MAP && map_has_key(&e->via.map, "__ndarray__")
                                 ? "a numpy array"
                                 : type_name(e));
        if (status != PI0_OK) {
            free(values);
            return status;
        }
        values[i] = scalar_to_double(&s);
    }
    int64_t shape[1] = {list->size};
    return add_array(d, PI0_DTYPE_F64, 1, shape, values);
}

typedef struct {
    const uint8_t *ptr;
    size_t len;
} key_bytes;

static int compare_keys(const void *a, const void *b) {
    const key_bytes *x = a, *y = b;
    if (x->len != y->len) return x->len < y->len ? -1 : 1;
    return memcmp(x->ptr, y->ptr, x->len);
}

/* Every key of a dict must be non-empty text, and no key may appear twice. */
static pi0_status check_keys(const decoder *d, const msgpack_object_map *map) {
    key_bytes *keys = malloc(((size_t)map->size + 1) * sizeof *keys);
    if (!keys) return fail_at(d, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    pi0_status status = PI0_OK;
    char shown[MP_SHOWN_PATH];
    for (uint32_t i = 0; i < map->size && status == PI0_OK; i++) {
        const msgpack_object *key = &map->ptr[i].key;
        if (!bytes_of(key, &keys[i].ptr, &keys[i].len))
            status = fail_at(d, PI0_ERR_FORMAT, "the key of entry %u is %s, not a string", i, type_name(key));
        else if (keys[i].len == 0) status = fail_at(d, PI0_ERR_FORMAT, "the key of entry %u is empty", i);
        else if (!is_text(keys[i].ptr, keys[i].len))
            status = fail_at(d, PI0_ERR_FORMAT, "the key of entry %u is not valid UTF-8 or holds a NUL", i);
    }
    if (status == PI0_OK && map->size > 1) {
        qsort(keys, map->size, sizeof *keys, compare_keys);
        for (uint32_t i = 1; i < map->size && status == PI0_OK; i++)
            if (compare_keys(&keys[i - 1], &keys[i]) == 0)
                status = fail_at(d, PI0_ERR_FORMAT, "the key '%s' appears twice",
                                 shorten((const char *)keys[i].ptr, keys[i].len, 40, 20, shown, sizeof shown));
    }
    free(keys);
    return status;
}

static pi0_status decode_value(decoder *d, const msgpack_object *o);

/* A dict: each value under its key's path. */
static pi0_status decode_dict(decoder *d, const msgpack_object_map *map) {
    pi0_status status = check_keys(d, map);
    for (uint32_t i = 0; i < map->size && status == PI0_OK; i++) {
        const uint8_t *key = NULL;
        size_t len = 0;
        bytes_of(&map->ptr[i].key, &key, &len); /* check_keys made sure it is a str or bin */
        size_t old = 0;
        status = path_push(d, key, len, &old);
        if (status != PI0_OK) return status;
        status = decode_value(d, &map->ptr[i].val);
        path_pop(d, old);
    }
    return status;
}

/* Depth needs no check here: the scan bounded it. */
static pi0_status decode_value(decoder *d, const msgpack_object *o) {
    scalar s;
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: return PI0_OK;
    case MSGPACK_OBJECT_STR:
    case MSGPACK_OBJECT_BIN: return add_string(d, o);
    case MSGPACK_OBJECT_ARRAY: return decode_list(d, &o->via.array);
    case MSGPACK_OBJECT_MAP:
        if (map_has_key(&o->via.map, "__ndarray__")) return decode_ndarray(d, &o->via.map);
        if (map_has_key(&o->via.map, "__npgeneric__")) {
            pi0_status status = decode_npgeneric(d, &o->via.map, &s);
            return status == PI0_OK ? add_scalar(d, &s) : status;
        }
        return decode_dict(d, &o->via.map);
    case MSGPACK_OBJECT_EXT:
        return fail_at(d, PI0_ERR_FORMAT, "msgpack ext values (type %d) are not supported", o->via.ext.type);
    default:
        if (plain_scalar(o, &s)) return add_scalar(d, &s);
        return fail_at(d, PI0_ERR_FORMAT, "unsupported msgpack value");
    }
}

static int compare_field_keys(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Flattening can make two keys one ({"a/b": x, "a": {"b": y}}); that is a duplicate too. */
static pi0_status check_flat_keys(decoder *d) {
    if (d->obs.count < 2) return PI0_OK;
    char **keys = malloc((size_t)d->obs.count * sizeof *keys);
    if (!keys) return pi0_fail(d->err, PI0_ERR_OUT_OF_MEMORY, "observation: out of memory");
    for (int i = 0; i < d->obs.count; i++) keys[i] = d->obs.fields[i].key;
    qsort(keys, (size_t)d->obs.count, sizeof *keys, compare_field_keys);
    pi0_status status = PI0_OK;
    char shown[MP_SHOWN_PATH];
    for (int i = 1; i < d->obs.count && status == PI0_OK; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0)
            status = pi0_fail(d->err, PI0_ERR_FORMAT, "key '%s': appears twice once nested keys are joined with '/'",
                              shorten(keys[i], strlen(keys[i]), 80, 60, shown, sizeof shown));
    free(keys);
    return status;
}

static pi0_status decode_root(decoder *d, const msgpack_object *root) {
    if (root->type != MSGPACK_OBJECT_MAP)
        return fail_at(d, PI0_ERR_FORMAT, "the frame is %s, not a map (dict)", type_name(root));
    if (map_has_key(&root->via.map, "__ndarray__") || map_has_key(&root->via.map, "__npgeneric__"))
        return fail_at(d, PI0_ERR_FORMAT, "the frame is a numpy value, not a dict");
    pi0_status status = decode_dict(d, &root->via.map);
    return status == PI0_OK ? check_flat_keys(d) : status;
}

pi0_status pi0_observation_decode(const void *data, size_t size, pi0_observation *out, pi0_error *err) {
    if (!out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_observation_decode: out is NULL");
    *out = (pi0_observation){0};
    if (!data && size) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_observation_decode: data is NULL");
    pi0_status status = scan_frame(data, size, err);
    if (status != PI0_OK) return status;

    msgpack_unpacked msg;
    msgpack_unpacked_init(&msg);
    size_t offset = 0;
    msgpack_unpack_return ret = msgpack_unpack_next(&msg, data, size, &offset);
    decoder d = {.err = err};
    if (ret == MSGPACK_UNPACK_NOMEM_ERROR) status = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "observation: out of memory");
    else if (ret != MSGPACK_UNPACK_SUCCESS || offset != size) /* the scan makes this unreachable */
        status = pi0_fail(err, PI0_ERR_FORMAT, "msgpack frame: msgpack-c rejected it (code %d)", (int)ret);
    else status = decode_root(&d, &msg.data);
    msgpack_unpacked_destroy(&msg);
    free(d.path);
    if (status != PI0_OK) {
        pi0_observation_free(&d.obs);
        return status;
    }
    *out = d.obs;
    return PI0_OK;
}

/* --- the packer -------------------------------------------------------------------------------- */

/* msgpack-c's write callback: appends to the growable buffer, or marks the packer failed. */
static int packer_write(void *user, const char *bytes, size_t len) {
    pi0_packer *p = user;
    if (p->failed) return -1;
    if (len == 0) return 0;
    if (len > p->capacity - p->size) {
        if (len > SIZE_MAX / 4 - p->size) return p->failed = 1, -1;
        size_t cap = p->capacity ? p->capacity : 256;
        while (cap < p->size + len) cap *= 2;
        uint8_t *grown = realloc(p->data, cap);
        if (!grown) return p->failed = 1, -1;
        p->data = grown;
        p->capacity = cap;
    }
    memcpy(p->data + p->size, bytes, len);
    p->size += len;
    return 0;
}

/* A msgpack-c packer writing into `p`; NULL when there is nothing to do (no packer, or failed). */
static msgpack_packer *packer_of(pi0_packer *p, msgpack_packer *pk) {
    if (!p || p->failed) return NULL;
    msgpack_packer_init(pk, p, packer_write);
    return pk;
}

void pi0_pack_map(pi0_packer *p, uint32_t num_pairs) {
    msgpack_packer pk;
    if (packer_of(p, &pk)) msgpack_pack_map(&pk, num_pairs);
}

void pi0_pack_array(pi0_packer *p, uint32_t num_items) {
    msgpack_packer pk;
    if (packer_of(p, &pk)) msgpack_pack_array(&pk, num_items);
}

static void pack_str_bytes(msgpack_packer *pk, const char *s, size_t len) {
    msgpack_pack_str(pk, len);
    msgpack_pack_str_body(pk, s, len);
}

void pi0_pack_str(pi0_packer *p, const char *s) {
    msgpack_packer pk;
    if (!packer_of(p, &pk)) return;
    size_t len = s ? strlen(s) : 0;
    if (!s || len > UINT32_MAX) p->failed = 1; /* msgpack strings are at most 4 GiB - 1 */
    else pack_str_bytes(&pk, s, len);
}

void pi0_pack_int(pi0_packer *p, int64_t v) {
    msgpack_packer pk;
    if (packer_of(p, &pk)) msgpack_pack_int64(&pk, v); /* msgpack-c picks the shortest form */
}

void pi0_pack_double(pi0_packer *p, double v) {
    msgpack_packer pk;
    if (packer_of(p, &pk)) msgpack_pack_double(&pk, v);
}

void pi0_pack_bool(pi0_packer *p, int v) {
    msgpack_packer pk;
    if (!packer_of(p, &pk)) return;
    if (v) msgpack_pack_true(&pk);
    else msgpack_pack_false(&pk);
}

void pi0_pack_nil(pi0_packer *p) {
    msgpack_packer pk;
    if (packer_of(p, &pk)) msgpack_pack_nil(&pk);
}

static void pack_bin_key(msgpack_packer *pk, const char *key) {
    size_t len = strlen(key);
    msgpack_pack_bin(pk, len);
    msgpack_pack_bin_body(pk, key, len);
}

void pi0_pack_ndarray(pi0_packer *p, pi0_dtype dtype, int ndim, const int64_t *shape, const void *data) {
    msgpack_packer pk;
    if (!packer_of(p, &pk)) return;
    size_t itemsize = pi0_dtype_size(dtype);
    uint64_t numel = 0;
    if (!itemsize || ndim < 0 || ndim > PI0_MAX_NDIM || (ndim && !shape) || !observation_shape_numel(ndim, shape, &numel) ||
        numel > UINT32_MAX / itemsize || (numel && !data)) {
        p->failed = 1; /* a bin holds at most 4 GiB - 1 */
        return;
    }
    size_t bytes = (size_t)numel * itemsize;
    char dtype_str[4];
    memcpy(dtype_str, pi0_dtype_str(dtype), sizeof dtype_str);
    if (itemsize > 1 && !host_is_little_endian()) dtype_str[0] = '>'; /* the data goes as it is in memory */

    msgpack_pack_map(&pk, 4); /* the keys and their order of openpi's pack_array */
    pack_bin_key(&pk, "__ndarray__");
    msgpack_pack_true(&pk);
    pack_bin_key(&pk, "data");
    msgpack_pack_bin(&pk, bytes);
    msgpack_pack_bin_body(&pk, data, bytes);
    pack_bin_key(&pk, "dtype");
    pack_str_bytes(&pk, dtype_str, strlen(dtype_str));
    pack_bin_key(&pk, "shape");
    msgpack_pack_array(&pk, (size_t)ndim);
    for (int i = 0; i < ndim; i++) msgpack_pack_int64(&pk, shape[i]);
}

void pi0_pack_policy_reply(pi0_packer *p, const pi0_policy_result *r, double infer_ms, uint32_t extra_pairs) {
    pi0_pack_map(p, 2 + extra_pairs);
    pi0_pack_str(p, "actions");
    pi0_pack_ndarray(p, PI0_DTYPE_F64, 2, (int64_t[]){r->horizon, r->action_dims}, r->actions);
    pi0_pack_str(p, "policy_timing");
    pi0_pack_map(p, 1);
    pi0_pack_str(p, "infer_ms");
    pi0_pack_double(p, infer_ms);
}

void pi0_packer_free(pi0_packer *p) {
    if (!p) return;
    free(p->data);
    *p = (pi0_packer){0};
}
