/*
 * test_infer.c - `pi0 infer` as a user runs it: --help, usage errors (exit 2), missing or bad files (exit 1,
 * naming the file), real runs with the libero, droid and a generic adapter on the checkpoint of
 * tests/make_policy_checkpoint.sh, --json, and --output read back and compared with the library's own
 * pi0_policy_infer. Observations are written with pi0_packer, as openpi_client.msgpack_numpy packs them.
 * The binary comes from $PI0_BIN (default build/pi0).
 */
#include <jansson.h>
#include <sys/stat.h>

#include "check.h"
#include "cli_run.h"
#include "server/msgpack_numpy.h"
#include "policy/policy.h"

/* A copy of test_path(leaf) that later test_path calls do not reuse. */
static const char *keep_path(const char *leaf) {
    static char paths[16][512];
    static int next;
    char *p = paths[next++ % 16];
    snprintf(p, sizeof paths[0], "%s", test_path(leaf));
    return p;
}

/* The shared test checkpoint, made once. */
static const char *checkpoint(void) {
    static char dir[512];
    if (dir[0]) return dir;
    snprintf(dir, sizeof dir, "%s", test_path("ckpt"));
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "PI0_BIN=%s tests/make_policy_checkpoint.sh %s", pi0_bin(), dir);
    if (system(cmd) != 0) fprintf(stderr, "  %s failed\n", cmd);
    return dir;
}

static uint8_t *make_image(int h, int w, uint32_t seed) {
    uint8_t *img = malloc((size_t)h * w * 3);
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < (size_t)h * w * 3; i++) img[i] = (uint8_t)((x = x * 1664525u + 1013904223u) >> 24);
    return img;
}

static int write_bytes(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    size_t n = fwrite(data, 1, size, f);
    fclose(f);
    return n == size ? 0 : -1;
}

/* A LIBERO observation (the keys of openpi's examples/libero client); `drop` leaves one key out, `state` (8
 * values) replaces the usual one when not NULL. */
static const char *write_libero_obs(const char *name, const char *drop, const float *state) {
    const char *path = keep_path(name);
    uint8_t *base = make_image(96, 128, 1), *wrist = make_image(224, 224, 2);
    static const float usual_state[8] = {0.01f, -0.1f, 0.9f, 3.0f, 0.25f, -0.2f, 0.03f, -0.025f};
    if (!state) state = usual_state;
    pi0_packer pk = {0};
    pi0_pack_map(&pk, drop ? 3 : 4);
    if (!drop || strcmp(drop, "observation/image")) {
        pi0_pack_str(&pk, "observation/image");
        pi0_pack_ndarray(&pk, PI0_DTYPE_U8, 3, (int64_t[]){96, 128, 3}, base);
    }
    if (!drop || strcmp(drop, "observation/wrist_image")) {
        pi0_pack_str(&pk, "observation/wrist_image");
        pi0_pack_ndarray(&pk, PI0_DTYPE_U8, 3, (int64_t[]){224, 224, 3}, wrist);
    }
    if (!drop || strcmp(drop, "observation/state")) {
        pi0_pack_str(&pk, "observation/state");
        pi0_pack_ndarray(&pk, PI0_DTYPE_F32, 1, (int64_t[]){8}, state);
    }
    if (!drop || strcmp(drop, "prompt")) {
        pi0_pack_str(&pk, "prompt");
        pi0_pack_str(&pk, "pick up the black bowl and place it on the plate");
    }
    if (pk.failed || write_bytes(path, pk.data, pk.size)) path = NULL;
    pi0_packer_free(&pk);
    free(base), free(wrist);
    return path;
}

/* A DROID observation: float32 CHW exterior image, uint8 HWC wrist, joints as a plain list, gripper a scalar. */
static const char *write_droid_obs(const char *name) {
    const char *path = keep_path(name);
    uint8_t *ext = make_image(180, 320, 3), *wrist = make_image(180, 320, 4);
    float *ext_chw = malloc((size_t)3 * 180 * 320 * sizeof(float));
    for (int c = 0; c < 3; c++)
        for (int i = 0; i < 180 * 320; i++) ext_chw[c * 180 * 320 + i] = ext[i * 3 + c] / 255.0f;
    static const double joints[7] = {0.0, -0.05, 0.82, 3.3, -0.1, 0.3, 0.018};
    pi0_packer pk = {0};
    pi0_pack_map(&pk, 5);
    pi0_pack_str(&pk, "observation/exterior_image_1_left");
    pi0_pack_ndarray(&pk, PI0_DTYPE_F32, 3, (int64_t[]){3, 180, 320}, ext_chw);
    pi0_pack_str(&pk, "observation/wrist_image_left");
    pi0_pack_ndarray(&pk, PI0_DTYPE_U8, 3, (int64_t[]){180, 320, 3}, wrist);
    pi0_pack_str(&pk, "observation/joint_position");
    pi0_pack_array(&pk, 7);
    for (int i = 0; i < 7; i++) pi0_pack_double(&pk, joints[i]);
    pi0_pack_str(&pk, "observation/gripper_position");
    pi0_pack_double(&pk, -0.01);
    pi0_pack_str(&pk, "prompt");
    pi0_pack_str(&pk, "put the marker in the cup");
    if (pk.failed || write_bytes(path, pk.data, pk.size)) path = NULL;
    pi0_packer_free(&pk);
    free(ext), free(wrist), free(ext_chw);
    return path;
}

