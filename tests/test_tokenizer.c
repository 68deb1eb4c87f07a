/*
 * test_tokenizer.c - the SentencePiece tokenizer against the fixture model: every case of
 * tokenizer/cases.json, Pi0 prompt formatting, model variants made by appending protobuf fields
 * to the fixture (expected ids from the sentencepiece library 0.2.3), Pi0.5 prompt formatting with
 * the discretized state (every case of tokenizer/pi05_prompts.json), and hostile model files
 * (every truncation, random byte mutations, crafted wire data) that must load or fail cleanly.
 * tests/tokenizer_vs_sentencepiece.py compares with sentencepiece on many random strings.
 */
#include <jansson.h>
#include <stdint.h>

#include "check.h"
#include "policy/tokenizer.h"

/* The fixture model's bytes, read once. */
static uint8_t *model_bytes;
static size_t model_size;

static int read_fixture_model(void) {
    if (model_bytes) return 1;
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/tok.model", fixtures_dir());
    FILE *f = fopen(path, "rb");
    if (!f) return 0;
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    model_bytes = malloc(size > 0 ? (size_t)size : 1);
    model_size = model_bytes && size > 0 ? fread(model_bytes, 1, (size_t)size, f) : 0;
    fclose(f);
    return model_size == (size_t)size && size > 0;
}

static pi0_tokenizer *load_fixture(void) {
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/tok.model", fixtures_dir());
    pi0_tokenizer *tok = NULL;
    pi0_error err = {0};
    if (pi0_tokenizer_load(path, &tok, &err) != PI0_OK) fprintf(stderr, "  load: %s\n", err.message);
    return tok;
}

/* Encodes text[0..n) and compares with want[0..want_count). */
static int encodes_to(const pi0_tokenizer *tok, const char *text, size_t n, const int32_t *want,
                      size_t want_count) {
    int32_t ids[256];
    size_t count = 0;
    pi0_error err = {0};
    if (pi0_tokenizer_encode(tok, text, n, ids, 256, &count, &err) != PI0_OK) {
        fprintf(stderr, "  encode: %s\n", err.message);
        return 0;
    }
    int same = count == want_count;
    for (size_t i = 0; same && i < count; i++) same = ids[i] == want[i];
    if (!same) {
        fprintf(stderr, "  got");
        for (size_t i = 0; i < count && i < 256; i++) fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, "\n");
    }
    return same;
}

#define ENCODES_TO(tok, text, ...)                                                          \
    do {                                                                                    \
        const int32_t want_[] = {__VA_ARGS__};                                              \
        CHECK(encodes_to(tok, text, sizeof(text) - 1, want_, sizeof want_ / sizeof *want_), \
              "%s", #text);                                                                 \
    } while (0)

static void test_fixture_cases(void) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/cases.json", fixtures_dir());
    json_error_t jerr;
    json_t *cases = json_load_file(path, 0, &jerr);
    REQUIRE(cases && json_is_array(cases), "%s: %s", path, jerr.text);
    size_t i, passed = 0;
    json_t *c;
    json_array_foreach(cases, i, c) {
        json_t *text = json_object_get(c, "text"), *ids = json_object_get(c, "ids");
        json_t *pieces = json_object_get(c, "pieces");
        CHECK(json_is_string(text) && json_is_array(ids) && json_is_array(pieces));
        if (!json_is_string(text) || !json_is_array(ids) || !json_is_array(pieces)) continue;
        size_t n = json_array_size(ids), count = 0;
        int32_t *got = malloc((n + 1) * sizeof *got);
        pi0_error err = {0};
        pi0_status st = pi0_tokenizer_encode(tok, json_string_value(text), json_string_length(text),
                                             got, n + 1, &count, &err);
        int same = st == PI0_OK && count == n;
        for (size_t k = 0; same && k < n; k++) {
            same = got[k] == json_integer_value(json_array_get(ids, k)) &&
                   strcmp(pi0_tokenizer_piece(tok, got[k]),
                          json_string_value(json_array_get(pieces, k))) == 0;
        }
        CHECK(same, "case %zu (%s): %zu ids", i, json_string_value(text), count);
        passed += same;
        free(got);
    }
    CHECK(i == 32, "%zu cases", i);
    fprintf(stderr, "  %zu/%zu fixture cases match\n", passed, i);
    json_decref(cases);
    pi0_tokenizer_free(tok);
}

static void test_model_info(void) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    CHECK(pi0_tokenizer_vocab_size(tok) == 2000);
    CHECK(pi0_tokenizer_bos_id(tok) == 2);
    CHECK(strcmp(pi0_tokenizer_piece(tok, 0), "<pad>") == 0);
    CHECK(strcmp(pi0_tokenizer_piece(tok, 2), "<s>") == 0);
    CHECK(strcmp(pi0_tokenizer_piece(tok, 4), "<start_of_turn>") == 0);
    CHECK(strcmp(pi0_tokenizer_piece(tok, 18), "<0x0A>") == 0);
    CHECK(pi0_tokenizer_piece(tok, -1) == NULL);
    CHECK(pi0_tokenizer_piece(tok, 2000) == NULL);
    pi0_tokenizer_free(tok);
}

