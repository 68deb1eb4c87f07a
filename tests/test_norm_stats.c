/* test_norm_stats.c - norm_stats.json parsing and openpi's Normalize / Unnormalize formulas. */
#include <stdint.h>
#include <unistd.h>

#include "check.h"
#include "policy/norm_stats.h"

/* The statistics of every golden value below; "extra" is a key openpi would also keep. */
static const char *STATS_JSON =
    "{\n"
    "  \"norm_stats\": {\n"
    "    \"state\": {\"mean\": [0.5, -1.25, 3, 100.0, 0.1], \"std\": [2.0, 0.1, 0.0, 1e-3, 0.001],\n"
    "              \"q01\": [-1.0, -2.0, 0.0, 99.0, 0.05], \"q99\": [1.0, 0.5, 0.0, 101.0, 0.15]},\n"
    "    \"actions\": {\"mean\": [0.5, -1.25], \"std\": [2.0, 0.1], \"q01\": null},\n"
    "    \"extra\": {\"mean\": [7], \"std\": [1], \"q01\": [0], \"q99\": [9], \"num_samples\": 12}\n"
    "  }\n"
    "}\n";

/*
 * Expected values from numpy with openpi's float64 stats (transforms.py), e.g. for z-score:
 *   x = np.array([1.0, -1.0, 3.0, 100.5, 0.1], np.float32)
 *   ((x - mean) / (std + 1e-6)).astype(np.float32)
 * In float32 arithmetic entries 3 and 4 would be 499.500458f and 0.0f instead.
 */
static const float X[5] = {1.0f, -1.0f, 3.0f, 100.5f, 0.1f};
static const float ZSCORE[5] = {0.249999881f, 2.49997497f, 0.0f, 499.500488f, 1.4886275e-06f};
static const float QUANTILE[5] = {0.999998987f, -0.200000316f, 5999999.0f, 0.499999255f, -9.97009829e-06f};
static const float A[5] = {0.25f, -0.5f, 1.5f, -2.0f, 0.75f};
static const float UNNORM_ZSCORE[5] = {1.00000024f, -1.30000055f, 3.00000143f, 99.9980011f, 0.100750752f};
static const float UNNORM_QUANTILE[5] = {0.250000626f, -1.37499976f, 1.24999997e-06f, 98.0f, 0.137500882f};
/* Unnormalize of A[0..4) with the 2-value "actions" stats: pad_to_dim (mean 0, std 1) / pass-through. */
static const float UNNORM_ZSCORE_PADDED[4] = {1.00000024f, -1.30000055f, 1.50000155f, -2.00000191f};

static char tmp_dir[64];

/* Writes `text` to tmp_dir/name and returns the path (static storage, valid until the next call). */
/* The float-vector view the checks below are written in: normalize x in place (through float64, as a
 * robot's float32 values reach numpy), unnormalize in place (rounding the float64 result to float). */
static pi0_status normalize_f(const pi0_norm_entry *e, pi0_norm_mode mode, float *x, int n, pi0_error *err) {
    double in[16] = {0}, out[16];
    for (int i = 0; x && i < n && i < 16; i++) in[i] = x[i];
    pi0_status st = pi0_normalize(e, mode, x ? in : NULL, x ? out : NULL, n, err);
    for (int i = 0; !st && i < n; i++) x[i] = (float)out[i];
    return st;
}

static pi0_status unnormalize_f(const pi0_norm_entry *e, pi0_norm_mode mode, float *x, int n, pi0_error *err) {
    double out[16];
    pi0_status st = pi0_unnormalize(e, mode, x, x ? out : NULL, n, err);
    for (int i = 0; !st && i < n; i++) x[i] = (float)out[i];
    return st;
}

static const char *write_file(const char *name, const char *text) {
    static char path[256];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    FILE *f = fopen(path, "wb");
    if (f) {
        fputs(text, f);
        fclose(f);
    }
    return path;
}

static int load_stats(pi0_norm_stats *s) {
    pi0_error err = {0};
    pi0_status st = pi0_norm_stats_load(write_file("norm_stats.json", STATS_JSON), s, &err);
    if (st != PI0_OK) fprintf(stderr, "  load failed: %s\n", err.message);
    return st == PI0_OK;
}

static int same_bits(const float *a, const float *b, int n) {
    return memcmp(a, b, (size_t)n * sizeof *a) == 0;
}