static json_t *parse_json(const char *text) {
    json_error_t jerr;
    json_t *o = json_loads(text, 0, &jerr);
    if (!o) fprintf(stderr, "  not JSON (%s): %.200s\n", jerr.text, text);
    return o;
}

/* Reads a reply file back: its actions (owned) and infer_ms. */
static int read_reply(const char *path, double **actions, int64_t shape[2], double *infer_ms) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    static uint8_t buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    pi0_observation reply;
    pi0_error err = {0};
    if (pi0_observation_decode(buf, n, &reply, &err)) {
        fprintf(stderr, "  %s: %s\n", path, err.message);
        return -1;
    }
    const pi0_field *a = pi0_observation_find(&reply, "actions"), *t = pi0_observation_find(&reply, "policy_timing/infer_ms");
    int ok = reply.count == 2 && a && t && a->kind == PI0_FIELD_ARRAY && a->dtype == PI0_DTYPE_F64 && a->ndim == 2 &&
             t->kind == PI0_FIELD_ARRAY && t->dtype == PI0_DTYPE_F64 && t->ndim == 0;
    if (ok) {
        shape[0] = a->shape[0], shape[1] = a->shape[1];
        *actions = malloc((size_t)pi0_field_numel(a) * sizeof(double));
        memcpy(*actions, a->data, (size_t)pi0_field_numel(a) * sizeof(double));
        memcpy(infer_ms, t->data, sizeof(double));
    } else {
        fprintf(stderr, "  %s: not {actions: f8 (H, D), policy_timing: {infer_ms: f8}}\n", path);
    }
    pi0_observation_free(&reply);
    return ok ? 0 : -1;
}

TEST(help_and_usage_errors) {
    char out[8192];
    CHECK(run_pi0(out, sizeof out, "infer --help") == 0 && strstr(out, "usage: pi0 infer") && strstr(out, "--adapter"));
    CHECK(run_pi0(NULL, 0, "infer") == 2 && strstr(last_stderr(), "required"), "%s", last_stderr());
    CHECK(run_pi0(NULL, 0, "infer --checkpoint x --adapter libero") == 2 && strstr(last_stderr(), "--obs"));
    CHECK(run_pi0(NULL, 0, "infer --no-such-flag") == 2 && strstr(last_stderr(), "--no-such-flag"));
    CHECK(run_pi0(NULL, 0, "infer --checkpoint x --adapter libero --obs y --steps 0") == 2 &&
          strstr(last_stderr(), "--steps"));
    CHECK(run_pi0(NULL, 0, "infer --checkpoint x --adapter libero --obs y --seed -1") == 2 &&
          strstr(last_stderr(), "--seed"));
    CHECK(run_pi0(NULL, 0, "infer --checkpoint x --adapter libero --obs y --backend tpu") == 2 &&
          strstr(last_stderr(), "unknown backend"));
    CHECK(run_pi0(NULL, 0, "infer --checkpoint x --adapter libero --obs") == 2 && strstr(last_stderr(), "needs a value"));
}