/* Malformed UTF-8: each byte that starts no valid character becomes U+FFFD = <0xEF><0xBF><0xBD>. */
static void test_malformed_utf8(void) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    ENCODES_TO(tok, "\xff", 247, 199, 197);
    ENCODES_TO(tok, "a\x80" "b", 1928, 247, 199, 197, 1934);
    ENCODES_TO(tok, "\xed\xa0\x80", 247, 199, 197, 247, 199, 197, 247, 199, 197); /* surrogate */
    ENCODES_TO(tok, "\xc0\xaf", 247, 199, 197, 247, 199, 197);                   /* overlong */
    ENCODES_TO(tok, "\xef\xbf\xbd", 247, 199, 197); /* a real U+FFFD */
    ENCODES_TO(tok, "a\0b", 1928, 8, 1934);          /* NUL is a character: <0x00> */
    pi0_tokenizer_free(tok);
}

static void test_encode_capacity(void) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    const char *text = "move 1234567 units";
    int32_t ids[16] = {0};
    size_t count = 0;
    pi0_error err = {0};
    CHECK(pi0_tokenizer_encode(tok, text, strlen(text), NULL, 0, &count, &err) == PI0_OK);
    CHECK(count == 12, "%zu", count);
    CHECK(pi0_tokenizer_encode(tok, text, strlen(text), ids, 3, &count, &err) == PI0_OK);
    CHECK(count == 12 && ids[0] == 441 && ids[1] == 1920 && ids[2] == 1959 && ids[3] == 0);
    CHECK(pi0_tokenizer_encode(tok, "", 0, ids, 16, &count, &err) == PI0_OK && count == 0);
    CHECK(pi0_tokenizer_encode(tok, NULL, 0, ids, 16, &count, &err) == PI0_OK && count == 0);
    CHECK(pi0_tokenizer_encode(tok, NULL, 3, ids, 16, &count, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenizer_encode(tok, text, 4, NULL, 16, &count, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenizer_encode(tok, text, 4, ids, 16, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenizer_encode(NULL, text, 4, ids, 16, &count, &err) == PI0_ERR_INVALID_ARGUMENT);
    pi0_tokenizer_free(tok);
}

/* Big inputs work (and give as many ids as sentencepiece would); beyond 16 MiB is refused. */
static void test_oversized_input(void) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    size_t big = (size_t)1 << 20, limit = (size_t)1 << 24;
    char *text = malloc(limit + 1);
    REQUIRE(text);
    memset(text, 'z', limit + 1); /* "z" is no merge: one id per byte */
    size_t count = 0;
    pi0_error err = {0};
    CHECK(pi0_tokenizer_encode(tok, text, big, NULL, 0, &count, &err) == PI0_OK && count == big);
    int32_t *ids = malloc(big * sizeof *ids);
    CHECK(ids && pi0_tokenizer_encode(tok, text, big, ids, big, &count, &err) == PI0_OK &&
          ids[0] == 1989 && ids[big - 1] == 1989);
    CHECK(pi0_tokenizer_encode(tok, text, limit + 1, NULL, 0, &count, &err) ==
          PI0_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.message, "limit"), "%s", err.message);
    free(ids);
    free(text);
    pi0_tokenizer_free(tok);
}

/* ---- Pi0 prompt formatting -------------------------------------------------------------- */

static int prompt_is(const pi0_tokenizer *tok, const char *prompt, int max_len, const int32_t *want,
                     int want_valid) {
    int32_t ids[64];
    uint8_t mask[64];
    int valid = -1;
    pi0_error err = {0};
    if (pi0_tokenize_prompt(tok, prompt, max_len, ids, mask, &valid, &err) != PI0_OK) {
        fprintf(stderr, "  tokenize_prompt: %s\n", err.message);
        return 0;
    }
    int same = valid == want_valid;
    for (int i = 0; same && i < max_len; i++)
        same = ids[i] == (i < want_valid ? want[i] : 0) && mask[i] == (i < want_valid);
    if (!same) {
        fprintf(stderr, "  got (%d valid)", valid);
        for (int i = 0; i < max_len; i++) fprintf(stderr, " %d", ids[i]);
        fprintf(stderr, "\n");
    }
    return same;
}

