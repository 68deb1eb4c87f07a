/*
 * layer_lab.c - what each kernel of one denoise layer costs inside a CUDA graph, the way the
 * engine runs it: each measured op is captured `reps` times in a row (cycling through `layers`
 * distinct weight sets, so that weights come from DRAM as they do across the expert's 18 layers),
 * the graph is replayed, and the time per op is the replay time / reps (launch gaps included).
 * Median, p90 and min over replays. Random inputs; only the timing matters here (the GPU tests
 * check the numbers). Two rows time the tiled attention at the seed workload's other shapes: the
 * prefix (532 tokens, Gemma's 8 heads over 1 K/V head) and the ViT (2 images of 256 tokens, 16 heads
 * of 72), and the last rows the prefix's at each forced key split.
 *
 * Usage: build/bench/layer_lab [--rows 11] [--keys 543] [--replays 30] [--sets 18] [--parts 4] [--only 1]
 * --sets N cycles N weight sets instead of 18 (--sets 1: every op's weights stay in L2, the layer without its DRAM
 * traffic); --parts N: the cuBLASLt path's o_proj and down as N partial sums that the next RMSNorm adds (the engine's
 * expert past the skinny rows, forward.c's stack_parts; 0: whole, added by the GEMM); --only 1 stops after the per-op
 * rows (no split sweeps).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/attention.h"
#include "cuda/gemm.h"
#include "cuda/kernels.h"
#include "cuda/skinny.h"
#include "lab.h"

#define LAYERS 18
#define REPS 36
#define WIDTH 1024
#define HEADS 8
#define HEAD_DIM 256
#define MLP 4096
#define QKV (HEADS * HEAD_DIM + 2 * HEAD_DIM)
#define PREFIX 532 /* the seed workload's prefix: 2 images of 256 tokens and a 20-token prompt */
#define VIT_TOKENS 256
#define VIT_HEADS 16
#define VIT_HEAD_DIM 72
#define VIT_WIDTH (VIT_HEADS * VIT_HEAD_DIM)

typedef struct {
    pi0_bf16 *qkv_w, *o_w, *gate_up_w, *down_w;
} layer_w;

typedef struct {
    int rows, keys;
    layer_w w[LAYERS];
    pi0_bf16 *x_bf16, *h, *qkv, *att, *mlp2, *mlp, *cache_k, *cache_v;
    float *x, *rope_cos, *rope_sin, *attn_ws;
    size_t attn_ws_bytes;
    int *pos, *cache_rows;
    attn_segment *segment;
    /* the prefix's attention (PREFIX tokens, Gemma's heads) and the ViT's (2 images of 256 tokens) */
    pi0_bf16 *prefix_qkv, *prefix_k, *prefix_v, *prefix_out, *vit_qkv, *vit_out;
    attn_segment *prefix_segment, *vit_segments;
    gemm_context gemm;
    cudaStream_t stream;
    int sets;  /* weight sets cycled through (--sets 1: every op's weights stay in L2) */
    int parts; /* the cuBLASLt path's o_proj and down as this many partial sums, added by the next norm (0: whole) */
} lab;

static void *random_bf16(size_t n, float scale) {
    uint16_t *h = malloc(n * 2);
    uint64_t s = n * 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        float v = scale * (float)((s >> 40) * (1.0 / 8388608.0) - 1.0);
        uint32_t b;
        memcpy(&b, &v, 4);
        h[i] = (uint16_t)(b >> 16);
    }
    void *d;
    CK(cudaMalloc(&d, n * 2));
    CK(cudaMemcpy(d, h, n * 2, cudaMemcpyHostToDevice));
    free(h);
    return d;
}

static void *zeros(size_t bytes) {
    void *d;
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemset(d, 0, bytes));
    return d;
}

typedef enum { OP_QKV, OP_QKV_ROPE, OP_O, OP_GATE_UP, OP_DOWN, OP_ROPE, OP_ATTENTION, OP_NORM, OP_GELU, OP_LAYER,
               OP_QKV_LT, OP_O_LT, OP_GATE_UP_LT, OP_DOWN_LT, OP_NORM_PARTS, OP_LAYER_LT, OP_ATTN_PREFIX, OP_ATTN_VIT,
               NUM_OPS } op;
