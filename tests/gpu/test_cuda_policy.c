/*
 * test_cuda_policy.c - a server's rule on the GPU: after pi0_policy_warmup, no request captures a CUDA
 * graph, whatever its batch size (up to the warm-up's, padded ones included), prompt length or which
 * optional cameras it brings, nor allocates GPU memory for 640 x 480 frames; and every such request still
 * gives the CPU policy's actions (bf16 tolerance). Pi0 and Pi0.5, the tiny fixtures' dims with random weights, a generic adapter whose wrist
 * camera may be missing.
 */
#include <stdlib.h>

#include "gpu_check.h"
#include "model/config.h"
#include "policy/policy.h"

#define TOL 2e-2
#define MAX_BATCH 10 /* exact batch sizes up to 8, then 16 (two extra samples run and are dropped) */
#define ROUNDS 28

static const char *ADAPTER_JSON =
    "{\"cameras\": [\"top\", \"wrist\", null], \"optional_cameras\": [\"wrist\"], \"state\": [\"joints\"],\n"
    " \"action_dims\": 7}";
static const char *STATS_JSON =
    "{\"norm_stats\": {\"state\": {\"mean\": [0, 0.1, -0.1, 0.2, 0, 0, 0.5, 0], \"std\": [1, 1, 1, 1, 2, 2, 1, 1],\n"
    "  \"q01\": [-1, -1, -1, -1, -2, -2, -1, -1], \"q99\": [1, 1, 1, 1, 2, 2, 1, 1]},\n"
    " \"actions\": {\"mean\": [0, 0, 0, 0, 0, 0, 0], \"std\": [1, 1, 1, 1, 1, 1, 1],\n"
    "  \"q01\": [-1, -1, -1, -1, -1, -1, -1], \"q99\": [1, 1, 1, 1, 1, 1, 1]}}}";
/* Prompts of very different token counts (one word to the tiny model's whole prompt budget). */
static const char *PROMPTS[] = {"go", "pick up the red block", "open the top drawer of the cabinet and put the bowl inside it",
                                "wipe", "turn the stove on, then move the pot onto the burner carefully and slowly"};

static void write_file(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (f) fputs(text, f), fclose(f);
}

static pi0_policy *open_policy(pi0_model_kind kind, pi0_backend backend) {
    char path[1024];
    pi0_dims d = {0};
    pi0_error err = {0};
    snprintf(path, sizeof path, "%s/pi0_tiny/config.json", fixtures_dir());
    if (config_load_dims(path, &d, &err)) return fprintf(stderr, "  %s\n", err.message), NULL;
    d.kind = kind, d.vocab_size = 2000; /* the test tokenizer's */
    if (kind == PI0_MODEL_PI05) d.max_token_len = 64; /* room for the discrete state */
    pi0_options mo = {.backend = backend};
    pi0_model *m = NULL;
    pi0_adapter *a = NULL;
    pi0_tokenizer *tok = NULL;
    pi0_norm_stats stats = {0};
    snprintf(path, sizeof path, "%s/tokenizer/tok.model", fixtures_dir());
    write_file(test_path("adapter.json"), ADAPTER_JSON);
    write_file(test_path("norm_stats.json"), STATS_JSON);
    if (pi0_model_random(&d, 5, &mo, &m, &err) || pi0_adapter_open(test_path("adapter.json"), &a, &err) ||
        pi0_tokenizer_load(path, &tok, &err) || pi0_norm_stats_load(test_path("norm_stats.json"), &stats, &err)) {
        fprintf(stderr, "  %s\n", err.message);
        pi0_model_free(m), pi0_adapter_free(a), pi0_tokenizer_free(tok), pi0_norm_stats_free(&stats);
        return NULL;
    }
    pi0_policy_options po = {.num_steps = 4};
    pi0_policy *p = NULL;
    if (pi0_policy_create(m, a, tok, &stats, &po, &p, &err)) fprintf(stderr, "  %s\n", err.message);
    return p;
}

/* A random observation: frames of odd sizes (640 x 480 in one round of five), the wrist camera left out one
 * time in three. */