#define PROMPT_IS(tok, prompt, max_len, ...)                                            \
    do {                                                                                \
        const int32_t want_[] = {__VA_ARGS__};                                          \
        CHECK(prompt_is(tok, prompt, max_len, want_, (int)(sizeof want_ / sizeof *want_)), \
              "%s", #prompt);                                                           \
    } while (0)

/* Expected ids: openpi's `sp.encode(clean, add_bos=True) + sp.encode("\n")` with sentencepiece. */
static void test_prompt(void) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    PROMPT_IS(tok, "pick up the fork", 10, 2, 451, 418, 266, 376, 18);
    PROMPT_IS(tok, "  Pick_up the\nfork  ", 10, 2, 534, 418, 266, 376, 18);
    PROMPT_IS(tok, "under_score\twords\n\nnext", 16, 2, 1513, 1636, 897, 17, 1937, 1167, 1929, 281,
              1925, 338, 18);
    /* Python strips Unicode whitespace (U+3000, U+00A0, U+2029, U+001C, U+0085) but not U+200B */
    PROMPT_IS(tok, "\xe3\x80\x80\xc2\xa0pick up the fork\xe2\x80\xa9\x1c", 10, 2, 451, 418, 266, 376, 18);
    PROMPT_IS(tok, "\xc2\x85pick\xe2\x80\x8b", 10, 2, 451, 234, 136, 147, 18);
    PROMPT_IS(tok, "  \n ", 4, 2, 18);
    PROMPT_IS(tok, "", 4, 2, 18);
    /* truncation: exactly full, cut inside the text, cut before the final "\n" */
    PROMPT_IS(tok, "pick up the fork", 6, 2, 451, 418, 266, 376, 18);
    PROMPT_IS(tok, "pick up the fork", 3, 2, 451, 418);
    PROMPT_IS(tok, "pick up the fork", 5, 2, 451, 418, 266, 376);
    PROMPT_IS(tok, "pick up the fork", 1, 2);

    int32_t ids[4];
    uint8_t mask[4];
    pi0_error err = {0};
    CHECK(pi0_tokenize_prompt(tok, "x", 0, ids, mask, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenize_prompt(tok, NULL, 4, ids, mask, NULL, &err) == PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenize_prompt(tok, "x", 4, ids, mask, NULL, &err) == PI0_OK);
    pi0_tokenizer_free(tok);
}

/* ---- Pi0.5 prompt formatting ------------------------------------------------------------- */

/* One case of pi05_prompts.json through pi0_tokenize_prompt (state null) or
 * pi0_tokenize_prompt_with_state; returns whether every id and mask entry matches. */
static int pi05_case_matches(const pi0_tokenizer *tok, json_t *c, size_t index) {
    json_t *prompt = json_object_get(c, "prompt"), *state = json_object_get(c, "state");
    json_t *want_ids = json_object_get(c, "ids"), *want_mask = json_object_get(c, "mask");
    int max_len = (int)json_integer_value(json_object_get(c, "max_len"));
    if (!json_is_string(prompt) || max_len <= 0 || !json_is_array(want_ids) ||
        !json_is_array(want_mask) || json_array_size(want_ids) != (size_t)max_len ||
        json_array_size(want_mask) != (size_t)max_len || !(json_is_null(state) || json_is_array(state)))
        return 0;
    int dim = json_is_array(state) ? (int)json_array_size(state) : 0, valid = -1, want_valid = 0;
    double *values = malloc((size_t)(dim ? dim : 1) * sizeof *values);
    int32_t *ids = malloc((size_t)max_len * sizeof *ids);
    uint8_t *mask = malloc((size_t)max_len);
    for (int i = 0; values && i < dim; i++) values[i] = json_number_value(json_array_get(state, i));
    pi0_error err = {0};
    pi0_status st = !values || !ids || !mask ? PI0_ERR_OUT_OF_MEMORY
                    : json_is_null(state)
                        ? pi0_tokenize_prompt(tok, json_string_value(prompt), max_len, ids, mask, &valid, &err)
                        : pi0_tokenize_prompt_with_state(tok, json_string_value(prompt), values, dim,
                                                         max_len, ids, mask, &valid, &err);
    int same = st == PI0_OK;
    for (int i = 0; same && i < max_len; i++) {
        want_valid += json_is_true(json_array_get(want_mask, i));
        same = ids[i] == json_integer_value(json_array_get(want_ids, i)) &&
               mask[i] == json_is_true(json_array_get(want_mask, i));
        if (!same) fprintf(stderr, "  case %zu: position %d: id %d mask %d\n", index, i, ids[i], mask[i]);
    }
    if (st != PI0_OK) fprintf(stderr, "  case %zu: %s\n", index, err.message);
    same = same && valid == want_valid;
    free(values);
    free(ids);
    free(mask);
    return same;
}

/* openpi's own PaligemmaTokenizer.tokenize(prompt, state) output with the fixture model. */
TEST(test_pi05_fixture) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/pi05_prompts.json", fixtures_dir());
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr), *cases = json_object_get(root, "cases");
    REQUIRE(json_is_array(cases), "%s: %s", path, jerr.text);
    size_t i, with_state = 0, passed = 0;
    json_t *c;
    json_array_foreach(cases, i, c) {
        int same = pi05_case_matches(tok, c, i);
        CHECK(same, "case %zu (%s)", i, json_string_value(json_object_get(c, "prompt")));
        passed += same;
        with_state += json_is_array(json_object_get(c, "state"));
    }
    CHECK(i == 54 && with_state == 36, "%zu cases, %zu with a state", i, with_state);
    fprintf(stderr, "  %zu/%zu cases match (%zu with a state)\n", passed, i, with_state);
    json_decref(root);
    pi0_tokenizer_free(tok);
}

/* numpy's digitize(x, linspace(-1, 1, 257)[:-1]) - 1 by its definition: the edges <= x, less one
 * (searchsorted side="right"; NaN sorts after every edge). */
static int reference_bin(double x) {
    int count = 0;
    for (int k = 0; k < 256; k++) count += isnan(x) || -1.0 + k * (2.0 / 256) <= x;
    return count - 1;
}

