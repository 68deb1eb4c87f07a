/*
 * test_cuda_denoise.c - the persistent denoise kernel (src/cuda/denoise.cu) on models of awkward dims, Pi0
 * and Pi0.5: head dims 32, 64, 128 and 256, widths and MLP sizes past one 1024-k piece and not multiples of
 * it, MQA, GQA and MHA, 4 to 16 suffix rows, and prompts from one to several hundred keys. Each model is
 * made three times from the same seed: on the GPU with PI0_PERSISTENT=1 (the persistent kernel), on the GPU
 * without it (the skinny kernels it replaces) and on the CPU (the oracle). A batch of one, fresh random
 * inputs: the kernel's actions agree with the CPU's at the bf16 tolerance and with the skinny kernels'
 * closer still; the graph of the persistent model is the one that runs the kernel (read from the backend's
 * state: Pi0.5's two paths can agree bit for bit, their differences gated down, so equal actions do not tell);
 * eager and replayed calls are bit-identical, and so are two replays (deterministic).
 */
#include <stdlib.h>

#include "cuda/backend.h"
#include "cuda/denoise.h"
#include "gpu_check.h"
#include "model/model.h"
#include "pi0.h"

#define TOL_BF16 1e-2
#define TOL_PATHS 5e-3 /* the two GPU paths differ in summation order only */

enum { CAMERAS = 2, IMAGE = 56, A = 32 }; /* 56 / 14: 16 tokens per image */

typedef struct {
    int heads, kv_heads, head_dim, width, mlp, horizon, prompt;
    const char *why;
} denoise_case;

static const denoise_case cases[] = {
    {2, 1, 32, 64, 136, 10, 12, "the fixtures' head_dim 32, MQA"},
    {4, 2, 64, 200, 232, 3, 40, "head_dim 64, GQA, a width that is no multiple of 64"},
    {3, 3, 128, 1096, 2056, 15, 300, "head_dim 128, MHA, width and mlp past one piece, 10 key chunks"},
    {8, 1, 256, 512, 1024, 15, 90, "Pi0's head_dim 256 and MQA of 8: 128 virtual rows"},
    {2, 1, 256, 264, 3000, 5, 700, "head_dim 256, mlp of 3 pieces, 23 key chunks"},
};

static pi0_dims dims_of(const denoise_case *c, pi0_model_kind kind) {
    pi0_dims d = {0};
    d.kind = kind;
    d.vision = (pi0_stack_dims){64, 1, 96, 2, 2, 32};
    d.patch_size = 14, d.image_size = IMAGE;
    d.llm = (pi0_stack_dims){c->width, 2, c->mlp, c->heads, c->kv_heads, c->head_dim};
    d.expert = (pi0_stack_dims){c->width, 2, c->mlp, c->heads, c->kv_heads, c->head_dim};
    d.vocab_size = 300, d.action_dim = A, d.action_horizon = c->horizon, d.max_token_len = c->prompt;
    return d;
}

/* The model of dims d from seed 11; persistent 1 loads it with PI0_PERSISTENT=1 (the backend reads it then). */
static pi0_model *load(const pi0_dims *d, pi0_backend backend, int persistent, pi0_error *err) {
    pi0_options opts = {.backend = backend};
    pi0_model *m = NULL;
    if (persistent) setenv("PI0_PERSISTENT", "1", 1);
    pi0_status st = pi0_model_random(d, 11, &opts, &m, err);
    unsetenv("PI0_PERSISTENT");
    return st ? NULL : m;
}

