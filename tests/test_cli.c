/*
 * test_cli.c - the `pi0` command as a user runs it: exit codes, --help, `pi0 sample` against every
 * fixture's actions (per sample, 1e-4), bad inputs, `inspect`, `init` and `bench --json`.
 * The binary comes from $PI0_BIN (default build/pi0).
 */
#include <jansson.h>
#include <sys/stat.h>
#include "check.h"
#include "cli_run.h"
#include "io/safetensors.h"

TEST(help_and_exit_codes) {
    char out[8192];
    CHECK(run_pi0(out, sizeof out, "--help") == 0 && strstr(out, "usage: pi0"), "pi0 --help");
    CHECK(run_pi0(NULL, 0, "%s", "") == 2, "no command must exit 2");
    CHECK(run_pi0(NULL, 0, "frobnicate") == 2 && strstr(last_stderr(), "unknown command"));
    const char *commands[] = {"sample", "bench", "inspect", "init", "convert"};
    for (int i = 0; i < 5; i++) {
        CHECK(run_pi0(out, sizeof out, "%s --help", commands[i]) == 0 && strstr(out, "usage: pi0"), "pi0 %s --help",
              commands[i]);
        CHECK(run_pi0(NULL, 0, "%s --no-such-flag", commands[i]) == 2, "pi0 %s with a bad flag must exit 2", commands[i]);
    }
    CHECK(run_pi0(NULL, 0, "sample --checkpoint x") == 2 && strstr(last_stderr(), "required"));
    CHECK(run_pi0(NULL, 0, "bench --steps 0") == 2 && strstr(last_stderr(), "--steps"));
    CHECK(run_pi0(NULL, 0, "bench --backend tpu") == 2 && strstr(last_stderr(), "unknown backend"));
}

/* ||a_b - r_b|| / ||r_b|| for every sample b; returns the worst. */
static double worst_sample_error(const float *a, const float *r, int batch, size_t per_sample) {
    double worst = 0;
    for (int b = 0; b < batch; b++) {
        double e = rel_error(a + b * per_sample, r + b * per_sample, per_sample);
        worst = e > worst ? e : worst;
    }
    return worst;
}

static void sample_matches_fixture(const char *name) {
    const char *steps_keys[3][2] = {{"10", "actions"}, {"3", "actions_3step"}, {"1", "actions_1step"}};
    for (int i = 0; i < 3; i++) {
        const char *out_path = test_path("actions.safetensors");
        int rc = run_pi0(NULL, 0, "sample --checkpoint %s/%s --inputs %s/%s/io.safetensors --output %s --steps %s --quiet",
                         fixtures_dir(), name, fixtures_dir(), name, out_path, steps_keys[i][0]);
        REQUIRE(rc == 0, "pi0 sample exited %d: %s", rc, last_stderr());
        char io_path[1024];
        snprintf(io_path, sizeof io_path, "%s/%s/io.safetensors", fixtures_dir(), name);
        st_file out, io;
        pi0_error err = {0};
        REQUIRE(st_open(out_path, &out, &err) == PI0_OK, "%s", err.message);
        REQUIRE(st_open(io_path, &io, &err) == PI0_OK, "%s", err.message);
        const st_tensor *a = st_find(&out, "actions"), *r = st_find(&io, steps_keys[i][1]);
        REQUIRE(a && r && a->numel == r->numel && a->rank == 3, "actions missing or mis-shaped");
        double e = worst_sample_error(a->data, r->data, (int)r->shape[0], (size_t)(r->shape[1] * r->shape[2]));
        fprintf(stderr, "  %s %s: worst per-sample rel error %.3g\n", name, steps_keys[i][1], e);
        CHECK(e <= 1e-4, "%s %s: %.3g", name, steps_keys[i][1], e);
        st_close(&out);
        st_close(&io);
    }
}

TEST(sample_pi0_tiny) { sample_matches_fixture("pi0_tiny"); }
TEST(sample_pi0_tiny_h50) { sample_matches_fixture("pi0_tiny_h50"); }
TEST(sample_pi05_tiny) { sample_matches_fixture("pi05_tiny"); }
TEST(sample_pi05_tiny_h50) { sample_matches_fixture("pi05_tiny_h50"); }

