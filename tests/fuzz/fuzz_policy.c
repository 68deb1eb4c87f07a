/*
 * fuzz_policy.c - libFuzzer harness for the observation -> actions path (pi0_policy_infer) on micro models: a Pi0
 * with the libero adapter (z-score) and a Pi0.5 with the droid adapter (quantile, the state in the prompt). The
 * bytes describe 1..4 observations field by field, any key, dtype, shape and values, so the fuzzer reaches every
 * check of an observation (cameras, state, prompt) and the batch around it. Every observation must come back
 * with an error or with finite actions of the policy's size; a call that fails as a whole is a finding too.
 *
 * Input: byte 0: bit 0 the policy (0 Pi0/libero, 1 Pi0.5/droid), bits 1-2 the count - 1. Then records:
 *   u8 key (0xff: the next observation starts; else an index into KEYS), u8 type (0..11 a pi0_dtype, else a
 *   string), u8 ndim (mod 4), ndim x u16 dims (mod 300), u16 n, n bytes: the values, repeated to fill the array
 *   (or the string's bytes).
 */
#include <math.h>

#include "fuzz.h"
#include "policy/policy.h"

#define MAX_OBS 4
#define MAX_SIDE 300 /* beyond 224: frames are resized both ways */
#define MAX_FIELD_BYTES ((size_t)1 << 22)

static const char *KEYS[] = {"observation/image", "observation/wrist_image", "observation/state", "prompt",
                             "observation/exterior_image_1_left", "observation/wrist_image_left",
                             "observation/joint_position", "observation/gripper_position", "other"};
#define NUM_KEYS ((int)(sizeof KEYS / sizeof KEYS[0]))

static const char *NORM_STATS =
    "{\"norm_stats\": {\"state\": {\"mean\": [-0.05, 0.03, 0.8, 3.1, -0.2, 0.1, 0.02, -0.02],\n"
    "  \"std\": [0.1, 0.15, 0.12, 0.4, 0.3, 0.25, 0.015, 0.012], \"q01\": [-0.3, -0.3, 0.5, 2.2, -0.9, -0.5, -0.01, -0.04],\n"
    "  \"q99\": [0.2, 0.35, 1.1, 3.9, 0.5, 0.7, 0.04, 0.0]},\n"
    " \"actions\": {\"mean\": [0.06, 0.09, -0.1, 0.004, 0.005, -0.006, -0.1, 0.2],\n"
    "  \"std\": [0.33, 0.38, 0.45, 0.04, 0.06, 0.08, 0.99, 0.5],\n"
    "  \"q01\": [-0.75, -0.8, -0.94, -0.11, -0.16, -0.22, -1.0, -1.0], \"q99\": [0.9, 0.87, 0.94, 0.12, 0.17, 0.2, 1.0, 1.0]}}}\n";

static pi0_policy *policies[2];

static pi0_policy *open_policy(pi0_model_kind kind, const char *adapter_name) {
    pi0_dims d = fuzz_micro_dims(kind);
    pi0_options model_opts = {.backend = PI0_BACKEND_CPU, .num_threads = 1};
    pi0_model *model = NULL;
    pi0_adapter *adapter = NULL;
    pi0_tokenizer *tok = NULL;
    pi0_norm_stats stats = {0};
    pi0_policy *p = NULL;
    pi0_error err = {0};
    char path[512];
    snprintf(path, sizeof path, "%s/norm_stats.json", fuzz_dir());
    FILE *f = fopen(path, "w");
    if (!f || fputs(NORM_STATS, f) < 0 || fclose(f)) perror(path), abort();
    pi0_policy_options opts = {.num_steps = 2};
    if (pi0_model_random(&d, 3, &model_opts, &model, &err) || pi0_adapter_open(adapter_name, &adapter, &err) ||
        pi0_tokenizer_load(fuzz_fixture("tokenizer/tok.model"), &tok, &err) || pi0_norm_stats_load(path, &stats, &err) ||
        pi0_policy_create(model, adapter, tok, &stats, &opts, &p, &err))
        fprintf(stderr, "policy: %s\n", err.message), abort();
    return p;
}

/* ---- the input format ----------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *data;
    size_t size, at;
} reader;

static int read_u8(reader *r) { return r->at < r->size ? r->data[r->at++] : -1; }

static int read_u16(reader *r) {
    int lo = read_u8(r), hi = read_u8(r);
    return lo < 0 || hi < 0 ? -1 : lo | hi << 8;
}

/* One record into obs (a duplicate or bad field is refused by the library, as for any caller); 0 at the end. */
static int read_field(reader *r, pi0_observation *obs) {
    int key = read_u8(r), type = read_u8(r), ndim = read_u8(r);
    if (key < 0 || type < 0 || ndim < 0) return 0;
    int64_t shape[4] = {0}, numel = 1;
    ndim %= 4;
    for (int i = 0; i < ndim; i++) {
        int dim = read_u16(r);
        if (dim < 0) return 0;
        shape[i] = dim % MAX_SIDE;
        numel *= shape[i];
    }
    int n = read_u16(r);
    if (n < 0) return 0;
    size_t available = r->size - r->at < (size_t)n ? r->size - r->at : (size_t)n;
    const uint8_t *values = r->data + r->at;
    r->at += available;
    if (type > PI0_DTYPE_F64) {
        char *s = malloc(available + 1);
        if (!s) abort();
        memcpy(s, values, available), s[available] = 0;
        pi0_observation_add_string(obs, KEYS[key % NUM_KEYS], s, NULL);
        free(s);
        return 1;
    }
    size_t bytes = (size_t)numel * pi0_dtype_size((pi0_dtype)type);
    if (bytes > MAX_FIELD_BYTES) return 1; /* time and memory, not coverage: the size limits are tested elsewhere */
    uint8_t *array = malloc(bytes + 1);
    if (!array) abort();
    for (size_t i = 0; i < bytes; i++) array[i] = available ? values[i % available] : 0;
    pi0_observation_add_array(obs, KEYS[key % NUM_KEYS], (pi0_dtype)type, ndim, shape, array, NULL);
    free(array);
    return 1;
}

