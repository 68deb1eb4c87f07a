/*
 * norm_stats.h - openpi's norm_stats.json and its Normalize / Unnormalize transforms.
 *
 * File format (openpi/shared/normalize.py):
 *   {"norm_stats": {"state": {"mean": [...], "std": [...], "q01": [...], "q99": [...]}, "actions": {...}}}
 * q01/q99 may be absent (or null); keys other than "state" and "actions" are kept by name. A negative std, a
 * q01 above its q99 or a q99 - q01 that overflows is refused at load, naming the file, the key and the index.
 *
 * Precision: openpi loads the stats as float64 arrays and numpy promotes the float32 vectors to float64, so
 * every formula here runs in double on double stats and only the result is rounded to float.
 */
#ifndef PI0_POLICY_NORM_STATS_H
#define PI0_POLICY_NORM_STATS_H

#include "pi0_policy.h" /* pi0_norm_mode */

typedef struct {
    char *key;
    int dim;
    double *mean, *std, *q01, *q99; /* dim values each; q01/q99 NULL if absent */
} pi0_norm_entry;

typedef struct {
    pi0_norm_entry *entries;
    int count;
} pi0_norm_stats;

/* Parses `path`. On failure *out is left empty and err names the file, the key and the problem. */
pi0_status pi0_norm_stats_load(const char *path, pi0_norm_stats *out, pi0_error *err);
void pi0_norm_stats_free(pi0_norm_stats *s);
/* The entry named `key`, or NULL. */
const pi0_norm_entry *pi0_norm_stats_find(const pi0_norm_stats *s, const char *key);


/*
 * transforms.Normalize on x[0..n) into out, with numpy's promotions: the robot's values arrive as float64 (any
 * dtype converts exactly) against float64 stats, and the result stays float64 (Pi0.5 bins these values
 * into its prompt; the model takes them rounded to float32); out may be x. z-score
 * (x - mean) / (std + 1e-6) or quantile (x - q01) / (q99 - q01 + 1e-6) * 2 - 1. Stats longer than n: the
 * first n are used. Shorter stats, or quantile mode without q01/q99, are an error.
 */
pi0_status pi0_normalize(const pi0_norm_entry *e, pi0_norm_mode mode, const double *x, double *out, int n,
                         pi0_error *err);

/*
 * transforms.Unnormalize of the model's float32 x[0..n) into out (float64, as openpi returns actions), with
 * numpy's promotions: z-score x * (std + 1e-6) + mean is float64 throughout; quantile's (x + 1.0) / 2.0
 * stays float32 (a Python float does not promote a float32 array) and only * (q99 - q01 + 1e-6) + q01 is
 * float64. Like openpi, a vector longer than the stats is allowed (the model's padded action_dim against
 * the robot's stats): z-score pads mean 0, std 1; quantile passes those values through.
 */
pi0_status pi0_unnormalize(const pi0_norm_entry *e, pi0_norm_mode mode, const float *x, double *out, int n,
                           pi0_error *err);

#endif
