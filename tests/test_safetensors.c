/*
 * test_safetensors.c - the safetensors reader and writer: round trips of every dtype, exact BF16/F16
 * conversion, the shared fixture, and hostile files (hand-made corruptions, every truncation and a
 * few thousand random byte mutations), each of which must fail cleanly and never read out of bounds.
 */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "io/safetensors.h"
#include "util/half.h"

#define PATH_SIZE 512

static char tmp_dir[] = "/tmp/pi0_test_safetensors_XXXXXX";

static void tmp_path(char *buf, const char *name) { snprintf(buf, PATH_SIZE, "%s/%s", tmp_dir, name); }

static int write_bytes(const char *path, const void *bytes, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) return 0;
    int ok = fwrite(bytes, 1, size, f) == size;
    return fclose(f) == 0 && ok;
}

/* The whole file in a malloc'ed buffer (NULL on failure); *size gets its length. */
static unsigned char *read_bytes(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long length = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *bytes = length >= 0 ? malloc((size_t)length + 1) : NULL;
    if (bytes && fread(bytes, 1, (size_t)length, f) != (size_t)length) {
        free(bytes);
        bytes = NULL;
    }
    fclose(f);
    *size = (size_t)length;
    return bytes;
}

static void put_u64_le(unsigned char *p, uint64_t value) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(value >> (8 * i));
}

static uint64_t get_u64_le(const unsigned char *p) {
    uint64_t value = 0;
    for (int i = 7; i >= 0; i--) value = value << 8 | p[i];
    return value;
}

/* A hand-made file: header size, `header_size` header bytes, `data_size` bytes of a counting pattern. */
static int write_raw(const char *path, const char *header, size_t header_size, size_t data_size) {
    size_t size = 8 + header_size + data_size;
    unsigned char *bytes = malloc(size);
    if (!bytes) return 0;
    put_u64_le(bytes, header_size);
    memcpy(bytes + 8, header, header_size);
    for (size_t i = 0; i < data_size; i++) bytes[8 + header_size + i] = (unsigned char)i;
    int ok = write_bytes(path, bytes, size);
    free(bytes);
    return ok;
}

static int file_is_empty(const st_file *f) {
    return !f->map && !f->map_size && !f->tensors && !f->num_tensors && !f->meta_keys && !f->meta_values &&
           !f->num_meta;
}

/* st_open must fail with `expected`, name the file and mention `needle`, and leave `file` zeroed. */
static void expect_open_fails(const char *path, pi0_status expected, const char *needle, const char *what) {
    st_file f;
    memset(&f, 0xab, sizeof f); /* st_open must not rely on the caller zeroing it */
    pi0_error err = {0};
    pi0_status status = st_open(path, &f, &err);
    CHECK(status == expected, "%s: status %d, expected %d (%s)", what, status, expected, err.message);
    CHECK(err.status == status, "%s", what);
    CHECK(strstr(err.message, needle), "%s: message '%s' lacks '%s'", what, err.message, needle);
    CHECK(strstr(err.message, path), "%s: message '%s' does not name the file", what, err.message);
    CHECK(file_is_empty(&f), "%s: st_file not zeroed after failure", what);
    st_close(&f);
}

static void expect_header_fails(const char *header, size_t data_size, const char *needle, const char *what) {
    char path[PATH_SIZE];
    tmp_path(path, "hostile.safetensors");
    if (!write_raw(path, header, strlen(header), data_size)) {
        CHECK(0, "%s: cannot write %s", what, path);
        return;
    }
    expect_open_fails(path, PI0_ERR_FORMAT, needle, what);
}

static uint32_t float_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* --- round trips ------------------------------------------------------------------------------- */

static void test_dtype_names_and_shape_str(void) {
    static const char *names[] = {"F32", "BF16", "F16", "I32", "I64", "BOOL", "U8"};
    static const size_t sizes[] = {4, 2, 2, 4, 8, 1, 1};
    for (int d = ST_F32; d <= ST_U8; d++) {
        CHECK(strcmp(st_dtype_name((st_dtype)d), names[d]) == 0, "dtype %d", d);
        CHECK(st_dtype_size((st_dtype)d) == sizes[d], "dtype %d", d);
    }
    char buf[64];
    int64_t shape[4] = {2, 224, 224, 3};
    CHECK(strcmp(st_shape_str(4, shape, buf, sizeof buf), "[2, 224, 224, 3]") == 0, "%s", buf);
    CHECK(strcmp(st_shape_str(0, shape, buf, sizeof buf), "[]") == 0, "%s", buf);
    char small[6];
    memset(small, 'x', sizeof small);
    st_shape_str(4, shape, small, sizeof small);
    CHECK(memchr(small, '\0', sizeof small) != NULL, "truncated output is not terminated");
    CHECK(strncmp(small, "[2, 2", 5) == 0, "%s", small);
}

typedef struct {
    const char *name;
    st_dtype dtype;
    int rank;
    int64_t shape[3];
    const void *data;
    size_t nbytes;
    float as_f32[6]; /* what st_to_f32 must give */
} roundtrip_case;

