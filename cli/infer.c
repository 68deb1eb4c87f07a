/* infer.c - `pi0 infer`: one robot observation (msgpack, as an openpi client sends it) to actions. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"
#include "pi0_policy.h"
#include "server/msgpack_numpy.h"
#include "util/clock.h"
#include "util/error.h"

static const char *help =
    "usage: pi0 infer --checkpoint DIR --adapter NAME|FILE --obs OBS.msgpack [--output OUT.msgpack]\n"
    "                 [--tokenizer PATH] [--norm-stats PATH] [--norm zscore|quantile] [--steps N] [--horizon N]\n"
    "                 [--seed N]"
    "                 [--backend auto|cpu|cuda] [--json] [--quiet]\n"
    "\n"
    "Runs openpi's Policy.infer on one observation: the adapter picks the cameras, state and prompt;\n"
    "images are resized with padding to the model's size, the state is normalized, the prompt tokenized;\n"
    "the actions come back unnormalized, cut to the robot's action dims, as float64.\n"
    "\n"
    "  --adapter NAME|FILE  libero, droid, or a generic adapter JSON file:\n"
    "                       {\"cameras\": [\"top\", \"wrist\", null], \"state\": [\"joints\", \"gripper\"],\n"
    "                        \"prompt\": \"prompt\", \"default_prompt\": \"...\", \"action_dims\": 7}\n"
    "  --obs FILE           the observation dict as msgpack with numpy arrays (openpi_client.msgpack_numpy)\n"
    "  --output FILE        also write the reply as `pi0 serve` sends it:\n"
    "                       {\"actions\": float64 (H, dims), \"policy_timing\": {\"infer_ms\": ...}}\n"
    "  --tokenizer PATH     default: DIR/paligemma_tokenizer.model, then\n"
    "                       ~/.cache/openpi/big_vision/paligemma_tokenizer.model\n"
    "  --norm-stats PATH    default: the one norm_stats.json under DIR/assets/\n"
    "  --norm MODE          zscore or quantile (q01/q99, openpi's use_quantile_norm); default: the model's\n"
    "                       own, z-score for Pi0 and quantile for Pi0.5 as openpi's configs (--quantile-norm:\n"
    "                       the same as --norm quantile)\n"
    "  --horizon N          action steps (default: config.json's action_horizon, else the adapter's)\n"
    "  --steps N            Euler steps (default 10)\n"
    "  --seed N             noise seed (default 0); `pi0 serve --seed N` answers the same observation alike\n"
    "  --json               print {\"actions\": [[...]], \"infer_ms\": ...} instead of a table\n"
    "  --quiet              no load progress on stderr\n";

#define MAX_OBS_BYTES ((size_t)1 << 30)

static pi0_status read_file(const char *path, uint8_t **data, size_t *size, pi0_error *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return pi0_fail(err, PI0_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    struct stat s;
    if (fstat(fileno(f), &s) || !S_ISREG(s.st_mode) || (size_t)s.st_size > MAX_OBS_BYTES) {
        fclose(f);
        return pi0_fail(err, PI0_ERR_IO, "%s is not a regular file of at most 1 GiB", path);
    }
    *size = (size_t)s.st_size;
    *data = malloc(*size + 1);
    size_t got = *data ? fread(*data, 1, *size, f) : 0;
    fclose(f);
    if (!*data) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory reading %s", path);
    if (got != *size) return pi0_fail(err, PI0_ERR_IO, "cannot read %s", path);
    return PI0_OK;
}

static pi0_status load_observation(const char *path, pi0_observation *obs, pi0_error *err) {
    uint8_t *data = NULL;
    size_t size = 0;
    pi0_status st = read_file(path, &data, &size, err);
    if (!st) {
        pi0_error inner = {0};
        if ((st = pi0_observation_decode(data, size, obs, &inner))) pi0_fail(err, st, "%s: %s", path, inner.message);
    }
    free(data);
    return st;
}

/* The reply `pi0 serve` sends, without its server_timing. */
static pi0_status write_reply(const char *path, const pi0_policy_result *r, double infer_ms, pi0_error *err) {
    pi0_packer pk = {0};
    pi0_pack_policy_reply(&pk, r, infer_ms, 0);
    pi0_status st = PI0_OK;
    FILE *f = NULL;
    if (pk.failed) st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory packing the reply");
    else if (!(f = fopen(path, "wb"))) st = pi0_fail(err, PI0_ERR_IO, "cannot create %s: %s", path, strerror(errno));
    else if (fwrite(pk.data, 1, pk.size, f) != pk.size) st = pi0_fail(err, PI0_ERR_IO, "cannot write %s", path);
    if (f && fclose(f) && !st) st = pi0_fail(err, PI0_ERR_IO, "cannot write %s: %s", path, strerror(errno));
    pi0_packer_free(&pk);
    return st;
}

/* The reply as JSON. An action that is not finite is refused by name: json_real gives NULL for it, which
 * json_array_append_new would turn into a silently missing element. */