static void run_case(const denoise_case *c, pi0_model_kind kind) {
    pi0_dims d = dims_of(c, kind);
    int H = c->horizon, rows = H + (kind == PI0_MODEL_PI0), P = c->prompt;
    fprintf(stderr, "  %s: %s; %d/%d heads x %d, width %d, mlp %d, %d rows, %d prompt tokens\n",
            pi0_model_kind_name(kind), c->why, c->heads, c->kv_heads, c->head_dim, c->width, c->mlp, rows, P);
    REQUIRE(pi0_cuda_denoise_supported(rows, c->width, c->heads, c->kv_heads, c->head_dim, c->mlp, d.expert.depth,
                                       CAMERAS * 16 + P + rows),
            "the persistent kernel does not take this case");
    pi0_error err = {0};
    pi0_model *fast = load(&d, PI0_BACKEND_CUDA, 1, &err), *skinny = fast ? load(&d, PI0_BACKEND_CUDA, 0, &err) : NULL;
    pi0_model *cpu = skinny ? load(&d, PI0_BACKEND_CPU, 0, &err) : NULL;
    REQUIRE(cpu, "loading: %s", err.message);

    size_t image = (size_t)IMAGE * IMAGE * 3, n = (size_t)H * A;
    float *images[CAMERAS], state[A], *noise = malloc(n * sizeof(float));
    float *ref = malloc(n * sizeof(float)), *got = malloc(n * sizeof(float)), *again = malloc(n * sizeof(float));
    int32_t *ids = malloc((size_t)P * sizeof(int32_t));
    uint8_t *mask = malloc((size_t)P), cams[CAMERAS] = {1, 1};
    REQUIRE(noise && ref && got && again && ids && mask, "out of memory");
    for (int i = 0; i < CAMERAS; i++) images[i] = malloc(image * sizeof(float)), fill_uniform(images[i], image, 1.0f);
    for (int i = 0; i < P; i++) ids[i] = (int32_t)((gpu_uniform() + 1) * 149.9f), mask[i] = i < P - 3; /* 3 padding */
    fill_uniform(state, A, 1.0f), fill_uniform(noise, n, 1.5f);
    pi0_batch b = {.batch = 1, .num_cameras = CAMERAS, .images = (const float **)images, .image_masks = cams,
                   .prompt_len = P, .prompt_ids = ids, .prompt_mask = mask, .state = state, .horizon = H,
                   .noise = noise, .num_steps = 4};
    REQUIRE(pi0_sample_actions(cpu, &b, ref, NULL, &err) == PI0_OK, "cpu: %s", err.message);
    REQUIRE(pi0_sample_actions(fast, &b, got, NULL, &err) == PI0_OK, "persistent (eager): %s", err.message);
    double e = rel_error(got, ref, n);
    fprintf(stderr, "    persistent vs cpu %.3g", e);
    CHECK(e <= TOL_BF16, "persistent vs cpu: %.3g > %g", e, TOL_BF16);
    for (int replay = 0; replay < 2; replay++) {
        REQUIRE(pi0_sample_actions(fast, &b, again, NULL, &err) == PI0_OK, "persistent (graph): %s", err.message);
        CHECK(!memcmp(got, again, n * sizeof(float)), "replay %d differs from the eager call (%.3g)", replay,
              rel_error(again, got, n));
    }
    REQUIRE(pi0_sample_actions(skinny, &b, again, NULL, &err) == PI0_OK, "skinny: %s", err.message);
    e = rel_error(got, again, n);
    fprintf(stderr, ", vs skinny %.3g (skinny vs cpu %.3g)\n", e, rel_error(again, ref, n));
    CHECK(e <= TOL_PATHS, "persistent vs skinny: %.3g > %g", e, TOL_PATHS);
    const cuda_state *with = fast->backend_state, *without = skinny->backend_state;
    CHECK(with->num_graphs == 1 && with->graphs[0]->persistent, "the persistent model's graph does not run the kernel");
    CHECK(without->num_graphs == 1 && !without->graphs[0]->persistent, "the skinny model's graph runs the kernel");

    for (int i = 0; i < CAMERAS; i++) free(images[i]);
    free(noise), free(ref), free(got), free(again), free(ids), free(mask);
    pi0_model_free(fast), pi0_model_free(skinny), pi0_model_free(cpu);
}

static void all_cases(pi0_model_kind kind) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_case(&cases[i], kind);
}

TEST(pi0_persistent_matches_cpu_and_skinny) { all_cases(PI0_MODEL_PI0); }
TEST(pi05_persistent_matches_cpu_and_skinny) { all_cases(PI0_MODEL_PI05); }

int main(int argc, char **argv) {
    check_init(argc, argv);
    gpu_seed();
    RUN(pi0_persistent_matches_cpu_and_skinny);
    RUN(pi05_persistent_matches_cpu_and_skinny);
    return check_finish();
}
