#include "cpu/ops.h"

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void cpu_linear(float *out, const float *in, int rows, int in_dim, const float *w, const float *b, int out_dim) {
    if (rows == 0) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out_dim, in_dim, 1.0f, in, in_dim, w, in_dim, 0.0f,
                out, out_dim);
    if (b) {
#pragma omp parallel for schedule(static) if (rows > 8)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < out_dim; j++) out[(size_t)r * out_dim + j] += b[j];
    }
}

void cpu_linear_add(float *x, const float *in, int rows, int in_dim, const float *w, const float *b, int out_dim) {
    if (rows == 0) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out_dim, in_dim, 1.0f, in, in_dim, w, in_dim, 1.0f,
                x, out_dim);
    if (b) {
#pragma omp parallel for schedule(static) if (rows > 8)
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < out_dim; j++) x[(size_t)r * out_dim + j] += b[j];
    }
}

void cpu_layernorm(float *out, const float *in, int rows, int dim, const float *w, const float *b, float eps) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float *x = in + (size_t)r * dim;
        float *y = out + (size_t)r * dim;
        float mean = 0, var = 0;
        for (int j = 0; j < dim; j++) mean += x[j];
        mean /= (float)dim;
        for (int j = 0; j < dim; j++) var += (x[j] - mean) * (x[j] - mean);
        var /= (float)dim;
        float inv = 1.0f / sqrtf(var + eps);
        for (int j = 0; j < dim; j++) y[j] = (x[j] - mean) * inv * w[j] + b[j];
    }
}

void cpu_rmsnorm(float *out, const float *in, int rows, int dim, const float *w, float eps) {
    cpu_rmsnorm_mod(out, in, rows, dim, w, NULL, eps);
}

void cpu_rmsnorm_mod(float *out, const float *in, int rows, int dim, const float *scale, const float *shift, float eps) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float *x = in + (size_t)r * dim;
        float *y = out + (size_t)r * dim;
        float sum_sq = 0;
        for (int j = 0; j < dim; j++) sum_sq += x[j] * x[j];
        float inv = 1.0f / sqrtf(sum_sq / (float)dim + eps);
        for (int j = 0; j < dim; j++) y[j] = x[j] * inv * (1.0f + scale[j]);
        if (shift)
            for (int j = 0; j < dim; j++) y[j] += shift[j];
    }
}

void cpu_add_gated(float *x, const float *y, int rows, int dim, const float *gate) {
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < dim; j++) x[(size_t)r * dim + j] += gate[j] * y[(size_t)r * dim + j];
}

float cpu_gelu_tanh(float x) {
    const float sqrt_2_over_pi = 0.7978845608028654f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * (x + 0.044715f * x * x * x)));
}

void cpu_gelu_inplace(float *x, size_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) x[i] = cpu_gelu_tanh(x[i]);
}

void cpu_gelu_mul(float *gate, const float *up, size_t n) {
#pragma omp parallel for schedule(static) if (n > 65536)
    for (size_t i = 0; i < n; i++) gate[i] = cpu_gelu_tanh(gate[i]) * up[i];
}

void cpu_swish_inplace(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = x[i] / (1.0f + expf(-x[i]));
}

void cpu_rope(float *x, int rows, int ld, int heads, int head_dim, const int *positions, const rope_table *t) {
    int half = head_dim / 2;
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float *c = t->cos + (size_t)positions[r] * half, *s = t->sin + (size_t)positions[r] * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + (size_t)r * ld + (size_t)h * head_dim, *x2 = x1 + half;
            for (int i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* Softmax over the first `n` entries of `row`; entries past n become 0 (masked keys). */
static void softmax_prefix(float *row, int n, int total) {
    float max = -INFINITY, sum = 0;
    for (int j = 0; j < n; j++) max = row[j] > max ? row[j] : max;
    for (int j = 0; j < n; j++) sum += row[j] = expf(row[j] - max);
    for (int j = 0; j < n; j++) row[j] /= sum;
    for (int j = n; j < total; j++) row[j] = 0;
}

static void attend_one_head(float *out, int ldo, const float *q, int ldq, const float *k, const float *v, int ldkv,
                            const attn_segment *s, int head_dim, float scale, float *scores) {
    /* scores (num_q, num_k) = scale * Q K^T; then softmax per query; out = scores V */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, s->num_q, s->num_k, head_dim, scale, q, ldq, k, ldkv, 0.0f,
                scores, s->num_k);
    for (int i = 0; i < s->num_q; i++) {
        int visible = (i == 0 && s->state_keys > 0) ? s->state_keys : s->num_k;
        softmax_prefix(scores + (size_t)i * s->num_k, visible, s->num_k);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, s->num_q, head_dim, s->num_k, 1.0f, scores, s->num_k, v,
                ldkv, 0.0f, out, ldo);
}

int cpu_attention(float *out, int ldo, const float *q, int ldq, const float *k, const float *v, int ldkv,
                  const attn_segment *segments, int num_segments, int num_heads, int num_kv_heads, int head_dim,
                  float scale) {
    int group = num_heads / num_kv_heads, tasks = num_segments * num_heads, failed = 0;
#pragma omp parallel for schedule(dynamic, 1)
    for (int task = 0; task < tasks; task++) {
        const attn_segment *s = &segments[task / num_heads];
        int h = task % num_heads, kv = h / group;
        if (s->num_q == 0 || s->num_k == 0) continue;
        float *scores = malloc((size_t)s->num_q * s->num_k * sizeof(float));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
            continue;
        }
        attend_one_head(out + (size_t)s->q_row * ldo + (size_t)h * head_dim, ldo,
                        q + (size_t)s->q_row * ldq + (size_t)h * head_dim, ldq,
                        k + (size_t)s->k_row * ldkv + (size_t)kv * head_dim,
                        v + (size_t)s->k_row * ldkv + (size_t)kv * head_dim, ldkv, s, head_dim, scale, scores);
        free(scores);
    }
    return failed ? -1 : 0;
}
