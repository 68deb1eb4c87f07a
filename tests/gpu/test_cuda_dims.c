/*
 * test_cuda_dims.c - the CUDA backend on models whose dims are not Pi0's: Gemma head dims that are multiples of
 * 8 besides 256 (the padded attention kernels), vision head dims besides 72, odd widths, MLP sizes and head
 * counts (the denoise steps take cuBLASLt where the skinny Linears do not apply), MQA, GQA and MHA; Pi0 and
 * Pi0.5. Each model is made on the GPU and on the CPU from the same seed (pi0_model_random) and their actions
 * agree at the bf16 tolerance: a batch of 2 with ragged cameras and prompts, then each sample alone (the
 * few-rows path), the GPU eager and replayed. Then a batch too large for the GPU: a clear out-of-memory error,
 * after which the model serves small batches as before.
 */
#include <stdlib.h>

#include "gpu_check.h"
#include "pi0.h"

#define TOL_BF16 1e-2

enum { B = 2, CAMERAS = 2, PROMPT = 40, H = 10, IMAGE = 112 }; /* 112 / 14: 64 tokens per image */

typedef struct {
    int vision_heads, vision_head_dim;
    int heads, kv_heads, head_dim; /* the LLM's and the expert's */
    int width, mlp, expert_width, expert_mlp;
    const char *why;
} dims_case;

static const dims_case cases[] = {
    {2, 16, 3, 1, 8, 100, 300, 60, 150, "head_dim 8 (padded 64), MQA, odd widths: no skinny Linears"},
    {3, 24, 4, 2, 24, 72, 200, 56, 96, "head_dim 24, GQA 4/2"},
    {5, 40, 5, 5, 40, 130, 258, 90, 170, "head_dim 40, MHA of 5 heads"},
    {1, 64, 3, 3, 64, 96, 192, 64, 128, "head_dim 64, skinny Linears with RoPE over 64"},
    {2, 96, 2, 1, 96, 200, 300, 120, 240, "head_dim 96 (padded 128), skinny Linears in the expert"},
    {1, 128, 4, 2, 128, 256, 512, 128, 256, "head_dim 128, skinny Linears, GQA"},
    {1, 136, 2, 1, 136, 150, 310, 100, 210, "head_dim 136 (padded 256)"},
    {1, 200, 3, 1, 200, 77, 333, 70, 150, "head_dim 200, LLM width 77"},
    {1, 248, 2, 2, 248, 64, 128, 48, 96, "head_dim 248, MHA of 2"},
    {2, 72, 2, 1, 256, 100, 200, 50, 100, "Pi0's head dims (exact kernels) with odd widths"},
};

static pi0_dims dims_of(const dims_case *c, pi0_model_kind kind) {
    pi0_dims d = {0};
    int vision_width = c->vision_heads * c->vision_head_dim;
    d.kind = kind;
    d.vision = (pi0_stack_dims){vision_width, 2, 2 * vision_width + 6, c->vision_heads, c->vision_heads, c->vision_head_dim};
    d.patch_size = 14, d.image_size = IMAGE;
    d.llm = (pi0_stack_dims){c->width, 2, c->mlp, c->heads, c->kv_heads, c->head_dim};
    d.expert = (pi0_stack_dims){c->expert_width, 2, c->expert_mlp, c->heads, c->kv_heads, c->head_dim};
    d.vocab_size = 300, d.action_dim = 32, d.action_horizon = H, d.max_token_len = PROMPT;
    return d;
}

/* Fresh random inputs: sample 0 with both cameras and a full prompt (168 prefix tokens: three key tiles),
 * sample 1 with one camera and 7 tokens. */
typedef struct {
    float *images[CAMERAS], state[B * 32], noise[B * H * 32];
    const float *image_ptrs[CAMERAS];
    uint8_t masks[B * CAMERAS], prompt_mask[B * PROMPT];
    int32_t ids[B * PROMPT];
    pi0_batch batch;
} workload;

