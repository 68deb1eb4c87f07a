/*
 * test_cuda_limits.c - what the CUDA backend refuses at load time (src/cuda/limits.h), checked without a GPU:
 * the dims its kernels take pass (Pi0's, Pi0.5's, odd widths, MLP sizes and head counts, every head_dim that
 * is a multiple of 8 up to 256), the others are refused with a message naming the dimension and the limit,
 * the cuda backend refuses such a model before anything else (with or without a GPU), and the auto backend
 * gives it to the CPU. And the dims-only choice of the skinny Linears (pi0_cuda_skinny_block_supported) is
 * exactly "all four Linears of the block take them", and their launches' shared memory (staged passes included) stays
 * within 48 KB; the fused gate|up kernel's shape choice keeps to the shapes it
 * was measured faster at; the patch embedding's weights in bf16 pieces (kernels.h) are laid out as its GEMM pairs them
 * with the patches' and sum to the float32 weights exactly. A build without the CUDA backend runs the API test only
 * (its refusal is another).
 */
#include "check.h"
#include "pi0.h"
#ifdef PI0_WITH_CUDA
#include "cuda/gate_up.h"
#include "cuda/kernels.h"
#include "cuda/limits.h"
#include "cuda/skinny.h"
#include "util/half.h"
#endif

/* A small model that every backend runs: 4 image tokens of 28 x 28 images, depth 1. */
static pi0_dims small_dims(pi0_model_kind kind) {
    pi0_dims d = {0};
    d.kind = kind;
    d.vision = (pi0_stack_dims){48, 1, 100, 2, 2, 24};
    d.patch_size = 14, d.image_size = 28;
    d.llm = (pi0_stack_dims){100, 1, 300, 3, 1, 40};
    d.expert = (pi0_stack_dims){60, 1, 150, 3, 1, 40};
    d.vocab_size = 300, d.action_dim = 32, d.action_horizon = 10, d.max_token_len = 16;
    return d;
}

#ifdef PI0_WITH_CUDA
/* pi0_cuda_check_dims refuses d with a message holding every one of `words`. */
static void expect_refused(const pi0_dims *d, const char *const *words, int num_words) {
    pi0_error err = {0};
    pi0_status st = pi0_cuda_check_dims(d, &err);
    CHECK(st == PI0_ERR_BACKEND, "status %d (%s)", (int)st, err.message);
    for (int i = 0; i < num_words; i++) CHECK(strstr(err.message, words[i]), "\"%s\" not in: %s", words[i], err.message);
    fprintf(stderr, "  refused: %s\n", err.message);
}

TEST(accepts_what_the_gpu_runs) {
    pi0_error err = {0};
    pi0_dims real[] = {pi0_dims_pi0(), pi0_dims_pi05()};
    for (int i = 0; i < 2; i++) CHECK(pi0_cuda_check_dims(&real[i], &err) == PI0_OK, "%s", err.message);
    for (int kind = PI0_MODEL_PI0; kind <= PI0_MODEL_PI05; kind++)
        for (int hd = 8; hd <= 256; hd += 8) {
            pi0_dims d = small_dims((pi0_model_kind)kind);
            d.vision.head_dim = hd, d.vision.width = 2 * hd;
            d.llm.head_dim = d.expert.head_dim = hd;
            CHECK(pi0_cuda_check_dims(&d, &err) == PI0_OK, "%s head_dim %d: %s", pi0_model_kind_name(d.kind), hd,
                  err.message);
        }
    pi0_dims wide = small_dims(PI0_MODEL_PI05);
    wide.expert.width = 12288; /* the time conditioning's limit, exactly */
    CHECK(pi0_cuda_check_dims(&wide, &err) == PI0_OK, "%s", err.message);
}

TEST(refuses_with_dimension_and_limit) {
    pi0_dims d = small_dims(PI0_MODEL_PI0);
    d.vision.head_dim = 20, d.vision.width = 40;
    expect_refused(&d, (const char *const[]){"vision", "head_dim is 20", "multiples of 8 up to 256"}, 3);
    d = small_dims(PI0_MODEL_PI0);
    d.llm.head_dim = d.expert.head_dim = 100;
    expect_refused(&d, (const char *const[]){"LLM", "head_dim is 100", "multiples of 8 up to 256"}, 3);
    d.llm.head_dim = d.expert.head_dim = 264;
    expect_refused(&d, (const char *const[]){"LLM", "head_dim is 264", "up to 256"}, 3);
    d = small_dims(PI0_MODEL_PI05);
    d.expert.width = 12296;
    expect_refused(&d, (const char *const[]){"width is 12296", "12288"}, 2);
    d.kind = PI0_MODEL_PI0; /* Pi0's time MLP takes the action dims, not the width */
    pi0_error err = {0};
    CHECK(pi0_cuda_check_dims(&d, &err) == PI0_OK, "%s", err.message);
}

