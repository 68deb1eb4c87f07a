/*
 * tokenizer.h - SentencePiece BPE tokenizer (PaliGemma's `paligemma_tokenizer.model`).
 *
 * Reads a sentencepiece `.model` file (a serialized ModelProto) and encodes text exactly like the
 * sentencepiece library's `encode(text)` for BPE models: the model's normalizer (user-defined
 * symbols kept whole, optional precompiled charsmap, add_dummy_prefix, remove_extra_whitespaces,
 * escape_whitespaces with U+2581), score-ordered pair merges, unknown pieces split into <0xXX>
 * byte pieces when byte_fallback is on. Other model types (unigram, word, char) are rejected.
 *
 * A loaded tokenizer is immutable: encode may be called from several threads at once.
 */
#ifndef PI0_POLICY_TOKENIZER_H
#define PI0_POLICY_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "pi0.h"

typedef struct pi0_tokenizer pi0_tokenizer;

/* Loads a `.model` file. A corrupt, truncated or non-BPE model gives PI0_ERR_FORMAT. */
pi0_status pi0_tokenizer_load(const char *path, pi0_tokenizer **out, pi0_error *err);
/* The same from the file's bytes in memory; `data` is not kept. */
pi0_status pi0_tokenizer_load_buffer(const void *data, size_t size, pi0_tokenizer **out,
                                     pi0_error *err);
void pi0_tokenizer_free(pi0_tokenizer *tok);

/* Number of pieces (ids are 0 .. vocab_size - 1). */
int pi0_tokenizer_vocab_size(const pi0_tokenizer *tok);
/* Id of the model's BOS piece (trainer_spec.bos_piece, "<s>" by default), or -1 when the model has
 * none (sentencepiece's bos_id()). */
int pi0_tokenizer_bos_id(const pi0_tokenizer *tok);

/* Encodes `length` bytes of UTF-8 like sentencepiece's encode(text), without BOS/EOS. Writes up to
 * `capacity` ids and sets *count to the total number of ids, which may exceed `capacity`: then call
 * again with more room. Malformed UTF-8 is handled like sentencepiece's normalizer: each byte that
 * does not start a valid character becomes U+FFFD (then, with byte_fallback, <0xEF><0xBF><0xBD>).
 * Texts longer than 16 MiB are refused (PI0_ERR_INVALID_ARGUMENT). */
pi0_status pi0_tokenizer_encode(const pi0_tokenizer *tok, const char *text, size_t length,
                                int32_t *ids, size_t capacity, size_t *count, pi0_error *err);

/* The piece string of an id (NUL-terminated, for debugging and tests), or NULL if out of range. */
const char *pi0_tokenizer_piece(const pi0_tokenizer *tok, int id);

/* Pi0's prompt formatting (openpi PaligemmaTokenizer, docs/policy.md#pi0-prompt-format):
 *   clean  = prompt.strip().replace("_", " ").replace("\n", " ")
 *   tokens = [BOS] + encode(clean) + encode("\n")
 * then padded with id 0 / mask 0 up to `max_len`, or truncated to `max_len`. `ids` and `mask` hold
 * `max_len` entries; *num_valid (may be NULL) gets the number of mask-1 entries. strip() removes
 * exactly the characters Python's str.isspace() accepts (ASCII whitespace, U+001C..U+001F, U+0085,
 * U+00A0, U+1680, U+2000..U+200A, U+2028, U+2029, U+202F, U+205F, U+3000) from both ends of
 * `prompt` (a NUL-terminated UTF-8 string); malformed bytes are never stripped. Only what the
 * `max_len` tokens need is encoded (besides one pass over the prompt to clean it): a long prompt
 * costs about what its first tokens cost, and gives exactly the ids of encoding it all (see
 * tokenizer.c for why). The 16 MiB limit of pi0_tokenizer_encode still applies to the text. */
pi0_status pi0_tokenize_prompt(const pi0_tokenizer *tok, const char *prompt, int max_len,
                               int32_t *ids, uint8_t *mask, int *num_valid, pi0_error *err);

/* Pi0.5's prompt format with the state written into it (openpi PaligemmaTokenizer.tokenize(prompt,
 * state), docs/policy.md#discrete-state; used when the model config's discrete_state_input is on):
 *   text   = "Task: " + clean + ", State: " + " ".join(str(b) for b in bins) + ";\nAction: "
 *   tokens = [BOS] + encode(text)
 * with `clean` as in pi0_tokenize_prompt and bins[i] = pi0_state_bin(state[i]); then padded or
 * truncated to `max_len` exactly as pi0_tokenize_prompt does (openpi also logs a warning when it
 * truncates; this function does not). `state` holds `state_dim` values (state_dim >= 0; NULL is
 * allowed when it is 0, giving "State: ;"): the robot's state after openpi's Normalize and before
 * PadStatesAndActions. They are doubles because that is what openpi discretizes: Normalize meets
 * the float64 norm stats, so the state is float64 whatever the robot sent. Pass the normalized
 * values before any rounding to float: a float32 rounding can move a value across a bin edge. */
pi0_status pi0_tokenize_prompt_with_state(const pi0_tokenizer *tok, const char *prompt,
                                          const double *state, int state_dim, int max_len,
                                          int32_t *ids, uint8_t *mask, int *num_valid,
                                          pi0_error *err);

/* openpi's bin of one normalized state value: np.digitize(x, np.linspace(-1, 1, 257)[:-1]) - 1,
 * the index k of the last edge -1 + k/128 (k = 0..255) that is <= x, or -1 below them all: so -1
 * for x < -1 (and -inf), 255 for x >= 1 - 1/128 (and +inf), 128 for -0.0. NaN gives 255, as
 * numpy's searchsorted orders NaN after every edge. A float32 value passed as double bins exactly
 * as numpy bins the float32 array (it compares in float64 against the float64 edges). */
int pi0_state_bin(double x);

#endif