static void test_roundtrip_every_dtype(void) {
    static const float f32[6] = {1.5f, -2.25f, 0.0f, 3e-5f, -1e10f, 7.0f};
    static const uint16_t bf16[4] = {0x3f80, 0xc040, 0x0000, 0x4120};    /* 1, -3, 0, 10 */
    static const uint16_t f16[3] = {0x3c00, 0xc200, 0x0001};              /* 1, -3, 2^-24 */
    static const int32_t i32[4] = {0, -1, 123456, -7};
    static const int64_t i64[3] = {1, -1, (int64_t)1 << 40};
    static const uint8_t bools[5] = {0, 1, 0, 1, 1};
    static const uint8_t u8[6] = {0, 1, 127, 128, 254, 255};
    static const float scalar = 42.0f;
    /* Names out of order, so the reader's sort and bsearch are exercised. */
    const roundtrip_case cases[] = {
        {"z.f32", ST_F32, 2, {2, 3}, f32, sizeof f32, {1.5f, -2.25f, 0.0f, 3e-5f, -1e10f, 7.0f}},
        {"a.bf16", ST_BF16, 1, {4}, bf16, sizeof bf16, {1, -3, 0, 10}},
        {"m.f16", ST_F16, 1, {3}, f16, sizeof f16, {1, -3, 0x1p-24f}},
        {"b.i32", ST_I32, 2, {2, 2}, i32, sizeof i32, {0, -1, 123456, -7}},
        {"y.i64", ST_I64, 1, {3}, i64, sizeof i64, {1, -1, 0x1p40f}},
        {"c.bool", ST_BOOL, 1, {5}, bools, sizeof bools, {0, 1, 0, 1, 1}},
        {"x.u8", ST_U8, 3, {2, 3, 1}, u8, sizeof u8, {0, 1, 127, 128, 254, 255}},
        {"scalar", ST_F32, 0, {0}, &scalar, sizeof scalar, {42}},
        {"empty", ST_F32, 2, {0, 5}, NULL, 0, {0}},
    };
    const int num_cases = (int)(sizeof cases / sizeof cases[0]);
    char path[PATH_SIZE];
    tmp_path(path, "roundtrip.safetensors");
    pi0_error err = {0};
    st_writer w;
    st_writer_init(&w);
    for (int i = 0; i < num_cases; i++) {
        const roundtrip_case *c = &cases[i];
        CHECK(st_writer_add(&w, c->name, c->dtype, c->rank, c->shape, c->data, &err) == PI0_OK, "%s", err.message);
    }
    CHECK(st_writer_meta(&w, "format", "pt", &err) == PI0_OK, "%s", err.message);
    CHECK(st_writer_meta(&w, "note", "h\xc3\xa9llo \"quoted\"", &err) == PI0_OK, "%s", err.message);
    pi0_status written = st_writer_write(&w, path, &err);
    st_writer_free(&w);
    REQUIRE(written == PI0_OK, "%s", err.message);

    st_file f;
    REQUIRE(st_open(path, &f, &err) == PI0_OK, "%s", err.message);
    CHECK(f.num_tensors == num_cases, "%d tensors", f.num_tensors);
    uint64_t header_size = get_u64_le(f.map);
    CHECK((8 + header_size) % 8 == 0, "data region starts at %llu", (unsigned long long)(8 + header_size));
    for (int i = 1; i < f.num_tensors; i++)
        CHECK(strcmp(f.tensors[i - 1].name, f.tensors[i].name) < 0, "tensors not sorted at %d", i);
    for (int i = 0; i < num_cases; i++) {
        const roundtrip_case *c = &cases[i];
        const st_tensor *t = st_find(&f, c->name);
        CHECK(t != NULL, "%s missing", c->name);
        if (!t) continue;
        CHECK(t->dtype == c->dtype && t->rank == c->rank, "%s", c->name);
        uint64_t numel = 1;
        for (int d = 0; d < c->rank; d++) {
            CHECK(t->shape[d] == c->shape[d], "%s dim %d", c->name, d);
            numel *= (uint64_t)c->shape[d];
        }
        CHECK(t->numel == numel && t->nbytes == c->nbytes, "%s: numel %llu nbytes %llu", c->name,
              (unsigned long long)t->numel, (unsigned long long)t->nbytes);
        CHECK(c->nbytes == 0 || memcmp(t->data, c->data, c->nbytes) == 0, "%s data differ", c->name);
        float out[6] = {0};
        st_to_f32(t, out);
        for (uint64_t k = 0; k < numel; k++)
            CHECK(out[k] == c->as_f32[k], "%s[%llu] = %g, expected %g", c->name, (unsigned long long)k, out[k],
                  c->as_f32[k]);
    }
    CHECK(st_find(&f, "missing") == NULL, "found a tensor that was never written");
    CHECK(st_find(&f, "") == NULL, "found a tensor with an empty name");
    CHECK(f.num_meta == 2, "%d metadata entries", f.num_meta);
    CHECK(st_meta(&f, "format") && strcmp(st_meta(&f, "format"), "pt") == 0, "metadata 'format' lost");
    CHECK(st_meta(&f, "note") && strcmp(st_meta(&f, "note"), "h\xc3\xa9llo \"quoted\"") == 0, "metadata 'note' lost");
    CHECK(st_meta(&f, "absent") == NULL, "found absent metadata");
    st_close(&f);
    CHECK(file_is_empty(&f), "st_close leaves the st_file zeroed");
    st_close(&f); /* closing twice is harmless */
}

static void test_empty_file_roundtrip(void) {
    char path[PATH_SIZE];
    tmp_path(path, "no_tensors.safetensors");
    pi0_error err = {0};
    st_writer w;
    st_writer_init(&w);
    CHECK(st_writer_write(&w, path, &err) == PI0_OK, "%s", err.message);
    st_writer_free(&w);
    st_file f;
    REQUIRE(st_open(path, &f, &err) == PI0_OK, "%s", err.message);
    CHECK(f.num_tensors == 0 && f.num_meta == 0, "%d tensors, %d metadata", f.num_tensors, f.num_meta);
    CHECK(st_find(&f, "x") == NULL && st_meta(&f, "x") == NULL, "lookup in an empty file");
    st_close(&f);
}