static void workload_init(workload *w) {
    size_t image = (size_t)IMAGE * IMAGE * 3;
    for (int c = 0; c < CAMERAS; c++) {
        w->image_ptrs[c] = w->images[c] = malloc(B * image * sizeof(float));
        fill_uniform(w->images[c], B * image, 1.0f);
    }
    const uint8_t masks[B * CAMERAS] = {1, 1, 1, 0};
    memcpy(w->masks, masks, sizeof masks);
    for (int i = 0; i < B * PROMPT; i++) {
        w->ids[i] = (int32_t)((gpu_uniform() + 1) * 149.9f);
        w->prompt_mask[i] = i < PROMPT || i % PROMPT < 7;
    }
    fill_uniform(w->state, B * 32, 1.0f), fill_uniform(w->noise, B * H * 32, 1.5f);
    w->batch = (pi0_batch){.batch = B, .num_cameras = CAMERAS, .images = w->image_ptrs, .image_masks = w->masks,
                           .prompt_len = PROMPT, .prompt_ids = w->ids, .prompt_mask = w->prompt_mask, .state = w->state,
                           .horizon = H, .noise = w->noise, .num_steps = 10};
}

static void workload_free(workload *w) {
    for (int c = 0; c < CAMERAS; c++) free(w->images[c]);
}

/* Sample b of the workload as a batch of its own; `images` receives its camera pointers. */
static pi0_batch sample_alone(const workload *w, int b, const float **images) {
    pi0_batch one = w->batch;
    for (int c = 0; c < CAMERAS; c++) images[c] = w->images[c] + (size_t)b * IMAGE * IMAGE * 3;
    one.batch = 1, one.images = images, one.image_masks = w->masks + b * CAMERAS;
    one.prompt_ids = w->ids + b * PROMPT, one.prompt_mask = w->prompt_mask + b * PROMPT;
    one.state = w->state + b * 32, one.noise = w->noise + (size_t)b * H * 32;
    return one;
}

/* The actions of `batch` on both backends, sample by sample within TOL_BF16; the GPU twice (the first call
 * of a shape runs eagerly, the second replays its graph). */
static void compare(pi0_model *gpu, pi0_model *cpu, const pi0_batch *batch, const char *what) {
    size_t per = (size_t)H * 32;
    float got[B * H * 32], ref[B * H * 32];
    pi0_error err = {0};
    REQUIRE(pi0_sample_actions(cpu, batch, ref, NULL, &err) == PI0_OK, "%s on the cpu: %s", what, err.message);
    for (int run = 0; run < 2; run++) {
        const char *how = run ? "graph" : "eager";
        REQUIRE(pi0_sample_actions(gpu, batch, got, NULL, &err) == PI0_OK, "%s (%s): %s", what, how, err.message);
        for (int b = 0; b < batch->batch; b++) {
            double e = rel_error(got + b * per, ref + b * per, per);
            fprintf(stderr, "    %s, sample %d (%s): cuda vs cpu %.3g\n", what, b, how, e);
            CHECK(e <= TOL_BF16, "%s, sample %d (%s): %.3g > %g", what, b, how, e, TOL_BF16);
        }
    }
}

static void run_case(const dims_case *c, pi0_model_kind kind) {
    pi0_dims d = dims_of(c, kind);
    pi0_options gpu_opts = {.backend = PI0_BACKEND_CUDA}, cpu_opts = {.backend = PI0_BACKEND_CPU};
    pi0_model *gpu = NULL, *cpu = NULL;
    pi0_error err = {0};
    fprintf(stderr, "  %s: %s; vision %d x %d, %d/%d heads x %d, widths %d/%d, mlp %d/%d\n", pi0_model_kind_name(kind),
            c->why, c->vision_heads, c->vision_head_dim, c->heads, c->kv_heads, c->head_dim, c->width, c->expert_width,
            c->mlp, c->expert_mlp);
    REQUIRE(pi0_model_random(&d, 3, &gpu_opts, &gpu, &err) == PI0_OK, "%s: %s", c->why, err.message);
    REQUIRE(pi0_model_random(&d, 3, &cpu_opts, &cpu, &err) == PI0_OK, "%s: %s", c->why, err.message);
    workload w;
    workload_init(&w);
    compare(gpu, cpu, &w.batch, "batch");
    for (int b = 0; b < B; b++) {
        const float *images[CAMERAS];
        pi0_batch one = sample_alone(&w, b, images);
        compare(gpu, cpu, &one, b ? "sample 1 alone" : "sample 0 alone");
    }
    workload_free(&w);
    pi0_model_free(gpu), pi0_model_free(cpu);
}

static void all_cases(pi0_model_kind kind) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], kind);
}

TEST(pi0_odd_dims_match_cpu) { all_cases(PI0_MODEL_PI0); }
TEST(pi05_odd_dims_match_cpu) { all_cases(PI0_MODEL_PI05); }