TEST(test_state_bins) {
    for (int k = 0; k < 256; k++) {
        double edge = -1.0 + k / 128.0;
        float edge32 = (float)edge; /* every edge is a float32 too */
        CHECK(pi0_state_bin(edge) == k, "edge %d", k);
        CHECK(pi0_state_bin(nextafter(edge, -INFINITY)) == k - 1, "just below edge %d", k);
        CHECK(pi0_state_bin(nextafter(edge, INFINITY)) == k, "just above edge %d", k);
        CHECK(pi0_state_bin(nextafterf(edge32, -INFINITY)) == k - 1, "float32 below edge %d", k);
        CHECK(pi0_state_bin(nextafterf(edge32, INFINITY)) == k, "float32 above edge %d", k);
    }
    const struct {
        double x;
        int bin;
    } cases[] = {
        {-1.0, 0}, {1.0, 255}, {-1.0000001, -1}, {1.0000001, 255}, {0.9999999, 255},
        {1.0 - 1.0 / 128, 255}, {0.0, 128}, {-0.0, 128}, {-4.9e-324, 127}, {4.9e-324, 128},
        {0.5 - 0x1p-54, 191}, /* (x + 1) * 128 would round up to the edge: 192 */
        {-0.5 - 0x1p-53, 63}, {-1e300, -1}, {1e300, 255}, {-1.7976931348623157e308, -1},
        {1.7976931348623157e308, 255}, /* x * 128 overflows to inf */
        {-INFINITY, -1}, {INFINITY, 255}, {NAN, 255}, {-NAN, 255},
        {0.7320070266723633, 221}, {-0.5140767097473145, 62},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        CHECK(pi0_state_bin(cases[i].x) == cases[i].bin, "x = %.17g: bin %d, want %d", cases[i].x,
              pi0_state_bin(cases[i].x), cases[i].bin);
        CHECK(reference_bin(cases[i].x) == cases[i].bin, "reference, x = %.17g", cases[i].x);
    }
    uint64_t rng = 0x243F6A8885A308D3ull;
    for (int i = 0; i < 100000; i++) { /* random bit patterns: every magnitude, NaNs and infinities */
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        double x;
        uint64_t bits = i % 2 ? rng : (rng & 0x800FFFFFFFFFFFFFull) | 0x3FE0000000000000ull; /* [0.5, 1) */
        memcpy(&x, &bits, sizeof x);
        if (i % 4 == 1) x = ldexp((double)(rng >> 11), -52) - 1.0 - 0x1p-10; /* about [-1, 1] */
        CHECK(pi0_state_bin(x) == reference_bin(x), "x = %.17g", x);
    }
}

static int state_prompt_is(const pi0_tokenizer *tok, const char *prompt, const double *state,
                           int dim, int max_len, const char *text) {
    int32_t ids[64], want[64];
    uint8_t mask[64];
    size_t count = 0;
    int valid = -1;
    pi0_error err = {0};
    want[0] = 2;
    if (pi0_tokenizer_encode(tok, text, strlen(text), want + 1, 63, &count, &err) != PI0_OK ||
        pi0_tokenize_prompt_with_state(tok, prompt, state, dim, max_len, ids, mask, &valid, &err) !=
            PI0_OK) {
        fprintf(stderr, "  %s\n", err.message);
        return 0;
    }
    int want_valid = (int)(count + 1 < (size_t)max_len ? count + 1 : (size_t)max_len);
    int same = valid == want_valid;
    for (int i = 0; same && i < max_len; i++)
        same = ids[i] == (i < want_valid ? want[i] : 0) && mask[i] == (i < want_valid);
    return same;
}

/* The text is exactly openpi's f-string: [BOS] + encode(text), no separate "\n" piece. */
TEST(test_prompt_with_state) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    const double state[] = {-2.0, -1.0, -0.0, 0.5 - 0x1p-54, 1.0, NAN, -INFINITY, 1e30};
    CHECK(state_prompt_is(tok, "  pick_up\nthe fork \xe3\x80\x80", state, 8, 64,
                          "Task: pick up the fork, State: -1 0 128 191 255 255 -1 255;\nAction: "));
    CHECK(state_prompt_is(tok, "", state, 1, 64, "Task: , State: -1;\nAction: "));
    CHECK(state_prompt_is(tok, "x", NULL, 0, 64, "Task: x, State: ;\nAction: "));
    CHECK(state_prompt_is(tok, "x", state, 8, 5, "Task: x, State: -1 0 128 191 255 255 -1 255;\nAction: "));
    CHECK(state_prompt_is(tok, "x", state, 8, 1, "Task: x"));

    int32_t ids[4];
    uint8_t mask[4];
    pi0_error err = {0};
    CHECK(pi0_tokenize_prompt_with_state(tok, "x", NULL, 2, 4, ids, mask, NULL, &err) ==
          PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenize_prompt_with_state(tok, "x", state, -1, 4, ids, mask, NULL, &err) ==
          PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenize_prompt_with_state(tok, "x", state, 2, 0, ids, mask, NULL, &err) ==
          PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenize_prompt_with_state(tok, NULL, state, 2, 4, ids, mask, NULL, &err) ==
          PI0_ERR_INVALID_ARGUMENT);
    CHECK(pi0_tokenize_prompt_with_state(NULL, "x", state, 2, 4, ids, mask, NULL, &err) ==
          PI0_ERR_INVALID_ARGUMENT);
    pi0_tokenizer_free(tok);
}

/* ---- Model variants: protobuf fields appended to the fixture (later fields override or merge
 * into earlier ones, so sentencepiece sees the edited model) ---------------------------------- */

typedef struct {
    uint8_t *data;
    size_t size;
} blob;

static void put_bytes(blob *b, const void *data, size_t n) {
    if (n) memcpy(b->data + b->size, data, n);
    b->size += n;
}

static void put_varint(blob *b, uint64_t v) {
    for (; v >= 0x80; v >>= 7) b->data[b->size++] = (uint8_t)(v | 0x80);
    b->data[b->size++] = (uint8_t)v;
}

/* The fixture followed by `extra` (room for `extra_capacity` more bytes). */
static blob fixture_plus(const void *extra, size_t n, size_t extra_capacity) {
    blob b = {malloc(model_size + n + extra_capacity), 0};
    put_bytes(&b, model_bytes, model_size);
    put_bytes(&b, extra, n);
    return b;
}

static pi0_tokenizer *load_blob(blob b, pi0_error *err) {
    pi0_tokenizer *tok = NULL;
    pi0_tokenizer_load_buffer(b.data, b.size, &tok, err);
    free(b.data);
    return tok;
}

static pi0_tokenizer *load_fixture_plus(const void *extra, size_t n, pi0_error *err) {
    return load_blob(fixture_plus(extra, n, 0), err);
}

