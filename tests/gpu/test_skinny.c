/*
 * test_skinny.c - the skinny Linears (src/cuda/skinny.cu) against a double-precision loop over the
 * same bf16 operands, on fresh random inputs: every epilogue, with and without the fused RMSNorm,
 * Pi0's expert shapes and awkward ones (row counts around the 16-row tile, column counts that are
 * not multiples of the block's tile, k not a multiple of the 32-wide chunk), the fused RoPE and K/V
 * cache writes against the CPU's RoPE, Pi0.5's adaptive-norm inputs (x scaled by 1 + in_scale, a column
 * bias) and gated residual, plus repeatability, untouched memory past the outputs, and the arguments it
 * must refuse. The step boundary's fused Euler update (pi0_cuda_skinny_euler) against the same loop and, at the
 * expert's width, against the two kernels it replaces, bit for bit.
 */
#include "cpu/ops.h"
#include "cuda/kernels.h"
#include "cuda/skinny.h"
#include "gpu_check.h"

#define GUARD 64 /* elements past each output that must stay poisoned */

typedef struct {
    int m, n, k, epilogue, rms_norm;
    int adaptive; /* Pi0.5: in_scale and col_bias (STORE, GELU_MUL), or a gate (RESIDUAL) */
} skinny_case;

/* The adaptive inputs of a case: bf16(1 + scale) per k (what the kernel takes), a bias and a gate per column
 * (NULL when not used). */
typedef struct {
    uint16_t *scale;
    float *bias, *gate;
} adaptive_inputs;

static adaptive_inputs adaptive_draw(int adaptive, int epilogue, int n, int k) {
    adaptive_inputs a = {0};
    if (!adaptive) return a;
    if (epilogue == SKINNY_RESIDUAL) {
        fill_uniform(a.gate = malloc((size_t)n * 4), n, 1.5f);
        return a;
    }
    float *scale = malloc((size_t)k * 4);
    fill_uniform(scale, k, 0.8f);
    a.scale = malloc((size_t)k * 2);
    for (int t = 0; t < k; t++) a.scale[t] = bf16_bits(1.0f + scale[t]);
    free(scale);
    fill_uniform(a.bias = malloc((size_t)n * 4), n, 1.0f);
    return a;
}

static void adaptive_free(adaptive_inputs *a) {
    free(a->scale), free(a->bias), free(a->gate);
}

/* x[i, t] (1 + scale[t]) for the oracle, in double. */
static double scaled_x(const float *x, const adaptive_inputs *a, int k, int i, int t) {
    return (double)x[(size_t)i * k + t] * (a->scale ? bf16_value(a->scale[t]) : 1.0);
}

static int poisoned_bf16(const uint16_t *h, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (h[i] != 0xffff) return 0;
    return 1;
}

