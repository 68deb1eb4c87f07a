/*
 * test_msgpack_numpy.c - the openpi wire codec: round trips of every dtype and rank through the packer,
 * byte orders, numpy scalars, lists, nested keys, observations shaped like LIBERO, DROID and ALOHA,
 * openpi's exact ndarray layout, and hostile frames (hand-made ones, every truncation, thousands of random
 * mutations), each of which must fail cleanly, name the key, and allocate nothing from what it claims.
 */
#include <msgpack.h>
#include <stdint.h>
#include <time.h>

#include "check.h"
#include "server/msgpack_numpy.h"

/* --- building frames: msgpack-c directly, for layouts the pi0 packer does not write ---------------- */

typedef struct {
    msgpack_sbuffer sb;
    msgpack_packer pk;
} frame;

static void frame_init(frame *f) {
    msgpack_sbuffer_init(&f->sb);
    msgpack_packer_init(&f->pk, &f->sb, msgpack_sbuffer_write);
}

static void frame_free(frame *f) { msgpack_sbuffer_destroy(&f->sb); }

static void put_strn(frame *f, const void *s, size_t n) {
    msgpack_pack_str(&f->pk, n);
    msgpack_pack_str_body(&f->pk, s, n);
}

static void put_str(frame *f, const char *s) { put_strn(f, s, strlen(s)); }

static void put_bin(frame *f, const void *b, size_t n) {
    msgpack_pack_bin(&f->pk, n);
    msgpack_pack_bin_body(&f->pk, b, n);
}

static void put_bin_key(frame *f, const char *s) { put_bin(f, s, strlen(s)); }

/* openpi's pack_array layout with any dtype string and any shape, even inconsistent ones. */
static void put_ndarray(frame *f, const char *dtype, int ndim, const int64_t *shape, const void *data, size_t bytes) {
    msgpack_pack_map(&f->pk, 4);
    put_bin_key(f, "__ndarray__");
    msgpack_pack_true(&f->pk);
    put_bin_key(f, "data");
    put_bin(f, data, bytes);
    put_bin_key(f, "dtype");
    put_str(f, dtype);
    put_bin_key(f, "shape");
    msgpack_pack_array(&f->pk, (size_t)ndim);
    for (int i = 0; i < ndim; i++) msgpack_pack_int64(&f->pk, shape[i]);
}

/* openpi's numpy scalar: {b"__npgeneric__": True, b"data": <value packed by the caller>, b"dtype": dtype}. */
static void put_npgeneric_head(frame *f, const char *dtype) {
    msgpack_pack_map(&f->pk, 3);
    put_bin_key(f, "__npgeneric__");
    msgpack_pack_true(&f->pk);
    put_bin_key(f, "dtype");
    put_str(f, dtype);
    put_bin_key(f, "data");
}

static uint64_t rng_next(uint64_t *state) { /* xorshift64* */
    *state ^= *state >> 12, *state ^= *state << 25, *state ^= *state >> 27;
    return *state * 2685821657736338717ull;
}

static void fill_random(void *data, size_t bytes, uint64_t seed) {
    uint64_t state = seed | 1;
    for (size_t i = 0; i < bytes; i++) ((uint8_t *)data)[i] = (uint8_t)(rng_next(&state) >> 56);
}

/* --- checking ----------------------------------------------------------------------------------- */

static int observation_is_empty(const pi0_observation *obs) { return !obs->fields && !obs->count; }

static int decode_ok(const void *bytes, size_t size, pi0_observation *obs, const char *what) {
    pi0_error err = {0};
    pi0_status status = pi0_observation_decode(bytes, size, obs, &err);
    CHECK(status == PI0_OK, "%s: %s", what, err.message);
    return status == PI0_OK;
}

/* Decoding must fail with PI0_ERR_FORMAT, a message holding both needles (NULL: none), and an empty result. */
static void expect_fails(const void *bytes, size_t size, const char *needle, const char *key, const char *what) {
    pi0_observation obs;
    memset(&obs, 0xab, sizeof obs); /* decode must not rely on the caller zeroing it */
    pi0_error err = {0};
    pi0_status status = pi0_observation_decode(bytes, size, &obs, &err);
    CHECK(status == PI0_ERR_FORMAT, "%s: status %d (%s)", what, status, err.message);
    CHECK(err.status == status, "%s", what);
    CHECK(!needle || strstr(err.message, needle), "%s: message '%s' lacks '%s'", what, err.message, needle);
    CHECK(!key || strstr(err.message, key), "%s: message '%s' does not name %s", what, err.message, key);
    CHECK(observation_is_empty(&obs), "%s: observation not empty after failure", what);
    if (status == PI0_OK) pi0_observation_free(&obs);
}

static void expect_frame_fails(frame *f, const char *needle, const char *key, const char *what) {
    expect_fails(f->sb.data, f->sb.size, needle, key, what);
    frame_free(f);
}

static const pi0_field *find_array(const pi0_observation *obs, const char *key, pi0_dtype dtype, int ndim) {
    const pi0_field *f = pi0_observation_find(obs, key);
    CHECK(f && f->kind == PI0_FIELD_ARRAY, "'%s' missing or not an array", key);
    if (!f || f->kind != PI0_FIELD_ARRAY) return NULL;
    CHECK(f->dtype == dtype, "'%s': dtype %s, expected %s", key, pi0_dtype_str(f->dtype), pi0_dtype_str(dtype));
    CHECK(f->ndim == ndim, "'%s': ndim %d, expected %d", key, f->ndim, ndim);
    CHECK(f->data && (uintptr_t)f->data % 64 == 0, "'%s': data not 64-byte aligned", key);
    return f->dtype == dtype && f->ndim == ndim ? f : NULL;
}

static double scalar_f64(const pi0_observation *obs, const char *key) {
    const pi0_field *f = find_array(obs, key, PI0_DTYPE_F64, 0);
    return f ? *(const double *)f->data : NAN;
}

/* --- round trips ------------------------------------------------------------------------------- */

TEST(test_dtype_table) {
    static const char *strs[] = {"|b1", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f2", "<f4", "<f8"};
    static const size_t sizes[] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 4, 8};
    for (int d = PI0_DTYPE_BOOL; d <= PI0_DTYPE_F64; d++) {
        CHECK(strcmp(pi0_dtype_str((pi0_dtype)d), strs[d]) == 0, "dtype %d: %s", d, pi0_dtype_str((pi0_dtype)d));
        CHECK(pi0_dtype_size((pi0_dtype)d) == sizes[d], "dtype %d", d);
    }
    CHECK(pi0_dtype_size((pi0_dtype)99) == 0 && strcmp(pi0_dtype_str((pi0_dtype)99), "?") == 0, "invalid dtype");
}