/* Hand-made files the writer would never produce but the format allows. */
static void test_reader_accepts_valid_variants(void) {
    static const struct {
        const char *what, *header;
        size_t data_size;
        int num_tensors;
    } cases[] = {
        {"empty object", "{}", 0, 0},
        {"padded with spaces", "{}        ", 0, 0},
        {"unaligned data region", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, 1},
        {"field order free", "{\"x\":{\"data_offsets\":[0,8],\"shape\":[2],\"dtype\":\"F32\"}}", 8, 1},
        {"empty tensor at the end", "{\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]}}", 4, 1},
        {"empty metadata", "{\"__metadata__\":{}}", 0, 0},
        {"tensors sharing an empty offset",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
         "\"b\":{\"dtype\":\"U8\",\"shape\":[0,3],\"data_offsets\":[0,0]},"
         "\"c\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[0,2]}}",
         2, 3},
    };
    char path[PATH_SIZE];
    tmp_path(path, "variant.safetensors");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *header = cases[i].header;
        REQUIRE(write_raw(path, header, strlen(header), cases[i].data_size), "%s: cannot write", cases[i].what);
        st_file f;
        pi0_error err = {0};
        pi0_status status = st_open(path, &f, &err);
        CHECK(status == PI0_OK, "%s: %s", cases[i].what, err.message);
        CHECK(f.num_tensors == cases[i].num_tensors, "%s: %d tensors", cases[i].what, f.num_tensors);
        st_close(&f);
    }
    /* The F32 tensor behind an odd-length header is unaligned in the mapping and still converts. */
    const char *header = cases[2].header;
    size_t header_size = strlen(header);
    REQUIRE((8 + header_size) % 4 != 0, "the header no longer misaligns the data");
    unsigned char bytes[128];
    float values[2] = {3.25f, -0.5f};
    put_u64_le(bytes, header_size);
    memcpy(bytes + 8, header, header_size);
    memcpy(bytes + 8 + header_size, values, sizeof values);
    REQUIRE(write_bytes(path, bytes, 8 + header_size + sizeof values), "cannot write %s", path);
    st_file f;
    pi0_error err = {0};
    REQUIRE(st_open(path, &f, &err) == PI0_OK, "%s", err.message);
    float out[2];
    st_to_f32(st_find(&f, "x"), out);
    CHECK(out[0] == 3.25f && out[1] == -0.5f, "%g %g", out[0], out[1]);
    st_close(&f);
}

static void test_writer_rejects_bad_arguments(void) {
    static const float data[4] = {0};
    static const int64_t four[1] = {4}, ones[ST_MAX_RANK + 1] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    static const int64_t negative[2] = {2, -1}, huge[2] = {INT64_MAX, 4};
    static const struct {
        const char *what, *name;
        st_dtype dtype;
        int rank;
        const int64_t *shape;
        const void *data;
    } bad[] = {
        {"duplicate name", "a", ST_F32, 1, four, data},
        {"empty name", "", ST_F32, 1, four, data},
        {"NULL name", NULL, ST_F32, 1, four, data},
        {"reserved name", "__metadata__", ST_F32, 1, four, data},
        {"invalid UTF-8 name", "bad\xff", ST_F32, 1, four, data},
        {"rank 9", "r", ST_F32, ST_MAX_RANK + 1, ones, data},
        {"rank -1", "r", ST_F32, -1, ones, data},
        {"NULL shape", "s", ST_F32, 1, NULL, data},
        {"negative dimension", "n", ST_F32, 2, negative, data},
        {"shape over 2^63 bytes", "h", ST_F32, 2, huge, data},
        {"invalid dtype", "d", (st_dtype)99, 1, four, data},
        {"NULL data", "null", ST_F32, 1, four, NULL},
    };
    pi0_error err = {0};
    st_writer w;
    st_writer_init(&w);
    CHECK(st_writer_add(&w, "a", ST_F32, 1, four, data, &err) == PI0_OK, "%s", err.message);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err = (pi0_error){0};
        pi0_status status = st_writer_add(&w, bad[i].name, bad[i].dtype, bad[i].rank, bad[i].shape, bad[i].data, &err);
        CHECK(status == PI0_ERR_INVALID_ARGUMENT && err.message[0], "%s accepted", bad[i].what);
    }
    CHECK(st_writer_add(&w, "r8", ST_F32, ST_MAX_RANK, ones, data, &err) == PI0_OK, "%s", err.message);
    CHECK(st_writer_meta(&w, "k", "v", &err) == PI0_OK, "%s", err.message);
    CHECK(st_writer_meta(&w, "k", "w", &err) == PI0_ERR_INVALID_ARGUMENT, "duplicate metadata key accepted");
    CHECK(st_writer_meta(&w, "k2", "\xc3", &err) == PI0_ERR_INVALID_ARGUMENT, "invalid UTF-8 metadata accepted");
    CHECK(w.count == 2 && w.num_meta == 1, "%d entries, %d meta", w.count, w.num_meta);

    /* A directory that does not exist: an i/o error naming the file. */
    char path[PATH_SIZE];
    tmp_path(path, "no/such/dir.safetensors");
    CHECK(st_writer_write(&w, path, &err) == PI0_ERR_IO, "write into a missing directory: %s", err.message);
    CHECK(strstr(err.message, path), "%s", err.message);
    st_writer_free(&w);
    CHECK(w.count == 0 && w.entries == NULL && w.num_meta == 0, "st_writer_free leaves the writer zeroed");
}

