/*
 * msgpack_tool.c - the wire codec on the command line, for tests/msgpack_vs_openpi.py.
 *
 *   msgpack_tool describe [IN]   decode one observation frame; print one line per field, in frame order:
 *                                  A <key hex> <dtype> <d0,d1,...|-> <crc32 of the little-endian data>
 *                                  S <key hex> <utf-8 hex|->
 *   msgpack_tool echo [IN]       decode one observation frame; write it back packed by pi0_packer as a flat
 *                                map {key: ndarray or str}
 *   msgpack_tool reply           write a reply-like frame that uses every pi0_pack_* function
 *   msgpack_tool describe|echo --batch
 *                                many frames in one run (one process start per case is slow under ASan):
 *                                stdin holds records <u64 little-endian size><frame>; stdout gets one record
 *                                <u8 0 ok, 1 refused><u64 size><output, or the error message> per frame
 *
 * IN defaults to stdin ("-" too); output goes to stdout. A frame that does not decode prints
 * "msgpack_tool: <message>" on stderr and exits 1. Built by `make` next to the tests when the server
 * libraries are present.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "server/msgpack_numpy.h"

static int usage(void) {
    fprintf(stderr, "usage: msgpack_tool describe|echo [IN|--batch]\n       msgpack_tool reply\n");
    return 2;
}

/* The whole of `path` (or stdin) in a malloc'ed buffer; NULL on failure. */
static uint8_t *read_all(const char *path, size_t *size) {
    FILE *f = !path || !strcmp(path, "-") ? stdin : fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, used = 0;
    uint8_t *buf = malloc(cap);
    for (size_t got; buf && (got = fread(buf + used, 1, cap - used, f)) > 0;) {
        used += got;
        if (used == cap) {
            uint8_t *grown = realloc(buf, cap *= 2);
            if (!grown) free(buf);
            buf = grown;
        }
    }
    int ok = buf && !ferror(f);
    if (f != stdin) fclose(f);
    if (!ok) {
        free(buf);
        return NULL;
    }
    *size = used;
    return buf;
}

static int write_all(const void *data, size_t size) {
    return fwrite(data, 1, size, stdout) == size && fflush(stdout) == 0 ? 0 : 1;
}

static void print_hex(FILE *out, const char *s) {
    if (!*s) fputc('-', out);
    for (; *s; s++) fprintf(out, "%02x", (unsigned char)*s);
}

static uint32_t crc32_update(uint32_t crc, const uint8_t *p, size_t n) { /* zlib's CRC-32, bit by bit */
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = crc >> 1 ^ (0xedb88320u & (0u - (crc & 1)));
    }
    return crc;
}

/* CRC-32 of the data as little-endian bytes, whatever the host order. */
static uint32_t crc32_le(const pi0_field *f) {
    const uint16_t one = 1;
    int little = *(const uint8_t *)&one == 1;
    size_t itemsize = pi0_dtype_size(f->dtype), numel = (size_t)pi0_field_numel(f);
    const uint8_t *p = f->data;
    uint32_t crc = 0xffffffffu;
    if (little) return ~crc32_update(crc, p, numel * itemsize);
    for (size_t e = 0; e < numel; e++, p += itemsize)
        for (size_t b = itemsize; b-- > 0;) crc = crc32_update(crc, p + b, 1);
    return ~crc;
}

/* The text of "describe" in a malloc'ed buffer; NULL when out of memory. */
static char *describe(const pi0_observation *obs, size_t *size) {
    char *text = NULL;
    FILE *out = open_memstream(&text, size);
    if (!out) return NULL;
    for (int i = 0; i < obs->count; i++) {
        const pi0_field *f = &obs->fields[i];
        fputs(f->kind == PI0_FIELD_ARRAY ? "A " : "S ", out);
        print_hex(out, f->key);
        if (f->kind == PI0_FIELD_STRING) {
            fputc(' ', out);
            print_hex(out, f->string);
            fputc('\n', out);
            continue;
        }
        fprintf(out, " %s ", pi0_dtype_str(f->dtype));
        if (f->ndim == 0) fputc('-', out);
        for (int d = 0; d < f->ndim; d++) fprintf(out, "%s%lld", d ? "," : "", (long long)f->shape[d]);
        fprintf(out, " %08x\n", (unsigned)crc32_le(f));
    }
    if (fclose(out) != 0) {
        free(text);
        return NULL;
    }
    return text;
}

/* The observation packed again as a flat map, in a malloc'ed buffer; NULL when the packer failed. */
static char *echo(const pi0_observation *obs, size_t *size) {
    pi0_packer p = {0};
    pi0_pack_map(&p, (uint32_t)obs->count);
    for (int i = 0; i < obs->count; i++) {
        const pi0_field *f = &obs->fields[i];
        pi0_pack_str(&p, f->key);
        if (f->kind == PI0_FIELD_STRING) pi0_pack_str(&p, f->string);
        else pi0_pack_ndarray(&p, f->dtype, f->ndim, f->shape, f->data);
    }
    if (p.failed) {
        pi0_packer_free(&p);
        return NULL;
    }
    *size = p.size;
    return (char *)p.data; /* the packer's buffer is plain malloc'ed memory */
}

/* Decodes one frame; *out gets the mode's output (0 returned) or the error message (1 returned). */
static int process(int is_describe, const uint8_t *frame, size_t size, char **out, size_t *out_size) {
    pi0_observation obs;
    pi0_error err = {0};
    if (pi0_observation_decode(frame, size, &obs, &err) != PI0_OK) {
        *out = strdup(err.message);
        *out_size = *out ? strlen(*out) : 0;
        return 1;
    }
    *out = is_describe ? describe(&obs, out_size) : echo(&obs, out_size);
    pi0_observation_free(&obs);
    if (*out) return 0;
    *out = strdup("the tool ran out of memory or the packer failed");
    *out_size = *out ? strlen(*out) : 0;
    return 1;
}