/* Every dtype at every rank 0..8 (and with a zero dimension) through pi0_pack_ndarray and back. */
TEST(test_roundtrip_every_dtype_and_rank) {
    for (int d = PI0_DTYPE_BOOL; d <= PI0_DTYPE_F64; d++) {
        for (int ndim = 0; ndim <= PI0_MAX_NDIM + 1; ndim++) {
            int rank = ndim <= PI0_MAX_NDIM ? ndim : 3; /* the extra round: rank 3 with a zero dimension */
            int64_t shape[PI0_MAX_NDIM];
            size_t numel = 1, size = pi0_dtype_size((pi0_dtype)d);
            for (int i = 0; i < rank; i++) {
                shape[i] = ndim > PI0_MAX_NDIM && i == 1 ? 0 : 1 + i % 3;
                numel *= (size_t)shape[i];
            }
            uint8_t data[1024 * 8];
            fill_random(data, numel * size, (uint64_t)(d * 100 + ndim));
            if (d == PI0_DTYPE_BOOL)
                for (size_t i = 0; i < numel; i++) data[i] &= 1;
            pi0_packer p = {0};
            pi0_pack_map(&p, 2);
            pi0_pack_str(&p, "x");
            pi0_pack_ndarray(&p, (pi0_dtype)d, rank, shape, data);
            pi0_pack_str(&p, "after");
            pi0_pack_int(&p, 7);
            REQUIRE(!p.failed, "packer failed");
            pi0_observation obs;
            if (decode_ok(p.data, p.size, &obs, pi0_dtype_str((pi0_dtype)d))) {
                const pi0_field *f = find_array(&obs, "x", (pi0_dtype)d, rank);
                CHECK(obs.count == 2, "%d fields", obs.count);
                if (f) {
                    CHECK(memcmp(f->shape, shape, (size_t)rank * sizeof *shape) == 0, "%s rank %d: shape",
                          pi0_dtype_str((pi0_dtype)d), rank);
                    CHECK(pi0_field_numel(f) == (int64_t)numel, "numel %lld", (long long)pi0_field_numel(f));
                    CHECK(memcmp(f->data, data, numel * size) == 0, "%s rank %d: data", pi0_dtype_str((pi0_dtype)d),
                          rank);
                }
                pi0_observation_free(&obs);
                CHECK(observation_is_empty(&obs), "free does not reset");
            }
            pi0_packer_free(&p);
        }
    }
}

/* '>' data is swapped to host order; '<', '|', '=' and no prefix are taken as they are. */
TEST(test_byte_orders) {
    static const struct {
        const char *dtype;
        pi0_dtype expected;
        uint8_t wire[8];
        uint8_t host[8]; /* little-endian host */
    } cases[] = {
        {">f4", PI0_DTYPE_F32, {0x3f, 0xc0, 0, 0}, {0, 0, 0xc0, 0x3f}},
        {">u2", PI0_DTYPE_U16, {0x12, 0x34}, {0x34, 0x12}},
        {">i8", PI0_DTYPE_I64, {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe}, {0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}},
        {">f2", PI0_DTYPE_F16, {0x3c, 0x00}, {0x00, 0x3c}},
        {">f8", PI0_DTYPE_F64, {0x3f, 0xf8, 0, 0, 0, 0, 0, 0}, {0, 0, 0, 0, 0, 0, 0xf8, 0x3f}},
        {"<u4", PI0_DTYPE_U32, {1, 2, 3, 4}, {1, 2, 3, 4}},
        {"=i4", PI0_DTYPE_I32, {1, 2, 3, 4}, {1, 2, 3, 4}},
        {"|u2", PI0_DTYPE_U16, {1, 2}, {1, 2}},
        {"i2", PI0_DTYPE_I16, {1, 2}, {1, 2}},
        {">u1", PI0_DTYPE_U8, {9}, {9}},
        {"<b1", PI0_DTYPE_BOOL, {1}, {1}},
        {"|b1", PI0_DTYPE_BOOL, {7}, {1}}, /* any non-zero byte is True */
        {"|i1", PI0_DTYPE_I8, {0x80}, {0x80}},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        size_t size = pi0_dtype_size(cases[c].expected);
        frame f;
        frame_init(&f);
        msgpack_pack_map(&f.pk, 1);
        put_str(&f, "v");
        int64_t shape[1] = {1};
        put_ndarray(&f, cases[c].dtype, 1, shape, cases[c].wire, size);
        pi0_observation obs;
        if (decode_ok(f.sb.data, f.sb.size, &obs, cases[c].dtype)) {
            const pi0_field *field = find_array(&obs, "v", cases[c].expected, 1);
            CHECK(field && memcmp(field->data, cases[c].host, size) == 0, "%s: bytes", cases[c].dtype);
            pi0_observation_free(&obs);
        }
        frame_free(&f);
    }
}

TEST(test_scalars_and_strings) {
    frame f;
    frame_init(&f);
    msgpack_pack_map(&f.pk, 15);
    put_str(&f, "float"), msgpack_pack_double(&f.pk, 1.5);
    put_str(&f, "float32"), msgpack_pack_float(&f.pk, 0.25f);
    put_str(&f, "int"), msgpack_pack_int64(&f.pk, -3);
    put_str(&f, "big"), msgpack_pack_uint64(&f.pk, UINT64_MAX);
    put_str(&f, "yes"), msgpack_pack_true(&f.pk);
    put_str(&f, "none"), msgpack_pack_nil(&f.pk);
    put_str(&f, "np_f4"), put_npgeneric_head(&f, "<f4"), msgpack_pack_double(&f.pk, 0.5);
    put_str(&f, "np_f8_from_int"), put_npgeneric_head(&f, "<f8"), msgpack_pack_int64(&f.pk, 3);
    put_str(&f, "np_u1"), put_npgeneric_head(&f, "|u1"), msgpack_pack_int64(&f.pk, 200);
    put_str(&f, "np_i8"), put_npgeneric_head(&f, ">i8"), msgpack_pack_int64(&f.pk, INT64_MIN);
    put_str(&f, "np_u8"), put_npgeneric_head(&f, "<u8"), msgpack_pack_uint64(&f.pk, UINT64_MAX);
    put_str(&f, "np_b"), put_npgeneric_head(&f, "|b1"), msgpack_pack_false(&f.pk);
    put_str(&f, "prompt"), put_str(&f, "pick up the caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\xa4\x96");
    put_bin_key(&f, "bin_key"), put_bin(&f, "text in bin", 11);
    put_str(&f, "empty"), put_str(&f, "");
    pi0_observation obs;
    REQUIRE(decode_ok(f.sb.data, f.sb.size, &obs, "scalars"));
    CHECK(obs.count == 14, "%d fields (nil is skipped)", obs.count);
    CHECK(pi0_observation_find(&obs, "none") == NULL, "nil kept");
    CHECK(scalar_f64(&obs, "float") == 1.5, "float");
    CHECK(scalar_f64(&obs, "float32") == 0.25, "float32");
    CHECK(scalar_f64(&obs, "np_f4") == 0.5, "np_f4");
    CHECK(scalar_f64(&obs, "np_f8_from_int") == 3.0, "np_f8_from_int");
    const pi0_field *x;
    CHECK((x = find_array(&obs, "int", PI0_DTYPE_I64, 0)) && *(int64_t *)x->data == -3, "int");
    CHECK((x = find_array(&obs, "big", PI0_DTYPE_U64, 0)) && *(uint64_t *)x->data == UINT64_MAX, "big");
    CHECK((x = find_array(&obs, "yes", PI0_DTYPE_BOOL, 0)) && *(uint8_t *)x->data == 1, "yes");
    CHECK((x = find_array(&obs, "np_u1", PI0_DTYPE_U64, 0)) && *(uint64_t *)x->data == 200, "np_u1");
    CHECK((x = find_array(&obs, "np_i8", PI0_DTYPE_I64, 0)) && *(int64_t *)x->data == INT64_MIN, "np_i8");
    CHECK((x = find_array(&obs, "np_u8", PI0_DTYPE_U64, 0)) && *(uint64_t *)x->data == UINT64_MAX, "np_u8");
    CHECK((x = find_array(&obs, "np_b", PI0_DTYPE_BOOL, 0)) && *(uint8_t *)x->data == 0, "np_b");
    CHECK(x && pi0_field_numel(x) == 1, "numel of a scalar");
    const pi0_field *s = pi0_observation_find(&obs, "prompt");
    CHECK(s && s->kind == PI0_FIELD_STRING && strcmp(s->string, "pick up the caf\xc3\xa9 \xe2\x9c\x93 \xf0\x9f\xa4\x96") == 0,
          "prompt");
    s = pi0_observation_find(&obs, "bin_key");
    CHECK(s && s->kind == PI0_FIELD_STRING && strcmp(s->string, "text in bin") == 0, "bin text");
    s = pi0_observation_find(&obs, "empty");
    CHECK(s && s->kind == PI0_FIELD_STRING && s->string && s->string[0] == '\0', "empty string");
    CHECK(strcmp(obs.fields[0].key, "float") == 0 && strcmp(obs.fields[13].key, "empty") == 0, "order kept");
    pi0_observation_free(&obs);
    frame_free(&f);
}

