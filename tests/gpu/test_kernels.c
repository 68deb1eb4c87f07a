/*
 * test_kernels.c - every CUDA kernel of src/cuda/kernels.cu and the cuBLASLt GEMM wrapper against
 * the float32 CPU oracle (src/cpu/ops.c or a plain loop), on fresh random inputs at awkward sizes.
 * Inputs are rounded to bf16 where the GPU reads bf16, so both sides see the same numbers; the
 * remaining difference is the GPU's bf16 output rounding (~4e-3 relative).
 */
#include "cpu/ops.h"
#include "cuda/gate_up.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "gpu_check.h"
#include "model/image.h"
#include "util/half.h"

#define TOL_BF16_OUT 1e-2

TEST(layernorm_matches_cpu) {
    /* a warp a row: rows of up to 1152 floats in fours from registers, others from memory; odd row counts leave a
     * block's second warp without a row */
    const int shapes[][2] = {{1, 64}, {7, 1152}, {513, 1000}, {5, 2048}, {3, 33}, {2, 1156}, {4, 1030}, {9, 4}};
    for (size_t c = 0; c < sizeof shapes / sizeof shapes[0]; c++) {
        int rows = shapes[c][0], dim = shapes[c][1];
        size_t n = (size_t)rows * dim;
        float *x = malloc(n * 4), *w = malloc(dim * 4), *b = malloc(dim * 4), *ref = malloc(n * 4);
        fill_uniform(x, n, 3.0f), fill_uniform(w, dim, 1.0f), fill_uniform(b, dim, 0.5f);
        for (size_t i = 0; i < n; i++) x[i] += 0.7f; /* a non-zero mean */
        cpu_layernorm(ref, x, rows, dim, w, b, 1e-6f);
        float *dx = dev_upload(x, n * 4), *dw = dev_upload(w, dim * 4), *db = dev_upload(b, dim * 4);
        pi0_bf16 *dout = dev_poisoned(n * 2);
        CUDA_OK(pi0_cuda_layernorm(dout, dx, rows, dim, dw, db, 1e-6f, 0));
        CUDA_OK(cudaDeviceSynchronize());
        float *got = download_bf16(dout, n);
        double e = rel_error(got, ref, n);
        CHECK(e <= TOL_BF16_OUT, "layernorm %dx%d: %.3g", rows, dim, e);
        free(x), free(w), free(b), free(ref), free(got);
        cudaFree(dx), cudaFree(dw), cudaFree(db), cudaFree(dout);
    }
}