static const char *op_names[NUM_OPS] = {
    "skinny QKV (norm)", "skinny QKV (norm, rope, cache)", "skinny o_proj (+res)", "skinny gate|up (norm, gelu)", "skinny down (+res)", "rope + cache",
    "attention", "rmsnorm", "gelu x up", "layer, skinny path", "cublasLt QKV", "cublasLt o_proj", "cublasLt gate|up",
    "cublasLt down", "rmsnorm adding the parts", "layer, cublasLt path", "attention, prefix (532 tokens)",
    "attention, ViT (2 x 256 tokens)"};
static const double op_bytes[NUM_OPS] = {2.0 * QKV * WIDTH, 2.0 * QKV * WIDTH, 2.0 * WIDTH * HEADS * HEAD_DIM, 4.0 * MLP * WIDTH,
                                         2.0 * WIDTH * MLP, 0, 0, 0, 0, 0, 2.0 * QKV * WIDTH, 2.0 * WIDTH * HEADS * HEAD_DIM,
                                         4.0 * MLP * WIDTH, 2.0 * WIDTH * MLP, 0, 0, 0, 0};

static void enqueue(lab *L, op o, int layer) {
    const layer_w *w = &L->w[layer];
    int m = L->rows;
    pi0_error err = {0};
    skinny_args qkv = {.m = m, .n = QKV, .k = WIDTH, .x = L->x_bf16, .w = w->qkv_w, .rms_norm = 1, .eps = 1e-6f,
                       .epilogue = SKINNY_STORE, .out = L->qkv};
    skinny_args qkv_rope = qkv;
    qkv_rope.epilogue = SKINNY_ROPE_QKV, qkv_rope.heads = HEADS, qkv_rope.kv_heads = 1, qkv_rope.head_dim = HEAD_DIM;
    qkv_rope.positions = L->pos, qkv_rope.cache_rows = L->cache_rows, qkv_rope.rope_cos = L->rope_cos;
    qkv_rope.rope_sin = L->rope_sin, qkv_rope.cache_k = L->cache_k, qkv_rope.cache_v = L->cache_v;
    const int narrow = m <= SKINNY_NARROW_MAX_ROWS ? SKINNY_NARROW_WARPS : 0; /* Pi0's o_proj and down, as forward.c */
    skinny_args o_proj = {.m = m, .n = WIDTH, .k = HEADS * HEAD_DIM, .x = L->att, .w = w->o_w,
                          .epilogue = SKINNY_RESIDUAL, .residual = L->x, .residual_bf16 = L->x_bf16, .max_warps = narrow};
    skinny_args gate_up = {.m = m, .n = 2 * MLP, .k = WIDTH, .x = L->x_bf16, .w = w->gate_up_w, .rms_norm = 1,
                           .eps = 1e-6f, .epilogue = SKINNY_GELU_MUL, .out = L->mlp};
    skinny_args down = {.m = m, .n = WIDTH, .k = MLP, .x = L->mlp, .w = w->down_w, .epilogue = SKINNY_RESIDUAL,
                        .residual = L->x, .residual_bf16 = L->x_bf16, .max_warps = narrow};
    gemm_args lt_qkv = {.m = m, .n = QKV, .k = WIDTH, .x = L->h, .w = w->qkv_w, .out = L->qkv, .alpha = 1};
    /* o_proj and down as the engine runs them here: partial sums in mlp2 (free between gelu x up and gate|up), or whole
     * into the residual stream */
    gemm_args lt_o = {.m = m, .n = WIDTH, .k = HEADS * HEAD_DIM, .x = L->att, .w = w->o_w, .out = L->x, .out_f32 = 1,
                      .alpha = 1, .beta = 1};
    gemm_args lt_gate_up = {.m = m, .n = 2 * MLP, .k = WIDTH, .x = L->h, .w = w->gate_up_w, .out = L->mlp2, .alpha = 1};
    gemm_args lt_down = {.m = m, .n = WIDTH, .k = MLP, .x = L->mlp, .w = w->down_w, .out = L->x, .out_f32 = 1,
                         .alpha = 1, .beta = 1};
    if (L->parts > 1) {
        lt_o.out = lt_down.out = L->mlp2, lt_o.beta = lt_down.beta = 0;
        lt_o.k_parts = lt_down.k_parts = L->parts;
    }
    cudaStream_t st = L->stream;
    switch (o) {
    case OP_QKV: CK(pi0_cuda_skinny_linear(&qkv, st)); break;
    case OP_QKV_ROPE: CK(pi0_cuda_skinny_linear(&qkv_rope, st)); break;
    case OP_O: CK(pi0_cuda_skinny_linear(&o_proj, st)); break;
    case OP_GATE_UP: CK(pi0_cuda_skinny_linear(&gate_up, st)); break;
    case OP_DOWN: CK(pi0_cuda_skinny_linear(&down, st)); break;
    case OP_ROPE:
        CK(pi0_cuda_rope_qkv(L->qkv, m, HEADS, 1, HEAD_DIM, L->pos, L->cache_rows, L->cache_k, L->cache_v, L->rope_cos,
                             L->rope_sin, st));
        break;
    case OP_ATTENTION:
        CK(pi0_cuda_attention_ws(L->att, HEADS * HEAD_DIM, L->qkv, QKV, L->cache_k, L->cache_v, HEAD_DIM, L->segment, 1,
                                 m, L->keys, HEADS, 1, HEAD_DIM, 1.0f / 16.0f, L->attn_ws, L->attn_ws_bytes, 0, st));
        break;
    case OP_NORM: CK(pi0_cuda_rmsnorm(L->h, L->x, NULL, m, WIDTH, NULL, 1e-6f, 0, st)); break;
    case OP_GELU: CK(pi0_cuda_gelu_mul(L->mlp, L->mlp2, m, MLP, st)); break;
    case OP_LAYER: {
        static const op seq[] = {OP_QKV_ROPE, OP_ATTENTION, OP_O, OP_GATE_UP, OP_DOWN};
        for (size_t i = 0; i < sizeof seq / sizeof seq[0]; i++) enqueue(L, seq[i], layer);
        break;
    }
    case OP_QKV_LT: (void)gemm_run(&L->gemm, &lt_qkv, st, &err); break;
    case OP_O_LT: (void)gemm_run(&L->gemm, &lt_o, st, &err); break;
    case OP_GATE_UP_LT: (void)gemm_run(&L->gemm, &lt_gate_up, st, &err); break;
    case OP_DOWN_LT: (void)gemm_run(&L->gemm, &lt_down, st, &err); break;
    case OP_NORM_PARTS:
        if (L->parts > 1)
            CK(pi0_cuda_add_parts_rmsnorm(L->h, L->x, (const float *)L->mlp2, L->parts, NULL, m, WIDTH, NULL, NULL, 1e-6f, 0,
                                          st));
        else CK(pi0_cuda_rmsnorm(L->h, L->x, NULL, m, WIDTH, NULL, 1e-6f, 0, st));
        break;
    case OP_LAYER_LT: {
        static const op seq[] = {OP_NORM_PARTS, OP_QKV_LT,      OP_ROPE, OP_ATTENTION, OP_O_LT,
                                 OP_NORM_PARTS, OP_GATE_UP_LT, OP_GELU, OP_DOWN_LT};
        for (size_t i = 0; i < sizeof seq / sizeof seq[0]; i++) enqueue(L, seq[i], layer);
        break;
    }
    case OP_ATTN_PREFIX:
        CK(pi0_cuda_attention_ws(L->prefix_out, HEADS * HEAD_DIM, L->prefix_qkv, QKV, L->prefix_k, L->prefix_v, HEAD_DIM,
                                 L->prefix_segment, 1, PREFIX, PREFIX, HEADS, 1, HEAD_DIM, 1.0f / 16.0f, L->attn_ws,
                                 L->attn_ws_bytes, 0, st));
        break;
    case OP_ATTN_VIT:
        CK(pi0_cuda_attention(L->vit_out, VIT_WIDTH, L->vit_qkv, 3 * VIT_WIDTH, L->vit_qkv + VIT_WIDTH,
                              L->vit_qkv + 2 * VIT_WIDTH, 3 * VIT_WIDTH, L->vit_segments, 2, VIT_TOKENS, VIT_HEADS,
                              VIT_HEADS, VIT_HEAD_DIM, 1.0f / sqrtf((float)VIT_HEAD_DIM), st));
        break;
    default: break;
    }
    if (err.status) {
        fprintf(stderr, "%s\n", err.message);
        exit(1);
    }
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static void measure(lab *L, op o, int replays, const char *label) {
    for (int i = 0; i < 2; i++) enqueue(L, o, i); /* eager warm-up: picks cuBLASLt algorithms outside capture */
    CK(cudaStreamSynchronize(L->stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CK(cudaStreamBeginCapture(L->stream, cudaStreamCaptureModeThreadLocal));
    for (int r = 0; r < REPS; r++) enqueue(L, o, r % L->sets);
    CK(cudaStreamEndCapture(L->stream, &graph));
    CK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t start, stop;
    CK(cudaEventCreate(&start));
    CK(cudaEventCreate(&stop));
    float *us = malloc(sizeof(float) * replays);
    for (int i = -3; i < replays; i++) {
        CK(cudaEventRecord(start, L->stream));
        CK(cudaGraphLaunch(exec, L->stream));
        CK(cudaEventRecord(stop, L->stream));
        CK(cudaEventSynchronize(stop));
        float ms;
        CK(cudaEventElapsedTime(&ms, start, stop));
        if (i >= 0) us[i] = 1000.0f * ms / REPS;
    }
    qsort(us, replays, sizeof *us, cmp_float);
    float med = us[replays / 2];
    printf("%-30s %8.2f %8.2f %8.2f", label ? label : op_names[o], med, us[replays * 9 / 10], us[0]);
    if (op_bytes[o] > 0) printf(" %8.2f", op_bytes[o] / (med * 1e-6) / 1e12);
    printf("\n");
    free(us);
    CK(cudaEventDestroy(start));
    CK(cudaEventDestroy(stop));
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
}

int main(int argc, char **argv) {
    lab L = {.rows = 11, .keys = 543, .sets = LAYERS, .parts = 4};
    int replays = 30, only = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--rows")) L.rows = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--keys")) L.keys = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--replays")) replays = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--sets")) L.sets = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--only")) only = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--parts")) L.parts = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "usage: layer_lab [--rows N] [--keys N] [--replays N] [--sets N] [--parts N] [--only 1]\n");
            return 2;
        }
    }
    if (L.rows < 1 || L.rows > 64 || L.keys < L.rows || replays < 1 || L.sets < 1 || L.sets > LAYERS || L.parts < 0 ||
        (L.parts > 1 && (MLP / WIDTH < L.parts || (HEADS * HEAD_DIM) % L.parts || MLP % L.parts ||
                         !pi0_cuda_add_parts_rmsnorm_fits(WIDTH, L.parts)))) {
        fprintf(stderr, "layer_lab: rows 1..64, keys >= rows, replays >= 1, sets 1..%d, parts 0..%d dividing %d and %d\n",
                LAYERS, MLP / WIDTH, HEADS * HEAD_DIM, MLP);
        return 2;
    }
    CK(cudaStreamCreateWithFlags(&L.stream, cudaStreamNonBlocking));
    pi0_error err = {0};
    if (gemm_init(&L.gemm, &err)) {
        fprintf(stderr, "%s\n", err.message);
        return 1;
    }
    for (int l = 0; l < LAYERS; l++) {
        L.w[l].qkv_w = random_bf16((size_t)QKV * WIDTH, 0.03f);
        L.w[l].o_w = random_bf16((size_t)WIDTH * HEADS * HEAD_DIM, 0.02f);
        L.w[l].gate_up_w = random_bf16((size_t)2 * MLP * WIDTH, 0.03f);
        L.w[l].down_w = random_bf16((size_t)WIDTH * MLP, 0.015f);
    }
    int m = L.rows;
    L.x = zeros((size_t)m * WIDTH * 4);
    L.x_bf16 = random_bf16((size_t)m * WIDTH, 1.0f);
    L.h = random_bf16((size_t)m * WIDTH, 1.0f);
    L.qkv = random_bf16((size_t)m * QKV, 1.0f);
    L.att = random_bf16((size_t)m * HEADS * HEAD_DIM, 1.0f);
    L.mlp2 = random_bf16((size_t)m * 2 * MLP, 1.0f);
    L.mlp = random_bf16((size_t)m * MLP, 1.0f);
    L.cache_k = random_bf16((size_t)L.keys * HEAD_DIM, 1.0f);
    L.cache_v = random_bf16((size_t)L.keys * HEAD_DIM, 1.0f);
    float *tab = malloc(sizeof(float) * 4096 * HEAD_DIM / 2);
    for (int i = 0; i < 4096 * HEAD_DIM / 2; i++) tab[i] = 0.5f;
    L.rope_cos = zeros(sizeof(float) * 4096 * HEAD_DIM / 2), L.rope_sin = zeros(sizeof(float) * 4096 * HEAD_DIM / 2);
    CK(cudaMemcpy(L.rope_cos, tab, sizeof(float) * 4096 * HEAD_DIM / 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(L.rope_sin, tab, sizeof(float) * 4096 * HEAD_DIM / 2, cudaMemcpyHostToDevice));
    free(tab);
    int *pos = malloc(sizeof(int) * m), *rows = malloc(sizeof(int) * m);
    for (int i = 0; i < m; i++) pos[i] = L.keys - m + i, rows[i] = L.keys - m + i;
    L.pos = zeros(sizeof(int) * m), L.cache_rows = zeros(sizeof(int) * m);
    CK(cudaMemcpy(L.pos, pos, sizeof(int) * m, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(L.cache_rows, rows, sizeof(int) * m, cudaMemcpyHostToDevice));
    free(pos), free(rows);
    attn_segment seg = {0, m, 0, L.keys, L.keys - m + 1}; /* the state token sees the prefix and itself */
    L.segment = zeros(sizeof seg);
    L.attn_ws_bytes = pi0_cuda_attention_workspace(1, 1, HEAD_DIM);
    L.attn_ws = zeros(L.attn_ws_bytes);
    CK(cudaMemcpy(L.segment, &seg, sizeof seg, cudaMemcpyHostToDevice));
    L.prefix_qkv = random_bf16((size_t)PREFIX * QKV, 1.0f);
    L.prefix_k = random_bf16((size_t)PREFIX * HEAD_DIM, 1.0f), L.prefix_v = random_bf16((size_t)PREFIX * HEAD_DIM, 1.0f);
    L.prefix_out = zeros((size_t)PREFIX * HEADS * HEAD_DIM * 2);
    const attn_segment prefix_seg = {0, PREFIX, 0, PREFIX, 0};
    L.prefix_segment = zeros(sizeof prefix_seg);
    CK(cudaMemcpy(L.prefix_segment, &prefix_seg, sizeof prefix_seg, cudaMemcpyHostToDevice));
    L.vit_qkv = random_bf16((size_t)2 * VIT_TOKENS * 3 * VIT_WIDTH, 1.0f);
    L.vit_out = zeros((size_t)2 * VIT_TOKENS * VIT_WIDTH * 2);
    const attn_segment vit_segs[2] = {{0, VIT_TOKENS, 0, VIT_TOKENS, 0}, {VIT_TOKENS, VIT_TOKENS, VIT_TOKENS, VIT_TOKENS, 0}};
    L.vit_segments = zeros(sizeof vit_segs);
    CK(cudaMemcpy(L.vit_segments, vit_segs, sizeof vit_segs, cudaMemcpyHostToDevice));

    printf("rows %d, keys %d, %d ops per graph over %d weight sets, %d replays; the cuBLASLt path's o_proj and down %s\n", m,
           L.keys, REPS, L.sets, replays, L.parts > 1 ? "in partial sums (--parts)" : "whole");
    printf("%-30s %8s %8s %8s %8s\n", "op (us per op, in a graph)", "median", "p90", "min", "TB/s");
    for (op o = 0; o < NUM_OPS; o++) measure(&L, o, replays, NULL);
    if (only) return 0;
    /* the tiled attention's fixed cost and its key split: fewer keys, each split forced (a forced split
     * also turns the few-queries kernels off) */
    const int keys[] = {64, L.keys};
    for (int i = 0; i < 2; i++) {
        seg.num_k = keys[i], seg.state_keys = keys[i] - m + 1;
        CK(cudaMemcpy(L.segment, &seg, sizeof seg, cudaMemcpyHostToDevice));
        for (int split = 1; split <= 16; split *= 2) {
            char label[64];
            snprintf(label, sizeof label, "attention %d keys, split %d", keys[i], split);
            pi0_cuda_attention_set_split(split);
            measure(&L, OP_ATTENTION, replays, label);
        }
    }
    for (int split = 1; split <= 8; split *= 2) { /* the prefix's attention at each split */
        char label[64];
        snprintf(label, sizeof label, "attention, prefix, split %d", split);
        pi0_cuda_attention_set_split(split);
        measure(&L, OP_ATTN_PREFIX, replays, label);
    }
    pi0_cuda_attention_set_split(0);
    return 0;
}
