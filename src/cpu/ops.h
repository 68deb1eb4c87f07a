/*
 * ops.h - float32 building blocks of the CPU reference backend (docs/model.md#building-blocks).
 *
 * Matrices are row-major; a Linear weight is PyTorch's (out, in), so y = x W^T + b. GEMMs go to
 * BLAS; everything else is a plain loop written to be read against the spec.
 */
#ifndef PI0_CPU_OPS_H
#define PI0_CPU_OPS_H

#include <stddef.h>

#include "model/plan.h"
#include "model/rope.h"

/* out (rows, out_dim) = in (rows, in_dim) W^T + b; b may be NULL. */
void cpu_linear(float *out, const float *in, int rows, int in_dim, const float *w, const float *b, int out_dim);
/* x (rows, out_dim) += in W^T + b: a residual branch added in place. */
void cpu_linear_add(float *x, const float *in, int rows, int in_dim, const float *w, const float *b, int out_dim);

/* (x - mean) / sqrt(var + eps) * w + b per row. */
void cpu_layernorm(float *out, const float *in, int rows, int dim, const float *w, const float *b, float eps);
/* x / sqrt(mean(x^2) + eps) * (1 + w) per row: Gemma's RMSNorm. */
void cpu_rmsnorm(float *out, const float *in, int rows, int dim, const float *w, float eps);
/* x / sqrt(mean(x^2) + eps) * (1 + scale) + shift per row: Pi0.5's adaptive RMSNorm
 * (docs/model.md#adaptive-rmsnorm); shift may be NULL (then it is Gemma's RMSNorm). */
void cpu_rmsnorm_mod(float *out, const float *in, int rows, int dim, const float *scale, const float *shift, float eps);
/* x (rows, dim) += gate * y, gate per column: Pi0.5's gated residual. */
void cpu_add_gated(float *x, const float *y, int rows, int dim, const float *gate);

float cpu_gelu_tanh(float x);
void cpu_gelu_inplace(float *x, size_t n);
/* gate = gelu(gate) * up: Gemma's MLP nonlinearity. */
void cpu_gelu_mul(float *gate, const float *up, size_t n);
/* x = x * sigmoid(x). */
void cpu_swish_inplace(float *x, size_t n);

/* Rotate-half RoPE on `heads` heads of every row; row r has position positions[r]. */
void cpu_rope(float *x, int rows, int ld, int heads, int head_dim, const int *positions, const rope_table *t);

/* Multi-head attention with num_heads query heads sharing num_kv_heads K/V heads (MQA/GQA), logits
 * scaled by `scale`, softmax in float32. Segments are independent; they run in parallel.
 * Returns 0, or -1 when scratch memory ran out. */
int cpu_attention(float *out, int ldo, const float *q, int ldq, const float *k, const float *v, int ldkv,
                  const attn_segment *segments, int num_segments, int num_heads, int num_kv_heads, int head_dim,
                  float scale);

#endif