TEST(test_lists) {
    frame f;
    frame_init(&f);
    msgpack_pack_map(&f.pk, 3);
    put_str(&f, "state");
    msgpack_pack_array(&f.pk, 6);
    msgpack_pack_int64(&f.pk, 1), msgpack_pack_double(&f.pk, 2.5), msgpack_pack_int64(&f.pk, -3);
    msgpack_pack_true(&f.pk), msgpack_pack_float(&f.pk, 0.5f);
    put_npgeneric_head(&f, "<f4"), msgpack_pack_double(&f.pk, -0.25);
    put_str(&f, "empty"), msgpack_pack_array(&f.pk, 0);
    put_str(&f, "big"), msgpack_pack_array(&f.pk, 1), msgpack_pack_uint64(&f.pk, (uint64_t)1 << 63);
    pi0_observation obs;
    REQUIRE(decode_ok(f.sb.data, f.sb.size, &obs, "lists"));
    const pi0_field *x = find_array(&obs, "state", PI0_DTYPE_F64, 1);
    static const double expected[] = {1, 2.5, -3, 1, 0.5, -0.25};
    CHECK(x && x->shape[0] == 6 && memcmp(x->data, expected, sizeof expected) == 0, "state");
    x = find_array(&obs, "empty", PI0_DTYPE_F64, 1);
    CHECK(x && x->shape[0] == 0 && pi0_field_numel(x) == 0, "empty list");
    x = find_array(&obs, "big", PI0_DTYPE_F64, 1);
    CHECK(x && ((double *)x->data)[0] == 9223372036854775808.0, "uint64 element");
    pi0_observation_free(&obs);
    frame_free(&f);
}