/* Whether pi0_cuda_skinny_supported takes the four Linears of forward.c's gemma_block_skinny for an 11-row
 * denoise step of these dims, with buffers at 256-byte boundaries as the backend carves them and Pi0.5's
 * in_scale row of norm n = 3 (an offset of 3 widths). No GPU is touched: the check only reads arguments. */
static int skinny_block_runs(int W, int mlp, int heads, int kv_heads, int hd) {
    pi0_bf16 *buf = (pi0_bf16 *)(uintptr_t)0x100000, *scale = buf + 3 * W;
    const int rows[11] = {0};
    const float *table = (const float *)buf;
    int q_dim = heads * hd, qkv_dim = (heads + 2 * kv_heads) * hd;
    skinny_args qkv = {.m = 11, .n = qkv_dim, .k = W, .x = buf, .w = buf, .rms_norm = 1, .in_scale = scale,
                       .epilogue = SKINNY_ROPE_QKV, .out = buf, .heads = heads, .kv_heads = kv_heads, .head_dim = hd,
                       .positions = rows, .cache_rows = rows, .rope_cos = table, .rope_sin = table, .cache_k = buf,
                       .cache_v = buf};
    skinny_args o = {.m = 11, .n = W, .k = q_dim, .x = buf, .w = buf, .epilogue = SKINNY_RESIDUAL,
                     .residual = (float *)buf, .residual_bf16 = buf};
    skinny_args gate_up = {.m = 11, .n = 2 * mlp, .k = W, .x = buf, .w = buf, .rms_norm = 1, .in_scale = scale,
                           .epilogue = SKINNY_GELU_MUL, .out = buf};
    skinny_args down = {.m = 11, .n = W, .k = mlp, .x = buf, .w = buf, .epilogue = SKINNY_RESIDUAL,
                        .residual = (float *)buf, .residual_bf16 = buf};
    return pi0_cuda_skinny_supported(&qkv) && pi0_cuda_skinny_supported(&o) && pi0_cuda_skinny_supported(&gate_up) &&
           pi0_cuda_skinny_supported(&down);
}

TEST(skinny_block_choice_is_exact) {
    static const int widths[] = {48, 60, 64, 100, 1024}, mlps[] = {96, 150, 128, 300, 4096}, heads[][2] = {{8, 1}, {3, 1}, {4, 2}};
    for (int w = 0; w < 5; w++)
        for (int m = 0; m < 5; m++)
            for (int h = 0; h < 3; h++)
                for (int hd = 8; hd <= 256; hd += 8) {
                    int dims_say = pi0_cuda_skinny_block_supported(widths[w], mlps[m], hd);
                    int args_say = skinny_block_runs(widths[w], mlps[m], heads[h][0], heads[h][1], hd);
                    CHECK(dims_say == args_say, "width %d, mlp %d, %d/%d heads x %d: dims say %d, arguments say %d",
                          widths[w], mlps[m], heads[h][0], heads[h][1], hd, dims_say, args_say);
                }
    CHECK(pi0_cuda_skinny_block_supported(1024, 4096, 256), "Pi0's expert");
}

/* The skinny Linears' staged passes (skinny.cu): Pi0's expert stages the second pass of down (8 warps) and gate|up (4
 * warps) and nothing of QKV or o_proj (one pass each), Pi0.5's scaled gate|up and two row tiles nothing; and at any shape
 * a launch's shared memory, the warps' partials with the staged passes, stays within the 48 KB a block has without
 * opting in (a cap of 40 KB on the staged bytes alone let RoPE's blocks at 10 warps ask for 50.9 KB). */