static void test_normalizer_flags(void) {
    REQUIRE(read_fixture_model());
    pi0_error err = {0};
    /* normalizer_spec { add_dummy_prefix: true remove_extra_whitespaces: true } */
    static const uint8_t dummy_prefix[] = {0x1A, 4, 0x18, 1, 0x20, 1};
    pi0_tokenizer *tok = load_fixture_plus(dummy_prefix, sizeof dummy_prefix, &err);
    REQUIRE(tok, "%s", err.message);
    ENCODES_TO(tok, "  pick  up the fork  ", 276, 422, 418, 266, 376);
    ENCODES_TO(tok, "a", 274);
    CHECK(encodes_to(tok, "   ", 3, NULL, 0));
    pi0_tokenizer_free(tok);

    /* ... and trainer_spec { treat_whitespace_as_suffix: true }: the dummy '▁' goes last */
    static const uint8_t suffix[] = {0x1A, 4, 0x18, 1, 0x20, 1, 0x12, 3, 0xC0, 0x01, 1};
    tok = load_fixture_plus(suffix, sizeof suffix, &err);
    REQUIRE(tok, "%s", err.message);
    ENCODES_TO(tok, "  pick  up the fork  ", 451, 418, 266, 376, 1920);
    ENCODES_TO(tok, "a", 1928, 1920);
    pi0_tokenizer_free(tok);

    /* normalizer_spec { escape_whitespaces: false }: ' ' stays, and is no piece: <0x20> */
    static const uint8_t no_escape[] = {0x1A, 2, 0x28, 0};
    tok = load_fixture_plus(no_escape, sizeof no_escape, &err);
    REQUIRE(tok, "%s", err.message);
    ENCODES_TO(tok, "stack 3 blocks", 437, 40, 1968, 40, 1934, 400, 1929);
    pi0_tokenizer_free(tok);
}

/* A hand-built darts-clone charsmap mapping "A" -> "b": root offset 256, node 'A' at 321 with a
 * leaf whose value unit (at 321 ^ 512) points at "b". Its all-zero units also make "\0A" a key,
 * a quirk sentencepiece shares. */
static blob charsmap_variant(uint32_t trie_bytes, const uint32_t *units, size_t num_units,
                             const char *strings, size_t strings_size) {
    size_t charsmap = 4 + num_units * 4 + strings_size;
    blob b = fixture_plus(NULL, 0, charsmap + 16);
    put_bytes(&b, "\x1A", 1);
    put_varint(&b, 1 + (charsmap < 128 ? 1 : charsmap < 16384 ? 2 : 3) + charsmap);
    put_bytes(&b, "\x12", 1);
    put_varint(&b, charsmap);
    for (int i = 0; i < 4; i++) b.data[b.size++] = (uint8_t)(trie_bytes >> (8 * i));
    for (size_t u = 0; u < num_units; u++)
        for (int i = 0; i < 4; i++) b.data[b.size++] = (uint8_t)(units[u] >> (8 * i));
    put_bytes(&b, strings, strings_size);
    return b;
}

static void test_charsmap(void) {
    REQUIRE(read_fixture_model());
    static uint32_t units[1024];
    memset(units, 0, sizeof units);
    units[0] = 256u << 10;
    units[321] = 0x41u | 1u << 8 | 512u << 10;
    units[833] = 1u << 31 | 0u;
    pi0_error err = {0};
    pi0_tokenizer *tok = load_blob(charsmap_variant(4096, units, 1024, "b", 2), &err);
    REQUIRE(tok, "%s", err.message);
    /* expected ids from sentencepiece 0.2.3 with the same model */
    ENCODES_TO(tok, "AAx", 1934, 1934, 1944);
    ENCODES_TO(tok, "BA", 1979, 1934);
    ENCODES_TO(tok, "A\0A", 1934, 1934);
    ENCODES_TO(tok, "pick up the fork", 451, 418, 266, 376);
    pi0_tokenizer_free(tok);

    /* the checks of DecodePrecompiledCharsMap and DoubleArray::validate */
    CHECK(!load_blob(charsmap_variant(4096, units, 1024, "b", 1), &err)); /* no final NUL */
    CHECK(strstr(err.message, "NUL"), "%s", err.message);
    CHECK(!load_blob(charsmap_variant(1000, units, 250, "b", 2), &err)); /* not 1024k bytes */
    CHECK(!load_blob(charsmap_variant(8192, units, 1024, "b", 2), &err)); /* past the blob */
    CHECK(!load_blob(charsmap_variant(0, units, 0, "", 0), &err));       /* 4 bytes */
    units[833] = 1u << 31 | 7u;                                           /* value past "b\0" */
    CHECK(!load_blob(charsmap_variant(4096, units, 1024, "b", 2), &err));
    CHECK(strstr(err.message, "invalid"), "%s", err.message);
    units[833] = 1u << 31;
    units[321] = 0x41u | 1u << 8 | 4096u << 10; /* child block outside the array */
    CHECK(!load_blob(charsmap_variant(4096, units, 1024, "b", 2), &err));
    units[0] = 0; /* root without offset */
    CHECK(!load_blob(charsmap_variant(4096, units, 1024, "b", 2), &err));
}

/* ---- Encoding in chunks, and only as far as the ids kept ----------------------------------- */

static uint64_t rng_next(uint64_t *state) { /* xorshift64* */
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    return *state * 0x2545F4914F6CDD1Dull;
}