TEST(missing_and_bad_files) {
    const char *ck = checkpoint(), *obs = write_libero_obs("obs.msgpack", NULL, NULL);
    REQUIRE(obs);
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs /nonexistent/obs.msgpack --quiet", ck) == 1 &&
              strstr(last_stderr(), "/nonexistent/obs.msgpack"), "%s", last_stderr());
    CHECK(run_pi0(NULL, 0, "infer --checkpoint /nonexistent/ckpt --adapter libero --obs %s --quiet", obs) == 1 &&
              strstr(last_stderr(), "/nonexistent/ckpt"), "%s", last_stderr());
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter /nonexistent/arm.json --obs %s --quiet", ck, obs) == 1 &&
              strstr(last_stderr(), "/nonexistent/arm.json"), "%s", last_stderr());
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --tokenizer /nonexistent/tok.model --quiet",
                  ck, obs) == 1 && strstr(last_stderr(), "/nonexistent/tok.model"), "%s", last_stderr());
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --norm-stats /nonexistent/ns.json --quiet",
                  ck, obs) == 1 && strstr(last_stderr(), "/nonexistent/ns.json"), "%s", last_stderr());
    /* not msgpack */
    const char *junk = keep_path("junk.msgpack");
    write_bytes(junk, "\xc1\xc1\xc1", 3);
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --quiet", ck, junk) == 1 &&
              strstr(last_stderr(), junk), "%s", last_stderr());
    /* a valid file missing a key: the key is named */
    const char *no_state = write_libero_obs("no_state.msgpack", "observation/state", NULL);
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --quiet", ck, no_state) == 1 &&
              strstr(last_stderr(), "observation/state") && strstr(last_stderr(), "missing"), "%s", last_stderr());
    /* a finite state that the norm stats scale past float32 (std 0.015): refused by name, not NaN actions and not
     * {"actions": [[], [], ...]} (jansson drops what it cannot hold) */
    static const float huge_state[8] = {0, 0, 0, 0, 0, 0, 1e38f, 0};
    const char *huge = write_libero_obs("huge_state.msgpack", NULL, huge_state);
    char out[4096];
    CHECK(run_pi0(out, sizeof out, "infer --checkpoint %s --adapter libero --obs %s --json --quiet", ck, huge) == 1 &&
              strstr(last_stderr(), "\"observation/state\"[6] is 1e+38") && !strstr(out, "actions"),
          "stdout %s, stderr %s", out, last_stderr());
    /* the droid adapter on a libero observation */
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter droid --obs %s --quiet", ck, obs) == 1 &&
              strstr(last_stderr(), "observation/exterior_image_1_left"), "%s", last_stderr());
    /* an unwritable --output */
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --output /nonexistent/out.msgpack --quiet",
                  ck, obs) == 1 && strstr(last_stderr(), "/nonexistent/out.msgpack"), "%s", last_stderr());
}

TEST(libero_table_json_and_output) {
    const char *ck = checkpoint(), *obs = write_libero_obs("obs.msgpack", NULL, NULL), *out = keep_path("reply.msgpack");
    static char text[1 << 16];
    REQUIRE(obs);
    int rc = run_pi0(text, sizeof text, "infer --checkpoint %s --adapter libero --obs %s --steps 3 --seed 9", ck, obs);
    REQUIRE(rc == 0, "exit %d: %s", rc, last_stderr());
    CHECK(strstr(text, "actions (10 steps x 7 dims, adapter libero)"), "%s", text);
    CHECK(strstr(last_stderr(), "policy ready"), "load progress on stderr: %s", last_stderr());
    int lines = 0;
    for (const char *p = text; (p = strchr(p, '\n')); p++) lines++;
    CHECK(lines == 12, "a title, a header and 10 rows: %d lines", lines);

    rc = run_pi0(text, sizeof text, "infer --checkpoint %s --adapter libero --obs %s --steps 3 --seed 9 --json --quiet "
                 "--output %s", ck, obs, out);
    REQUIRE(rc == 0, "exit %d: %s", rc, last_stderr());
    CHECK(last_stderr()[0] == 0, "--quiet printed: %s", last_stderr());
    json_t *o = parse_json(text);
    REQUIRE(o);
    json_t *rows = json_object_get(o, "actions");
    CHECK(json_array_size(rows) == 10 && json_array_size(json_array_get(rows, 0)) == 7);
    CHECK(json_real_value(json_object_get(o, "infer_ms")) > 0);

    double *actions = NULL, infer_ms = 0;
    int64_t shape[2];
    REQUIRE(read_reply(out, &actions, shape, &infer_ms) == 0);
    CHECK(shape[0] == 10 && shape[1] == 7 && infer_ms > 0);
    int same = 1;
    for (int t = 0; t < 10; t++)
        for (int a = 0; a < 7; a++) same &= json_real_value(json_array_get(json_array_get(rows, t), a)) == actions[t * 7 + a];
    CHECK(same, "--json and --output disagree");
    json_decref(o);

    /* the library gives the same bits (what `pi0 serve --seed 9` computes for this request alone) */
    pi0_policy_options opts = {.checkpoint = ck, .adapter = "libero", .num_steps = 3, .model = {.backend = PI0_BACKEND_AUTO}};
    pi0_policy *pol = NULL;
    pi0_error err = {0};
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    FILE *f = fopen(obs, "rb");
    static uint8_t buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    pi0_observation ob;
    REQUIRE(pi0_observation_decode(buf, n, &ob, &err) == PI0_OK, "%s", err.message);
    const pi0_observation *list[1] = {&ob};
    uint64_t seed = 9;
    pi0_policy_result r;
    REQUIRE(pi0_policy_infer(pol, list, &seed, 1, &r, NULL, &err) == PI0_OK && r.error.status == PI0_OK);
    CHECK(!memcmp(r.actions, actions, 70 * sizeof(double)), "pi0 infer differs from pi0_policy_infer");
    pi0_policy_result_free(&r);
    pi0_observation_free(&ob);
    pi0_policy_free(pol);

    /* another seed, other actions; the same seed, the same actions */
    double *again = NULL;
    REQUIRE(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --steps 3 --seed 10 --quiet --output %s",
                    ck, obs, out) == 0);
    REQUIRE(read_reply(out, &again, shape, &infer_ms) == 0);
    CHECK(memcmp(again, actions, 70 * sizeof(double)) != 0, "--seed ignored");
    free(again);
    REQUIRE(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --steps 3 --seed 9 --quiet --output %s",
                    ck, obs, out) == 0);
    REQUIRE(read_reply(out, &again, shape, &infer_ms) == 0);
    CHECK(!memcmp(again, actions, 70 * sizeof(double)), "the same seed gave other actions");
    free(again);
    /* --quantile-norm: the library's quantile mode, other actions than z-score */
    REQUIRE(run_pi0(NULL, 0, "infer --checkpoint %s --adapter libero --obs %s --steps 3 --seed 9 --quiet --quantile-norm "
                    "--output %s", ck, obs, out) == 0, "%s", last_stderr());
    REQUIRE(read_reply(out, &again, shape, &infer_ms) == 0);
    opts.norm_mode = PI0_NORM_QUANTILE;
    REQUIRE(pi0_policy_open(&opts, &pol, &err) == PI0_OK, "%s", err.message);
    f = fopen(obs, "rb");
    n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    REQUIRE(pi0_observation_decode(buf, n, &ob, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_policy_infer(pol, list, &seed, 1, &r, NULL, &err) == PI0_OK && r.error.status == PI0_OK);
    CHECK(memcmp(again, actions, 70 * sizeof(double)) != 0, "--quantile-norm ignored");
    CHECK(!memcmp(r.actions, again, 70 * sizeof(double)), "--quantile-norm differs from the library's quantile mode");
    pi0_policy_result_free(&r);
    pi0_observation_free(&ob);
    pi0_policy_free(pol);
    free(again);
    free(actions);
}

