#include "cuda/gemm.h"

#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/kernels.h"
#include "util/error.h"
#include "util/switches.h"

#define WORKSPACE_BYTES (32u << 20)
#define TUNE_CANDIDATES 10
#define TUNE_REPS 20
#define TUNE_ROUNDS 2
#define TUNE_SPIN_US 400

struct gemm_algo_entry {
    int m, n, k, flags;
    cublasLtMatmulAlgo_t algo;
};

pi0_status gemm_init(gemm_context *ctx, pi0_error *err) {
    memset(ctx, 0, sizeof *ctx);
    cublasStatus_t s = cublasLtCreate(&ctx->lt);
    if (s != CUBLAS_STATUS_SUCCESS) return pi0_fail(err, PI0_ERR_BACKEND, "cublasLtCreate: %s", cublasLtGetStatusString(s));
    if (cudaMalloc(&ctx->workspace, WORKSPACE_BYTES) != cudaSuccess) {
        cublasLtDestroy(ctx->lt);
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate the cuBLASLt workspace");
    }
    ctx->workspace_size = WORKSPACE_BYTES;
    ctx->tune = !switched_off("PI0_GEMM_TUNE"); /* "0": take the heuristic's pick, for a faster first call */
    return PI0_OK;
}

pi0_status gemm_side(gemm_context *ctx, cudaStream_t side, pi0_error *err) {
    if (cudaMalloc(&ctx->side_workspace, ctx->workspace_size) != cudaSuccess) {
        cudaGetLastError();
        ctx->side_workspace = NULL;
        return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "cannot allocate the side stream's cuBLASLt workspace");
    }
    ctx->side = side;
    return PI0_OK;
}

void gemm_free(gemm_context *ctx) {
    if (ctx->workspace) cudaFree(ctx->workspace);
    if (ctx->side_workspace) cudaFree(ctx->side_workspace);
    if (ctx->lt) cublasLtDestroy(ctx->lt);
    if (ctx->scratch) cudaFree(ctx->scratch);
    free(ctx->algos);
    memset(ctx, 0, sizeof *ctx);
}

static int parts(const gemm_args *a) { return a->k_parts > 1 ? a->k_parts : 1; }

/* Everything about a call that changes the algorithm choice, in one int. */
static int gemm_flags(const gemm_args *a) {
    return (a->out_f32 << 0) | ((a->bias != NULL) << 1) | (a->gelu << 2) | ((a->beta != 0) << 3) | (parts(a) << 4);
}

static const cublasLtMatmulAlgo_t *cached_algo(const gemm_context *ctx, const gemm_args *a) {
    int flags = gemm_flags(a);
    for (int i = 0; i < ctx->num_algos; i++) {
        const gemm_algo_entry *e = &ctx->algos[i];
        if (e->m == a->m && e->n == a->n && e->k == a->k && e->flags == flags) return &e->algo;
    }
    return NULL;
}

static int cache_algo(gemm_context *ctx, const gemm_args *a, const cublasLtMatmulAlgo_t *algo) {
    if (ctx->num_algos == ctx->cap_algos) {
        int cap = ctx->cap_algos ? 2 * ctx->cap_algos : 64;
        gemm_algo_entry *grown = realloc(ctx->algos, (size_t)cap * sizeof *grown);
        if (!grown) return -1;
        ctx->algos = grown, ctx->cap_algos = cap;
    }
    ctx->algos[ctx->num_algos++] = (gemm_algo_entry){a->m, a->n, a->k, gemm_flags(a), *algo};
    return 0;
}

typedef struct {
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t w, x, out;
} gemm_descs;

static void descs_free(gemm_descs *d) {
    if (d->op) cublasLtMatmulDescDestroy(d->op);
    if (d->w) cublasLtMatrixLayoutDestroy(d->w);
    if (d->x) cublasLtMatrixLayoutDestroy(d->x);
    if (d->out) cublasLtMatrixLayoutDestroy(d->out);
}