/* One case with skinny_args.max_warps (0: the kernel's choice). */
static void run_case_warps(skinny_case c, int max_warps) {
    const int m = c.m, n = c.n, k = c.k, out_cols = c.epilogue == SKINNY_GELU_MUL ? n / 2 : n;
    const size_t out_n = (size_t)m * out_cols;
    float *x = malloc((size_t)m * k * 4), *w = malloc((size_t)n * k * 4), *res = malloc((size_t)m * n * 4);
    fill_uniform(x, (size_t)m * k, c.rms_norm ? 6.0f : 1.0f); /* the norm must matter */
    fill_uniform(w, (size_t)n * k, 1.0f / sqrtf((float)k));
    fill_uniform(res, (size_t)m * n, 2.0f);
    uint16_t *xb = to_bf16_rounding(x, (size_t)m * k), *wb = to_bf16_rounding(w, (size_t)n * k);
    adaptive_inputs ad = adaptive_draw(c.adaptive, c.epilogue, n, k);

    /* oracle: row scale from the bf16 x (before any adaptive scale), products in double */
    float *ref = malloc(out_n * 4 + 4);
    for (int i = 0; i < m; i++) {
        double scale = 1, ss = 0;
        for (int t = 0; t < k; t++) ss += (double)x[(size_t)i * k + t] * x[(size_t)i * k + t];
        if (c.rms_norm) scale = 1 / sqrt(ss / k + 1e-6);
        for (int j = 0; j < n; j++) {
            double acc = 0;
            for (int t = 0; t < k; t++) acc += scaled_x(x, &ad, k, i, t) * w[(size_t)j * k + t];
            acc = acc * scale + (ad.bias ? ad.bias[j] : 0.0);
            if (c.epilogue == SKINNY_STORE) ref[(size_t)i * n + j] = (float)acc;
            else if (c.epilogue == SKINNY_RESIDUAL)
                ref[(size_t)i * n + j] = res[(size_t)i * n + j] + (float)((ad.gate ? ad.gate[j] : 1.0) * acc);
            else if (j % 2 == 0) ref[(size_t)i * out_cols + j / 2] = cpu_gelu_tanh((float)acc);
            else ref[(size_t)i * out_cols + j / 2] *= (float)acc;
        }
    }

    pi0_bf16 *dx = dev_upload(xb, (size_t)m * k * 2), *dw = dev_upload(wb, (size_t)n * k * 2);
    pi0_bf16 *dout = dev_poisoned((out_n + GUARD) * 2), *dres_bf16 = dev_poisoned(((size_t)m * n + GUARD) * 2);
    float *dres = dev_upload(NULL, ((size_t)m * n + GUARD) * 4);
    float *dout_f32 = c.epilogue == SKINNY_STORE ? dev_poisoned(out_n * 4) : NULL; /* STORE's float32 copy */
    pi0_bf16 *dscale = ad.scale ? dev_upload(ad.scale, (size_t)k * 2) : NULL;
    float *dbias = ad.bias ? dev_upload(ad.bias, (size_t)n * 4) : NULL, *dgate = ad.gate ? dev_upload(ad.gate, (size_t)n * 4) : NULL;
    REQUIRE(dx && dw && dout && dres_bf16 && dres, "device allocation");
    skinny_args a = {.m = m, .n = n, .k = k, .x = dx, .w = dw, .rms_norm = c.rms_norm, .eps = 1e-6f, .in_scale = dscale,
                     .col_bias = dbias, .epilogue = c.epilogue, .out = dout, .out_f32 = dout_f32, .residual = dres,
                     .residual_bf16 = dres_bf16, .gate = dgate, .max_warps = max_warps};
    float *got[2] = {NULL, NULL};
    uint16_t *bits[2] = {NULL, NULL};
    for (int run = 0; run < 2; run++) { /* twice from the same inputs: bitwise repeatable */
        CUDA_OK(cudaMemcpy(dres, res, (size_t)m * n * 4, cudaMemcpyHostToDevice));
        CUDA_OK(pi0_cuda_skinny_linear(&a, 0));
        CUDA_OK(cudaDeviceSynchronize());
        if (c.epilogue == SKINNY_RESIDUAL) {
            got[run] = download_f32(dres, (size_t)m * n);
            bits[run] = malloc(((size_t)m * n + GUARD) * 2);
            CUDA_OK(cudaMemcpy(bits[run], dres_bf16, ((size_t)m * n + GUARD) * 2, cudaMemcpyDeviceToHost));
        } else {
            got[run] = download_bf16(dout, out_n);
            bits[run] = malloc((out_n + GUARD) * 2);
            CUDA_OK(cudaMemcpy(bits[run], dout, (out_n + GUARD) * 2, cudaMemcpyDeviceToHost));
        }
    }
    const size_t got_n = c.epilogue == SKINNY_RESIDUAL ? (size_t)m * n : out_n;
    double e = rel_error(got[0], ref, got_n), tol = c.epilogue == SKINNY_RESIDUAL ? 1e-5 : 1e-2;
    CHECK(e <= tol, "m %d n %d k %d epilogue %d norm %d adaptive %d max_warps %d: error %.3g", m, n, k, c.epilogue,
          c.rms_norm, c.adaptive, max_warps, e);
    CHECK(!memcmp(got[0], got[1], got_n * 4) && !memcmp(bits[0], bits[1], got_n * 2),
          "m %d n %d k %d epilogue %d: two runs differ", m, n, k, c.epilogue);
    CHECK(poisoned_bf16(bits[0] + got_n, GUARD), "m %d n %d k %d epilogue %d: wrote past the output", m, n, k, c.epilogue);
    if (c.epilogue == SKINNY_RESIDUAL) { /* the bf16 copy is the float32 result, rounded */
        int bad = 0;
        for (size_t i = 0; i < got_n; i++) bad += bits[0][i] != bf16_bits(got[0][i]);
        CHECK(bad == 0, "m %d n %d k %d: %d bf16 copies differ from the float32 rows", m, n, k, bad);
    } else {
        uint16_t *res_bits = malloc(GUARD * 2);
        CUDA_OK(cudaMemcpy(res_bits, dres_bf16, GUARD * 2, cudaMemcpyDeviceToHost));
        CHECK(poisoned_bf16(res_bits, GUARD), "epilogue %d wrote the residual's bf16 copy", c.epilogue);
        free(res_bits);
    }
    if (dout_f32) { /* the float32 rows, of which out is the rounding */
        float *f32 = download_f32(dout_f32, out_n);
        int bad = 0;
        for (size_t i = 0; i < out_n; i++) bad += bits[0][i] != bf16_bits(f32[i]);
        CHECK(bad == 0 && rel_error(f32, ref, out_n) <= tol, "m %d n %d k %d: float32 copy: %d not rounding to out, error %.3g",
              m, n, k, bad, rel_error(f32, ref, out_n));
        free(f32);
    }
    for (int run = 0; run < 2; run++) free(got[run]), free(bits[run]);
    free(x), free(w), free(res), free(xb), free(wb), free(ref);
    adaptive_free(&ad);
    cudaFree(dx), cudaFree(dw), cudaFree(dout), cudaFree(dres_bf16), cudaFree(dres);
    cudaFree(dscale), cudaFree(dbias), cudaFree(dgate), cudaFree(dout_f32);
}