static void test_load_keeps_every_key(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    CHECK(s.count == 3, "count %d", s.count);
    const pi0_norm_entry *state = pi0_norm_stats_find(&s, "state");
    const pi0_norm_entry *actions = pi0_norm_stats_find(&s, "actions");
    const pi0_norm_entry *extra = pi0_norm_stats_find(&s, "extra");
    REQUIRE(state && actions && extra, "state, actions and extra must all be found");
    CHECK(state->dim == 5 && actions->dim == 2 && extra->dim == 1, "dims %d %d %d", state->dim, actions->dim,
          extra->dim);
    CHECK(state->mean[2] == 3.0 && state->std[3] == 1e-3 && state->q99[3] == 101.0, "values differ from the JSON");
    CHECK(state->mean[4] == 0.1, "stats are kept as the JSON's doubles");
    CHECK(actions->q01 == NULL && actions->q99 == NULL, "null and absent quantiles are both absent");
    CHECK(extra->q99 && extra->q99[0] == 9.0, "extra.q99 not kept");
    CHECK(pi0_norm_stats_find(&s, "missing") == NULL, "an unknown key must not be found");
    pi0_norm_stats_free(&s);
    CHECK(s.count == 0 && s.entries == NULL, "free must leave the struct empty");
}

static void test_normalize_matches_numpy(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    const pi0_norm_entry *state = pi0_norm_stats_find(&s, "state");
    float z[5], q[5];
    memcpy(z, X, sizeof z);
    memcpy(q, X, sizeof q);
    CHECK(normalize_f(state, PI0_NORM_ZSCORE, z, 5, NULL) == PI0_OK, "z-score normalize failed");
    CHECK(normalize_f(state, PI0_NORM_QUANTILE, q, 5, NULL) == PI0_OK, "quantile normalize failed");
    CHECK(same_bits(z, ZSCORE, 5), "z-score: %.9g %.9g %.9g %.9g %.9g", z[0], z[1], z[2], z[3], z[4]);
    CHECK(same_bits(q, QUANTILE, 5), "quantile: %.9g %.9g %.9g %.9g %.9g", q[0], q[1], q[2], q[3], q[4]);
    pi0_norm_stats_free(&s);
}

static void test_unnormalize_matches_numpy(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    const pi0_norm_entry *state = pi0_norm_stats_find(&s, "state");
    float z[5], q[5];
    memcpy(z, A, sizeof z);
    memcpy(q, A, sizeof q);
    CHECK(unnormalize_f(state, PI0_NORM_ZSCORE, z, 5, NULL) == PI0_OK, "z-score unnormalize failed");
    CHECK(unnormalize_f(state, PI0_NORM_QUANTILE, q, 5, NULL) == PI0_OK, "quantile unnormalize failed");
    CHECK(same_bits(z, UNNORM_ZSCORE, 5), "z-score: %.9g %.9g %.9g %.9g %.9g", z[0], z[1], z[2], z[3], z[4]);
    CHECK(same_bits(q, UNNORM_QUANTILE, 5), "quantile: %.9g %.9g %.9g %.9g %.9g", q[0], q[1], q[2], q[3], q[4]);
    pi0_norm_stats_free(&s);
}

/* Normalize then unnormalize returns the input up to float rounding, in both modes. */
static void test_round_trip(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    const pi0_norm_entry *state = pi0_norm_stats_find(&s, "state");
    uint32_t seed = 12345;
    for (int mode = PI0_NORM_ZSCORE; mode <= PI0_NORM_QUANTILE; mode++) {
        for (int trial = 0; trial < 100; trial++) {
            float x[2], y[2];
            for (int i = 0; i < 2; i++) {
                seed = seed * 1664525u + 1013904223u;
                x[i] = (float)((seed >> 8) / 16777216.0 * 20.0 - 10.0);
            }
            memcpy(y, x, sizeof y);
            CHECK(normalize_f(state, (pi0_norm_mode)mode, y, 2, NULL) == PI0_OK, "normalize failed in mode %d", mode);
            CHECK(unnormalize_f(state, (pi0_norm_mode)mode, y, 2, NULL) == PI0_OK, "unnormalize failed in mode %d",
                  mode);
            for (int i = 0; i < 2; i++)
                CHECK(fabsf(y[i] - x[i]) <= 1e-5f * (1.0f + fabsf(x[i])), "%g -> %g", x[i], y[i]);
        }
    }
    pi0_norm_stats_free(&s);
}

