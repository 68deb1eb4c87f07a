/*
 * fuzz_tokenizer.c - libFuzzer harness for the SentencePiece tokenizer. First byte 0: the rest is a `.model` file
 * (pi0_tokenizer_load_buffer), which then encodes a few texts; 1: the rest is text for the fixtures' test
 * tokenizer, through pi0_tokenizer_encode (with too little room, then enough) and both prompt formats, Pi0.5's
 * with states from ordinary to NaN. Every id must lie in the vocabulary. Seeds: the test tokenizer and prompts.
 */
#include <math.h>

#include "fuzz.h"
#include "policy/tokenizer.h"

enum { MODEL, TEXT, NUM_MODES };
#define MAX_LEN 48

static pi0_tokenizer *fixture_tokenizer;

static void write_seeds(const char *seeds) {
    size_t size;
    uint8_t *model = fuzz_read_file(fuzz_fixture("tokenizer/tok.model"), &size);
    fuzz_write_seed(seeds, "model", (uint8_t[]){MODEL}, 1, model, size);
    free(model);
    static const char *texts[] = {"pick up the black bowl and place it on the plate", "  Put_the marker\nin the cup ",
                                  "caf\xc3\xa9 \xe2\x96\x81 \xf0\x9f\xa4\x96 <0x41> \xff\xfe", ""};
    for (int i = 0; i < 4; i++) {
        char name[32];
        snprintf(name, sizeof name, "text_%d", i);
        fuzz_write_seed(seeds, name, (uint8_t[]){TEXT}, 1, texts[i], strlen(texts[i]));
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_seeds_then_exit(write_seeds);
    pi0_error err = {0};
    if (pi0_tokenizer_load(fuzz_fixture("tokenizer/tok.model"), &fixture_tokenizer, &err))
        fprintf(stderr, "%s\n", err.message), abort();
    return 0;
}

static void check_ids(const pi0_tokenizer *tok, const int32_t *ids, size_t count) {
    for (size_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= pi0_tokenizer_vocab_size(tok)) fprintf(stderr, "id %d\n", ids[i]), abort();
}

/* Every entry point on one NUL-terminated text. */
static void tokenize(const pi0_tokenizer *tok, const char *text) {
    static const double states[] = {0.0, -1.0, 0.9921875, -0.0, 1e300, -INFINITY, NAN, 0.5};
    int32_t ids[MAX_LEN], *all = NULL;
    uint8_t mask[MAX_LEN];
    size_t count = 0, length = strlen(text);
    int valid = 0;
    if (pi0_tokenizer_encode(tok, text, length, ids, 4, &count, NULL) == PI0_OK) {
        check_ids(tok, ids, count < 4 ? count : 4);
        if (!(all = malloc((count + 1) * sizeof *all))) abort();
        size_t again = 0;
        if (pi0_tokenizer_encode(tok, text, length, all, count, &again, NULL) || again != count) abort();
        check_ids(tok, all, count);
        free(all);
    }
    if (pi0_tokenize_prompt(tok, text, MAX_LEN, ids, mask, &valid, NULL) == PI0_OK) check_ids(tok, ids, (size_t)valid);
    if (pi0_tokenize_prompt_with_state(tok, text, states, 8, MAX_LEN, ids, mask, &valid, NULL) == PI0_OK)
        check_ids(tok, ids, (size_t)valid);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    if (data[0] % NUM_MODES == MODEL) {
        pi0_tokenizer *tok = NULL;
        if (pi0_tokenizer_load_buffer(data + 1, size - 1, &tok, NULL) == PI0_OK) {
            tokenize(tok, "pick up the black bowl");
            tokenize(tok, "\xe2\x96\x81 \xff x_y\n");
        }
        pi0_tokenizer_free(tok);
        return 0;
    }
    char *text = malloc(size);
    if (!text) abort();
    memcpy(text, data + 1, size - 1);
    text[size - 1] = 0; /* the prompt functions take C strings: an embedded NUL ends it */
    tokenize(fixture_tokenizer, text);
    free(text);
    return 0;
}