static void run_case(skinny_case c) { run_case_warps(c, 0); }

TEST(pi0_expert_shapes) {
    /* one denoise layer at batch 1, horizon 10: 11 rows */
    run_case((skinny_case){11, 2560, 1024, SKINNY_STORE, 1, 0});    /* QKV, input norm folded */
    run_case((skinny_case){11, 1024, 2048, SKINNY_RESIDUAL, 0, 0}); /* o_proj + residual */
    run_case((skinny_case){11, 8192, 1024, SKINNY_GELU_MUL, 1, 0}); /* gate|up, post-attention norm, gelu x up */
    run_case((skinny_case){11, 1024, 4096, SKINNY_RESIDUAL, 0, 0}); /* down + residual */
    run_case_warps((skinny_case){11, 1024, 2048, SKINNY_RESIDUAL, 0, 0}, SKINNY_NARROW_WARPS); /* as Pi0 runs them */
    run_case_warps((skinny_case){11, 1024, 4096, SKINNY_RESIDUAL, 0, 0}, SKINNY_NARROW_WARPS);
    /* a residual through gate|up's block shape (a grid of 512+ blocks: 4 warps of two passes), one and two row tiles */
    run_case((skinny_case){11, 8200, 1024, SKINNY_RESIDUAL, 0, 1});
    run_case((skinny_case){17, 8200, 1024, SKINNY_RESIDUAL, 0, 0});
    /* horizon 50 (openpi's default): 51 rows, four row tiles a block */
    run_case((skinny_case){51, 2560, 1024, SKINNY_STORE, 1, 0});
    run_case((skinny_case){51, 1024, 2048, SKINNY_RESIDUAL, 0, 0});
    run_case((skinny_case){51, 8192, 1024, SKINNY_GELU_MUL, 1, 0});
    run_case((skinny_case){51, 1024, 4096, SKINNY_RESIDUAL, 0, 0});
}

TEST(pi05_expert_shapes) {
    /* batch 1, horizon 10: 10 rows, the adaptive norms' scale and shift, the gated residuals */
    run_case((skinny_case){10, 2560, 1024, SKINNY_STORE, 1, 1});
    run_case((skinny_case){10, 1024, 2048, SKINNY_RESIDUAL, 0, 1});
    run_case_warps((skinny_case){10, 1024, 2048, SKINNY_RESIDUAL, 0, 1}, SKINNY_NARROW_WARPS); /* o_proj as Pi0.5 runs it */
    run_case((skinny_case){10, 8192, 1024, SKINNY_GELU_MUL, 1, 1});
    run_case((skinny_case){10, 1024, 4096, SKINNY_RESIDUAL, 0, 1});
    run_case((skinny_case){50, 1024, 4096, SKINNY_RESIDUAL, 0, 1}); /* horizon 50 */
    run_case((skinny_case){50, 8192, 1024, SKINNY_GELU_MUL, 1, 1});
    const int rows[] = {1, 15, 17, 50};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        run_case((skinny_case){rows[i], 1000, 40, SKINNY_STORE, 1, 1});      /* k tail, n past the tile */
        run_case((skinny_case){rows[i], 4106, 1032, SKINNY_GELU_MUL, 1, 1}); /* 8 chunks a pass, k tail */
        run_case((skinny_case){rows[i], 7, 264, SKINNY_RESIDUAL, 0, 1});     /* n < 8, gated */
    }
}

TEST(awkward_shapes) {
    /* one to four row tiles a block (16, 32, 64 rows), partial tiles, and past 64 rows a second block row */
    const int rows[] = {1, 8, 9, 16, 17, 33, 40, 64, 65, 100};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        run_case((skinny_case){rows[i], 24, 8, SKINNY_STORE, 0, 0});          /* k below one chunk */
        run_case((skinny_case){rows[i], 1000, 40, SKINNY_STORE, 1, 0});       /* k tail, n past the tile */
        run_case((skinny_case){rows[i], 7, 264, SKINNY_RESIDUAL, 0, 0});      /* n < 8 */
        run_case((skinny_case){rows[i], 8200, 1024, SKINNY_GELU_MUL, 1, 0});  /* 4-warp blocks, the last block partial */
        run_case((skinny_case){rows[i], 4106, 1032, SKINNY_GELU_MUL, 0, 0});  /* 8 chunks a pass, k tail */
        run_case_warps((skinny_case){rows[i], 1000, 4104, SKINNY_RESIDUAL, 0, 1}, 8); /* 8 warps: 3 passes, k tail */
        run_case((skinny_case){rows[i], 1030, 4104, SKINNY_RESIDUAL, 1, 0});  /* C 8, a second pass */
        run_case((skinny_case){rows[i], 2056, 2056, SKINNY_STORE, 0, 0});     /* 16 warps, k tail */
    }
}