/* ---- seeds ---------------------------------------------------------------------------------------------- */

typedef struct {
    uint8_t bytes[4096];
    size_t size;
} writer;

static void put(writer *w, const void *data, size_t n) {
    if (w->size + n > sizeof w->bytes) abort();
    memcpy(w->bytes + w->size, data, n), w->size += n;
}

static void put_field(writer *w, int key, int type, int ndim, const int *dims, const void *values, int n) {
    put(w, (uint8_t[]){(uint8_t)key, (uint8_t)type, (uint8_t)ndim}, 3);
    for (int i = 0; i < ndim; i++) put(w, (uint8_t[]){(uint8_t)dims[i], (uint8_t)(dims[i] >> 8)}, 2);
    put(w, (uint8_t[]){(uint8_t)n, (uint8_t)(n >> 8)}, 2);
    put(w, values, (size_t)n);
}

static void put_image(writer *w, int key, int h, int width) {
    static const uint8_t pixels[] = {12, 200, 77, 5, 130, 255, 0, 64, 99, 31, 180, 2};
    put_field(w, key, PI0_DTYPE_U8, 3, (int[]){h, width, 3}, pixels, sizeof pixels);
}

static void write_seeds(const char *dir) {
    static const float state[8] = {0.01f, -0.1f, 0.9f, 3.0f, 0.25f, -0.2f, 0.03f, -0.025f};
    static const double joints[7] = {0.0, -0.05, 0.82, 3.3, -0.1, 0.3, 0.018}, gripper = -0.01;
    static const char prompt[] = "pick up the black bowl";
    writer w = {.size = 0};
    put(&w, (uint8_t[]){0 | 1 << 1}, 1); /* Pi0, two observations */
    for (int i = 0; i < 2; i++) {
        if (i) put(&w, (uint8_t[]){0xff}, 1);
        put_image(&w, 0, 48, 64);
        put_image(&w, 1, 224, 224);
        put_field(&w, 2, PI0_DTYPE_F32, 1, (int[]){8}, state, sizeof state);
        put_field(&w, 3, 0x80, 0, NULL, prompt, (int)strlen(prompt));
    }
    fuzz_write_seed(dir, "pi0_libero", "", 0, w.bytes, w.size);
    w.size = 0;
    put(&w, (uint8_t[]){1}, 1); /* Pi0.5, one observation */
    put_image(&w, 4, 180, 32);
    put_image(&w, 5, 10, 250);
    put_field(&w, 6, PI0_DTYPE_F64, 1, (int[]){7}, joints, sizeof joints);
    put_field(&w, 7, PI0_DTYPE_F64, 0, NULL, &gripper, sizeof gripper);
    put_field(&w, 3, 0x80, 0, NULL, prompt, (int)strlen(prompt));
    fuzz_write_seed(dir, "pi05_droid", "", 0, w.bytes, w.size);
}

/* ---- the harness ---------------------------------------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_seeds_then_exit(write_seeds);
    policies[0] = open_policy(PI0_MODEL_PI0, "libero");
    policies[1] = open_policy(PI0_MODEL_PI05, "droid");
    return 0;
}

/* An observation's answer: an error, or finite actions of the policy's shape. */
static void check_result(const pi0_policy *p, const pi0_policy_result *r) {
    if (r->error.status) {
        if (r->actions || !r->error.message[0]) abort();
        return;
    }
    if (!r->actions || r->horizon != pi0_policy_horizon(p) || r->action_dims != pi0_policy_action_dims(p)) abort();
    for (int i = 0; i < r->horizon * r->action_dims; i++)
        if (!isfinite(r->actions[i])) fprintf(stderr, "action %d is %g\n", i, r->actions[i]), abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    pi0_policy *p = policies[data[0] & 1];
    int count = 1 + (data[0] >> 1 & 3), n = 0;
    pi0_observation obs[MAX_OBS] = {{0}};
    reader r = {data, size, 1};
    while (n < count) {
        if (r.at < r.size && r.data[r.at] == 0xff) r.at++, n++;
        else if (!read_field(&r, &obs[n])) n++;
    }
    const pi0_observation *list[MAX_OBS] = {&obs[0], &obs[1], &obs[2], &obs[3]};
    uint64_t seeds[MAX_OBS] = {1, 2, 3, 4};
    pi0_policy_result results[MAX_OBS];
    pi0_error err = {0};
    if (pi0_policy_infer(p, list, seeds, count, results, NULL, &err)) fprintf(stderr, "%s\n", err.message), abort();
    for (int i = 0; i < count; i++) check_result(p, &results[i]), pi0_policy_result_free(&results[i]);
    for (int i = 0; i < count; i++) pi0_observation_free(&obs[i]);
    return 0;
}
