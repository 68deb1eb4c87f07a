/*
 * tokenizer.c - SentencePiece BPE encoding, bit-exact with the sentencepiece library.
 *
 * Reference: sentencepiece 0.2.3 (the PyPI release tests/tokenizer_vs_sentencepiece.py checks
 * against). The pipeline is SentencePieceProcessor::EncodeOptimized for a BPE model:
 *
 *   1. Normalizer::Normalize (normalizer.cc): the input is cut into prefixes, each either a
 *      user-defined symbol (kept verbatim), the longest match of the precompiled charsmap (replaced
 *      by its normalized string), one valid UTF-8 character, or one malformed byte (-> U+FFFD).
 *      Spaces become U+2581 '▁' (escape_whitespaces), a '▁' is prepended (add_dummy_prefix) and
 *      leading/repeated/trailing spaces are dropped (remove_extra_whitespaces).
 *   2. bpe::Model::SampleEncode with alpha = 0 (bpe_model.cc): the normalized string is split into
 *      characters (user-defined symbols again matched first and frozen), then the adjacent pair
 *      whose concatenation is the highest-scoring mergeable piece is merged, leftmost first on
 *      ties, until no pair forms one. Merged UNUSED pieces are split back into the pieces they
 *      came from. There is no pretokenization at encode time: split_by_whitespace, split_digits,
 *      split_by_unicode_script and split_by_number only shape training, so they are not read.
 *   3. The id loop of EncodeOptimized (sentencepiece_processor.cc): a symbol that is not a piece
 *      is unknown; with byte_fallback it becomes its UTF-8 bytes as <0xXX> pieces, without it a
 *      run of unknown symbols becomes one unk id.
 *
 * The normalized text is encoded in chunks cut where no merge can cross (see "Encoding in chunks"
 * below), and the prompt functions stop a little past the ids they keep.
 *
 * The `.model` file is parsed by a small protobuf wire-format reader; every length is checked
 * against the buffer, so a corrupt file is an error, never an out-of-bounds read. The model is
 * validated like ModelInterface::InitializePieces and Normalizer::Init do (unique pieces, 256 byte
 * pieces when byte_fallback is on, a well-formed charsmap trie, ...).
 */
#include "policy/tokenizer.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/error.h"

/* ModelProto.SentencePiece.Type */
enum {
    PIECE_NORMAL = 1,
    PIECE_UNKNOWN = 2,
    PIECE_CONTROL = 3,
    PIECE_USER_DEFINED = 4,
    PIECE_UNUSED = 5,
    PIECE_BYTE = 6,
};

/* TrainerSpec.ModelType */
enum { MODEL_UNIGRAM = 1, MODEL_BPE = 2, MODEL_CHAR = 4 };

/* sentencepiece refuses pieces of 8000 bytes or more (model_interface.cc, kMaxPieceSize). */
#define MAX_PIECE_BYTES 8000
/* Longest text encode accepts; keeps every index of the normalized text well inside int32. */
#define MAX_TEXT_BYTES ((size_t)1 << 24)
/* Largest model file accepted: piece offsets are 32-bit. */
#define MAX_MODEL_BYTES ((size_t)1 << 31)
/* bpe_model.cc kMaxBpeResegmentDepth: an UNUSED piece nested deeper is emitted as it is. */
#define MAX_RESEGMENT_DEPTH 100
/* How many prefix matches the searches look at: Normalizer::kMaxTrieResultsSize and the
 * kResultSize of PrefixMatcher::PrefixMatch. */
#define MAX_CHARSMAP_MATCHES 32
#define MAX_USER_SYMBOL_MATCHES 64
/* Nesting of unknown groups the protobuf reader skips (protobuf's default recursion limit). */
#define MAX_GROUP_DEPTH 100

static const char SPACE_SYMBOL[] = "\xe2\x96\x81"; /* U+2581, sentencepiece's kSpaceSymbol */
static const char REPLACEMENT_CHAR[] = "\xef\xbf\xbd"; /* U+FFFD */

typedef struct {
    uint32_t offset; /* into the arena, NUL-terminated there */
    uint32_t length;
    float score;
    uint8_t type;
} piece_entry;

struct pi0_tokenizer {
    piece_entry *pieces;
    int num_pieces;
    char *arena;

    /* piece -> id, open addressing, -1 = empty: sentencepiece's pieces_ map, which for BPE holds
     * every piece type (InitializePieces(use_reserved_id_map = false)). */
    int32_t *slots;
    size_t slot_mask;

    int unk_id; /* -1 when the model has no UNKNOWN piece (allowed with byte_fallback) */
    int bos_id;
    int byte_fallback;
    int byte_ids[256];
    int treat_whitespace_as_suffix;

    /* NormalizerSpec flags */
    int add_dummy_prefix;
    int remove_extra_whitespaces;
    int escape_whitespaces;

    /* User-defined symbols: the bytes they start with and their distinct lengths, increasing. */
    uint8_t user_first_byte[256];
    uint32_t *user_lengths;
    int num_user_lengths;

    /* For encoding only the ids that are kept (encode_kept): a bit set of the hashes of every two
     * adjacent characters inside a piece BPE may form (NULL: the text is encoded whole), and how
     * far past a position splitting the text into symbols looks (4, or the longest user symbol). */
    uint64_t *pair_filter;
    size_t pair_filter_mask;
    size_t lookahead;

    /* Precompiled charsmap: a darts-clone double array (units) and the NUL-terminated replacement
     * strings its values point into. NULL trie = identity. */
    uint32_t *trie;
    size_t trie_units;
    char *replacements;
    size_t replacements_size;
};

static pi0_status out_of_memory(pi0_error *err) {
    return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "tokenizer: out of memory");
}

/* ---------------------------------------------------------------------------------------------
 * Protobuf wire format
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *pos, *end;
} pb_reader;

typedef struct {
    uint32_t number;
    int wire_type;
    uint64_t value;      /* wire types 0 (varint), 1 (fixed64) and 5 (fixed32) */
    const uint8_t *data; /* wire type 2 (length-delimited) */
    size_t length;
} pb_field;

enum {
    WIRE_VARINT = 0,
    WIRE_FIXED64 = 1,
    WIRE_BYTES = 2,
    WIRE_START_GROUP = 3,
    WIRE_END_GROUP = 4,
    WIRE_FIXED32 = 5,
};

static int pb_read_varint(pb_reader *r, uint64_t *out) {
    uint64_t value = 0;
    for (int shift = 0; shift < 70; shift += 7) { /* at most 10 bytes */
        if (r->pos == r->end) return 0;
        uint8_t byte = *r->pos++;
        if (shift < 64) value |= (uint64_t)(byte & 0x7F) << shift;
        if (!(byte & 0x80)) {
            *out = value;
            return 1;
        }
    }
    return 0;
}

static uint64_t load_le(const uint8_t *p, int bytes) {
    uint64_t value = 0;
    for (int i = bytes - 1; i >= 0; i--) value = value << 8 | p[i];
    return value;
}

static int pb_read_field(pb_reader *r, pb_field *f, int depth);

/* Skips the fields of a group up to its END_GROUP tag, which must carry the same number. */
static int pb_skip_group(pb_reader *r, uint32_t number, int depth) {
    if (depth > MAX_GROUP_DEPTH) return 0;
    pb_field inner;
    for (;;) {
        if (!pb_read_field(r, &inner, depth + 1)) return 0;
        if (inner.wire_type == WIRE_END_GROUP) return inner.number == number;
    }
}

/* Reads one field; a group (no sentencepiece field is one) is skipped whole. Returns 0 when it is
 * malformed: truncated, a length past the end, field number 0, an unbalanced group, wire type 6/7. */
