/*
 * norm_stats.c - loading norm_stats.json and applying openpi's transforms.Normalize / Unnormalize.
 *
 * openpi (shared/normalize.py) reads the file with json.loads into pydantic NormStats whose numpydantic
 * arrays come out float64; Normalize computes (x - mean) / (std + 1e-6) with x the robot's float32 (or
 * float64) vector, which numpy promotes to float64. So the stats are kept as doubles and each formula below
 * is evaluated in double, in openpi's operation order, and rounded to float once at the end.
 */
#include "policy/norm_stats.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/error.h"
#include "util/json_kind.h"

/* Reads norm_stats.<key>.<field> into a new array of doubles. An absent or null optional field gives NULL. */
static pi0_status read_vector(const char *path, const char *key, json_t *entry, const char *field, int required,
                              double **out, int *dim, pi0_error *err) {
    json_t *arr = json_object_get(entry, field);
    *out = NULL;
    if (!arr || (!required && json_is_null(arr))) {
        if (required) return pi0_fail(err, PI0_ERR_FORMAT, "%s: norm_stats.%s has no \"%s\"", path, key, field);
        return PI0_OK;
    }
    if (!json_is_array(arr))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: norm_stats.%s.%s is %s, not an array of numbers", path, key, field,
                        json_kind(arr));
    size_t n = json_array_size(arr);
    if (n == 0 || n > (1 << 20))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: norm_stats.%s.%s has %zu values (expected 1 .. %d)", path, key,
                        field, n, 1 << 20);
    double *v = malloc(n * sizeof *v);
    if (!v) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory for norm_stats.%s.%s", path, key, field);
    for (size_t i = 0; i < n; i++) {
        json_t *x = json_array_get(arr, i);
        /* JSON has no NaN or infinity (jansson rejects them and overflowing numbers); pydantic writes them as
         * null, so a null here is most likely a NaN in the statistics. */
        if (!json_is_number(x)) {
            free(v);
            return pi0_fail(err, PI0_ERR_FORMAT, "%s: norm_stats.%s.%s[%zu] is %s, not a number%s", path, key, field,
                            i, json_kind(x), json_is_null(x) ? " (NaN or infinity when saved by openpi)" : "");
        }
        v[i] = json_number_value(x);
    }
    *out = v;
    *dim = (int)n;
    return PI0_OK;
}

static void entry_free(pi0_norm_entry *e) {
    free(e->key);
    free(e->mean);
    free(e->std);
    free(e->q01);
    free(e->q99);
    memset(e, 0, sizeof *e);
}

/* Stats the transforms can use: std >= 0 and q01 <= q99 with q99 - q01 finite, so that the scale each transform
 * divides or multiplies by (std + 1e-6, q99 - q01 + 1e-6) is positive and finite. Every value is already finite
 * (jansson refuses a number that overflows a double), but a difference can still overflow. openpi would take
 * anything and answer NaN or a sign-flipped action; a robot must not. */
static pi0_status check_entry(const char *path, const pi0_norm_entry *e, pi0_error *err) {
    for (int i = 0; i < e->dim; i++) {
        if (!(e->std[i] >= 0))
            return pi0_fail(err, PI0_ERR_FORMAT, "%s: norm_stats.%s.std[%d] is %g: a standard deviation must be >= 0",
                            path, e->key, i, e->std[i]);
        if (e->q01 && e->q99 && !(e->q01[i] <= e->q99[i] && isfinite(e->q99[i] - e->q01[i])))
            return pi0_fail(err, PI0_ERR_FORMAT,
                            "%s: norm_stats.%s.q01[%d] is %g and q99[%d] is %g: q01 must be <= q99, and q99 - q01 finite",
                            path, e->key, i, e->q01[i], i, e->q99[i]);
    }
    return PI0_OK;
}

/* One NormStats: mean and std required, q01/q99 optional, all the same length; other fields are ignored like
 * pydantic does. */
static pi0_status parse_entry(const char *path, const char *key, json_t *obj, pi0_norm_entry *e, pi0_error *err) {
    if (!json_is_object(obj))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: norm_stats.%s is %s, not an object", path, key, json_kind(obj));
    e->key = strdup(key);
    if (!e->key) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);

    const char *fields[4] = {"mean", "std", "q01", "q99"};
    double **vectors[4] = {&e->mean, &e->std, &e->q01, &e->q99};
    for (int f = 0; f < 4; f++) {
        int dim = 0;
        pi0_status st = read_vector(path, key, obj, fields[f], f < 2, vectors[f], &dim, err);
        if (st != PI0_OK) return st;
        if (f == 0) e->dim = dim;
        else if (*vectors[f] && dim != e->dim)
            return pi0_fail(err, PI0_ERR_FORMAT, "%s: norm_stats.%s.%s has %d values but mean has %d", path, key,
                            fields[f], dim, e->dim);
    }
    return check_entry(path, e, err);
}