TEST(skinny_staged_passes_fit) {
    static pi0_bf16 buf[8], scale[8];
    skinny_args down = {.m = 11, .n = 1024, .k = 4096, .x = buf, .w = buf, .epilogue = SKINNY_RESIDUAL,
                        .residual = (float *)buf, .residual_bf16 = buf, .max_warps = SKINNY_NARROW_WARPS};
    skinny_args gate_up = {.m = 11, .n = 8192, .k = 1024, .x = buf, .w = buf, .rms_norm = 1, .epilogue = SKINNY_GELU_MUL,
                           .out = buf};
    skinny_args o_proj = down, qkv = gate_up;
    o_proj.k = 2048;
    qkv.n = 2560, qkv.epilogue = SKINNY_ROPE_QKV;
    int staged = -1;
    size_t bytes = pi0_cuda_skinny_shared_bytes(&down, &staged);
    CHECK(staged == 1 && bytes == 8 * 16 * 9 * 4 + 8 * 8 * 32 * 16, "down: %d staged, %zu bytes", staged, bytes);
    bytes = pi0_cuda_skinny_shared_bytes(&gate_up, &staged);
    CHECK(staged == 1 && bytes == 4 * 16 * 17 * 4 + 4 * 4 * 2 * 32 * 16, "gate|up: %d staged, %zu bytes", staged, bytes);
    pi0_cuda_skinny_shared_bytes(&o_proj, &staged);
    CHECK(staged == 0, "o_proj: %d staged", staged);
    pi0_cuda_skinny_shared_bytes(&qkv, &staged);
    CHECK(staged == 0, "QKV: %d staged", staged);
    skinny_args scaled = gate_up, two_tiles = gate_up;
    scaled.in_scale = scale;
    two_tiles.m = 22;
    pi0_cuda_skinny_shared_bytes(&scaled, &staged);
    CHECK(staged == 0, "Pi0.5's scaled gate|up: %d staged", staged);
    pi0_cuda_skinny_shared_bytes(&two_tiles, &staged);
    CHECK(staged == 0, "two row tiles: %d staged", staged);
    static const int ms[] = {1, 11, 16, 17, 32}, warps[] = {0, 4, 8, 10, 12};
    int most_staged = 0;
    for (int rope = 0; rope < 2; rope++) /* RoPE's blocks take two n8 tiles of four chunks at any k */
        for (int mi = 0; mi < 5; mi++)
            for (int wi = 0; wi < 5; wi++)
                for (int n = 8; n <= 9000; n += n < 256 ? 8 : 248)
                    for (int k = 8; k <= 20000; k += k < 512 ? 8 : 504) {
                        skinny_args a = gate_up;
                        a.epilogue = rope ? SKINNY_ROPE_QKV : SKINNY_STORE;
                        a.m = ms[mi], a.n = n, a.k = k, a.max_warps = warps[wi];
                        bytes = pi0_cuda_skinny_shared_bytes(&a, &staged);
                        CHECK(bytes <= 48 * 1024, "%sm %d, n %d, k %d, max warps %d: %zu bytes of shared memory",
                              rope ? "RoPE, " : "", a.m, n, k, warps[wi], bytes);
                        if (staged > most_staged) most_staged = staged;
                    }
    CHECK(most_staged >= 2, "the sweep reaches shapes of two staged passes and more (at most %d)", most_staged);
}

/* Where the prefix's gate|up takes the fused kernel (gate_up.h): the shapes it was measured faster at, and not the
 * ones it was measured slower at (bench/NOTES.md, sessions 29-30). */
TEST(gate_up_kernel_where_it_pays) {
    static const int faster[] = {532, 788, 1064, 2128, 256, 572, 560, 1144, 4256, 8512, 34048}, slower[] = {300, 255};
    for (size_t i = 0; i < sizeof faster / sizeof *faster; i++)
        CHECK(pi0_cuda_gate_up_gelu_pays(faster[i], 2048), "%d rows: measured faster", faster[i]);
    for (size_t i = 0; i < sizeof slower / sizeof *slower; i++)
        CHECK(!pi0_cuda_gate_up_gelu_pays(slower[i], 2048), "%d rows: measured slower", slower[i]);
    CHECK(!pi0_cuda_gate_up_gelu_pays(704, 1024), "the expert's k (B = 64's denoise): measured slower");
}
#endif

#ifdef PI0_WITH_CUDA
/* pi0_cuda_patch_weight_pieces: in every row, block b holds piece PI0_PATCH_W_PIECES[b] of each weight (util/half.h's
 * split), each a bf16 value, and the distinct pieces sum to the float32 weight; the blocks meet the patches' pieces so
 * that each (x piece, w piece) pair of orders summing to at most 2 comes once. */