static int pb_read_field(pb_reader *r, pb_field *f, int depth) {
    uint64_t key, length;
    if (!pb_read_varint(r, &key) || key >> 3 == 0 || key >> 3 > 0x1FFFFFFF) return 0;
    f->number = (uint32_t)(key >> 3);
    f->wire_type = (int)(key & 7);
    switch (f->wire_type) {
    case WIRE_VARINT: return pb_read_varint(r, &f->value);
    case WIRE_FIXED64:
    case WIRE_FIXED32: {
        int bytes = f->wire_type == WIRE_FIXED64 ? 8 : 4;
        if (r->end - r->pos < bytes) return 0;
        f->value = load_le(r->pos, bytes);
        r->pos += bytes;
        return 1;
    }
    case WIRE_BYTES:
        if (!pb_read_varint(r, &length) || length > (uint64_t)(r->end - r->pos)) return 0;
        f->data = r->pos;
        f->length = (size_t)length;
        r->pos += length;
        return 1;
    case WIRE_START_GROUP: return pb_skip_group(r, f->number, depth);
    case WIRE_END_GROUP: return 1;
    default: return 0;
    }
}

/* The next field of a message; an END_GROUP outside any group is malformed. */
static int pb_next(pb_reader *r, pb_field *f) {
    return pb_read_field(r, f, 0) && f->wire_type != WIRE_END_GROUP;
}

/* ---------------------------------------------------------------------------------------------
 * Model parsing. Fields follow sentencepiece_model.proto (proto2) and protobuf's rules: a field
 * whose wire type does not match its declaration is skipped, as is an enum value the proto does
 * not define; a repeated scalar keeps its last value; a repeated sub-message (trainer_spec,
 * normalizer_spec) merges into the earlier one.
 * ------------------------------------------------------------------------------------------- */

/* What parsing collects besides the tokenizer itself; pointers go into the model buffer. */
typedef struct {
    int model_type;
    const uint8_t *bos_piece;
    size_t bos_piece_length;
    const uint8_t *charsmap;
    size_t charsmap_length;
    size_t arena_used, arena_capacity;
    int pieces_capacity;
} model_parse;

static pi0_status corrupt(pi0_error *err, const char *where) {
    return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: corrupt or truncated protobuf in %s",
                    where);
}

static pi0_status add_piece(pi0_tokenizer *tok, model_parse *mp, const piece_entry *entry,
                            pi0_error *err) {
    if (tok->num_pieces == mp->pieces_capacity) {
        int capacity = mp->pieces_capacity ? 2 * mp->pieces_capacity : 1024;
        piece_entry *grown = realloc(tok->pieces, (size_t)capacity * sizeof *grown);
        if (!grown) return out_of_memory(err);
        tok->pieces = grown;
        mp->pieces_capacity = capacity;
    }
    tok->pieces[tok->num_pieces++] = *entry;
    return PI0_OK;
}

/* ModelProto.SentencePiece: piece (1) string, score (2) float, type (3) enum. */
static pi0_status parse_piece(pi0_tokenizer *tok, model_parse *mp, const uint8_t *data,
                              size_t size, pi0_error *err) {
    piece_entry entry = {.offset = 0, .length = 0, .score = 0.0f, .type = PIECE_NORMAL};
    pb_reader r = {data, data + size};
    pb_field f;
    while (r.pos < r.end) {
        if (!pb_next(&r, &f)) return corrupt(err, "a piece");
        if (f.number == 1 && f.wire_type == WIRE_BYTES) {
            /* Every copied string is a distinct stretch of the file preceded by at least a tag
             * and a length byte, so the arena (file size + 1) never overflows. */
            if (mp->arena_used + f.length + 1 > mp->arena_capacity) return corrupt(err, "a piece");
            memcpy(tok->arena + mp->arena_used, f.data, f.length);
            tok->arena[mp->arena_used + f.length] = '\0';
            entry.offset = (uint32_t)mp->arena_used;
            entry.length = (uint32_t)f.length;
            mp->arena_used += f.length + 1;
        } else if (f.number == 2 && f.wire_type == WIRE_FIXED32) {
            uint32_t bits = (uint32_t)f.value;
            memcpy(&entry.score, &bits, sizeof entry.score);
        } else if (f.number == 3 && f.wire_type == WIRE_VARINT && f.value >= PIECE_NORMAL &&
                   f.value <= PIECE_BYTE) {
            entry.type = (uint8_t)f.value;
        }
    }
    return add_piece(tok, mp, &entry, err);
}

/* TrainerSpec: only the fields encoding depends on. The unk/bos/eos/pad ids are not read:
 * sentencepiece itself finds unk by piece type and BOS by bos_piece. */
static void parse_trainer_spec(pi0_tokenizer *tok, model_parse *mp, const pb_field *f) {
    if (f->wire_type == WIRE_VARINT) {
        if (f->number == 3 && f->value >= MODEL_UNIGRAM && f->value <= MODEL_CHAR)
            mp->model_type = (int)f->value;
        else if (f->number == 24) tok->treat_whitespace_as_suffix = f->value != 0;
        else if (f->number == 35) tok->byte_fallback = f->value != 0;
    } else if (f->wire_type == WIRE_BYTES && f->number == 46) {
        mp->bos_piece = f->data;
        mp->bos_piece_length = f->length;
    }
}

/* NormalizerSpec: precompiled_charsmap (2), add_dummy_prefix (3), remove_extra_whitespaces (4),
 * escape_whitespaces (5). The rule name (1) only matters to the trainer. */
static void parse_normalizer_spec(pi0_tokenizer *tok, model_parse *mp, const pb_field *f) {
    if (f->wire_type == WIRE_BYTES && f->number == 2) {
        mp->charsmap = f->data;
        mp->charsmap_length = f->length;
    } else if (f->wire_type == WIRE_VARINT) {
        if (f->number == 3) tok->add_dummy_prefix = f->value != 0;
        else if (f->number == 4) tok->remove_extra_whitespaces = f->value != 0;
        else if (f->number == 5) tok->escape_whitespaces = f->value != 0;
    }
}

/* Runs `parse` on every field of the sub-message data[0..size). */
static pi0_status parse_spec(pi0_tokenizer *tok, model_parse *mp, const uint8_t *data, size_t size,
                             void (*parse)(pi0_tokenizer *, model_parse *, const pb_field *),
                             const char *name, pi0_error *err) {
    pb_reader r = {data, data + size};
    pb_field f;
    while (r.pos < r.end) {
        if (!pb_next(&r, &f)) return corrupt(err, name);
        parse(tok, mp, &f);
    }
    return PI0_OK;
}

/* ModelProto: pieces (1), trainer_spec (2), normalizer_spec (3); denormalizer_spec (5) and
 * self_test_data only matter to decoding and training. */
static pi0_status parse_model(pi0_tokenizer *tok, model_parse *mp, const uint8_t *data,
                              size_t size, pi0_error *err) {
    pb_reader r = {data, data + size};
    pb_field f;
    while (r.pos < r.end) {
        if (!pb_next(&r, &f)) return corrupt(err, "ModelProto");
        if (f.wire_type != WIRE_BYTES) continue;
        pi0_status st = PI0_OK;
        if (f.number == 1) st = parse_piece(tok, mp, f.data, f.length, err);
        else if (f.number == 2)
            st = parse_spec(tok, mp, f.data, f.length, parse_trainer_spec, "trainer_spec", err);
        else if (f.number == 3)
            st = parse_spec(tok, mp, f.data, f.length, parse_normalizer_spec, "normalizer_spec", err);
        if (st != PI0_OK) return st;
    }
    return PI0_OK;
}