static int print_reply_json(const pi0_policy_result *r, double infer_ms) {
    json_t *rows = json_array();
    for (int t = 0; t < r->horizon; t++) {
        json_t *row = json_array();
        json_array_append_new(rows, row);
        for (int a = 0; a < r->action_dims; a++) {
            double x = r->actions[t * r->action_dims + a];
            if (json_array_append_new(row, json_real(x))) {
                pi0_error err;
                pi0_fail(&err, PI0_ERR_NUMERIC, "action step %d, dim %d is %g, which JSON cannot hold", t, a, x);
                json_decref(rows);
                return run_error("infer", &err);
            }
        }
    }
    return print_json("infer", json_pack("{s:o,s:f}", "actions", rows, "infer_ms", infer_ms),
                      JSON_PRESERVE_ORDER | JSON_COMPACT);
}

static void print_table(const pi0_policy_result *r, const char *adapter, double infer_ms) {
    printf("actions (%d steps x %d dims, adapter %s) in %.1f ms\n", r->horizon, r->action_dims, adapter, infer_ms);
    printf("step");
    for (int a = 0; a < r->action_dims; a++) printf(" %10d", a);
    printf("\n");
    for (int t = 0; t < r->horizon; t++) {
        printf("%4d", t);
        for (int a = 0; a < r->action_dims; a++) printf(" %10.5f", r->actions[t * r->action_dims + a]);
        printf("\n");
    }
}

int cmd_infer(int argc, char **argv) {
    const char *obs_path = NULL, *output = NULL, *backend_name = "auto", *norm = NULL;
    pi0_policy_options opts = {0};
    long long steps = 10, seed = 0, horizon = 0;
    int json = 0, quiet = 0, r, bad;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return fputs(help, stdout), EXIT_OK;
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if (!strcmp(argv[i], "--quiet")) { quiet = 1; continue; }
        if (!strcmp(argv[i], "--quantile-norm")) { opts.norm_mode = PI0_NORM_QUANTILE; continue; }
        if ((r = flag_value(argc, argv, &i, "--checkpoint", &opts.checkpoint)) ||
            (r = flag_value(argc, argv, &i, "--adapter", &opts.adapter)) ||
            (r = flag_value(argc, argv, &i, "--obs", &obs_path)) || (r = flag_value(argc, argv, &i, "--output", &output)) ||
            (r = flag_value(argc, argv, &i, "--tokenizer", &opts.tokenizer)) ||
            (r = flag_value(argc, argv, &i, "--norm-stats", &opts.norm_stats)) ||
            (r = flag_value(argc, argv, &i, "--backend", &backend_name)) || (r = flag_value(argc, argv, &i, "--norm", &norm))) {
            if (r < 0) return usage_error("infer", "%s needs a value", argv[i]);
            continue;
        }
        const int_flag ints[] = {{"--steps", 1, PI0_MAX_STEPS, &steps}, {"--seed", 0, INT64_MAX, &seed},
                                 {"--horizon", 1, PI0_MAX_HORIZON, &horizon}}, *f;
        if ((f = int_flag_value(argc, argv, &i, ints, 3, &bad))) {
            if (bad) return int_flag_error("infer", f);
            continue;
        }
        return usage_error("infer", "unknown option '%s'", argv[i]);
    }
    if (!opts.checkpoint || !opts.adapter || !obs_path)
        return usage_error("infer", "--checkpoint, --adapter and --obs are required");
    if (pi0_backend_from_name(backend_name, &opts.model.backend))
        return usage_error("infer", "unknown backend '%s'", backend_name);
    if (norm && norm_mode_from_name(norm, &opts.norm_mode)) return usage_error("infer", "--norm takes zscore or quantile");
    opts.num_steps = (int)steps;
    opts.horizon = (int)horizon;
    int last_percent = -1;
    opts.model.progress = quiet ? NULL : progress_to_stderr;
    opts.model.progress_user = &last_percent;

    pi0_error err = {0};
    pi0_observation obs = {0};
    pi0_policy *policy = NULL;
    pi0_policy_result result = {0};
    int rc = EXIT_OK;
    double t0 = pi0_now_ms(), infer_ms = 0;
    /* the observation first: a bad file fails before the weights are read */
    if (load_observation(obs_path, &obs, &err) || pi0_policy_open(&opts, &policy, &err)) {
        rc = run_error("infer", &err);
        goto done;
    }
    if (!quiet)
        fprintf(stderr, "policy ready: adapter %s, %.2fM parameters, %s backend, %.1f s\n", pi0_policy_adapter_name(policy),
                pi0_model_num_params(pi0_policy_model(policy)) / 1e6,
                pi0_backend_name(pi0_model_backend(pi0_policy_model(policy))), (pi0_now_ms() - t0) / 1e3);
    const pi0_observation *batch[1] = {&obs};
    uint64_t seeds[1] = {(uint64_t)seed};
    if (pi0_policy_infer(policy, batch, seeds, 1, &result, &infer_ms, &err)) {
        rc = run_error("infer", &err);
        goto done;
    }
    if (result.error.status) {
        pi0_fail(&err, result.error.status, "%s: %s", obs_path, result.error.message);
        rc = run_error("infer", &err);
        goto done;
    }
    if (output && write_reply(output, &result, infer_ms, &err)) {
        rc = run_error("infer", &err);
        goto done;
    }
    if (json) rc = print_reply_json(&result, infer_ms);
    else print_table(&result, pi0_policy_adapter_name(policy), infer_ms);
done:
    pi0_policy_result_free(&result);
    pi0_policy_free(policy);
    pi0_observation_free(&obs);
    return rc;
}