/* Writes a copy of the fixtures' file `leaf` to `path` with one tensor replaced (or dropped when data == NULL). */
static void write_fixture_with(const char *leaf, const char *path, const char *replace, st_dtype dtype, int rank,
                               const int64_t *shape, const void *data) {
    char from[1024];
    snprintf(from, sizeof from, "%s/%s", fixtures_dir(), leaf);
    st_file io;
    pi0_error err = {0};
    if (st_open(from, &io, &err)) return;
    st_writer w;
    st_writer_init(&w);
    for (int i = 0; i < io.num_tensors; i++) {
        const st_tensor *t = &io.tensors[i];
        if (strcmp(t->name, replace)) st_writer_add(&w, t->name, t->dtype, t->rank, t->shape, t->data, &err);
        else if (data) st_writer_add(&w, t->name, dtype, rank, shape, data, &err);
    }
    st_writer_write(&w, path, &err);
    st_writer_free(&w);
    st_close(&io);
}

TEST(sample_bad_inputs) {
    char in[512], out[512], ckpt[1024]; /* copies: test_path's buffers are reused by every run_pi0 */
    snprintf(in, sizeof in, "%s", test_path("bad_inputs.safetensors"));
    snprintf(out, sizeof out, "%s", test_path("bad_out.safetensors"));
    snprintf(ckpt, sizeof ckpt, "%s/pi0_tiny", fixtures_dir());
    static float small_image[2 * 100 * 100 * 3];
    write_fixture_with("pi0_tiny/io.safetensors", in, "image/base_0_rgb", ST_F32, 4, (int64_t[]){2, 100, 100, 3}, small_image);
    CHECK(run_pi0(NULL, 0, "sample --checkpoint %s --inputs %s --output %s --quiet", ckpt, in, out) == 1 &&
              strstr(last_stderr(), "image/base_0_rgb") && strstr(last_stderr(), "[2, 100, 100, 3]"),
          "%s", last_stderr());
    int32_t ids[2 * 16];
    for (int i = 0; i < 32; i++) ids[i] = 100000; /* beyond the 512-token vocabulary */
    write_fixture_with("pi0_tiny/io.safetensors", in, "tokenized_prompt", ST_I32, 2, (int64_t[]){2, 16}, ids);
    CHECK(run_pi0(NULL, 0, "sample --checkpoint %s --inputs %s --output %s --quiet", ckpt, in, out) == 1 &&
              strstr(last_stderr(), "100000") && strstr(last_stderr(), "vocabulary"),
          "%s", last_stderr());
    /* a noise of horizon 0: refused, since 0 in pi0_batch.horizon means the model's default (10 steps) */
    static float no_noise[1];
    write_fixture_with("pi0_tiny/io.safetensors", in, "noise", ST_F32, 3, (int64_t[]){2, 0, 32}, no_noise);
    CHECK(run_pi0(NULL, 0, "sample --checkpoint %s --inputs %s --output %s --quiet", ckpt, in, out) == 1 &&
              strstr(last_stderr(), "input noise has shape [2, 0, 32]: its horizon (axis 1) must be in 1..4096"),
          "%s", last_stderr());
    static float nan_noise[2 * 10 * 32] = {[2 * 10 * 32 - 1] = NAN};
    write_fixture_with("pi0_tiny/io.safetensors", in, "noise", ST_F32, 3, (int64_t[]){2, 10, 32}, nan_noise);
    CHECK(run_pi0(NULL, 0, "sample --checkpoint %s --inputs %s --output %s --quiet", ckpt, in, out) == 1 &&
              strstr(last_stderr(), "the noise of sample 1 is nan at step 9, dim 31"), "%s", last_stderr());
    write_fixture_with("pi0_tiny/io.safetensors", in, "state", ST_F32, 0, NULL, NULL);
    CHECK(run_pi0(NULL, 0, "sample --checkpoint %s --inputs %s --output %s --quiet", ckpt, in, out) == 1 &&
              strstr(last_stderr(), "state"), "%s", last_stderr());
    FILE *f = fopen(in, "w");
    fputs("this is not a safetensors file", f);
    fclose(f);
    CHECK(run_pi0(NULL, 0, "sample --checkpoint %s --inputs %s --output %s --quiet", ckpt, in, out) == 1 &&
              strstr(last_stderr(), "error:"), "%s", last_stderr());
    CHECK(run_pi0(NULL, 0, "sample --checkpoint /nonexistent --inputs %s --output %s --quiet", in, out) == 1 &&
              strstr(last_stderr(), "/nonexistent"), "%s", last_stderr());
}

