/*
 * test_policy.c - openpi's Policy.infer in C: the built-in and generic adapters, the whole pipeline against
 * a reference assembled here from the lower-level pieces (pi0_image_preprocess, pi0_normalize,
 * pi0_tokenize_prompt, pi0_sample_actions with its own seeded noise, pi0_unnormalize), layout and dtype
 * equivalences, batched vs alone, per-observation errors, and how pi0_policy_open finds its files.
 * The model is the pi0_tiny fixture's dims with random weights and the test tokenizer's 2000-piece vocabulary.
 */
#include <pthread.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "model/config.h"
#include "model/model.h"
#include "policy/adapter.h"
#include "model/image.h"
#include "policy/norm_stats.h"
#include "policy/policy.h"
#include "policy/tokenizer.h"
#include "util/rng.h"

#define STEPS 3

/* State (8) and actions (7) stats, as in tests/make_policy_checkpoint.sh. */
static const char *STATS_JSON =
    "{\"norm_stats\": {\n"
    "  \"state\": {\"mean\": [-0.05, 0.03, 0.8, 3.1, -0.2, 0.1, 0.02, -0.02],\n"
    "            \"std\": [0.1, 0.15, 0.12, 0.4, 0.3, 0.25, 0.015, 0.012],\n"
    "            \"q01\": [-0.3, -0.3, 0.5, 2.2, -0.9, -0.5, -0.01, -0.04],\n"
    "            \"q99\": [0.2, 0.35, 1.1, 3.9, 0.5, 0.7, 0.04, 0.0]},\n"
    "  \"actions\": {\"mean\": [0.06, 0.09, -0.1, 0.004, 0.005, -0.006, -0.1],\n"
    "              \"std\": [0.33, 0.38, 0.45, 0.04, 0.06, 0.08, 0.99],\n"
    "              \"q01\": [-0.75, -0.8, -0.94, -0.11, -0.16, -0.22, -1.0],\n"
    "              \"q99\": [0.9, 0.87, 0.94, 0.12, 0.17, 0.2, 1.0]}}}\n";

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

static void copy_file(const char *from, const char *to) {
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    char buf[65536];
    for (size_t n; in && out && (n = fread(buf, 1, sizeof buf, in)) > 0;) fwrite(buf, 1, n, out);
    if (in) fclose(in);
    if (out) fclose(out);
}

static const char *tokenizer_path(void) {
    static char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/tok.model", fixtures_dir());
    return path;
}

/* ---- the pieces ---------------------------------------------------------------------------------------- */

/* The tiny fixtures' dims, of a Pi0 or a Pi0.5 model (64 prompt tokens for Pi0.5: room for the state). */
static pi0_dims tiny_dims(pi0_model_kind kind, int vocab) {
    char path[1024];
    pi0_dims d = {0};
    pi0_error err = {0};
    snprintf(path, sizeof path, "%s/pi0_tiny/config.json", fixtures_dir());
    if (config_load_dims(path, &d, &err)) fprintf(stderr, "  %s\n", err.message);
    d.vocab_size = vocab;
    d.kind = kind;
    if (kind == PI0_MODEL_PI05) d.max_token_len = 64;
    return d;
}

static pi0_model *tiny_model(pi0_model_kind kind, int vocab) {
    pi0_dims d = tiny_dims(kind, vocab);
    pi0_options opts = {.backend = PI0_BACKEND_CPU};
    pi0_model *m = NULL;
    pi0_error err = {0};
    if (pi0_model_random(&d, 11, &opts, &m, &err)) fprintf(stderr, "  %s\n", err.message);
    return m;
}

typedef struct {
    pi0_model *model;
    pi0_tokenizer *tok;
    pi0_norm_stats stats;
} parts;

static int parts_open(parts *p, pi0_model_kind kind, int vocab) {
    pi0_error err = {0};
    memset(p, 0, sizeof *p);
    const char *stats = test_path("norm_stats.json");
    write_text(stats, STATS_JSON);
    p->model = tiny_model(kind, vocab);
    if (!p->model || pi0_tokenizer_load(tokenizer_path(), &p->tok, &err) || pi0_norm_stats_load(stats, &p->stats, &err)) {
        fprintf(stderr, "  parts: %s\n", err.message);
        return -1;
    }
    return 0;
}

static void parts_close(parts *p) {
    pi0_model_free(p->model);
    pi0_tokenizer_free(p->tok);
    pi0_norm_stats_free(&p->stats);
}

/* A policy over fresh parts (the policy owns them); `p` keeps a reference model etc. for the reference path. */
static pi0_policy *make_policy(const char *adapter_name, pi0_model_kind kind, int vocab, pi0_norm_mode mode,
                               pi0_error *err) {
    parts q;
    if (parts_open(&q, kind, vocab)) return NULL;
    pi0_adapter *a = NULL;
    if (pi0_adapter_open(adapter_name, &a, err)) {
        parts_close(&q);
        return NULL;
    }
    pi0_policy_options opts = {.norm_mode = mode, .num_steps = STEPS};
    pi0_policy *pol = NULL;
    pi0_policy_create(q.model, a, q.tok, &q.stats, &opts, &pol, err);
    return pol;
}

/* One observation as the reference takes it: images (NULL = absent camera), the raw state as float32, and
 * whether its normalized state goes into the prompt (Pi0.5's discrete state). */
typedef struct {
    const pi0_image *images[3];
    const float *state;
    int n;
    const char *prompt;
    uint64_t seed;
    int discrete_state;
} ref_sample;

/* ---- observations built in memory ------------------------------------------------------------------------ */

typedef struct {
    pi0_field fields[24];
    pi0_observation obs;
} obs_builder;

static void obs_init(obs_builder *b) {
    memset(b, 0, sizeof *b);
    b->obs.fields = b->fields;
}

static pi0_field *obs_array(obs_builder *b, const char *key, pi0_dtype dtype, int ndim, const int64_t *shape,
                            const void *data) {
    pi0_field *f = &b->fields[b->obs.count++];
    memset(f, 0, sizeof *f);
    f->key = (char *)key;
    f->kind = PI0_FIELD_ARRAY;
    f->dtype = dtype;
    f->ndim = ndim;
    for (int i = 0; i < ndim; i++) f->shape[i] = shape[i];
    f->data = (void *)data;
    return f;
}

static void obs_string(obs_builder *b, const char *key, const char *s) {
    pi0_field *f = &b->fields[b->obs.count++];
    memset(f, 0, sizeof *f);
    f->key = (char *)key;
    f->kind = PI0_FIELD_STRING;
    f->string = (char *)s;
}

/* Removes field `key` (tests of missing keys). */
static void obs_drop(obs_builder *b, const char *key) {
    for (int i = 0; i < b->obs.count; i++)
        if (!strcmp(b->fields[i].key, key)) {
            b->fields[i] = b->fields[--b->obs.count];
            return;
        }
}

static pi0_field *obs_get(obs_builder *b, const char *key) {
    for (int i = 0; i < b->obs.count; i++)
        if (!strcmp(b->fields[i].key, key)) return &b->fields[i];
    return NULL;
}

/* A deterministic uint8 HWC image, h x w. */
static uint8_t *make_image(int h, int w, uint32_t seed) {
    uint8_t *img = malloc((size_t)h * w * 3);
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < (size_t)h * w * 3; i++) {
        x = x * 1664525u + 1013904223u;
        img[i] = (uint8_t)((x >> 24) ^ (i * 7 / (size_t)(w * 3 + 1)));
    }
    return img;
}

static const float LIBERO_STATE[8] = {0.01f, -0.1f, 0.9f, 3.0f, 0.25f, -0.2f, 0.03f, -0.025f};

/* A LIBERO observation: base 48x64 (resized with padding), wrist 224x224 (used as is). */
typedef struct {
    obs_builder b;
    uint8_t *base, *wrist;
    pi0_image base_img, wrist_img;
    const char *prompt;
} libero_obs;

static void libero_make(libero_obs *o, uint32_t seed, const char *prompt) {
    obs_init(&o->b);
    o->base = make_image(48, 64, seed);
    o->wrist = make_image(224, 224, seed + 100);
    obs_array(&o->b, "observation/image", PI0_DTYPE_U8, 3, (int64_t[]){48, 64, 3}, o->base);
    obs_array(&o->b, "observation/wrist_image", PI0_DTYPE_U8, 3, (int64_t[]){224, 224, 3}, o->wrist);
    obs_array(&o->b, "observation/state", PI0_DTYPE_F32, 1, (int64_t[]){8}, LIBERO_STATE);
    obs_string(&o->b, "prompt", prompt);
    o->base_img = (pi0_image){o->base, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 48, 64, 3};
    o->wrist_img = (pi0_image){o->wrist, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 224, 224, 3};
    o->prompt = prompt;
}

static ref_sample libero_ref(const libero_obs *o, uint64_t seed) {
    return (ref_sample){{&o->base_img, &o->wrist_img, NULL}, LIBERO_STATE, 8, o->prompt, seed, 0};
}

/* Worst |a - b| / (|b| + 1e-3) over two results. */
static double result_diff(const pi0_policy_result *a, const pi0_policy_result *b) {
    double worst = a->actions && b->actions ? 0 : INFINITY;
    for (int k = 0; a->actions && b->actions && k < a->horizon * a->action_dims; k++) {
        double d = fabs(a->actions[k] - b->actions[k]) / (fabs(b->actions[k]) + 1e-3);
        worst = d > worst ? d : worst;
    }
    return worst;
}

static void libero_free(libero_obs *o) {
    free(o->base);
    free(o->wrist);
}

/* ---- the reference --------------------------------------------------------------------------------------- */

/*
 * openpi's Unnormalize of one float32 action value, written out with numpy's promotions (float64 stats;
 * quantile's `(x + 1.0) / 2.0` stays float32 because a Python float does not promote an array).
 */