/* A batch of 1 with 10 prompt tokens, run twice (eager, then the graph) into `actions` (2 x H x 32). */
static pi0_status small_batch(pi0_model *m, float *actions, pi0_error *err) {
    int32_t ids[10] = {1, 5, 9, 13, 17, 21, 25, 29, 33, 37};
    uint8_t mask[10] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1};
    float state[32] = {0}, noise[H * 32];
    for (int i = 0; i < H * 32; i++) noise[i] = (float)(i % 13) / 6.5f - 1.0f;
    pi0_batch b = {.batch = 1, .prompt_len = 10, .prompt_ids = ids, .prompt_mask = mask, .state = state, .horizon = H,
                   .noise = noise, .num_steps = 3};
    pi0_status st = pi0_sample_actions(m, &b, actions, NULL, err);
    return st ? st : pi0_sample_actions(m, &b, actions + H * 32, NULL, err);
}

/* A batch whose activations cannot fit on the GPU fails with PI0_ERR_OUT_OF_MEMORY and a message naming the
 * batch; the model then serves a small batch with the same actions as before. The LLM's wide MLP makes every
 * prefix token need at least 6 mlp_dim bytes (its bf16 gate|up output and gelu x up), so PI0_MAX_BATCH samples
 * of `tokens` prompt tokens ask for more than twice the GPU's memory. */
TEST(out_of_memory_leaves_model_usable) {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_OK(cudaMemGetInfo(&free_bytes, &total_bytes));
    pi0_dims d = dims_of(&cases[1], PI0_MODEL_PI0);
    d.llm.mlp_dim = 16384;
    pi0_options opts = {.backend = PI0_BACKEND_CUDA};
    pi0_model *m = NULL;
    pi0_error err = {0};
    REQUIRE(pi0_model_random(&d, 5, &opts, &m, &err) == PI0_OK, "%s", err.message);
    float before[2 * H * 32], after[2 * H * 32];
    REQUIRE(small_batch(m, before, &err) == PI0_OK, "%s", err.message);

    const int batch = PI0_MAX_BATCH;
    const long long per_token = 6LL * d.llm.mlp_dim;
    const int tokens = (int)(2 * (long long)total_bytes / ((long long)batch * per_token)) + 1;
    REQUIRE(tokens + H + 1 <= 16384, "a %.0f GB GPU needs %d prompt tokens per sample, more than RoPE's positions",
            total_bytes / 1e9, tokens);
    int32_t *ids = calloc((size_t)batch * tokens, sizeof(int32_t));
    uint8_t *mask = malloc((size_t)batch * tokens);
    float *state = calloc((size_t)batch * 32, sizeof(float)), *actions = malloc((size_t)batch * H * 32 * sizeof(float));
    REQUIRE(ids && mask && state && actions, "out of host memory");
    memset(mask, 1, (size_t)batch * tokens);
    pi0_batch big = {.batch = batch, .prompt_len = tokens, .prompt_ids = ids, .prompt_mask = mask, .state = state,
                     .horizon = H, .noise_seed = 1, .num_steps = 3};
    pi0_status st = pi0_sample_actions(m, &big, actions, NULL, &err);
    fprintf(stderr, "  %d samples x %d tokens on a %.0f GB GPU (%.0f GB free): %s\n", batch, tokens, total_bytes / 1e9,
            free_bytes / 1e9, st ? err.message : "ran");
    char want[64];
    snprintf(want, sizeof want, "batch of %d", batch);
    CHECK(st == PI0_ERR_OUT_OF_MEMORY, "status %d (%s)", (int)st, pi0_status_name(st));
    CHECK(st == PI0_OK || strstr(err.message, want), "the message does not say \"%s\": %s", want, err.message);
    free(ids), free(mask), free(state), free(actions);

    REQUIRE(small_batch(m, after, &err) == PI0_OK, "after the failed batch: %s", err.message);
    CHECK(!memcmp(before, after, sizeof before), "a small batch changed after the failed one (eager %.3g, graph %.3g)",
          rel_error(after, before, H * 32), rel_error(after + H * 32, before + H * 32, H * 32));
    pi0_model_free(m);
}

int main(int argc, char **argv) {
    check_init(argc, argv);
    gpu_seed();
    RUN(pi0_odd_dims_match_cpu);
    RUN(pi05_odd_dims_match_cpu);
    RUN(out_of_memory_leaves_model_usable);
    return check_finish();
}