/* SKINNY_ROPE_QKV: q to out, k and v to cache rows 2i + 1 of a (2m + 2)-row cache (the rows between
 * must stay untouched, as must out's k and v columns), against the product in double followed by the
 * CPU backend's RoPE at random positions. */
static void rope_case(int m, int heads, int kv_heads, int hd, int k, int rms_norm, int adaptive) {
    const int n = (heads + 2 * kv_heads) * hd, q_dim = heads * hd, kv_dim = kv_heads * hd, max_pos = 1000;
    const int cache_n = 2 * m + 2;
    float *x = malloc((size_t)m * k * 4), *w = malloc((size_t)n * k * 4), *ref = malloc((size_t)m * n * 4);
    fill_uniform(x, (size_t)m * k, rms_norm ? 6.0f : 1.0f);
    fill_uniform(w, (size_t)n * k, 1.0f / sqrtf((float)k));
    uint16_t *xb = to_bf16_rounding(x, (size_t)m * k), *wb = to_bf16_rounding(w, (size_t)n * k);
    int *pos = malloc(sizeof(int) * m), *rows = malloc(sizeof(int) * m);
    for (int i = 0; i < m; i++) pos[i] = (int)((gpu_uniform() + 1) * 0.5f * (max_pos - 1)), rows[i] = 2 * i + 1;
    adaptive_inputs ad = adaptive_draw(adaptive, SKINNY_ROPE_QKV, n, k);
    for (int i = 0; i < m; i++) {
        double ss = 0, scale = 1;
        for (int t = 0; t < k; t++) ss += (double)x[(size_t)i * k + t] * x[(size_t)i * k + t];
        if (rms_norm) scale = 1 / sqrt(ss / k + 1e-6);
        for (int j = 0; j < n; j++) {
            double acc = 0;
            for (int t = 0; t < k; t++) acc += scaled_x(x, &ad, k, i, t) * w[(size_t)j * k + t];
            ref[(size_t)i * n + j] = (float)(acc * scale + (ad.bias ? ad.bias[j] : 0.0));
        }
    }
    rope_table table = {0};
    REQUIRE(rope_table_init(&table, max_pos, hd) == 0, "rope table");
    cpu_rope(ref, m, n, heads, hd, pos, &table);
    cpu_rope(ref + q_dim, m, n, kv_heads, hd, pos, &table);

    pi0_bf16 *dx = dev_upload(xb, (size_t)m * k * 2), *dw = dev_upload(wb, (size_t)n * k * 2);
    pi0_bf16 *dout = dev_poisoned(((size_t)m * n + GUARD) * 2);
    pi0_bf16 *dk = dev_poisoned((size_t)cache_n * kv_dim * 2), *dv = dev_poisoned((size_t)cache_n * kv_dim * 2);
    int *dpos = dev_upload(pos, sizeof(int) * m), *drows = dev_upload(rows, sizeof(int) * m);
    float *dcos = dev_upload(table.cos, sizeof(float) * max_pos * (hd / 2));
    float *dsin = dev_upload(table.sin, sizeof(float) * max_pos * (hd / 2));
    pi0_bf16 *dscale = ad.scale ? dev_upload(ad.scale, (size_t)k * 2) : NULL;
    float *dbias = ad.bias ? dev_upload(ad.bias, (size_t)n * 4) : NULL;
    REQUIRE(dx && dw && dout && dk && dv && dpos && drows && dcos && dsin, "device allocation");
    skinny_args a = {.m = m, .n = n, .k = k, .x = dx, .w = dw, .rms_norm = rms_norm, .eps = 1e-6f, .in_scale = dscale,
                     .col_bias = dbias, .epilogue = SKINNY_ROPE_QKV, .out = dout, .heads = heads, .kv_heads = kv_heads, .head_dim = hd,
                     .positions = dpos, .cache_rows = drows, .rope_cos = dcos, .rope_sin = dsin, .cache_k = dk,
                     .cache_v = dv};
    CHECK(pi0_cuda_skinny_supported(&a), "rope case refused");
    uint16_t *bits[2][3] = {{NULL}};
    const size_t sizes[3] = {(size_t)m * n + GUARD, (size_t)cache_n * kv_dim, (size_t)cache_n * kv_dim};
    for (int run = 0; run < 2; run++) {
        CUDA_OK(pi0_cuda_skinny_linear(&a, 0));
        CUDA_OK(cudaDeviceSynchronize());
        const void *src[3] = {dout, dk, dv};
        for (int b = 0; b < 3; b++) {
            bits[run][b] = malloc(sizes[b] * 2);
            CUDA_OK(cudaMemcpy(bits[run][b], src[b], sizes[b] * 2, cudaMemcpyDeviceToHost));
        }
    }
    /* gather what was written next to the oracle's rows */
    float *got = malloc((size_t)m * n * 4);
    int untouched = 1;
    for (int i = 0; i < m; i++) {
        for (int j = 0; j < q_dim; j++) got[(size_t)i * n + j] = bf16_value(bits[0][0][(size_t)i * n + j]);
        for (int j = 0; j < kv_dim; j++) {
            got[(size_t)i * n + q_dim + j] = bf16_value(bits[0][1][(size_t)rows[i] * kv_dim + j]);
            got[(size_t)i * n + q_dim + kv_dim + j] = bf16_value(bits[0][2][(size_t)rows[i] * kv_dim + j]);
        }
        untouched &= poisoned_bf16(bits[0][0] + (size_t)i * n + q_dim, 2 * kv_dim);
        untouched &= poisoned_bf16(bits[0][1] + (size_t)2 * i * kv_dim, kv_dim) && poisoned_bf16(bits[0][2] + (size_t)2 * i * kv_dim, kv_dim);
    }
    double e = rel_error(got, ref, (size_t)m * n);
    CHECK(e <= 1e-2, "rope m %d heads %d/%d hd %d k %d norm %d: error %.3g", m, heads, kv_heads, hd, k, rms_norm, e);
    CHECK(untouched && poisoned_bf16(bits[0][0] + (size_t)m * n, GUARD),
          "rope m %d hd %d k %d: wrote outside q and the rows' cache rows", m, hd, k);
    for (int b = 0; b < 3; b++)
        CHECK(!memcmp(bits[0][b], bits[1][b], sizes[b] * 2), "rope m %d hd %d k %d: two runs differ", m, hd, k);
    for (int run = 0; run < 2; run++)
        for (int b = 0; b < 3; b++) free(bits[run][b]);
    rope_table_free(&table);
    adaptive_free(&ad);
    cudaFree(dscale), cudaFree(dbias);
    free(x), free(w), free(ref), free(xb), free(wb), free(pos), free(rows), free(got);
    cudaFree(dx), cudaFree(dw), cudaFree(dout), cudaFree(dk), cudaFree(dv), cudaFree(dpos), cudaFree(drows);
    cudaFree(dcos), cudaFree(dsin);
}

