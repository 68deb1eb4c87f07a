/*
 * fuzz_json.c - libFuzzer harness for the JSON files the library reads. The first byte picks the reader, the rest
 * is the file: 0 a dims file (config_load_dims, `--dims`), 1 norm_stats.json (then Normalize / Unnormalize of every
 * entry in both modes), 2 a generic adapter file, 3 a checkpoint's config.json next to a micro model.safetensors
 * (config_derive_dims). Seeds: what `pi0 init` writes, tests/make_policy_checkpoint.sh's norm stats, an adapter.
 */
#include "fuzz.h"
#include "model/checkpoint.h"
#include "model/config.h"
#include "policy/adapter.h"
#include "policy/norm_stats.h"

enum { DIMS_FILE, NORM_STATS, ADAPTER, CHECKPOINT_CONFIG, NUM_READERS };

static const char *NORM_STATS_SEED =
    "{\"norm_stats\": {\"state\": {\"mean\": [-0.05, 0.03, 0.8, 3.1, -0.2, 0.1, 0.02, -0.02],\n"
    "  \"std\": [0.1, 0.15, 0.12, 0.4, 0.3, 0.25, 0.015, 0.012], \"q01\": [-0.3, -0.3, 0.5, 2.2, -0.9, -0.5, -0.01, -0.04],\n"
    "  \"q99\": [0.2, 0.35, 1.1, 3.9, 0.5, 0.7, 0.04, 0.0]},\n"
    " \"actions\": {\"mean\": [0.06, 0.09, -0.1], \"std\": [0.33, 0.38, 0.45], \"q01\": null, \"q99\": null}}}\n";
static const char *ADAPTER_SEED =
    "{\"name\": \"arm\", \"cameras\": [\"images/top\", \"images/wrist\", null], \"state\": [\"joints\", \"gripper\"],\n"
    " \"prompt\": \"prompt\", \"default_prompt\": \"pick up the cup\", \"action_dims\": 7, \"discrete_state\": true,\n"
    " \"horizon\": 15}\n";

/* A micro checkpoint whose config.json is the memfd. */
static const char *checkpoint_dir(void) {
    static char dir[256];
    if (!dir[0]) {
        char config[512];
        snprintf(dir, sizeof dir, "%s/checkpoint", fuzz_dir());
        fuzz_save_micro_checkpoint(PI0_MODEL_PI0, dir);
        snprintf(config, sizeof config, "%s/config.json", dir);
        if (unlink(config) || symlink(fuzz_file(NULL, 0), config)) perror(config), abort();
    }
    return dir;
}

static void write_seeds(const char *seeds) {
    const char *dir = checkpoint_dir();
    char path[512];
    snprintf(path, sizeof path, "%s/config_written", dir);
    pi0_error err = {0};
    pi0_dims d = fuzz_micro_dims(PI0_MODEL_PI05);
    if (config_write(&d, path, 1, &err)) fprintf(stderr, "%s\n", err.message), abort();
    size_t size;
    uint8_t *config = fuzz_read_file(path, &size), *fixture = NULL;
    fuzz_write_seed(seeds, "dims_file", (uint8_t[]){DIMS_FILE}, 1, config, size);
    fuzz_write_seed(seeds, "checkpoint_config", (uint8_t[]){CHECKPOINT_CONFIG}, 1, config, size);
    free(config);
    fixture = fuzz_read_file(fuzz_fixture("pi0_tiny/config.json"), &size);
    fuzz_write_seed(seeds, "dims_file_fixture", (uint8_t[]){DIMS_FILE}, 1, fixture, size);
    free(fixture);
    fuzz_write_seed(seeds, "norm_stats", (uint8_t[]){NORM_STATS}, 1, NORM_STATS_SEED, strlen(NORM_STATS_SEED));
    fuzz_write_seed(seeds, "adapter", (uint8_t[]){ADAPTER}, 1, ADAPTER_SEED, strlen(ADAPTER_SEED));
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_seeds_then_exit(write_seeds);
    checkpoint_dir();
    return 0;
}

/* Both transforms of every entry, on values from ordinary to extreme (the stats were checked at load). */
static void transform_all(const pi0_norm_stats *s) {
    static const double values[] = {0.0, -1.5, 3.25, 1e300, -1e-300, 7e37};
    for (int i = 0; i < s->count; i++) {
        const pi0_norm_entry *e = &s->entries[i];
        int n = e->dim + 1; /* one past the stats: refused by Normalize, padded by Unnormalize */
        double *x = malloc((size_t)n * sizeof *x), *out = malloc((size_t)n * sizeof *out);
        float *xf = malloc((size_t)n * sizeof *xf);
        if (!x || !out || !xf) abort();
        for (int j = 0; j < n; j++) x[j] = values[j % 6], xf[j] = (float)values[j % 5];
        for (pi0_norm_mode mode = PI0_NORM_ZSCORE; mode <= PI0_NORM_QUANTILE; mode++) {
            pi0_normalize(e, mode, x, out, e->dim, NULL);
            pi0_normalize(e, mode, x, out, n, NULL);
            pi0_unnormalize(e, mode, xf, out, n, NULL);
        }
        free(x), free(out), free(xf);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const char *path = fuzz_file(data + 1, size - 1);
    pi0_error err = {0};
    switch (data[0] % NUM_READERS) {
    case DIMS_FILE: {
        pi0_dims d;
        config_load_dims(path, &d, &err);
        break;
    }
    case NORM_STATS: {
        pi0_norm_stats s;
        if (pi0_norm_stats_load(path, &s, &err) == PI0_OK) transform_all(&s);
        pi0_norm_stats_free(&s);
        break;
    }
    case ADAPTER: {
        pi0_adapter *a = NULL;
        pi0_adapter_open(path, &a, &err);
        pi0_adapter_free(a);
        break;
    }
    case CHECKPOINT_CONFIG: {
        checkpoint ck;
        if (checkpoint_open(checkpoint_dir(), &ck, &err) == PI0_OK) checkpoint_close(&ck);
        break;
    }
    }
    return 0;
}
