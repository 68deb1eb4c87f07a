/*
 * limits.c - the dims the CUDA backend refuses (limits.h), each with the kernel's limit that rules it out.
 * Everything else (odd widths, MLP sizes, head counts) runs: the skinny Linears fall back to cuBLASLt
 * where their alignment needs are not met (forward.c), the attention pads its head dims (attention.cu).
 */
#include "cuda/limits.h"

#include "cuda/attention.h"
#include "cuda/kernels.h"
#include "util/error.h"

#define REFUSE(...) pi0_fail(err, PI0_ERR_BACKEND, "the cuda backend cannot run this model: " __VA_ARGS__)

static pi0_status check_head_dim(int head_dim, const char *stack, pi0_error *err) {
    if (head_dim % 8 == 0 && head_dim <= PI0_CUDA_ATTN_MAX_HEAD_DIM) return PI0_OK;
    return REFUSE("the %s's head_dim is %d, the GPU attention takes multiples of 8 up to %d (the cpu backend takes any)",
                  stack, head_dim, PI0_CUDA_ATTN_MAX_HEAD_DIM);
}

pi0_status pi0_cuda_check_dims(const pi0_dims *d, pi0_error *err) {
    pi0_status st;
    /* the expert's head layout is the LLM's (joint attention) */
    if ((st = check_head_dim(d->vision.head_dim, "vision encoder", err)) || (st = check_head_dim(d->llm.head_dim, "LLM", err)))
        return st;
    if (d->llm.num_kv_heads > 65535) /* a grid dimension of the attention */
        return REFUSE("the LLM has %d kv heads, the GPU attention takes up to 65535", d->llm.num_kv_heads);
    /* Pi0.5's time conditioning: Linears of the expert's width through pi0_cuda_linear_small_k */
    if (d->kind == PI0_MODEL_PI05 && d->expert.width > PI0_CUDA_SMALL_K_MAX)
        return REFUSE("the action expert's width is %d, Pi0.5's time conditioning on the GPU takes up to %d",
                      d->expert.width, PI0_CUDA_SMALL_K_MAX);
    return PI0_OK;
}