/* ---------------------------------------------------------------------------------------------
 * Piece lookup
 * ------------------------------------------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a, then a final mix for the low bits */
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static const char *piece_text(const pi0_tokenizer *tok, int id) {
    return tok->arena + tok->pieces[id].offset;
}

/* Id of the piece spelled s[0..n), or -1. */
static int find_piece(const pi0_tokenizer *tok, const char *s, size_t n) {
    for (size_t slot = hash_bytes(s, n) & tok->slot_mask;; slot = (slot + 1) & tok->slot_mask) {
        int id = tok->slots[slot];
        if (id < 0) return -1;
        if (tok->pieces[id].length == n && memcmp(piece_text(tok, id), s, n) == 0) return id;
    }
}

/* IsReservedId: CONTROL, UNKNOWN and BYTE pieces are never merged into nor emitted by BPE. */
static int is_reserved(const pi0_tokenizer *tok, int id) {
    int type = tok->pieces[id].type;
    return type != PIECE_NORMAL && type != PIECE_USER_DEFINED && type != PIECE_UNUSED;
}

/* "<0xXX>" (uppercase hex, as ByteToPiece writes it) -> XX, else -1. */
static int byte_of_piece(const char *s, size_t n) {
    static const char hex[] = "0123456789ABCDEF";
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>') return -1;
    const char *hi = s[3] ? strchr(hex, s[3]) : NULL, *lo = s[4] ? strchr(hex, s[4]) : NULL;
    return hi && lo ? (int)((hi - hex) * 16 + (lo - hex)) : -1;
}

/* ---------------------------------------------------------------------------------------------
 * Building the tokenizer from the parsed model
 * ------------------------------------------------------------------------------------------- */

/* Checks one piece like InitializePieces; *indexed says whether it goes into the piece map. */
static pi0_status check_piece(pi0_tokenizer *tok, int id, int *indexed, pi0_error *err) {
    piece_entry *p = &tok->pieces[id];
    const char *text = piece_text(tok, id);
    *indexed = 0;
    if (p->length >= MAX_PIECE_BYTES)
        return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: piece %d is too long", id);
    if (p->length == 0) return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: piece %d is empty", id);
    /* A lone "\0" piece (left by some conversion scripts) is made UNUSED when byte_fallback is
     * on, and an UNUSED "\0" stays out of the map (SentencePieceProcessor::Load, issue #1308). */
    int is_nul = p->length == 1 && text[0] == '\0';
    if (is_nul && tok->byte_fallback) p->type = PIECE_UNUSED;
    if (is_nul && p->type == PIECE_UNUSED) return PI0_OK;
    if (memchr(text, '\0', p->length))
        return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: piece %d contains a NUL byte", id);
    if (find_piece(tok, text, p->length) >= 0)
        return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: piece %d (%.64s) is defined twice",
                        id, text);
    if (p->type == PIECE_UNKNOWN) {
        if (tok->unk_id >= 0)
            return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: unk is defined twice (%d, %d)",
                            tok->unk_id, id);
        tok->unk_id = id;
    }
    if (p->type == PIECE_BYTE) {
        if (!tok->byte_fallback)
            return pi0_fail(err, PI0_ERR_FORMAT,
                            "tokenizer model: byte piece %.16s found although byte_fallback is false",
                            text);
        int byte = byte_of_piece(text, p->length);
        if (byte < 0)
            return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: invalid byte piece %.16s", text);
        tok->byte_ids[byte] = id;
    }
    *indexed = 1;
    return PI0_OK;
}

static pi0_status index_pieces(pi0_tokenizer *tok, pi0_error *err) {
    size_t capacity = 16;
    while (capacity < 2 * (size_t)tok->num_pieces) capacity *= 2;
    tok->slots = malloc(capacity * sizeof *tok->slots);
    if (!tok->slots) return out_of_memory(err);
    memset(tok->slots, 0xFF, capacity * sizeof *tok->slots);
    tok->slot_mask = capacity - 1;
    tok->unk_id = -1;
    for (int i = 0; i < 256; i++) tok->byte_ids[i] = -1;

    for (int id = 0; id < tok->num_pieces; id++) {
        int indexed;
        pi0_status st = check_piece(tok, id, &indexed, err);
        if (st != PI0_OK) return st;
        if (!indexed) continue;
        size_t slot = hash_bytes(piece_text(tok, id), tok->pieces[id].length) & tok->slot_mask;
        while (tok->slots[slot] >= 0) slot = (slot + 1) & tok->slot_mask;
        tok->slots[slot] = id;
    }
    if (tok->unk_id < 0 && !tok->byte_fallback)
        return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: unk is not defined");
    for (int b = 0; tok->byte_fallback && b < 256; b++)
        if (tok->byte_ids[b] < 0)
            return pi0_fail(err, PI0_ERR_FORMAT,
                            "tokenizer model: byte_fallback is on but <0x%02X> is missing", b);
    return PI0_OK;
}

