/*
 * cli_run.h - what the command-line tests share: running `pi0 ARGS` ($PI0_BIN, default build/pi0) with
 * its stdout captured and its stderr kept in a file for the checks that read it.
 */
#ifndef PI0_TESTS_CLI_RUN_H
#define PI0_TESTS_CLI_RUN_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

#include "check.h"

static const char *pi0_bin(void) {
    const char *bin = getenv("PI0_BIN");
    return bin ? bin : "build/pi0";
}

/* Runs `pi0 ARGS`, capturing stdout into `out` (may be NULL); returns the exit code. */
static int run_pi0(char *out, size_t out_size, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int run_pi0(char *out, size_t out_size, const char *fmt, ...) {
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "%s %s 2>%s", pi0_bin(), args, test_path("stderr.txt"));
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t n = 0;
    char sink[4096];
    for (size_t got; (got = fread(out ? out + n : sink, 1, out ? out_size - 1 - n : sizeof sink, p)) > 0;)
        if (out) n += got;
    if (out) out[n] = 0;
    int status = pclose(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

/* The last command's stderr. */
static const char *last_stderr(void) {
    static char text[8192];
    FILE *f = fopen(test_path("stderr.txt"), "r");
    size_t n = f ? fread(text, 1, sizeof text - 1, f) : 0;
    text[n] = 0;
    if (f) fclose(f);
    return text;
}

#endif