/* Appends a random fragment of text: mostly a vocabulary piece, else spaces, punctuation, digits,
 * special-piece look-alikes, other scripts, U+2581 (whole or cut) or a malformed byte. */
static void put_fragment(blob *b, const pi0_tokenizer *tok, uint64_t *rng) {
    static const char *const others[] = {" ", "  ", "   ", "\t", "\xe3\x80\x80", "\xc2\xa0", ",", ".",
                                         "!?", "123", "7", "<loc0001>", "<loc0000>", "<loc00",
                                         "\xc3\xa9", "\xe6\x8a\x8a", "\xf0\x9f\xa4\x96", "\xe2\x96\x81",
                                         "\xe2\x96", "\xff", "\xc3", "e\xe2\x96\x81", "A"};
    uint64_t r = rng_next(rng);
    if (r % 3) { /* a vocabulary piece, its U+2581 as a space */
        const char *piece = pi0_tokenizer_piece(tok, 200 + (int)(r / 3 % 1800));
        for (; *piece; piece++) {
            if (memcmp(piece, "\xe2\x96\x81", 3) == 0) {
                put_bytes(b, " ", 1);
                piece += 2;
            } else if (*piece != '_' && *piece != '\n') {
                put_bytes(b, piece, 1);
            }
        }
    } else {
        const char *other = others[r / 3 % (sizeof others / sizeof *others)];
        put_bytes(b, other, strlen(other));
    }
}

/* Encodes with `whole` (a model with an UNUSED piece, which is encoded whole) and checks that
 * `tok` gives the same ids, chunked, and that pi0_tokenize_prompt keeps exactly their beginning
 * at every max_len. The text starts and ends with "x" and has no "_" or "\n": cleaning keeps it. */
static int kept_ids_match(const pi0_tokenizer *tok, const pi0_tokenizer *whole, const char *text) {
    enum { CAPACITY = 8192 };
    static int32_t want[CAPACITY + 1], got[CAPACITY], prompt[CAPACITY];
    static uint8_t mask[CAPACITY];
    size_t count = 0, newline = 0, chunked = 0, n = strlen(text);
    pi0_error err = {0};
    if (pi0_tokenizer_encode(whole, text, n, want + 1, CAPACITY - 1, &count, &err) != PI0_OK ||
        pi0_tokenizer_encode(tok, text, n, got, CAPACITY, &chunked, &err) != PI0_OK ||
        count + 8 > CAPACITY || chunked != count ||
        pi0_tokenizer_encode(whole, "\n", 1, want + 1 + count, 4, &newline, &err) != PI0_OK ||
        newline > 4) {
        fprintf(stderr, "  %zu ids, %zu chunked: %s\n", count, chunked, err.message);
        return 0;
    }
    if (memcmp(got, want + 1, count * sizeof *got) != 0) return 0;
    want[0] = pi0_tokenizer_bos_id(tok);
    size_t total = 1 + count + newline;
    for (int max_len = 1; max_len <= (int)total + 2; max_len += 1 + max_len / 4) {
        int valid = -1;
        if (pi0_tokenize_prompt(tok, text, max_len, prompt, mask, &valid, &err) != PI0_OK) return 0;
        int same = valid == (int)(total < (size_t)max_len ? total : (size_t)max_len);
        for (int i = 0; same && i < valid; i++) same = prompt[i] == want[i];
        if (!same) {
            fprintf(stderr, "  max_len %d: %d valid of %zu\n", max_len, valid, total);
            return 0;
        }
    }
    return 1;
}

static pi0_tokenizer *load_variant(const uint8_t *extra, size_t n, int whole) {
    /* pieces { piece: "\x7f\x7f" type: UNUSED }: a piece no test text can form */
    static const uint8_t unused[] = {0x0A, 6, 0x0A, 2, 0x7F, 0x7F, 0x18, 5};
    blob b = fixture_plus(extra, n, sizeof unused);
    if (whole) put_bytes(&b, unused, sizeof unused);
    pi0_error err = {0};
    pi0_tokenizer *tok = load_blob(b, &err);
    if (!tok) fprintf(stderr, "  load: %s\n", err.message);
    return tok;
}

/* Long random texts through every normalizer setting and user-defined symbols that span a space
 * and nest ("e▁", "e▁t": cut at a budget's end, the longer one looks like the shorter), so that
 * chunks are cut next to frozen symbols, inside runs of spaces and at the budgets' edges. */
TEST(test_kept_ids) {
    REQUIRE(read_fixture_model());
    static const uint8_t none[] = {0};
    static const uint8_t dummy_prefix[] = {0x1A, 4, 0x18, 1, 0x20, 1};
    static const uint8_t suffix[] = {0x1A, 4, 0x18, 1, 0x20, 1, 0x12, 3, 0xC0, 0x01, 1};
    static const uint8_t no_escape[] = {0x1A, 4, 0x28, 0, 0x20, 1};
    /* pieces { piece: "e▁" type: USER_DEFINED } pieces { piece: "e▁t" type: USER_DEFINED } */
    static const uint8_t user_symbols[] = {0x0A, 8, 0x0A, 4, 'e', 0xE2, 0x96, 0x81, 0x18, 4,
                                           0x0A, 9, 0x0A, 5, 'e', 0xE2, 0x96, 0x81, 't', 0x18, 4};
    const struct {
        const uint8_t *extra;
        size_t size;
    } variants[] = {{none, 0},
                    {dummy_prefix, sizeof dummy_prefix},
                    {suffix, sizeof suffix},
                    {no_escape, sizeof no_escape},
                    {user_symbols, sizeof user_symbols}};
    uint64_t rng = 0x6A09E667F3BCC908ull;
    blob text = {malloc(1 << 16), 0};
    REQUIRE(text.data);
    for (size_t v = 0; v < sizeof variants / sizeof *variants; v++) {
        pi0_tokenizer *tok = load_variant(variants[v].extra, variants[v].size, 0);
        pi0_tokenizer *whole = load_variant(variants[v].extra, variants[v].size, 1);
        CHECK(tok && whole, "variant %zu", v);
        for (int t = 0; tok && whole && t < 150; t++) {
            text.size = 0;
            put_bytes(&text, "x", 1);
            int parts = (int)(rng_next(&rng) % (t % 3 ? 60 : 600));
            for (int i = 0; i < parts; i++) put_fragment(&text, tok, &rng);
            put_bytes(&text, "x", 2); /* with the NUL */
            CHECK(kept_ids_match(tok, whole, (const char *)text.data), "variant %zu text %d: %s", v,
                  t, (const char *)text.data);
        }
        pi0_tokenizer_free(tok);
        pi0_tokenizer_free(whole);
    }
    free(text.data);
}