/* ALOHA's nested {"images": {"cam_high": ...}} and LIBERO's flat "observation/image" are looked up alike. */
TEST(test_nested_keys) {
    frame f;
    frame_init(&f);
    uint8_t pixels[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    int64_t shape[3] = {2, 2, 3};
    msgpack_pack_map(&f.pk, 3);
    put_str(&f, "images");
    msgpack_pack_map(&f.pk, 2);
    put_str(&f, "cam_high"), put_ndarray(&f, "|u1", 3, shape, pixels, 12);
    put_bin_key(&f, "deeper");
    msgpack_pack_map(&f.pk, 1);
    put_str(&f, "cam_low"), put_ndarray(&f, "|u1", 3, shape, pixels, 12);
    put_str(&f, "observation/image"), put_ndarray(&f, "|u1", 3, shape, pixels, 12);
    put_str(&f, "empty_dict"), msgpack_pack_map(&f.pk, 0);
    pi0_observation obs;
    REQUIRE(decode_ok(f.sb.data, f.sb.size, &obs, "nested"));
    CHECK(obs.count == 3, "%d fields", obs.count);
    CHECK(find_array(&obs, "images/cam_high", PI0_DTYPE_U8, 3), "images/cam_high");
    CHECK(find_array(&obs, "images/deeper/cam_low", PI0_DTYPE_U8, 3), "images/deeper/cam_low");
    CHECK(find_array(&obs, "observation/image", PI0_DTYPE_U8, 3), "observation/image");
    CHECK(!pi0_observation_find(&obs, "images") && !pi0_observation_find(&obs, "cam_high"), "partial keys found");
    CHECK(!pi0_observation_find(NULL, "x") && !pi0_observation_find(&obs, NULL), "NULL arguments");
    pi0_observation_free(&obs);
    frame_free(&f);
}

/* --- robot-shaped observations, packed by pi0_packer as openpi's client packs them ------------- */

static void pack_image(pi0_packer *p, const char *key, int chw, uint8_t *pixels, uint64_t seed) {
    int64_t hwc[3] = {224, 224, 3}, chw_shape[3] = {3, 224, 224};
    fill_random(pixels, 224 * 224 * 3, seed);
    pi0_pack_str(p, key);
    pi0_pack_ndarray(p, PI0_DTYPE_U8, 3, chw ? chw_shape : hwc, pixels);
}

static void pack_vector(pi0_packer *p, const char *key, pi0_dtype dtype, int n, const void *values) {
    int64_t shape[1] = {n};
    pi0_pack_str(p, key);
    pi0_pack_ndarray(p, dtype, 1, shape, values);
}

static void check_image(const pi0_observation *obs, const char *key, int chw, const uint8_t *pixels) {
    const pi0_field *f = find_array(obs, key, PI0_DTYPE_U8, 3);
    if (!f) return;
    int64_t expected[3] = {chw ? 3 : 224, 224, chw ? 224 : 3};
    CHECK(memcmp(f->shape, expected, sizeof expected) == 0 && memcmp(f->data, pixels, 224 * 224 * 3) == 0, "%s",
          key);
}

TEST(test_libero_droid_aloha_observations) {
    uint8_t *img[4];
    for (int i = 0; i < 4; i++) img[i] = malloc(224 * 224 * 3);
    REQUIRE(img[0] && img[1] && img[2] && img[3], "out of memory");
    double state8[8] = {0.1, -0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.04}, joints[7] = {1, 2, 3, 4, 5, 6, 7}, grip[1] = {0.5};
    float state14[14];
    for (int i = 0; i < 14; i++) state14[i] = (float)i / 7.0f;

    pi0_packer p = {0}; /* LIBERO (examples/libero/main.py) */
    pi0_pack_map(&p, 4);
    pack_image(&p, "observation/image", 0, img[0], 1);
    pack_image(&p, "observation/wrist_image", 0, img[1], 2);
    pack_vector(&p, "observation/state", PI0_DTYPE_F64, 8, state8);
    pi0_pack_str(&p, "prompt"), pi0_pack_str(&p, "put the bowl on the plate");
    pi0_observation obs;
    REQUIRE(!p.failed && decode_ok(p.data, p.size, &obs, "libero"));
    check_image(&obs, "observation/image", 0, img[0]);
    check_image(&obs, "observation/wrist_image", 0, img[1]);
    const pi0_field *f = find_array(&obs, "observation/state", PI0_DTYPE_F64, 1);
    CHECK(f && f->shape[0] == 8 && memcmp(f->data, state8, sizeof state8) == 0, "libero state");
    f = pi0_observation_find(&obs, "prompt");
    CHECK(f && f->kind == PI0_FIELD_STRING && strcmp(f->string, "put the bowl on the plate") == 0, "libero prompt");
    pi0_observation_free(&obs);
    pi0_packer_free(&p);

    pi0_pack_map(&p, 5); /* DROID (examples/droid/main.py) */
    pack_image(&p, "observation/exterior_image_1_left", 0, img[0], 3);
    pack_image(&p, "observation/wrist_image_left", 0, img[1], 4);
    pack_vector(&p, "observation/joint_position", PI0_DTYPE_F64, 7, joints);
    pack_vector(&p, "observation/gripper_position", PI0_DTYPE_F64, 1, grip);
    pi0_pack_str(&p, "prompt"), pi0_pack_str(&p, "open the drawer");
    REQUIRE(!p.failed && decode_ok(p.data, p.size, &obs, "droid"));
    check_image(&obs, "observation/exterior_image_1_left", 0, img[0]);
    check_image(&obs, "observation/wrist_image_left", 0, img[1]);
    CHECK((f = find_array(&obs, "observation/joint_position", PI0_DTYPE_F64, 1)) && f->shape[0] == 7, "joints");
    CHECK((f = find_array(&obs, "observation/gripper_position", PI0_DTYPE_F64, 1)) && f->shape[0] == 1, "gripper");
    pi0_observation_free(&obs);
    pi0_packer_free(&p);

    static const char *cams[4] = {"cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist"};
    pi0_pack_map(&p, 3); /* ALOHA (examples/aloha_real): nested images, CHW */
    pi0_pack_str(&p, "images");
    pi0_pack_map(&p, 4);
    for (int c = 0; c < 4; c++) pack_image(&p, cams[c], 1, img[c], 10 + (uint64_t)c);
    pack_vector(&p, "state", PI0_DTYPE_F32, 14, state14);
    pi0_pack_str(&p, "prompt"), pi0_pack_str(&p, "fold the towel");
    REQUIRE(!p.failed && decode_ok(p.data, p.size, &obs, "aloha"));
    CHECK(obs.count == 6, "%d fields", obs.count);
    for (int c = 0; c < 4; c++) {
        char key[64];
        snprintf(key, sizeof key, "images/%s", cams[c]);
        check_image(&obs, key, 1, img[c]);
    }
    f = find_array(&obs, "state", PI0_DTYPE_F32, 1);
    CHECK(f && f->shape[0] == 14 && memcmp(f->data, state14, sizeof state14) == 0, "aloha state");
    pi0_observation_free(&obs);
    pi0_packer_free(&p);
    for (int i = 0; i < 4; i++) free(img[i]);
}

/* --- the packer -------------------------------------------------------------------------------- */

/* Byte for byte what openpi_client.msgpack_numpy.packb({"a": np.array([1, 2], "<f4")}) gives. */
TEST(test_packer_openpi_layout) {
    static const uint8_t expected[] = {
        0x81, 0xa1, 'a', 0x84,
        0xc4, 0x0b, '_', '_', 'n', 'd', 'a', 'r', 'r', 'a', 'y', '_', '_', 0xc3,
        0xc4, 0x04, 'd', 'a', 't', 'a', 0xc4, 0x08, 0, 0, 0x80, 0x3f, 0, 0, 0, 0x40,
        0xc4, 0x05, 'd', 't', 'y', 'p', 'e', 0xa3, '<', 'f', '4',
        0xc4, 0x05, 's', 'h', 'a', 'p', 'e', 0x91, 0x02,
    };
    float values[2] = {1, 2};
    int64_t shape[1] = {2};
    pi0_packer p = {0};
    pi0_pack_map(&p, 1);
    pi0_pack_str(&p, "a");
    pi0_pack_ndarray(&p, PI0_DTYPE_F32, 1, shape, values);
    CHECK(!p.failed && p.size == sizeof expected && memcmp(p.data, expected, sizeof expected) == 0,
          "layout differs (%zu bytes)", p.size);
    pi0_packer_free(&p);
    CHECK(!p.data && !p.size && !p.capacity && !p.failed, "free does not reset");
}

/* Every pi0_pack_* call, read back with msgpack-c. */
TEST(test_packer_values) {
    static const int64_t ints[] = {0, 1, 127, 128, 255, 256, 65535, 65536, 4294967295ll, 4294967296ll, INT64_MAX,
                                   -1, -32, -33, -128, -129, -32768, -32769, INT32_MIN, INT64_MIN};
    enum { NUM_INTS = sizeof ints / sizeof ints[0] };
    pi0_packer p = {0};
    pi0_pack_map(&p, 5);
    pi0_pack_str(&p, "ints");
    pi0_pack_array(&p, NUM_INTS);
    for (int i = 0; i < NUM_INTS; i++) pi0_pack_int(&p, ints[i]);
    pi0_pack_str(&p, "double"), pi0_pack_double(&p, -1.25e300);
    pi0_pack_str(&p, "bools"), pi0_pack_array(&p, 2), pi0_pack_bool(&p, 5), pi0_pack_bool(&p, 0);
    pi0_pack_str(&p, "nil"), pi0_pack_nil(&p);
    pi0_pack_str(&p, "str"), pi0_pack_str(&p, "h\xc3\xa9llo");
    REQUIRE(!p.failed, "packer failed");
    msgpack_unpacked msg;
    msgpack_unpacked_init(&msg);
    size_t off = 0;
    REQUIRE(msgpack_unpack_next(&msg, (const char *)p.data, p.size, &off) == MSGPACK_UNPACK_SUCCESS && off == p.size,
            "msgpack-c cannot read it back");
    msgpack_object_kv *kv = msg.data.via.map.ptr;
    CHECK(msg.data.type == MSGPACK_OBJECT_MAP && msg.data.via.map.size == 5, "map");
    CHECK(kv[0].key.type == MSGPACK_OBJECT_STR && kv[0].val.via.array.size == NUM_INTS, "ints");
    for (int i = 0; i < NUM_INTS; i++) {
        msgpack_object o = kv[0].val.via.array.ptr[i];
        int64_t v = o.type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (int64_t)o.via.u64 : o.via.i64;
        CHECK(v == ints[i], "int %lld came back as %lld", (long long)ints[i], (long long)v);
    }
    CHECK(kv[1].val.type == MSGPACK_OBJECT_FLOAT64 && kv[1].val.via.f64 == -1.25e300, "double");
    CHECK(kv[2].val.via.array.ptr[0].via.boolean && !kv[2].val.via.array.ptr[1].via.boolean, "bools");
    CHECK(kv[3].val.type == MSGPACK_OBJECT_NIL, "nil");
    CHECK(kv[4].val.type == MSGPACK_OBJECT_STR && kv[4].val.via.str.size == 6 &&
          memcmp(kv[4].val.via.str.ptr, "h\xc3\xa9llo", 6) == 0, "str");
    msgpack_unpacked_destroy(&msg);
    /* msgpack-c chose the shortest forms: 0 is one byte, INT64_MIN nine. */
    pi0_packer q = {0};
    pi0_pack_int(&q, 0), pi0_pack_int(&q, INT64_MIN), pi0_pack_int(&q, 200);
    CHECK(q.size == 1 + 9 + 2 && q.data[0] == 0 && q.data[1] == 0xd3 && q.data[10] == 0xcc, "int encodings");
    pi0_packer_free(&q);
    pi0_packer_free(&p);
}

/* Invalid arguments mark the packer failed; later calls do nothing. */
TEST(test_packer_failures) {
    int64_t bad_shapes[][2] = {{-1, 2}, {INT64_MAX, 2}, {(int64_t)1 << 31, 2}};
    for (int i = 0; i < 3; i++) {
        pi0_packer p = {0};
        float data[4] = {0};
        pi0_pack_ndarray(&p, PI0_DTYPE_F32, 2, bad_shapes[i], data);
        CHECK(p.failed, "shape %d accepted", i);
        pi0_pack_int(&p, 1);
        CHECK(p.size == 0, "a failed packer still writes");
        pi0_packer_free(&p);
    }
    int64_t shape[PI0_MAX_NDIM + 1] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    float one = 1;
    struct { pi0_dtype dtype; int ndim; const int64_t *shape; const void *data; } cases[] = {
        {PI0_DTYPE_F32, PI0_MAX_NDIM + 1, shape, &one}, {PI0_DTYPE_F32, -1, shape, &one},
        {PI0_DTYPE_F32, 1, NULL, &one}, {PI0_DTYPE_F32, 1, shape, NULL}, {(pi0_dtype)42, 1, shape, &one},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pi0_packer p = {0};
        pi0_pack_ndarray(&p, cases[i].dtype, cases[i].ndim, cases[i].shape, cases[i].data);
        CHECK(p.failed, "case %zu accepted", i);
        pi0_packer_free(&p);
    }
    pi0_packer p = {0};
    pi0_pack_str(&p, NULL);
    CHECK(p.failed, "NULL string accepted");
    pi0_packer_free(&p);
    int64_t empty[2] = {0, 5};
    pi0_pack_ndarray(&p, PI0_DTYPE_F64, 2, empty, NULL); /* nothing to read: NULL data is fine */
    CHECK(!p.failed, "empty array refused");
    pi0_packer_free(&p);
    pi0_pack_map(NULL, 1), pi0_pack_str(NULL, "x"), pi0_packer_free(NULL); /* no crash */
}

/* --- hostile frames ---------------------------------------------------------------------------- */

TEST(test_invalid_arguments) {
    pi0_error err = {0};
    CHECK(pi0_observation_decode("\x80", 1, NULL, &err) == PI0_ERR_INVALID_ARGUMENT, "out NULL");
    pi0_observation obs;
    CHECK(pi0_observation_decode(NULL, 5, &obs, &err) == PI0_ERR_INVALID_ARGUMENT, "data NULL");
    CHECK(pi0_observation_decode(NULL, 0, &obs, NULL) == PI0_ERR_FORMAT, "empty frame, no err");
    CHECK(pi0_observation_decode("\x80", 1, &obs, NULL) == PI0_OK && obs.count == 0, "empty map");
    pi0_observation_free(&obs);
    pi0_observation_free(NULL);
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Tiny frames claiming huge counts or lengths fail at once, before anything is allocated from the claim. */
TEST(test_huge_claims) {
    static const struct { const char *bytes; size_t size; const char *needle, *key; } cases[] = {
        {"\xdd\xff\xff\xff\xff", 5, "claims 4294967295 elements", NULL},
        {"\xdf\xff\xff\xff\xff", 5, "claims 4294967295 entries", NULL},
        {"\xdc\xff\xff", 3, "claims 65535", NULL},
        {"\x81\xa1" "a\xdd\xff\xff\xff\xff", 8, "claims 4294967295", "key 'a'"},
        {"\x81\xa1" "a\xdf\x80\x00\x00\x00", 8, "claims 2147483648 entries", "key 'a'"},
        {"\x81\xa1" "a\xdb\xff\xff\xff\xff", 8, "4294967295 bytes runs past", "key 'a'"},
        {"\x81\xa1" "a\xc6\xff\xff\xff\xff", 8, "runs past", "key 'a'"},
        {"\x81\xa1" "a\xc9\xff\xff\xff\xff\x01", 9, "runs past", "key 'a'"},
        {"\x81\xa1" "a\x81\xa1" "b\xdd\x00\x01\x00\x00\x00", 12, "claims 65536", "key 'a/b'"},
        {"\x81\xdb\xff\xff\xff\xf0", 6, "runs past", NULL},
    };
    double start = seconds_now();
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[32];
        snprintf(what, sizeof what, "claim %zu", i);
        expect_fails(cases[i].bytes, cases[i].size, cases[i].needle, cases[i].key, what);
    }
    double elapsed = seconds_now() - start;
    CHECK(elapsed < 0.05, "huge claims took %.3f s", elapsed);
}

/* Nested lists each claiming as many elements as there are bytes left: individually plausible, together
   far more than the frame holds. msgpack-c alone would allocate 24 bytes per claimed element at every level. */
TEST(test_stacked_claims) {
    enum { LEVELS = 12, SIZE = 1 << 20 };
    uint8_t *bytes = calloc(SIZE, 1);
    REQUIRE(bytes, "out of memory");
    for (int l = 0; l < LEVELS; l++) {
        uint32_t n = (uint32_t)(SIZE - 5 * (l + 1)) / 2;
        uint8_t *h = bytes + 5 * l;
        h[0] = 0xdd, h[1] = (uint8_t)(n >> 24), h[2] = (uint8_t)(n >> 16), h[3] = (uint8_t)(n >> 8), h[4] = (uint8_t)n;
    }
    double start = seconds_now();
    expect_fails(bytes, SIZE, "more than 1048576 values", NULL, "stacked claims");
    CHECK(seconds_now() - start < 0.05, "stacked claims took %.3f s", seconds_now() - start);
    free(bytes);

    /* A frame that really holds more than 2^20 values: a list of 1.1 million zeros. */
    size_t n = 1100000, size = 1 + 2 + 1 + 5 + n;
    bytes = calloc(size, 1);
    REQUIRE(bytes, "out of memory");
    memcpy(bytes, "\x81\xa1x\xdd", 4);
    bytes[4] = (uint8_t)(n >> 24), bytes[5] = (uint8_t)(n >> 16), bytes[6] = (uint8_t)(n >> 8), bytes[7] = (uint8_t)n;
    expect_fails(bytes, 8 + n, "more than 1048576 values", "key 'x'", "a million values");
    free(bytes);
}

TEST(test_deep_nesting) {
    enum { DEPTH = 17 };
    uint8_t bytes[3 * DEPTH + 1];
    for (int i = 0; i < DEPTH; i++) memcpy(bytes + 3 * i, "\x81\xa1k", 3);
    bytes[3 * DEPTH] = 0xc0;
    expect_fails(bytes, sizeof bytes, "nested more than 16", "key 'k/k/k/k", "17 nested maps");
    uint8_t lists[100000];
    memset(lists, 0x91, sizeof lists);
    lists[0] = 0x81, lists[1] = 0xa1, lists[2] = 'l', lists[sizeof lists - 1] = 0x01;
    expect_fails(lists, sizeof lists, "nested more than 16", "key 'l'", "100000 nested lists");
    /* 16 deep is fine: 14 nested dicts around an ndarray (its map 15, its shape 16). */
    frame f;
    frame_init(&f);
    for (int i = 0; i < 14; i++) msgpack_pack_map(&f.pk, 1), put_str(&f, "d");
    int64_t shape[1] = {1};
    put_ndarray(&f, "|u1", 1, shape, "x", 1);
    pi0_observation obs;
    if (decode_ok(f.sb.data, f.sb.size, &obs, "depth 16")) {
        CHECK(find_array(&obs, "d/d/d/d/d/d/d/d/d/d/d/d/d/d", PI0_DTYPE_U8, 1), "deep key");
        pi0_observation_free(&obs);
    }
    frame_free(&f);
}

/* A frame holding {key: <one ndarray with the given dtype, shape and data>}. */
static void ndarray_frame(frame *f, const char *key, const char *dtype, int ndim, const int64_t *shape,
                          size_t bytes) {
    static const uint8_t zeros[256];
    frame_init(f);
    msgpack_pack_map(&f->pk, 1);
    put_str(f, key);
    put_ndarray(f, dtype, ndim, shape, zeros, bytes);
}

TEST(test_bad_ndarrays) {
    frame f;
    int64_t s23[2] = {2, 3}, neg[2] = {2, -3}, huge[3] = {(int64_t)1 << 40, (int64_t)1 << 40, 0},
            big[1] = {(int64_t)1 << 62}, nine[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1}, eight[8] = {1, 1, 1, 1, 1, 1, 1, 2};
    ndarray_frame(&f, "img", "<f4", 2, s23, 20);
    expect_frame_fails(&f, "holds 20 bytes but shape [2, 3] of <f4 needs 6", "key 'img'", "short data");
    ndarray_frame(&f, "img", "<f4", 2, s23, 28);
    expect_frame_fails(&f, "holds 28 bytes", "key 'img'", "long data");
    ndarray_frame(&f, "img", "|u1", 2, neg, 6);
    expect_frame_fails(&f, "dimension 1 of the shape is negative", "key 'img'", "negative dimension");
    ndarray_frame(&f, "img", "|u1", 3, huge, 0);
    expect_frame_fails(&f, "overflows", "key 'img'", "overflowing product (with a zero)");
    ndarray_frame(&f, "img", "<f8", 1, big, 8);
    expect_frame_fails(&f, "needs 4611686018427387904 elements", "key 'img'", "2^62 elements");
    ndarray_frame(&f, "img", "|u1", 9, nine, 1);
    expect_frame_fails(&f, "9 dimensions", "key 'img'", "rank 9");
    ndarray_frame(&f, "img", "|u1", 8, eight, 2);
    pi0_observation obs;
    if (decode_ok(f.sb.data, f.sb.size, &obs, "rank 8")) pi0_observation_free(&obs);
    frame_free(&f);

    static const struct { const char *dtype, *needle; } dtypes[] = {
        {"<c8", "unsupported dtype '<c8' (complex"}, {"<c16", "complex"}, {"|O", "(object"}, {"|V2", "(void"},
        {"<U5", "(unicode"}, {"|S3", "(bytes"}, {"<M8[ns]", "(datetime"}, {"<m8", "datetime"},
        {"<f16", "unsupported dtype '<f16'"}, {"<u3", "unsupported dtype '<u3'"}, {"|b2", "unsupported dtype"},
        {"float32", "not a numpy dtype"}, {"", "not a numpy dtype"}, {"<", "not a numpy dtype"},
        {"<f4x", "not a numpy dtype"}, {"<f99999999999999999999", "not a numpy dtype"}, {"f\xff", "'f?'"},
    };
    for (size_t i = 0; i < sizeof dtypes / sizeof dtypes[0]; i++) {
        ndarray_frame(&f, "obs", dtypes[i].dtype, 1, s23, 2);
        expect_frame_fails(&f, dtypes[i].needle, "key 'obs'", dtypes[i].dtype);
    }

    /* Fields of the numpy map itself. */
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "a");
    msgpack_pack_map(&f.pk, 3), put_bin_key(&f, "__ndarray__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), put_bin(&f, "x", 1), put_bin_key(&f, "dtype"), put_str(&f, "|u1");
    expect_frame_fails(&f, "lacks the field 'shape'", "key 'a'", "no shape");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "a");
    msgpack_pack_map(&f.pk, 5), put_str(&f, "__ndarray__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), put_bin(&f, "x", 1), put_bin_key(&f, "dtype"), put_str(&f, "|u1");
    put_bin_key(&f, "shape"), msgpack_pack_array(&f.pk, 0), put_bin_key(&f, "strides"), msgpack_pack_nil(&f.pk);
    expect_frame_fails(&f, "unknown field 'strides'", "key 'a'", "unknown field");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "a");
    msgpack_pack_map(&f.pk, 5), put_bin_key(&f, "__ndarray__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), put_bin(&f, "x", 1), put_bin_key(&f, "dtype"), put_str(&f, "|u1");
    put_bin_key(&f, "shape"), msgpack_pack_array(&f.pk, 0), put_str(&f, "data"), put_bin(&f, "y", 1);
    expect_frame_fails(&f, "field 'data' twice", "key 'a'", "data twice");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "a");
    msgpack_pack_map(&f.pk, 4), put_bin_key(&f, "__ndarray__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), put_str(&f, "x"), put_bin_key(&f, "dtype"), put_str(&f, "|u1");
    put_bin_key(&f, "shape"), msgpack_pack_array(&f.pk, 0);
    expect_frame_fails(&f, "data is a str, not bin", "key 'a'", "str data");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "a");
    msgpack_pack_map(&f.pk, 4), put_bin_key(&f, "__ndarray__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), put_bin(&f, "x", 1), put_bin_key(&f, "dtype"), msgpack_pack_int64(&f.pk, 4);
    put_bin_key(&f, "shape"), msgpack_pack_array(&f.pk, 0);
    expect_frame_fails(&f, "dtype is an int", "key 'a'", "int dtype");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "a");
    msgpack_pack_map(&f.pk, 4), put_bin_key(&f, "__ndarray__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), put_bin(&f, "x", 1), put_bin_key(&f, "dtype"), put_str(&f, "|u1");
    put_bin_key(&f, "shape"), msgpack_pack_array(&f.pk, 1), msgpack_pack_double(&f.pk, 1.0);
    expect_frame_fails(&f, "dimension 0 of the shape is a float", "key 'a'", "float dimension");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "a");
    msgpack_pack_map(&f.pk, 4), put_bin_key(&f, "__ndarray__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), put_bin(&f, "x", 1), put_bin_key(&f, "dtype"), put_str(&f, "|u1");
    put_bin_key(&f, "shape"), msgpack_pack_int64(&f.pk, 1);
    expect_frame_fails(&f, "shape is an int", "key 'a'", "int shape");
}

TEST(test_bad_npgenerics) {
    static const struct { const char *dtype; int kind; double value; const char *needle; } cases[] = {
        {"|u1", 'i', 300, "300 is out of the range of |u1"}, {"|i1", 'i', -129, "-129 is out of the range"},
        {"<u4", 'i', -1, "-1 is out of the range"},         {"<i4", 'f', 1.5, "dtype <i4 holds a float"},
        {"|b1", 'i', 1, "dtype |b1 holds an int"},           {"<f4", 'b', 1, "holds a bool"},
        {"<c8", 'f', 1, "complex"},                          {"<U3", 'f', 1, "unicode"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        frame f;
        frame_init(&f);
        msgpack_pack_map(&f.pk, 1), put_str(&f, "g"), msgpack_pack_map(&f.pk, 1), put_str(&f, "s");
        put_npgeneric_head(&f, cases[i].dtype);
        if (cases[i].kind == 'i') msgpack_pack_int64(&f.pk, (int64_t)cases[i].value);
        else if (cases[i].kind == 'f') msgpack_pack_double(&f.pk, cases[i].value);
        else msgpack_pack_true(&f.pk);
        expect_frame_fails(&f, cases[i].needle, "key 'g/s'", cases[i].needle);
    }
    frame f;
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "g");
    msgpack_pack_map(&f.pk, 3), put_bin_key(&f, "__npgeneric__"), msgpack_pack_true(&f.pk);
    put_bin_key(&f, "data"), msgpack_pack_int64(&f.pk, 1), put_bin_key(&f, "shape"), msgpack_pack_array(&f.pk, 0);
    expect_frame_fails(&f, "numpy scalar has an unknown field 'shape'", "key 'g'", "scalar with shape");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "list");
    msgpack_pack_array(&f.pk, 2), msgpack_pack_int64(&f.pk, 1), put_npgeneric_head(&f, "|u1");
    msgpack_pack_int64(&f.pk, 256);
    expect_frame_fails(&f, "out of the range", "key 'list'", "bad scalar in a list");
}