TEST(droid_and_generic_adapters) {
    const char *ck = checkpoint(), *obs = write_droid_obs("droid.msgpack");
    static char text[1 << 16];
    REQUIRE(obs);
    int rc = run_pi0(text, sizeof text, "infer --checkpoint %s --adapter droid --obs %s --steps 2 --json --quiet", ck, obs);
    REQUIRE(rc == 0, "exit %d: %s", rc, last_stderr());
    json_t *o = parse_json(text);
    REQUIRE(o);
    json_t *rows = json_object_get(o, "actions");
    CHECK(json_array_size(rows) == 10 && json_array_size(json_array_get(rows, 9)) == 8, "DROID returns 8 dims");

    /* the same robot through a generic adapter file: the same actions */
    const char *adapter = keep_path("droid_like.json");
    FILE *f = fopen(adapter, "w");
    REQUIRE(f);
    fputs("{\"name\": \"droid_like\",\n"
          " \"cameras\": [\"observation/exterior_image_1_left\", \"observation/wrist_image_left\", null],\n"
          " \"state\": [\"observation/joint_position\", \"observation/gripper_position\"], \"action_dims\": 8}\n", f);
    fclose(f);
    static char text2[1 << 16];
    rc = run_pi0(text2, sizeof text2, "infer --checkpoint %s --adapter %s --obs %s --steps 2 --json --quiet", ck, adapter,
                 obs);
    REQUIRE(rc == 0, "exit %d: %s", rc, last_stderr());
    json_t *o2 = parse_json(text2);
    REQUIRE(o2);
    CHECK(json_equal(json_object_get(o2, "actions"), rows), "generic adapter differs from droid:\n%s\n%s", text, text2);
    json_decref(o2);
    rc = run_pi0(text2, sizeof text2, "infer --checkpoint %s --adapter %s --obs %s --steps 2 --quiet", ck, adapter, obs);
    CHECK(rc == 0 && strstr(text2, "adapter droid_like"), "%s", text2);
    json_decref(o);
    /* a generic adapter with an error names the file and the key */
    f = fopen(adapter, "w");
    fputs("{\"cameras\": [\"a\"], \"state\": [\"b\"], \"action_dims\": \"8\"}", f);
    fclose(f);
    CHECK(run_pi0(NULL, 0, "infer --checkpoint %s --adapter %s --obs %s --quiet", ck, adapter, obs) == 1 &&
              strstr(last_stderr(), adapter) && strstr(last_stderr(), "action_dims"), "%s", last_stderr());
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(help_and_usage_errors);
    RUN(missing_and_bad_files);
    RUN(libero_table_json_and_output);
    RUN(droid_and_generic_adapters);
    return check_finish();
}
