/*
 * test_model.c - the CPU backend against openpi's golden fixtures (Pi0 and Pi0.5), and the model-level
 * API: actions at 1, 3 and 10 steps, vision tokens, K/V cache rows, bf16 checkpoints, checkpoint mapping
 * errors and names (LeRobot's), the model kind, ragged batches and the full-size random model.
 */
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "cpu/cpu.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "model/image.h"
#include "model/model.h"
#include "pi0.h"
#include "util/finite.h"

#define TOL_F32 1e-4

static const char *cameras[3] = {"base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"};

/* A fixture case: its model, its io.safetensors and the batch built from it. */
typedef struct {
    pi0_model *model;
    st_file io;
    float *images[3], *state, *noise;
    uint8_t masks[64 * 3], *prompt_mask;
    int32_t *prompt_ids;
    const float *image_ptrs[3];
    pi0_batch batch;
} fixture;

static float *f32_copy(const st_tensor *t) {
    float *out = malloc(t->numel * sizeof(float));
    st_to_f32(t, out);
    return out;
}

static void fixture_close(fixture *f) {
    for (int c = 0; c < 3; c++) free(f->images[c]);
    free(f->state), free(f->noise), free(f->prompt_ids), free(f->prompt_mask);
    st_close(&f->io);
    pi0_model_free(f->model);
    memset(f, 0, sizeof *f);
}

/* Loads fixtures/<name> (model from `model_dir` when given) and builds the batch of its io file. */
static int fixture_open(fixture *f, const char *name, const char *model_dir) {
    char path[1024];
    pi0_error err = {0};
    memset(f, 0, sizeof *f);
    snprintf(path, sizeof path, "%s/%s", fixtures_dir(), name);
    pi0_options opts = {.backend = PI0_BACKEND_CPU};
    if (pi0_model_load(model_dir ? model_dir : path, &opts, &f->model, &err)) {
        fprintf(stderr, "  load %s: %s\n", path, err.message);
        return -1;
    }
    snprintf(path, sizeof path, "%s/%s/io.safetensors", fixtures_dir(), name);
    if (st_open(path, &f->io, &err)) {
        fprintf(stderr, "  %s\n", err.message);
        return -1;
    }
    const st_tensor *state = st_find(&f->io, "state"), *ids = st_find(&f->io, "tokenized_prompt");
    const st_tensor *ids_mask = st_find(&f->io, "tokenized_prompt_mask"), *noise = st_find(&f->io, "noise");
    int B = (int)state->shape[0];
    for (int c = 0; c < 3; c++) {
        char key[64];
        snprintf(key, sizeof key, "image/%s", cameras[c]);
        f->image_ptrs[c] = f->images[c] = f32_copy(st_find(&f->io, key));
        snprintf(key, sizeof key, "image_mask/%s", cameras[c]);
        const uint8_t *mask = st_find(&f->io, key)->data;
        for (int b = 0; b < B; b++) f->masks[b * 3 + c] = mask[b];
    }
    f->state = f32_copy(state);
    f->noise = f32_copy(noise);
    f->prompt_ids = malloc(ids->nbytes);
    memcpy(f->prompt_ids, ids->data, ids->nbytes);
    f->prompt_mask = malloc(ids_mask->nbytes);
    memcpy(f->prompt_mask, ids_mask->data, ids_mask->nbytes);
    f->batch = (pi0_batch){.batch = B, .num_cameras = 3, .images = f->image_ptrs, .image_masks = f->masks,
                           .prompt_len = (int)ids->shape[1], .prompt_ids = f->prompt_ids, .prompt_mask = f->prompt_mask,
                           .state = f->state, .horizon = (int)noise->shape[1], .noise = f->noise};
    return 0;
}

static size_t actions_len(const fixture *f) {
    return (size_t)f->batch.batch * f->batch.horizon * pi0_model_dims(f->model)->action_dim;
}

/* Runs the fixture at `steps` and returns the relative error against io[key]. */
static double actions_error(fixture *f, int steps, const char *key) {
    size_t n = actions_len(f);
    float *actions = malloc(n * sizeof(float));
    pi0_error err = {0};
    f->batch.num_steps = steps;
    double e = INFINITY;
    if (pi0_sample_actions(f->model, &f->batch, actions, NULL, &err) == PI0_OK) {
        float *ref = f32_copy(st_find(&f->io, key));
        e = rel_error(actions, ref, n);
        free(ref);
    } else {
        fprintf(stderr, "  sample_actions: %s\n", err.message);
    }
    free(actions);
    return e;
}

static void check_fixture_actions(const char *name) {
    fixture f;
    REQUIRE(fixture_open(&f, name, NULL) == 0);
    const struct { int steps; const char *key; } cases[] = {{10, "actions"}, {3, "actions_3step"}, {1, "actions_1step"}};
    for (int i = 0; i < 3; i++) {
        double e = actions_error(&f, cases[i].steps, cases[i].key);
        fprintf(stderr, "  %s %s: rel error %.3g\n", name, cases[i].key, e);
        CHECK(e <= TOL_F32, "%s %s: rel error %.3g > %g", name, cases[i].key, e, TOL_F32);
    }
    fixture_close(&f);
}

TEST(fixture_pi0_tiny_actions) { check_fixture_actions("pi0_tiny"); }
TEST(fixture_pi0_tiny_h50_actions) { check_fixture_actions("pi0_tiny_h50"); }
TEST(fixture_pi05_tiny_actions) { check_fixture_actions("pi05_tiny"); }
TEST(fixture_pi05_tiny_h50_actions) { check_fixture_actions("pi05_tiny_h50"); }