static pi0_status parse_root(const char *path, json_t *root, pi0_norm_stats *out, pi0_error *err) {
    json_t *stats = json_is_object(root) ? json_object_get(root, "norm_stats") : NULL;
    if (!stats) return pi0_fail(err, PI0_ERR_FORMAT, "%s: no top-level \"norm_stats\" object", path);
    if (!json_is_object(stats))
        return pi0_fail(err, PI0_ERR_FORMAT, "%s: \"norm_stats\" is %s, not an object", path, json_kind(stats));
    size_t count = json_object_size(stats);
    out->entries = calloc(count ? count : 1, sizeof *out->entries);
    if (!out->entries) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "%s: out of memory", path);

    const char *key;
    json_t *value;
    json_object_foreach(stats, key, value) {
        /* Count the entry before parsing it so that a failure frees its partial contents too. */
        pi0_status st = parse_entry(path, key, value, &out->entries[out->count++], err);
        if (st != PI0_OK) return st;
    }
    return PI0_OK;
}

pi0_status pi0_norm_stats_load(const char *path, pi0_norm_stats *out, pi0_error *err) {
    if (!path || !out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "norm stats: NULL path or output");
    memset(out, 0, sizeof *out);
    FILE *f = fopen(path, "rb");
    if (!f) return pi0_fail(err, PI0_ERR_IO, "cannot open %s: %s", path, strerror(errno));
    json_error_t jerr;
    json_t *root = json_loadf(f, 0, &jerr);
    fclose(f);
    if (!root)
        return pi0_fail(err, PI0_ERR_FORMAT, "%s:%d:%d: invalid JSON: %s", path, jerr.line, jerr.column, jerr.text);
    pi0_status st = parse_root(path, root, out, err);
    json_decref(root);
    if (st != PI0_OK) pi0_norm_stats_free(out);
    return st;
}

void pi0_norm_stats_free(pi0_norm_stats *s) {
    if (!s) return;
    for (int i = 0; i < s->count; i++) entry_free(&s->entries[i]);
    free(s->entries);
    memset(s, 0, sizeof *s);
}

const pi0_norm_entry *pi0_norm_stats_find(const pi0_norm_stats *s, const char *key) {
    for (int i = 0; s && key && i < s->count; i++)
        if (!strcmp(s->entries[i].key, key)) return &s->entries[i];
    return NULL;
}

static pi0_status check_args(const char *what, const pi0_norm_entry *e, pi0_norm_mode mode, const void *x,
                             const void *out, int n, pi0_error *err) {
    if (!e || (n > 0 && (!x || !out)) || n < 0)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s: NULL stats or vector, or negative length %d", what, n);
    if (mode != PI0_NORM_ZSCORE && mode != PI0_NORM_QUANTILE)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s: unknown mode %d", what, (int)mode);
    if (mode == PI0_NORM_QUANTILE && (!e->q01 || !e->q99))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT,
                        "%s: quantile mode needs q01 and q99, which norm stats '%s' lack", what, e->key);
    return PI0_OK;
}

pi0_status pi0_normalize(const pi0_norm_entry *e, pi0_norm_mode mode, const double *x, double *out, int n,
                         pi0_error *err) {
    pi0_status st = check_args("normalize", e, mode, x, out, n, err);
    if (st != PI0_OK) return st;
    /* openpi slices stats[..., :n]; shorter stats would fail to broadcast there. */
    if (n > e->dim)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "normalize: norm stats '%s' have %d values, the vector has %d",
                        e->key, e->dim, n);
    for (int i = 0; i < n; i++) {
        if (mode == PI0_NORM_ZSCORE) out[i] = (x[i] - e->mean[i]) / (e->std[i] + 1e-6);
        else out[i] = (x[i] - e->q01[i]) / (e->q99[i] - e->q01[i] + 1e-6) * 2.0 - 1.0;
    }
    return PI0_OK;
}

pi0_status pi0_unnormalize(const pi0_norm_entry *e, pi0_norm_mode mode, const float *x, double *out, int n,
                           pi0_error *err) {
    pi0_status st = check_args("unnormalize", e, mode, x, out, n, err);
    if (st != PI0_OK) return st;
    /* The products are separate statements so that no compiler fuses them with the add into an FMA, which
     * would round once where numpy rounds twice. */
    for (int i = 0; i < n; i++) {
        if (mode == PI0_NORM_ZSCORE) {
            /* Unnormalize._unnormalize: pad_to_dim(mean, n, value=0.0), pad_to_dim(std, n, value=1.0). */
            double mean = i < e->dim ? e->mean[i] : 0.0, std = i < e->dim ? e->std[i] : 1.0;
            double scaled = (double)x[i] * (std + 1e-6);
            out[i] = scaled + mean;
        } else if (i < e->dim) {
            float half = (x[i] + 1.0f) / 2.0f;
            double scaled = (double)half * (e->q99[i] - e->q01[i] + 1e-6);
            out[i] = scaled + e->q01[i];
        } else {
            out[i] = x[i]; /* Unnormalize._unnormalize_quantile: values past the stats pass through */
        }
    }
    return PI0_OK;
}