/* Frames that are well-formed msgpack but not a valid observation. */
TEST(test_bad_values_and_keys) {
    struct { const char *bytes; size_t size; const char *needle, *key; } cases[] = {
        {"\x90", 1, "the frame is a list, not a map", NULL},
        {"\xa3" "abc", 4, "the frame is a str, not a map", NULL},
        {"\x05", 1, "is an int, not a map", NULL},
        {"\xc0", 1, "is nil, not a map", NULL},
        {"\x81\x01\x02", 3, "the key of entry 0 is an int", "observation"},
        {"\x82\xa1" "a\x01\xa1" "a\x02", 7, "the key 'a' appears twice", "observation"},
        {"\x81\xa1" "a\x82\xa1" "b\xc0\xc4\x01" "b\x02", 11, "the key 'b' appears twice", "key 'a'"},
        {"\x81\xa0\x01", 3, "entry 0 is empty", NULL},
        {"\x81\xa2" "a\x00\x01", 5, "not valid UTF-8 or holds a NUL", NULL},
        {"\x81\xa1" "a\xa3" "a\x00" "b", 7, "holds a NUL", "key 'a'"},
        {"\x81\xa1" "a\xa1\xff", 5, "not valid UTF-8", "key 'a'"},
        {"\x81\xa1" "a\xa2\xc0\xaf", 6, "not valid UTF-8", "key 'a'"},         /* overlong '/' */
        {"\x81\xa1" "a\xa3\xed\xa0\x80", 7, "not valid UTF-8", "key 'a'"},     /* surrogate */
        {"\x81\xa1" "a\xa4\xf4\x90\x80\x80", 8, "not valid UTF-8", "key 'a'"}, /* past U+10FFFF */
        {"\x81\xa1" "a\xa2\xe2\x9c", 6, "not valid UTF-8", "key 'a'"},         /* cut sequence */
        {"\x81\xa1" "a\xc4\x02\xff\xfe", 7, "bin value is not UTF-8 text", "key 'a'"},
        {"\x81\xa1" "a\xd4\x05\x01", 6, "ext values (type 5)", "key 'a'"},
        {"\x81\xa1" "a\xd6\xff\x00\x00\x00\x01", 9, "ext values (type -1)", "key 'a'"}, /* a timestamp */
        {"\x81\xa1" "a\x92\x01\x92\x01\x02", 8, "element 1 of the list is a list", "key 'a'"},
        {"\x81\xa1" "a\x91\xa1" "x", 6, "element 0 of the list is a str", "key 'a'"},
        {"\x81\xa1" "a\x91\x80", 5, "element 0 of the list is a map", "key 'a'"},
        {"\x81\xa1" "a\x01\x02", 5, "1 bytes follow the value", NULL},
        {"\x81\xa1" "a\xc1", 4, "byte 0xc1 is not a msgpack type", "key 'a'"},
        {"", 0, "empty frame", NULL},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char what[32];
        snprintf(what, sizeof what, "case %zu", i);
        expect_fails(cases[i].bytes, cases[i].size, cases[i].needle, cases[i].key, what);
    }
    /* {"a/b": 1, "a": {"b": 2}}: two paths "a/b". */
    expect_fails("\x82\xa3" "a/b\x01\xa1" "a\x81\xa1" "b\x02", 12, "appears twice once nested", "key 'a/b'",
                 "flattened duplicate");
    /* {"a": {"x": 1}, "a": {"y": 2}}: the same key twice though no leaf path repeats. */
    expect_fails("\x82\xa1" "a\x81\xa1" "x\x01\xa1" "a\x81\xa1" "y\x02", 13, "'a' appears twice", NULL,
                 "duplicate dicts");
    /* A numpy array at the top. */
    frame f;
    int64_t shape[1] = {1};
    frame_init(&f);
    put_ndarray(&f, "|u1", 1, shape, "x", 1);
    expect_frame_fails(&f, "the frame is a numpy value", NULL, "top-level ndarray");
    /* A list holding a numpy array. */
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_str(&f, "imgs"), msgpack_pack_array(&f.pk, 1);
    put_ndarray(&f, "|u1", 1, shape, "x", 1);
    expect_frame_fails(&f, "element 0 of the list is a numpy array", "key 'imgs'", "list of arrays");
}

