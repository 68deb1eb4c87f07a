/*
 * tokenize_tool.c - the C tokenizer as a filter, for tests/tokenizer_vs_sentencepiece.py.
 *
 *   tokenize_tool MODEL < lines               ids of pi0_tokenizer_encode
 *   tokenize_tool --bins < lines              pi0_state_bin of each value
 *   tokenize_tool --pi05 MODEL MAX_LEN < lines  pi0_tokenize_prompt_with_state
 *
 * Input lines are hex. For MODEL alone each is a UTF-8 (or deliberately malformed) byte string and
 * the output line holds its space-separated ids (empty for no ids). For --bins each is a run of
 * little-endian float64s (16 hex digits each) and the output line holds their bins. For --pi05 each
 * is "PROMPT STATE", the prompt's bytes and the state's float64s (either may be empty, the prompt
 * has no NUL), and the output line is the number of mask-1 tokens, then all MAX_LEN ids. Exits 1
 * on a load error or a line that is not hex.
 *
 * Build: cc -std=c11 -O2 -D_GNU_SOURCE -Iinclude -Isrc tests/tokenize_tool.c \
 *            src/policy/tokenizer.c src/util/error.c -lm -o build/tokenize_tool
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/tokenizer.h"

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* Decodes hex[0..n) into bytes in place; returns the byte count or -1. */
static long decode_hex(char *hex, size_t n) {
    if (n % 2) return -1;
    for (size_t i = 0; i < n; i += 2) {
        int hi = hex_digit(hex[i]), lo = hex_digit(hex[i + 1]);
        if (hi < 0 || lo < 0) return -1;
        hex[i / 2] = (char)(hi * 16 + lo);
    }
    return (long)(n / 2);
}

/* Decodes a hex run of float64s into a new *values; returns their count or -1. */
static long decode_doubles(char *hex, size_t n, double **values) {
    long bytes = decode_hex(hex, n);
    if (bytes < 0 || bytes % 8) return -1;
    *values = malloc((size_t)bytes + 8);
    if (!*values) return -1;
    memcpy(*values, hex, (size_t)bytes); /* little-endian hosts only, like the rest of pi0 */
    return bytes / 8;
}

/* One line of pi0_tokenizer_encode; *ids grows as needed. */
static int encode_line(const pi0_tokenizer *tok, char *line, size_t n, int32_t **ids,
                       size_t *capacity) {
    long bytes = decode_hex(line, n);
    if (bytes < 0) return 0;
    size_t count = 0;
    pi0_error err = {0};
    for (;;) {
        if (pi0_tokenizer_encode(tok, line, (size_t)bytes, *ids, *capacity, &count, &err) != PI0_OK) {
            fprintf(stderr, "encode: %s\n", err.message);
            return 0;
        }
        if (count <= *capacity) break;
        int32_t *grown = realloc(*ids, count * sizeof *grown); /* grow and encode again */
        if (!grown) return 0;
        *ids = grown;
        *capacity = count;
    }
    for (size_t i = 0; i < count; i++) printf(i ? " %d" : "%d", (*ids)[i]);
    putchar('\n');
    return 1;
}

static int bins_line(char *line, size_t n) {
    double *state = NULL;
    long dim = decode_doubles(line, n, &state);
    for (long i = 0; i < dim; i++) printf(i ? " %d" : "%d", pi0_state_bin(state[i]));
    putchar('\n');
    free(state);
    return dim >= 0;
}

static int pi05_line(const pi0_tokenizer *tok, int max_len, char *line, size_t n) {
    char *space = memchr(line, ' ', n);
    if (!space) return 0;
    size_t prompt_hex = (size_t)(space - line);
    double *state = NULL;
    long prompt_bytes = decode_hex(line, prompt_hex);
    long dim = decode_doubles(space + 1, n - prompt_hex - 1, &state);
    int32_t *ids = malloc((size_t)max_len * sizeof *ids);
    uint8_t *mask = malloc((size_t)max_len);
    int valid = 0, ok = prompt_bytes >= 0 && dim >= 0 && ids && mask;
    pi0_error err = {0};
    if (ok) {
        line[prompt_bytes] = '\0';
        ok = pi0_tokenize_prompt_with_state(tok, line, state, (int)dim, max_len, ids, mask, &valid,
                                            &err) == PI0_OK;
        if (!ok) fprintf(stderr, "tokenize: %s\n", err.message);
    }
    if (ok) {
        printf("%d", valid);
        for (int i = 0; i < max_len; i++) printf(" %d", ids[i]);
        putchar('\n');
    }
    free(state);
    free(ids);
    free(mask);
    return ok;
}

int main(int argc, char **argv) {
    int bins = argc == 2 && strcmp(argv[1], "--bins") == 0;
    int pi05 = argc == 4 && strcmp(argv[1], "--pi05") == 0;
    int max_len = pi05 ? atoi(argv[3]) : 0;
    if (!(bins || pi05 || argc == 2) || (pi05 && max_len <= 0)) {
        fprintf(stderr, "usage: %s MODEL | --bins | --pi05 MODEL MAX_LEN  < hex-lines\n", argv[0]);
        return 2;
    }
    pi0_error err = {0};
    pi0_tokenizer *tok = NULL;
    if (!bins && pi0_tokenizer_load(argv[pi05 ? 2 : 1], &tok, &err) != PI0_OK) {
        fprintf(stderr, "load: %s\n", err.message);
        return 1;
    }
    char *line = NULL;
    size_t line_capacity = 0, id_capacity = 256;
    int32_t *ids = malloc(id_capacity * sizeof *ids);
    ssize_t got;
    int ok = ids != NULL;
    while (ok && (got = getline(&line, &line_capacity, stdin)) >= 0) {
        size_t n = (size_t)got;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) n--;
        ok = bins ? bins_line(line, n)
             : pi05 ? pi05_line(tok, max_len, line, n)
                    : encode_line(tok, line, n, &ids, &id_capacity);
        if (!ok) fprintf(stderr, "failed on the line: %.*s\n", (int)(n < 200 ? n : 200), line);
    }
    free(line);
    free(ids);
    pi0_tokenizer_free(tok);
    return ok ? 0 : 1;
}
