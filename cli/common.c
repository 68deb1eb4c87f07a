#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "model/config.h"
#include "util/clock.h"

int usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "pi0 %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see pi0 %s --help)\n", cmd);
    va_end(ap);
    return EXIT_USAGE;
}

int run_error(const char *cmd, const pi0_error *err) {
    fprintf(stderr, "pi0 %s: error: %s\n", cmd, err->message);
    return EXIT_FAILURE_RUN;
}

int parse_int(const char *s, long long min, long long max, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < min || v > max) return -1;
    *out = v;
    return 0;
}

int flag_value(int argc, char **argv, int *i, const char *name, const char **value) {
    if (strcmp(argv[*i], name)) return 0;
    if (*i + 1 >= argc) return -1;
    *value = argv[++*i];
    return 1;
}

const int_flag *int_flag_value(int argc, char **argv, int *i, const int_flag *flags, size_t count, int *bad) {
    const char *value;
    for (size_t k = 0; k < count; k++) {
        int r = flag_value(argc, argv, i, flags[k].name, &value);
        if (!r) continue;
        *bad = r < 0 || parse_int(value, flags[k].min, flags[k].max, flags[k].out);
        return &flags[k];
    }
    return NULL;
}

int int_flag_error(const char *cmd, const int_flag *flag) {
    return usage_error(cmd, "%s takes an integer in %lld..%lld", flag->name, flag->min, flag->max);
}

int print_json(const char *cmd, json_t *o, size_t flags) {
    char *text = o ? json_dumps(o, flags) : NULL;
    json_decref(o);
    if (!text) {
        fprintf(stderr, "pi0 %s: error: cannot write the JSON output (a number is NaN or infinite, or out of memory)\n",
                cmd);
        return EXIT_FAILURE_RUN;
    }
    puts(text);
    free(text);
    return EXIT_OK;
}

uint64_t host_anon_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    unsigned long long kb = 0;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "RssAnon: %llu kB", &kb) == 1) break;
    if (f) fclose(f);
    return (uint64_t)kb * 1024;
}

void progress_to_stderr(void *user, const char *stage, uint64_t done, uint64_t total) {
    int *last_percent = user;
    int percent = total ? (int)(done * 100 / total) : 100;
    if (percent == *last_percent) return;
    *last_percent = percent;
    fprintf(stderr, "\r%s: %3d%% (%.2f / %.2f GB)", stage, percent, (double)done / 1e9, (double)total / 1e9);
    if (done >= total) fprintf(stderr, "\n");
}

int norm_mode_from_name(const char *name, pi0_norm_mode *mode) {
    if (!strcmp(name, "zscore")) *mode = PI0_NORM_ZSCORE;
    else if (!strcmp(name, "quantile")) *mode = PI0_NORM_QUANTILE;
    else return -1;
    return 0;
}

int model_kind_from_name(const char *name, pi0_model_kind *kind) {
    if (!strcmp(name, "pi0")) *kind = PI0_MODEL_PI0;
    else if (!strcmp(name, "pi05")) *kind = PI0_MODEL_PI05;
    else return -1;
    return 0;
}

pi0_status open_model(const char *checkpoint, const char *dims_path, int kind, uint64_t seed, pi0_backend backend,
                      int quiet, pi0_model **model, pi0_error *err) {
    int last_percent = -1;
    pi0_options opts = {.backend = backend, .progress = quiet ? NULL : progress_to_stderr, .progress_user = &last_percent};
    double t0 = pi0_now_ms();
    pi0_status st;
    if (checkpoint) {
        st = pi0_model_load(checkpoint, &opts, model, err);
    } else {
        pi0_dims dims = kind == PI0_MODEL_PI05 ? pi0_dims_pi05() : pi0_dims_pi0();
        if (dims_path && (st = config_load_dims(dims_path, &dims, err))) return st;
        if (kind >= 0) dims.kind = (pi0_model_kind)kind;
        if (!quiet)
            fprintf(stderr, "building random %s weights (seed %llu)...\n", pi0_model_kind_name(dims.kind),
                    (unsigned long long)seed);
        st = pi0_model_random(&dims, seed, &opts, model, err);
    }
    if (!st && !quiet)
        fprintf(stderr, "model ready: %s, %.2fB parameters, %s backend, %.1f s\n",
                pi0_model_kind_name(pi0_model_dims(*model)->kind), pi0_model_num_params(*model) / 1e9,
                pi0_backend_name(pi0_model_backend(*model)), (pi0_now_ms() - t0) / 1e3);
    return st;
}