/* A prompt of 16 MiB costs what its first ids cost (it took seconds when encoded whole). */
TEST(test_huge_prompt) {
    pi0_tokenizer *tok = load_fixture();
    REQUIRE(tok);
    size_t n = ((size_t)1 << 24) - 64; /* the text around it stays within the 16 MiB limit */
    char *prompt = malloc(n + 1);
    REQUIRE(prompt);
    for (size_t i = 0; i < n; i++) prompt[i] = "pick up the fork "[i % 17];
    prompt[n] = '\0';
    int32_t ids[2][200];
    uint8_t mask[2][200];
    int valid[2];
    pi0_error err = {0};
    const double state[2] = {0.5, -0.25};
    CHECK(pi0_tokenize_prompt_with_state(tok, prompt, state, 2, 200, ids[0], mask[0], &valid[0],
                                         &err) == PI0_OK, "%s", err.message);
    prompt[17 * 100] = '\0'; /* 400 words: still more than 200 ids */
    CHECK(pi0_tokenize_prompt_with_state(tok, prompt, state, 2, 200, ids[1], mask[1], &valid[1],
                                         &err) == PI0_OK);
    CHECK(valid[0] == 200 && valid[1] == 200 && memcmp(ids[0], ids[1], sizeof ids[0]) == 0);
    free(prompt);
    pi0_tokenizer_free(tok);
}

static void test_model_errors(void) {
    REQUIRE(read_fixture_model());
    pi0_error err = {0};
    /* trainer_spec { byte_fallback: false } while <0xXX> pieces exist */
    static const uint8_t no_fallback[] = {0x12, 3, 0x98, 0x02, 0};
    CHECK(!load_fixture_plus(no_fallback, sizeof no_fallback, &err));
    CHECK(strstr(err.message, "byte_fallback"), "%s", err.message);
    /* trainer_spec { model_type: UNIGRAM } */
    static const uint8_t unigram[] = {0x12, 2, 0x18, 1};
    CHECK(!load_fixture_plus(unigram, sizeof unigram, &err));
    CHECK(strstr(err.message, "BPE"), "%s", err.message);
    /* a second "▁the" piece */
    static const uint8_t duplicate[] = {0x0A, 7, 0x0A, 5, 0xE2, 0x96, 0x81, 't', 'h', 'e'};
    CHECK(!load_fixture_plus(duplicate, sizeof duplicate, &err));
    /* an empty piece, a piece with a NUL inside */
    static const uint8_t empty[] = {0x0A, 2, 0x0A, 0};
    CHECK(!load_fixture_plus(empty, sizeof empty, &err));
    static const uint8_t with_nul[] = {0x0A, 4, 0x0A, 2, 'x', 0};
    CHECK(!load_fixture_plus(with_nul, sizeof with_nul, &err));
    /* a piece of 8000 bytes */
    blob b = fixture_plus(NULL, 0, 8100);
    put_bytes(&b, "\x0A", 1);
    put_varint(&b, 8003);
    put_bytes(&b, "\x0A", 1);
    put_varint(&b, 8000);
    memset(b.data + b.size, 'q', 8000);
    b.size += 8000;
    CHECK(!load_blob(b, &err));
    CHECK(strstr(err.message, "too long"), "%s", err.message);

    char path[1024];
    snprintf(path, sizeof path, "%s/tokenizer/no-such.model", fixtures_dir());
    pi0_tokenizer *tok = NULL;
    CHECK(pi0_tokenizer_load(path, &tok, &err) == PI0_ERR_IO && !tok);
    CHECK(pi0_tokenizer_load_buffer(NULL, 5, &tok, &err) == PI0_ERR_INVALID_ARGUMENT);
}

/* Wire data protobuf accepts: unknown groups, unknown enum values, mismatched wire types. */
static void test_lenient_wire_data(void) {
    REQUIRE(read_fixture_model());
    pi0_error err = {0};
    /* an empty group (field 4), then a piece "zqz" with type 9 and a varint where a string goes */
    static const uint8_t extra[] = {0x23, 0x24, 0x0A, 9, 0x0A, 3, 'z', 'q', 'z', 0x18, 9, 0x08, 5};
    pi0_tokenizer *tok = load_fixture_plus(extra, sizeof extra, &err);
    REQUIRE(tok, "%s", err.message);
    CHECK(pi0_tokenizer_vocab_size(tok) == 2001);
    CHECK(strcmp(pi0_tokenizer_piece(tok, 2000), "zqz") == 0);
    ENCODES_TO(tok, "pick up", 451, 418);
    pi0_tokenizer_free(tok);
}

