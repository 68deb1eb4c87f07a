/*
 * fuzz.h - what the libFuzzer harnesses of tests/fuzz/ share (`make fuzz`, `make fuzz-smoke`):
 *  - fuzz_file(): the fuzzer's bytes behind a path, for parsers that read a file (a memfd, so nothing is written
 *    to disk and the library's own open/mmap/fopen path is what runs);
 *  - seed corpora: each harness writes its own (it knows its input format) when $PI0_FUZZ_SEEDS names a
 *    directory, then exits (fuzz_seeds_then_exit); tests/fuzz/smoke.sh does that before fuzzing;
 *  - the micro model dims the harnesses build checkpoints and policies from (image 28, one layer per stack,
 *    the test tokenizer's vocabulary), small enough for hundreds of inferences a second.
 * A harness aborts on anything the library must never do besides crashing: an OK status with a broken result.
 */
#ifndef PI0_TESTS_FUZZ_H
#define PI0_TESTS_FUZZ_H

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "pi0.h"

/* A fixed path whose file holds exactly data[0..size) (a memfd, rewritten on every call). */
static inline const char *fuzz_file(const uint8_t *data, size_t size) {
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        fd = memfd_create("pi0_fuzz", 0);
        if (fd < 0) perror("memfd_create"), abort();
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) || (size && pwrite(fd, data, size, 0) != (ssize_t)size)) perror("fuzz_file"), abort();
    return path;
}

/* A fresh directory of this process, for harnesses that need a checkpoint directory. */
static inline const char *fuzz_dir(void) {
    static char dir[64];
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/pi0_fuzz_XXXXXX");
        if (!mkdtemp(dir)) perror("mkdtemp"), abort();
    }
    return dir;
}

/* For LLVMFuzzerInitialize: when $PI0_FUZZ_SEEDS names a directory, creates it, writes the harness's seed corpus
 * there and exits; otherwise returns. */
static inline void fuzz_seeds_then_exit(void (*write_seeds)(const char *dir)) {
    const char *dir = getenv("PI0_FUZZ_SEEDS");
    if (!dir) return;
    if (mkdir(dir, 0755) && errno != EEXIST) perror(dir), abort();
    write_seeds(dir);
    exit(0);
}

/* Writes one seed: `prefix` (its `prefix_size` bytes, e.g. a mode byte) then data[0..size). */
static inline void fuzz_write_seed(const char *dir, const char *name, const void *prefix, size_t prefix_size,
                                   const void *data, size_t size) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(prefix, 1, prefix_size, f) != prefix_size || fwrite(data, 1, size, f) != size || fclose(f))
        perror(path), abort();
}

/* The whole of `path` in a malloc'ed buffer (abort when unreadable: the harness's own files). */
static inline uint8_t *fuzz_read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) perror(path), abort();
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    rewind(f);
    uint8_t *data = malloc((size_t)n + 1);
    if (!data || fread(data, 1, (size_t)n, f) != (size_t)n) perror(path), abort();
    fclose(f);
    *size = (size_t)n;
    return data;
}

/* $PI0_FIXTURES/<leaf>, else ../shared/fixtures/<leaf>. */
static inline const char *fuzz_fixture(const char *leaf) {
    static char path[1024];
    const char *dir = getenv("PI0_FIXTURES");
    snprintf(path, sizeof path, "%s/%s", dir ? dir : "../shared/fixtures", leaf);
    return path;
}

/* A Pi0 or Pi0.5 model far smaller than the fixtures' (28 x 28 images of 4 patches), with the test tokenizer's
 * 2000-piece vocabulary, the real action_dim and a horizon of 10. */
static inline pi0_dims fuzz_micro_dims(pi0_model_kind kind) {
    pi0_stack_dims stack = {.width = 16, .depth = 1, .mlp_dim = 32, .num_heads = 2, .num_kv_heads = 1, .head_dim = 8};
    return (pi0_dims){.kind = kind, .vision = {.width = 16, .depth = 1, .mlp_dim = 32, .num_heads = 2, .num_kv_heads = 2,
                                               .head_dim = 8},
                      .patch_size = 14, .image_size = 28, .llm = stack, .expert = stack, .vocab_size = 2000,
                      .action_dim = 32, .action_horizon = 10, .max_token_len = kind == PI0_MODEL_PI05 ? 64 : 16};
}

/* A micro model of `kind` with random weights, saved as a checkpoint in `dir`. */
static inline void fuzz_save_micro_checkpoint(pi0_model_kind kind, const char *dir) {
    pi0_dims d = fuzz_micro_dims(kind);
    pi0_options opts = {.backend = PI0_BACKEND_CPU, .num_threads = 1};
    pi0_model *m = NULL;
    pi0_error err = {0};
    if (pi0_model_random(&d, 1, &opts, &m, &err) || pi0_model_save(m, dir, 0, &err))
        fprintf(stderr, "micro checkpoint: %s\n", err.message), abort();
    pi0_model_free(m);
}

#endif