/* Writing over an existing file replaces it whole and leaves no temporary files behind. */
static void test_writer_replaces_file(void) {
    char path[PATH_SIZE];
    tmp_path(path, "replace.safetensors");
    static const float first[2] = {1, 2}, second[3] = {4, 5, 6};
    pi0_error err = {0};
    for (int round = 0; round < 2; round++) {
        st_writer w;
        st_writer_init(&w);
        pi0_status status = st_writer_add(&w, "x", ST_F32, 1, (int64_t[]){round ? 3 : 2}, round ? second : first, &err);
        CHECK(status == PI0_OK, "%s", err.message);
        CHECK(st_writer_write(&w, path, &err) == PI0_OK, "%s", err.message);
        st_writer_free(&w);
    }
    st_file f;
    REQUIRE(st_open(path, &f, &err) == PI0_OK, "%s", err.message);
    const st_tensor *x = st_find(&f, "x");
    CHECK(x && x->numel == 3 && memcmp(x->data, second, sizeof second) == 0, "the second write did not replace it");
    st_close(&f);
    DIR *dir = opendir(tmp_dir);
    REQUIRE(dir, "cannot list %s", tmp_dir);
    for (struct dirent *entry; (entry = readdir(dir));)
        CHECK(!strstr(entry->d_name, ".tmp."), "temporary file %s left behind", entry->d_name);
    closedir(dir);
}

/* --- conversion ---------------------------------------------------------------------------------- */

/* The float value of an IEEE half, computed independently of the library, in double. */
static double half_reference(uint16_t h) {
    int sign = h >> 15, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    double magnitude = exponent == 31 ? (mantissa ? NAN : INFINITY)
                       : exponent == 0 ? ldexp(mantissa, -24)
                                       : ldexp(1024 + mantissa, exponent - 25);
    return sign ? -magnitude : magnitude;
}

/* A tensor over `numel` 16-bit values stored at an odd address, so conversion meets unaligned data. */
static st_tensor unaligned_tensor(st_dtype dtype, unsigned char *storage, const void *values, size_t numel) {
    size_t size = st_dtype_size(dtype);
    memcpy(storage + 1, values, numel * size);
    st_tensor t = {.dtype = dtype, .rank = 1, .numel = numel, .nbytes = numel * size, .data = storage + 1};
    t.shape[0] = (int64_t)numel;
    return t;
}

static void test_bf16_to_f32(void) {
    static const struct { uint16_t in; uint32_t out; } known[] = {
        {0x3f80, 0x3f800000}, /* 1 */
        {0xc000, 0xc0000000}, /* -2 */
        {0x8000, 0x80000000}, /* -0 */
        {0x0001, 0x00010000}, /* smallest subnormal */
        {0x7f80, 0x7f800000}, /* inf */
        {0xff80, 0xff800000}, /* -inf */
        {0x7fc0, 0x7fc00000}, /* nan */
        {0x7f7f, 0x7f7f0000}, /* largest finite */
    };
    enum { N = 65536 };
    uint16_t *all = malloc(N * sizeof *all);
    unsigned char *storage = malloc(N * 2 + 1);
    float *out = malloc(N * sizeof *out);
    REQUIRE(all && storage && out, "out of memory");
    for (int i = 0; i < N; i++) all[i] = (uint16_t)i;
    st_tensor t = unaligned_tensor(ST_BF16, storage, all, N);
    st_to_f32(&t, out);
    for (int i = 0; i < N; i++)
        if (float_bits(out[i]) != (uint32_t)i << 16) {
            CHECK(0, "bf16 0x%04x -> 0x%08x", i, float_bits(out[i]));
            break;
        }
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        CHECK(float_bits(out[known[i].in]) == known[i].out, "bf16 0x%04x -> 0x%08x", known[i].in,
              float_bits(out[known[i].in]));
    CHECK(signbit(out[0x8000]) && out[0x8000] == 0.0f, "bf16 -0 lost its sign");
    CHECK(isnan(out[0x7fc0]) && isinf(out[0xff80]) && out[0xff80] < 0, "bf16 nan/-inf wrong");
    free(all);
    free(storage);
    free(out);
}

/* util/half.h's three-piece split (the CUDA patch embedding's): at every binary exponent where it is exact, random
 * floats of both signs are the sum of their pieces, the first is the float's bf16 rounding and each later piece at
 * most half a unit of the last place of the one before; zero splits into zeros. */
static void test_f32_to_bf16x3(void) {
    uint32_t state = 12345;
    int inexact = 0, misplaced = 0;
    for (int e = -109; e <= 127; e++)
        for (int i = 0; i < 2000; i++) {
            state = state * 1664525u + 1013904223u;
            float x = ldexpf(1.0f + (float)(state >> 8) / 16777216.0f, e - 1) * (i & 1 ? -1.0f : 1.0f);
            uint16_t p[3];
            f32_to_bf16x3(x, p);
            inexact += (double)bf16_to_f32(p[0]) + bf16_to_f32(p[1]) + bf16_to_f32(p[2]) != (double)x;
            misplaced += p[0] != f32_to_bf16(x);
            for (int k = 1; k < 3; k++) { /* half an ulp of an 8-bit significand: 2^-8 of its leading power of two */
                float before = bf16_to_f32(p[k - 1]), piece = fabsf(bf16_to_f32(p[k]));
                misplaced += before == 0.0f ? piece != 0.0f : piece > ldexpf(1.0f, ilogbf(before) - 8);
            }
        }
    CHECK(inexact == 0, "%d floats are not the sum of their three bf16 pieces", inexact);
    CHECK(misplaced == 0, "%d pieces out of place", misplaced);
    uint16_t zero[3];
    f32_to_bf16x3(0.0f, zero);
    CHECK(!zero[0] && !zero[1] && !zero[2], "0 splits into %04x %04x %04x", zero[0], zero[1], zero[2]);
}