/* A checkpoint whose weights give NaN actions: pi0 sample refuses to write them, naming where they are. */
TEST(sample_refuses_nonfinite_actions) {
    char dir[512], inputs[1024], out[600], cmd[2048];
    snprintf(dir, sizeof dir, "%s", test_path("nan_checkpoint"));
    snprintf(inputs, sizeof inputs, "%s/pi0_tiny/io.safetensors", fixtures_dir());
    snprintf(out, sizeof out, "%s/actions.safetensors", dir);
    snprintf(cmd, sizeof cmd, "mkdir -p %s && cp %s/pi0_tiny/config.json %s/", dir, fixtures_dir(), dir);
    REQUIRE(system(cmd) == 0);
    static float bias[32] = {[5] = NAN}; /* the Euler steps spread it to every dim */
    char model[600];
    snprintf(model, sizeof model, "%s/model.safetensors", dir);
    write_fixture_with("pi0_tiny/model.safetensors", model, "action_out_proj.bias", ST_F32, 1, (int64_t[]){32}, bias);
    CHECK(run_pi0(NULL, 0, "sample --checkpoint %s --inputs %s --output %s --steps 1 --quiet", dir, inputs, out) == 1 &&
              strstr(last_stderr(), "the actions of sample 0 are nan at step 0, dim 5: not writing") && access(out, F_OK),
          "%s", last_stderr());
}

static json_t *run_json(const char *fmt, const char *arg1, const char *arg2) {
    static char out[1 << 16];
    int rc = run_pi0(out, sizeof out, fmt, arg1, arg2);
    if (rc != 0) {
        fprintf(stderr, "  exit %d: %s\n", rc, last_stderr());
        return NULL;
    }
    json_error_t jerr;
    return json_loads(out, 0, &jerr);
}

TEST(inspect_fixture) {
    char ckpt[1024];
    snprintf(ckpt, sizeof ckpt, "%s/pi0_tiny", fixtures_dir());
    json_t *o = run_json("inspect --checkpoint %s --json%s", ckpt, "");
    REQUIRE(o, "inspect --json gave no JSON");
    CHECK(json_is_true(json_object_get(o, "loadable")));
    json_t *dims = json_object_get(o, "dims");
    CHECK(json_integer_value(json_object_get(json_object_get(dims, "llm"), "width")) == 64);
    CHECK(json_integer_value(json_object_get(json_object_get(dims, "expert"), "width")) == 48);
    CHECK(json_integer_value(json_object_get(json_object_get(dims, "vision"), "num_heads")) == 4);
    CHECK(json_integer_value(json_object_get(dims, "action_horizon")) == 10);
    CHECK(json_array_size(json_object_get(o, "missing")) == 0);
    json_t *params = json_object_get(o, "params");
    CHECK(json_integer_value(json_object_get(params, "total")) > 0);
    CHECK(!strcmp(json_string_value(json_object_get(o, "model")), "pi0"));
    json_decref(o);
    char out[1 << 14];
    CHECK(run_pi0(out, sizeof out, "inspect --checkpoint %s", ckpt) == 0 && strstr(out, "parameters:") &&
          strstr(out, "model: Pi0 ("));
    /* Pi0.5, told from its tensors, and why */
    snprintf(ckpt, sizeof ckpt, "%s/pi05_tiny", fixtures_dir());
    o = run_json("inspect --checkpoint %s --json%s", ckpt, "");
    REQUIRE(o);
    CHECK(!strcmp(json_string_value(json_object_get(o, "model")), "pi05") &&
          strstr(json_string_value(json_object_get(o, "model_reason")), "adaptive"));
    CHECK(json_is_true(json_object_get(o, "loadable")) && json_array_size(json_object_get(o, "unused")) == 0);
    CHECK(run_pi0(out, sizeof out, "inspect --checkpoint %s", ckpt) == 0 && strstr(out, "model: Pi0.5 ("), "%s", out);
    json_decref(o);
}