static double numpy_unnormalize(const pi0_norm_entry *e, pi0_norm_mode mode, float a, int i) {
    if (mode == PI0_NORM_ZSCORE) {
        double mean = i < e->dim ? e->mean[i] : 0.0, std = i < e->dim ? e->std[i] : 1.0; /* pad_to_dim */
        double scaled = (double)a * (std + 1e-6);
        return scaled + mean;
    }
    if (i >= e->dim) return a;
    float half = (a + 1.0f) / 2.0f;
    double scaled = (double)half * (e->q99[i] - e->q01[i] + 1e-6);
    return scaled + e->q01[i];
}

/*
 * Policy.infer for `count` observations from the lower-level pieces. The noise of a batch of one is
 * pi0_sample_actions' own (noise = NULL, noise_seed); in larger batches each sample's is drawn the way
 * model/plan.c draws a batch of one's. `out` gets the unnormalized actions (count, H, R) in float64; they
 * are checked against pi0_unnormalize (bit for bit) on the way.
 */
static int reference_batch(const parts *p, const ref_sample *s, int count, pi0_norm_mode mode, int R, double *out) {
    const pi0_dims *d = pi0_model_dims(p->model);
    size_t S = (size_t)d->image_size, A = (size_t)d->action_dim, H = (size_t)d->action_horizon,
           L = (size_t)d->max_token_len, B = (size_t)count;
    pi0_error err = {0};
    float *bufs[3], *state = calloc(B * A, sizeof(float)), *noise = malloc(B * H * A * sizeof(float));
    float *actions = malloc(B * H * A * sizeof(float));
    double *library = malloc(A * sizeof(double));
    uint8_t *masks = calloc(B * 3, 1), *id_mask = calloc(B * L, 1);
    int32_t *ids = calloc(B * L, sizeof(int32_t));
    int ok = 1;
    for (int c = 0; c < 3; c++) bufs[c] = calloc(B * S * S * 3, sizeof(float));
    for (size_t b = 0; b < B; b++) {
        for (int c = 0; c < 3; c++) {
            masks[b * 3 + c] = s[b].images[c] != NULL;
            if (s[b].images[c] && pi0_image_preprocess(s[b].images[c], (int)S, bufs[c] + b * S * S * 3, &err)) ok = 0;
        }
        double raw[64], normalized[64];
        for (int i = 0; i < s[b].n && i < 64; i++) raw[i] = s[b].state[i];
        if (s[b].n > 64 || pi0_normalize(pi0_norm_stats_find(&p->stats, "state"), mode, raw, normalized, s[b].n, &err))
            ok = 0;
        for (int i = 0; ok && i < s[b].n; i++) state[b * A + i] = (float)normalized[i];
        if (s[b].discrete_state ? pi0_tokenize_prompt_with_state(p->tok, s[b].prompt, normalized, s[b].n, (int)L,
                                                                 ids + b * L, id_mask + b * L, NULL, &err)
                                : pi0_tokenize_prompt(p->tok, s[b].prompt, (int)L, ids + b * L, id_mask + b * L, NULL, &err))
            ok = 0;
        uint64_t stream = rng_mix64(s[b].seed ^ 0x6e6f697365ull);
        for (size_t i = 0; i < H * A; i++) noise[b * H * A + i] = rng_normal(stream, i);
    }
    const float *imgs[3] = {bufs[0], bufs[1], bufs[2]};
    pi0_batch batch = {.batch = count, .num_cameras = 3, .images = imgs, .image_masks = masks, .prompt_len = (int)L,
                       .prompt_ids = ids, .prompt_mask = id_mask, .state = state, .horizon = (int)H,
                       .noise = count == 1 ? NULL : noise, .noise_seed = s[0].seed, .num_steps = STEPS};
    if (ok && pi0_sample_actions(p->model, &batch, actions, NULL, &err)) ok = 0;
    const pi0_norm_entry *e = pi0_norm_stats_find(&p->stats, "actions");
    for (size_t t = 0; ok && t < B * H; t++) {
        if (pi0_unnormalize(e, mode, actions + t * A, library, (int)A, &err)) ok = 0;
        for (int i = 0; ok && i < R; i++) {
            out[t * R + i] = numpy_unnormalize(e, mode, actions[t * A + i], i);
            if (out[t * R + i] != library[i]) {
                fprintf(stderr, "  reference: unnormalize %.9g vs pi0_unnormalize %.9g\n", out[t * R + i], library[i]);
                ok = 0;
            }
        }
    }
    if (!ok) fprintf(stderr, "  reference: %s\n", err.message);
    for (int c = 0; c < 3; c++) free(bufs[c]);
    free(state), free(noise), free(actions), free(library), free(masks), free(id_mask), free(ids);
    return ok ? 0 : -1;
}

static int reference(const parts *p, const pi0_image *const images[3], const float *state, int n, const char *prompt,
                     uint64_t seed, pi0_norm_mode mode, int R, double *out) {
    ref_sample s = {{images[0], images[1], images[2]}, state, n, prompt, seed, 0};
    return reference_batch(p, &s, 1, mode, R, out);
}

/* The policy's float64 actions are the reference's, bit for bit. */
static int result_matches(const pi0_policy_result *r, const double *ref, int H, int R) {
    if (r->error.status != PI0_OK || !r->actions || r->horizon != H || r->action_dims != R) {
        fprintf(stderr, "  result: status %d (%s), %d x %d\n", r->error.status, r->error.message, r->horizon,
                r->action_dims);
        return 0;
    }
    for (int i = 0; i < H * R; i++)
        if (r->actions[i] != ref[i]) {
            fprintf(stderr, "  action %d: %.17g vs reference %.17g\n", i, r->actions[i], ref[i]);
            return 0;
        }
    return 1;
}

static int same_result(const pi0_policy_result *a, const pi0_policy_result *b) {
    return a->error.status == PI0_OK && b->error.status == PI0_OK && a->horizon == b->horizon &&
           a->action_dims == b->action_dims &&
           !memcmp(a->actions, b->actions, (size_t)a->horizon * a->action_dims * sizeof(double));
}

static pi0_status infer1(pi0_policy *pol, const pi0_observation *obs, uint64_t seed, pi0_policy_result *r) {
    pi0_error err = {0};
    const pi0_observation *list[1] = {obs};
    pi0_status st = pi0_policy_infer(pol, list, &seed, 1, r, NULL, &err);
    if (st) fprintf(stderr, "  infer: %s\n", err.message);
    return st ? st : r->error.status;
}

/* ---- adapters -------------------------------------------------------------------------------------------- */

TEST(adapters_builtin) {
    pi0_adapter *a = NULL;
    pi0_error err = {0};
    REQUIRE(pi0_adapter_open("libero", &a, &err) == PI0_OK, "%s", err.message);
    CHECK(!strcmp(a->name, "libero") && a->num_cameras == 3 && a->action_dims == 7);
    CHECK(!strcmp(a->camera_keys[0], "observation/image") && !strcmp(a->camera_keys[1], "observation/wrist_image") &&
          a->camera_keys[2] == NULL);
    CHECK(a->num_state_keys == 1 && !strcmp(a->state_keys[0], "observation/state"));
    CHECK(a->prompt_key && !strcmp(a->prompt_key, "prompt") && a->default_prompt == NULL);
    pi0_adapter_free(a);
    REQUIRE(pi0_adapter_open("droid", &a, &err) == PI0_OK, "%s", err.message);
    CHECK(!strcmp(a->name, "droid") && a->num_cameras == 3 && a->action_dims == 8);
    CHECK(!strcmp(a->camera_keys[0], "observation/exterior_image_1_left") &&
          !strcmp(a->camera_keys[1], "observation/wrist_image_left") && a->camera_keys[2] == NULL);
    CHECK(a->num_state_keys == 2 && !strcmp(a->state_keys[0], "observation/joint_position") &&
          !strcmp(a->state_keys[1], "observation/gripper_position"));
    pi0_adapter_free(a);
    a = (pi0_adapter *)1;
    CHECK(pi0_adapter_open("aloha", &a, &err) == PI0_ERR_IO && a == NULL && strstr(err.message, "aloha") &&
              strstr(err.message, "libero"), "%s", err.message);
    CHECK(pi0_adapter_open(NULL, &a, &err) == PI0_ERR_INVALID_ARGUMENT);
}

TEST(adapter_generic_valid) {
    const char *path = test_path("my_arm.json");
    write_text(path, "{\"cameras\": [\"images/top\", null, \"images/wrist\"], \"state\": [\"joints\", \"gripper\"],\n"
                     " \"default_prompt\": \"pick up the cup\", \"action_dims\": 6}");
    pi0_adapter *a = NULL;
    pi0_error err = {0};
    REQUIRE(pi0_adapter_open(path, &a, &err) == PI0_OK, "%s", err.message);
    CHECK(!strcmp(a->name, "my_arm"), "name from the file: %s", a->name);
    CHECK(a->num_cameras == 3 && !strcmp(a->camera_keys[0], "images/top") && a->camera_keys[1] == NULL &&
          !strcmp(a->camera_keys[2], "images/wrist"));
    CHECK(a->num_state_keys == 2 && !strcmp(a->state_keys[1], "gripper"));
    CHECK(a->prompt_key && !strcmp(a->prompt_key, "prompt"), "absent \"prompt\" reads key \"prompt\"");
    CHECK(a->default_prompt && !strcmp(a->default_prompt, "pick up the cup") && a->action_dims == 6);
    pi0_adapter_free(a);
    write_text(path, "{\"name\": \"arm\", \"cameras\": [\"c\"], \"state\": [\"s\"], \"prompt\": null, "
                     "\"default_prompt\": \"wave\", \"action_dims\": 1}");
    REQUIRE(pi0_adapter_open(path, &a, &err) == PI0_OK, "%s", err.message);
    CHECK(!strcmp(a->name, "arm") && a->prompt_key == NULL && a->num_cameras == 1);
    pi0_adapter_free(a);
    write_text(path, "{\"cameras\": [\"c\"], \"state\": [\"s\"], \"prompt\": \"task/instruction\", \"action_dims\": 2}");
    REQUIRE(pi0_adapter_open(path, &a, &err) == PI0_OK, "%s", err.message);
    CHECK(!strcmp(a->prompt_key, "task/instruction") && a->default_prompt == NULL);
    CHECK(!a->camera_optional[0], "cameras are required unless listed in optional_cameras");
    pi0_adapter_free(a);
    write_text(path, "{\"cameras\": [\"top\", \"left\", \"right\"], \"optional_cameras\": [\"right\", \"left\"], "
                     "\"state\": [\"s\"], \"action_dims\": 2}");
    REQUIRE(pi0_adapter_open(path, &a, &err) == PI0_OK, "%s", err.message);
    CHECK(!a->camera_optional[0] && a->camera_optional[1] && a->camera_optional[2]);
    pi0_adapter_free(a);
}