/* Vision tokens of valid cameras and K/V cache rows of valid prefix tokens against the fixture. */
static void check_fixture_intermediates(const char *name) {
    fixture f;
    REQUIRE(fixture_open(&f, name, NULL) == 0);
    const pi0_dims *d = pi0_model_dims(f.model);
    pi0_plan plan;
    pi0_error err = {0};
    f.batch.num_steps = 1;
    REQUIRE(plan_build(d, &f.batch, &plan, &err) == PI0_OK, "%s", err.message);
    int P = (d->image_size / d->patch_size) * (d->image_size / d->patch_size), D = d->llm.width, L = d->llm.depth;
    int kv = d->llm.num_kv_heads * d->llm.head_dim;
    float *vision = malloc((size_t)plan.num_images * P * D * sizeof(float));
    float *kbuf[16], *vbuf[16];
    for (int l = 0; l < L; l++) {
        kbuf[l] = malloc((size_t)plan.cache_rows * kv * sizeof(float));
        vbuf[l] = malloc((size_t)plan.cache_rows * kv * sizeof(float));
    }
    cpu_trace trace = {vision, kbuf, vbuf};
    float *actions = malloc(actions_len(&f) * sizeof(float));
    REQUIRE(cpu_sample_traced(f.model, &plan, actions, NULL, &trace, &err) == PI0_OK, "%s", err.message);

    /* vision tokens: plan order is sample-major, camera order, valid cameras only */
    int image = 0;
    for (int b = 0; b < f.batch.batch; b++)
        for (int c = 0; c < 3; c++) {
            if (!f.masks[b * 3 + c]) continue;
            char key[64];
            snprintf(key, sizeof key, "vision_tokens/%s", cameras[c]);
            float *ref = f32_copy(st_find(&f.io, key));
            double e = rel_error(vision + (size_t)image++ * P * D, ref + (size_t)b * P * D, (size_t)P * D);
            CHECK(e <= TOL_F32, "vision tokens sample %d camera %s: %.3g", b, cameras[c], e);
            free(ref);
        }

    /* K/V rows: the fixture is padded (L, B, Ppad, 1, hd); valid rows in order are our cache rows */
    const st_tensor *kt = st_find(&f.io, "kv_k"), *vt = st_find(&f.io, "kv_v"), *mt = st_find(&f.io, "prefix_mask");
    float *kref = f32_copy(kt), *vref = f32_copy(vt);
    const uint8_t *prefix_mask = mt->data;
    int Ppad = (int)kt->shape[2], B = f.batch.batch;
    for (int l = 0; l < L; l++) {
        size_t valid = 0;
        float *kmine = malloc((size_t)plan.total_prefix * kv * sizeof(float)), *kgold = malloc((size_t)plan.total_prefix * kv * sizeof(float));
        float *vmine = malloc((size_t)plan.total_prefix * kv * sizeof(float)), *vgold = malloc((size_t)plan.total_prefix * kv * sizeof(float));
        for (int b = 0; b < B; b++) {
            int row = 0;
            for (int p = 0; p < Ppad; p++) {
                if (!prefix_mask[(size_t)b * Ppad + p]) continue;
                size_t gold = (((size_t)l * B + b) * Ppad + p) * kv, mine = (size_t)(plan.cache_start[b] + row++) * kv;
                memcpy(kgold + valid * kv, kref + gold, kv * sizeof(float));
                memcpy(vgold + valid * kv, vref + gold, kv * sizeof(float));
                memcpy(kmine + valid * kv, kbuf[l] + mine, kv * sizeof(float));
                memcpy(vmine + valid * kv, vbuf[l] + mine, kv * sizeof(float));
                valid++;
            }
            CHECK(row == plan.prefix_len[b], "sample %d: %d valid prefix tokens in the fixture, %d planned", b, row,
                  plan.prefix_len[b]);
        }
        double ek = rel_error(kmine, kgold, valid * kv), ev = rel_error(vmine, vgold, valid * kv);
        CHECK(ek <= TOL_F32 && ev <= TOL_F32, "layer %d: K error %.3g, V error %.3g", l, ek, ev);
        free(kmine), free(kgold), free(vmine), free(vgold);
    }
    free(kref), free(vref), free(actions), free(vision);
    for (int l = 0; l < L; l++) free(kbuf[l]), free(vbuf[l]);
    plan_free(&plan);
    fixture_close(&f);
}

TEST(fixture_pi0_tiny_intermediates) { check_fixture_intermediates("pi0_tiny"); }
TEST(fixture_pi0_tiny_h50_intermediates) { check_fixture_intermediates("pi0_tiny_h50"); }
TEST(fixture_pi05_tiny_intermediates) { check_fixture_intermediates("pi05_tiny"); }
TEST(fixture_pi05_tiny_h50_intermediates) { check_fixture_intermediates("pi05_tiny_h50"); }

static uint32_t bits_of(float x) {
    uint32_t b;
    memcpy(&b, &x, 4);
    return b;
}

