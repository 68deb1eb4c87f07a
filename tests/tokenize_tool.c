/*
 * tokenize_tool.c - the C tokenizer as a filter, for tests/tokenizer_vs_sentencepiece.py.
 *
 *   tokenize_tool MODEL < lines
 *
 * Each input line is a hex-encoded UTF-8 (or deliberately malformed) byte string; each output line
 * holds the space-separated ids pi0_tokenizer_encode gives for it (empty for no ids). Exits 1 on a
 * load error or a line that is not hex.
 *
 * Build: cc -std=c11 -O2 -D_GNU_SOURCE -Iinclude -Isrc tests/tokenize_tool.c \
 *            src/policy/tokenizer.c src/util/error.c -o build/tokenize_tool
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

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MODEL < hex-lines\n", argv[0]);
        return 2;
    }
    pi0_error err = {0};
    pi0_tokenizer *tok = NULL;
    if (pi0_tokenizer_load(argv[1], &tok, &err) != PI0_OK) {
        fprintf(stderr, "load: %s\n", err.message);
        return 1;
    }
    char *line = NULL;
    size_t line_capacity = 0, id_capacity = 256;
    int32_t *ids = malloc(id_capacity * sizeof *ids);
    ssize_t got;
    int status = ids ? 0 : 1;
    while (status == 0 && (got = getline(&line, &line_capacity, stdin)) >= 0) {
        size_t n = (size_t)got;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r')) n--;
        long bytes = decode_hex(line, n);
        size_t count = 0;
        if (bytes < 0) {
            fprintf(stderr, "not a hex line: %.*s\n", (int)n, line);
            status = 1;
        } else if (pi0_tokenizer_encode(tok, line, (size_t)bytes, ids, id_capacity, &count, &err) != PI0_OK) {
            fprintf(stderr, "encode: %s\n", err.message);
            status = 1;
        } else if (count > id_capacity) { /* grow and encode again */
            int32_t *grown = realloc(ids, count * sizeof *ids);
            if (!grown) status = 1;
            else {
                ids = grown;
                id_capacity = count;
                if (pi0_tokenizer_encode(tok, line, (size_t)bytes, ids, id_capacity, &count, &err) != PI0_OK)
                    status = 1;
            }
        }
        for (size_t i = 0; status == 0 && i < count; i++) printf(i ? " %d" : "%d", ids[i]);
        if (status == 0) putchar('\n');
    }
    free(line);
    free(ids);
    pi0_tokenizer_free(tok);
    return status;
}