TEST(adapter_generic_invalid) {
    const char *path = test_path("bad_adapter.json");
    static const struct {
        const char *json, *expect;
    } cases[] = {
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"]", "invalid JSON"},
        {"[1, 2]", "an array, expected a JSON object"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 7, \"camera\": 1}", "unknown key \"camera\""},
        {"{\"state\": [\"s\"], \"action_dims\": 7}", "missing \"cameras\""},
        {"{\"cameras\": \"c\", \"state\": [\"s\"], \"action_dims\": 7}", "\"cameras\" is a string"},
        {"{\"cameras\": [], \"state\": [\"s\"], \"action_dims\": 7}", "\"cameras\" has 0 entries"},
        {"{\"cameras\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\"], \"state\": [\"s\"], \"action_dims\": 7}",
         "\"cameras\" has 9 entries"},
        {"{\"cameras\": [\"c\", 3], \"state\": [\"s\"], \"action_dims\": 7}", "\"cameras\"[1] is a number"},
        {"{\"cameras\": [\"\"], \"state\": [\"s\"], \"action_dims\": 7}", "\"cameras\"[0] is an empty"},
        {"{\"cameras\": [null, null], \"state\": [\"s\"], \"action_dims\": 7}", "\"cameras\" names no key"},
        {"{\"cameras\": [\"c\"], \"action_dims\": 7}", "missing \"state\""},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\", null], \"action_dims\": 7}", "\"state\"[1] is null"},
        {"{\"cameras\": [\"c\"], \"state\": [\"1\",\"2\",\"3\",\"4\",\"5\",\"6\",\"7\",\"8\",\"9\",\"10\",\"11\",\"12\","
         "\"13\",\"14\",\"15\",\"16\",\"17\"], \"action_dims\": 7}", "\"state\" has 17 entries"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"prompt\": 5, \"action_dims\": 7}", "\"prompt\" is a number"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"prompt\": \"\", \"action_dims\": 7}", "\"prompt\" is an empty key"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"prompt\": null, \"action_dims\": 7}", "no \"default_prompt\""},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"default_prompt\": [], \"action_dims\": 7}",
         "\"default_prompt\" is an array"},
        {"{\"name\": 3, \"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 7}", "\"name\" is a number"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"]}", "missing \"action_dims\""},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 0}", "\"action_dims\" must be"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 7.5}", "\"action_dims\" must be"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 100000}", "\"action_dims\" must be"},
        {"{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 7, \"action_dims\": 8}", "duplicate"},
        {"{\"cameras\": [\"c\"], \"optional_cameras\": \"c\", \"state\": [\"s\"], \"action_dims\": 7}",
         "\"optional_cameras\" is a string"},
        {"{\"cameras\": [\"c\"], \"optional_cameras\": [\"d\"], \"state\": [\"s\"], \"action_dims\": 7}",
         "\"optional_cameras\"[0] is \"d\", which is not one of \"cameras\""},
        {"{\"cameras\": [\"c\"], \"optional_cameras\": [null], \"state\": [\"s\"], \"action_dims\": 7}",
         "\"optional_cameras\"[0] is null"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        write_text(path, cases[i].json);
        pi0_adapter *a = (pi0_adapter *)1;
        pi0_error err = {0};
        pi0_status st = pi0_adapter_open(path, &a, &err);
        CHECK(st == PI0_ERR_FORMAT && a == NULL && strstr(err.message, path) && strstr(err.message, cases[i].expect),
              "case %zu: status %d: %s (expected \"%s\")", i, st, err.message, cases[i].expect);
        if (!st) pi0_adapter_free(a);
    }
}

/* ---- the pipeline ---------------------------------------------------------------------------------------- */

TEST(libero_matches_reference) {
    parts ref;
    REQUIRE(parts_open(&ref, PI0_MODEL_PI0, 2000) == 0);
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    libero_obs o;
    libero_make(&o, 1, "  pick_up the\nblack bowl ");
    pi0_image base = {o.base, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 48, 64, 3};
    pi0_image wrist = {o.wrist, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 224, 224, 3};
    const pi0_image *imgs[3] = {&base, &wrist, NULL};
    double want[10 * 7];
    REQUIRE(reference(&ref, imgs, LIBERO_STATE, 8, "  pick_up the\nblack bowl ", 42, PI0_NORM_ZSCORE, 7, want) == 0);
    pi0_policy_result r;
    double ms = -1;
    const pi0_observation *list[1] = {&o.b.obs};
    uint64_t seed = 42;
    CHECK(pi0_policy_infer(pol, list, &seed, 1, &r, &ms, &err) == PI0_OK, "%s", err.message);
    CHECK(ms > 0, "infer_ms %g", ms);
    CHECK(result_matches(&r, want, 10, 7));
    CHECK(pi0_policy_horizon(pol) == 10 && pi0_policy_adapter(pol)->action_dims == 7 && pi0_policy_model(pol));
    /* the actions are not the normalized model output: the stats moved them */
    double sum = 0;
    for (int i = 0; r.actions && i < 70; i++) sum += r.actions[i];
    CHECK(isfinite(sum));
    pi0_policy_result_free(&r);
    CHECK(r.actions == NULL);
    pi0_policy_result_free(&r);
    /* another seed gives other actions */
    pi0_policy_result r2;
    seed = 43;
    CHECK(pi0_policy_infer(pol, list, &seed, 1, &r2, NULL, &err) == PI0_OK);
    CHECK(r2.actions && r2.actions[0] != want[0]);
    pi0_policy_result_free(&r2);
    libero_free(&o);
    pi0_policy_free(pol);
    parts_close(&ref);
}

TEST(droid_matches_reference) {
    parts ref;
    REQUIRE(parts_open(&ref, PI0_MODEL_PI0, 2000) == 0);
    pi0_error err = {0};
    pi0_policy *pol = make_policy("droid", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    /* exterior: float32 CHW 3x100x80; wrist: uint8 HWC 180x320 */
    uint8_t *ext_u8 = make_image(100, 80, 5), *wrist = make_image(180, 320, 6);
    float *ext = malloc(3 * 100 * 80 * sizeof(float));
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < 100 * 80; i++) ext[c * 8000 + i] = ext_u8[i * 3 + c] / 255.0f;
    static const double joints[7] = {0.0, -0.05, 0.82, 3.3, -0.1, 0.3, 0.018};
    static const double gripper = -0.01; /* a numpy scalar (ndim 0), like DROID clients send */
    obs_builder b;
    obs_init(&b);
    obs_array(&b, "observation/exterior_image_1_left", PI0_DTYPE_F32, 3, (int64_t[]){3, 100, 80}, ext);
    obs_array(&b, "observation/wrist_image_left", PI0_DTYPE_U8, 3, (int64_t[]){180, 320, 3}, wrist);
    obs_array(&b, "observation/joint_position", PI0_DTYPE_F64, 1, (int64_t[]){7}, joints);
    obs_array(&b, "observation/gripper_position", PI0_DTYPE_F64, 0, NULL, &gripper);
    obs_string(&b, "prompt", "put the marker in the cup");

    pi0_image e = {ext, PI0_PIXEL_F32, PI0_LAYOUT_CHW, 100, 80, 3};
    pi0_image w = {wrist, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 180, 320, 3};
    const pi0_image *imgs[3] = {&e, &w, NULL};
    float state[8];
    for (int i = 0; i < 7; i++) state[i] = (float)joints[i];
    state[7] = (float)gripper;
    double want[10 * 8];
    /* values that float32 represents exactly normalize alike from float32 or float64; these do not all, so
     * the reference normalizes from float32 and the policy must stay within float32 rounding of it */
    REQUIRE(reference(&ref, imgs, state, 8, "put the marker in the cup", 7, PI0_NORM_ZSCORE, 8, want) == 0);
    pi0_policy_result r;
    REQUIRE(infer1(pol, &b.obs, 7, &r) == PI0_OK);
    CHECK(r.horizon == 10 && r.action_dims == 8);
    double worst = 0;
    for (int i = 0; i < 80; i++) {
        double d = fabs(r.actions[i] - want[i]) / (fabs(want[i]) + 1e-3);
        worst = d > worst ? d : worst;
    }
    CHECK(worst < 1e-4, "droid vs reference: %.3g", worst);
    /* the 8th dim has no action stats: z-score pads mean 0, std 1 */
    pi0_policy_result_free(&r);

    /* with float32-exact joint values the float64 path gives the reference bit for bit */
    static const double exact_joints[7] = {0.0, -0.0625, 0.8125, 3.25, -0.125, 0.375, 0.015625};
    static const double exact_gripper = -0.0078125;
    obs_get(&b, "observation/joint_position")->data = (void *)exact_joints;
    obs_get(&b, "observation/gripper_position")->data = (void *)&exact_gripper;
    for (int i = 0; i < 7; i++) state[i] = (float)exact_joints[i];
    state[7] = (float)exact_gripper;
    REQUIRE(reference(&ref, imgs, state, 8, "put the marker in the cup", 7, PI0_NORM_ZSCORE, 8, want) == 0);
    REQUIRE(infer1(pol, &b.obs, 7, &r) == PI0_OK);
    CHECK(result_matches(&r, want, 10, 8));
    pi0_policy_result_free(&r);
    free(ext_u8), free(wrist), free(ext);
    pi0_policy_free(pol);
    parts_close(&ref);
}