static int compare_ascending(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static pi0_status index_user_symbols(pi0_tokenizer *tok, pi0_error *err) {
    int count = 0;
    for (int id = 0; id < tok->num_pieces; id++) count += tok->pieces[id].type == PIECE_USER_DEFINED;
    if (count == 0) return PI0_OK;
    tok->user_lengths = malloc((size_t)count * sizeof *tok->user_lengths);
    if (!tok->user_lengths) return out_of_memory(err);
    for (int id = 0, n = 0; id < tok->num_pieces; id++) {
        if (tok->pieces[id].type != PIECE_USER_DEFINED) continue;
        tok->user_first_byte[(uint8_t)piece_text(tok, id)[0]] = 1;
        tok->user_lengths[n++] = tok->pieces[id].length;
    }
    qsort(tok->user_lengths, (size_t)count, sizeof *tok->user_lengths, compare_ascending);
    int distinct = 0;
    for (int i = 0; i < count; i++)
        if (distinct == 0 || tok->user_lengths[distinct - 1] != tok->user_lengths[i])
            tok->user_lengths[distinct++] = tok->user_lengths[i];
    tok->num_user_lengths = distinct;
    return PI0_OK;
}

/* darts-clone DoubleArrayUnit accessors (darts.h). */
static uint32_t unit_offset(uint32_t unit) { return (unit >> 10) << ((unit & (1u << 9)) >> 6); }
static uint32_t unit_label(uint32_t unit) { return unit & ((1u << 31) | 0xFF); }
static int unit_has_leaf(uint32_t unit) { return (unit >> 8) & 1; }
static uint32_t unit_value(uint32_t unit) { return unit & ((1u << 31) - 1); }

/* darts-clone DoubleArray::validate(max_value): every child block of every node lies inside the
 * array, every leaf flag points at a value unit, every value is below max_value. This is what
 * lets charsmap_match walk the array without bounds checks. */
static int trie_is_valid(const uint32_t *units, size_t size, uint32_t max_value) {
    uint32_t root = units[0];
    if (unit_label(root) != 0 || unit_has_leaf(root) || unit_offset(root) == 0 ||
        (unit_offset(root) | 0xFFu) >= size)
        return 0;
    for (size_t i = 1; i < size; i++) {
        uint32_t unit = units[i];
        if (unit_label(unit) <= 0xFF) {
            if (((i ^ unit_offset(unit)) | 0xFF) >= size) return 0;
            if (unit_has_leaf(unit) && unit_label(units[i ^ unit_offset(unit)]) <= 0xFF) return 0;
        } else if (unit_value(unit) >= max_value) {
            return 0;
        }
    }
    return 1;
}

/* Normalizer::DecodePrecompiledCharsMap + Init: <trie size: uint32 LE><trie units><replacement
 * strings, the block ending with NUL>, checked exactly as sentencepiece checks it. */
static pi0_status load_charsmap(pi0_tokenizer *tok, const uint8_t *blob, size_t size,
                                pi0_error *err) {
    if (size == 0) return PI0_OK; /* identity */
    if (size <= 4)
        return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: precompiled_charsmap is broken");
    size_t trie_bytes = (size_t)load_le(blob, 4);
    if (trie_bytes >= size - 4)
        return pi0_fail(err, PI0_ERR_FORMAT,
                        "tokenizer model: precompiled_charsmap trie exceeds the blob");
    if (trie_bytes < 1024 || trie_bytes % 1024 != 0)
        return pi0_fail(err, PI0_ERR_FORMAT,
                        "tokenizer model: precompiled_charsmap trie size %zu is not a multiple of 1024",
                        trie_bytes);
    if (blob[size - 1] != '\0')
        return pi0_fail(err, PI0_ERR_FORMAT,
                        "tokenizer model: precompiled_charsmap strings are not NUL-terminated");
    tok->trie_units = trie_bytes / 4;
    tok->replacements_size = size - 4 - trie_bytes;
    tok->trie = malloc(tok->trie_units * sizeof *tok->trie);
    tok->replacements = malloc(tok->replacements_size);
    if (!tok->trie || !tok->replacements) return out_of_memory(err);
    for (size_t i = 0; i < tok->trie_units; i++) tok->trie[i] = (uint32_t)load_le(blob + 4 + 4 * i, 4);
    memcpy(tok->replacements, blob + 4 + trie_bytes, tok->replacements_size);
    if (!trie_is_valid(tok->trie, tok->trie_units, (uint32_t)tok->replacements_size))
        return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: precompiled_charsmap is invalid");
    return PI0_OK;
}

static pi0_status build_pair_filter(pi0_tokenizer *tok, pi0_error *err);

static pi0_status build(pi0_tokenizer *tok, const uint8_t *data, size_t size, pi0_error *err) {
    if (size >= MAX_MODEL_BYTES)
        return pi0_fail(err, PI0_ERR_FORMAT, "tokenizer model: file too large (%zu bytes)", size);
    model_parse mp = {.model_type = MODEL_UNIGRAM, /* proto default */
                      .arena_capacity = size + 1};
    /* NormalizerSpec defaults (sentencepiece_model.proto) */
    tok->add_dummy_prefix = tok->remove_extra_whitespaces = tok->escape_whitespaces = 1;
    tok->arena = malloc(mp.arena_capacity);
    if (!tok->arena) return out_of_memory(err);

    pi0_status st = parse_model(tok, &mp, data, size, err);
    if (st != PI0_OK) return st;
    if (mp.model_type != MODEL_BPE)
        return pi0_fail(err, PI0_ERR_FORMAT,
                        "tokenizer model: model_type %d is not supported, only BPE (2)",
                        mp.model_type);
    if ((st = index_pieces(tok, err)) != PI0_OK) return st;
    if ((st = index_user_symbols(tok, err)) != PI0_OK) return st;
    if ((st = load_charsmap(tok, mp.charsmap, mp.charsmap_length, err)) != PI0_OK) return st;
    if ((st = build_pair_filter(tok, err)) != PI0_OK) return st;

    /* SentencePieceProcessor::bos_id(): bos_piece ("<s>" when empty), if that is a CONTROL piece. */
    if (mp.bos_piece_length == 0) {
        mp.bos_piece = (const uint8_t *)"<s>";
        mp.bos_piece_length = 3;
    }
    int bos = find_piece(tok, (const char *)mp.bos_piece, mp.bos_piece_length);
    tok->bos_id = bos >= 0 && tok->pieces[bos].type == PIECE_CONTROL ? bos : -1;
    return PI0_OK;
}

pi0_status pi0_tokenizer_load_buffer(const void *data, size_t size, pi0_tokenizer **out,
                                     pi0_error *err) {
    if (!out || (!data && size > 0))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenizer: NULL argument");
    *out = NULL;
    pi0_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) return out_of_memory(err);
    pi0_status st = build(tok, data, size, err);
    if (st != PI0_OK) {
        pi0_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return PI0_OK;
}

/* Reads a whole file into *data (NULL and 0 on entry; the caller frees it, even on error). */
static pi0_status read_file(const char *path, uint8_t **data, size_t *size, pi0_error *err) {
    FILE *file = fopen(path, "rb");
    if (!file) return pi0_fail(err, PI0_ERR_IO, "%s: %s", path, strerror(errno));
    size_t capacity = 0;
    pi0_status st = PI0_OK;
    for (;;) {
        if (*size == capacity) {
            if (capacity >= MAX_MODEL_BYTES) {
                st = pi0_fail(err, PI0_ERR_FORMAT, "%s: file too large", path);
                break;
            }
            capacity = capacity ? 2 * capacity : 1 << 20;
            uint8_t *grown = realloc(*data, capacity);
            if (!grown) {
                st = out_of_memory(err);
                break;
            }
            *data = grown;
        }
        size_t got = fread(*data + *size, 1, capacity - *size, file);
        *size += got;
        if (got == 0) {
            if (ferror(file)) st = pi0_fail(err, PI0_ERR_IO, "%s: read error", path);
            break;
        }
    }
    fclose(file);
    return st;
}

pi0_status pi0_tokenizer_load(const char *path, pi0_tokenizer **out, pi0_error *err) {
    if (!path || !out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenizer: NULL argument");
    *out = NULL;
    uint8_t *data = NULL;
    size_t size = 0;
    pi0_status st = read_file(path, &data, &size, err);
    if (st == PI0_OK) {
        pi0_error inner = {0};
        st = pi0_tokenizer_load_buffer(data, size, out, &inner);
        if (st != PI0_OK) pi0_fail(err, st, "%s: %s", path, inner.message);
    }
    free(data);
    return st;
}

void pi0_tokenizer_free(pi0_tokenizer *tok) {
    if (!tok) return;
    free(tok->pieces);
    free(tok->arena);
    free(tok->slots);
    free(tok->user_lengths);
    free(tok->pair_filter);
    free(tok->trie);
    free(tok->replacements);
    free(tok);
}

int pi0_tokenizer_vocab_size(const pi0_tokenizer *tok) { return tok ? tok->num_pieces : 0; }

int pi0_tokenizer_bos_id(const pi0_tokenizer *tok) { return tok ? tok->bos_id : -1; }

const char *pi0_tokenizer_piece(const pi0_tokenizer *tok, int id) {
    if (!tok || id < 0 || id >= tok->num_pieces) return NULL;
    return piece_text(tok, id);
}

/* ---------------------------------------------------------------------------------------------
 * UTF-8 and prefix matching
 * ------------------------------------------------------------------------------------------- */

/* string_util::OneCharLen: the length a lead byte announces, without validation. */
static size_t one_char_len(uint8_t lead) {
    static const uint8_t lengths[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    return lengths[lead >> 4];
}

static int is_trail_byte(uint8_t b) { return (b & 0xC0) == 0x80; }

/* string_util::DecodeUTF8: the code point at s (n > 0 bytes) and its length, or -1 (length 1)
 * for a malformed sequence: bad trail byte, overlong form, surrogate or beyond U+10FFFF. */
static int32_t decode_utf8(const uint8_t *s, size_t n, size_t *length) {
    uint32_t cp;
    *length = 1;
    if (s[0] < 0x80) return s[0];
    if (n >= 2 && (s[0] & 0xE0) == 0xC0 && is_trail_byte(s[1])) {
        cp = (uint32_t)(s[0] & 0x1F) << 6 | (s[1] & 0x3F);
        if (cp < 0x80) return -1;
        *length = 2;
    } else if (n >= 3 && (s[0] & 0xF0) == 0xE0 && is_trail_byte(s[1]) && is_trail_byte(s[2])) {
        cp = (uint32_t)(s[0] & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F);
        if (cp < 0x800) return -1;
        *length = 3;
    } else if (n >= 4 && (s[0] & 0xF8) == 0xF0 && is_trail_byte(s[1]) && is_trail_byte(s[2]) &&
               is_trail_byte(s[3])) {
        cp = (uint32_t)(s[0] & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 |
             (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
        if (cp < 0x10000) return -1;
        *length = 4;
    } else {
        return -1;
    }
    if ((cp >= 0xD800 && cp < 0xE000) || cp > 0x10FFFF) {
        *length = 1;
        return -1;
    }
    return (int32_t)cp;
}

/* PrefixMatcher::PrefixMatch: the longest user-defined symbol prefixing s (*found = 1), among the
 * first 64 matches as darts reports them (shortest first); else one character by its lead byte,
 * clipped to n. */
static size_t match_user_symbol(const pi0_tokenizer *tok, const char *s, size_t n, int *found) {
    size_t longest = 0;
    int matches = 0;
    if (tok->user_first_byte[(uint8_t)s[0]]) {
        for (int i = 0; i < tok->num_user_lengths && matches < MAX_USER_SYMBOL_MATCHES; i++) {
            size_t length = tok->user_lengths[i];
            if (length > n) break;
            int id = find_piece(tok, s, length);
            if (id >= 0 && tok->pieces[id].type == PIECE_USER_DEFINED) {
                longest = length;
                matches++;
            }
        }
    }
    *found = matches > 0;
    if (*found) return longest;
    size_t length = one_char_len((uint8_t)s[0]);
    return length < n ? length : n;
}

/* darts-clone commonPrefixSearch over the charsmap trie, keeping the longest of the first 32 hits
 * as Normalizer::NormalizePrefix does. Returns its length (0 = none) and sets *value. The trie
 * passed trie_is_valid, so every index stays inside the array and *value inside replacements. */
static size_t charsmap_match(const pi0_tokenizer *tok, const uint8_t *s, size_t n,
                             uint32_t *value) {
    const uint32_t *units = tok->trie;
    size_t node = unit_offset(units[0]), longest = 0;
    int matches = 0;
    for (size_t i = 0; i < n && matches < MAX_CHARSMAP_MATCHES; i++) {
        node ^= s[i];
        uint32_t unit = units[node];
        if (unit_label(unit) != s[i]) break;
        node ^= unit_offset(unit);
        if (unit_has_leaf(unit)) {
            longest = i + 1;
            *value = unit_value(units[node]);
            matches++;
        }
    }
    return longest;
}

/* ---------------------------------------------------------------------------------------------
 * Normalization (normalizer.cc)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    char *data;
    size_t length, capacity;
} byte_buffer;

static int buffer_append(byte_buffer *b, const char *s, size_t n) {
    if (b->length + n > b->capacity) {
        size_t capacity = b->capacity ? b->capacity : 256;
        while (capacity < b->length + n) capacity *= 2;
        char *grown = realloc(b->data, capacity);
        if (!grown) return 0;
        b->data = grown;
        b->capacity = capacity;
    }
    memcpy(b->data + b->length, s, n);
    b->length += n;
    return 1;
}

/* One step of Normalizer::NormalizePrefix: `consumed` input bytes become text[0..length). */
typedef struct {
    const char *text;
    size_t length;
    size_t consumed;
} norm_prefix;

static norm_prefix normalize_prefix(const pi0_tokenizer *tok, const char *s, size_t n) {
    int found;
    size_t length = match_user_symbol(tok, s, n, &found);
    if (found) return (norm_prefix){s, length, length}; /* user-defined symbols stay as they are */
    if (tok->trie) {
        uint32_t value = 0;
        length = charsmap_match(tok, (const uint8_t *)s, n, &value);
        if (length > 0) {
            const char *replacement = tok->replacements + value; /* NUL-terminated: validated */
            return (norm_prefix){replacement, strlen(replacement), length};
        }
    }
    /* a malformed byte becomes U+FFFD, consuming that one byte */
    if (decode_utf8((const uint8_t *)s, n, &length) < 0) return (norm_prefix){REPLACEMENT_CHAR, 3, 1};
    return (norm_prefix){s, length, length};
}

static int append_space(const pi0_tokenizer *tok, byte_buffer *out) {
    return tok->escape_whitespaces ? buffer_append(out, SPACE_SYMBOL, 3) : buffer_append(out, " ", 1);
}

/* Appends a normalized prefix, replacing ' ' by U+2581 when escape_whitespaces is on. */
static int append_escaped(const pi0_tokenizer *tok, byte_buffer *out, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++) {
        int ok = s[i] == ' ' ? append_space(tok, out) : buffer_append(out, s + i, 1);
        if (!ok) return 0;
    }
    return 1;
}

/* Normalizer::Normalize, or its beginning: the main loop stops once `budget` bytes are out, and
 * *complete says whether it got to the end. Returns 0 when out of memory. The loop only appends and
 * every prefix is matched against the whole remaining input, so a stopped run's output is the
 * full run's before the end (trailing spaces, suffix dummy): see final_prefix. */
static int normalize(const pi0_tokenizer *tok, const char *s, size_t n, size_t budget,
                     byte_buffer *out, int *complete) {
    norm_prefix p;
    /* remove_extra_whitespaces drops leading prefixes that normalize to exactly " " */
    while (tok->remove_extra_whitespaces && n > 0) {
        p = normalize_prefix(tok, s, n);
        if (!(p.length == 1 && p.text[0] == ' ')) break;
        s += p.consumed;
        n -= p.consumed;
    }
    *complete = 1;
    if (n == 0) return 1;
    /* the dummy prefix goes in front, or at the end when whitespace is a suffix */
    if (!tok->treat_whitespace_as_suffix && tok->add_dummy_prefix && !append_space(tok, out)) return 0;

    int prev_is_space = tok->remove_extra_whitespaces;
    while (n > 0 && out->length < budget) {
        p = normalize_prefix(tok, s, n);
        /* after a space, remove_extra_whitespaces drops the spaces a prefix starts with */
        while (prev_is_space && p.length > 0 && p.text[0] == ' ') {
            p.text++;
            p.length--;
        }
        if (p.length > 0) {
            if (!append_escaped(tok, out, p.text, p.length)) return 0;
            prev_is_space = p.text[p.length - 1] == ' ';
        }
        s += p.consumed;
        n -= p.consumed;
        if (!tok->remove_extra_whitespaces) prev_is_space = 0;
    }
    *complete = n == 0;
    if (!*complete) return 1;

    if (tok->remove_extra_whitespaces) { /* trailing spaces, as they were appended */
        const char *space = tok->escape_whitespaces ? SPACE_SYMBOL : " ";
        size_t space_length = strlen(space);
        while (out->length >= space_length &&
               memcmp(out->data + out->length - space_length, space, space_length) == 0)
            out->length -= space_length;
    }
    return !(tok->treat_whitespace_as_suffix && tok->add_dummy_prefix && !append_space(tok, out));
}

/* ---------------------------------------------------------------------------------------------
 * BPE (bpe_model.cc)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
    int32_t prev, next;     /* -1 at the ends */
    uint32_t begin, length; /* into the normalized text; length 0 once merged into its left */
    int frozen;             /* a user-defined symbol: never merged */
} bpe_symbol;

typedef struct {
    uint32_t score_key; /* see score_key() */
    int32_t left, right;
    uint32_t length; /* of the merged piece: a stale pair no longer matches it */
} bpe_pair;

/* sentencepiece's SymbolPairComparator compares scores through their IEEE bit patterns: float
 * order for ordinary scores, but -0.0 ranks below +0.0 and NaNs have fixed places. This maps the
 * bits to an unsigned key with that same order. */
static uint32_t score_key(float score) {
    uint32_t bits;
    memcpy(&bits, &score, sizeof bits);
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

/* The agenda's order: higher score first, then the leftmost pair. */
static int pair_before(const bpe_pair *a, const bpe_pair *b) {
    return a->score_key > b->score_key || (a->score_key == b->score_key && a->left < b->left);
}

typedef struct {
    bpe_pair *items;
    size_t count;
} pair_heap;

static void heap_push(pair_heap *h, bpe_pair pair) {
    size_t i = h->count++;
    while (i > 0 && pair_before(&pair, &h->items[(i - 1) / 2])) {
        h->items[i] = h->items[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h->items[i] = pair;
}

static bpe_pair heap_pop(pair_heap *h) {
    bpe_pair top = h->items[0], last = h->items[--h->count];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= h->count) break;
        if (child + 1 < h->count && pair_before(&h->items[child + 1], &h->items[child])) child++;
        if (!pair_before(&h->items[child], &last)) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->count > 0) h->items[i] = last;
    return top;
}

/* rev_merge of bpe_model.cc: how a merged UNUSED piece was last formed (its left part's length).
 * Like sentencepiece's map, a later pair forming the same piece overwrites an earlier one. */
typedef struct {
    int32_t id;
    uint32_t left_length;
} unused_split;

/* Collects ids like the loop of EncodeOptimized. */
typedef struct {
    int32_t *ids;
    size_t capacity, count;
    int prev_unknown;
} id_sink;

typedef struct {
    const pi0_tokenizer *tok;
    const char *text;
    bpe_symbol *symbols;
    pair_heap agenda;
    unused_split *splits;
    size_t num_splits;
    id_sink *sink;
} bpe_state;

static void record_unused_split(bpe_state *b, int id, uint32_t left_length) {
    for (size_t i = 0; i < b->num_splits; i++) {
        if (b->splits[i].id == id) {
            b->splits[i].left_length = left_length;
            return;
        }
    }
    b->splits[b->num_splits++] = (unused_split){id, left_length};
}

/* MaybeAddNewSymbolPair: queues left+right if their concatenation is a mergeable piece. */
static void maybe_add_pair(bpe_state *b, int32_t left, int32_t right) {
    if (left < 0 || right < 0 || b->symbols[left].frozen || b->symbols[right].frozen) return;
    const bpe_symbol *l = &b->symbols[left], *r = &b->symbols[right];
    uint32_t length = l->length + r->length;
    int id = find_piece(b->tok, b->text + l->begin, length);
    if (id < 0 || is_reserved(b->tok, id)) return;
    const piece_entry *piece = &b->tok->pieces[id];
    heap_push(&b->agenda, (bpe_pair){score_key(piece->score), left, right, length});
    if (piece->type == PIECE_UNUSED) record_unused_split(b, id, l->length);
}

/* Splits the text into characters (user-defined symbols whole and frozen) and links them. */
static int32_t split_symbols(bpe_state *b, size_t n) {
    int32_t count = 0;
    for (size_t pos = 0; pos < n; count++) {
        int found;
        size_t length = match_user_symbol(b->tok, b->text + pos, n - pos, &found);
        b->symbols[count] = (bpe_symbol){count - 1, pos + length < n ? count + 1 : -1,
                                         (uint32_t)pos, (uint32_t)length, found};
        pos += length;
    }
    return count;
}

static void merge_pairs(bpe_state *b, int32_t num_symbols) {
    bpe_symbol *sym = b->symbols;
    for (int32_t i = 1; i < num_symbols; i++) maybe_add_pair(b, i - 1, i);
    while (b->agenda.count > 0) {
        bpe_pair top = heap_pop(&b->agenda);
        bpe_symbol *l = &sym[top.left], *r = &sym[top.right];
        /* stale: one side was merged away or grew since the pair was queued */
        if (l->length == 0 || r->length == 0 || l->length + r->length != top.length) continue;
        l->length += r->length;
        l->next = r->next;
        if (r->next >= 0) sym[r->next].prev = top.left;
        r->length = 0;
        maybe_add_pair(b, l->prev, top.left);
        maybe_add_pair(b, top.left, l->next);
    }
}

static void sink_put(id_sink *sink, int32_t id) {
    if (sink->count < sink->capacity) sink->ids[sink->count] = id;
    sink->count++;
}

/* One (piece, id) of the BPE result; id < 0 is the unknown id of a model without an unk piece. */
static void emit_piece(const pi0_tokenizer *tok, id_sink *sink, const char *s, size_t n, int id) {
    if (id >= 0 && tok->pieces[id].type == PIECE_CONTROL) {
        sink_put(sink, id);
        sink->prev_unknown = 0;
        return;
    }
    int unknown = id < 0 || tok->pieces[id].type == PIECE_UNKNOWN;
    if (unknown && tok->byte_fallback) {
        for (size_t i = 0; i < n; i++) sink_put(sink, tok->byte_ids[(uint8_t)s[i]]);
    } else if (!(unknown && sink->prev_unknown)) { /* a run of unknowns is one unk */
        sink_put(sink, id);
    }
    sink->prev_unknown = unknown;
}

/* `resegment` of bpe_model.cc: a symbol that is no piece (or a reserved one) is unknown; an
 * UNUSED piece is replaced by the two parts it was merged from, recursively. */
static void resegment(bpe_state *b, uint32_t begin, uint32_t length, int depth) {
    const pi0_tokenizer *tok = b->tok;
    const char *s = b->text + begin;
    int id = find_piece(tok, s, length);
    if (id < 0) id = tok->unk_id;
    if (depth > MAX_RESEGMENT_DEPTH) {
        emit_piece(tok, b->sink, s, length, id);
        return;
    }
    if (id < 0 || id == tok->unk_id || is_reserved(tok, id)) {
        emit_piece(tok, b->sink, s, length, tok->unk_id);
        return;
    }
    const unused_split *split = NULL;
    if (tok->pieces[id].type == PIECE_UNUSED) {
        for (size_t i = 0; i < b->num_splits && !split; i++)
            if (b->splits[i].id == id) split = &b->splits[i];
        if (!split) id = tok->unk_id; /* an UNUSED piece nothing was merged into */
    }
    if (!split) {
        emit_piece(tok, b->sink, s, length, id);
        return;
    }
    uint32_t left = split->left_length;
    resegment(b, begin, left, depth + 1);
    resegment(b, begin + left, length - left, depth + 1);
}

static pi0_status bpe_encode(const pi0_tokenizer *tok, const char *text, size_t n, id_sink *sink,
                             pi0_error *err) {
    if (n == 0) return PI0_OK;
    if (n > INT32_MAX / 4) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenizer: text too long");
    /* at most n - 1 initial pairs plus two per merge */
    size_t max_pairs = 3 * n;
    bpe_state b = {.tok = tok, .text = text, .sink = sink};
    b.symbols = malloc(n * sizeof *b.symbols);
    b.agenda.items = malloc(max_pairs * sizeof *b.agenda.items);
    b.splits = malloc(max_pairs * sizeof *b.splits);
    pi0_status st = PI0_OK;
    if (!b.symbols || !b.agenda.items || !b.splits) {
        st = out_of_memory(err);
    } else {
        merge_pairs(&b, split_symbols(&b, n));
        for (int32_t i = 0; i >= 0; i = b.symbols[i].next)
            resegment(&b, b.symbols[i].begin, b.symbols[i].length, 0);
    }
    free(b.symbols);
    free(b.agenda.items);
    free(b.splits);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * Encoding in chunks, and only as far as the ids that are kept
 *
 * A boundary p of the normalized text's split into symbols (split_symbols) is a barrier when no
 * symbol can ever span it: when the symbol before or after p is a user-defined symbol (frozen:
 * never merged), or when no piece BPE may form (NORMAL, USER_DEFINED or UNUSED: maybe_add_pair's
 * test) holds the two characters c1 c2 beside p side by side. A merged symbol is a run of whole
 * characters of the text spelling such a piece, and the piece's characters found with
 * one_char_len from its first byte are those characters, so a symbol spanning p would put c1 c2
 * side by side in that piece. The pairs are kept as a bit set of hashes (a collision only costs
 * a barrier). Then:
 *   - a chunk of text between two boundaries splits into the whole text's symbols there (a match
 *     that ended inside the chunk is found the same when the text ends with the chunk: shorter
 *     candidates come first);
 *   - no pair across a barrier is ever queued, so each side makes the merges it makes alone, in
 *     the same order (the agenda's pick, highest score then leftmost, is also the best of the
 *     side it falls on), and resegments and emits them the same, through one id sink (so a run
 *     of unknowns carries over). The exception is an UNUSED piece: resegment reads the split
 *     recorded last for it anywhere in the text, so a model with UNUSED pieces gets no filter
 *     and its texts are encoded whole.
 * So the normalized text is encoded in chunks cut at barriers (which keeps the BPE arrays small),
 * and when only the first `enough` ids matter, encoding stops at the first barrier past them. The
 * normalization then stops after a budget of bytes (see normalize): what it wrote is the whole
 * run's up to final_prefix(), and the split is the whole text's for the symbols starting at
 * least `lookahead` bytes before that, as split_symbols reads no further ahead. When no barrier
 * comes in time the budget grows fourfold and the work starts over, so the total stays within a
 * constant factor of the work up to the last id kept (or of encoding the whole text, at worst).
 * ------------------------------------------------------------------------------------------- */

/* The smallest chunk bpe_encode gets (it allocates per call). */
#define MIN_CHUNK_BYTES 64

/* The filter bit of the characters s[0..first) and s[first..first + second) side by side. */
static uint64_t pair_bit(const pi0_tokenizer *tok, const char *s, size_t first, size_t second) {
    return (hash_bytes(s, first + second) ^ first * 0x9E3779B97F4A7C15ull) & tok->pair_filter_mask;
}

static int pair_may_merge(const pi0_tokenizer *tok, const char *s, size_t first, size_t second) {
    uint64_t bit = pair_bit(tok, s, first, second);
    return (int)(tok->pair_filter[bit >> 6] >> (bit & 63) & 1);
}

static pi0_status build_pair_filter(pi0_tokenizer *tok, pi0_error *err) {
    tok->lookahead = 4; /* one_char_len's longest character */
    if (tok->num_user_lengths > 0 && tok->user_lengths[tok->num_user_lengths - 1] > 4)
        tok->lookahead = tok->user_lengths[tok->num_user_lengths - 1];
    size_t bytes = 0;
    for (int id = 0; id < tok->num_pieces; id++) {
        const piece_entry *p = &tok->pieces[id];
        if (p->type == PIECE_UNUSED && find_piece(tok, piece_text(tok, id), p->length) == id)
            return PI0_OK; /* no filter: texts are encoded whole */
        if (!is_reserved(tok, id)) bytes += p->length;
    }
    size_t bits = 64;
    while (bits < 8 * bytes) bits *= 2; /* at most one bit in 8 set */
    tok->pair_filter = calloc(bits / 64, sizeof *tok->pair_filter);
    if (!tok->pair_filter) return out_of_memory(err);
    tok->pair_filter_mask = bits - 1;
    for (int id = 0; id < tok->num_pieces; id++) {
        if (is_reserved(tok, id)) continue;
        const char *s = piece_text(tok, id);
        size_t n = tok->pieces[id].length, prev = 0, length;
        for (size_t pos = 0; pos < n; prev = pos, pos += length) {
            length = one_char_len((uint8_t)s[pos]); /* clipped like split_symbols at the text end */
            if (length > n - pos) length = n - pos;
            if (pos == 0) continue;
            uint64_t bit = pair_bit(tok, s + prev, pos - prev, length);
            tok->pair_filter[bit >> 6] |= 1ull << (bit & 63);
        }
    }
    return PI0_OK;
}

/* How much of a stopped normalization is final: with remove_extra_whitespaces, the full run drops
 * the spaces that end the text, a suffix made of the space symbol's bytes; it cannot reach past
 * the last byte that is none of them. */
static size_t final_prefix(const pi0_tokenizer *tok, const char *text, size_t length) {
    if (!tok->remove_extra_whitespaces) return length;
    const char *space = tok->escape_whitespaces ? SPACE_SYMBOL : " ";
    while (length > 0 && memchr(space, text[length - 1], strlen(space))) length--;
    return length;
}

/* Encodes the normalized text[0..length) into `sink` chunk by chunk, stopping at a barrier once
 * `enough` ids are out. `complete`: the text is all of it (else it is a stopped normalization's,
 * and what follows its last barrier in reach is left out). */
static pi0_status encode_chunks(const pi0_tokenizer *tok, const char *text, size_t length,
                                int complete, size_t enough, id_sink *sink, pi0_error *err) {
    if (length == 0) return PI0_OK; /* no ids; and `text` may be NULL, an empty buffer */
    size_t known = complete ? length : final_prefix(tok, text, length);
    size_t decided = complete ? length : known > tok->lookahead ? known - tok->lookahead : 0;
    size_t start = 0, prev = 0, pos = 0;
    int prev_frozen = 1;
    pi0_status st = PI0_OK;
    /* split_symbols' walk: each symbol starting before `decided` is the whole text's */
    while (tok->pair_filter && pos < decided && sink->count < enough && st == PI0_OK) {
        int frozen;
        size_t symbol = match_user_symbol(tok, text + pos, known - pos, &frozen);
        int barrier = prev_frozen || frozen || !pair_may_merge(tok, text + prev, pos - prev, symbol);
        if (barrier && pos - start >= MIN_CHUNK_BYTES) {
            st = bpe_encode(tok, text + start, pos - start, sink, err);
            start = pos;
        }
        prev = pos;
        prev_frozen = frozen;
        pos += symbol;
    }
    if (st == PI0_OK && complete && sink->count < enough)
        st = bpe_encode(tok, text + start, length - start, sink, err);
    return st;
}

/* pi0_tokenizer_encode, allowed to stop once `enough` ids are out (SIZE_MAX: never): then
 * *count is only known to be at least `enough`, and ids[0..min(enough, capacity)) are final. */
static pi0_status encode_ids(const pi0_tokenizer *tok, const char *text, size_t length,
                             int32_t *ids, size_t capacity, size_t enough, size_t *count,
                             pi0_error *err) {
    *count = 0;
    if (length > MAX_TEXT_BYTES)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT,
                        "tokenizer: text of %zu bytes exceeds the %zu-byte limit", length,
                        MAX_TEXT_BYTES);
    /* about 16 normalized bytes an id, plus the lookahead that makes them final */
    size_t budget = tok->pair_filter && enough < MAX_TEXT_BYTES ? 16 * enough + 256 + tok->lookahead
                                                                : SIZE_MAX;
    for (;;) {
        byte_buffer normalized = {0};
        id_sink sink = {.ids = ids, .capacity = capacity};
        int complete;
        pi0_status st = normalize(tok, text, length, budget, &normalized, &complete)
                            ? encode_chunks(tok, normalized.data, normalized.length, complete,
                                            enough, &sink, err)
                            : out_of_memory(err);
        free(normalized.data);
        if (st != PI0_OK) return st;
        if (complete || sink.count >= enough) {
            *count = sink.count;
            return PI0_OK;
        }
        budget = budget < SIZE_MAX / 4 ? 4 * budget : SIZE_MAX;
    }
}

pi0_status pi0_tokenizer_encode(const pi0_tokenizer *tok, const char *text, size_t length,
                                int32_t *ids, size_t capacity, size_t *count, pi0_error *err) {
    if (!tok || !count || (!text && length > 0) || (!ids && capacity > 0))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenizer: NULL argument");
    return encode_ids(tok, text, length, ids, capacity, SIZE_MAX, count, err);
}

/* ---------------------------------------------------------------------------------------------
 * Pi0 prompt formatting (openpi PaligemmaTokenizer.tokenize)
 * ------------------------------------------------------------------------------------------- */

/* Python's str.isspace(), which str.strip() uses. */
static int is_python_space(int32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
           cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
           cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

/* prompt.strip(): the span between the first and past the last non-space character. */
static void strip_span(const char *s, size_t n, size_t *begin, size_t *end) {
    *begin = n;
    *end = 0;
    for (size_t pos = 0, length; pos < n; pos += length) {
        int32_t cp = decode_utf8((const uint8_t *)s + pos, n - pos, &length);
        if (is_python_space(cp)) continue;
        if (*begin == n) *begin = pos;
        *end = pos + length;
    }
    if (*begin == n) *begin = *end = 0;
}

/* prompt.strip().replace("_", " ").replace("\n", " ") of prompt[0..n), written to dst (room for n
 * bytes); returns its length. */
static size_t clean_prompt(const char *prompt, size_t n, char *dst) {
    size_t begin, end;
    strip_span(prompt, n, &begin, &end);
    for (size_t i = begin; i < end; i++)
        dst[i - begin] = prompt[i] == '_' || prompt[i] == '\n' ? ' ' : prompt[i];
    return end - begin;
}

static pi0_status check_prompt_args(const pi0_tokenizer *tok, const char *prompt, int max_len,
                                    const int32_t *ids, const uint8_t *mask, pi0_error *err) {
    if (!tok || !prompt || !ids || !mask)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenize_prompt: NULL argument");
    if (max_len <= 0)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenize_prompt: max_len %d", max_len);
    if (tok->bos_id < 0)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenize_prompt: the model has no BOS piece");
    return PI0_OK;
}

/* Appends the ids of text[0..n) to ids[*used..room), dropping those past `room` (and encoding
 * not much further than `room`). */
static pi0_status append_encoded(const pi0_tokenizer *tok, const char *text, size_t n,
                                 int32_t *ids, size_t room, size_t *used, pi0_error *err) {
    size_t count, left = room - *used;
    pi0_status st = encode_ids(tok, text, n, ids + *used, left, left, &count, err);
    if (st == PI0_OK) *used += count < left ? count : left;
    return st;
}

/* openpi's padding: ids 0 and mask 0 after the `used` tokens (truncation happened already). */
static void pad_prompt(int32_t *ids, uint8_t *mask, size_t used, size_t room, int *num_valid) {
    for (size_t i = 0; i < room; i++) {
        if (i >= used) ids[i] = 0;
        mask[i] = i < used;
    }
    if (num_valid) *num_valid = (int)used;
}

pi0_status pi0_tokenize_prompt(const pi0_tokenizer *tok, const char *prompt, int max_len,
                               int32_t *ids, uint8_t *mask, int *num_valid, pi0_error *err) {
    pi0_status st = check_prompt_args(tok, prompt, max_len, ids, mask, err);
    if (st != PI0_OK) return st;
    size_t n = strlen(prompt);
    char *clean = malloc(n + 1);
    if (!clean) return out_of_memory(err);
    size_t room = (size_t)max_len, used = 1;
    ids[0] = tok->bos_id;
    st = append_encoded(tok, clean, clean_prompt(prompt, n, clean), ids, room, &used, err);
    free(clean);
    /* openpi encodes "\n" apart, as the start-of-answer token */
    if (st == PI0_OK && used < room) st = append_encoded(tok, "\n", 1, ids, room, &used, err);
    if (st == PI0_OK) pad_prompt(ids, mask, used, room, num_valid);
    return st;
}

/* ---------------------------------------------------------------------------------------------
 * Pi0.5 prompt formatting: the discretized state in the text
 * ------------------------------------------------------------------------------------------- */

int pi0_state_bin(double x) {
    if (isnan(x)) return 255; /* searchsorted puts NaN after every edge */
    /* The edges -1 + k/128 are exact doubles (numpy's linspace computes k * 2^-7 - 1 exactly), and
     * x * 128 is exact too (a power of two; an overflow to inf still compares right), so
     * edge_k <= x  <=>  k - 128 <= x * 128  <=>  k <= floor(x * 128) + 128. The bin is the largest
     * such k, clamped to -1 (below every edge) and 255 (the last edge). */
    double k = floor(x * 128.0) + 128.0;
    return k < -1.0 ? -1 : k > 255.0 ? 255 : (int)k;
}

static const char TASK_PREFIX[] = "Task: ", STATE_PREFIX[] = ", State: ";
static const char ACTION_SUFFIX[] = ";\nAction: ";

/* Writes " ".join(map(str, bins)) at dst (room for 4 bytes a value); returns its length. */
static size_t format_bins(const double *state, int state_dim, char *dst) {
    size_t length = 0;
    for (int i = 0; i < state_dim; i++)
        length += (size_t)sprintf(dst + length, i ? " %d" : "%d", pi0_state_bin(state[i]));
    return length;
}

pi0_status pi0_tokenize_prompt_with_state(const pi0_tokenizer *tok, const char *prompt,
                                          const double *state, int state_dim, int max_len,
                                          int32_t *ids, uint8_t *mask, int *num_valid,
                                          pi0_error *err) {
    pi0_status st = check_prompt_args(tok, prompt, max_len, ids, mask, err);
    if (st != PI0_OK) return st;
    if (state_dim < 0 || (!state && state_dim > 0))
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenize_prompt: state_dim %d, state %s",
                        state_dim, state ? "given" : "NULL");
    size_t n = strlen(prompt);
    /* each bin is at most "255" or "-1" plus a separating space; sprintf adds a NUL */
    size_t capacity = sizeof TASK_PREFIX + n + sizeof STATE_PREFIX + 4 * (size_t)state_dim +
                      sizeof ACTION_SUFFIX;
    char *text = malloc(capacity);
    if (!text) return out_of_memory(err);
    size_t length = sizeof TASK_PREFIX - 1;
    memcpy(text, TASK_PREFIX, length);
    length += clean_prompt(prompt, n, text + length);
    memcpy(text + length, STATE_PREFIX, sizeof STATE_PREFIX - 1);
    length += sizeof STATE_PREFIX - 1;
    length += format_bins(state, state_dim, text + length);
    memcpy(text + length, ACTION_SUFFIX, sizeof ACTION_SUFFIX - 1);
    length += sizeof ACTION_SUFFIX - 1;

    size_t room = (size_t)max_len, used = 1;
    ids[0] = tok->bos_id;
    st = append_encoded(tok, text, length, ids, room, &used, err);
    free(text);
    if (st == PI0_OK) pad_prompt(ids, mask, used, room, num_valid);
    return st;
}