/* ---- Hostile model files ----------------------------------------------------------------- */

/* Loads data[0..n) from an exact-size copy (so sanitizers see any over-read); if it loads, every
 * id it produces must be a valid id. Returns 1 when it loaded. */
static int load_and_poke(const uint8_t *data, size_t n) {
    uint8_t *copy = malloc(n ? n : 1);
    if (!copy) return 0;
    if (n) memcpy(copy, data, n);
    pi0_tokenizer *tok = NULL;
    pi0_error err = {0};
    pi0_status st = pi0_tokenizer_load_buffer(copy, n, &tok, &err);
    free(copy);
    if (st != PI0_OK) {
        CHECK(!tok && err.message[0] != '\0' && st == PI0_ERR_FORMAT, "status %d", st);
        return 0;
    }
    static const char *texts[] = {"pick up the fork", "  x\xff\xc3 <loc0000>\n\t\xe6\x8a\x8a", "",
                                  "<start_of_turn>user 12345 ABC xyz"};
    for (size_t t = 0; t < sizeof texts / sizeof *texts; t++) {
        int32_t ids[128];
        size_t count = 0;
        CHECK(pi0_tokenizer_encode(tok, texts[t], strlen(texts[t]), ids, 128, &count, &err) == PI0_OK);
        for (size_t i = 0; i < count && i < 128; i++)
            CHECK(ids[i] >= 0 && ids[i] < pi0_tokenizer_vocab_size(tok), "id %d", ids[i]);
    }
    int32_t prompt[16];
    uint8_t mask[16];
    pi0_tokenize_prompt(tok, "pick_up", 16, prompt, mask, NULL, &err);
    pi0_tokenizer_free(tok);
    return 1;
}

static void test_truncated_models(void) {
    REQUIRE(read_fixture_model());
    size_t loaded = 0;
    for (size_t n = 0; n < model_size; n++) loaded += load_and_poke(model_bytes, n);
    /* cuts at field boundaries after trainer_spec load (with default normalizer flags) */
    fprintf(stderr, "  %zu of %zu truncations load\n", loaded, model_size);
    CHECK(load_and_poke(model_bytes, model_size));
}

static void test_mutated_models(void) {
    REQUIRE(read_fixture_model());
    uint8_t *mutant = malloc(model_size);
    REQUIRE(mutant);
    uint64_t state = 0x9E3779B97F4A7C15ull;
    size_t loaded = 0, trials = 3000;
    for (size_t t = 0; t < trials; t++) {
        memcpy(mutant, model_bytes, model_size);
        /* half the mutants aim at the tail, where trainer_spec and normalizer_spec live */
        size_t region = t % 2 ? 256 : model_size;
        int edits = 1 + (int)(rng_next(&state) % 8);
        for (int e = 0; e < edits; e++) {
            size_t pos = model_size - 1 - rng_next(&state) % region;
            mutant[pos] = (uint8_t)rng_next(&state);
        }
        loaded += load_and_poke(mutant, model_size);
    }
    fprintf(stderr, "  %zu of %zu mutants load\n", loaded, trials);
    free(mutant);
}

static void test_crafted_wire_data(void) {
    static const uint8_t overlong_varint[] = {0x08, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF,
                                              0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01};
    static const uint8_t field_zero[] = {0x02, 0x00};
    static const uint8_t huge_length[] = {0x0A, 0xFF, 0xFF, 0xFF, 0xFF, 0x0F, 0x00};
    static const uint8_t wire_type_7[] = {0x0F};
    static const uint8_t stray_end_group[] = {0x0C};
    static const uint8_t unclosed_group[] = {0x0B, 0x08, 0x01};
    static const uint8_t mismatched_group[] = {0x0B, 0x14};
    static const uint8_t short_fixed32[] = {0x0A, 3, 0x15, 0x00, 0x00};
    const struct {
        const uint8_t *data;
        size_t size;
    } cases[] = {
        {overlong_varint, sizeof overlong_varint}, {field_zero, sizeof field_zero},
        {huge_length, sizeof huge_length},         {wire_type_7, sizeof wire_type_7},
        {stray_end_group, sizeof stray_end_group}, {unclosed_group, sizeof unclosed_group},
        {mismatched_group, sizeof mismatched_group}, {short_fixed32, sizeof short_fixed32},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        CHECK(!load_and_poke(cases[i].data, cases[i].size), "case %zu", i);
    CHECK(!load_and_poke(NULL, 0)); /* empty: no BPE model_type */

    /* 100000 nested groups: refused, without recursing that deep */
    size_t depth = 100000;
    uint8_t *nested = malloc(depth);
    REQUIRE(nested);
    memset(nested, 0x0B, depth);
    CHECK(!load_and_poke(nested, depth));
    free(nested);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    RUN(test_fixture_cases);
    RUN(test_model_info);
    RUN(test_malformed_utf8);
    RUN(test_encode_capacity);
    RUN(test_oversized_input);
    RUN(test_prompt);
    RUN(test_pi05_fixture);
    RUN(test_state_bins);
    RUN(test_prompt_with_state);
    RUN(test_normalizer_flags);
    RUN(test_charsmap);
    RUN(test_kept_ids);
    RUN(test_huge_prompt);
    RUN(test_model_errors);
    RUN(test_lenient_wire_data);
    RUN(test_truncated_models);
    RUN(test_mutated_models);
    RUN(test_crafted_wire_data);
    free(model_bytes);
    return check_finish();
}
