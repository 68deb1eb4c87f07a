/*
 * msgpack_numpy.h - openpi's wire encoding: msgpack whose numpy arrays travel as maps
 *   {b"__ndarray__": True, b"data": <bin raw bytes>, b"dtype": "<f4", b"shape": [d0, d1, ...]}
 * and numpy scalars as {b"__npgeneric__": True, b"data": <number>, b"dtype": "<f8"}
 * (openpi_client/msgpack_numpy.py). Requests are one map (the observation); replies and the
 * metadata frame are maps packed with pi0_packer.
 *
 * Decoding treats every byte as hostile: sizes are checked against the bytes present before anything
 * is allocated from them, nesting is bounded, and every failure names the key and the problem.
 */
#ifndef PI0_SERVER_MSGPACK_NUMPY_H
#define PI0_SERVER_MSGPACK_NUMPY_H

#include <stddef.h>
#include <stdint.h>

#include "pi0_policy.h"

/*
 * What a frame decodes to: the policy's observation (pi0_policy.h), nested keys joined with "/".
 *
 * ARRAY: numpy arrays, in their own dtype; numpy scalars, plain msgpack numbers and bools (ndim 0: F64,
 *        I64/U64 or BOOL: a numpy scalar by its kind, float/signed/unsigned/bool, its value checked against
 *        its dtype; a plain int is I64 unless only U64 holds it); lists of numbers, plain or numpy scalars
 *        (ndim 1, F64). `data` is an owned copy, 64-byte aligned and never NULL, in host byte order
 *        (big-endian dtypes are swapped) holding product(shape) elements; BOOL bytes are exactly 0 or 1;
 *        F16 holds IEEE half bits.
 * STRING: msgpack str (or bin holding valid UTF-8 without NUL), NUL-terminated.
 * nil values are skipped; other values (ext, lists of non-numbers) are an error naming the key.
 *
 * Refused, with the key named: non-string, empty or non-UTF-8 keys; a key twice in one map or twice
 * after flattening; unknown fields in a numpy map; a shape whose product overflows or differs from the
 * data size; dtypes other than b1, u1..u8, i1..i8, f2, f4, f8 (any byte order: <, >, | or =).
 * Limits, far above real observations: 16 levels of nesting, 2^20 msgpack values (list elements, keys,
 * ...) per frame, 4096 fields, 1024 bytes per joined key path.
 */
/* Decodes one msgpack map. On failure *out is empty and err (PI0_ERR_FORMAT or
 * PI0_ERR_OUT_OF_MEMORY; PI0_ERR_INVALID_ARGUMENT for NULL pointers) says what was wrong and where. */
pi0_status pi0_observation_decode(const void *data, size_t size, pi0_observation *out, pi0_error *err);

/*
 * A growable msgpack writer for replies and metadata. Calls after an allocation failure do nothing and
 * leave `failed` set; check it once at the end. Keys are packed as str.
 */
typedef struct {
    uint8_t *data;
    size_t size, capacity;
    int failed;
} pi0_packer;

void pi0_pack_map(pi0_packer *p, uint32_t num_pairs);
void pi0_pack_array(pi0_packer *p, uint32_t num_items);
void pi0_pack_str(pi0_packer *p, const char *s);
void pi0_pack_int(pi0_packer *p, int64_t v);
void pi0_pack_double(pi0_packer *p, double v);
void pi0_pack_bool(pi0_packer *p, int v);
void pi0_pack_nil(pi0_packer *p);
/* A numpy array map as openpi's pack_array writes it (bin keys, str dtype, shape as an array). */
void pi0_pack_ndarray(pi0_packer *p, pi0_dtype dtype, int ndim, const int64_t *shape, const void *data);
/* The start of a reply as openpi's server sends it: a map of 2 + extra_pairs entries, the first two
 * `actions` (float64, (horizon, action_dims)) and `policy_timing` {infer_ms}; the caller packs the
 * extra pairs (the server's `server_timing`). */
void pi0_pack_policy_reply(pi0_packer *p, const pi0_policy_result *result, double infer_ms, uint32_t extra_pairs);
void pi0_packer_free(pi0_packer *p);

#endif /* PI0_SERVER_MSGPACK_NUMPY_H */