static void rmsnorm_case(int dim) {
    int rows = 37, out_rows = 20;
    size_t n = (size_t)rows * dim;
    float *x = malloc(n * 4), *w = malloc(dim * 4), *ref = malloc((size_t)out_rows * dim * 4);
    int map[20];
    fill_uniform(x, n, 5.0f), fill_uniform(w, dim, 0.3f);
    for (int i = 0; i < out_rows; i++) {
        map[i] = (i * 7 + 3) % rows;
        cpu_rmsnorm(ref + (size_t)i * dim, x + (size_t)map[i] * dim, 1, dim, w, 1e-6f);
    }
    float *dx = dev_upload(x, n * 4), *dw = dev_upload(w, dim * 4);
    int *dmap = dev_upload(map, sizeof map);
    pi0_bf16 *dout = dev_poisoned((size_t)out_rows * dim * 2);
    CUDA_OK(pi0_cuda_rmsnorm(dout, dx, dmap, out_rows, dim, dw, 1e-6f, 0, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *got = download_bf16(dout, (size_t)out_rows * dim);
    CHECK(rel_error(got, ref, (size_t)out_rows * dim) <= TOL_BF16_OUT, "mapped rmsnorm, dim %d: %.3g", dim,
          rel_error(got, ref, (size_t)out_rows * dim));
    /* identity map (NULL) over all rows */
    float *ref_all = malloc(n * 4);
    cpu_rmsnorm(ref_all, x, rows, dim, w, 1e-6f);
    pi0_bf16 *dall = dev_poisoned(n * 2);
    CUDA_OK(pi0_cuda_rmsnorm(dall, dx, NULL, rows, dim, dw, 1e-6f, 0, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *got_all = download_bf16(dall, n);
    CHECK(rel_error(got_all, ref_all, n) <= TOL_BF16_OUT, "rmsnorm, dim %d: %.3g", dim, rel_error(got_all, ref_all, n));
    /* no weight (folded into the next Linear): the oracle with w = 0, i.e. a factor 1 + 0 */
    float *zero = calloc(dim, 4);
    cpu_rmsnorm(ref_all, x, rows, dim, zero, 1e-6f);
    CUDA_OK(pi0_cuda_rmsnorm(dall, dx, NULL, rows, dim, NULL, 1e-6f, 0, 0));
    CUDA_OK(cudaDeviceSynchronize());
    free(got_all);
    got_all = download_bf16(dall, n);
    CHECK(rel_error(got_all, ref_all, n) <= TOL_BF16_OUT, "rmsnorm without weight, dim %d: %.3g", dim,
          rel_error(got_all, ref_all, n));
    free(x), free(w), free(ref), free(got), free(ref_all), free(got_all), free(zero);
    cudaFree(dx), cudaFree(dw), cudaFree(dmap), cudaFree(dout), cudaFree(dall);
}

TEST(rmsnorm_matches_cpu_with_row_map) {
    rmsnorm_case(1024); /* the expert's final norm: from registers */
    rmsnorm_case(2048); /* the LLM's: from registers, two groups a thread */
    rmsnorm_case(1030); /* not in fours: from memory */
    rmsnorm_case(2056); /* past the register path's rows */
}

/* A GEMM's split-K partial sums added to the residual stream inside the next RMSNorm: x += gate * (sum of the parts in
 * order) (float32, so x must match the same arithmetic on the host bit for bit), then h = RMSNorm(x) * (1 + w) + shift
 * (the prefix's down projection: no gate, no shift; Pi0.5's expert: both). */
static void add_parts_rmsnorm_case(int rows, int dim, int parts, int pi05) {
    size_t n = (size_t)rows * dim;
    float *x = malloc(n * 4), *p = malloc(parts * n * 4), *w = malloc(dim * 4), *gate = malloc(dim * 4);
    float *shift = malloc(dim * 4), *ref = malloc(n * 4);
    fill_uniform(x, n, 5.0f), fill_uniform(p, parts * n, 2.0f), fill_uniform(w, dim, 0.3f), fill_uniform(gate, dim, 1.0f);
    fill_uniform(shift, dim, 0.5f);
    float *dx = dev_upload(x, n * 4), *dp = dev_upload(p, parts * n * 4), *dw = dev_upload(w, dim * 4);
    float *dgate = dev_upload(gate, dim * 4), *dshift = dev_upload(shift, dim * 4);
    for (size_t i = 0; i < n; i++) {
        float sum = p[i];
        for (int j = 1; j < parts; j++) sum += p[(size_t)j * n + i];
        x[i] += pi05 ? gate[i % dim] * sum : sum;
    }
    cpu_rmsnorm(ref, x, rows, dim, w, 1e-6f);
    if (pi05)
        for (size_t i = 0; i < n; i++) ref[i] += shift[i % dim];
    pi0_bf16 *dh = dev_poisoned(n * 2);
    CUDA_OK(pi0_cuda_add_parts_rmsnorm(dh, dx, dp, parts, pi05 ? dgate : NULL, rows, dim, dw, pi05 ? dshift : NULL, 1e-6f,
                                       0, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *got_x = download_f32(dx, n), *got_h = download_bf16(dh, n);
    size_t differ = 0;
    for (size_t i = 0; i < n; i++) differ += memcmp(&got_x[i], &x[i], 4) != 0;
    CHECK(differ == 0, "add parts %dx%d, %d parts%s: %zu sums differ from the host's", rows, dim, parts,
          pi05 ? ", gated" : "", differ);
    CHECK(rel_error(got_h, ref, n) <= TOL_BF16_OUT, "add parts rmsnorm %dx%d, %d parts%s: %.3g", rows, dim, parts,
          pi05 ? ", gated, shifted" : "", rel_error(got_h, ref, n));
    free(x), free(p), free(w), free(gate), free(shift), free(ref), free(got_x), free(got_h);
    cudaFree(dx), cudaFree(dp), cudaFree(dw), cudaFree(dgate), cudaFree(dshift), cudaFree(dh);
}

TEST(add_parts_rmsnorm_matches_cpu) {
    add_parts_rmsnorm_case(37, 2048, 2, 0); /* the LLM's down projection */
    add_parts_rmsnorm_case(51, 1024, 4, 0); /* the expert's at horizon 50 */
    add_parts_rmsnorm_case(43, 1024, 2, 1); /* Pi0.5's expert: gated, shifted */
    add_parts_rmsnorm_case(5, 1024, 8, 1);
    add_parts_rmsnorm_case(3, 1156, 3, 1); /* not a whole number of float4 a thread */
    add_parts_rmsnorm_case(1, 4, 1, 0);
    /* past the register path, or too many parts: refused, nothing written */
    CHECK(!pi0_cuda_add_parts_rmsnorm_fits(2056, 2) && !pi0_cuda_add_parts_rmsnorm_fits(1030, 2) &&
              !pi0_cuda_add_parts_rmsnorm_fits(2048, 9) && !pi0_cuda_add_parts_rmsnorm_fits(2048, 0),
          "unsupported shapes reported as fitting");
    float *d = dev_poisoned(2056 * 3 * 4);
    CHECK(pi0_cuda_add_parts_rmsnorm((pi0_bf16 *)d, d, d, 2, NULL, 1, 2056, NULL, NULL, 1e-6f, 0, 0) == cudaErrorInvalidValue,
          "a row past the register path was not refused");
    cudaGetLastError();
    cudaFree(d);
}

/* Pi0.5's adaptive RMSNorm (scale and shift) through a row map, and the gated residual add. */
static void rmsnorm_mod_case(int dim) {
    int rows = 29, out_rows = 11;
    size_t n = (size_t)rows * dim;
    float *x = malloc(n * 4), *scale = malloc(dim * 4), *shift = malloc(dim * 4), *ref = malloc((size_t)out_rows * dim * 4);
    int map[11];
    fill_uniform(x, n, 5.0f), fill_uniform(scale, dim, 0.8f), fill_uniform(shift, dim, 1.0f);
    for (int i = 0; i < out_rows; i++) {
        map[i] = (i * 5 + 2) % rows;
        cpu_rmsnorm_mod(ref + (size_t)i * dim, x + (size_t)map[i] * dim, 1, dim, scale, shift, 1e-6f);
    }
    float *dx = dev_upload(x, n * 4), *dscale = dev_upload(scale, dim * 4), *dshift = dev_upload(shift, dim * 4);
    int *dmap = dev_upload(map, sizeof map);
    pi0_bf16 *dout = dev_poisoned((size_t)out_rows * dim * 2);
    CUDA_OK(pi0_cuda_rmsnorm_mod(dout, dx, dmap, out_rows, dim, dscale, dshift, 1e-6f, 0, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *got = download_bf16(dout, (size_t)out_rows * dim);
    double e = rel_error(got, ref, (size_t)out_rows * dim);
    CHECK(e <= TOL_BF16_OUT, "adaptive rmsnorm, dim %d: %.3g", dim, e);
    /* gated add: x += gate * y, against the CPU's */
    float *y = malloc(n * 4), *gate = malloc(dim * 4), *want = malloc(n * 4);
    fill_uniform(y, n, 2.0f), fill_uniform(gate, dim, 1.5f);
    memcpy(want, x, n * 4);
    cpu_add_gated(want, y, rows, dim, gate);
    float *dy = dev_upload(y, n * 4), *dgate = dev_upload(gate, dim * 4);
    CUDA_OK(pi0_cuda_add_gated(dx, dy, dgate, rows, dim, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *sum = download_f32(dx, n);
    CHECK(rel_error(sum, want, n) <= 1e-6, "gated add, dim %d: %.3g", dim, rel_error(sum, want, n));
    /* bf16(1 + scale), the skinny Linears' form of it */
    pi0_bf16 *dplus = dev_poisoned((size_t)dim * 2);
    CUDA_OK(pi0_cuda_one_plus_bf16(dplus, dscale, (size_t)dim, 0));
    CUDA_OK(cudaDeviceSynchronize());
    uint16_t *plus = malloc((size_t)dim * 2);
    CUDA_OK(cudaMemcpy(plus, dplus, (size_t)dim * 2, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < dim; i++) bad += plus[i] != bf16_bits(1.0f + scale[i]);
    CHECK(bad == 0, "one_plus_bf16, dim %d: %d values differ", dim, bad);
    free(plus);
    cudaFree(dplus);
    free(x), free(scale), free(shift), free(ref), free(got), free(y), free(gate), free(want), free(sum);
    cudaFree(dx), cudaFree(dscale), cudaFree(dshift), cudaFree(dmap), cudaFree(dout), cudaFree(dy), cudaFree(dgate);
}

TEST(rmsnorm_mod_and_gated_add_match_cpu) {
    rmsnorm_mod_case(1024); /* Pi0.5's expert: from registers */
    rmsnorm_mod_case(1030); /* from memory */
    rmsnorm_mod_case(48);   /* the tiny fixtures' expert */
}

static void gelu_mul_case(int rows, int mlp) {
    size_t n = (size_t)rows * 2 * mlp;
    float *in = malloc(n * 4), *gate = malloc((size_t)rows * mlp * 4), *up = malloc((size_t)rows * mlp * 4);
    fill_uniform(in, n, 4.0f);
    uint16_t *bits = to_bf16_rounding(in, n);
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < mlp; j++) {
            gate[(size_t)r * mlp + j] = in[(size_t)r * 2 * mlp + 2 * j]; /* (gate_j, up_j) interleaved */
            up[(size_t)r * mlp + j] = in[(size_t)r * 2 * mlp + 2 * j + 1];
        }
    cpu_gelu_mul(gate, up, (size_t)rows * mlp);
    pi0_bf16 *din = dev_upload(bits, n * 2), *dout = dev_poisoned((size_t)rows * mlp * 2);
    CUDA_OK(pi0_cuda_gelu_mul(dout, din, rows, mlp, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *got = download_bf16(dout, (size_t)rows * mlp);
    CHECK(rel_error(got, gate, (size_t)rows * mlp) <= TOL_BF16_OUT, "gelu_mul %d x %d: %.3g", rows, mlp,
          rel_error(got, gate, (size_t)rows * mlp));
    free(in), free(gate), free(up), free(bits), free(got);
    cudaFree(din), cudaFree(dout);
}

TEST(gelu_mul_matches_cpu) {
    gelu_mul_case(19, 4097); /* an odd count: one output a thread */
    gelu_mul_case(7, 1030);  /* a multiple of 4 (7 x 1030) across rows: four a thread, rows straddling vectors */
    gelu_mul_case(3, 16384); /* Pi0's mlp dim */
}

/* gelu(x w_gate^T) x (x w_up^T) in one Hopper kernel (gate_up.cu) against cpu_linear and cpu_gelu_mul, gate and up
 * rounded to bf16 in between as the kernel (and the cuBLASLt path) does. The sizes straddle the kernel's tiles: both of
 * its token tilings (2 x 136 with a last wide tile of 136 or fewer, or 144 each), weight rows in super-tiles of 512,
 * k in steps of 64 (a tail the tensor copies fill with zeros). With after_norm, x is RMSNorm's output, written into
 * a poisoned buffer by the kernel launched just before, as in the prefix, where the product runs as a programmatic
 * dependent of that norm and copies its first stages' weights before its wait. What this does not force is the race
 * a token copy issued before the wait would open: a mutant doing that passed it three times on an H200 (session 43),
 * because the product's blocks each need a whole multiprocessor, which the norm's blocks leave only as they finish;
 * tests/pdl_loads.sh (pdl_order_gate_up, no GPU) checks that order in the kernel's PTX instead. */
static void gate_up_gelu_case_from(int rows, int mlp, int k, int after_norm) {
    size_t nx = (size_t)rows * k, nw = (size_t)2 * mlp * k, nout = (size_t)rows * mlp;
    float *x = malloc(nx * 4), *w = malloc(nw * 4), *both = malloc((size_t)rows * 2 * mlp * 4);
    float *gate = malloc(nout * 4), *up = malloc(nout * 4), *norm_w = malloc((size_t)k * 4);
    float *normed = after_norm ? malloc(nx * 4) : NULL;
    fill_uniform(x, nx, 1.0f), fill_uniform(w, nw, 2.0f / sqrtf((float)k)), fill_uniform(norm_w, k, 0.3f);
    uint16_t *xb = to_bf16_rounding(x, nx), *wb = to_bf16_rounding(w, nw);
    if (after_norm) cpu_rmsnorm(normed, x, rows, k, norm_w, 1e-6f);
    cpu_linear(both, after_norm ? normed : x, rows, k, w, NULL, 2 * mlp); /* w's rows interleaved (gate_j, up_j) */
    for (size_t r = 0; r < (size_t)rows; r++)
        for (size_t j = 0; j < (size_t)mlp; j++) {
            gate[r * mlp + j] = bf16_value(bf16_bits(both[r * 2 * mlp + 2 * j]));
            up[r * mlp + j] = bf16_value(bf16_bits(both[r * 2 * mlp + 2 * j + 1]));
        }
    cpu_gelu_mul(gate, up, nout);
    pi0_bf16 *dx = after_norm ? dev_poisoned(nx * 2) : dev_upload(xb, nx * 2), *dw = dev_upload(wb, nw * 2);
    pi0_bf16 *dout = dev_poisoned(nout * 2);
    float *dxf = after_norm ? dev_upload(x, nx * 4) : NULL, *dnw = after_norm ? dev_upload(norm_w, (size_t)k * 4) : NULL;
    CUDA_OK(cudaDeviceSynchronize());
    if (after_norm) CUDA_OK(pi0_cuda_rmsnorm(dx, dxf, NULL, rows, k, dnw, 1e-6f, 1, 0));
    CUDA_OK(pi0_cuda_gate_up_gelu(dout, dx, dw, rows, mlp, k, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *got = download_bf16(dout, nout);
    double e = rel_error(got, gate, nout);
    CHECK(all_finite(got, nout) && e <= TOL_BF16_OUT, "gate_up_gelu %d x %d x %d%s: %.3g", rows, mlp, k,
          after_norm ? " after RMSNorm" : "", e);
    free(x), free(w), free(both), free(gate), free(up), free(normed), free(norm_w), free(xb), free(wb), free(got);
    cudaFree(dx), cudaFree(dw), cudaFree(dout), cudaFree(dxf), cudaFree(dnw);
}

static void gate_up_gelu_case(int rows, int mlp, int k) { gate_up_gelu_case_from(rows, mlp, k, 0); }

TEST(gate_up_gelu_matches_cpu) {
    if (!pi0_cuda_gate_up_gelu_fits(1, 256, 64)) SKIP("not an sm_90a device (or build), or no tensor maps in its driver");
    gate_up_gelu_case(1, 256, 64);       /* one token: the 136 kernel's wide unit alone, one k step */
    gate_up_gelu_case(137, 256, 72);     /* the 144 kernel, one tile; k's last step 8 deep */
    gate_up_gelu_case(532, 512, 128);    /* the 136 kernel's narrow tiles, the last with 124 tokens in its second half */
    gate_up_gelu_case(936, 768, 200);    /* three narrow tiles and a wide one of 120 tokens; three super-tiles */
    gate_up_gelu_case(600, 8192, 64);    /* two narrow tiles and a wide one of 56 tokens; ~2-3 units a cluster of one k
                                          * step each, the staging tile reused from unit to unit (its wait for the
                                          * last copy's read is a race this case does not force: without the wait it
                                          * still passed, session 32) */
    gate_up_gelu_case(572, 16384, 2048); /* Pi0.5's prefix at a 60-token prompt: the 144 kernel, four tiles */
    gate_up_gelu_case(532, 16384, 2048); /* the seed's prefix */
    gate_up_gelu_case_from(532, 16384, 2048, 1); /* ... after the norm that writes its tokens, as in the prefix */
    CHECK(!pi0_cuda_gate_up_gelu_fits(16, 384, 64) && !pi0_cuda_gate_up_gelu_fits(16, 256, 60),
          "dims outside the kernel's tiles are refused");
}

static void rope_case(int rows, int heads, int kv_heads, int hd) {
    int qkv_dim = (heads + 2 * kv_heads) * hd, kv_dim = kv_heads * hd, max_pos = 900, cache_rows = rows + 5;
    size_t n = (size_t)rows * qkv_dim;
    float *qkv = malloc(n * 4);
    int *pos = malloc(rows * sizeof(int)), *cache_row = malloc(rows * sizeof(int));
    fill_uniform(qkv, n, 2.0f);
    uint16_t *bits = to_bf16_rounding(qkv, n);
    for (int r = 0; r < rows; r++) /* scattered positions; distinct cache rows, shifted as in a batch */
        pos[r] = (r * 37 + 11) % max_pos, cache_row[r] = (r + 2) % cache_rows;
    rope_table table;
    REQUIRE(rope_table_init(&table, max_pos, hd) == 0);
    /* oracle: rotate q and k of each row on the CPU */
    float *ref = malloc(n * 4);
    memcpy(ref, qkv, n * 4);
    for (int r = 0; r < rows; r++) {
        cpu_rope(ref + (size_t)r * qkv_dim, 1, qkv_dim, heads, hd, &pos[r], &table);
        cpu_rope(ref + (size_t)r * qkv_dim + heads * hd, 1, qkv_dim, kv_heads, hd, &pos[r], &table);
    }
    pi0_bf16 *dqkv = dev_upload(bits, n * 2), *dk = dev_poisoned((size_t)cache_rows * kv_dim * 2),
             *dv = dev_poisoned((size_t)cache_rows * kv_dim * 2);
    int *dpos = dev_upload(pos, rows * sizeof(int)), *drow = dev_upload(cache_row, rows * sizeof(int));
    float *dcos = dev_upload(table.cos, (size_t)max_pos * hd / 2 * 4), *dsin = dev_upload(table.sin, (size_t)max_pos * hd / 2 * 4);
    CUDA_OK(pi0_cuda_rope_qkv(dqkv, rows, heads, kv_heads, hd, dpos, drow, dk, dv, dcos, dsin, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *got = download_bf16(dqkv, n), *k = download_bf16(dk, (size_t)cache_rows * kv_dim),
          *v = download_bf16(dv, (size_t)cache_rows * kv_dim);
    double eq = 0, ek = 0, ev = 0;
    for (int r = 0; r < rows; r++) {
        const float *want = ref + (size_t)r * qkv_dim;
        eq = fmax(eq, rel_error(got + (size_t)r * qkv_dim, want, (size_t)heads * hd));
        ek = fmax(ek, rel_error(k + (size_t)cache_row[r] * kv_dim, want + heads * hd, kv_dim));
        ev = fmax(ev, rel_error(v + (size_t)cache_row[r] * kv_dim, qkv + (size_t)r * qkv_dim + heads * hd + kv_dim, kv_dim));
    }
    CHECK(eq <= TOL_BF16_OUT && ek <= TOL_BF16_OUT && ev == 0, "rope %d rows %d/%d heads hd %d: q %.3g k %.3g v %.3g", rows,
          heads, kv_heads, hd, eq, ek, ev);
    free(qkv), free(pos), free(cache_row), free(bits), free(ref), free(got), free(k), free(v);
    rope_table_free(&table);
    cudaFree(dqkv), cudaFree(dk), cudaFree(dv), cudaFree(dpos), cudaFree(drow), cudaFree(dcos), cudaFree(dsin);
}

TEST(rope_qkv_matches_cpu) {
    rope_case(1, 8, 1, 256); /* head dims in eights: 4 pairs and 8 values a thread, all loads first, one pass */
    rope_case(33, 8, 1, 256);
    rope_case(3, 16, 2, 256); /* more groups than threads: two passes */
    rope_case(7, 4, 2, 32);
    rope_case(5, 3, 2, 8);
    rope_case(6, 3, 1, 12); /* not: a pair a thread */
    rope_case(33, 0, 1, 256); /* K and V only (the prefix's last layer, forward.c's kv_only) */
    rope_case(5, 0, 2, 12);
}

TEST(im2col_and_bias_pos) {
    int n = 3, S = 42, p = 14, grid = S / p, P = grid * grid, patch_dim = 3 * p * p, dim = 5;
    size_t image = (size_t)S * S * 3;
    float *images = malloc(n * image * 4);
    fill_uniform(images, n * image, 1.0f);
    size_t row_len = (size_t)PI0_PATCH_PIECES * patch_dim;
    float *dimg = dev_upload(images, n * image * 4);
    pi0_bf16 *dout = dev_poisoned((size_t)n * P * row_len * 2);
    int zeros[3] = {0, 0, 0}, *dflags = dev_upload(zeros, sizeof zeros), flags[3];
    CUDA_OK(pi0_cuda_im2col(dout, dimg, n, S, p, dflags, 0));
    CUDA_OK(cudaDeviceSynchronize());
    CUDA_OK(cudaMemcpy(flags, dflags, sizeof flags, cudaMemcpyDeviceToHost));
    CHECK(!flags[0] && !flags[1] && !flags[2], "finite images flagged: %d %d %d", flags[0], flags[1], flags[2]);
    uint16_t *got = malloc((size_t)n * P * row_len * 2);
    CUDA_OK(cudaMemcpy(got, dout, (size_t)n * P * row_len * 2, cudaMemcpyDeviceToHost));
    const int x_piece[PI0_PATCH_PIECES] = PI0_PATCH_X_PIECES;
    int mismatches = 0, inexact = 0;
    for (int i = 0; i < n; i++)
        for (int py = 0; py < grid; py++)
            for (int px = 0; px < grid; px++)
                for (int c = 0; c < 3; c++)
                    for (int r = 0; r < p; r++)
                        for (int col = 0; col < p; col++) {
                            float want = images[i * image + ((size_t)(py * p + r) * S + px * p + col) * 3 + c];
                            const uint16_t *at = got + ((size_t)i * P + py * grid + px) * row_len + (c * p + r) * p + col;
                            uint16_t piece[3]; /* the host's split, bit for bit, in every block */
                            f32_to_bf16x3(want, piece);
                            for (int b = 0; b < PI0_PATCH_PIECES; b++) mismatches += at[(size_t)b * patch_dim] != piece[x_piece[b]];
                            inexact += (double)bf16_value(piece[0]) + bf16_value(piece[1]) + bf16_value(piece[2]) != want;
                        }
    CHECK(mismatches == 0, "im2col: %d mismatches", mismatches);
    CHECK(inexact == 0, "%d values are not the sum of their three pieces", inexact);
    /* NaN and infinity flag their own image only, wherever they are (image 1's first value, image 2's last) */
    float bad[2] = {NAN, -INFINITY};
    CUDA_OK(cudaMemcpy(dimg + image, &bad[0], 4, cudaMemcpyHostToDevice));
    CUDA_OK(cudaMemcpy(dimg + 3 * image - 1, &bad[1], 4, cudaMemcpyHostToDevice));
    CUDA_OK(pi0_cuda_im2col(dout, dimg, n, S, p, dflags, 0));
    CUDA_OK(cudaMemcpy(flags, dflags, sizeof flags, cudaMemcpyDeviceToHost));
    CHECK(!flags[0] && flags[1] && flags[2], "flags %d %d %d, want 0 1 1", flags[0], flags[1], flags[2]);
    CUDA_OK(pi0_cuda_im2col(dout, dimg, n, S, p, NULL, 0)); /* without flags: no flag to set */
    CUDA_OK(cudaDeviceSynchronize());
    cudaFree(dflags);
    /* x += bias + pos[row % P] */
    size_t rows = (size_t)n * P;
    float *x = malloc(rows * dim * 4), *bias = malloc(dim * 4), *pos = malloc((size_t)P * dim * 4);
    fill_uniform(x, rows * dim, 1.0f), fill_uniform(bias, dim, 1.0f), fill_uniform(pos, (size_t)P * dim, 1.0f);
    float *dx = dev_upload(x, rows * dim * 4), *dbias = dev_upload(bias, dim * 4), *dpos = dev_upload(pos, (size_t)P * dim * 4);
    CUDA_OK(pi0_cuda_add_bias_pos(dx, dbias, dpos, (int)rows, P, dim, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *gx = download_f32(dx, rows * dim);
    mismatches = 0;
    for (size_t r = 0; r < rows; r++)
        for (int j = 0; j < dim; j++) mismatches += gx[r * dim + j] != x[r * dim + j] + bias[j] + pos[(r % P) * dim + j];
    CHECK(mismatches == 0, "add_bias_pos: %d mismatches", mismatches);
    free(images), free(got), free(x), free(bias), free(pos), free(gx);
    cudaFree(dimg), cudaFree(dout), cudaFree(dx), cudaFree(dbias), cudaFree(dpos);
}

TEST(assemble_prefix_and_suffix) {
    int rows = 9, dim = 70, vocab = 13;
    float *vision = malloc(4 * dim * 4), *embed = malloc((size_t)vocab * dim * 4);
    fill_uniform(vision, 4 * dim, 1.0f), fill_uniform(embed, (size_t)vocab * dim, 1.0f);
    uint16_t *embed_bits = to_bf16_rounding(embed, (size_t)vocab * dim);
    int src[9] = {0, 1, -1, -13, 3, 2, -5, -1, 0};
    float *dvision = dev_upload(vision, 4 * dim * 4), *dx = dev_poisoned((size_t)rows * dim * 4);
    pi0_bf16 *dembed = dev_upload(embed_bits, (size_t)vocab * dim * 2);
    int *dsrc = dev_upload(src, sizeof src);
    CUDA_OK(pi0_cuda_assemble_prefix(dx, dsrc, rows, dim, dvision, dembed, 8.0f, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *x = download_f32(dx, (size_t)rows * dim);
    int bad = 0;
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < dim; j++) {
            float want = src[r] >= 0 ? vision[src[r] * dim + j] : embed[(-src[r] - 1) * dim + j] * 8.0f;
            bad += x[r * dim + j] != want;
        }
    CHECK(bad == 0, "assemble_prefix: %d mismatches", bad);
    /* suffix: [state, actions...] per sample */
    int B = 3, H = 4, W = 33;
    float *state = malloc(B * W * 4), *act = malloc((size_t)B * H * W * 4);
    fill_uniform(state, B * W, 1.0f), fill_uniform(act, (size_t)B * H * W, 1.0f);
    float *dstate = dev_upload(state, B * W * 4), *dact = dev_upload(act, (size_t)B * H * W * 4);
    float *dsuffix = dev_poisoned((size_t)B * (H + 1) * W * 4);
    pi0_bf16 *dsuffix_bf16 = dev_poisoned((size_t)B * (H + 1) * W * 2);
    CUDA_OK(pi0_cuda_assemble_suffix(dsuffix, dsuffix_bf16, dstate, dact, B, H, W, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *suffix = download_f32(dsuffix, (size_t)B * (H + 1) * W), *suffix_bf16 = download_bf16(dsuffix_bf16, (size_t)B * (H + 1) * W);
    bad = 0;
    int bad_bf16 = 0;
    for (int b = 0; b < B; b++)
        for (int i = 0; i <= H; i++)
            for (int j = 0; j < W; j++) {
                float want = i == 0 ? state[b * W + j] : act[((size_t)b * H + i - 1) * W + j];
                bad += suffix[((size_t)b * (H + 1) + i) * W + j] != want;
                bad_bf16 += suffix_bf16[((size_t)b * (H + 1) + i) * W + j] != bf16_value(bf16_bits(want));
            }
    CHECK(bad == 0, "assemble_suffix: %d mismatches", bad);
    CHECK(bad_bf16 == 0, "assemble_suffix bf16 copy: %d mismatches", bad_bf16);
    free(vision), free(embed), free(embed_bits), free(x), free(state), free(act), free(suffix), free(suffix_bf16);
    cudaFree(dvision), cudaFree(dx), cudaFree(dembed), cudaFree(dsrc), cudaFree(dstate), cudaFree(dact), cudaFree(dsuffix);
    cudaFree(dsuffix_bf16);
}

TEST(linear_small_k_matches_cpu) {
    int rows = 23, k = 32, n = 1030;
    float *x = malloc(rows * k * 4), *w = malloc((size_t)n * k * 4), *b = malloc(n * 4), *ref = malloc((size_t)rows * n * 4);
    fill_uniform(x, rows * k, 1.0f), fill_uniform(w, (size_t)n * k, 0.3f), fill_uniform(b, n, 0.5f);
    uint16_t *wbits = to_bf16_rounding(w, (size_t)n * k);
    float *dx = dev_upload(x, rows * k * 4), *db = dev_upload(b, n * 4);
    pi0_bf16 *dw = dev_upload(wbits, (size_t)n * k * 2);
    for (int swish = 0; swish <= 1; swish++) {
        cpu_linear(ref, x, rows, k, w, b, n);
        if (swish) cpu_swish_inplace(ref, (size_t)rows * n);
        float *df = dev_poisoned((size_t)rows * n * 4);
        pi0_bf16 *dh = dev_poisoned((size_t)rows * n * 2), *dboth = dev_poisoned((size_t)rows * n * 2);
        CUDA_OK(pi0_cuda_linear_small_k(df, dboth, dx, dw, db, rows, k, n, swish, 0)); /* both outputs */
        CUDA_OK(pi0_cuda_linear_small_k(NULL, dh, dx, dw, db, rows, k, n, swish, 0));
        CHECK(pi0_cuda_linear_small_k(NULL, NULL, dx, dw, db, rows, k, n, swish, 0) == cudaErrorInvalidValue, "no output");
        CUDA_OK(cudaDeviceSynchronize());
        float *gf = download_f32(df, (size_t)rows * n), *gh = download_bf16(dh, (size_t)rows * n);
        uint16_t *both = malloc((size_t)rows * n * 2);
        CUDA_OK(cudaMemcpy(both, dboth, (size_t)rows * n * 2, cudaMemcpyDeviceToHost));
        CHECK(rel_error(gf, ref, (size_t)rows * n) <= 1e-5, "f32 out, swish %d: %.3g", swish, rel_error(gf, ref, (size_t)rows * n));
        CHECK(rel_error(gh, ref, (size_t)rows * n) <= TOL_BF16_OUT, "bf16 out, swish %d", swish);
        int bad = 0;
        for (size_t i = 0; i < (size_t)rows * n; i++) bad += both[i] != bf16_bits(gf[i]);
        CHECK(bad == 0, "swish %d: %d bf16 outputs are not the float32 ones rounded", swish, bad);
        free(gf), free(gh), free(both);
        cudaFree(df), cudaFree(dh), cudaFree(dboth);
    }
    free(x), free(w), free(b), free(ref), free(wbits);
    cudaFree(dx), cudaFree(db), cudaFree(dw);
}

/* Pi0's first kernel of a skinny denoise step: the hidden rows as linear_small_k's (bf16, swish) and the state
 * token in the suffix's row 0, float32 and bf16; the action rows after it are left alone (the next Linear's). */
TEST(action_time_in_matches_cpu) {
    int H = 10, A = 32, W = 1030;
    float *x = malloc(H * A * 4), *w = malloc((size_t)W * A * 4), *b = malloc(W * 4), *state = malloc(W * 4);
    float *ref = malloc((size_t)H * W * 4);
    fill_uniform(x, H * A, 1.0f), fill_uniform(w, (size_t)W * A, 0.3f), fill_uniform(b, W, 0.5f), fill_uniform(state, W, 3.0f);
    uint16_t *wbits = to_bf16_rounding(w, (size_t)W * A);
    cpu_linear(ref, x, H, A, w, b, W);
    cpu_swish_inplace(ref, (size_t)H * W);
    float *dx = dev_upload(x, H * A * 4), *db = dev_upload(b, W * 4), *dstate = dev_upload(state, W * 4);
    pi0_bf16 *dw = dev_upload(wbits, (size_t)W * A * 2), *dh = dev_poisoned(((size_t)H * W + 64) * 2);
    float *dsuffix = dev_poisoned((size_t)(H + 1) * W * 4);
    pi0_bf16 *dsuffix_bf16 = dev_poisoned((size_t)(H + 1) * W * 2);
    CUDA_OK(pi0_cuda_action_time_in(dh, dsuffix, dsuffix_bf16, dstate, dx, dw, db, H, A, W, 0));
    CUDA_OK(cudaDeviceSynchronize());
    float *gh = download_bf16(dh, (size_t)H * W), *suffix = download_f32(dsuffix, (size_t)(H + 1) * W);
    uint16_t *suffix_bf16 = malloc((size_t)(H + 1) * W * 2), *guard = malloc(64 * 2);
    CUDA_OK(cudaMemcpy(suffix_bf16, dsuffix_bf16, (size_t)(H + 1) * W * 2, cudaMemcpyDeviceToHost));
    CUDA_OK(cudaMemcpy(guard, dh + (size_t)H * W, 64 * 2, cudaMemcpyDeviceToHost));
    CHECK(rel_error(gh, ref, (size_t)H * W) <= TOL_BF16_OUT, "hidden rows: %.3g", rel_error(gh, ref, (size_t)H * W));
    int bad = 0, touched = 0;
    for (int j = 0; j < W; j++) bad += suffix[j] != state[j] || suffix_bf16[j] != bf16_bits(state[j]);
    uint32_t poison_f32;
    memcpy(&poison_f32, &suffix[W], 4);
    for (size_t i = W; i < (size_t)(H + 1) * W; i++) {
        uint32_t bits;
        memcpy(&bits, &suffix[i], 4);
        touched += bits != poison_f32 || suffix_bf16[i] != suffix_bf16[W];
    }
    for (int i = 0; i < 64; i++) touched += guard[i] != 0xffff;
    CHECK(bad == 0, "%d state token values differ", bad);
    CHECK(touched == 0, "%d values written past the state row or the hidden rows", touched);
    free(x), free(w), free(b), free(state), free(ref), free(wbits), free(gh), free(suffix), free(suffix_bf16), free(guard);
    cudaFree(dx), cudaFree(db), cudaFree(dstate), cudaFree(dw), cudaFree(dh), cudaFree(dsuffix), cudaFree(dsuffix_bf16);
}

/* cuBLASLt: every flavour the backend uses, against a double-precision loop on the same operands. */
static void gemm_case(gemm_context *ctx, int m, int n, int k, int bias, int gelu, int out_f32, float alpha, float beta) {
    float *x = malloc((size_t)m * k * 4), *w = malloc((size_t)n * k * 4), *b = malloc(n * 4), *c = malloc((size_t)m * n * 4);
    fill_uniform(x, (size_t)m * k, 1.0f), fill_uniform(w, (size_t)n * k, 1.0f / sqrtf((float)k));
    fill_uniform(b, n, 0.5f), fill_uniform(c, (size_t)m * n, 1.0f);
    uint16_t *xb = to_bf16_rounding(x, (size_t)m * k), *wb = to_bf16_rounding(w, (size_t)n * k);
    uint16_t *bb = out_f32 ? NULL : to_bf16_rounding(b, n), *cb = out_f32 ? NULL : to_bf16_rounding(c, (size_t)m * n);
    float *ref = malloc((size_t)m * n * 4);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < n; j++) {
            double acc = 0;
            for (int t = 0; t < k; t++) acc += (double)x[(size_t)i * k + t] * w[(size_t)j * k + t];
            acc = alpha * acc + beta * c[(size_t)i * n + j] + (bias ? b[j] : 0);
            ref[(size_t)i * n + j] = gelu ? cpu_gelu_tanh((float)acc) : (float)acc;
        }
    size_t out_elem = out_f32 ? 4 : 2;
    void *dx = dev_upload(xb, (size_t)m * k * 2), *dw = dev_upload(wb, (size_t)n * k * 2);
    void *db = dev_upload(out_f32 ? (void *)b : (void *)bb, n * out_elem);
    void *dout = dev_upload(out_f32 ? (void *)c : (void *)cb, (size_t)m * n * out_elem);
    pi0_error err = {0};
    gemm_args a = {.m = m, .n = n, .k = k, .x = dx, .w = dw, .out = dout, .bias = bias ? db : NULL, .out_f32 = out_f32,
                   .gelu = gelu, .alpha = alpha, .beta = beta};
    CHECK(gemm_run(ctx, &a, 0, &err) == PI0_OK, "%s", err.message);
    CUDA_OK(cudaDeviceSynchronize());
    float *got = out_f32 ? download_f32(dout, (size_t)m * n) : download_bf16(dout, (size_t)m * n);
    double e = rel_error(got, ref, (size_t)m * n), tol = out_f32 ? 1e-4 : TOL_BF16_OUT;
    CHECK(e <= tol, "gemm m %d n %d k %d bias %d gelu %d f32out %d alpha %g beta %g: %.3g", m, n, k, bias, gelu, out_f32,
          alpha, beta, e);
    free(x), free(w), free(b), free(c), free(xb), free(wb), free(bb), free(cb), free(ref), free(got);
    cudaFree(dx), cudaFree(dw), cudaFree(db), cudaFree(dout);
}

/* k_parts: each slice of k's float32 product into its own output, against the double loop over that slice. */
static void gemm_parts_case(gemm_context *ctx, int m, int n, int k, int parts) {
    float *x = malloc((size_t)m * k * 4), *w = malloc((size_t)n * k * 4), *ref = malloc((size_t)parts * m * n * 4);
    fill_uniform(x, (size_t)m * k, 1.0f), fill_uniform(w, (size_t)n * k, 1.0f / sqrtf((float)k));
    uint16_t *xb = to_bf16_rounding(x, (size_t)m * k), *wb = to_bf16_rounding(w, (size_t)n * k);
    int slice = k / parts;
    for (int p = 0; p < parts; p++)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double acc = 0;
                for (int t = p * slice; t < (p + 1) * slice; t++) acc += (double)x[(size_t)i * k + t] * w[(size_t)j * k + t];
                ref[((size_t)p * m + i) * n + j] = (float)acc;
            }
    void *dx = dev_upload(xb, (size_t)m * k * 2), *dw = dev_upload(wb, (size_t)n * k * 2);
    float *dout = dev_poisoned((size_t)parts * m * n * 4);
    pi0_error err = {0};
    gemm_args a = {.m = m, .n = n, .k = k, .x = dx, .w = dw, .out = dout, .out_f32 = 1, .alpha = 1, .k_parts = parts};
    CHECK(gemm_run(ctx, &a, 0, &err) == PI0_OK, "%s", err.message);
    CUDA_OK(cudaDeviceSynchronize());
    float *got = download_f32(dout, (size_t)parts * m * n);
    double e = rel_error(got, ref, (size_t)parts * m * n);
    CHECK(e <= 1e-4, "gemm k parts m %d n %d k %d parts %d: %.3g", m, n, k, parts, e);
    free(x), free(w), free(ref), free(xb), free(wb), free(got);
    cudaFree(dx), cudaFree(dw), cudaFree(dout);
}

/* The patch embedding as the engine runs it (kernels.h): im2col's bf16 pieces of n images of S x S in patches of p times
 * the weights' pieces (pi0_cuda_patch_weight_pieces), one bf16 GEMM, against a double loop over the float32 images and
 * weights. Within 1e-5, the bound cuBLASLt's float32 product was held to here: 6.5e-6 at SigLIP's shape on an H200
 * (bench/NOTES.md, session 41), the tensor cores' float32 accumulation over k = 3528, where a plain bf16 product is
 * ~2e-3 and one without x0 w1 or x1 w0 ~1.5e-3. Each of the three smallest products is ~2.5e-6 of the result, under
 * the accumulation's error: leaving one out would not fail here (test_cuda_limits and test_safetensors check the pieces
 * and their layout on the host). */
static void patch_embedding_case(gemm_context *ctx, int n, int S, int p, int dim) {
    int grid = S / p, P = grid * grid, rows = n * P, pd = 3 * p * p, k = PI0_PATCH_PIECES * pd;
    size_t image = (size_t)S * S * 3;
    float *images = malloc(n * image * 4), *w = malloc((size_t)dim * pd * 4), *ref = malloc((size_t)rows * dim * 4);
    fill_uniform(images, n * image, 1.0f), fill_uniform(w, (size_t)dim * pd, 1.0f / sqrtf((float)pd));
    float *pieces = pi0_cuda_patch_weight_pieces(w, (size_t)dim, (size_t)pd);
    REQUIRE(pieces != NULL, "out of memory");
    uint16_t *pieces_bf16 = to_bf16_rounding(pieces, (size_t)dim * k); /* exact: each is a bf16 value */
    for (int row = 0; row < rows; row++) {
        int i = row / P, py = row % P / grid, px = row % grid;
        for (int j = 0; j < dim; j++) {
            double acc = 0;
            for (int t = 0; t < pd; t++) {
                int c = t / (p * p), r = t / p % p, col = t % p;
                acc += (double)images[i * image + ((size_t)(py * p + r) * S + px * p + col) * 3 + c] * w[(size_t)j * pd + t];
            }
            ref[(size_t)row * dim + j] = (float)acc;
        }
    }
    float *dimg = dev_upload(images, n * image * 4), *dout = dev_poisoned((size_t)rows * dim * 4);
    pi0_bf16 *dpatches = dev_poisoned((size_t)rows * k * 2), *dw = dev_upload(pieces_bf16, (size_t)dim * k * 2);
    CUDA_OK(pi0_cuda_im2col(dpatches, dimg, n, S, p, NULL, 0));
    pi0_error err = {0};
    gemm_args a = {.m = rows, .n = dim, .k = k, .x = dpatches, .w = dw, .out = dout, .out_f32 = 1, .alpha = 1};
    CHECK(gemm_run(ctx, &a, 0, &err) == PI0_OK, "%s", err.message);
    CUDA_OK(cudaDeviceSynchronize());
    float *got = download_f32(dout, (size_t)rows * dim);
    double e = rel_error(got, ref, (size_t)rows * dim);
    fprintf(stderr, "patch embedding, %d images of %d in patches of %d, width %d: error %.3g\n", n, S, p, dim, e);
    CHECK(e <= 1e-5, "patch embedding, %d images of %d in patches of %d, width %d: %.3g", n, S, p, dim, e);
    free(images), free(w), free(ref), free(pieces), free(pieces_bf16), free(got);
    cudaFree(dimg), cudaFree(dout), cudaFree(dpatches), cudaFree(dw);
}

TEST(gemm_matches_cpu) {
    gemm_context ctx;
    pi0_error err = {0};
    REQUIRE(gemm_init(&ctx, &err) == PI0_OK, "%s", err.message);
    gemm_case(&ctx, 1, 32, 48, 0, 0, 0, 1, 0);
    gemm_case(&ctx, 11, 2560, 1024, 0, 0, 0, 1, 0);   /* expert QKV */
    gemm_case(&ctx, 257, 1000, 72, 1, 0, 0, 1, 0);    /* bias, bf16 out */
    gemm_case(&ctx, 129, 4304, 1152, 1, 1, 0, 1, 0);  /* ViT fc1: bias + gelu */
    gemm_case(&ctx, 531, 2048, 2048, 0, 0, 1, 1, 1);  /* residual accumulate */
    gemm_case(&ctx, 33, 1152, 1152, 1, 0, 1, 1, 1);   /* accumulate + f32 bias */
    gemm_case(&ctx, 50, 32, 1024, 1, 0, 1, -0.1f, 1); /* the fused Euler step */
    patch_embedding_case(&ctx, 2, 224, 14, 1152);     /* SigLIP's, two cameras */
    patch_embedding_case(&ctx, 3, 70, 14, 200);
    patch_embedding_case(&ctx, 1, 21, 7, 24);         /* k = 6 x 147: rows not 16-byte aligned */
    gemm_parts_case(&ctx, 37, 2048, 1024, 2);         /* the prefix's down projection, in partial sums */
    gemm_parts_case(&ctx, 5, 72, 48, 3);
    /* k parts need k in whole slices, float32 outputs and nothing added: refused otherwise */
    gemm_args bad = {.m = 4, .n = 8, .k = 10, .x = ctx.workspace, .w = ctx.workspace, .out = ctx.workspace, .out_f32 = 1,
                     .alpha = 1, .k_parts = 4};
    CHECK(gemm_run(&ctx, &bad, 0, &err) == PI0_ERR_BACKEND, "k 10 in 4 parts was not refused");
    bad.k = 16, bad.beta = 1;
    CHECK(gemm_run(&ctx, &bad, 0, &err) == PI0_ERR_BACKEND, "k parts with beta 1 were not refused");
    /* the algorithm cache answers a repeated shape */
    int cached = ctx.num_algos;
    gemm_case(&ctx, 11, 2560, 1024, 0, 0, 0, 1, 0);
    CHECK(ctx.num_algos == cached, "a repeated shape searched again");
    gemm_free(&ctx);
}

/* Uploads one axis's weights (when Pillow resamples along it) and points the job at them. */
static void upload_axis(int in, int out, const int **first, const int **count, const int32_t **weights, int *taps,
                        void **owned) {
    if (in == out) return;
    pi0_axis_weights k = {0};
    pi0_error err = {0};
    REQUIRE(pi0_axis_weights_init(&k, in, out, &err) == PI0_OK, "%s", err.message);
    *first = owned[0] = dev_upload(k.first, (size_t)out * sizeof(int));
    *count = owned[1] = dev_upload(k.count, (size_t)out * sizeof(int));
    *weights = owned[2] = dev_upload(k.weights, (size_t)out * k.max_taps * sizeof(int32_t));
    *taps = (int)k.max_taps;
    pi0_axis_weights_free(&k);
}

/* The device resize (frames -> model input) against model/image.c on the host, bit for bit: shrinking,
 * enlarging, thin frames, the model's own size (a copy), wide sums past int32's exact range (S = 2), and a
 * masked camera (zeros). Several frames in one launch, as a batch has. */
TEST(frames_to_images_equal_host) {
    const int cases[][3] = {{256, 256, 224}, {180, 320, 224}, {224, 224, 224}, {1, 1, 224}, {100, 60, 224},
                            {4096, 7, 224}, {3, 4096, 2}, {333, 1, 16}, {481, 641, 224}};
    int n = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i <= n; i++) { /* case n: a masked camera */
        int h = cases[i % n][0], w = cases[i % n][1], S = cases[i % n][2];
        size_t bytes = (size_t)h * w * 3, out = (size_t)S * S * 3;
        uint8_t *px = malloc(bytes);
        for (size_t k = 0; k < bytes; k++) px[k] = (uint8_t)((gpu_uniform() + 1.0f) * 127.99f);
        if (i < n / 2) /* flat regions and extremes as well as noise: Pillow's clip8 saturates at both ends */
            for (size_t k = 0; k < bytes; k++) px[k] = (k / 3) % 7 < 3 ? 255 * ((k / 97) & 1) : px[k];
        float *ref = malloc(out * sizeof(float)), *got = malloc(out * sizeof(float));
        pi0_image img = {.data = px, .type = PI0_PIXEL_U8, .layout = PI0_LAYOUT_HWC, .height = h, .width = w, .channels = 3};
        pi0_error err = {0};
        REQUIRE(pi0_image_preprocess(&img, S, ref, &err) == PI0_OK, "%s", err.message);
        pi0_frame_job job = {.height = h, .width = w};
        void *owned[7] = {NULL};
        pi0_resize_with_pad_geometry(h, w, S, S, &job.new_h, &job.new_w, &job.pad_y, &job.pad_x);
        upload_axis(w, job.new_w, &job.x_first, &job.x_count, &job.x_weights, &job.x_taps, owned);
        upload_axis(h, job.new_h, &job.y_first, &job.y_count, &job.y_weights, &job.y_taps, owned + 3);
        job.pixels = owned[6] = dev_upload(px, bytes);
        if (i == n) {
            job.pixels = NULL;
            memset(ref, 0, out * sizeof(float));
        }
        pi0_frame_job jobs[2] = {job, job};
        jobs[0].pixels = NULL; /* the first of two frames is masked: the second must not read its job */
        pi0_frame_job *djobs = dev_upload(jobs, sizeof jobs);
        float *dout = dev_poisoned(2 * out * sizeof(float));
        CUDA_OK(pi0_cuda_frames_to_images(dout, djobs, 2, S, 0));
        CUDA_OK(cudaDeviceSynchronize());
        CUDA_OK(cudaMemcpy(got, dout + out, out * sizeof(float), cudaMemcpyDeviceToHost));
        size_t at = 0;
        while (at < out && got[at] == ref[at]) at++;
        CHECK(at == out, "%dx%d -> %d%s: differs at (y %zu, x %zu, c %zu): %g, host %g", h, w, S, i == n ? " masked" : "",
              at / (S * 3), at / 3 % S, at % 3, at < out ? got[at] : 0, at < out ? ref[at] : 0);
        CUDA_OK(cudaMemcpy(got, dout, out * sizeof(float), cudaMemcpyDeviceToHost));
        for (at = 0; at < out && got[at] == 0.0f; at++) continue;
        CHECK(at == out, "the masked frame's image is not zeros");
        for (int k = 0; k < 7; k++) cudaFree(owned[k]);
        cudaFree(djobs), cudaFree(dout);
        free(px), free(ref), free(got);
    }
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    gpu_seed();
    RUN(layernorm_matches_cpu);
    RUN(rmsnorm_matches_cpu_with_row_map);
    RUN(rmsnorm_mod_and_gated_add_match_cpu);
    RUN(add_parts_rmsnorm_matches_cpu);
    RUN(gelu_mul_matches_cpu);
    RUN(gate_up_gelu_matches_cpu);
    RUN(rope_qkv_matches_cpu);
    RUN(frames_to_images_equal_host);
    RUN(im2col_and_bias_pos);
    RUN(assemble_prefix_and_suffix);
    RUN(linear_small_k_matches_cpu);
    RUN(action_time_in_matches_cpu);
    RUN(gemm_matches_cpu);
    return check_finish();
}