static void test_f16_to_f32(void) {
    static const struct { uint16_t in; uint32_t out; } known[] = {
        {0x3c00, 0x3f800000}, /* 1 */
        {0xc000, 0xc0000000}, /* -2 */
        {0x3555, 0x3eaaa000}, /* 0.333251953125 */
        {0x7bff, 0x477fe000}, /* 65504, largest finite */
        {0x0400, 0x38800000}, /* 2^-14, smallest normal */
        {0x03ff, 0x387fc000}, /* 1023 * 2^-24, largest subnormal */
        {0x0001, 0x33800000}, /* 2^-24, smallest subnormal */
        {0x8001, 0xb3800000}, /* -2^-24 */
        {0x0000, 0x00000000}, /* 0 */
        {0x8000, 0x80000000}, /* -0 */
        {0x7c00, 0x7f800000}, /* inf */
        {0xfc00, 0xff800000}, /* -inf */
        {0x7e00, 0x7fc00000}, /* quiet nan */
        {0x7c01, 0x7f802000}, /* signalling nan keeps its payload */
    };
    enum { N = 65536 };
    uint16_t *all = malloc(N * sizeof *all);
    unsigned char *storage = malloc(N * 2 + 1);
    float *out = malloc(N * sizeof *out);
    REQUIRE(all && storage && out, "out of memory");
    for (int i = 0; i < N; i++) all[i] = (uint16_t)i;
    st_tensor t = unaligned_tensor(ST_F16, storage, all, N);
    st_to_f32(&t, out);
    int mismatches = 0;
    for (int i = 0; i < N && mismatches < 5; i++) {
        double expected = half_reference((uint16_t)i);
        int same = isnan(expected) ? isnan(out[i])
                                   : (double)out[i] == expected && !signbit(out[i]) == !signbit(expected);
        if (!same) {
            CHECK(0, "f16 0x%04x -> %g (0x%08x), expected %g", i, out[i], float_bits(out[i]), expected);
            mismatches++;
        }
    }
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
        CHECK(float_bits(out[known[i].in]) == known[i].out, "f16 0x%04x -> 0x%08x", known[i].in,
              float_bits(out[known[i].in]));
    free(all);
    free(storage);
    free(out);
}

/* Tensors spanning many conversion blocks (the parallel path) give the same values as one by one. */
static void test_large_conversion(void) {
    enum { N = 5 * 65536 + 17 };
    unsigned char *storage = malloc((size_t)N * 8 + 1);
    void *values = malloc((size_t)N * 8);
    float *out = malloc((size_t)N * sizeof *out);
    REQUIRE(storage && values && out, "out of memory");
    uint32_t state = 12345;
    static const st_dtype dtypes[] = {ST_F32, ST_BF16, ST_F16, ST_I32, ST_I64, ST_U8};
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        size_t size = st_dtype_size(dtypes[d]);
        unsigned char *bytes = values;
        for (size_t i = 0; i < (size_t)N * size; i++) {
            state = state * 1664525u + 1013904223u;
            bytes[i] = (unsigned char)(state >> 24);
        }
        st_tensor t = unaligned_tensor(dtypes[d], storage, values, N);
        st_to_f32(&t, out);
        int bad = 0;
        for (size_t i = 0; i < N && !bad; i++) {
            const unsigned char *p = bytes + i * size;
            float expected;
            uint16_t u16;
            uint32_t u32;
            int32_t i32;
            int64_t i64;
            switch (dtypes[d]) {
            case ST_F32: memcpy(&expected, p, 4); break;
            case ST_BF16: memcpy(&u16, p, 2); u32 = (uint32_t)u16 << 16; memcpy(&expected, &u32, 4); break;
            case ST_F16: memcpy(&u16, p, 2); expected = (float)half_reference(u16); break;
            case ST_I32: memcpy(&i32, p, 4); expected = (float)i32; break;
            case ST_I64: memcpy(&i64, p, 8); expected = (float)i64; break;
            default: expected = (float)*p; break;
            }
            bad = isnan(expected) ? !isnan(out[i]) : float_bits(out[i]) != float_bits(expected);
            CHECK(!bad, "%s element %zu: %g, expected %g", st_dtype_name(dtypes[d]), i, out[i], expected);
        }
    }
    free(storage);
    free(values);
    free(out);
}

/* --- the shared fixture ----------------------------------------------------------------------------- */

