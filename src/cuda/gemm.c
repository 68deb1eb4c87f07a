#include "cuda/gemm.h"

#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "util/error.h"

#define WORKSPACE_BYTES (32u << 20)

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
    return PI0_OK;
}

void gemm_free(gemm_context *ctx) {
    if (ctx->workspace) cudaFree(ctx->workspace);
    if (ctx->lt) cublasLtDestroy(ctx->lt);
    free(ctx->algos);
    memset(ctx, 0, sizeof *ctx);
}

/* Everything about a call that changes the algorithm choice, in one int. */
static int gemm_flags(const gemm_args *a) {
    return (a->out_f32 << 0) | ((a->bias != NULL) << 1) | (a->gelu << 2) | (a->f32_inputs << 3) | ((a->beta != 0) << 4);
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
    cudaDataType_t in_type = a->f32_inputs ? CUDA_R_32F : CUDA_R_16BF, out_type = a->out_f32 ? CUDA_R_32F : CUDA_R_16BF;
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
    /* column-major: w^T is (k, n) with ld k, x^T is (k, m) with ld k, out^T is (n, m) with ld n */
    if ((s = cublasLtMatrixLayoutCreate(&d->w, in_type, (uint64_t)a->k, (uint64_t)a->n, a->k)) ||
        (s = cublasLtMatrixLayoutCreate(&d->x, in_type, (uint64_t)a->k, (uint64_t)a->m, a->k)) ||
        (s = cublasLtMatrixLayoutCreate(&d->out, out_type, (uint64_t)a->n, (uint64_t)a->m, a->n)))
        return s;
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t find_algo(gemm_context *ctx, const gemm_descs *d, cublasLtMatmulAlgo_t *algo) {
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    cublasStatus_t s = cublasLtMatmulPreferenceCreate(&pref);
    if (s) return s;
    s = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ctx->workspace_size,
                                             sizeof ctx->workspace_size);
    if (!s) s = cublasLtMatmulAlgoGetHeuristic(ctx->lt, d->op, d->w, d->x, d->out, d->out, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (!s && found == 0) s = CUBLAS_STATUS_NOT_SUPPORTED;
    if (!s) *algo = result.algo;
    return s;
}

pi0_status gemm_run(gemm_context *ctx, const gemm_args *a, cudaStream_t stream, pi0_error *err) {
    if (a->m == 0) return PI0_OK;
    gemm_descs d;
    cublasLtMatmulAlgo_t algo;
    cublasStatus_t s = descs_make(&d, a);
    const cublasLtMatmulAlgo_t *known = s ? NULL : cached_algo(ctx, a);
    if (!s && !known) {
        s = find_algo(ctx, &d, &algo);
        if (!s && cache_algo(ctx, a, &algo)) s = CUBLAS_STATUS_ALLOC_FAILED;
        known = &algo;
    }
    if (!s)
        s = cublasLtMatmul(ctx->lt, d.op, &a->alpha, a->w, d.w, a->x, d.x, &a->beta, a->out, d.out, a->out, d.out, known,
                           ctx->workspace, ctx->workspace_size, stream);
    descs_free(&d);
    if (s)
        return pi0_fail(err, PI0_ERR_BACKEND, "cuBLASLt matmul (m %d, n %d, k %d%s%s): %s", a->m, a->n, a->k,
                        a->bias ? ", bias" : "", a->gelu ? ", gelu" : "", cublasLtGetStatusString(s));
    return PI0_OK;
}