/* Small frames that would multiply into many fields or many copies of a long key path. */
TEST(test_field_and_key_limits) {
    frame f;
    frame_init(&f);
    msgpack_pack_map(&f.pk, 4097);
    for (int i = 0; i < 4097; i++) {
        char key[16];
        snprintf(key, sizeof key, "k%d", i);
        put_str(&f, key), msgpack_pack_int64(&f.pk, i);
    }
    expect_frame_fails(&f, "more than 4096 fields", "key 'k4096'", "4097 fields");
    frame_init(&f);
    msgpack_pack_map(&f.pk, 4096);
    for (int i = 0; i < 4096; i++) {
        char key[16];
        snprintf(key, sizeof key, "k%d", i);
        put_str(&f, key), msgpack_pack_int64(&f.pk, i);
    }
    pi0_observation obs;
    if (decode_ok(f.sb.data, f.sb.size, &obs, "4096 fields")) {
        const pi0_field *x = find_array(&obs, "k4095", PI0_DTYPE_I64, 0);
        CHECK(obs.count == 4096 && x && *(int64_t *)x->data == 4095, "4096 fields");
        pi0_observation_free(&obs);
    }
    frame_free(&f);

    char key[1025];
    memset(key, 'x', sizeof key);
    frame_init(&f); /* {"xxx...(1000)": {"yyy...(23)": 1}}: 1024 bytes joined, the most allowed */
    msgpack_pack_map(&f.pk, 1), put_strn(&f, key, 1000);
    msgpack_pack_map(&f.pk, 1), put_strn(&f, "yyyyyyyyyyyyyyyyyyyyyyy", 23), msgpack_pack_int64(&f.pk, 1);
    if (decode_ok(f.sb.data, f.sb.size, &obs, "1024-byte key")) {
        CHECK(obs.count == 1 && strlen(obs.fields[0].key) == 1024, "1024-byte key");
        pi0_observation_free(&obs);
    }
    frame_free(&f);
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_strn(&f, key, 1000);
    msgpack_pack_map(&f.pk, 1), put_strn(&f, "yyyyyyyyyyyyyyyyyyyyyyyy", 24), msgpack_pack_int64(&f.pk, 1);
    expect_frame_fails(&f, "key path grows past 1024 bytes with the key 'yyyy", "key 'xxxx", "1025-byte key");
    /* Long paths in messages are shortened between characters: 'é' is 2 bytes, the cut must not split one. */
    char accents[2 * 600];
    for (int i = 0; i < 600; i++) accents[2 * i] = (char)0xc3, accents[2 * i + 1] = (char)0xa9;
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_strn(&f, accents, 2 * 401), put_str(&f, "\xff");
    pi0_observation bad;
    pi0_error err = {0};
    CHECK(pi0_observation_decode(f.sb.data, f.sb.size, &bad, &err) == PI0_ERR_FORMAT, "invalid string accepted");
    CHECK(strstr(err.message, "\xc3\xa9...\xc3\xa9") && strstr(err.message, "\xc3\xa9': the string is not valid UTF-8"),
          "%s", err.message);
    CHECK(strlen(err.message) < 250, "message of %zu bytes", strlen(err.message));
    frame_free(&f);
    frame_init(&f);
    msgpack_pack_map(&f.pk, 1), put_strn(&f, key, 1025), msgpack_pack_int64(&f.pk, 1);
    expect_frame_fails(&f, "grows past 1024 bytes", "observation", "one 1025-byte key");
}