/* Re-stored as BF16, the fixture model must give exactly the F32 run on weights rounded to bf16. */
TEST(bf16_checkpoint_equals_rounded_f32) {
    fixture f32, bf16;
    REQUIRE(fixture_open(&f32, "pi0_tiny", NULL) == 0);
    char dir[512];
    snprintf(dir, sizeof dir, "%s", test_path("bf16"));
    pi0_error err = {0};
    REQUIRE(pi0_model_save(f32.model, dir, 1, &err) == PI0_OK, "%s", err.message);
    REQUIRE(fixture_open(&bf16, "pi0_tiny", dir) == 0);
    /* round the F32 model's weights to bf16 in place (nearest even), as the file stores them */
    pi0_model *m = f32.model;
    int rounded_changed = 0;
    for (int i = 0; i < m->num_specs; i++) {
        float *x = *m->specs[i].slot;
        for (uint64_t j = 0; j < m->specs[i].numel; j++) {
            uint32_t b = bits_of(x[j]);
            b = (b + 0x7fff + ((b >> 16) & 1)) & 0xffff0000u;
            float r;
            memcpy(&r, &b, 4);
            rounded_changed |= r != x[j];
            x[j] = r;
            CHECK(bits_of(x[j]) == bits_of((*bf16.model->specs[i].slot)[j]), "%s[%llu] differs from the bf16 file",
                  m->specs[i].name, (unsigned long long)j);
            if (check_test_failed) break;
        }
    }
    CHECK(rounded_changed, "rounding to bf16 changed nothing: the test would prove nothing");
    size_t n = actions_len(&f32);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    REQUIRE(pi0_sample_actions(f32.model, &f32.batch, a, NULL, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(bf16.model, &bf16.batch, b, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(memcmp(a, b, n * sizeof(float)) == 0, "bf16 checkpoint actions differ from rounded f32 (rel %.3g)", rel_error(b, a, n));
    /* and bf16 weights stay within the bf16 tolerance of the golden fp32 actions */
    float *ref = f32_copy(st_find(&f32.io, "actions"));
    double e = rel_error(b, ref, n);
    CHECK(e <= 1e-2, "bf16 weights vs fp32 golden: %.3g", e);
    free(ref), free(a), free(b);
    fixture_close(&f32);
    fixture_close(&bf16);
}

/* Copies a fixture checkpoint with one tensor renamed, reshaped, retyped, dropped or replaced by an empty one of
 * shape `empty` (rank 2: it may claim any size along the other axis); or with LeRobot's names: a "model." prefix
 * and the embedding stored only as PaliGemma's tied output head. */
typedef enum { EDIT_DROP, EDIT_RESHAPE, EDIT_RETYPE, EDIT_EMPTY, EDIT_PREFIX, EDIT_EXTRA, EDIT_LEROBOT } edit_kind;

#define EMBED "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
#define TIED_HEAD "paligemma_with_expert.paligemma.lm_head.weight"

static int write_edited_from(const char *fixture_name, const char *dir, edit_kind kind, const char *target,
                             const int64_t empty[2]) {
    char path[1024];
    pi0_error err = {0};
    st_file src;
    snprintf(path, sizeof path, "%s/%s/model.safetensors", fixtures_dir(), fixture_name);
    if (st_open(path, &src, &err)) return -1;
    mkdir(dir, 0755);
    st_writer w;
    st_writer_init(&w);
    char names[200][256];
    int32_t ints[64] = {0};
    for (int i = 0; i < src.num_tensors && i < 200; i++) {
        const st_tensor *t = &src.tensors[i];
        int64_t shape[ST_MAX_RANK];
        memcpy(shape, t->shape, sizeof shape);
        int lerobot = kind == EDIT_LEROBOT;
        snprintf(names[i], sizeof names[i], "%s%s", kind == EDIT_PREFIX || lerobot ? "model." : "",
                 lerobot && !strcmp(t->name, EMBED) ? TIED_HEAD : t->name);
        int is_target = target && !strcmp(t->name, target);
        if (is_target && kind == EDIT_DROP) continue;
        if (is_target && kind == EDIT_RESHAPE) {
            /* same bytes, other shape: swap the first two dims (or split a vector) */
            if (t->rank >= 2) shape[0] = t->shape[1], shape[1] = t->shape[0];
        }
        if (is_target && kind == EDIT_RETYPE) {
            st_writer_add(&w, names[i], ST_I32, 1, (int64_t[]){16}, ints, &err);
            continue;
        }
        if (is_target && kind == EDIT_EMPTY) {
            st_writer_add(&w, names[i], ST_U8, 2, empty, NULL, &err); /* bytes: the writer takes any claim */
            continue;
        }
        st_writer_add(&w, names[i], t->dtype, t->rank, shape, t->data, &err);
    }
    if (kind == EDIT_EXTRA) {
        st_writer_add(&w, "paligemma_with_expert.paligemma.lm_head.weight", ST_I32, 1, (int64_t[]){16}, ints, &err);
        st_writer_add(&w, "something_else.weight", ST_I32, 1, (int64_t[]){16}, ints, &err);
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    int rc = st_writer_write(&w, path, &err) ? -1 : 0;
    st_writer_free(&w);
    st_close(&src);
    /* config.json: copy the fixture's */
    char cfg_src[1024], cfg_dst[1024], buf[4096];
    snprintf(cfg_src, sizeof cfg_src, "%s/%s/config.json", fixtures_dir(), fixture_name);
    snprintf(cfg_dst, sizeof cfg_dst, "%s/config.json", dir);
    FILE *in = fopen(cfg_src, "rb"), *out = fopen(cfg_dst, "wb");
    size_t n = in ? fread(buf, 1, sizeof buf, in) : 0;
    if (out) fwrite(buf, 1, n, out);
    if (in) fclose(in);
    if (out) fclose(out);
    return rc;
}

static int write_edited(const char *dir, edit_kind kind, const char *target) {
    return write_edited_from("pi0_tiny", dir, kind, target, NULL);
}

static pi0_status load_dir(const char *dir, pi0_error *err) {
    pi0_model *m = NULL;
    pi0_options opts = {.backend = PI0_BACKEND_CPU};
    pi0_status st = pi0_model_load(dir, &opts, &m, err);
    pi0_model_free(m);
    return st;
}

#define Q_PROJ "paligemma_with_expert.gemma_expert.model.layers.1.self_attn.q_proj.weight"

TEST(checkpoint_missing_tensor_is_named) {
    const char *dir = test_path("missing");
    REQUIRE(write_edited(dir, EDIT_DROP, Q_PROJ) == 0);
    pi0_error err = {0};
    CHECK(load_dir(dir, &err) == PI0_ERR_CHECKPOINT);
    CHECK(strstr(err.message, "missing tensor") && strstr(err.message, Q_PROJ) && strstr(err.message, "[128, 48]"), "%s",
          err.message);
}

TEST(checkpoint_misshaped_tensor_names_both_shapes) {
    const char *dir = test_path("misshaped");
    REQUIRE(write_edited(dir, EDIT_RESHAPE, "action_out_proj.weight") == 0);
    pi0_error err = {0};
    CHECK(load_dir(dir, &err) == PI0_ERR_CHECKPOINT);
    CHECK(strstr(err.message, "action_out_proj.weight") && strstr(err.message, "[48, 32]") && strstr(err.message, "[32, 48]"),
          "%s", err.message);
}

TEST(checkpoint_wrong_dtype_is_named) {
    const char *dir = test_path("retyped");
    REQUIRE(write_edited(dir, EDIT_RETYPE, "state_proj.bias") == 0);
    pi0_error err = {0};
    CHECK(load_dir(dir, &err) == PI0_ERR_CHECKPOINT);
    CHECK(strstr(err.message, "state_proj.bias"), "%s", err.message);
}

/* LeRobot-style "model." prefix loads, extra lm_head and unknown tensors are ignored, same actions. */
TEST(checkpoint_prefix_and_extra_tensors) {
    const char *dir = test_path("prefixed");
    REQUIRE(write_edited(dir, EDIT_PREFIX, NULL) == 0);
    fixture f;
    REQUIRE(fixture_open(&f, "pi0_tiny", dir) == 0);
    double e = actions_error(&f, 10, "actions");
    CHECK(e <= TOL_F32, "prefixed checkpoint: %.3g", e);
    fixture_close(&f);
    dir = test_path("extra");
    REQUIRE(write_edited(dir, EDIT_EXTRA, NULL) == 0);
    pi0_error err = {0};
    CHECK(load_dir(dir, &err) == PI0_OK, "%s", err.message);
}

TEST(checkpoint_not_a_pi0_file) {
    pi0_error err = {0};
    CHECK(load_dir("/nonexistent/dir", &err) == PI0_ERR_IO, "%s", err.message);
    const char *dir = test_path("notpi0");
    mkdir(dir, 0755);
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    st_writer w;
    st_writer_init(&w);
    float x[4] = {1, 2, 3, 4};
    st_writer_add(&w, "some.weight", ST_F32, 1, (int64_t[]){4}, x, &err);
    REQUIRE(st_writer_write(&w, path, &err) == PI0_OK);
    st_writer_free(&w);
    CHECK(load_dir(dir, &err) == PI0_ERR_CHECKPOINT && strstr(err.message, "not a Pi0 or Pi0.5 checkpoint"), "%s",
          err.message);
}

TEST(checkpoint_bad_config_json) {
    const char *dir = test_path("badconfig");
    REQUIRE(write_edited(dir, EDIT_EXTRA, NULL) == 0);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *fp = fopen(path, "w");
    fputs("{\"action_dim\": 32, \"dims\": {\"vision\": {\"num_heads\": \"four\"}}}", fp);
    fclose(fp);
    pi0_error err = {0};
    CHECK(load_dir(dir, &err) == PI0_ERR_FORMAT && strstr(err.message, "num_heads"), "%s", err.message);
    fp = fopen(path, "w");
    fputs("{\"action_dim\": 32,", fp);
    fclose(fp);
    CHECK(load_dir(dir, &err) == PI0_ERR_FORMAT && strstr(err.message, "config.json"), "%s", err.message);
    fp = fopen(path, "w");
    fputs("{\"action_dim\": 16}", fp);
    fclose(fp);
    CHECK(load_dir(dir, &err) == PI0_ERR_CHECKPOINT && strstr(err.message, "action_dim"), "%s", err.message);
}

/* An empty tensor may claim any size: each dim read from a shape is bounded before any arithmetic (a position
 * embedding of 2^62 rows once made the image-size math overflow), and the message names the tensor and the limit. */
TEST(checkpoint_claimed_sizes_are_bounded) {
    static const struct {
        const char *target;
        int64_t shape[2];
        const char *message;
    } cases[] = {
        {"paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.position_embedding.weight",
         {(int64_t)1 << 62, 0}, "axis 0 has size 4611686018427387904, over the limit 16777216"},
        {"paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings.position_embedding.weight",
         {INT64_MAX, 0}, "axis 0 has size 9223372036854775807, over the limit 16777216"},
        {EMBED, {(int64_t)1 << 40, 0}, "axis 0 has size 1099511627776, over the limit 16777216"},
        {"paligemma_with_expert.gemma_expert.model.layers.0.mlp.gate_proj.weight", {(int64_t)1 << 32, 0},
         "axis 0 has size 4294967296, over the limit 1048576"},
        {"action_in_proj.weight", {0, (int64_t)1 << 33}, "axis 1 has size 8589934592, over the limit 4096"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *dir = test_path("claimed");
        REQUIRE(write_edited_from("pi0_tiny", dir, EDIT_EMPTY, cases[i].target, cases[i].shape) == 0);
        pi0_error err = {0};
        CHECK(load_dir(dir, &err) == PI0_ERR_CHECKPOINT && strstr(err.message, cases[i].target) &&
                  strstr(err.message, cases[i].message), "case %zu: %s", i, err.message);
    }
}

/* A dims file's head counts are bounded too: heads x head_dim once overflowed int, and a huge q_proj would have
 * been allocated. Each limit is named, and so are depths that cannot attend jointly. A case replaces one block of the pi0_tiny fixture's dims (NULL: kept). */
TEST(dims_file_limits) {
    static const char *vision = "\"vision\": {\"width\": 64, \"depth\": 2, \"mlp_dim\": 128, \"num_heads\": 4}",
                      *llm = "\"llm\": {\"width\": 64, \"depth\": 3, \"mlp_dim\": 160, \"num_heads\": 4, "
                             "\"num_kv_heads\": 1, \"head_dim\": 32}",
                      *expert = "\"expert\": {\"width\": 48, \"depth\": 3, \"mlp_dim\": 96, \"num_heads\": 4, "
                                "\"num_kv_heads\": 1, \"head_dim\": 32}";
    static const struct {
        const char *vision, *llm, *expert, *image, *message;
    } cases[] = {
        {"\"vision\": {\"width\": 64, \"depth\": 2, \"mlp_dim\": 128, \"num_heads\": 16777216, \"head_dim\": 16777216}",
         NULL, NULL, NULL, "vision.num_heads is 16777216, outside the limits 1..1024"},
        {"\"vision\": {\"width\": 64, \"depth\": 2, \"mlp_dim\": 128, \"num_heads\": 4, \"head_dim\": 16777216}",
         NULL, NULL, NULL, "vision.head_dim is 16777216, outside the limits 1..4096"},
        {NULL,
         "\"llm\": {\"width\": 64, \"depth\": 3, \"mlp_dim\": 160, \"num_heads\": 1024, \"num_kv_heads\": 1, "
         "\"head_dim\": 4096}",
         "\"expert\": {\"width\": 48, \"depth\": 3, \"mlp_dim\": 96, \"num_heads\": 1024, \"num_kv_heads\": 1, "
         "\"head_dim\": 4096}",
         NULL, "llm.num_heads x head_dim is 4194304, outside the limits 1..262144"},
        {NULL, NULL, NULL, "\"image_size\": 16777216", "image_size is 16777216, outside the limits 1..4096"},
        /* expert layer l attends to LLM layer l's cache: the CPU backend once read past the cache's layers */
        {NULL, NULL,
         "\"expert\": {\"width\": 48, \"depth\": 4, \"mlp_dim\": 96, \"num_heads\": 4, \"num_kv_heads\": 1, "
         "\"head_dim\": 32}",
         NULL, "the LLM has 3 layers and the action expert 4"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *path = test_path("dims.json");
        FILE *f = fopen(path, "w");
        REQUIRE(f);
        fprintf(f, "{\"model\": \"pi0\", \"dims\": {%s, %s, %s%s%s}}", cases[i].vision ? cases[i].vision : vision,
                cases[i].llm ? cases[i].llm : llm, cases[i].expert ? cases[i].expert : expert,
                cases[i].image ? ", " : "", cases[i].image ? cases[i].image : "");
        fclose(f);
        pi0_dims d;
        pi0_error err = {0};
        CHECK(config_load_dims(path, &d, &err) == PI0_ERR_INVALID_ARGUMENT && strstr(err.message, cases[i].message),
              "case %zu: %s", i, err.message);
    }
}

/* Tensor sizes saturate rather than wrap: dims that never met dims_validate (a q_proj of 2^60 x 16 rows, 2^64
 * floats) fail the allocation instead of getting a small arena. */
TEST(weight_sizes_saturate) {
    pi0_dims d = pi0_dims_pi0();
    d.llm.num_heads = d.expert.num_heads = d.llm.head_dim = d.expert.head_dim = 1 << 30;
    d.llm.width = 16;
    pi0_weights w = {0};
    weight_spec *specs = NULL;
    int n = weights_specs(&d, &w, &specs);
    REQUIRE(n > 0);
    uint64_t q_numel = 0;
    for (int i = 0; i < n; i++)
        if (!strcmp(specs[i].name, "paligemma_with_expert.paligemma.model.language_model.layers.0.self_attn.q_proj.weight"))
            q_numel = specs[i].numel;
    CHECK(q_numel == UINT64_MAX, "q_proj numel %llu", (unsigned long long)q_numel);
    pi0_error err = {0};
    if (q_numel == UINT64_MAX)
        CHECK(weights_alloc(&w, specs, n, NULL, &err) == PI0_ERR_OUT_OF_MEMORY && w.arena == NULL, "%s", err.message);
    weights_free(&w);
    free(specs);
}

/* Each sample of a ragged batch gets the actions it gets alone: masking is per sample. */
static void check_ragged_batch(const char *name) {
    fixture f;
    REQUIRE(fixture_open(&f, name, NULL) == 0);
    int B = f.batch.batch;
    size_t n = actions_len(&f), per = n / B;
    float *together = malloc(n * sizeof(float)), *alone = malloc(per * sizeof(float));
    pi0_error err = {0};
    f.batch.num_steps = 3;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, together, NULL, &err) == PI0_OK, "%s", err.message);
    for (int b = 0; b < B; b++) {
        const float *images[3];
        for (int c = 0; c < 3; c++) images[c] = f.images[c] + (size_t)b * 224 * 224 * 3;
        pi0_batch one = f.batch;
        one.batch = 1;
        one.images = images;
        one.image_masks = f.masks + b * 3;
        one.prompt_ids = f.prompt_ids + b * f.batch.prompt_len;
        one.prompt_mask = f.prompt_mask + b * f.batch.prompt_len;
        one.state = f.state + b * 32;
        one.noise = f.noise + (size_t)b * per;
        REQUIRE(pi0_sample_actions(f.model, &one, alone, NULL, &err) == PI0_OK, "%s", err.message);
        double e = rel_error(together + b * per, alone, per);
        CHECK(e < 1e-5, "%s sample %d alone differs from in-batch: %.3g", name, b, e);
    }
    free(together), free(alone);
    fixture_close(&f);
}

TEST(ragged_batch_equals_single_samples) { check_ragged_batch("pi0_tiny"); }
TEST(pi05_ragged_batch_equals_single_samples) { check_ragged_batch("pi05_tiny"); }

/* Pi0.5 is told from its tensors, takes 200 prompt tokens when config.json does not say, and does not
 * read the state (the policy writes it into the prompt). */
TEST(pi05_kind_defaults_and_no_state) {
    fixture f;
    REQUIRE(fixture_open(&f, "pi05_tiny", NULL) == 0);
    CHECK(pi0_model_dims(f.model)->kind == PI0_MODEL_PI05);
    size_t n = actions_len(&f);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    pi0_error err = {0};
    f.batch.num_steps = 2;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, a, NULL, &err) == PI0_OK, "%s", err.message);
    f.batch.state = NULL;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, b, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(memcmp(a, b, n * sizeof(float)) == 0, "Pi0.5 read the state");
    free(a), free(b);
    fixture_close(&f);

    const char *dir = test_path("pi05_no_config_len");
    REQUIRE(write_edited_from("pi05_tiny", dir, EDIT_EXTRA, NULL, NULL) == 0);
    char path[600];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *fp = fopen(path, "w");
    fputs("{\"action_dim\": 32, \"dims\": {\"vision\": {\"num_heads\": 4}, \"llm\": {\"head_dim\": 32}, "
          "\"expert\": {\"head_dim\": 32}}}", fp);
    fclose(fp);
    pi0_model *m = NULL;
    pi0_options opts = {.backend = PI0_BACKEND_CPU};
    REQUIRE(pi0_model_load(dir, &opts, &m, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_model_dims(m)->kind == PI0_MODEL_PI05 && pi0_model_dims(m)->max_token_len == 200, "kind %d, %d tokens",
          pi0_model_dims(m)->kind, pi0_model_dims(m)->max_token_len);
    pi0_model_free(m);
    REQUIRE(write_edited(dir, EDIT_EXTRA, NULL) == 0); /* the same for Pi0: 48 */
    fp = fopen(path, "w");
    fputs("{\"action_dim\": 32, \"dims\": {\"vision\": {\"num_heads\": 4}, \"llm\": {\"head_dim\": 32}, "
          "\"expert\": {\"head_dim\": 32}}}", fp);
    fclose(fp);
    REQUIRE(pi0_model_load(dir, &opts, &m, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_model_dims(m)->kind == PI0_MODEL_PI0 && pi0_model_dims(m)->max_token_len == 48);
    pi0_model_free(m);
}

/* LeRobot's Pi0.5: the same modules under "model.", the embedding only as the tied lm_head: same actions. */
TEST(pi05_lerobot_names) {
    const char *dir = test_path("pi05_lerobot");
    REQUIRE(write_edited_from("pi05_tiny", dir, EDIT_LEROBOT, NULL, NULL) == 0);
    fixture plain, renamed;
    REQUIRE(fixture_open(&plain, "pi05_tiny", NULL) == 0);
    REQUIRE(fixture_open(&renamed, "pi05_tiny", dir) == 0);
    size_t n = actions_len(&plain);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    pi0_error err = {0};
    plain.batch.num_steps = renamed.batch.num_steps = 3;
    REQUIRE(pi0_sample_actions(plain.model, &plain.batch, a, NULL, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(renamed.model, &renamed.batch, b, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(memcmp(a, b, n * sizeof(float)) == 0, "renamed checkpoint differs: %.3g", rel_error(b, a, n));
    CHECK(pi0_model_dims(renamed.model)->kind == PI0_MODEL_PI05);
    free(a), free(b);
    fixture_close(&plain);
    fixture_close(&renamed);
}

/* Masked cameras and padded tokens are skipped: garbage in them must not change the actions. */
TEST(invalid_tokens_do_not_matter) {
    fixture f;
    REQUIRE(fixture_open(&f, "pi0_tiny", NULL) == 0);
    size_t n = actions_len(&f);
    float *a = malloc(n * sizeof(float)), *b = malloc(n * sizeof(float));
    pi0_error err = {0};
    f.batch.num_steps = 2;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, a, NULL, &err) == PI0_OK);
    for (size_t i = 0; i < (size_t)224 * 224 * 3; i++) f.images[2][i] = 1e30f; /* sample 0's masked camera */
    for (int i = 0; i < f.batch.prompt_len; i++)
        if (!f.prompt_mask[i]) f.prompt_ids[i] = -12345; /* sample 0's padding, even out of range */
    REQUIRE(pi0_sample_actions(f.model, &f.batch, b, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(memcmp(a, b, n * sizeof(float)) == 0, "masked inputs changed the actions");
    free(a), free(b);
    fixture_close(&f);
}

/* Uniform mode computes masked cameras and padding too (never as keys): the same actions as skipping them,
 * garbage in them changes nothing, and batches that differ in masks and prompt lengths share one shape. */
static void check_uniform_shape(const char *name) {
    fixture f;
    REQUIRE(fixture_open(&f, name, NULL) == 0);
    size_t n = actions_len(&f);
    float *skipped = malloc(n * sizeof(float)), *uniform = malloc(n * sizeof(float)), *garbage = malloc(n * sizeof(float));
    pi0_error err = {0};
    f.batch.num_steps = 3;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, skipped, NULL, &err) == PI0_OK, "%s", err.message);
    f.batch.uniform_shape = 1;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, uniform, NULL, &err) == PI0_OK, "%s", err.message);
    double e = rel_error(uniform, skipped, n);
    CHECK(e < 1e-5, "%s: uniform vs skipped %.3g", name, e);
    float *ref = f32_copy(st_find(&f.io, "actions_3step"));
    CHECK(rel_error(uniform, ref, n) <= TOL_F32, "%s: uniform vs openpi %.3g", name, rel_error(uniform, ref, n));
    free(ref);
    for (size_t i = 0; i < (size_t)224 * 224 * 3; i++) f.images[2][i] = 1e30f; /* sample 0's masked camera */
    for (int i = 0; i < f.batch.prompt_len; i++)
        if (!f.prompt_mask[i]) f.prompt_ids[i] = -12345;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, garbage, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(memcmp(uniform, garbage, n * sizeof(float)) == 0, "%s: masked inputs changed the actions in uniform mode", name);
    /* every mask pattern, one shape */
    pi0_plan a, b;
    REQUIRE(plan_build(pi0_model_dims(f.model), &f.batch, &a, &err) == PI0_OK, "%s", err.message);
    uint8_t masks[64 * 3], ids_mask[64 * 64] = {0};
    pi0_batch other = f.batch;
    memset(masks, 0, sizeof masks);
    masks[0] = 1; /* only sample 0's first camera, one prompt token */
    ids_mask[0] = 1;
    other.image_masks = masks, other.prompt_mask = ids_mask;
    REQUIRE(plan_build(pi0_model_dims(f.model), &other, &b, &err) == PI0_OK, "%s", err.message);
    CHECK(a.total_prefix == b.total_prefix && a.num_images == b.num_images && a.max_prefix == b.max_prefix &&
          a.cache_rows == b.cache_rows, "%s: shapes differ: %d/%d rows, %d/%d images", name, a.total_prefix, b.total_prefix,
          a.num_images, b.num_images);
    CHECK(b.prefix_keys[0] == 256 + 1 && b.prefix_keys[1] == 0, "%s: keys %d %d", name, b.prefix_keys[0], b.prefix_keys[1]);
    plan_free(&a), plan_free(&b);
    free(skipped), free(uniform), free(garbage);
    fixture_close(&f);
}

TEST(uniform_shape_pi0) { check_uniform_shape("pi0_tiny"); }
TEST(uniform_shape_pi05) { check_uniform_shape("pi05_tiny"); }

/* The later denoise steps run the action rows alone (plan.h): each is the first step's row of the same token (its
 * position and cache row), sees the whole suffix in the cache, and no query of theirs is masked; Pi0.5's two are the
 * same. */
static void check_step_rows(const char *name) {
    fixture f;
    REQUIRE(fixture_open(&f, name, NULL) == 0);
    pi0_plan p;
    pi0_error err = {0};
    REQUIRE(plan_build(pi0_model_dims(f.model), &f.batch, &p, &err) == PI0_OK, "%s", err.message);
    const suffix_rows *first = plan_step_rows(&p, 0), *later = plan_step_rows(&p, 1);
    int H = p.horizon, S = p.suffix_len, state = S - H, wrong = 0;
    CHECK(first->per_sample == S && later->per_sample == H && plan_step_rows(&p, 9) == later, "%s: %d / %d rows a sample",
          name, first->per_sample, later->per_sample);
    CHECK(p.batch >= 2 && p.prefix_keys[0] != p.prefix_keys[1], "%s: the fixture's batch is not ragged", name);
    for (int b = 0; b < p.batch; b++) {
        attn_segment a = first->segments[b], l = later->segments[b];
        wrong += a.q_row != b * S || a.num_q != S || a.state_keys != (state ? p.prefix_keys[b] + 1 : 0);
        wrong += l.q_row != b * H || l.num_q != H || l.k_row != a.k_row || l.num_k != a.num_k || l.state_keys != 0;
        for (int i = 0; i < H; i++) {
            int from_first = first->action_rows[b * H + i], from_later = later->action_rows[b * H + i];
            wrong += from_first != b * S + state + i || from_later != b * H + i;
            wrong += later->pos[from_later] != first->pos[from_first];
            wrong += later->cache_row[from_later] != first->cache_row[from_first];
        }
    }
    CHECK(wrong == 0, "%s: %d rows or segments of the later steps differ from the first step's", name, wrong);
    plan_free(&p);
    fixture_close(&f);
}

TEST(step_rows_pi0) { check_step_rows("pi0_tiny"); }
TEST(step_rows_pi05) { check_step_rows("pi05_tiny"); }

TEST(bad_batches_are_rejected) {
    fixture f;
    REQUIRE(fixture_open(&f, "pi0_tiny", NULL) == 0);
    float *out = malloc(actions_len(&f) * sizeof(float));
    pi0_error err = {0};
    pi0_batch b = f.batch;
    b.batch = 0;
    CHECK(pi0_sample_actions(f.model, &b, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT && strstr(err.message, "batch"));
    b = f.batch;
    f.prompt_ids[3] = 512; /* vocab is 512: one past the end, and valid */
    CHECK(pi0_sample_actions(f.model, &b, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT && strstr(err.message, "512"),
          "%s", err.message);
    f.prompt_ids[3] = 7;
    b.state = NULL;
    CHECK(pi0_sample_actions(f.model, &b, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    b = f.batch;
    const float *no_images[3] = {NULL, NULL, NULL};
    b.images = no_images;
    CHECK(pi0_sample_actions(f.model, &b, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT && strstr(err.message, "NULL"));
    b = f.batch;
    b.num_steps = -1;
    CHECK(pi0_sample_actions(f.model, &b, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_sample_actions(f.model, NULL, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    free(out);
    fixture_close(&f);
}

/* The scan behind the refusal: NaN (either sign, any payload) and both infinities are found at any index, first
 * one first, in full blocks, in the last partial block and in arrays shorter than a block; the largest finite
 * values, subnormals and zeros are not. */
TEST(first_nonfinite_finds_every_kind) {
    enum { N = 3 * 4096 + 1000 };
    static float x[N];
    uint32_t rng = 7;
    for (int i = 0; i < N; i++) x[i] = ((rng = rng * 1664525u + 1013904223u) >> 8) * (1.0f / 8388608.0f) - 1.0f;
    const float finite[] = {3.4028235e38f, -3.4028235e38f, 1e-45f, -1e-45f, 1.1754942e-38f, 0.0f, -0.0f};
    for (int i = 0; i < (int)(sizeof finite / sizeof finite[0]); i++) x[4095 + i] = finite[i];
    CHECK(first_nonfinite(x, N) == N, "a finite array gave %zu", first_nonfinite(x, N));
    uint32_t patterns[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xffffffffu};
    const size_t at[] = {0, 1, 4095, 4096, 8191, 3 * 4096, N - 1};
    for (int p = 0; p < 6; p++)
        for (int a = 0; a < 7; a++) {
            float keep = x[at[a]], bad;
            memcpy(&bad, &patterns[p], sizeof bad);
            x[at[a]] = bad;
            CHECK(first_nonfinite(x, N) == at[a], "0x%08x at %zu: found at %zu", patterns[p], at[a], first_nonfinite(x, N));
            CHECK(at[a] + 1 >= N || first_nonfinite(x + at[a] + 1, N - at[a] - 1) == N - at[a] - 1, "past it");
            if (at[a] < 100) CHECK(first_nonfinite(x, 100) == at[a], "in a short array");
            x[at[a]] = keep;
        }
    x[5000] = NAN, x[9000] = INFINITY;
    CHECK(first_nonfinite(x, N) == 5000, "the first of two: %zu", first_nonfinite(x, N));
    CHECK(first_nonfinite(x, 0) == 0, "an empty array");
}

/* NaN or infinity in what the model reads is refused, naming the input and where it is; what it does not read (a
 * masked camera's image, Pi0.5's state) is not looked at. */
TEST(nonfinite_inputs_are_refused) {
    fixture f;
    REQUIRE(fixture_open(&f, "pi0_tiny", NULL) == 0);
    float *out = malloc(actions_len(&f) * sizeof(float));
    pi0_error err = {0};
    size_t S = 224, A = 32, image = S * S * 3, chunk = (size_t)f.batch.horizon * A;
    f.batch.num_steps = 1;
    REQUIRE(f.masks[1 * 3 + 1] && !f.masks[0 * 3 + 2], "the fixture's masks changed");
    float *pixel = &f.images[1][image + (5 * S + 7) * 3 + 2]; /* sample 1, camera 1, y 5, x 7, channel 2 */
    *pixel = NAN;
    CHECK(pi0_sample_actions(f.model, &f.batch, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the image of camera 1, sample 1 is nan at (y 5, x 7, channel 2)"), "%s", err.message);
    *pixel = 0;
    f.images[2][0] = INFINITY; /* sample 0's masked camera */
    CHECK(pi0_sample_actions(f.model, &f.batch, out, NULL, &err) == PI0_OK, "%s", err.message);
    f.state[A + 4] = -INFINITY;
    CHECK(pi0_sample_actions(f.model, &f.batch, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the state of sample 1 is -inf at dim 4"), "%s", err.message);
    f.state[A + 4] = 0;
    f.noise[chunk + 3 * A + 9] = NAN;
    CHECK(pi0_sample_actions(f.model, &f.batch, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the noise of sample 1 is nan at step 3, dim 9"), "%s", err.message);
    free(out);
    fixture_close(&f);
    REQUIRE(fixture_open(&f, "pi05_tiny", NULL) == 0);
    out = malloc(actions_len(&f) * sizeof(float));
    f.batch.num_steps = 1;
    f.state[0] = NAN; /* Pi0.5 has no state token */
    CHECK(pi0_sample_actions(f.model, &f.batch, out, NULL, &err) == PI0_OK, "%s", err.message);
    free(out);
    fixture_close(&f);
}

/* pi0_host_alloc's memory (pinned where the CUDA driver gives it, malloc's here) holds images like any other: the same
 * actions, to the bit; its edge cases fail cleanly. */
TEST(host_alloc_images) {
    fixture f;
    REQUIRE(fixture_open(&f, "pi0_tiny", NULL) == 0);
    size_t n = actions_len(&f), bytes = (size_t)f.batch.batch * 224 * 224 * 3 * sizeof(float);
    float *want = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float)), *images[3];
    const float *ptrs[3];
    f.batch.num_steps = 1;
    pi0_error err = {0};
    REQUIRE(pi0_sample_actions(f.model, &f.batch, want, NULL, &err) == PI0_OK, "%s", err.message);
    for (int c = 0; c < 3; c++) {
        REQUIRE((images[c] = pi0_host_alloc(bytes)) != NULL);
        CHECK((uintptr_t)images[c] % 16 == 0, "camera %d: %p is not 16-byte aligned", c, (void *)images[c]);
        memcpy(images[c], f.images[c], bytes);
        ptrs[c] = images[c];
    }
    f.batch.images = ptrs;
    REQUIRE(pi0_sample_actions(f.model, &f.batch, got, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(!memcmp(want, got, n * sizeof(float)), "pi0_host_alloc's images give other actions");
    for (int c = 0; c < 3; c++) pi0_host_free(images[c]);
    CHECK(pi0_host_alloc(SIZE_MAX) == NULL && pi0_host_alloc(SIZE_MAX - 8) == NULL, "an impossible size was allocated");
    void *empty = pi0_host_alloc(0);
    CHECK(empty != NULL, "pi0_host_alloc(0) failed");
    pi0_host_free(empty);
    pi0_host_free(NULL);
    free(want), free(got);
    fixture_close(&f);
}

/* A batch whose images pass PLAN_HOST_THREADS_BYTES is checked on the OpenMP threads: a bad value anywhere (the last
 * float of an image, inside its last, partial block) is still found, the first in (sample, camera) order is named,
 * and a masked camera's image is not looked at, also in uniform mode, where the plan holds it. */
TEST(nonfinite_images_of_a_large_batch_are_refused) {
    fixture f;
    REQUIRE(fixture_open(&f, "pi0_tiny", NULL) == 0);
    enum { B = 8, C = 3 };
    size_t S = 224, A = 32, image = S * S * 3, L = (size_t)f.batch.prompt_len;
    REQUIRE((B * C - 1) * image * sizeof(float) > PLAN_HOST_THREADS_BYTES, "the batch no longer takes the threads");
    float *images[C], *state = calloc(B * A, sizeof(float)), *out = malloc((size_t)B * f.batch.horizon * A * sizeof(float));
    const float *image_ptrs[C];
    uint8_t masks[B * C], *prompt_mask = malloc(B * L);
    int32_t *prompt_ids = malloc(B * L * sizeof(int32_t));
    for (int c = 0; c < C; c++) {
        image_ptrs[c] = images[c] = malloc(B * image * sizeof(float));
        for (size_t i = 0; i < B * image; i++) images[c][i] = 0.25f;
    }
    for (int i = 0; i < B * C; i++) masks[i] = i != 3 * C + 2; /* sample 3's camera 2 is masked */
    for (int b = 0; b < B; b++) memcpy(prompt_ids + b * L, f.prompt_ids, L * sizeof(int32_t)), memset(prompt_mask + b * L, 1, L);
    pi0_batch batch = {.batch = B, .num_cameras = C, .images = image_ptrs, .image_masks = masks, .prompt_len = (int)L,
                       .prompt_ids = prompt_ids, .prompt_mask = prompt_mask, .state = state, .horizon = f.batch.horizon,
                       .num_steps = 1, .noise_seed = 5};
    pi0_error err = {0};
    images[1][6 * image + image - 1] = NAN; /* sample 6, camera 1, the last pixel's last channel */
    CHECK(pi0_sample_actions(f.model, &batch, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the image of camera 1, sample 6 is nan at (y 223, x 223, channel 2)"), "%s", err.message);
    images[0][2 * image + (100 * S + 3) * 3 + 1] = -INFINITY; /* sample 2, camera 0: before sample 6 */
    CHECK(pi0_sample_actions(f.model, &batch, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the image of camera 0, sample 2 is -inf at (y 100, x 3, channel 1)"), "%s", err.message);
    images[0][2 * image + (100 * S + 3) * 3 + 1] = images[1][6 * image + image - 1] = 0.25f;
    images[2][3 * image + 17] = NAN; /* the masked camera's */
    CHECK(pi0_sample_actions(f.model, &batch, out, NULL, &err) == PI0_OK, "%s", err.message);
    batch.uniform_shape = 1; /* the masked camera's image now goes to the ViT (its tokens never keys), still unchecked */
    CHECK(pi0_sample_actions(f.model, &batch, out, NULL, &err) == PI0_OK, "uniform mode: %s", err.message);
    for (int c = 0; c < C; c++) free(images[c]);
    free(state), free(out), free(prompt_mask), free(prompt_ids);
    fixture_close(&f);
}

/* Camera frames of any size (pi0_batch.frames, resized by the backend) give what the images openpi's transforms
 * make of them give, bit for bit, with cameras masked and in uniform mode; bad frames are refused by name. */
TEST(frames_equal_preprocessed_images) {
    fixture f;
    REQUIRE(fixture_open(&f, "pi0_tiny", NULL) == 0);
    const int sizes[][2] = {{256, 256}, {180, 320}, {224, 224}, {1, 1}, {37, 500}, {300, 41}, {100, 60}};
    int B = f.batch.batch, C = 3, nsizes = (int)(sizeof sizes / sizeof sizes[0]);
    size_t image = (size_t)224 * 224 * 3, n = actions_len(&f);
    pi0_frame frames[64 * 3] = {{0}};
    uint32_t rng = 12345;
    for (int i = 0; i < B * C; i++) {
        int b = i / C, c = i % C, h = sizes[i % nsizes][0], w = sizes[i % nsizes][1];
        if (!f.masks[i]) continue; /* a masked camera's frame stays NULL */
        uint8_t *px = malloc((size_t)h * w * 3);
        for (size_t k = 0; k < (size_t)h * w * 3; k++) px[k] = (uint8_t)((rng = rng * 1664525u + 1013904223u) >> 24);
        frames[i] = (pi0_frame){px, h, w};
        pi0_image img = {.data = px, .type = PI0_PIXEL_U8, .layout = PI0_LAYOUT_HWC, .height = h, .width = w, .channels = 3};
        pi0_error e = {0};
        REQUIRE(pi0_image_preprocess(&img, 224, f.images[c] + b * image, &e) == PI0_OK, "%s", e.message);
    }
    float *from_images = malloc(n * sizeof(float)), *from_frames = malloc(n * sizeof(float));
    pi0_error err = {0};
    f.batch.num_steps = 2;
    for (int uniform = 0; uniform < 2; uniform++) {
        pi0_batch b = f.batch;
        b.uniform_shape = uniform;
        REQUIRE(pi0_sample_actions(f.model, &b, from_images, NULL, &err) == PI0_OK, "%s", err.message);
        b.images = NULL, b.frames = frames;
        REQUIRE(pi0_sample_actions(f.model, &b, from_frames, NULL, &err) == PI0_OK, "%s", err.message);
        CHECK(memcmp(from_images, from_frames, n * sizeof(float)) == 0, "uniform %d: frames differ from their images (%.3g)",
              uniform, rel_error(from_frames, from_images, n));
    }
    pi0_batch bad = f.batch;
    bad.frames = frames; /* and images */
    CHECK(pi0_sample_actions(f.model, &bad, from_frames, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
          strstr(err.message, "both images and frames"), "%s", err.message);
    bad.images = NULL, bad.frames = NULL;
    CHECK(pi0_sample_actions(f.model, &bad, from_frames, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
          strstr(err.message, "one or the other"), "%s", err.message);
    REQUIRE(f.masks[1 * 3 + 1], "the fixture's masks changed");
    bad.frames = frames;
    pi0_frame kept = frames[1 * 3 + 1];
    frames[1 * 3 + 1].width = 0;
    CHECK(pi0_sample_actions(f.model, &bad, from_frames, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
          strstr(err.message, "the frame of camera 1, sample 1 is 0x"), "%s", err.message);
    frames[1 * 3 + 1].width = PI0_MAX_IMAGE_SIDE + 1;
    CHECK(pi0_sample_actions(f.model, &bad, from_frames, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
          strstr(err.message, "sides must be in 1..4096"), "%s", err.message);
    frames[1 * 3 + 1] = (pi0_frame){NULL, 10, 10};
    CHECK(pi0_sample_actions(f.model, &bad, from_frames, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
          strstr(err.message, "camera 1 is valid for sample 1 but its frame is NULL"), "%s", err.message);
    frames[1 * 3 + 1] = kept;
    for (int i = 0; i < B * C; i++) free((void *)frames[i].pixels);
    free(from_images), free(from_frames);
    fixture_close(&f);
}

/* Random weights: deterministic per seed, different across seeds, and a saved model reloads equal. */
TEST(random_weights_deterministic_and_saveable) {
    char path[600];
    snprintf(path, sizeof path, "%s/pi0_tiny/config.json", fixtures_dir());
    pi0_model *a = NULL, *b = NULL, *c = NULL, *reloaded = NULL;
    pi0_error err = {0};
    pi0_options opts = {.backend = PI0_BACKEND_CPU};
    pi0_model *fixture_model = NULL;
    snprintf(path, sizeof path, "%s/pi0_tiny", fixtures_dir());
    REQUIRE(pi0_model_load(path, &opts, &fixture_model, &err) == PI0_OK);
    pi0_dims dims = *pi0_model_dims(fixture_model);
    pi0_model_free(fixture_model);
    REQUIRE(pi0_model_random(&dims, 7, &opts, &a, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_model_random(&dims, 7, &opts, &b, &err) == PI0_OK);
    REQUIRE(pi0_model_random(&dims, 8, &opts, &c, &err) == PI0_OK);
    size_t bytes = 0;
    for (int i = 0; i < a->num_specs; i++) bytes += a->specs[i].numel * sizeof(float);
    int same_ab = 1, same_ac = 1;
    for (int i = 0; i < a->num_specs; i++) {
        same_ab &= !memcmp(*a->specs[i].slot, *b->specs[i].slot, a->specs[i].numel * sizeof(float));
        same_ac &= !memcmp(*a->specs[i].slot, *c->specs[i].slot, a->specs[i].numel * sizeof(float));
    }
    CHECK(same_ab, "same seed gave different weights");
    CHECK(!same_ac, "different seeds gave the same weights");
    const char *dir = test_path("random_saved");
    REQUIRE(pi0_model_save(a, dir, 0, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_model_load(dir, &opts, &reloaded, &err) == PI0_OK, "%s", err.message);
    CHECK(!memcmp(pi0_model_dims(reloaded), &dims, sizeof dims), "dims changed through save/load");
    for (int i = 0; i < a->num_specs; i++)
        CHECK(!memcmp(*a->specs[i].slot, *reloaded->specs[i].slot, a->specs[i].numel * sizeof(float)), "%s differs",
              a->specs[i].name);
    CHECK(bytes > 0);
    pi0_model_free(a), pi0_model_free(b), pi0_model_free(c), pi0_model_free(reloaded);
}

/* The real size: random weights, one inference with the seed workload's shape, finite actions. */
TEST(full_size_random_inference) {
    if (getenv("PI0_SKIP_FULL_SIZE")) SKIP("PI0_SKIP_FULL_SIZE is set");
    pi0_dims dims = pi0_dims_pi0();
    pi0_model *m = NULL;
    pi0_error err = {0};
    pi0_options opts = {.backend = PI0_BACKEND_CPU};
    REQUIRE(pi0_model_random(&dims, 1, &opts, &m, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_model_num_params(m) > 3200000000ull && pi0_model_num_params(m) < 3300000000ull, "%llu parameters",
          (unsigned long long)pi0_model_num_params(m));
    size_t image = 224 * 224 * 3;
    float *img = malloc(image * sizeof(float)), state[32], noise[10 * 32], actions[10 * 32];
    for (size_t i = 0; i < image; i++) img[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    for (int i = 0; i < 32; i++) state[i] = 0.1f * (float)(i % 7) - 0.3f;
    for (int i = 0; i < 320; i++) noise[i] = (float)((i * 40503u) % 2001) / 1000.0f - 1.0f;
    int32_t ids[20];
    uint8_t mask[20], cams[2] = {1, 0};
    for (int i = 0; i < 20; i++) ids[i] = (i * 12289) % dims.vocab_size, mask[i] = 1;
    const float *images[2] = {img, img};
    pi0_batch b = {.batch = 1, .num_cameras = 2, .images = images, .image_masks = cams, .prompt_len = 20,
                   .prompt_ids = ids, .prompt_mask = mask, .state = state, .horizon = 10, .noise = noise, .num_steps = 2};
    pi0_timings t;
    REQUIRE(pi0_sample_actions(m, &b, actions, &t, &err) == PI0_OK, "%s", err.message);
    fprintf(stderr, "  full size, 1 camera, 2 steps: %.0f ms (vision %.0f, prefix %.0f, denoise %.0f)\n", t.total_ms,
            t.vision_ms, t.prefix_ms, t.denoise_ms);
    int finite = 1, moved = 0;
    for (int i = 0; i < 320; i++) finite &= isfinite(actions[i]), moved |= actions[i] != noise[i];
    CHECK(finite, "non-finite actions");
    CHECK(moved, "actions equal the noise: the model did nothing");
    free(img);
    pi0_model_free(m);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(fixture_pi0_tiny_actions);
    RUN(fixture_pi0_tiny_h50_actions);
    RUN(fixture_pi05_tiny_actions);
    RUN(fixture_pi05_tiny_h50_actions);
    RUN(fixture_pi0_tiny_intermediates);
    RUN(fixture_pi0_tiny_h50_intermediates);
    RUN(fixture_pi05_tiny_intermediates);
    RUN(fixture_pi05_tiny_h50_intermediates);
    RUN(bf16_checkpoint_equals_rounded_f32);
    RUN(checkpoint_missing_tensor_is_named);
    RUN(checkpoint_misshaped_tensor_names_both_shapes);
    RUN(checkpoint_wrong_dtype_is_named);
    RUN(checkpoint_prefix_and_extra_tensors);
    RUN(checkpoint_not_a_pi0_file);
    RUN(checkpoint_bad_config_json);
    RUN(checkpoint_claimed_sizes_are_bounded);
    RUN(dims_file_limits);
    RUN(weight_sizes_saturate);
    RUN(ragged_batch_equals_single_samples);
    RUN(pi05_ragged_batch_equals_single_samples);
    RUN(pi05_kind_defaults_and_no_state);
    RUN(pi05_lerobot_names);
    RUN(invalid_tokens_do_not_matter);
    RUN(uniform_shape_pi0);
    RUN(uniform_shape_pi05);
    RUN(step_rows_pi0);
    RUN(step_rows_pi05);
    RUN(bad_batches_are_rejected);
    RUN(first_nonfinite_finds_every_kind);
    RUN(nonfinite_inputs_are_refused);
    RUN(host_alloc_images);
    RUN(nonfinite_images_of_a_large_batch_are_refused);
    RUN(frames_equal_preprocessed_images);
    RUN(random_weights_deterministic_and_saveable);
    RUN(full_size_random_inference);
    return check_finish();
}