static void test_fixture_model(void) {
    char path[PATH_SIZE];
    snprintf(path, sizeof path, "%s/pi0_tiny/model.safetensors", fixtures_dir());
    st_file f;
    pi0_error err = {0};
    REQUIRE(st_open(path, &f, &err) == PI0_OK, "%s", err.message);
    CHECK(f.num_tensors == 106, "%d tensors", f.num_tensors); /* counted with python's json module */
    for (int i = 0; i < f.num_tensors; i++)
        CHECK(st_find(&f, f.tensors[i].name) == &f.tensors[i], "st_find(%s) misses", f.tensors[i].name);
    const st_tensor *patch = st_find(&f, "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
                                         "embeddings.patch_embedding.weight");
    CHECK(patch != NULL, "patch embedding missing");
    if (patch) {
        char shape[64];
        st_shape_str(patch->rank, patch->shape, shape, sizeof shape);
        CHECK(patch->dtype == ST_F32 && strcmp(shape, "[64, 3, 14, 14]") == 0, "%s %s", st_dtype_name(patch->dtype),
              shape);
        CHECK(patch->numel == 64 * 3 * 14 * 14 && patch->nbytes == patch->numel * 4, "numel %llu",
              (unsigned long long)patch->numel);
    }
    const st_tensor *bias = st_find(&f, "action_in_proj.bias");
    CHECK(bias && bias->rank == 1 && bias->shape[0] == 48, "action_in_proj.bias missing or misshapen");
    if (bias) {
        float out[48];
        st_to_f32(bias, out);
        static const uint32_t first[4] = {0xbed7fa27, 0x3e8913be, 0x3d72f6c7, 0xbeb0af79}; /* from python */
        for (int i = 0; i < 4; i++) CHECK(float_bits(out[i]) == first[i], "bias[%d] = %g", i, out[i]);
    }
    st_close(&f);
}

/* --- hostile files ----------------------------------------------------------------------------------- */

