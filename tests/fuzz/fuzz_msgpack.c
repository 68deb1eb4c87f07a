/*
 * fuzz_msgpack.c - libFuzzer harness for openpi's wire format: the bytes are one request frame for
 * pi0_observation_decode (src/server/msgpack_numpy.c). What it accepts must be a well-formed observation:
 * every array's data as long as its shape says, and packing it back (pi0_packer) then decoding gives the same
 * fields. Seeds: observations as openpi's clients send them (LIBERO, DROID with lists and scalars, nested maps).
 */
#include "fuzz.h"
#include "server/msgpack_numpy.h"

static void seed(const char *dir, const char *name, pi0_packer *pk) {
    if (pk->failed) abort();
    fuzz_write_seed(dir, name, "", 0, pk->data, pk->size);
    pi0_packer_free(pk);
}

static void write_seeds(const char *dir) {
    static uint8_t image[8 * 6 * 3];
    static const float state[8] = {0.01f, -0.1f, 0.9f, 3.0f, 0.25f, -0.2f, 0.03f, -0.025f};
    for (size_t i = 0; i < sizeof image; i++) image[i] = (uint8_t)(i * 37);
    pi0_packer pk = {0};
    pi0_pack_map(&pk, 4);
    pi0_pack_str(&pk, "observation/image");
    pi0_pack_ndarray(&pk, PI0_DTYPE_U8, 3, (int64_t[]){8, 6, 3}, image);
    pi0_pack_str(&pk, "observation/wrist_image");
    pi0_pack_ndarray(&pk, PI0_DTYPE_U8, 3, (int64_t[]){3, 8, 6}, image);
    pi0_pack_str(&pk, "observation/state");
    pi0_pack_ndarray(&pk, PI0_DTYPE_F32, 1, (int64_t[]){8}, state);
    pi0_pack_str(&pk, "prompt");
    pi0_pack_str(&pk, "pick up the black bowl");
    seed(dir, "libero", &pk);

    pi0_pack_map(&pk, 4);
    pi0_pack_str(&pk, "observation");
    pi0_pack_map(&pk, 2);
    pi0_pack_str(&pk, "joint_position");
    pi0_pack_array(&pk, 3);
    pi0_pack_double(&pk, 0.5), pi0_pack_int(&pk, -2), pi0_pack_double(&pk, 1e300);
    pi0_pack_str(&pk, "gripper_position");
    pi0_pack_double(&pk, -0.01);
    pi0_pack_str(&pk, "flag");
    pi0_pack_bool(&pk, 1);
    pi0_pack_str(&pk, "nothing");
    pi0_pack_nil(&pk);
    pi0_pack_str(&pk, "half");
    pi0_pack_ndarray(&pk, PI0_DTYPE_F16, 2, (int64_t[]){2, 2}, (uint16_t[]){0x3c00, 0x7c00, 0x7e00, 0x8000});
    seed(dir, "droid_nested", &pk);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_seeds_then_exit(write_seeds);
    return 0;
}

/* The observation packed back as a flat map, as msgpack_tool's echo does. */
static void repack(const pi0_observation *obs, pi0_packer *pk) {
    pi0_pack_map(pk, (uint32_t)obs->count);
    for (int i = 0; i < obs->count; i++) {
        const pi0_field *f = &obs->fields[i];
        pi0_pack_str(pk, f->key);
        if (f->kind == PI0_FIELD_STRING) pi0_pack_str(pk, f->string);
        else pi0_pack_ndarray(pk, f->dtype, f->ndim, f->shape, f->data);
    }
}

static int same_fields(const pi0_field *a, const pi0_field *b) {
    if (strcmp(a->key, b->key) || a->kind != b->kind) return 0;
    if (a->kind == PI0_FIELD_STRING) return !strcmp(a->string, b->string);
    return a->dtype == b->dtype && a->ndim == b->ndim && !memcmp(a->shape, b->shape, sizeof a->shape[0] * a->ndim) &&
           !memcmp(a->data, b->data, (size_t)pi0_field_numel(a) * pi0_dtype_size(a->dtype));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pi0_observation obs, again;
    if (pi0_observation_decode(data, size, &obs, NULL)) return 0;
    pi0_packer pk = {0};
    repack(&obs, &pk);
    if (pk.failed || pi0_observation_decode(pk.data, pk.size, &again, NULL) || again.count != obs.count) abort();
    for (int i = 0; i < obs.count; i++)
        if (!same_fields(&obs.fields[i], &again.fields[i])) fprintf(stderr, "field %d differs\n", i), abort();
    pi0_observation_free(&again);
    pi0_observation_free(&obs);
    pi0_packer_free(&pk);
    return 0;
}
