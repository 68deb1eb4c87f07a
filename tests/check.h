/*
 * check.h - the test harness: each tests/test_*.c is one program of TEST functions run by RUN in
 * main(); a TEST passes when none of its CHECKs failed, and is skipped (never passed) when it calls
 * SKIP because something it needs is absent. The program prints one line per test ("ok", "FAIL" or
 * "skip NAME: why") and ends with "N passed, N failed, N skipped"; tests/run.sh adds them all up.
 */
#ifndef PI0_TESTS_CHECK_H
#define PI0_TESTS_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int check_test_failed, check_passed, check_failed, check_skipped;
static char check_skip_reason[256];
static const char *check_filter;

#define CHECK(cond, ...)                                                                   \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "  %s:%d: check failed: %s: ", __FILE__, __LINE__, #cond);     \
            fprintf(stderr, " " __VA_ARGS__);                                              \
            fprintf(stderr, "\n");                                                         \
            check_test_failed = 1;                                                         \
        }                                                                                  \
    } while (0)

/* Fails the test and leaves it when `cond` is false: for checks later code depends on. */
#define REQUIRE(cond, ...)                                                                 \
    do {                                                                                   \
        CHECK(cond, __VA_ARGS__);                                                          \
        if (check_test_failed) return;                                                     \
    } while (0)

/* Leaves the test as skipped, saying why: for a test whose prerequisite is absent (an opt-out
 * variable, a library this build lacks). Reported as "skip", counted apart, never as passed. */
#define SKIP(...)                                                                          \
    do {                                                                                   \
        snprintf(check_skip_reason, sizeof check_skip_reason, __VA_ARGS__);                \
        return;                                                                            \
    } while (0)

/* Declares a test: TEST(name) { ... CHECK(...); } */
#define TEST(name) static void name(void)

#define RUN(fn) check_run(#fn, fn)

static inline void check_run(const char *name, void (*fn)(void)) {
    if (check_filter && !strstr(name, check_filter)) return;
    check_test_failed = 0;
    check_skip_reason[0] = 0;
    fprintf(stderr, "test %s ...\n", name);
    fn();
    if (check_test_failed) {
        printf("FAIL %s\n", name);
        check_failed++;
    } else if (check_skip_reason[0]) {
        printf("skip %s: %s\n", name, check_skip_reason);
        check_skipped++;
    } else {
        printf("ok   %s\n", name);
        check_passed++;
    }
    fflush(stdout);
}

/* argv[1], when given, selects the tests whose name contains it. */
static inline void check_init(int argc, char **argv) {
    check_filter = argc > 1 ? argv[1] : NULL;
}

static inline int check_finish(void) {
    printf("%d passed, %d failed, %d skipped\n", check_passed, check_failed, check_skipped);
    return check_failed ? 1 : 0;
}

/* ||a - b|| / ||b|| over n elements; NaN anywhere gives infinity. */
static inline double rel_error(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        if (isnan(a[i]) || isnan(b[i])) return INFINITY;
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* Directory of the shared fixtures: $PI0_FIXTURES or ../shared/fixtures. */
static inline const char *fixtures_dir(void) {
    const char *dir = getenv("PI0_FIXTURES");
    return dir ? dir : "../shared/fixtures";
}

/* A path under this program's own fresh temporary directory; up to 8 returned paths stay valid. */
static inline const char *test_path(const char *leaf) {
    static char root[64], ring[8][512];
    static int next;
    char *path = ring[next++ % 8];
    if (!root[0]) {
        snprintf(root, sizeof root, "/tmp/pi0_test_XXXXXX");
        if (!mkdtemp(root)) return NULL;
    }
    snprintf(path, sizeof ring[0], "%s/%s", root, leaf);
    return path;
}

#endif