TEST(rope_qkv) {
    rope_case(11, 8, 1, 256, 1024, 1, 0); /* Pi0's expert QKV at batch 1 */
    rope_case(10, 8, 1, 256, 1024, 1, 1); /* Pi0.5's, with the adaptive norm's scale and shift */
    rope_case(51, 8, 1, 256, 1024, 1, 0); /* horizon 50 */
    const int rows[] = {1, 9, 17, 40, 51, 100};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        rope_case(rows[i], 3, 1, 32, 40, 0, 0);   /* k below two chunks, with a tail */
        rope_case(rows[i], 2, 2, 16, 264, 1, 1);  /* several kv heads, the smallest head, adaptive */
        rope_case(rows[i], 4, 1, 48, 2056, 1, 0); /* 3 blocks a head, 16 warps, k tail */
    }
}

TEST(refuses_what_it_cannot_run) {
    pi0_bf16 *buf = dev_upload(NULL, 1 << 20);
    float *res = dev_upload(NULL, 1 << 20);
    REQUIRE(buf && res, "device allocation");
    skinny_args ok = {.m = 4, .n = 16, .k = 64, .x = buf, .w = buf + 4096, .epilogue = SKINNY_STORE, .out = buf + 8192,
                      .residual = res, .residual_bf16 = buf + 16384};
    CHECK(pi0_cuda_skinny_supported(&ok), "a valid call was refused");
    skinny_args bad = ok;
    bad.k = 60;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "k not a multiple of 8 accepted");
    bad = ok, bad.x = buf + 1;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "misaligned x accepted");
    bad = ok, bad.in_scale = buf + 1;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "misaligned in_scale accepted");
    bad = ok, bad.epilogue = SKINNY_GELU_MUL, bad.n = 15;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "odd n with gelu x up accepted");
    bad = ok, bad.epilogue = SKINNY_RESIDUAL, bad.residual_bf16 = NULL;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "residual without its bf16 copy accepted");
    bad = ok, bad.epilogue = SKINNY_ROPE_QKV, bad.heads = 1, bad.kv_heads = 1, bad.head_dim = 16;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "rope without its tables and caches accepted");
    bad = ok, bad.epilogue = 7;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "unknown epilogue accepted");
    bad = ok, bad.m = 0;
    CHECK(pi0_cuda_skinny_linear(&bad, 0) == cudaErrorInvalidValue, "zero rows accepted");
    CHECK(pi0_cuda_skinny_linear(NULL, 0) == cudaErrorInvalidValue, "NULL arguments accepted");
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(buf), cudaFree(res);
}

