/*
 * limits.h - what the CUDA backend's kernels can run, checked on a model's dims before its weights are
 * read: a model outside these limits is refused (the cuda backend) or left to the CPU (auto), instead of
 * failing in the middle of its first call. Needs no GPU.
 */
#ifndef PI0_CUDA_LIMITS_H
#define PI0_CUDA_LIMITS_H

#include "pi0.h"

/* PI0_OK, or PI0_ERR_BACKEND with a message naming the first dimension the kernels cannot take and their
 * limit. `dims` must have passed dims_validate (positive, heads a multiple of kv heads, llm and expert
 * sharing their head layout). */
pi0_status pi0_cuda_check_dims(const pi0_dims *dims, pi0_error *err);

#endif
