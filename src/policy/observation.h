/*
 * observation.h - what the library's own observation producers share (pi0_policy.h has the type and
 * its public functions): the field data allocation and the append that takes ownership.
 */
#ifndef PI0_POLICY_OBSERVATION_H
#define PI0_POLICY_OBSERVATION_H

#include "pi0_policy.h"

/* Field data alignment: a cache line, and enough for any vector load. */
#define OBSERVATION_ALIGN 64

/* A block of OBSERVATION_ALIGN-aligned memory of at least `bytes` (and never of size 0, so that empty
 * arrays have data too), or NULL. */
void *observation_alloc_data(size_t bytes);

/* numpy's dtype.kind of a dtype: 'b', 'u', 'i' or 'f' ('?' for an invalid one). */
char observation_dtype_kind(pi0_dtype dtype);

/* The element count of a shape, in *numel; 0 when a dimension is negative or the product of the non-zero
 * dimensions overflows int64 (so callers may multiply any subset of the dimensions safely). */
int observation_shape_numel(int ndim, const int64_t *shape, uint64_t *numel);

/* Appends `field` (its key, data and string already allocated) and takes ownership of them, also when it
 * fails for lack of memory (it frees them then). Does not check the key for duplicates. */
pi0_status observation_append(pi0_observation *obs, pi0_field field, pi0_error *err);

#endif