/* pi0_cuda_skinny_euler: rows x action_dim of x_t updated from rows x width of x (adaptive: Pi0.5's in_scale and
 * per-column bias; else Pi0's folded norm with a plain bias), then the next Linear of next_n columns (0: none, the
 * update alone, in place) with swish and bf16 out (Pi0) or float32 and bf16 out (Pi0.5). Against a double loop over
 * the same bf16 operands; at width 1024 (where the skinny kernel runs the update with the fused kernel's 8 warps of 4
 * chunks) also against pi0_cuda_skinny_linear then pi0_cuda_linear_small_k, to the bit. */
static void euler_case(int rows, int width, int A, int adaptive, int next_n) {
    const int swish = next_n && !adaptive, in_place = next_n == 0;
    float *x = malloc((size_t)rows * width * 4), *w = malloc((size_t)A * width * 4), *xt = malloc((size_t)rows * A * 4);
    float *bias = malloc((size_t)A * 4), *gate = malloc((size_t)A * 4), *scale = malloc((size_t)width * 4);
    float *nw = malloc((size_t)(next_n + 1) * A * 4), *nbias = malloc((size_t)(next_n + 1) * 4);
    fill_uniform(x, (size_t)rows * width, 6.0f);
    fill_uniform(w, (size_t)A * width, 1.0f / sqrtf((float)width));
    fill_uniform(xt, (size_t)rows * A, 2.0f);
    fill_uniform(bias, A, 1.0f);
    for (int j = 0; j < A; j++) gate[j] = -0.1f; /* dt: 10 steps */
    fill_uniform(scale, width, 0.8f);
    fill_uniform(nw, (size_t)next_n * A, 1.0f / sqrtf((float)A));
    fill_uniform(nbias, next_n, 1.0f);
    uint16_t *xb = to_bf16_rounding(x, (size_t)rows * width), *wb = to_bf16_rounding(w, (size_t)A * width);
    uint16_t *nwb = to_bf16_rounding(nw, (size_t)next_n * A), *sb = malloc((size_t)width * 2);
    for (int t = 0; t < width; t++) sb[t] = bf16_bits(1.0f + scale[t]);

    /* oracle: the norm's statistics from the bf16 x, x scaled (and rounded, as the kernel does) by 1 + scale */
    float *ref_xt = malloc((size_t)rows * A * 4), *ref_next = malloc((size_t)(rows * next_n + 1) * 4);
    for (int i = 0; i < rows; i++) {
        double ss = 0;
        for (int t = 0; t < width; t++) ss += (double)x[(size_t)i * width + t] * x[(size_t)i * width + t];
        double r = 1 / sqrt(ss / width + 1e-6);
        for (int j = 0; j < A; j++) {
            double acc = 0;
            for (int t = 0; t < width; t++) {
                float xv = x[(size_t)i * width + t];
                if (adaptive) xv = bf16_value(bf16_bits(xv * bf16_value(sb[t])));
                acc += (double)xv * w[(size_t)j * width + t];
            }
            ref_xt[(size_t)i * A + j] = (float)(xt[(size_t)i * A + j] + gate[j] * (acc * r + bias[j]));
        }
        for (int c = 0; c < next_n; c++) {
            double v = nbias[c];
            for (int j = 0; j < A; j++) v += (double)ref_xt[(size_t)i * A + j] * nw[(size_t)c * A + j];
            if (swish) v = v / (1 + exp(-v));
            ref_next[(size_t)i * next_n + c] = (float)v;
        }
    }

    pi0_bf16 *dx = dev_upload(xb, (size_t)rows * width * 2), *dw = dev_upload(wb, (size_t)A * width * 2);
    pi0_bf16 *dscale = adaptive ? dev_upload(sb, (size_t)width * 2) : NULL;
    pi0_bf16 *dnw = next_n ? dev_upload(nwb, (size_t)next_n * A * 2) : NULL;
    float *dbias = dev_upload(bias, (size_t)A * 4), *dgate = dev_upload(gate, (size_t)A * 4);
    float *dnbias = next_n ? dev_upload(nbias, (size_t)next_n * 4) : NULL;
    float *dxt = dev_upload(NULL, ((size_t)rows * A + GUARD) * 4), *dxt_next = dev_poisoned(((size_t)rows * A + GUARD) * 4);
    const size_t out_n = (size_t)rows * next_n;
    float *dnext_f32 = next_n && adaptive ? dev_poisoned((out_n + GUARD) * 4) : NULL;
    pi0_bf16 *dnext_bf16 = next_n ? dev_poisoned((out_n + GUARD) * 2) : NULL;
    REQUIRE(dx && dw && dbias && dgate && dxt && dxt_next, "device allocation");
    skinny_euler_args a = {.rows = rows, .width = width, .action_dim = A, .x = dx, .out_w = dw, .in_scale = dscale,
                           .out_bias = dbias, .gate = dgate, .eps = 1e-6f, .x_t = dxt,
                           .x_t_next = in_place ? dxt : dxt_next, .next_w = dnw, .next_bias = dnbias, .next_n = next_n,
                           .swish = swish, .next_f32 = dnext_f32, .next_bf16 = dnext_bf16};
    CHECK(pi0_cuda_skinny_euler_supported(&a), "euler rows %d width %d A %d next %d refused", rows, width, A, next_n);
    float *got_xt[2] = {NULL, NULL}, *got_f32[2] = {NULL, NULL};
    uint16_t *got_bf16[2] = {NULL, NULL};
    for (int run = 0; run < 2; run++) { /* twice from the same inputs: bitwise repeatable */
        CUDA_OK(cudaMemcpy(dxt, xt, (size_t)rows * A * 4, cudaMemcpyHostToDevice));
        CUDA_OK(pi0_cuda_skinny_euler(&a, 0));
        CUDA_OK(cudaDeviceSynchronize());
        got_xt[run] = download_f32(a.x_t_next, (size_t)rows * A + GUARD);
        if (dnext_f32) got_f32[run] = download_f32(dnext_f32, out_n + GUARD);
        if (dnext_bf16) {
            got_bf16[run] = malloc((out_n + GUARD) * 2);
            CUDA_OK(cudaMemcpy(got_bf16[run], dnext_bf16, (out_n + GUARD) * 2, cudaMemcpyDeviceToHost));
        }
    }
    double e = rel_error(got_xt[0], ref_xt, (size_t)rows * A);
    CHECK(e <= 1e-5, "euler rows %d width %d A %d adaptive %d: x_t error %.3g", rows, width, A, adaptive, e);
    CHECK(!memcmp(got_xt[0], got_xt[1], (size_t)rows * A * 4), "euler rows %d width %d: two runs differ", rows, width);
    if (!in_place) {
        int poisoned = 1;
        for (int i = 0; i < GUARD; i++) poisoned &= ((uint32_t *)got_xt[0])[(size_t)rows * A + i] == 0xffffffffu;
        CHECK(poisoned, "euler rows %d width %d A %d: wrote past x_t_next", rows, width, A);
    }
    if (next_n) {
        float *as_f32 = malloc(out_n * 4 + 4);
        for (size_t i = 0; i < out_n; i++) as_f32[i] = bf16_value(got_bf16[0][i]);
        e = rel_error(as_f32, ref_next, out_n);
        CHECK(e <= 1e-2, "euler rows %d width %d next %d swish %d: next (bf16) error %.3g", rows, width, next_n, swish, e);
        CHECK(!memcmp(got_bf16[0], got_bf16[1], out_n * 2) && poisoned_bf16(got_bf16[0] + out_n, GUARD),
              "euler rows %d next %d: the bf16 rows differ run to run or were written past", rows, next_n);
        if (got_f32[0]) {
            int rounds = 1, poisoned = 1;
            for (size_t i = 0; i < out_n; i++) rounds &= got_bf16[0][i] == bf16_bits(got_f32[0][i]);
            for (int i = 0; i < GUARD; i++) poisoned &= ((uint32_t *)got_f32[0])[out_n + i] == 0xffffffffu;
            e = rel_error(got_f32[0], ref_next, out_n);
            CHECK(e <= 1e-5 && rounds && poisoned, "euler rows %d next %d: float32 rows error %.3g, rounding %d, guard %d",
                  rows, next_n, e, rounds, poisoned);
        }
        free(as_f32);
    }

    if (width == 1024) { /* the kernels it replaces: the skinny update, then linear_small_k */
        pi0_bf16 *dres_bf16 = dev_upload(NULL, (size_t)rows * A * 2);
        float *dsep_f32 = dnext_f32 ? dev_poisoned((out_n + GUARD) * 4) : NULL;
        pi0_bf16 *dsep_bf16 = next_n ? dev_poisoned((out_n + GUARD) * 2) : NULL;
        CUDA_OK(cudaMemcpy(dxt, xt, (size_t)rows * A * 4, cudaMemcpyHostToDevice));
        skinny_args u = {.m = rows, .n = A, .k = width, .x = dx, .w = dw, .rms_norm = 1, .eps = 1e-6f, .in_scale = dscale,
                         .col_bias = dbias, .epilogue = SKINNY_RESIDUAL, .residual = dxt, .residual_bf16 = dres_bf16,
                         .gate = dgate};
        CUDA_OK(pi0_cuda_skinny_linear(&u, 0));
        if (next_n)
            CUDA_OK(pi0_cuda_linear_small_k(dnext_f32 ? dsep_f32 : NULL, dsep_bf16, dxt, dnw, dnbias, rows, A, next_n, swish, 0));
        CUDA_OK(cudaDeviceSynchronize());
        float *sep_xt = download_f32(dxt, (size_t)rows * A);
        CHECK(!memcmp(sep_xt, got_xt[0], (size_t)rows * A * 4), "euler rows %d A %d adaptive %d: x_t differs from the "
              "skinny update's", rows, A, adaptive);
        if (next_n) {
            uint16_t *sep_bits = malloc(out_n * 2);
            CUDA_OK(cudaMemcpy(sep_bits, dsep_bf16, out_n * 2, cudaMemcpyDeviceToHost));
            CHECK(!memcmp(sep_bits, got_bf16[0], out_n * 2), "euler rows %d next %d: differs from linear_small_k's", rows,
                  next_n);
            free(sep_bits);
        }
        if (dsep_f32) {
            float *sep = download_f32(dsep_f32, out_n);
            CHECK(!memcmp(sep, got_f32[0], out_n * 4), "euler rows %d next %d: float32 rows differ from linear_small_k's",
                  rows, next_n);
            free(sep);
        }
        free(sep_xt);
        cudaFree(dres_bf16), cudaFree(dsep_f32), cudaFree(dsep_bf16);
    }
    for (int run = 0; run < 2; run++) free(got_xt[run]), free(got_f32[run]), free(got_bf16[run]);
    free(x), free(w), free(xt), free(bias), free(gate), free(scale), free(nw), free(nbias), free(xb), free(wb), free(nwb);
    free(sb), free(ref_xt), free(ref_next);
    cudaFree(dx), cudaFree(dw), cudaFree(dscale), cudaFree(dnw), cudaFree(dbias), cudaFree(dgate), cudaFree(dnbias);
    cudaFree(dxt), cudaFree(dxt_next), cudaFree(dnext_f32), cudaFree(dnext_bf16);
}