static uint64_t get_u64_le(const uint8_t *p) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--) value = value << 8 | p[i];
    return value;
}

static int run_batch(int is_describe, const uint8_t *input, size_t size) {
    for (size_t pos = 0; pos < size;) {
        uint64_t n = 0;
        if (size - pos < 8 || (n = get_u64_le(input + pos)) > size - pos - 8) {
            fprintf(stderr, "msgpack_tool: batch record at byte %zu is truncated\n", pos);
            return 1;
        }
        char *out = NULL;
        size_t out_size = 0;
        uint8_t head[9] = {(uint8_t)process(is_describe, input + pos + 8, (size_t)n, &out, &out_size)};
        for (int i = 0; i < 8; i++) head[1 + i] = (uint8_t)((uint64_t)out_size >> (8 * i));
        int failed = !out || write_all(head, sizeof head) || write_all(out, out_size);
        free(out);
        if (failed) return 1;
        pos += 8 + (size_t)n;
    }
    return 0;
}

/* A reply as the server sends one, plus every kind of value; msgpack_vs_openpi.py builds the same in Python. */
static int reply(void) {
    static const int64_t ints[] = {0, 1, 127, 128, 255, 256, 65535, 65536, 4294967295ll, 4294967296ll, INT64_MAX,
                                   -1, -32, -33, -128, -129, -32768, -32769, INT32_MIN, INT64_MIN};
    static const double doubles[] = {0.0, -0.0, 1.5, -1e-300, 1.7976931348623157e308, 5e-324, INFINITY, -INFINITY};
    double actions[10 * 7];
    for (int i = 0; i < 10 * 7; i++) actions[i] = i * 0.25 - 3;
    int64_t actions_shape[2] = {10, 7}, scalar_shape[1] = {0};
    uint8_t mask[3] = {1, 0, 1};
    int64_t mask_shape[1] = {3};
    uint16_t halves[4] = {0x3c00, 0xc000, 0x7c00, 0x0001};
    int64_t halves_shape[2] = {2, 2};
    int32_t one = -7;

    pi0_packer p = {0};
    pi0_pack_map(&p, 11);
    pi0_pack_str(&p, "actions"), pi0_pack_ndarray(&p, PI0_DTYPE_F64, 2, actions_shape, actions);
    pi0_pack_str(&p, "policy_timing"), pi0_pack_map(&p, 1), pi0_pack_str(&p, "infer_ms"), pi0_pack_double(&p, 12.5);
    pi0_pack_str(&p, "server_timing"), pi0_pack_map(&p, 2);
    pi0_pack_str(&p, "infer_ms"), pi0_pack_double(&p, 13.25);
    pi0_pack_str(&p, "prev_total_ms"), pi0_pack_double(&p, 20.0);
    pi0_pack_str(&p, "ints"), pi0_pack_array(&p, sizeof ints / sizeof ints[0]);
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) pi0_pack_int(&p, ints[i]);
    pi0_pack_str(&p, "doubles"), pi0_pack_array(&p, sizeof doubles / sizeof doubles[0]);
    for (size_t i = 0; i < sizeof doubles / sizeof doubles[0]; i++) pi0_pack_double(&p, doubles[i]);
    pi0_pack_str(&p, "flags"), pi0_pack_array(&p, 3), pi0_pack_bool(&p, 1), pi0_pack_bool(&p, 0), pi0_pack_nil(&p);
    pi0_pack_str(&p, "text"), pi0_pack_str(&p, "caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\xa4\x96");
    pi0_pack_str(&p, "mask"), pi0_pack_ndarray(&p, PI0_DTYPE_BOOL, 1, mask_shape, mask);
    pi0_pack_str(&p, "halves"), pi0_pack_ndarray(&p, PI0_DTYPE_F16, 2, halves_shape, halves);
    pi0_pack_str(&p, "scalar"), pi0_pack_ndarray(&p, PI0_DTYPE_I32, 0, NULL, &one);
    pi0_pack_str(&p, "empty"), pi0_pack_ndarray(&p, PI0_DTYPE_F32, 1, scalar_shape, NULL);
    int rc = 1;
    if (p.failed) fprintf(stderr, "msgpack_tool: the packer failed\n");
    else rc = write_all(p.data, p.size);
    pi0_packer_free(&p);
    return rc;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    if (!strcmp(argv[1], "reply")) return argc == 2 ? reply() : usage();
    int is_describe = !strcmp(argv[1], "describe");
    if ((!is_describe && strcmp(argv[1], "echo")) || argc > 3) return usage();
    int batch = argc > 2 && !strcmp(argv[2], "--batch");
    const char *path = argc > 2 && !batch ? argv[2] : NULL;
    size_t size = 0;
    uint8_t *input = read_all(path, &size);
    if (!input) {
        fprintf(stderr, "msgpack_tool: cannot read %s\n", path ? path : "stdin");
        return 1;
    }
    int rc = 1;
    if (batch) {
        rc = run_batch(is_describe, input, size);
    } else {
        char *out = NULL;
        size_t out_size = 0;
        if (process(is_describe, input, size, &out, &out_size) == 0) rc = write_all(out, out_size);
        else fprintf(stderr, "msgpack_tool: %s\n", out ? out : "out of memory");
        free(out);
    }
    free(input);
    return rc;
}