static void test_hostile_framing(void) {
    char path[PATH_SIZE];
    tmp_path(path, "framing.safetensors");
    unsigned char bytes[32] = {0};

    REQUIRE(write_bytes(path, bytes, 0), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "too small", "empty file");
    REQUIRE(write_bytes(path, "{}\0\0\0\0\0", 7), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "too small", "7-byte file");

    put_u64_le(bytes, 0);
    REQUIRE(write_bytes(path, bytes, 8), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "not valid JSON", "empty header");

    put_u64_le(bytes, 100);
    memcpy(bytes + 8, "{}", 2);
    REQUIRE(write_bytes(path, bytes, 18), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "exceeds the file size", "header size past the end");

    put_u64_le(bytes, 17);
    REQUIRE(write_bytes(path, bytes, 24), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "exceeds the file size", "header size one past the end");

    put_u64_le(bytes, UINT64_MAX);
    REQUIRE(write_bytes(path, bytes, 16), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "100 MiB", "header size 2^64-1");

    put_u64_le(bytes, UINT64_MAX - 7); /* 8 + N wraps to 0 */
    REQUIRE(write_bytes(path, bytes, 16), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "header size", "header size wrapping 8 + N");

    /* Over the limit but inside the file: a sparse 200 MiB file costs no disk. */
    put_u64_le(bytes, ((uint64_t)100 << 20) + 1);
    REQUIRE(write_bytes(path, bytes, 8), "cannot write %s", path);
    REQUIRE(truncate(path, (off_t)200 << 20) == 0, "cannot extend %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "100 MiB", "header size over the limit");

    /* A NUL byte inside the header text. */
    REQUIRE(write_raw(path, "{}\0 ", 4, 0), "cannot write %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "not valid JSON", "NUL in header");

    tmp_path(path, "does_not_exist.safetensors");
    expect_open_fails(path, PI0_ERR_IO, "cannot open", "missing file");
    expect_open_fails(tmp_dir, PI0_ERR_IO, "not a regular file", "directory");
}

#define TENSOR(dtype, shape, offsets) "{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":" offsets "}"

static const struct {
    const char *what, *header;
    size_t data_size;
    const char *needle;
} bad_headers[] = {
    {"not JSON", "hello", 0, "not valid JSON"},
    {"truncated JSON", "{\"x\":", 0, "not valid JSON"},
    {"trailing garbage", "{} x", 0, "not valid JSON"},
    {"JSON array", "[1, 2]", 0, "must be a JSON object"},
    {"escaped NUL in a name", "{\"a\\u0000b\":" TENSOR("F32", "[1]", "[0,4]") "}", 4, "not valid JSON"},
    {"integer too big for JSON", "{\"x\":" TENSOR("U8", "[1]", "[0,99999999999999999999]") "}", 4, "not valid JSON"},
    {"duplicate names", "{\"x\":" TENSOR("U8", "[1]", "[0,1]") ",\"x\":" TENSOR("U8", "[1]", "[1,2]") "}", 2,
     "duplicate"},
    {"entry not an object", "{\"x\":[1]}", 0, "not a JSON object"},
    {"empty name", "{\"\":" TENSOR("U8", "[1]", "[0,1]") "}", 1, "empty tensor name"},
    {"unknown field", "{\"x\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"foo\":1}}", 1,
     "unknown field 'foo'"},
    {"missing dtype", "{\"x\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1, "missing 'dtype'"},
    {"missing shape", "{\"x\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1, "missing 'shape'"},
    {"missing offsets", "{\"x\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, "missing 'data_offsets'"},
    {"unknown dtype", "{\"x\":" TENSOR("F64", "[1]", "[0,8]") "}", 8, "unsupported dtype 'F64'"},
    {"lower-case dtype", "{\"x\":" TENSOR("f32", "[1]", "[0,4]") "}", 4, "unsupported dtype 'f32'"},
    {"dtype not a string", "{\"x\":{\"dtype\":4,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "dtype is not a string"},
    {"shape not an array", "{\"x\":" TENSOR("U8", "1", "[0,1]") "}", 1, "shape is not an array"},
    {"negative dim", "{\"x\":" TENSOR("U8", "[2,-3]", "[0,6]") "}", 6, "negative"},
    {"real dim", "{\"x\":" TENSOR("U8", "[2.0]", "[0,2]") "}", 2, "not an integer"},
    {"string dim", "{\"x\":" TENSOR("U8", "[\"2\"]", "[0,2]") "}", 2, "not an integer"},
    {"rank 9", "{\"x\":" TENSOR("U8", "[1,1,1,1,1,1,1,1,1]", "[0,1]") "}", 1, "rank 9"},
    {"shape product overflows u64", "{\"x\":" TENSOR("U8", "[4294967296,4294967296]", "[0,0]") "}", 0, "overflows"},
    {"shape product overflows u64 before a zero",
     "{\"x\":" TENSOR("U8", "[4294967296,4294967296,0]", "[0,0]") "}", 0, "overflows"},
    {"byte size overflows u64", "{\"x\":" TENSOR("F32", "[4611686018427387904]", "[0,0]") "}", 0, "overflows"},
    {"numel * size != span", "{\"x\":" TENSOR("F32", "[2,3]", "[0,20]") "}", 24, "needs 24 bytes"},
    {"scalar with no bytes", "{\"x\":" TENSOR("F32", "[]", "[0,0]") "}", 4, "needs 4 bytes"},
    {"offsets end < begin", "{\"x\":" TENSOR("F32", "[1]", "[8,4]") "}", 16, "end before they begin"},
    {"offsets past the end", "{\"x\":" TENSOR("F32", "[2]", "[8,16]") "}", 12, "exceed the data region (12 bytes)"},
    {"empty tensor past the end", "{\"x\":" TENSOR("F32", "[0]", "[13,13]") "}", 12, "exceed the data region"},
    {"offsets of length 1", "{\"x\":" TENSOR("U8", "[1]", "[0]") "}", 1, "data_offsets must be [begin, end]"},
    {"offsets of length 3", "{\"x\":" TENSOR("U8", "[1]", "[0,1,2]") "}", 2, "data_offsets must be [begin, end]"},
    {"offsets not an array", "{\"x\":" TENSOR("U8", "[1]", "0") "}", 1, "data_offsets must be [begin, end]"},
    {"negative offsets", "{\"x\":" TENSOR("U8", "[1]", "[-1,0]") "}", 1, "data_offsets must be [begin, end]"},
    {"real offsets", "{\"x\":" TENSOR("U8", "[1]", "[0,1.0]") "}", 1, "data_offsets must be [begin, end]"},
    {"overlapping tensors", "{\"a\":" TENSOR("F32", "[2]", "[0,8]") ",\"b\":" TENSOR("F32", "[2]", "[4,12]") "}", 12,
     "overlap"},
    {"identical tensors", "{\"a\":" TENSOR("F32", "[2]", "[0,8]") ",\"b\":" TENSOR("U8", "[8]", "[0,8]") "}", 8,
     "overlap"},
    {"overlap across an empty tensor",
     "{\"a\":" TENSOR("F32", "[4]", "[0,16]") ",\"e\":" TENSOR("F32", "[0]", "[4,4]") ",\"b\":" TENSOR(
         "F32", "[1]", "[8,12]") "}",
     16, "overlap"},
    {"metadata not an object", "{\"__metadata__\":[\"a\"]}", 0, "__metadata__ is not a JSON object"},
    {"metadata with a number", "{\"__metadata__\":{\"a\":\"b\",\"n\":1}}", 0, "__metadata__ value of 'n'"},
    {"metadata with an object", "{\"__metadata__\":{\"o\":{}}}", 0, "__metadata__ value of 'o'"},
    {"duplicate metadata", "{\"__metadata__\":{},\"__metadata__\":{}}", 0, "duplicate"},
};

static void test_hostile_headers(void) {
    for (size_t i = 0; i < sizeof bad_headers / sizeof bad_headers[0]; i++)
        expect_header_fails(bad_headers[i].header, bad_headers[i].data_size, bad_headers[i].needle,
                            bad_headers[i].what);
}

/* A small file from the writer whose last tensor ends exactly at the end of the file. */
static int write_small_valid(const char *path, pi0_error *err) {
    static const float a[3] = {1, 2, 3};
    static const uint16_t b[4] = {0x3f80, 0x4000, 0x4040, 0x4080};
    static const int64_t c = 5;
    st_writer w;
    st_writer_init(&w);
    int ok = st_writer_add(&w, "a", ST_F32, 1, (int64_t[]){3}, a, err) == PI0_OK &&
             st_writer_add(&w, "empty", ST_U8, 2, (int64_t[]){0, 2}, NULL, err) == PI0_OK &&
             st_writer_add(&w, "c", ST_I64, 0, NULL, &c, err) == PI0_OK &&
             st_writer_add(&w, "b", ST_BF16, 2, (int64_t[]){2, 2}, b, err) == PI0_OK &&
             st_writer_meta(&w, "format", "pt", err) == PI0_OK && st_writer_write(&w, path, err) == PI0_OK;
    st_writer_free(&w);
    return ok;
}

static void test_truncated_data_region(void) {
    char path[PATH_SIZE];
    tmp_path(path, "truncated.safetensors");
    pi0_error err = {0};
    REQUIRE(write_small_valid(path, &err), "%s", err.message);
    struct stat st;
    REQUIRE(stat(path, &st) == 0, "cannot stat %s", path);
    REQUIRE(truncate(path, st.st_size - 4) == 0, "cannot truncate %s", path);
    expect_open_fails(path, PI0_ERR_FORMAT, "exceed the data region", "data region cut short");
}

/* Every strict prefix of a valid file is invalid: either the header or the last tensor is cut. */
static void test_every_prefix_fails(void) {
    char valid_path[PATH_SIZE], path[PATH_SIZE];
    tmp_path(valid_path, "prefix_source.safetensors");
    tmp_path(path, "prefix.safetensors");
    pi0_error err = {0};
    REQUIRE(write_small_valid(valid_path, &err), "%s", err.message);
    size_t size;
    unsigned char *bytes = read_bytes(valid_path, &size);
    REQUIRE(bytes, "cannot read %s", valid_path);
    for (size_t length = 0; length < size; length++) {
        if (!write_bytes(path, bytes, length)) {
            CHECK(0, "cannot write %s", path);
            break;
        }
        st_file f;
        pi0_status status = st_open(path, &f, &err);
        CHECK(status == PI0_ERR_FORMAT, "prefix of %zu/%zu bytes: status %d (%s)", length, size, status, err.message);
        CHECK(file_is_empty(&f), "prefix of %zu bytes: st_file not zeroed", length);
        st_close(&f);
    }
    st_file f;
    CHECK(st_open(valid_path, &f, &err) == PI0_OK, "%s", err.message);
    CHECK(f.num_tensors == 4, "%d tensors", f.num_tensors);
    st_close(&f);
    free(bytes);
}

/* Whatever st_open accepts must be internally consistent and inside the mapping. */
static void check_accepted_file(const st_file *f) {
    const unsigned char *begin = (const unsigned char *)f->map + 8, *end = (const unsigned char *)f->map + f->map_size;
    for (int i = 0; i < f->num_tensors; i++) {
        const st_tensor *t = &f->tensors[i];
        const unsigned char *data = t->data;
        CHECK(t->name && t->name[0] && t->rank >= 0 && t->rank <= ST_MAX_RANK, "tensor %d: rank %d", i, t->rank);
        CHECK(data >= begin && data <= end && t->nbytes <= (uint64_t)(end - data), "tensor %s outside the file",
              t->name);
        CHECK(t->nbytes == t->numel * st_dtype_size(t->dtype), "tensor %s: nbytes != numel * size", t->name);
        CHECK(i == 0 || strcmp(f->tensors[i - 1].name, t->name) < 0, "tensors not sorted at %d", i);
        float *out = malloc(t->numel ? t->numel * sizeof *out : 1);
        if (out) st_to_f32(t, out); /* reads every byte of the tensor */
        free(out);
    }
}

static void test_random_mutations(void) {
    char valid_path[PATH_SIZE], path[PATH_SIZE];
    tmp_path(valid_path, "mutation_source.safetensors");
    tmp_path(path, "mutation.safetensors");
    pi0_error err = {0};
    REQUIRE(write_small_valid(valid_path, &err), "%s", err.message);
    size_t size;
    unsigned char *original = read_bytes(valid_path, &size);
    unsigned char *bytes = malloc(size);
    REQUIRE(original && bytes && size > 8, "cannot read %s", valid_path);
    size_t header_end = 8 + (size_t)get_u64_le(original);
    uint64_t state = 0x9e3779b97f4a7c15u;
    int accepted = 0;
    for (int iteration = 0; iteration < 4000; iteration++) {
        state ^= state << 13, state ^= state >> 7, state ^= state << 17; /* xorshift64 */
        memcpy(bytes, original, size);
        /* Mostly the header (length and JSON), where the parsing decisions are. */
        size_t position = (size_t)(state >> 8) % (iteration % 4 ? header_end : size);
        bytes[position] = (unsigned char)(state ^ (state >> 32));
        if (!write_bytes(path, bytes, size)) {
            CHECK(0, "cannot write %s", path);
            break;
        }
        st_file f;
        pi0_status status = st_open(path, &f, &err);
        CHECK(status == PI0_OK || status == PI0_ERR_FORMAT, "mutation at %zu: status %d (%s)", position, status,
              err.message);
        if (status == PI0_OK) {
            accepted++;
            check_accepted_file(&f);
        } else {
            CHECK(file_is_empty(&f), "mutation at %zu: st_file not zeroed", position);
        }
        st_close(&f);
    }
    fprintf(stderr, "  %d of 4000 mutated files were still valid\n", accepted);
    free(original);
    free(bytes);
}

static void remove_tmp_dir(void) {
    DIR *dir = opendir(tmp_dir);
    if (!dir) return;
    for (struct dirent *entry; (entry = readdir(dir));) {
        if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0) continue;
        char path[PATH_SIZE];
        tmp_path(path, entry->d_name);
        unlink(path);
    }
    closedir(dir);
    rmdir(tmp_dir);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_dtype_names_and_shape_str);
    RUN(test_roundtrip_every_dtype);
    RUN(test_empty_file_roundtrip);
    RUN(test_reader_accepts_valid_variants);
    RUN(test_writer_rejects_bad_arguments);
    RUN(test_writer_replaces_file);
    RUN(test_bf16_to_f32);
    RUN(test_f32_to_bf16x3);
    RUN(test_f16_to_f32);
    RUN(test_large_conversion);
    RUN(test_fixture_model);
    RUN(test_hostile_framing);
    RUN(test_hostile_headers);
    RUN(test_truncated_data_region);
    RUN(test_every_prefix_fails);
    RUN(test_random_mutations);
    remove_tmp_dir();
    return check_finish();
}