static cublasStatus_t descs_make(gemm_descs *d, const gemm_args *a) {
    cudaDataType_t in_type = CUDA_R_16BF, out_type = a->out_f32 ? CUDA_R_32F : CUDA_R_16BF;
    cublasOperation_t transpose = CUBLAS_OP_T, none = CUBLAS_OP_N;
    cublasLtEpilogue_t epilogue = a->bias ? (a->gelu ? CUBLASLT_EPILOGUE_GELU_BIAS : CUBLASLT_EPILOGUE_BIAS)
                                          : CUBLASLT_EPILOGUE_DEFAULT;
    cublasStatus_t s;
    memset(d, 0, sizeof *d);
    if ((s = cublasLtMatmulDescCreate(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F)) ||
        (s = cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose, sizeof transpose)) ||
        (s = cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &none, sizeof none)) ||
        (s = cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue)))
        return s;
    if (a->bias && (s = cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &a->bias, sizeof a->bias)))
        return s;
    /* column-major: w^T is (k, n) with ld k, x^T is (k, m) with ld k, out^T is (n, m) with ld n; with k_parts, a
     * strided batch over the slices of k (the rows of w^T and x^T) into consecutive outputs */
    const int p = parts(a), slice = a->k / p;
    if ((s = cublasLtMatrixLayoutCreate(&d->w, in_type, (uint64_t)slice, (uint64_t)a->n, a->k)) ||
        (s = cublasLtMatrixLayoutCreate(&d->x, in_type, (uint64_t)slice, (uint64_t)a->m, a->k)) ||
        (s = cublasLtMatrixLayoutCreate(&d->out, out_type, (uint64_t)a->n, (uint64_t)a->m, a->n)))
        return s;
    if (p > 1) {
        const int64_t w_step = slice, out_step = (int64_t)a->m * a->n;
        cublasLtMatrixLayout_t batched[3] = {d->w, d->x, d->out};
        const int64_t steps[3] = {w_step, w_step, out_step};
        for (int i = 0; i < 3; i++)
            if ((s = cublasLtMatrixLayoutSetAttribute(batched[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &p, sizeof p)) ||
                (s = cublasLtMatrixLayoutSetAttribute(batched[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &steps[i],
                                                      sizeof steps[i])))
                return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}

static int capturing(cudaStream_t stream) {
    enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    cudaStreamIsCapturing(stream, &status);
    return status != cudaStreamCaptureStatusNone;
}

static void *scratch_for(gemm_context *ctx, size_t bytes) {
    if (bytes > ctx->scratch_size) {
        if (ctx->scratch) cudaFree(ctx->scratch);
        ctx->scratch_size = 0;
        if (cudaMalloc(&ctx->scratch, bytes) != cudaSuccess) {
            cudaGetLastError();
            ctx->scratch = NULL;
            return NULL;
        }
        cudaMemset(ctx->scratch, 0, bytes);
        ctx->scratch_size = bytes;
    }
    return ctx->scratch;
}

/* out = the call's product by `algo` (out is the call's own output, or the tuner's scratch). */
static cublasStatus_t matmul(gemm_context *ctx, const gemm_descs *d, const gemm_args *a, const cublasLtMatmulAlgo_t *algo,
                             void *out, cudaStream_t stream) {
    void *workspace = ctx->side_workspace && stream == ctx->side ? ctx->side_workspace : ctx->workspace;
    return cublasLtMatmul(ctx->lt, d->op, &a->alpha, a->w, d->w, a->x, d->x, &a->beta, out, d->out, out, d->out, algo,
                          workspace, ctx->workspace_size, stream);
}

/* Mean GPU time of TUNE_REPS runs of one candidate into `out`, or a negative value if it fails. One untimed run
 * first: CUDA loads a kernel's module at its first launch (lazy loading), 0.1-1 ms that landed in the timed runs and
 * made the tuner's picks all but random (bench/NOTES.md, session 16). The spin then covers the host's launches. */
static float time_candidate(gemm_context *ctx, const gemm_descs *d, const gemm_args *a, const cublasLtMatmulAlgo_t *algo,
                            void *out, cudaStream_t stream, cudaEvent_t start, cudaEvent_t stop) {
    float ms = -1;
    if (matmul(ctx, d, a, algo, out, stream)) return -1;
    if (pi0_cuda_spin(TUNE_SPIN_US, stream) != cudaSuccess) return -1;
    cudaEventRecord(start, stream);
    for (int r = 0; r < TUNE_REPS; r++)
        if (matmul(ctx, d, a, algo, out, stream)) return -1;
    cudaEventRecord(stop, stream);
    if (cudaEventSynchronize(stop) != cudaSuccess || cudaEventElapsedTime(&ms, start, stop) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return ms / TUNE_REPS;
}

/* The fastest of cuBLASLt's candidates for this call, timed on scratch (each candidate's best of TUNE_ROUNDS rounds,
 * the rounds interleaved so that a slow moment of the GPU does not decide); or its first pick when timing is not
 * possible (under capture, or out of scratch memory). */
static cublasStatus_t find_algo(gemm_context *ctx, const gemm_descs *d, const gemm_args *a, cudaStream_t stream,
                                cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t results[TUNE_CANDIDATES];
    int found = 0;
    cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref);
    if (s) return s;
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ctx->workspace_size,
                                             sizeof ctx->workspace_size);
    if (!s)
        s = cublasLtMatmulAlgoGetHeuristic(ctx->lt, d->op, d->w, d->x, d->out, d->out, pref, TUNE_CANDIDATES, results,
                                           &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (!s && found == 0) s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (s) return s;
    *algo = results[0].algo;
    void *out = NULL;
    if (found == 1 || !ctx->tune || capturing(stream) ||
        !(out = scratch_for(ctx, (size_t)a->m * a->n * (a->out_f32 ? 4 : 2) * parts(a))))
        return CUBLAS_STATUS_SUCCESS;
    cudaEvent_t start, stop;
    if (cudaEventCreate(&start) != cudaSuccess) return CUBLAS_STATUS_SUCCESS;
    if (cudaEventCreate(&stop) != cudaSuccess) {
        cudaEventDestroy(start);
        return CUBLAS_STATUS_SUCCESS;
    }
    float time[TUNE_CANDIDATES], best = -1; /* each candidate's best, -1 while it has none */
    for (int i = 0; i < found; i++) time[i] = -1;
    for (int round = 0; round < TUNE_ROUNDS; round++)
        for (int i = 0; i < found; i++) {
            float ms = time_candidate(ctx, d, a, &results[i].algo, out, stream, start, stop);
            if (ms > 0 && (time[i] < 0 || ms < time[i])) time[i] = ms;
        }
    for (int i = 0; i < found; i++)
        if (time[i] > 0 && (best < 0 || time[i] < best)) best = time[i], *algo = results[i].algo;
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    return CUBLAS_STATUS_SUCCESS;
}

pi0_status gemm_run(gemm_context *ctx, const gemm_args *a, cudaStream_t stream, pi0_error *err) {
    if (a->m == 0) return PI0_OK;
    if (parts(a) > 1 && (a->k % parts(a) || !a->out_f32 || a->beta != 0 || a->bias || a->gelu))
        return pi0_fail(err, PI0_ERR_BACKEND, "GEMM k parts: k %d in %d parts needs float32 output, no bias, beta 0",
                        a->k, parts(a));
    gemm_descs d;
    cublasLtMatmulAlgo_t algo;
    cublasStatus_t s = descs_make(&d, a);
    const cublasLtMatmulAlgo_t *known = s ? NULL : cached_algo(ctx, a);
    if (!s && !known) {
        s = find_algo(ctx, &d, a, stream, &algo);
        if (!s && cache_algo(ctx, a, &algo)) s = CUBLAS_STATUS_ALLOC_FAILED;
        known = &algo;
    }
    if (!s) s = matmul(ctx, &d, a, known, a->out, stream);
    descs_free(&d);
    if (s)
        return pi0_fail(err, PI0_ERR_BACKEND, "cuBLASLt matmul (m %d, n %d, k %d%s%s): %s", a->m, a->n, a->k,
                        a->bias ? ", bias" : "", a->gelu ? ", gelu" : "", cublasLtGetStatusString(s));
    return PI0_OK;
}