TEST(quantile_mode_matches_reference) {
    parts ref;
    REQUIRE(parts_open(&ref, PI0_MODEL_PI0, 2000) == 0);
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_QUANTILE, &err);
    REQUIRE(pol, "%s", err.message);
    libero_obs o;
    libero_make(&o, 2, "open the drawer");
    pi0_image base = {o.base, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 48, 64, 3};
    pi0_image wrist = {o.wrist, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 224, 224, 3};
    const pi0_image *imgs[3] = {&base, &wrist, NULL};
    double want[10 * 7];
    REQUIRE(reference(&ref, imgs, LIBERO_STATE, 8, "open the drawer", 3, PI0_NORM_QUANTILE, 7, want) == 0);
    pi0_policy_result r;
    REQUIRE(infer1(pol, &o.b.obs, 3, &r) == PI0_OK);
    CHECK(result_matches(&r, want, 10, 7));
    pi0_policy_result_free(&r);
    libero_free(&o);
    pi0_policy_free(pol);
    parts_close(&ref);
}

/* uint8 HWC, uint8 CHW, float32 HWC/CHW and float64 CHW of the same pixels give the same actions. float pixels
 * are (v + 0.5) / 255 so that numpy's (255 * x).astype(uint8) truncates back to v. */
TEST(layouts_and_dtypes_are_equivalent) {
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    libero_obs o;
    libero_make(&o, 3, "stack the blocks");
    int h = 48, w = 64;
    size_t n = (size_t)h * w * 3;
    uint8_t *chw_u8 = malloc(n);
    float *hwc_f32 = malloc(n * sizeof(float)), *chw_f32 = malloc(n * sizeof(float));
    double *chw_f64 = malloc(n * sizeof(double));
    for (int y = 0; y < h; y++)
        for (int x = 0; x < w; x++)
            for (int c = 0; c < 3; c++) {
                uint8_t v = o.base[(y * w + x) * 3 + c];
                size_t hwc = (size_t)(y * w + x) * 3 + c, chw = (size_t)(c * h + y) * w + x;
                chw_u8[chw] = v;
                hwc_f32[hwc] = (v + 0.5f) / 255.0f;
                chw_f32[chw] = (v + 0.5f) / 255.0f;
                chw_f64[chw] = (v + 0.5) / 255.0;
            }
    pi0_policy_result base_r, r;
    REQUIRE(infer1(pol, &o.b.obs, 9, &base_r) == PI0_OK);
    pi0_field *f = obs_get(&o.b, "observation/image");
    struct {
        const char *what;
        pi0_dtype dtype;
        int64_t shape[3];
        const void *data;
    } variants[] = {
        {"uint8 CHW", PI0_DTYPE_U8, {3, 48, 64}, chw_u8},
        {"float32 HWC", PI0_DTYPE_F32, {48, 64, 3}, hwc_f32},
        {"float32 CHW", PI0_DTYPE_F32, {3, 48, 64}, chw_f32},
        {"float64 CHW", PI0_DTYPE_F64, {3, 48, 64}, chw_f64},
    };
    for (int v = 0; v < 4; v++) {
        f->dtype = variants[v].dtype;
        memcpy(f->shape, variants[v].shape, sizeof variants[v].shape);
        f->data = (void *)variants[v].data;
        REQUIRE(infer1(pol, &o.b.obs, 9, &r) == PI0_OK);
        CHECK(same_result(&base_r, &r), "%s differs from uint8 HWC", variants[v].what);
        pi0_policy_result_free(&r);
    }
    /* a 224x224 float64 HWC frame is used as is (no resize) and still equals its uint8 version */
    f = obs_get(&o.b, "observation/wrist_image");
    double *wrist_f64 = malloc((size_t)224 * 224 * 3 * sizeof(double));
    for (size_t i = 0; i < (size_t)224 * 224 * 3; i++) wrist_f64[i] = (o.wrist[i] + 0.25) / 255.0;
    f->dtype = PI0_DTYPE_F64;
    f->data = wrist_f64;
    REQUIRE(infer1(pol, &o.b.obs, 9, &r) == PI0_OK);
    CHECK(same_result(&base_r, &r), "float64 wrist differs");
    pi0_policy_result_free(&r);
    /* the state's dtype only matters through its values: int64 and float32 of small integers agree */
    obs_builder b2 = o.b;
    b2.obs.fields = b2.fields;
    static const int64_t ints[8] = {0, 0, 1, 3, 0, 0, 0, 0};
    static const float floats[8] = {0, 0, 1, 3, 0, 0, 0, 0};
    pi0_field *s = obs_get(&b2, "observation/state");
    s->dtype = PI0_DTYPE_I64;
    s->data = (void *)ints;
    pi0_policy_result ri, rf;
    REQUIRE(infer1(pol, &b2.obs, 9, &ri) == PI0_OK);
    s->dtype = PI0_DTYPE_F32;
    s->data = (void *)floats;
    REQUIRE(infer1(pol, &b2.obs, 9, &rf) == PI0_OK);
    CHECK(same_result(&ri, &rf), "int64 state differs from float32");
    CHECK(!same_result(&ri, &base_r), "a different state gave the same actions");
    pi0_policy_result_free(&ri), pi0_policy_result_free(&rf), pi0_policy_result_free(&base_r);
    free(chw_u8), free(hwc_f32), free(chw_f32), free(chw_f64), free(wrist_f64);
    libero_free(&o);
    pi0_policy_free(pol);
}

/*
 * Each observation's noise depends on its own seed only. A batch equals, bit for bit, the same batch assembled
 * from the pieces with each sample's seeded noise; each observation alone gets the same noise, so the same
 * actions up to the engine's batch-size rounding (CPU GEMMs of different row counts round differently).
 */
