/*
 * gate_up.h - the prefix's gate|up Linear with gelu x up in its epilogue, one kernel on Hopper (sm_90a):
 *
 *   out (rows, mlp) bf16 = gelu_tanh(x w_gate^T) * (x w_up^T),  x (rows, k) bf16, w (2 mlp, k) bf16 with its rows
 *   interleaved (gate_j, up_j) (weights.c),
 *
 * what gemm (gemm.h) into a (rows, 2 mlp) buffer followed by pi0_cuda_gelu_mul computes, gate and up rounded to
 * bf16 before the product as there, without the buffer (gate_up.cu says why and how).
 */
#ifndef PI0_CUDA_GATE_UP_H
#define PI0_CUDA_GATE_UP_H

#include <cuda_runtime_api.h>

#include "cuda/bf16.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Whether the kernel runs these dims on the current device: an sm_90a device (H100, H200) whose driver has tensor
 * maps, mlp a multiple of 256 and k of 8. */
int pi0_cuda_gate_up_gelu_fits(int rows, int mlp, int k);

/*
 * Whether the kernel beats cuBLASLt's gate|up and pi0_cuda_gelu_mul at these dims, as measured on an H100
 * (bench/NOTES.md, sessions 29-30): a prefix of at least 256 rows, whose k (the LLM's 2048) is long enough to hide the
 * epilogue's stall of the products (the expert's 1024 is not), and whose tokens the kernel's tiles (2 x 136, or 144)
 * cover with at most 1/8 padding: the seed's 532 rows pad to 544, Pi0.5's 572 (a 60-token prompt) to 576, B = 64's
 * 34048 to 34128, where 300 rows, padded to 408, lost to cuBLASLt. Dims only: it says nothing of the device
 * (pi0_cuda_gate_up_gelu_fits).
 */
int pi0_cuda_gate_up_gelu_pays(int rows, int k);

/* cudaErrorInvalidValue where it does not fit, or for pointers a tensor map refuses (x and w 16-byte aligned). */
cudaError_t pi0_cuda_gate_up_gelu(pi0_bf16 *out, const pi0_bf16 *x, const pi0_bf16 *w, int rows, int mlp, int k,
                                  cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