static void random_observation(pi0_observation *obs, int round, int i) {
    pi0_error err = {0};
    int h = 40 + (int)(30 * (gpu_uniform() + 1)), w = 60 + (int)(40 * (gpu_uniform() + 1));
    if (round % 5 == 2) h = 480, w = 640;
    uint8_t *frame = malloc((size_t)h * w * 3);
    for (size_t k = 0; k < (size_t)h * w * 3; k++) frame[k] = (uint8_t)(128 + 127 * gpu_uniform());
    pi0_observation_add_array(obs, "top", PI0_DTYPE_U8, 3, (int64_t[]){h, w, 3}, frame, &err);
    if (gpu_uniform() > -1.0f / 3.0f)
        pi0_observation_add_array(obs, "wrist", PI0_DTYPE_U8, 3, (int64_t[]){w, h, 3}, frame, &err);
    float joints[8];
    fill_uniform(joints, 8, 0.9f);
    pi0_observation_add_array(obs, "joints", PI0_DTYPE_F32, 1, (int64_t[]){8}, joints, &err);
    pi0_observation_add_string(obs, "prompt", PROMPTS[(round * 7 + i * 3) % 5], &err);
    free(frame);
}

/* ||a - b|| / ||b|| over one request's actions (float64), as check.h's rel_error. */
static double worst_diff(const pi0_policy_result *a, const pi0_policy_result *b) {
    if (a->error.status || b->error.status || !a->actions || !b->actions) return INFINITY;
    double num = 0, den = 0;
    for (int k = 0; k < a->horizon * a->action_dims; k++) {
        double d = a->actions[k] - b->actions[k];
        num += d * d, den += b->actions[k] * b->actions[k];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static void no_capture_after_warmup(pi0_model_kind kind) {
    pi0_policy *gpu = open_policy(kind, PI0_BACKEND_CUDA), *cpu = open_policy(kind, PI0_BACKEND_CPU);
    REQUIRE(gpu && cpu);
    pi0_error err = {0};
    double seconds = 0;
    REQUIRE(pi0_policy_warmup(gpu, MAX_BATCH, &seconds, &err) == PI0_OK, "%s", err.message);
    const pi0_model *m = pi0_policy_model(gpu);
    uint64_t captured = pi0_model_graph_captures(m), device_bytes = pi0_model_device_memory(m);
    fprintf(stderr, "  %s: warm-up of batches 1..%d took %.2f s, %llu graphs\n", pi0_model_kind_name(kind), MAX_BATCH,
            seconds, (unsigned long long)captured);
    CHECK(captured > 0);
    double worst = 0;
    int requests = 0, missing_wrist = 0;
    for (int round = 0; round < ROUNDS; round++) {
        static const int sizes[] = {1, 2, 3, 4, 7, 9, 10};
        int n = sizes[round % 7];
        pi0_observation obs[MAX_BATCH] = {{0}};
        const pi0_observation *list[MAX_BATCH];
        uint64_t seeds[MAX_BATCH];
        for (int i = 0; i < n; i++) {
            random_observation(&obs[i], round, i);
            list[i] = &obs[i], seeds[i] = (uint64_t)(round * 10 + i);
            missing_wrist += !pi0_observation_find(&obs[i], "wrist");
        }
        pi0_policy_result on_gpu[MAX_BATCH], on_cpu[MAX_BATCH];
        REQUIRE(pi0_policy_infer(gpu, list, seeds, n, on_gpu, NULL, &err) == PI0_OK, "%s", err.message);
        REQUIRE(pi0_policy_infer(cpu, list, seeds, n, on_cpu, NULL, &err) == PI0_OK, "%s", err.message);
        if (round < 7) { /* the same requests without graphs: replay and eager runs must agree */
            pi0_policy_result eager[MAX_BATCH];
            setenv("PI0_CUDA_GRAPHS", "0", 1);
            REQUIRE(pi0_policy_infer(gpu, list, seeds, n, eager, NULL, &err) == PI0_OK, "%s", err.message);
            unsetenv("PI0_CUDA_GRAPHS");
            double e_cpu = 0, e_replay = 0;
            for (int i = 0; i < n; i++) {
                e_cpu = fmax(e_cpu, worst_diff(&eager[i], &on_cpu[i]));
                e_replay = fmax(e_replay, worst_diff(&on_gpu[i], &eager[i]));
                pi0_policy_result_free(&eager[i]);
            }
            fprintf(stderr, "  round %d (batch %d): eager GPU vs CPU %.3g, replay vs eager %.3g\n", round, n, e_cpu,
                    e_replay);
            CHECK(e_replay < 1e-3, "round %d: the replayed graph differs from the eager run by %.3g", round, e_replay);
        }
        for (int i = 0; i < n; i++) {
            double d = worst_diff(&on_gpu[i], &on_cpu[i]);
            if (d > TOL && d > worst)
                fprintf(stderr, "  round %d, batch %d, request %d (%s wrist camera, prompt %d): GPU vs CPU %.3g\n", round,
                        n, i, pi0_observation_find(&obs[i], "wrist") ? "with" : "without", (round * 7 + i * 3) % 5, d);
            worst = d > worst ? d : worst;
            pi0_policy_result_free(&on_gpu[i]), pi0_policy_result_free(&on_cpu[i]);
            pi0_observation_free(&obs[i]);
        }
        requests += n;
        CHECK(pi0_model_graph_captures(m) == captured, "round %d (batch %d): %llu graphs captured after warm-up", round,
              n, (unsigned long long)(pi0_model_graph_captures(m) - captured));
        CHECK(pi0_model_device_memory(m) == device_bytes, "round %d (batch %d): GPU memory grew by %.1f MB after warm-up",
              round, n, (double)(pi0_model_device_memory(m) - device_bytes) / 1e6);
    }
    fprintf(stderr, "  %d requests (%d without the wrist camera): worst GPU vs CPU %.3g\n", requests, missing_wrist,
            worst);
    CHECK(missing_wrist > 0 && missing_wrist < requests, "the cameras did not vary");
    CHECK(worst < TOL, "GPU vs CPU policy: %.3g", worst);
    pi0_policy_free(gpu), pi0_policy_free(cpu);
}

/* A prepared observation is one block of page-locked memory (the policy's pool of pi0_host_alloc blocks), so the
 * backend sends its frames to the GPU from where they are; its actions are the CPU policy's within the tolerance, and
 * the same to the bit when its block is reused for the same observation. */
TEST(prepared_frames_are_page_locked) {
    pi0_policy *gpu = open_policy(PI0_MODEL_PI0, PI0_BACKEND_CUDA), *cpu = open_policy(PI0_MODEL_PI0, PI0_BACKEND_CPU);
    REQUIRE(gpu && cpu);
    pi0_error err = {0};
    pi0_observation obs = {0};
    random_observation(&obs, 2, 0); /* 640 x 480 frames */
    const pi0_observation *list[1] = {&obs};
    uint64_t seed = 3;
    pi0_policy_result got[2], want;
    for (int i = 0; i < 2; i++) {
        pi0_prepared *pr = NULL;
        REQUIRE(pi0_policy_prepare(gpu, &obs, &pr, &err) == PI0_OK, "%s", err.message);
        struct cudaPointerAttributes a;
        CHECK(cudaPointerGetAttributes(&a, pr) == cudaSuccess && a.type == cudaMemoryTypeHost,
              "a prepared observation is not in page-locked memory");
        const pi0_prepared *one[1] = {pr};
        REQUIRE(pi0_policy_infer_prepared(gpu, one, &seed, 1, &got[i], &err) == PI0_OK, "%s", err.message);
        pi0_prepared_free(pr);
    }
    REQUIRE(pi0_policy_infer(cpu, list, &seed, 1, &want, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(worst_diff(&got[1], &got[0]) == 0, "the reused block gives other actions");
    CHECK(worst_diff(&got[0], &want) < TOL, "GPU vs CPU policy: %.3g", worst_diff(&got[0], &want));
    pi0_policy_result_free(&got[0]), pi0_policy_result_free(&got[1]), pi0_policy_result_free(&want);
    pi0_observation_free(&obs);
    pi0_policy_free(gpu), pi0_policy_free(cpu);
}

TEST(pi0_no_capture_after_warmup) { no_capture_after_warmup(PI0_MODEL_PI0); }
TEST(pi05_no_capture_after_warmup) { no_capture_after_warmup(PI0_MODEL_PI05); }

int main(int argc, char **argv) {
    check_init(argc, argv);
    gpu_seed();
    RUN(prepared_frames_are_page_locked);
    RUN(pi0_no_capture_after_warmup);
    RUN(pi05_no_capture_after_warmup);
    return check_finish();
}