static void test_stats_longer_than_vector_use_prefix(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    const pi0_norm_entry *state = pi0_norm_stats_find(&s, "state");
    float z[3], u[3];
    memcpy(z, X, sizeof z);
    memcpy(u, A, sizeof u);
    CHECK(normalize_f(state, PI0_NORM_ZSCORE, z, 3, NULL) == PI0_OK, "normalize of a prefix failed");
    CHECK(unnormalize_f(state, PI0_NORM_ZSCORE, u, 3, NULL) == PI0_OK, "unnormalize of a prefix failed");
    CHECK(same_bits(z, ZSCORE, 3) && same_bits(u, UNNORM_ZSCORE, 3), "a prefix must match the full vector");
    pi0_norm_stats_free(&s);
}

static void test_normalize_rejects_short_stats(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    float x[6] = {0};
    pi0_error err = {0};
    pi0_status st = normalize_f(pi0_norm_stats_find(&s, "state"), PI0_NORM_ZSCORE, x, 6, &err);
    CHECK(st == PI0_ERR_INVALID_ARGUMENT, "a 6-vector against 5 stats must fail");
    CHECK(strstr(err.message, "5 values") && strstr(err.message, "has 6"), "message: %s", err.message);
    pi0_norm_stats_free(&s);
}

/* openpi's Unnormalize accepts the model's padded vector against the robot's shorter stats. */
static void test_unnormalize_pads_like_openpi(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    const pi0_norm_entry *extra = pi0_norm_stats_find(&s, "extra");
    const pi0_norm_entry *actions = pi0_norm_stats_find(&s, "actions");
    float z[4], q[3] = {0.5f, -3.0f, 2.0f};
    memcpy(z, A, sizeof z);
    CHECK(unnormalize_f(actions, PI0_NORM_ZSCORE, z, 4, NULL) == PI0_OK, "padded z-score unnormalize failed");
    CHECK(same_bits(z, UNNORM_ZSCORE_PADDED, 4), "%.9g %.9g %.9g %.9g", z[0], z[1], z[2], z[3]);
    CHECK(unnormalize_f(extra, PI0_NORM_QUANTILE, q, 3, NULL) == PI0_OK, "padded quantile unnormalize failed");
    /* (0.5 + 1) / 2 * (9 - 0 + 1e-6) + 0, then the rest passed through. */
    CHECK(q[0] == (float)(1.5 / 2.0 * (9.0 + 1e-6)) && q[1] == -3.0f && q[2] == 2.0f, "%.9g %g %g", q[0], q[1], q[2]);
    pi0_norm_stats_free(&s);
}

static void test_quantile_needs_quantiles(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    float x[2] = {1, 2};
    pi0_error err = {0};
    const pi0_norm_entry *actions = pi0_norm_stats_find(&s, "actions");
    CHECK(normalize_f(actions, PI0_NORM_QUANTILE, x, 2, &err) == PI0_ERR_INVALID_ARGUMENT,
          "quantile normalize without q01/q99 must fail");
    CHECK(strstr(err.message, "q01") && strstr(err.message, "actions"), "message: %s", err.message);
    CHECK(unnormalize_f(actions, PI0_NORM_QUANTILE, x, 2, &err) == PI0_ERR_INVALID_ARGUMENT,
          "quantile unnormalize without q01/q99 must fail");
    CHECK(x[0] == 1 && x[1] == 2, "a failed call leaves the vector alone");
    pi0_norm_stats_free(&s);
}

static void test_bad_arguments(void) {
    pi0_norm_stats s;
    REQUIRE(load_stats(&s), "norm_stats.json did not load");
    const pi0_norm_entry *state = pi0_norm_stats_find(&s, "state");
    float x[1] = {0};
    CHECK(normalize_f(NULL, PI0_NORM_ZSCORE, x, 1, NULL) == PI0_ERR_INVALID_ARGUMENT, "NULL stats");
    CHECK(normalize_f(state, PI0_NORM_ZSCORE, NULL, 1, NULL) == PI0_ERR_INVALID_ARGUMENT, "NULL vector with n > 0");
    CHECK(normalize_f(state, PI0_NORM_ZSCORE, x, -1, NULL) == PI0_ERR_INVALID_ARGUMENT, "negative n");
    CHECK(unnormalize_f(state, (pi0_norm_mode)7, x, 1, NULL) == PI0_ERR_INVALID_ARGUMENT, "unknown mode");
    CHECK(normalize_f(state, PI0_NORM_ZSCORE, NULL, 0, NULL) == PI0_OK, "an empty vector is fine");
    CHECK(pi0_norm_stats_load(NULL, &s, NULL) == PI0_ERR_INVALID_ARGUMENT, "NULL path");
    pi0_norm_stats_free(&s);
}