TEST(batch_equals_alone) {
    parts ref;
    REQUIRE(parts_open(&ref, PI0_MODEL_PI0, 2000) == 0);
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    enum { N = 4 };
    libero_obs o[N];
    const char *prompts[N] = {"pick up the bowl", "open the top drawer and put the bowl inside", "x", "turn on the stove"};
    const pi0_observation *list[N];
    uint64_t seeds[N] = {5, 123456789012345ull, 5, 0};
    ref_sample samples[N];
    for (int i = 0; i < N; i++) {
        libero_make(&o[i], 10 + i, prompts[i]);
        list[i] = &o[i].b.obs;
        samples[i] = libero_ref(&o[i], seeds[i]);
    }
    double want[N * 10 * 7];
    REQUIRE(reference_batch(&ref, samples, N, PI0_NORM_ZSCORE, 7, want) == 0);
    pi0_policy_result together[N], again[N], alone;
    REQUIRE(pi0_policy_infer(pol, list, seeds, N, together, NULL, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_policy_infer(pol, list, seeds, N, again, NULL, &err) == PI0_OK, "%s", err.message);
    for (int i = 0; i < N; i++) {
        CHECK(result_matches(&together[i], want + i * 70, 10, 7), "observation %d vs the reference batch", i);
        CHECK(same_result(&together[i], &again[i]), "observation %d: the same batch twice differs", i);
        REQUIRE(infer1(pol, list[i], seeds[i], &alone) == PI0_OK);
        double d = result_diff(&together[i], &alone);
        fprintf(stderr, "  observation %d: batched vs alone %.3g\n", i, d);
        CHECK(d < 1e-4, "observation %d: batched vs alone %.3g", i, d);
        pi0_policy_result_free(&alone);
    }
    CHECK(result_diff(&together[0], &together[2]) > 1e-3, "different observations, same seed, same actions?");
    /* the same observation under other seeds */
    uint64_t other[N] = {6, 123456789012346ull, 6, 1};
    pi0_policy_result moved[N];
    REQUIRE(pi0_policy_infer(pol, list, other, N, moved, NULL, &err) == PI0_OK);
    for (int i = 0; i < N; i++) CHECK(result_diff(&moved[i], &together[i]) > 1e-3, "seed change ignored (%d)", i);
    for (int i = 0; i < N; i++)
        pi0_policy_result_free(&together[i]), pi0_policy_result_free(&again[i]), pi0_policy_result_free(&moved[i]);
    /* a count of 0 is fine; NULL seeds mean seed 0 */
    CHECK(pi0_policy_infer(pol, NULL, NULL, 0, NULL, NULL, &err) == PI0_OK);
    pi0_policy_result z0, z1;
    REQUIRE(pi0_policy_infer(pol, list + 3, NULL, 1, &z0, NULL, &err) == PI0_OK);
    REQUIRE(infer1(pol, list[3], 0, &z1) == PI0_OK);
    CHECK(same_result(&z0, &z1), "NULL seeds differ from seed 0");
    pi0_policy_result_free(&z0), pi0_policy_result_free(&z1);
    CHECK(pi0_policy_infer(pol, list, seeds, -1, together, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_policy_infer(NULL, list, seeds, 1, together, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
          together[0].error.status == PI0_ERR_INVALID_ARGUMENT && together[0].actions == NULL);
    for (int i = 0; i < N; i++) libero_free(&o[i]);
    pi0_policy_free(pol);
    parts_close(&ref);
}

/* A bad observation fails alone, with an error naming the key and the problem; the others still run. */
typedef struct {
    const pi0_policy *policy;
    const pi0_observation *obs;
    pi0_prepared *prepared;
    pi0_status status;
} prepare_job;

static void *prepare_thread(void *arg) {
    prepare_job *j = arg;
    pi0_error err = {0};
    j->status = pi0_policy_prepare(j->policy, j->obs, &j->prepared, &err);
    return NULL;
}

/* The server's split: observations prepared on threads of their own, all at once, then run together, give
 * what pi0_policy_infer gives; a bad one carries its error through. Then warm-up covers every shape. */
TEST(prepare_on_threads_then_infer) {
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    enum { N = 3 };
    libero_obs o[N];
    const char *prompts[N] = {"pick up the bowl", "open the top drawer", "turn on the stove"};
    const pi0_observation *list[N];
    uint64_t seeds[N] = {1, 2, 3};
    for (int i = 0; i < N; i++) libero_make(&o[i], 30 + i, prompts[i]), list[i] = &o[i].b.obs;
    obs_drop(&o[1].b, "observation/state");
    prepare_job jobs[N];
    pthread_t threads[N];
    for (int i = 0; i < N; i++) {
        jobs[i] = (prepare_job){.policy = pol, .obs = list[i]};
        REQUIRE(pthread_create(&threads[i], NULL, prepare_thread, &jobs[i]) == 0);
    }
    for (int i = 0; i < N; i++) pthread_join(threads[i], NULL);
    CHECK(jobs[0].status == PI0_OK && jobs[2].status == PI0_OK && jobs[1].status == PI0_ERR_INVALID_ARGUMENT);
    const pi0_prepared *prepared[N] = {jobs[0].prepared, jobs[1].prepared, jobs[2].prepared};
    REQUIRE(prepared[0] && prepared[1] && prepared[2], "a failed preparation still gives its error holder");
    pi0_policy_result split[N], whole[N];
    REQUIRE(pi0_policy_infer_prepared(pol, prepared, seeds, N, split, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_policy_infer(pol, list, seeds, N, whole, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(same_result(&split[0], &whole[0]) && same_result(&split[2], &whole[2]));
    CHECK(split[1].error.status == PI0_ERR_INVALID_ARGUMENT && split[1].actions == NULL &&
          strstr(split[1].error.message, "observation/state"), "%s", split[1].error.message);
    CHECK(split[0].prepare_ms > 0 && split[0].model_ms > 0 && split[0].model_ms == split[2].model_ms,
          "timings: prepare %.3f model %.3f / %.3f", split[0].prepare_ms, split[0].model_ms, split[2].model_ms);
    for (int i = 0; i < N; i++)
        pi0_policy_result_free(&split[i]), pi0_policy_result_free(&whole[i]), pi0_prepared_free(jobs[i].prepared);
    CHECK(pi0_policy_prepare(pol, NULL, &jobs[0].prepared, &err) == PI0_ERR_INVALID_ARGUMENT);

    double seconds = -1;
    CHECK(pi0_policy_warmup(pol, 2, &seconds, &err) == PI0_OK && seconds == 0, "the CPU has nothing to warm up: %s", err.message);
    CHECK(pi0_policy_warmup(pol, 0, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_policy_warmup(pol, PI0_MAX_BATCH + 1, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    pi0_policy_result again;
    REQUIRE(infer1(pol, list[0], seeds[0], &again) == PI0_OK); /* warm-up leaves nothing behind */
    pi0_policy_result first;
    REQUIRE(infer1(pol, list[0], seeds[0], &first) == PI0_OK);
    CHECK(same_result(&again, &first));
    pi0_policy_result_free(&again), pi0_policy_result_free(&first);
    for (int i = 0; i < N; i++) libero_free(&o[i]);
    pi0_policy_free(pol);
}

/* Prepared observations live in the policy's pool of pi0_host_alloc blocks: a freed block serves the next
 * observation (no stale bytes of the last one reach the model), more blocks than the pool keeps come and go, and an
 * observation freed after its policy still frees cleanly (the sanitizer build checks both). */
TEST(prepared_blocks_are_reused) {
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    libero_obs a, b;
    libero_make(&a, 41, "pick up the bowl"), libero_make(&b, 42, "open the top drawer");
    uint64_t seed = 5;
    pi0_prepared *first = NULL, *again = NULL;
    REQUIRE(pi0_policy_prepare(pol, &a.b.obs, &first, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_policy_pooled_blocks(pol) == 0, "the pool starts empty");
    pi0_prepared_free(first);
    CHECK(pi0_policy_pooled_blocks(pol) == 1, "a freed block did not go back to the pool");
    REQUIRE(pi0_policy_prepare(pol, &b.b.obs, &again, &err) == PI0_OK, "%s", err.message);
    CHECK(again == first && pi0_policy_pooled_blocks(pol) == 0, "a freed block was not reused");
    pi0_policy_result from_pool, direct;
    const pi0_prepared *list[1] = {again};
    REQUIRE(pi0_policy_infer_prepared(pol, list, &seed, 1, &from_pool, &err) == PI0_OK, "%s", err.message);
    REQUIRE(infer1(pol, &b.b.obs, seed, &direct) == PI0_OK);
    CHECK(same_result(&from_pool, &direct), "a reused block gives other actions");
    pi0_policy_result_free(&from_pool), pi0_policy_result_free(&direct);
    enum { MANY = 40 };
    pi0_prepared *many[MANY];
    for (int i = 0; i < MANY; i++) REQUIRE(pi0_policy_prepare(pol, &a.b.obs, &many[i], &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_policy_pooled_blocks(pol) == 0, "blocks handed out twice");
    for (int i = 0; i < MANY; i++) pi0_prepared_free(many[i]);
    CHECK(pi0_policy_pooled_blocks(pol) == 16, "the pool keeps %d blocks, not 16", pi0_policy_pooled_blocks(pol));
    pi0_prepared_free(NULL);
    pi0_prepared *late = NULL;
    REQUIRE(pi0_policy_prepare(pol, &a.b.obs, &late, &err) == PI0_OK, "%s", err.message);
    pi0_policy_free(pol);
    pi0_prepared_free(late); /* after its policy */
    pi0_prepared_free(again);
    libero_free(&a), libero_free(&b);
}

TEST(bad_observations_fail_alone) {
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    static uint8_t img4[10 * 10 * 4], tiny_img[2 * 2 * 3], flat[100];
    static int32_t img_i32[10 * 10 * 3];
    static float nan_state[8] = {0, 0, NAN, 0, 0, 0, 0, 0}, long_state[33], state_9[9], state_2d[8];
    /* finite, but (x - mean) / (std + 1e-6) is not finite in float32, the model's input */
    static float huge_state[8] = {0, 0, 0, 0, 0, 0, 1e38f, 0};
    static double huge_state_f64[8] = {0, 0, 0, 0, 0, 1e300, 0, 0};
    uint8_t *huge = calloc((size_t)4097 * 2 * 3, 1);
    enum { MAX_CASES = 24 };
    libero_obs o[MAX_CASES];
    const char *expect[MAX_CASES][2];
    int n = 0;
#define CASE(e1, e2) (libero_make(&o[n], 20 + n, "do it"), expect[n][0] = (e1), expect[n][1] = (e2), &o[n++].b)
    CASE(NULL, NULL); /* good */
    obs_drop(CASE("observation/image", "missing key"), "observation/image");
    obs_get(CASE("observation/wrist_image", "expected an image"), "observation/wrist_image")->ndim = 2;
    {
        pi0_field *f = obs_get(CASE("observation/image", "3 color channels"), "observation/image");
        f->shape[0] = 10, f->shape[1] = 10, f->shape[2] = 4, f->data = img4;
    }
    {
        pi0_field *f = obs_get(CASE("observation/image", "dtype <i4"), "observation/image");
        f->dtype = PI0_DTYPE_I32, f->shape[0] = 10, f->shape[1] = 10, f->data = img_i32;
    }
    {
        obs_builder *b = CASE("observation/wrist_image", "is a string");
        obs_drop(b, "observation/wrist_image");
        obs_string(b, "observation/wrist_image", "not an image");
    }
    {
        pi0_field *f = obs_get(CASE("observation/image", "empty image"), "observation/image");
        f->shape[0] = 0, f->data = tiny_img;
    }
    {
        pi0_field *f = obs_get(CASE("observation/image", "larger than 4096x4096"), "observation/image");
        f->shape[0] = 4097, f->shape[1] = 2, f->data = huge;
    }
    CASE(NULL, NULL); /* good, between bad ones */
    obs_get(CASE("observation/state", "must be finite"), "observation/state")->data = nan_state;
    obs_get(CASE("\"observation/state\"[6] is 1e+38", "not finite as the model's float32 input"),
            "observation/state")->data = huge_state;
    {
        pi0_field *f = obs_get(CASE("\"observation/state\"[5] is 1e+300", "not finite as the model's float32 input"),
                               "observation/state");
        f->dtype = PI0_DTYPE_F64, f->data = huge_state_f64;
    }
    {
        pi0_field *f = obs_get(CASE("observation/state", "more than the model's action_dim 32"), "observation/state");
        f->shape[0] = 33, f->data = long_state;
    }
    {
        pi0_field *f = obs_get(CASE("observation/state", "norm stats \"state\" have 8"), "observation/state");
        f->shape[0] = 9, f->data = state_9;
    }
    {
        pi0_field *f = obs_get(CASE("observation/state", "expected a number or a vector"), "observation/state");
        f->ndim = 2, f->shape[0] = 2, f->shape[1] = 4, f->data = state_2d;
    }
    {
        obs_builder *b = CASE("observation/state", "is a string");
        obs_drop(b, "observation/state");
        obs_string(b, "observation/state", "1 2 3");
    }
    obs_drop(CASE("prompt", "missing key"), "prompt");
    {
        obs_builder *b = CASE("prompt", "expected the instruction string");
        obs_drop(b, "prompt");
        obs_array(b, "prompt", PI0_DTYPE_U8, 1, (int64_t[]){100}, flat);
    }
    {
        pi0_field *f = obs_get(CASE("observation/image", "expected an image"), "observation/image");
        f->ndim = 1, f->shape[0] = 100, f->data = flat;
    }
    CASE(NULL, NULL); /* good, last */
#undef CASE
    const pi0_observation *list[MAX_CASES + 1];
    uint64_t seeds[MAX_CASES + 1];
    for (int i = 0; i < n; i++) list[i] = &o[i].b.obs, seeds[i] = 100 + i;
    list[n] = NULL, seeds[n] = 0; /* a NULL observation fails alone too */
    pi0_policy_result r[MAX_CASES + 1];
    REQUIRE(pi0_policy_infer(pol, list, seeds, n + 1, r, NULL, &err) == PI0_OK, "%s", err.message);
    /* the good ones, run without the bad ones: the same batch, so the same bits */
    const pi0_observation *good[MAX_CASES];
    uint64_t good_seeds[MAX_CASES];
    pi0_policy_result good_r[MAX_CASES];
    int num_good = 0;
    for (int i = 0; i < n; i++)
        if (!expect[i][0]) good[num_good] = list[i], good_seeds[num_good++] = seeds[i];
    REQUIRE(num_good == 3 && pi0_policy_infer(pol, good, good_seeds, num_good, good_r, NULL, &err) == PI0_OK);
    for (int i = 0, g = 0; i < n; i++) {
        if (!expect[i][0]) {
            CHECK(same_result(&r[i], &good_r[g]), "good observation %d differs without the bad ones", i);
            pi0_policy_result_free(&good_r[g++]);
        } else {
            CHECK(r[i].error.status == PI0_ERR_INVALID_ARGUMENT && r[i].actions == NULL &&
                      strstr(r[i].error.message, expect[i][0]) && strstr(r[i].error.message, expect[i][1]),
                  "case %d: %s (expected %s / %s)", i, r[i].error.message, expect[i][0], expect[i][1]);
        }
        fprintf(stderr, "  %2d: %s\n", i, r[i].error.status ? r[i].error.message : "ok");
    }
    CHECK(r[n].error.status == PI0_ERR_INVALID_ARGUMENT && strstr(r[n].error.message, "NULL"));
    for (int i = 0; i <= n; i++) pi0_policy_result_free(&r[i]);
    /* all bad: OK overall, every result an error */
    REQUIRE(pi0_policy_infer(pol, list + 1, seeds + 1, 2, r, NULL, &err) == PI0_OK);
    CHECK(r[0].error.status && r[1].error.status && !r[0].actions && !r[1].actions);
    for (int i = 0; i < n; i++) libero_free(&o[i]);
    free(huge);
    pi0_policy_free(pol);
}

/* The policy over the libero adapter with the given norm stats (a pi0_tiny-sized Pi0). */
static pi0_policy *policy_with_stats(const char *stats_json, pi0_error *err) {
    parts q;
    pi0_adapter *a = NULL;
    pi0_policy *pol = NULL;
    if (parts_open(&q, PI0_MODEL_PI0, 2000)) return NULL;
    const char *path = test_path("custom_norm_stats.json");
    write_text(path, stats_json);
    pi0_norm_stats_free(&q.stats);
    if (pi0_norm_stats_load(path, &q.stats, err) || pi0_adapter_open("libero", &a, err)) {
        parts_close(&q);
        return NULL;
    }
    pi0_policy_options opts = {.num_steps = STEPS};
    pi0_policy_create(q.model, a, q.tok, &q.stats, &opts, &pol, err);
    return pol;
}

/* A robot never receives NaN or infinity: actions that are not all finite fail their observation with
 * PI0_ERR_NUMERIC, whether the model computed them (a NaN weight) or unnormalizing overflowed (finite stats). */
TEST(nonfinite_actions_fail) {
    pi0_error err = {0};
    libero_obs o[2];
    libero_make(&o[0], 1, "pick it up");
    libero_make(&o[1], 2, "put it down");
    const pi0_observation *list[2] = {&o[0].b.obs, &o[1].b.obs};
    pi0_policy_result r[2];

    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    /* the CPU backend reads the host weights; the Euler steps spread the NaN to every dim */
    ((pi0_model *)pi0_policy_model(pol))->weights.action_out_b[2] = NAN;
    REQUIRE(pi0_policy_infer(pol, list, NULL, 2, r, NULL, &err) == PI0_OK, "%s", err.message);
    for (int i = 0; i < 2; i++) {
        CHECK(r[i].error.status == PI0_ERR_NUMERIC && !r[i].actions &&
                  strstr(r[i].error.message, "action step 0, dim 0 is nan (the model gave nan"),
              "%d: %s", i, r[i].error.message);
        pi0_policy_result_free(&r[i]);
    }
    pi0_policy_free(pol);

    /* x * (std + 1e-6) + mean overflows float64 for any action x above 0.06 */
    char stats[2048];
    snprintf(stats, sizeof stats, "{\"norm_stats\": {\"state\": {\"mean\": [0, 0, 0, 0, 0, 0, 0, 0], \"std\": [1, 1, 1, 1, "
             "1, 1, 1, 1]}, \"actions\": {\"mean\": [%s], \"std\": [%s]}}}",
             "1.7e308, 1.7e308, 1.7e308, 1.7e308, 1.7e308, 1.7e308, 1.7e308",
             "1.7e308, 1.7e308, 1.7e308, 1.7e308, 1.7e308, 1.7e308, 1.7e308");
    pol = policy_with_stats(stats, &err);
    REQUIRE(pol, "%s", err.message);
    REQUIRE(pi0_policy_infer(pol, list, NULL, 1, r, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(r[0].error.status == PI0_ERR_NUMERIC && !r[0].actions && strstr(r[0].error.message, "is inf (the model gave"),
          "%s", r[0].error.message);
    pi0_policy_result_free(&r[0]);
    pi0_policy_free(pol);
    libero_free(&o[0]), libero_free(&o[1]);
}

/* Token ids beyond the model's vocabulary fail that observation, naming the id and the vocabulary. */
TEST(token_ids_outside_vocabulary) {
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI0, 512, PI0_NORM_ZSCORE, &err); /* the tokenizer has 2000 pieces */
    REQUIRE(pol, "%s", err.message);
    libero_obs o;
    libero_make(&o, 30, "zebra quantum xylophone");
    pi0_policy_result r;
    CHECK(infer1(pol, &o.b.obs, 1, &r) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(strstr(r.error.message, "vocabulary of 512") && strstr(r.error.message, "2000 pieces"), "%s", r.error.message);
    libero_free(&o);
    pi0_policy_free(pol);
}

/* Generic adapters: absent cameras, several state keys, default prompts, prompts not read at all. */
TEST(generic_adapter_runs) {
    parts ref;
    REQUIRE(parts_open(&ref, PI0_MODEL_PI0, 2000) == 0);
    const char *path = test_path("arm.json");
    write_text(path, "{\"cameras\": [null, \"cam/wrist\", \"cam/top\"], \"state\": [\"arm\", \"hand\"],\n"
                     " \"prompt\": \"task\", \"default_prompt\": \"wipe the table\", \"action_dims\": 5}");
    pi0_error err = {0};
    pi0_policy *pol = make_policy(path, PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err);
    REQUIRE(pol, "%s", err.message);
    uint8_t *top = make_image(30, 40, 40), *wrist = make_image(224, 100, 41);
    static const float arm[6] = {0.1f, 0.2f, 0.7f, 3.5f, 0.0f, 0.05f};
    static const uint8_t hand[2] = {1, 0};
    obs_builder b;
    obs_init(&b);
    obs_array(&b, "cam/top", PI0_DTYPE_U8, 3, (int64_t[]){30, 40, 3}, top);
    obs_array(&b, "cam/wrist", PI0_DTYPE_U8, 3, (int64_t[]){224, 100, 3}, wrist);
    obs_array(&b, "arm", PI0_DTYPE_F32, 1, (int64_t[]){6}, arm);
    obs_array(&b, "hand", PI0_DTYPE_BOOL, 1, (int64_t[]){2}, hand);
    pi0_image w = {wrist, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 224, 100, 3}, t = {top, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 30, 40, 3};
    const pi0_image *imgs[3] = {NULL, &w, &t};
    float state[8] = {0.1f, 0.2f, 0.7f, 3.5f, 0.0f, 0.05f, 1.0f, 0.0f};
    double want[10 * 5];
    REQUIRE(reference(&ref, imgs, state, 8, "wipe the table", 4, PI0_NORM_ZSCORE, 5, want) == 0);
    pi0_policy_result r;
    REQUIRE(infer1(pol, &b.obs, 4, &r) == PI0_OK);
    CHECK(result_matches(&r, want, 10, 5), "default prompt");
    pi0_policy_result_free(&r);
    obs_string(&b, "task", "wipe_the table\n"); /* the same after openpi's cleanup */
    REQUIRE(infer1(pol, &b.obs, 4, &r) == PI0_OK);
    CHECK(result_matches(&r, want, 10, 5), "prompt from the observation");
    pi0_policy_result_free(&r);
    pi0_policy_free(pol);

    /* "prompt": null: the observation's "prompt" is ignored */
    write_text(path, "{\"cameras\": [null, \"cam/wrist\", \"cam/top\"], \"state\": [\"arm\", \"hand\"],\n"
                     " \"prompt\": null, \"default_prompt\": \"wipe the table\", \"action_dims\": 5}");
    REQUIRE((pol = make_policy(path, PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err)), "%s", err.message);
    obs_drop(&b, "task");
    obs_string(&b, "prompt", "something else entirely");
    REQUIRE(infer1(pol, &b.obs, 4, &r) == PI0_OK);
    CHECK(result_matches(&r, want, 10, 5), "prompt: null");
    pi0_policy_result_free(&r);
    pi0_policy_free(pol);

    /* an optional camera left out is zeros with its mask false, alone and next to one that has it */
    write_text(path, "{\"cameras\": [null, \"cam/wrist\", \"cam/top\"], \"optional_cameras\": [\"cam/wrist\"],\n"
                     " \"state\": [\"arm\", \"hand\"], \"prompt\": null, \"default_prompt\": \"wipe the table\", "
                     "\"action_dims\": 5}");
    REQUIRE((pol = make_policy(path, PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err)), "%s", err.message);
    obs_builder no_wrist;
    obs_init(&no_wrist);
    obs_array(&no_wrist, "cam/top", PI0_DTYPE_U8, 3, (int64_t[]){30, 40, 3}, top);
    obs_array(&no_wrist, "arm", PI0_DTYPE_F32, 1, (int64_t[]){6}, arm);
    obs_array(&no_wrist, "hand", PI0_DTYPE_BOOL, 1, (int64_t[]){2}, hand);
    const pi0_image *top_only[3] = {NULL, NULL, &t};
    double want_top[10 * 5];
    REQUIRE(reference(&ref, top_only, state, 8, "wipe the table", 4, PI0_NORM_ZSCORE, 5, want_top) == 0);
    REQUIRE(infer1(pol, &no_wrist.obs, 4, &r) == PI0_OK);
    CHECK(result_matches(&r, want_top, 10, 5), "optional camera missing");
    pi0_policy_result_free(&r);
    const pi0_observation *mixed[2] = {&b.obs, &no_wrist.obs};
    pi0_policy_result two[2];
    REQUIRE(pi0_policy_infer(pol, mixed, (uint64_t[]){4, 4}, 2, two, NULL, &err) == PI0_OK, "%s", err.message);
    double worst[2] = {0, 0};
    const double *wants[2] = {want, want_top};
    for (int i = 0; i < 2; i++)
        for (int k = 0; two[i].actions && k < 10 * 5; k++) {
            double dk = fabs(two[i].actions[k] - wants[i][k]) / (fabs(wants[i][k]) + 1e-3);
            if (dk > worst[i]) worst[i] = dk;
        }
    CHECK(two[0].actions && two[1].actions && worst[0] < 1e-4 && worst[1] < 1e-4,
          "with and without the optional camera in one batch: %.3g %.3g", worst[0], worst[1]);
    pi0_policy_result_free(&two[0]), pi0_policy_result_free(&two[1]);
    obs_drop(&no_wrist, "cam/top"); /* a required camera is still required */
    CHECK(infer1(pol, &no_wrist.obs, 4, &r) != PI0_OK && strstr(r.error.message, "cam/top"), "%s", r.error.message);
    pi0_policy_result_free(&r);
    pi0_policy_free(pol);

    /* an adapter asking for more action dims than the model has fails at creation */
    write_text(path, "{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 33}");
    CHECK(make_policy(path, PI0_MODEL_PI0, 2000, PI0_NORM_ZSCORE, &err) == NULL && strstr(err.message, "33") &&
              strstr(err.message, "32"), "%s", err.message);
    free(top), free(wrist);
    parts_close(&ref);
}

/* ---- Pi0.5 --------------------------------------------------------------------------------------------- */

/* A DROID observation with float32-exact values (so that the reference's float32 view of the state is exact). */
typedef struct {
    obs_builder b;
    uint8_t *ext, *wrist;
    pi0_image ext_img, wrist_img;
} droid_obs;

static const float DROID_STATE[8] = {0.0f, -0.0625f, 0.8125f, 3.25f, -0.125f, 0.375f, 0.015625f, -0.0078125f};

static void droid_make(droid_obs *o, uint32_t seed, const char *prompt) {
    static double joints[7], gripper;
    for (int i = 0; i < 7; i++) joints[i] = DROID_STATE[i];
    gripper = DROID_STATE[7];
    obs_init(&o->b);
    o->ext = make_image(180, 320, seed), o->wrist = make_image(224, 224, seed + 1);
    obs_array(&o->b, "observation/exterior_image_1_left", PI0_DTYPE_U8, 3, (int64_t[]){180, 320, 3}, o->ext);
    obs_array(&o->b, "observation/wrist_image_left", PI0_DTYPE_U8, 3, (int64_t[]){224, 224, 3}, o->wrist);
    obs_array(&o->b, "observation/joint_position", PI0_DTYPE_F64, 1, (int64_t[]){7}, joints);
    obs_array(&o->b, "observation/gripper_position", PI0_DTYPE_F64, 0, NULL, &gripper);
    obs_string(&o->b, "prompt", prompt);
    o->ext_img = (pi0_image){o->ext, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 180, 320, 3};
    o->wrist_img = (pi0_image){o->wrist, PI0_PIXEL_U8, PI0_LAYOUT_HWC, 224, 224, 3};
}

/* openpi's pi05_droid: quantile normalization by default, the robot's 8 normalized state values binned into
 * the prompt, 8 action dims; bit for bit the reference assembled from the pieces. */
TEST(pi05_droid_discrete_state_matches_reference) {
    parts ref;
    REQUIRE(parts_open(&ref, PI0_MODEL_PI05, 2000) == 0);
    pi0_error err = {0};
    pi0_policy *pol = make_policy("droid", PI0_MODEL_PI05, 2000, PI0_NORM_DEFAULT, &err);
    REQUIRE(pol, "%s", err.message);
    CHECK(pi0_policy_norm_mode(pol) == PI0_NORM_QUANTILE && pi0_policy_discrete_state(pol) == 1);
    droid_obs o;
    droid_make(&o, 9, "put the marker in the cup");
    ref_sample s = {{&o.ext_img, &o.wrist_img, NULL}, DROID_STATE, 8, "put the marker in the cup", 5, 1};
    double want[10 * 8];
    REQUIRE(reference_batch(&ref, &s, 1, PI0_NORM_QUANTILE, 8, want) == 0);
    pi0_policy_result r;
    REQUIRE(infer1(pol, &o.b.obs, 5, &r) == PI0_OK);
    CHECK(result_matches(&r, want, 10, 8));
    pi0_policy_result_free(&r);
    /* without the state in the prompt the answer differs: the test would notice a policy that drops it */
    s.discrete_state = 0;
    REQUIRE(reference_batch(&ref, &s, 1, PI0_NORM_QUANTILE, 8, want) == 0);
    REQUIRE(infer1(pol, &o.b.obs, 5, &r) == PI0_OK);
    CHECK(!result_matches(&r, want, 10, 8), "the discrete state changed nothing");
    pi0_policy_result_free(&r);
    free(o.ext), free(o.wrist);
    pi0_policy_free(pol);
    parts_close(&ref);
}

/* openpi's pi05_libero: no discrete state (the Pi0 prompt format), quantile normalization. */
TEST(pi05_libero_prompt_without_state) {
    parts ref;
    REQUIRE(parts_open(&ref, PI0_MODEL_PI05, 2000) == 0);
    pi0_error err = {0};
    pi0_policy *pol = make_policy("libero", PI0_MODEL_PI05, 2000, PI0_NORM_DEFAULT, &err);
    REQUIRE(pol, "%s", err.message);
    CHECK(pi0_policy_norm_mode(pol) == PI0_NORM_QUANTILE && pi0_policy_discrete_state(pol) == 0);
    libero_obs o;
    libero_make(&o, 4, "open the top drawer");
    ref_sample s = {{&o.base_img, &o.wrist_img, NULL}, LIBERO_STATE, 8, "open the top drawer", 8, 0};
    double want[10 * 7];
    REQUIRE(reference_batch(&ref, &s, 1, PI0_NORM_QUANTILE, 7, want) == 0);
    pi0_policy_result r;
    REQUIRE(infer1(pol, &o.b.obs, 8, &r) == PI0_OK);
    CHECK(result_matches(&r, want, 10, 7));
    pi0_policy_result_free(&r);
    libero_free(&o);
    pi0_policy_free(pol);
    parts_close(&ref);
}

/* A generic adapter's discrete_state switch; asking it of a Pi0 checkpoint is refused. */
TEST(pi05_generic_discrete_state_switch) {
    const char *path = test_path("pi05_arm.json");
    write_text(path, "{\"cameras\": [\"observation/image\", \"observation/wrist_image\", null], "
                     "\"state\": [\"observation/state\"], \"action_dims\": 7, \"discrete_state\": true}");
    pi0_error err = {0};
    pi0_policy *pol = make_policy(path, PI0_MODEL_PI05, 2000, PI0_NORM_DEFAULT, &err);
    REQUIRE(pol, "%s", err.message);
    CHECK(pi0_policy_discrete_state(pol) == 1);
    pi0_policy_free(pol);
    CHECK(make_policy(path, PI0_MODEL_PI0, 2000, PI0_NORM_DEFAULT, &err) == NULL &&
              strstr(err.message, "discrete state") && strstr(err.message, "Pi0"), "%s", err.message);
    write_text(path, "{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 7, \"discrete_state\": 1}");
    pi0_adapter *a = NULL;
    CHECK(pi0_adapter_open(path, &a, &err) == PI0_ERR_FORMAT && strstr(err.message, "discrete_state"), "%s", err.message);
    write_text(path, "{\"cameras\": [\"c\"], \"state\": [\"s\"], \"action_dims\": 7, \"horizon\": 0}");
    CHECK(pi0_adapter_open(path, &a, &err) == PI0_ERR_FORMAT && strstr(err.message, "horizon"), "%s", err.message);
}

/* pi0_policy_open on Pi0.5 checkpoints: norm stats without quantiles are refused at open, naming what is
 * missing; the horizon falls back to the adapter's (pi05_droid: 15) when config.json gives none. */
TEST(pi05_open_checks_quantiles_and_horizon) {
    pi0_model *m = tiny_model(PI0_MODEL_PI05, 2000);
    REQUIRE(m);
    const char *dir = test_path("pi05_ckpt");
    pi0_error err = {0};
    REQUIRE(pi0_model_save(m, dir, 0, &err) == PI0_OK, "%s", err.message);
    pi0_model_free(m);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir); /* no action_horizon */
    write_text(path, "{\"action_dim\": 32, \"max_token_len\": 64, \"dims\": {\"vision\": {\"num_heads\": 4}, "
                     "\"llm\": {\"head_dim\": 32}, \"expert\": {\"head_dim\": 32}}}");
    const char *no_quantiles = test_path("zscore_stats.json");
    write_text(no_quantiles, "{\"norm_stats\": {\"state\": {\"mean\": [0,0,0,0,0,0,0,0], \"std\": [1,1,1,1,1,1,1,1]}, "
                             "\"actions\": {\"mean\": [0,0,0,0,0,0,0,0], \"std\": [1,1,1,1,1,1,1,1]}}}");
    pi0_policy_options opts = {.checkpoint = dir, .adapter = "droid", .tokenizer = tokenizer_path(),
                               .norm_stats = no_quantiles, .model = {.backend = PI0_BACKEND_CPU}};
    pi0_policy *pol = NULL;
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_FORMAT && strstr(err.message, "q01") &&
              strstr(err.message, "Pi0.5") && strstr(err.message, "zscore_stats.json"), "%s", err.message);
    opts.norm_mode = PI0_NORM_ZSCORE; /* asked for explicitly, z-score works */
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_policy_horizon(pol) == 15 && pi0_policy_action_dims(pol) == 8, "horizon %d", pi0_policy_horizon(pol));
    pi0_policy_free(pol);
    opts.adapter = "libero";
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_policy_horizon(pol) == 10, "libero horizon %d", pi0_policy_horizon(pol));
    pi0_policy_free(pol);
    opts.horizon = 4; /* the caller's wins */
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_policy_horizon(pol) == 4);
    pi0_policy_free(pol);
}

TEST(create_rejects_bad_parts) {
    pi0_error err = {0};
    parts q;
    REQUIRE(parts_open(&q, PI0_MODEL_PI0, 2000) == 0);
    pi0_adapter *a = NULL;
    REQUIRE(pi0_adapter_open("libero", &a, &err) == PI0_OK);
    pi0_policy *pol = (pi0_policy *)1;
    /* stats without "actions": the parts are freed even on failure (ASan would see a leak otherwise) */
    const char *path = test_path("state_only.json");
    write_text(path, "{\"norm_stats\": {\"state\": {\"mean\": [0], \"std\": [1]}}}");
    pi0_norm_stats_free(&q.stats);
    REQUIRE(pi0_norm_stats_load(path, &q.stats, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_policy_create(q.model, a, q.tok, &q.stats, NULL, &pol, &err) == PI0_ERR_FORMAT && pol == NULL &&
              strstr(err.message, "\"actions\""), "%s", err.message);
    CHECK(q.stats.entries == NULL, "the stats were not taken");
    /* quantile mode without q01/q99 */
    REQUIRE(parts_open(&q, PI0_MODEL_PI0, 2000) == 0);
    REQUIRE(pi0_adapter_open("libero", &a, &err) == PI0_OK);
    write_text(path, "{\"norm_stats\": {\"state\": {\"mean\": [0], \"std\": [1]}, \"actions\": {\"mean\": [0], \"std\": [1]}}}");
    pi0_norm_stats_free(&q.stats);
    REQUIRE(pi0_norm_stats_load(path, &q.stats, &err) == PI0_OK, "%s", err.message);
    pi0_policy_options opts = {.norm_mode = PI0_NORM_QUANTILE};
    CHECK(pi0_policy_create(q.model, a, q.tok, &q.stats, &opts, &pol, &err) == PI0_ERR_FORMAT &&
              strstr(err.message, "q01"), "%s", err.message);
    /* NULL parts */
    REQUIRE(parts_open(&q, PI0_MODEL_PI0, 2000) == 0);
    CHECK(pi0_policy_create(q.model, NULL, q.tok, &q.stats, NULL, &pol, &err) == PI0_ERR_INVALID_ARGUMENT);
}

/* ---- pi0_policy_open: where the files come from ------------------------------------------------------------ */

static void mkdirs(const char *path) {
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1; *p; p++)
        if (*p == '/') *p = 0, mkdir(buf, 0755), *p = '/';
    mkdir(buf, 0755);
}

TEST(open_finds_its_files) {
    unsetenv("OPENPI_DATA_HOME");
    char home[512], ckpt[512], path[1024], path2[1024], stats[1024];
    snprintf(home, sizeof home, "%s", test_path("home"));
    snprintf(ckpt, sizeof ckpt, "%s", test_path("ckpt"));
    mkdirs(home);
    setenv("HOME", home, 1);
    pi0_model *m = tiny_model(PI0_MODEL_PI0, 2000);
    pi0_error err = {0};
    REQUIRE(m && pi0_model_save(m, ckpt, 0, &err) == PI0_OK, "%s", err.message);
    pi0_model_free(m);
    pi0_policy_options opts = {.checkpoint = ckpt, .adapter = "libero", .num_steps = STEPS,
                               .model = {.backend = PI0_BACKEND_CPU}};
    pi0_policy *pol = NULL;

    /* no tokenizer anywhere: the error lists both places */
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_IO && pol == NULL && strstr(err.message, ckpt) &&
              strstr(err.message, "/.cache/openpi/big_vision/paligemma_tokenizer.model") &&
              strstr(err.message, "--tokenizer"), "%s", err.message);
    /* the download cache is the fallback */
    snprintf(path, sizeof path, "%s/.cache/openpi/big_vision", home);
    mkdirs(path);
    snprintf(path, sizeof path, "%s/.cache/openpi/big_vision/paligemma_tokenizer.model", home);
    copy_file(tokenizer_path(), path);
    /* no norm stats */
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_IO && strstr(err.message, "norm_stats.json") &&
              strstr(err.message, "--norm-stats"), "%s", err.message);
    /* one, under an asset id with a '/' */
    snprintf(path, sizeof path, "%s/assets/physical-intelligence/libero", ckpt);
    mkdirs(path);
    snprintf(stats, sizeof stats, "%s/assets/physical-intelligence/libero/norm_stats.json", ckpt);
    write_text(stats, STATS_JSON);
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    libero_obs o;
    libero_make(&o, 50, "pick up the bowl");
    pi0_policy_result from_cache, r;
    REQUIRE(infer1(pol, &o.b.obs, 1, &from_cache) == PI0_OK);
    pi0_policy_free(pol);
    /* the checkpoint's own tokenizer comes first: a broken one there is an error, not skipped */
    snprintf(path, sizeof path, "%s/paligemma_tokenizer.model", ckpt);
    write_text(path, "not a sentencepiece model");
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_FORMAT && strstr(err.message, path), "%s", err.message);
    copy_file(tokenizer_path(), path);
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    REQUIRE(infer1(pol, &o.b.obs, 1, &r) == PI0_OK);
    CHECK(same_result(&from_cache, &r), "tokenizer from the checkpoint vs the cache");
    pi0_policy_result_free(&r);
    pi0_policy_free(pol);
    /* two norm stats: ask which */
    snprintf(path2, sizeof path2, "%s/assets/other", ckpt);
    mkdirs(path2);
    snprintf(path2, sizeof path2, "%s/assets/other/norm_stats.json", ckpt);
    write_text(path2, STATS_JSON);
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_INVALID_ARGUMENT && strstr(err.message, "2 norm_stats.json") &&
              strstr(err.message, "other/norm_stats.json") &&
              strstr(err.message, "physical-intelligence/libero/norm_stats.json") && strstr(err.message, "--norm-stats"),
          "%s", err.message);
    opts.norm_stats = stats;
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    REQUIRE(infer1(pol, &o.b.obs, 1, &r) == PI0_OK);
    CHECK(same_result(&from_cache, &r));
    pi0_policy_result_free(&r);
    pi0_policy_free(pol);
    /* explicit files that are wrong, each named */
    write_text(path2, "{\"norm_stats\": {\"state\": {\"mean\": [0], \"std\": [1]}}}");
    opts.norm_stats = path2;
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_FORMAT && strstr(err.message, path2) &&
              strstr(err.message, "actions"), "%s", err.message);
    opts.norm_stats = "/nonexistent/norm_stats.json";
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_IO && strstr(err.message, "/nonexistent/norm_stats.json"),
          "%s", err.message);
    opts.norm_stats = stats;
    opts.tokenizer = "/nonexistent/tok.model";
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_IO && strstr(err.message, "/nonexistent/tok.model"), "%s",
          err.message);
    opts.tokenizer = NULL;
    opts.adapter = "/nonexistent/adapter.json";
    CHECK(pi0_policy_open(&opts, &pol, &err) == PI0_ERR_IO && strstr(err.message, "/nonexistent/adapter.json"), "%s",
          err.message);
    opts.adapter = "libero";
    opts.checkpoint = home; /* no model there */
    CHECK(pi0_policy_open(&opts, &pol, &err) != PI0_OK && pol == NULL, "a directory without a model");
    CHECK(pi0_policy_open(NULL, &pol, &err) == PI0_ERR_INVALID_ARGUMENT);
    pi0_policy_result_free(&from_cache);
    libero_free(&o);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(adapters_builtin);
    RUN(adapter_generic_valid);
    RUN(adapter_generic_invalid);
    RUN(libero_matches_reference);
    RUN(droid_matches_reference);
    RUN(quantile_mode_matches_reference);
    RUN(layouts_and_dtypes_are_equivalent);
    RUN(batch_equals_alone);
    RUN(prepare_on_threads_then_infer);
    RUN(prepared_blocks_are_reused);
    RUN(bad_observations_fail_alone);
    RUN(nonfinite_actions_fail);
    RUN(token_ids_outside_vocabulary);
    RUN(generic_adapter_runs);
    RUN(pi05_droid_discrete_state_matches_reference);
    RUN(pi05_libero_prompt_without_state);
    RUN(pi05_generic_discrete_state_switch);
    RUN(pi05_open_checks_quantiles_and_horizon);
    RUN(create_rejects_bad_parts);
    RUN(open_finds_its_files);
    return check_finish();
}