/* --- every truncation and random mutations ----------------------------------------------------- */

/* A small frame with a bit of everything: str and bin keys, nested dicts, arrays, scalars, lists. */
static void mixed_frame(frame *f) {
    uint8_t pixels[4 * 4 * 3];
    float state[8] = {0.5f, -1, 2, 3, 4, 5, 6, 7};
    uint16_t be[3] = {0x0100, 0x0200, 0x0300};
    fill_random(pixels, sizeof pixels, 99);
    int64_t img[3] = {4, 4, 3}, vec[1] = {8}, three[1] = {3};
    frame_init(f);
    msgpack_pack_map(&f->pk, 8);
    put_str(f, "observation/image"), put_ndarray(f, "|u1", 3, img, pixels, sizeof pixels);
    put_str(f, "observation/state"), put_ndarray(f, "<f4", 1, vec, state, sizeof state);
    put_bin_key(f, "images");
    msgpack_pack_map(&f->pk, 2);
    put_str(f, "cam_high"), put_ndarray(f, "|u1", 3, img, pixels, sizeof pixels);
    put_str(f, "be"), put_ndarray(f, ">u2", 1, three, be, sizeof be);
    put_str(f, "prompt"), put_str(f, "stack the blocks \xe2\x9c\x93");
    put_str(f, "step"), put_npgeneric_head(f, "<i8"), msgpack_pack_int64(&f->pk, 12);
    put_str(f, "gains"), msgpack_pack_array(&f->pk, 3);
    msgpack_pack_double(&f->pk, 0.5), msgpack_pack_int64(&f->pk, -2), msgpack_pack_true(&f->pk);
    put_str(f, "done"), msgpack_pack_false(&f->pk);
    put_str(f, "nothing"), msgpack_pack_nil(&f->pk);
}