static void test_malformed_files(void) {
    static const struct {
        const char *json, *message;
    } cases[] = {
        {"", "invalid JSON"},
        {"{\n  \"norm_stats\": {\n    \"state\": {\"mean\": [1, 2,,]}}}\n", ":3:"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [NaN], \"std\": [1]}}}", "invalid JSON"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [1e999], \"std\": [1]}}}", "invalid JSON"},
        {"[1, 2]", "no top-level \"norm_stats\""},
        {"{\"stats\": {}}", "no top-level \"norm_stats\""},
        {"{\"norm_stats\": [1]}", "\"norm_stats\" is an array"},
        {"{\"norm_stats\": {\"state\": 3}}", "norm_stats.state is a number"},
        {"{\"norm_stats\": {\"state\": {\"std\": [1]}}}", "norm_stats.state has no \"mean\""},
        {"{\"norm_stats\": {\"state\": {\"mean\": [1]}}}", "has no \"std\""},
        {"{\"norm_stats\": {\"state\": {\"mean\": [1], \"std\": \"1\"}}}", "state.std is a string"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [1, \"2\"], \"std\": [1, 1]}}}", "state.mean[1] is a string"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [null], \"std\": [1]}}}", "state.mean[0] is null"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [[1]], \"std\": [1]}}}", "state.mean[0] is an array"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [], \"std\": []}}}", "has 0 values"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [1, 2, 3], \"std\": [1, 2]}}}", "std has 2 values but mean has 3"},
        {"{\"norm_stats\": {\"a\": {\"mean\": [1], \"std\": [1]},"
         " \"b\": {\"mean\": [1], \"std\": [1], \"q99\": [1, 2]}}}",
         "norm_stats.b.q99 has 2 values but mean has 1"},
        /* values the transforms cannot use: refused naming the file, the key and the index */
        {"{\"norm_stats\": {\"state\": {\"mean\": [1, 2], \"std\": [1, -0.5]}}}",
         "bad.json: norm_stats.state.std[1] is -0.5"},
        {"{\"norm_stats\": {\"actions\": {\"mean\": [0, 0], \"std\": [1, 1], \"q01\": [0, 2], \"q99\": [1, 1]}}}",
         "bad.json: norm_stats.actions.q01[1] is 2 and q99[1] is 1"},
        {"{\"norm_stats\": {\"state\": {\"mean\": [0], \"std\": [1], \"q01\": [-1e308], \"q99\": [1e308]}}}",
         "norm_stats.state.q01[0] is -1e+308 and q99[0] is 1e+308: q01 must be <= q99, and q99 - q01 finite"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pi0_norm_stats s = {.count = 99};
        pi0_error err = {0};
        pi0_status st = pi0_norm_stats_load(write_file("bad.json", cases[i].json), &s, &err);
        CHECK(st == PI0_ERR_FORMAT, "case %zu: status %d (%s)", i, (int)st, err.message);
        CHECK(strstr(err.message, cases[i].message), "case %zu: message \"%s\" lacks \"%s\"", i, err.message,
              cases[i].message);
        CHECK(s.count == 0 && s.entries == NULL, "case %zu: output not left empty", i);
    }
    pi0_norm_stats s;
    pi0_error err = {0};
    char missing[128];
    snprintf(missing, sizeof missing, "%s/does_not_exist.json", tmp_dir);
    CHECK(pi0_norm_stats_load(missing, &s, &err) == PI0_ERR_IO, "a missing file is an I/O error: %s", err.message);
    CHECK(strstr(err.message, "does_not_exist.json"), "message: %s", err.message);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    snprintf(tmp_dir, sizeof tmp_dir, "/tmp/pi0_test_norm_stats_XXXXXX");
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_load_keeps_every_key);
    RUN(test_normalize_matches_numpy);
    RUN(test_unnormalize_matches_numpy);
    RUN(test_round_trip);
    RUN(test_stats_longer_than_vector_use_prefix);
    RUN(test_normalize_rejects_short_stats);
    RUN(test_unnormalize_pads_like_openpi);
    RUN(test_quantile_needs_quantiles);
    RUN(test_bad_arguments);
    RUN(test_malformed_files);
    char path[128];
    snprintf(path, sizeof path, "%s/norm_stats.json", tmp_dir);
    unlink(path);
    snprintf(path, sizeof path, "%s/bad.json", tmp_dir);
    unlink(path);
    rmdir(tmp_dir);
    return check_finish();
}
