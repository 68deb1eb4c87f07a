/*
 * cli.h - what the `pi0` subcommands share: exit codes, flag parsing, progress, model opening.
 */
#ifndef PI0_CLI_H
#define PI0_CLI_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "pi0_policy.h"

/* Exit codes: 0 success, 1 the work failed (bad checkpoint, bad input file, inference error),
 * 2 the command line was wrong. */
enum { EXIT_OK = 0, EXIT_FAILURE_RUN = 1, EXIT_USAGE = 2 };

int cmd_sample(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_init(int argc, char **argv);
int cmd_convert(int argc, char **argv); /* runs tools/convert_openpi.py */
int cmd_infer(int argc, char **argv); /* only in builds with PI0_WITH_SERVER */
int cmd_serve(int argc, char **argv);

/* Prints "pi0 CMD: message" to stderr and returns EXIT_USAGE. */
int usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints "pi0 CMD: error: message" to stderr and returns EXIT_FAILURE_RUN. */
int run_error(const char *cmd, const pi0_error *err);

/* Parse a whole decimal integer within [min, max]; return -1 on anything else. */
int parse_int(const char *s, long long min, long long max, long long *out);

/* Flag helpers for `for (i = 1; i < argc; i++)` loops: match argv[i] == name and take argv[++i]. */
int flag_value(int argc, char **argv, int *i, const char *name, const char **value);

/* An integer flag: its name, the accepted range and where the value goes. */
typedef struct {
    const char *name;
    long long min, max, *out;
} int_flag;

/* If argv[*i] is one of flags[0..count), takes and parses its value and returns that flag, with *bad set
 * when the value is missing or outside [min, max] (see int_flag_error); NULL when argv[*i] is none of them. */
const int_flag *int_flag_value(int argc, char **argv, int *i, const int_flag *flags, size_t count, int *bad);
/* The usage error for a bad int_flag value ("--steps takes an integer in 1..10000"). */
int int_flag_error(const char *cmd, const int_flag *flag);

/* Prints `o` (freed here) on stdout as JSON dumped with `flags`; returns EXIT_OK. jansson holds no NaN or infinity:
 * json_real and json_pack fail on them, which leaves a NULL object (or an array without that element), so a NULL `o`
 * or a failed dump prints an error naming `cmd` and returns EXIT_FAILURE_RUN: never an empty or partial success. */
int print_json(const char *cmd, json_t *o, size_t flags);

/* The process's resident anonymous memory (RssAnon of /proc/self/status: its own allocations, not the page
 * cache or mapped files); 0 where unknown. */
uint64_t host_anon_bytes(void);

/* A load-progress callback printing whole percents to stderr. */
void progress_to_stderr(void *user, const char *stage, uint64_t done, uint64_t total);

/* "zscore" or "quantile" (--norm) into *mode; -1 for anything else. */
int norm_mode_from_name(const char *name, pi0_norm_mode *mode);

/* "pi0" or "pi05" (--model) into *kind; -1 for anything else. */
int model_kind_from_name(const char *name, pi0_model_kind *kind);

/* Loads `checkpoint`, or builds random weights when it is NULL: of the dims in `dims_path` (its "model" key
 * telling the kind), else the real size of `kind`; `kind` >= 0 overrides the dims file's. */
pi0_status open_model(const char *checkpoint, const char *dims_path, int kind, uint64_t seed, pi0_backend backend,
                      int quiet, pi0_model **model, pi0_error *err);

#endif