TEST(test_every_truncation) {
    frame f;
    mixed_frame(&f);
    pi0_observation obs;
    REQUIRE(decode_ok(f.sb.data, f.sb.size, &obs, "mixed frame"));
    CHECK(obs.count == 8, "%d fields", obs.count);
    pi0_observation_free(&obs);
    int wrong = 0;
    for (size_t n = 0; n < f.sb.size && wrong < 5; n++) {
        pi0_error err = {0};
        pi0_status status = pi0_observation_decode(f.sb.data, n, &obs, &err);
        if (status != PI0_ERR_FORMAT || !observation_is_empty(&obs) || !strstr(err.message, "msgpack frame")) {
            CHECK(0, "prefix of %zu bytes: status %d: %s", n, status, err.message);
            wrong++;
            if (status == PI0_OK) pi0_observation_free(&obs);
        }
    }
    frame_free(&f);
}

/* Random edits of a valid frame: decoding must succeed or fail cleanly, never crash, leak or over-read
   (the ASan build runs this). Bytes in the first 200 (the headers) are hit most, with values that make
   msgpack types and counts. */
TEST(test_random_mutations) {
    static const uint8_t interesting[] = {0x00, 0x01, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1,
                                          0xc4, 0xc6, 0xc9, 0xd4, 0xd8, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0xff};
    frame f;
    mixed_frame(&f);
    size_t size = f.sb.size;
    uint8_t *mutant = malloc(size + 16);
    REQUIRE(mutant, "out of memory");
    uint64_t state = 0x2545f4914f6cdd1dull;
    int decoded = 0, failed = 0;
    unsigned sink = 0;
    for (int round = 0; round < 20000; round++) {
        memcpy(mutant, f.sb.data, size);
        size_t mutant_size = size;
        int edits = 1 + (int)(rng_next(&state) % 4);
        for (int e = 0; e < edits; e++) {
            uint64_t r = rng_next(&state);
            size_t pos = (r & 1 ? r >> 8 : (r >> 8) % 200) % mutant_size;
            switch ((r >> 1) % 4) {
            case 0: mutant[pos] = (uint8_t)(r >> 40); break;
            case 1: mutant[pos] ^= (uint8_t)(1u << ((r >> 40) % 8)); break;
            case 2: mutant[pos] = interesting[(r >> 40) % sizeof interesting]; break;
            default: mutant_size = pos + 1; break; /* truncate */
            }
        }
        pi0_observation obs;
        pi0_error err = {0};
        pi0_status status = pi0_observation_decode(mutant, mutant_size, &obs, &err);
        if (status == PI0_OK) {
            for (int i = 0; i < obs.count; i++) {
                const pi0_field *x = &obs.fields[i];
                if (x->kind == PI0_FIELD_ARRAY) /* read the last byte: ASan checks the size */
                    sink += ((volatile uint8_t *)x->data)[pi0_field_numel(x) * (int64_t)pi0_dtype_size(x->dtype) - 1];
                else if (x->kind == PI0_FIELD_STRING) CHECK(strlen(x->string) < mutant_size, "string too long");
            }
            pi0_observation_free(&obs);
            decoded++;
        } else {
            CHECK(status == PI0_ERR_FORMAT && err.message[0] && observation_is_empty(&obs), "round %d: status %d: %s",
                  round, status, err.message);
            /* The scan must catch every malformed frame before msgpack-c sees it. */
            CHECK(!strstr(err.message, "msgpack-c rejected"), "round %d: %s", round, err.message);
            failed++;
        }
        if (check_test_failed) break;
    }
    fprintf(stderr, "  %d mutants decoded, %d refused (%u)\n", decoded, failed, sink & 1);
    CHECK(decoded > 100 && failed > 1000, "mutations too mild or too harsh: %d decoded, %d refused", decoded, failed);
    free(mutant);
    frame_free(&f);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(test_dtype_table);
    RUN(test_roundtrip_every_dtype_and_rank);
    RUN(test_byte_orders);
    RUN(test_scalars_and_strings);
    RUN(test_lists);
    RUN(test_nested_keys);
    RUN(test_libero_droid_aloha_observations);
    RUN(test_packer_openpi_layout);
    RUN(test_packer_values);
    RUN(test_packer_failures);
    RUN(test_invalid_arguments);
    RUN(test_huge_claims);
    RUN(test_stacked_claims);
    RUN(test_deep_nesting);
    RUN(test_bad_ndarrays);
    RUN(test_bad_npgenerics);
    RUN(test_bad_values_and_keys);
    RUN(test_field_and_key_limits);
    RUN(test_every_truncation);
    RUN(test_random_mutations);
    return check_finish();
}