TEST(euler_step) {
    euler_case(10, 1024, 32, 0, 1024); /* Pi0 at horizon 10: the time MLP's hidden rows, swish */
    euler_case(10, 1024, 32, 1, 1024); /* Pi0.5: action_in_proj into the suffix */
    euler_case(10, 1024, 32, 0, 0);    /* the last step: the update alone, in place */
    euler_case(10, 1024, 32, 1, 0);
    const int rows[] = {1, 7, 16};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        euler_case(rows[i], 1024, 32, i % 2, 100);   /* a last block of the next Linear part full */
        euler_case(rows[i], 1024, 24, 1 - i % 2, 1); /* fewer action columns than the block's four n8 tiles */
        euler_case(rows[i], 200, 8, 0, 65);          /* k below a pass, with a tail */
        euler_case(rows[i], 1032, 16, 1, 64);        /* a second pass over k */
        euler_case(rows[i], 64, 7, 1, 0);            /* an odd action_dim, the update alone */
    }
}

TEST(euler_refuses_what_it_cannot_run) {
    pi0_bf16 *buf = dev_upload(NULL, 1 << 20);
    float *f = dev_upload(NULL, 1 << 20);
    REQUIRE(buf && f, "device allocation");
    skinny_euler_args ok = {.rows = 10, .width = 1024, .action_dim = 32, .x = buf, .out_w = buf + 65536, .out_bias = f,
                            .gate = f + 64, .x_t = f + 1024, .x_t_next = f + 2048, .next_w = buf + 131072,
                            .next_n = 1024, .next_bf16 = buf + 196608};
    CHECK(pi0_cuda_skinny_euler_supported(&ok), "a valid call was refused");
    skinny_euler_args bad = ok;
    bad.rows = 17;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "17 rows accepted");
    bad = ok, bad.action_dim = 33;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "33 action columns accepted");
    bad = ok, bad.action_dim = 12;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "a next Linear with k not a multiple of 8 accepted");
    bad = ok, bad.x_t = bad.x_t_next;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "x_t in place with a next Linear accepted");
    bad = ok, bad.width = 1020;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "width not a multiple of 8 accepted");
    bad = ok, bad.x = buf + 1;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "misaligned x accepted");
    bad = ok, bad.next_bf16 = NULL;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "a next Linear with no output accepted");
    bad = ok, bad.gate = NULL;
    CHECK(pi0_cuda_skinny_euler(&bad, 0) == cudaErrorInvalidValue, "no gate accepted");
    CHECK(pi0_cuda_skinny_euler(NULL, 0) == cudaErrorInvalidValue, "NULL arguments accepted");
    bad = ok, bad.next_w = NULL, bad.x_t = bad.x_t_next;
    CHECK(pi0_cuda_skinny_euler_supported(&bad), "the update alone in place was refused");
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(buf), cudaFree(f);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    gpu_seed();
    RUN(pi0_expert_shapes);
    RUN(pi05_expert_shapes);
    RUN(awkward_shapes);
    RUN(rope_qkv);
    RUN(refuses_what_it_cannot_run);
    RUN(euler_step);
    RUN(euler_refuses_what_it_cannot_run);
    return check_finish();
}