/* `pi0 init --model pi05` and `pi0 bench --model pi05` on tiny dims; a bad --model is a usage error. */
TEST(init_and_bench_pi05) {
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/pi05_tiny/config.json", fixtures_dir());
    const char *dir = test_path("init_pi05");
    CHECK(run_pi0(NULL, 0, "init --model pi05 --dims %s --output %s", cfg, dir) == 0, "%s", last_stderr());
    json_t *o = run_json("inspect --checkpoint %s --json%s", dir, "");
    REQUIRE(o);
    CHECK(!strcmp(json_string_value(json_object_get(o, "model")), "pi05") && json_is_true(json_object_get(o, "loadable")));
    json_decref(o);
    o = run_json("bench --model pi05 --dims %s --iters 2 --warmup 0 --prompt-len 30 --horizon 15 --json%s", cfg, "");
    REQUIRE(o, "bench --model pi05 gave no JSON");
    CHECK(!strcmp(json_string_value(json_object_get(o, "model")), "pi05") && json_integer_value(json_object_get(o, "horizon")) == 15);
    json_decref(o);
    CHECK(run_pi0(NULL, 0, "bench --model pi06") == 2 && strstr(last_stderr(), "pi05"), "%s", last_stderr());
    CHECK(run_pi0(NULL, 0, "init --output %s --model x", dir) == 2);
}

TEST(init_then_bench_json) {
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/pi0_tiny/config.json", fixtures_dir());
    const char *dir = test_path("init_ckpt");
    CHECK(run_pi0(NULL, 0, "init --dims %s --output %s --seed 3 --bf16", cfg, dir) == 0, "%s", last_stderr());
    json_t *o = run_json("inspect --checkpoint %s --json%s", dir, "");
    REQUIRE(o);
    CHECK(json_object_get(json_object_get(o, "dtypes"), "BF16") != NULL, "init --bf16 did not store BF16");
    json_decref(o);
    o = run_json("bench --checkpoint %s --warmup 1 --iters 3 --batch 2 --json%s", dir, "");
    REQUIRE(o, "bench --json gave no JSON");
    json_t *lat = json_object_get(o, "latency_ms");
    double p50 = json_real_value(json_object_get(lat, "p50")), min = json_real_value(json_object_get(lat, "min"));
    double max = json_real_value(json_object_get(lat, "max"));
    CHECK(min > 0 && min <= p50 && p50 <= max, "latencies min %g p50 %g max %g", min, p50, max);
    CHECK(json_integer_value(json_object_get(o, "batch")) == 2);
    CHECK(json_real_value(json_object_get(o, "samples_per_s")) > 0);
    CHECK(json_object_get(json_object_get(o, "stages_ms"), "denoise") != NULL);
    double load_s = json_real_value(json_object_get(o, "load_s")), host = json_real_value(json_object_get(o, "host_memory_after_load_gb"));
    CHECK(load_s > 0 && host > 0 && host < 1, "load %g s, host memory after load %g GB", load_s, host);
    json_decref(o);
    o = run_json("bench --dims %s --iters 2 --warmup 0 --masked-cameras 0 --json%s", cfg, "");
    CHECK(o != NULL, "bench on random weights of given dims");
    json_decref(o);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(help_and_exit_codes);
    RUN(sample_pi0_tiny);
    RUN(sample_pi0_tiny_h50);
    RUN(sample_pi05_tiny);
    RUN(sample_pi05_tiny_h50);
    RUN(sample_bad_inputs);
    RUN(sample_refuses_nonfinite_actions);
    RUN(inspect_fixture);
    RUN(init_then_bench_json);
    RUN(init_and_bench_pi05);
    return check_finish();
}