TEST(patch_weight_pieces_pair_with_the_patches) {
    enum { ROWS = 5, COLS = 147 };
    float w[ROWS * COLS];
    uint32_t state = 7;
    for (int i = 0; i < ROWS * COLS; i++) {
        state = state * 1664525u + 1013904223u;
        w[i] = ldexpf((float)(state >> 8) / 16777216.0f - 0.5f, i % 40 - 30);
    }
    float *pieces = pi0_cuda_patch_weight_pieces(w, ROWS, COLS);
    REQUIRE(pieces != NULL, "out of memory");
    const int w_piece[PI0_PATCH_PIECES] = PI0_PATCH_W_PIECES, x_piece[PI0_PATCH_PIECES] = PI0_PATCH_X_PIECES;
    int wrong = 0, inexact = 0;
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < COLS; j++) {
            uint16_t want[3];
            f32_to_bf16x3(w[r * COLS + j], want);
            double sum = 0;
            for (int b = 0; b < PI0_PATCH_PIECES; b++) {
                float got = pieces[((size_t)r * PI0_PATCH_PIECES + b) * COLS + j];
                wrong += got != bf16_to_f32(want[w_piece[b]]);
                if (x_piece[b] == 0) sum += got; /* x0 meets each of w's pieces once */
            }
            inexact += sum != (double)w[r * COLS + j];
        }
    CHECK(wrong == 0, "%d pieces out of place", wrong);
    CHECK(inexact == 0, "%d weights are not the sum of their pieces", inexact);
    int pairs[3][3] = {{0}}; /* how often each (x piece, w piece) pair comes along k */
    for (int b = 0; b < PI0_PATCH_PIECES; b++) pairs[x_piece[b]][w_piece[b]]++;
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++)
            CHECK(pairs[i][j] == (i + j <= 2), "x piece %d meets w piece %d %d times", i, j, pairs[i][j]);
    free(pieces);
}
#endif

/* Through the public API: the cuda backend refuses the model before it looks for a GPU or reads a weight,
 * and auto gives it to the CPU, which runs it. */
TEST(cuda_refuses_auto_falls_back) {
    pi0_dims d = small_dims(PI0_MODEL_PI0);
    d.llm.head_dim = d.expert.head_dim = 20;
    pi0_options cuda = {.backend = PI0_BACKEND_CUDA}, automatic = {.backend = PI0_BACKEND_AUTO};
    pi0_model *m = NULL;
    pi0_error err = {0};
    CHECK(pi0_model_random(&d, 1, &cuda, &m, &err) == PI0_ERR_BACKEND && !m, "status %d", (int)err.status);
#ifdef PI0_WITH_CUDA
    CHECK(strstr(err.message, "head_dim is 20"), "%s", err.message);
#endif
    fprintf(stderr, "  --backend cuda: %s\n", err.message);
    REQUIRE(pi0_model_random(&d, 1, &automatic, &m, &err) == PI0_OK, "%s", err.message);
    CHECK(pi0_model_backend(m) == PI0_BACKEND_CPU, "auto chose %s", pi0_backend_name(pi0_model_backend(m)));
    float image[28 * 28 * 3] = {0}, state[32] = {0}, noise[10 * 32], actions[10 * 32];
    for (int i = 0; i < 10 * 32; i++) noise[i] = (float)(i % 7) / 7.0f - 0.5f;
    const float *images[1] = {image};
    uint8_t camera = 1, mask[4] = {1, 1, 1, 0};
    int32_t ids[4] = {1, 2, 3, 4};
    pi0_batch b = {.batch = 1, .num_cameras = 1, .images = images, .image_masks = &camera, .prompt_len = 4,
                   .prompt_ids = ids, .prompt_mask = mask, .state = state, .horizon = 10, .noise = noise, .num_steps = 2};
    CHECK(pi0_sample_actions(m, &b, actions, NULL, &err) == PI0_OK, "%s", err.message);
    pi0_model_free(m);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
#ifdef PI0_WITH_CUDA
    RUN(accepts_what_the_gpu_runs);
    RUN(refuses_with_dimension_and_limit);
    RUN(skinny_block_choice_is_exact);
    RUN(skinny_staged_passes_fit);
    RUN(gate_up_kernel_where_it_pays);
    RUN(patch_weight_pieces_pair_with_the_patches);
#endif
    RUN(cuda_refuses_auto_falls_back);
    return check_finish();
}
