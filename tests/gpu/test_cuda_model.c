/*
 * test_cuda_model.c - the CUDA backend end to end, Pi0 and Pi0.5: every fixture at the bf16 tolerance
 * (1e-2 vs openpi's fp32 actions), as a batch (B 2-3 at H 10: the skinny path's two row tiles; H 50: cuBLASLt) and
 * sample by sample (the skinny path),
 * ragged batches against the CPU oracle, graph replay equal to the eager run, repeated replays
 * identical, the first denoise step beside the prefix equal to it after, several shapes alternating through the graph cache, camera frames resized on the GPU equal to
 * their images made on the host, and the real-size models on random weights within 2e-2 of the CPU backend (two
 * samples, one, one at horizon 50, and a batch of eight against the CPU and against each sample alone).
 */
#include <math.h>
#include <stdlib.h>

#include "cuda/backend.h"
#include "gpu_check.h"
#include "io/safetensors.h"
#include "model/image.h"
#include "pi0.h"

#define TOL_BF16 1e-2
#define TOL_FULL_SIZE 2e-2

static const char *cameras[3] = {"base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"};

typedef struct {
    st_file io;
    float *images[3], *state, *noise;
    const float *image_ptrs[3];
    uint8_t masks[3 * 64], *prompt_mask;
    int32_t *prompt_ids;
    pi0_batch batch;
} fixture_io;

static float *f32_of(const st_tensor *t) {
    float *out = malloc(t->numel * sizeof(float));
    st_to_f32(t, out);
    return out;
}

static int io_open(fixture_io *f, const char *name) {
    char path[1024];
    pi0_error err = {0};
    memset(f, 0, sizeof *f);
    snprintf(path, sizeof path, "%s/%s/io.safetensors", fixtures_dir(), name);
    if (st_open(path, &f->io, &err)) return fprintf(stderr, "  %s\n", err.message), -1;
    const st_tensor *ids = st_find(&f->io, "tokenized_prompt"), *noise = st_find(&f->io, "noise");
    int B = (int)noise->shape[0];
    for (int c = 0; c < 3; c++) {
        char key[64];
        snprintf(key, sizeof key, "image/%s", cameras[c]);
        f->image_ptrs[c] = f->images[c] = f32_of(st_find(&f->io, key));
        snprintf(key, sizeof key, "image_mask/%s", cameras[c]);
        for (int b = 0; b < B; b++) f->masks[b * 3 + c] = ((const uint8_t *)st_find(&f->io, key)->data)[b];
    }
    f->state = f32_of(st_find(&f->io, "state"));
    f->noise = f32_of(noise);
    f->prompt_ids = malloc(ids->nbytes);
    memcpy(f->prompt_ids, ids->data, ids->nbytes);
    f->prompt_mask = malloc(ids->numel);
    memcpy(f->prompt_mask, st_find(&f->io, "tokenized_prompt_mask")->data, ids->numel);
    f->batch = (pi0_batch){.batch = B, .num_cameras = 3, .images = f->image_ptrs, .image_masks = f->masks,
                           .prompt_len = (int)ids->shape[1], .prompt_ids = f->prompt_ids, .prompt_mask = f->prompt_mask,
                           .state = f->state, .horizon = (int)noise->shape[1], .noise = f->noise};
    return 0;
}

static void io_close(fixture_io *f) {
    for (int c = 0; c < 3; c++) free(f->images[c]);
    free(f->state), free(f->noise), free(f->prompt_ids), free(f->prompt_mask);
    st_close(&f->io);
}

static pi0_model *load(const char *name, pi0_backend backend) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", fixtures_dir(), name);
    pi0_options opts = {.backend = backend};
    pi0_model *m = NULL;
    pi0_error err = {0};
    if (pi0_model_load(path, &opts, &m, &err)) fprintf(stderr, "  load %s: %s\n", path, err.message);
    return m;
}

static size_t actions_len(const pi0_batch *b) {
    return (size_t)b->batch * b->horizon * 32;
}

static void fixture_case(const char *name) {
    fixture_io f;
    REQUIRE(io_open(&f, name) == 0);
    pi0_model *m = load(name, PI0_BACKEND_CUDA);
    REQUIRE(m && pi0_model_backend(m) == PI0_BACKEND_CUDA);
    /* the last case computes the masked cameras and padding too (pi0_batch.uniform_shape: a server's shapes) */
    const struct { int steps; const char *key; int uniform; } cases[] = {
        {10, "actions", 0}, {3, "actions_3step", 0}, {1, "actions_1step", 0}, {10, "actions", 1}};
    size_t n = actions_len(&f.batch);
    float *got = malloc(n * sizeof(float));
    for (int i = 0; i < 4; i++) {
        pi0_error err = {0};
        f.batch.num_steps = cases[i].steps;
        f.batch.uniform_shape = cases[i].uniform;
        /* twice: the first call runs eagerly, the second replays the captured graph */
        for (int run = 0; run < 2; run++) {
            REQUIRE(pi0_sample_actions(m, &f.batch, got, NULL, &err) == PI0_OK, "%s", err.message);
            float *ref = f32_of(st_find(&f.io, cases[i].key));
            double e = rel_error(got, ref, n), worst = 0;
            size_t per = n / f.batch.batch;
            for (int b = 0; b < f.batch.batch; b++) worst = fmax(worst, rel_error(got + b * per, ref + b * per, per));
            fprintf(stderr, "  %s %s%s (%s): rel error %.3g, worst sample %.3g\n", name, cases[i].key,
                    cases[i].uniform ? " uniform" : "", run ? "graph" : "eager", e, worst);
            CHECK(worst <= TOL_BF16, "%s %s: %.3g > %g", name, cases[i].key, worst, TOL_BF16);
            free(ref);
        }
    }
    free(got);
    pi0_model_free(m);
    io_close(&f);
}

TEST(fixture_pi0_tiny) { fixture_case("pi0_tiny"); }
TEST(fixture_pi0_tiny_h50) { fixture_case("pi0_tiny_h50"); }
TEST(fixture_pi05_tiny) { fixture_case("pi05_tiny"); }
TEST(fixture_pi05_tiny_h50) { fixture_case("pi05_tiny_h50"); }

/* Each sample of a fixture alone: 11 (Pi0) or 10 (Pi0.5) suffix rows take the skinny Linears, against
 * openpi's fp32 actions of that sample and against the CPU backend. */
static void fixture_by_sample(const char *name) {
    fixture_io f;
    REQUIRE(io_open(&f, name) == 0);
    pi0_model *gpu = load(name, PI0_BACKEND_CUDA), *cpu = load(name, PI0_BACKEND_CPU);
    REQUIRE(gpu && cpu);
    int B = f.batch.batch, H = f.batch.horizon;
    size_t per = (size_t)H * 32;
    float *got = malloc(per * sizeof(float)), *ref = malloc(per * sizeof(float));
    float *golden = f32_of(st_find(&f.io, "actions"));
    for (int b = 0; b < B; b++) {
        const float *images[3];
        for (int c = 0; c < 3; c++) images[c] = f.images[c] + (size_t)b * 224 * 224 * 3;
        pi0_batch one = f.batch;
        one.batch = 1, one.num_steps = 10, one.images = images, one.image_masks = f.masks + b * 3;
        one.prompt_ids = f.prompt_ids + b * f.batch.prompt_len, one.prompt_mask = f.prompt_mask + b * f.batch.prompt_len;
        one.state = f.state + b * 32, one.noise = f.noise + (size_t)b * per;
        pi0_error err = {0};
        for (int run = 0; run < 2; run++) /* eager, then the graph */
            REQUIRE(pi0_sample_actions(gpu, &one, got, NULL, &err) == PI0_OK, "%s", err.message);
        REQUIRE(pi0_sample_actions(cpu, &one, ref, NULL, &err) == PI0_OK, "%s", err.message);
        double e_gold = rel_error(got, golden + b * per, per), e_cpu = rel_error(got, ref, per);
        fprintf(stderr, "  %s sample %d alone: vs golden %.3g, vs cpu %.3g\n", name, b, e_gold, e_cpu);
        CHECK(e_gold <= TOL_BF16 && e_cpu <= TOL_BF16, "%s sample %d: %.3g %.3g", name, b, e_gold, e_cpu);
    }
    free(got), free(ref), free(golden);
    pi0_model_free(gpu), pi0_model_free(cpu);
    io_close(&f);
}

TEST(fixture_pi0_tiny_by_sample) { fixture_by_sample("pi0_tiny"); }
TEST(fixture_pi05_tiny_by_sample) { fixture_by_sample("pi05_tiny"); }

static float *bf16_to_floats(const uint16_t *h, size_t n) {
    float *out = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) out[i] = bf16_value(h[i]);
    return out;
}

/* The vision tokens and the K/V cache rows of the valid prefix tokens, read out of the graph's device block
 * after a call (a white-box look at graph.c's buffers: backend.h), against openpi's fp32 intermediates at
 * the bf16 tolerance. */
static void fixture_intermediates(const char *name) {
    fixture_io f;
    REQUIRE(io_open(&f, name) == 0);
    pi0_model *m = load(name, PI0_BACKEND_CUDA);
    REQUIRE(m);
    const pi0_dims *d = pi0_model_dims(m);
    float *actions = malloc(actions_len(&f.batch) * sizeof(float));
    pi0_error err = {0};
    f.batch.num_steps = 1;
    REQUIRE(pi0_sample_actions(m, &f.batch, actions, NULL, &err) == PI0_OK, "%s", err.message);
    pi0_plan plan;
    REQUIRE(plan_build(d, &f.batch, &plan, &err) == PI0_OK, "%s", err.message);
    const cuda_state *s = m->backend_state;
    const cuda_graph *g = s->graphs[0];
    REQUIRE(g && g->shape.batch == plan.batch && g->shape.total_prefix == plan.total_prefix, "no graph of this shape");
    int P = (d->image_size / d->patch_size) * (d->image_size / d->patch_size), D = d->llm.width, B = plan.batch;
    int kv = d->llm.num_kv_heads * d->llm.head_dim;

    float *vision = malloc((size_t)plan.num_images * P * D * sizeof(float));
    CUDA_OK(cudaMemcpy(vision, g->vision, (size_t)plan.num_images * P * D * sizeof(float), cudaMemcpyDeviceToHost));
    int image = 0;
    double worst_vision = 0;
    for (int b = 0; b < B; b++)
        for (int c = 0; c < 3; c++) {
            if (!f.masks[b * 3 + c]) continue;
            char key[64];
            snprintf(key, sizeof key, "vision_tokens/%s", cameras[c]);
            float *ref = f32_of(st_find(&f.io, key));
            worst_vision = fmax(worst_vision, rel_error(vision + (size_t)image++ * P * D, ref + (size_t)b * P * D, (size_t)P * D));
            free(ref);
        }
    CHECK(worst_vision <= TOL_BF16, "%s vision tokens: %.3g", name, worst_vision);

    const st_tensor *kt = st_find(&f.io, "kv_k"), *vt = st_find(&f.io, "kv_v"), *mt = st_find(&f.io, "prefix_mask");
    float *kref = f32_of(kt), *vref = f32_of(vt);
    const uint8_t *prefix_mask = mt->data;
    int Ppad = (int)kt->shape[2];
    size_t layer_elems = (size_t)plan.cache_rows * kv;
    uint16_t *bits = malloc(layer_elems * 2 * sizeof(uint16_t));
    double worst_kv = 0;
    for (int l = 0; l < d->llm.depth; l++) {
        CUDA_OK(cudaMemcpy(bits, g->cache_k + l * layer_elems, layer_elems * 2, cudaMemcpyDeviceToHost));
        CUDA_OK(cudaMemcpy(bits + layer_elems, g->cache_v + l * layer_elems, layer_elems * 2, cudaMemcpyDeviceToHost));
        float *kmine = bf16_to_floats(bits, layer_elems), *vmine = bf16_to_floats(bits + layer_elems, layer_elems);
        float *kg = malloc((size_t)plan.total_prefix * kv * 4), *vg = malloc((size_t)plan.total_prefix * kv * 4);
        float *km = malloc((size_t)plan.total_prefix * kv * 4), *vm = malloc((size_t)plan.total_prefix * kv * 4);
        size_t valid = 0;
        for (int b = 0; b < B; b++)
            for (int p = 0, row = 0; p < Ppad; p++) {
                if (!prefix_mask[(size_t)b * Ppad + p]) continue;
                size_t gold = (((size_t)l * B + b) * Ppad + p) * kv, mine = (size_t)(plan.cache_start[b] + row++) * kv;
                memcpy(kg + valid * kv, kref + gold, kv * 4), memcpy(vg + valid * kv, vref + gold, kv * 4);
                memcpy(km + valid * kv, kmine + mine, kv * 4), memcpy(vm + valid * kv, vmine + mine, kv * 4);
                valid++;
            }
        worst_kv = fmax(worst_kv, fmax(rel_error(km, kg, valid * kv), rel_error(vm, vg, valid * kv)));
        free(kmine), free(vmine), free(kg), free(vg), free(km), free(vm);
    }
    fprintf(stderr, "  %s intermediates: vision tokens %.3g, K/V rows %.3g\n", name, worst_vision, worst_kv);
    CHECK(worst_kv <= TOL_BF16, "%s K/V rows: %.3g", name, worst_kv);
    free(bits), free(kref), free(vref), free(vision), free(actions);
    plan_free(&plan);
    pi0_model_free(m);
    io_close(&f);
}

TEST(fixture_pi0_tiny_intermediates) { fixture_intermediates("pi0_tiny"); }
TEST(fixture_pi05_tiny_intermediates) { fixture_intermediates("pi05_tiny"); }

/* A B = 5 batch with every mask pattern and prompt length, against the CPU backend per sample. Its 8 valid images
 * (4.8 MB) pass PLAN_HOST_THREADS_BYTES: the host checks and copies them on its threads. */
TEST(ragged_batch_matches_cpu) {
    fixture_io f;
    REQUIRE(io_open(&f, "pi0_tiny") == 0);
    pi0_model *gpu = load("pi0_tiny", PI0_BACKEND_CUDA), *cpu = load("pi0_tiny", PI0_BACKEND_CPU);
    REQUIRE(gpu && cpu);
    enum { B = 5, S = 16 };
    size_t image = 224 * 224 * 3;
    float *imgs[3];
    const float *ptrs[3];
    uint8_t masks[B * 3] = {1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0};
    REQUIRE(8 * image * sizeof(float) > PLAN_HOST_THREADS_BYTES, "the batch no longer takes the host's threads");
    int32_t ids[B * S];
    uint8_t id_mask[B * S];
    float state[B * 32], noise[B * 10 * 32];
    for (int c = 0; c < 3; c++) {
        ptrs[c] = imgs[c] = malloc(B * image * sizeof(float));
        fill_uniform(imgs[c], B * image, 1.0f);
    }
    for (int i = 0; i < B * S; i++) ids[i] = (int32_t)((gpu_uniform() + 1) * 255.9f), id_mask[i] = (i % S) < 3 + 3 * (i / S);
    fill_uniform(state, B * 32, 1.0f), fill_uniform(noise, B * 10 * 32, 1.5f);
    pi0_batch batch = {.batch = B, .num_cameras = 3, .images = ptrs, .image_masks = masks, .prompt_len = S,
                       .prompt_ids = ids, .prompt_mask = id_mask, .state = state, .horizon = 10, .noise = noise,
                       .num_steps = 10};
    float a_gpu[B * 10 * 32], a_cpu[B * 10 * 32];
    pi0_error err = {0};
    REQUIRE(pi0_sample_actions(gpu, &batch, a_gpu, NULL, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(cpu, &batch, a_cpu, NULL, &err) == PI0_OK, "%s", err.message);
    for (int b = 0; b < B; b++) {
        double e = rel_error(a_gpu + b * 320, a_cpu + b * 320, 320);
        CHECK(e <= TOL_BF16, "sample %d (cameras %d%d%d, %d tokens): %.3g", b, masks[3 * b], masks[3 * b + 1],
              masks[3 * b + 2], 3 + 3 * b, e);
    }
    imgs[1][5 * image - 1] = NAN; /* the last valid image's last value, found by a thread of the copy */
    CHECK(pi0_sample_actions(gpu, &batch, a_gpu, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the image of camera 1, sample 4 is nan at (y 223, x 223, channel 2)"), "%s", err.message);
    for (int c = 0; c < 3; c++) free(imgs[c]);
    pi0_model_free(gpu), pi0_model_free(cpu);
    io_close(&f);
}

/* One sample alone (11 suffix rows: the shape of a robot's request) against the CPU backend and the
 * golden actions, eager and replayed. */
TEST(single_sample_matches_cpu) {
    fixture_io f;
    REQUIRE(io_open(&f, "pi0_tiny") == 0);
    pi0_model *gpu = load("pi0_tiny", PI0_BACKEND_CUDA), *cpu = load("pi0_tiny", PI0_BACKEND_CPU);
    REQUIRE(gpu && cpu);
    pi0_batch one = f.batch;
    one.batch = 1;
    one.num_steps = 10;
    float eager[320], replay[320], ref[320];
    pi0_error err = {0};
    REQUIRE(pi0_sample_actions(gpu, &one, eager, NULL, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(gpu, &one, replay, NULL, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(cpu, &one, ref, NULL, &err) == PI0_OK, "%s", err.message);
    float *golden = f32_of(st_find(&f.io, "actions"));
    double e_cpu = rel_error(replay, ref, 320), e_gold = rel_error(replay, golden, 320);
    fprintf(stderr, "  one sample: vs cpu %.3g, vs golden %.3g\n", e_cpu, e_gold);
    CHECK(e_cpu <= TOL_BF16 && e_gold <= TOL_BF16, "one sample: %.3g %.3g", e_cpu, e_gold);
    CHECK(memcmp(eager, replay, sizeof eager) == 0, "replay differs from the eager call");
    free(golden);
    pi0_model_free(gpu), pi0_model_free(cpu);
    io_close(&f);
}

/* One sample at horizon H against the CPU backend. At 20 (21 suffix rows for Pi0, 20 for Pi0.5): the skinny path's
 * blocks of two row tiles, and the step's first and last Linears over them. At 32, Pi0's first step (33 rows, its
 * state token with the actions) is past the skinny Linears and its later steps (32 action rows) are not: the two
 * paths hand the suffix over between steps. */
static void horizon_matches_cpu(const char *name, int H) {
    fixture_io f;
    REQUIRE(io_open(&f, name) == 0);
    pi0_model *gpu = load(name, PI0_BACKEND_CUDA), *cpu = load(name, PI0_BACKEND_CPU);
    REQUIRE(gpu && cpu);
    enum { MAX_H = 32, N = MAX_H * 32 };
    REQUIRE(H <= MAX_H);
    float noise[N], got[N], ref[N];
    fill_uniform(noise, N, 1.5f);
    pi0_batch one = f.batch;
    one.batch = 1, one.num_steps = 10, one.horizon = H, one.noise = noise;
    pi0_error err = {0};
    REQUIRE(pi0_sample_actions(gpu, &one, got, NULL, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(cpu, &one, ref, NULL, &err) == PI0_OK, "%s", err.message);
    double e = rel_error(got, ref, (size_t)H * 32);
    fprintf(stderr, "  %s at horizon %d: vs cpu %.3g\n", name, H, e);
    CHECK(e <= TOL_BF16, "%s at horizon %d: %.3g", name, H, e);
    pi0_model_free(gpu), pi0_model_free(cpu);
    io_close(&f);
}

TEST(horizon_20_pi0_matches_cpu) { horizon_matches_cpu("pi0_tiny", 20); }
TEST(horizon_20_pi05_matches_cpu) { horizon_matches_cpu("pi05_tiny", 20); }
TEST(horizon_32_pi0_matches_cpu) { horizon_matches_cpu("pi0_tiny", 32); }

/* Eager (no graph), first graph call (eager, then capture), replays: all bitwise identical. */
TEST(graph_replay_equals_eager_and_repeats) {
    fixture_io f;
    REQUIRE(io_open(&f, "pi0_tiny") == 0);
    pi0_model *m = load("pi0_tiny", PI0_BACKEND_CUDA);
    REQUIRE(m);
    size_t n = actions_len(&f.batch);
    float *eager = malloc(n * 4), *replay = malloc(n * 4);
    pi0_error err = {0};
    f.batch.num_steps = 10;
    setenv("PI0_CUDA_GRAPHS", "0", 1);
    REQUIRE(pi0_sample_actions(m, &f.batch, eager, NULL, &err) == PI0_OK, "%s", err.message);
    unsetenv("PI0_CUDA_GRAPHS");
    for (int i = 0; i < 6; i++) {
        pi0_timings t = {0};
        REQUIRE(pi0_sample_actions(m, &f.batch, replay, &t, &err) == PI0_OK, "%s", err.message);
        CHECK(memcmp(eager, replay, n * 4) == 0, "call %d differs from the eager run (rel %.3g)", i, rel_error(replay, eager, n));
        /* stage timings come from events inside the graph: every replay must report them */
        CHECK(t.vision_ms > 0 && t.prefix_ms > 0 && t.denoise_ms > 0 && isfinite(t.total_ms), "call %d timings %g %g %g", i,
              t.vision_ms, t.prefix_ms, t.denoise_ms);
    }
    /* other inputs through the same graph: the graph reads the new inputs, not the captured ones */
    for (size_t i = 0; i < n; i++) f.noise[i] = -f.noise[i];
    setenv("PI0_CUDA_GRAPHS", "0", 1);
    REQUIRE(pi0_sample_actions(m, &f.batch, eager, NULL, &err) == PI0_OK);
    unsetenv("PI0_CUDA_GRAPHS");
    REQUIRE(pi0_sample_actions(m, &f.batch, replay, NULL, &err) == PI0_OK);
    CHECK(memcmp(eager, replay, n * 4) == 0, "replay with new inputs differs from eager");
    free(eager), free(replay);
    pi0_model_free(m);
    io_close(&f);
}

/* The first denoise step beside the prefix (forward.c's first_step_beside: in a graph, up to 64 suffix rows) gives, bit
 * for bit, the actions of the same model with it off (PI0_BESIDE=0): the same kernels on the same data, so a
 * difference is a missing dependency (an expert layer reading its LLM layer's K/V before they are written, or step 1
 * starting before step 0 ends). Each call has new images and a new prompt, so that K/V left in the cache by the call
 * before are wrong ones; two prompt lengths in turn, so that each shape runs eagerly (not beside) and then replays its
 * graph (beside). B samples at horizon H: one at 10 is the skinny path, two at 10 and one at 50 the cuBLASLt GEMMs
 * around it or everywhere (the side stream's own workspace). */
static void beside_equals_serial(pi0_dims dims, int B, int H) {
    dims.action_horizon = H;
    pi0_options opts = {.backend = PI0_BACKEND_CUDA};
    pi0_model *beside = NULL, *serial = NULL;
    pi0_error err = {0};
    setenv("PI0_GEMM_TUNE", "0", 1); /* each model's tuner could time two algorithms alike and pick either */
    pi0_status st = pi0_model_random(&dims, 7, &opts, &beside, &err);
    setenv("PI0_BESIDE", "0", 1);
    if (!st) st = pi0_model_random(&dims, 7, &opts, &serial, &err);
    unsetenv("PI0_BESIDE"), unsetenv("PI0_GEMM_TUNE");
    REQUIRE(st == PI0_OK, "%s", err.message);
    CHECK(((cuda_state *)beside->backend_state)->side && !((cuda_state *)serial->backend_state)->side,
          "PI0_BESIDE does not switch the side stream");
    enum { P = 40 };
    int A = dims.action_dim;
    size_t image = (size_t)B * dims.image_size * dims.image_size * 3, n = (size_t)B * H * A;
    float *imgs[3], *state = malloc(B * A * 4), *noise = malloc(n * 4), *got = malloc(n * 4), *ref = malloc(n * 4);
    const float *ptrs[3];
    uint8_t masks[2 * 3] = {1, 1, 0, 1, 0, 1}, id_mask[2 * P];
    int32_t ids[2 * P];
    for (int c = 0; c < 3; c++) ptrs[c] = imgs[c] = malloc(image * sizeof(float));
    pi0_batch batch = {.batch = B, .num_cameras = 3, .images = ptrs, .image_masks = masks, .prompt_len = P,
                       .prompt_ids = ids, .prompt_mask = id_mask, .state = state, .horizon = H, .noise = noise,
                       .num_steps = 10};
    for (int call = 0; call < 6; call++) {
        for (int c = 0; c < 3; c++) fill_uniform(imgs[c], image, 1.0f);
        for (int i = 0; i < B * P; i++)
            ids[i] = (int32_t)((gpu_uniform() + 1) * 0.499f * dims.vocab_size), id_mask[i] = i % P < P - call % 2;
        fill_uniform(state, B * A, 1.0f), fill_uniform(noise, n, 1.5f);
        REQUIRE(pi0_sample_actions(serial, &batch, ref, NULL, &err) == PI0_OK, "%s", err.message);
        REQUIRE(pi0_sample_actions(beside, &batch, got, NULL, &err) == PI0_OK, "%s", err.message);
        CHECK(memcmp(got, ref, n * 4) == 0, "%s B %d H %d call %d: beside differs from serial (rel %.3g)",
              pi0_model_kind_name(dims.kind), B, H, call, rel_error(got, ref, n));
    }
    const cuda_state *with = beside->backend_state, *without = serial->backend_state;
    CHECK(with->num_graphs == 2 && without->num_graphs == 2, "a graph per prompt length");
    for (int i = 0; i < with->num_graphs; i++) CHECK(with->graphs[i]->first_step_beside, "graph %d: not beside", i);
    for (int i = 0; i < without->num_graphs; i++) CHECK(!without->graphs[i]->first_step_beside, "PI0_BESIDE=0: beside");
    for (int c = 0; c < 3; c++) free(imgs[c]);
    free(state), free(noise), free(got), free(ref);
    pi0_model_free(beside), pi0_model_free(serial);
}

/* A small model whose prefix (40 prompt tokens, 4 layers of width 512) outlasts the step's first layers, and the
 * real-size ones. */
static pi0_dims small_dims(pi0_model_kind kind) {
    pi0_dims d = kind == PI0_MODEL_PI05 ? pi0_dims_pi05() : pi0_dims_pi0();
    d.vision = (pi0_stack_dims){128, 2, 256, 2, 2, 64};
    d.image_size = 112;
    d.llm = (pi0_stack_dims){512, 4, 2048, 8, 1, 64};
    d.expert = (pi0_stack_dims){256, 4, 1024, 8, 1, 64};
    d.vocab_size = 1000, d.max_token_len = 48;
    return d;
}

TEST(first_step_beside_prefix_pi0) {
    beside_equals_serial(small_dims(PI0_MODEL_PI0), 1, 10);
    beside_equals_serial(small_dims(PI0_MODEL_PI0), 2, 10);
}
TEST(first_step_beside_prefix_pi05) {
    beside_equals_serial(small_dims(PI0_MODEL_PI05), 1, 10);
    beside_equals_serial(small_dims(PI0_MODEL_PI05), 1, 50);
}
TEST(first_step_beside_prefix_full_size) {
    beside_equals_serial(pi0_dims_pi0(), 1, 10);
    beside_equals_serial(pi0_dims_pi0(), 1, 50);
}

/* The step boundary as one kernel (forward.c's euler_boundary) gives, bit for bit, the actions of the kernels it
 * replaces (PI0_FUSED_EULER=0): the same sums in the same order, so a difference is a wrong buffer (x_t after an odd
 * or even step count, Pi0.5's alternating bf16 rows) or a missing dependency. Step counts 10, 3 and 1 (the update alone
 * at the first step), each eagerly and then replayed; horizon 16 is the last the kernel takes, 17 keeps the separate
 * kernels (the flag is checked both ways). */
static void fused_euler_equals_separate(pi0_dims dims, int H) {
    dims.action_horizon = H;
    pi0_options opts = {.backend = PI0_BACKEND_CUDA};
    pi0_model *fused = NULL, *separate = NULL;
    pi0_error err = {0};
    setenv("PI0_GEMM_TUNE", "0", 1);
    pi0_status st = pi0_model_random(&dims, 11, &opts, &fused, &err);
    setenv("PI0_FUSED_EULER", "0", 1);
    if (!st) st = pi0_model_random(&dims, 11, &opts, &separate, &err);
    unsetenv("PI0_FUSED_EULER"), unsetenv("PI0_GEMM_TUNE");
    REQUIRE(st == PI0_OK, "%s", err.message);
    enum { P = 24 };
    int A = dims.action_dim;
    size_t image = (size_t)dims.image_size * dims.image_size * 3, n = (size_t)H * A;
    float *imgs[2], *state = malloc(A * 4), *noise = malloc(n * 4), *got = malloc(n * 4), *ref = malloc(n * 4);
    const float *ptrs[2];
    uint8_t masks[2] = {1, 1}, id_mask[P];
    int32_t ids[P];
    for (int c = 0; c < 2; c++) ptrs[c] = imgs[c] = malloc(image * sizeof(float));
    pi0_batch batch = {.batch = 1, .num_cameras = 2, .images = ptrs, .image_masks = masks, .prompt_len = P,
                       .prompt_ids = ids, .prompt_mask = id_mask, .state = state, .horizon = H, .noise = noise};
    const int steps[] = {10, 3, 1};
    for (int call = 0; call < 6; call++) {
        batch.num_steps = steps[call % 3];
        for (int c = 0; c < 2; c++) fill_uniform(imgs[c], image, 1.0f);
        for (int i = 0; i < P; i++) ids[i] = (int32_t)((gpu_uniform() + 1) * 0.499f * dims.vocab_size), id_mask[i] = 1;
        fill_uniform(state, A, 1.0f), fill_uniform(noise, n, 1.5f);
        REQUIRE(pi0_sample_actions(separate, &batch, ref, NULL, &err) == PI0_OK, "%s", err.message);
        REQUIRE(pi0_sample_actions(fused, &batch, got, NULL, &err) == PI0_OK, "%s", err.message);
        CHECK(memcmp(got, ref, n * 4) == 0, "%s H %d steps %d call %d: fused step boundary differs (rel %.3g)",
              pi0_model_kind_name(dims.kind), H, batch.num_steps, call, rel_error(got, ref, n));
    }
    const cuda_state *with = fused->backend_state, *without = separate->backend_state;
    CHECK(with->num_graphs == 3 && without->num_graphs == 3, "a graph per step count");
    for (int i = 0; i < with->num_graphs; i++)
        CHECK(with->graphs[i]->fused_euler == (H <= 16), "H %d graph %d: fused_euler %d", H, i, with->graphs[i]->fused_euler);
    for (int i = 0; i < without->num_graphs; i++) CHECK(!without->graphs[i]->fused_euler, "PI0_FUSED_EULER=0: fused");
    for (int c = 0; c < 2; c++) free(imgs[c]);
    free(state), free(noise), free(got), free(ref);
    pi0_model_free(fused), pi0_model_free(separate);
}

TEST(fused_euler_pi0) {
    fused_euler_equals_separate(small_dims(PI0_MODEL_PI0), 10);
    fused_euler_equals_separate(small_dims(PI0_MODEL_PI0), 16);
    fused_euler_equals_separate(small_dims(PI0_MODEL_PI0), 17);
    fused_euler_equals_separate(pi0_dims_pi0(), 10);
}
TEST(fused_euler_pi05) {
    fused_euler_equals_separate(small_dims(PI0_MODEL_PI05), 10);
    fused_euler_equals_separate(small_dims(PI0_MODEL_PI05), 16);
    fused_euler_equals_separate(pi0_dims_pi05(), 10);
}

/* More shapes than the cache holds (PI0_CUDA_MAX_GRAPHS=4), alternating step counts and batch sizes (the
 * workspace grows, dropping the graphs made so far): each result stays what it was the first time. */
TEST(graph_cache_many_shapes) {
    fixture_io f;
    REQUIRE(io_open(&f, "pi0_tiny") == 0);
    setenv("PI0_CUDA_MAX_GRAPHS", "4", 1);
    pi0_model *m = load("pi0_tiny", PI0_BACKEND_CUDA);
    unsetenv("PI0_CUDA_MAX_GRAPHS");
    REQUIRE(m);
    enum { SHAPES = 7 };
    float *first[SHAPES];
    pi0_error err = {0};
    for (int round = 0; round < 2; round++)
        for (int sh = 0; sh < SHAPES; sh++) {
            pi0_batch b = f.batch;
            b.num_steps = 1 + sh; /* each step count is its own graph and its own step tables */
            b.batch = 1 + sh % 2; /* the workspace grows for the second sample */
            float *out = malloc(actions_len(&b) * 4);
            REQUIRE(pi0_sample_actions(m, &b, out, NULL, &err) == PI0_OK, "%s", err.message);
            if (round == 0) first[sh] = out;
            else {
                CHECK(memcmp(first[sh], out, actions_len(&b) * 4) == 0, "shape %d changed on its second visit", sh);
                free(out);
                free(first[sh]);
            }
        }
    pi0_model_free(m);
    io_close(&f);
}

/* Fresh random frames of the sizes in `sizes` (one per camera of each sample, masked ones NULL), and the images
 * openpi's transforms make of them on the host into f->images. */
static void make_frames(fixture_io *f, const int (*sizes)[2], int nsizes, int offset, pi0_frame *frames) {
    int C = 3;
    size_t image = (size_t)224 * 224 * 3;
    for (int i = 0; i < f->batch.batch * C; i++) {
        int h = sizes[(i + offset) % nsizes][0], w = sizes[(i + offset) % nsizes][1];
        free((void *)frames[i].pixels);
        frames[i] = (pi0_frame){0};
        if (!f->masks[i]) continue;
        uint8_t *px = malloc((size_t)h * w * 3);
        for (size_t k = 0; k < (size_t)h * w * 3; k++) px[k] = (uint8_t)((gpu_uniform() + 1.0f) * 127.99f);
        frames[i] = (pi0_frame){px, h, w};
        pi0_image img = {.data = px, .type = PI0_PIXEL_U8, .layout = PI0_LAYOUT_HWC, .height = h, .width = w, .channels = 3};
        pi0_error err = {0};
        REQUIRE(pi0_image_preprocess(&img, 224, f->images[i % C] + (size_t)(i / C) * image, &err) == PI0_OK, "%s",
                err.message);
    }
}

/* The batch's frames with every other one copied into page-locked memory (pi0_host_alloc), which the backend sends
 * from where it is rather than staging it: the same actions as `want`, to the bit. */
static void pinned_frames_equal(pi0_model *gpu, pi0_batch b, const pi0_frame *frames, int count, const float *want,
                                int call) {
    pi0_frame locked[3 * 64];
    size_t n = actions_len(&b);
    float *got = malloc(n * 4);
    memcpy(locked, frames, sizeof(pi0_frame) * count);
    for (int i = 0; i < count; i += 2) {
        if (!frames[i].pixels) continue;
        size_t bytes = (size_t)frames[i].height * frames[i].width * 3;
        uint8_t *px = pi0_host_alloc(bytes);
        REQUIRE(px, "pi0_host_alloc");
        struct cudaPointerAttributes a;
        REQUIRE(cudaPointerGetAttributes(&a, px) == cudaSuccess && a.type == cudaMemoryTypeHost,
                "pi0_host_alloc's memory is not page-locked: the test would not take the pinned path");
        memcpy(px, frames[i].pixels, bytes);
        locked[i].pixels = px;
    }
    b.images = NULL, b.frames = locked;
    pi0_error err = {0};
    REQUIRE(pi0_sample_actions(gpu, &b, got, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(memcmp(got, want, n * 4) == 0, "call %d: pinned frames give other actions (%.3g)", call, rel_error(got, want, n));
    for (int i = 0; i < count; i += 2)
        if (frames[i].pixels) pi0_host_free((void *)locked[i].pixels);
    free(got);
}

/* Camera frames (pi0_batch.frames) resized on the GPU give, bit for bit, the actions of the images the host
 * makes of them: eager, replayed, replayed with frames of other sizes and contents (the graph reads each call's
 * frames), and in uniform mode, from malloc's memory and (pinned_frames_equal) page-locked memory; and the CPU
 * backend's actions for the same frames within the bf16 tolerance. */
TEST(frames_resized_on_gpu_equal_host_images) {
    fixture_io f;
    REQUIRE(io_open(&f, "pi0_tiny") == 0);
    pi0_model *gpu = load("pi0_tiny", PI0_BACKEND_CUDA), *cpu = load("pi0_tiny", PI0_BACKEND_CPU);
    REQUIRE(gpu && cpu);
    const int sizes[][2] = {{256, 256}, {180, 320}, {224, 224}, {37, 500}, {480, 640}, {100, 60}, {1, 1}};
    pi0_frame frames[3 * 64] = {{0}};
    size_t n = actions_len(&f.batch);
    float *from_images = malloc(n * 4), *from_frames = malloc(n * 4), *on_cpu = malloc(n * 4);
    pi0_error err = {0};
    f.batch.num_steps = 3;
    for (int call = 0; call < 4; call++) {
        if (call != 1) make_frames(&f, sizes, 7, call, frames); /* call 1 replays the same frames */
        pi0_batch b = f.batch;
        b.uniform_shape = call == 3;
        REQUIRE(pi0_sample_actions(gpu, &b, from_images, NULL, &err) == PI0_OK, "%s", err.message);
        b.images = NULL, b.frames = frames;
        REQUIRE(pi0_sample_actions(gpu, &b, from_frames, NULL, &err) == PI0_OK, "%s", err.message);
        CHECK(memcmp(from_images, from_frames, n * 4) == 0, "call %d%s: frames differ from their host images (%.3g)", call,
              b.uniform_shape ? " (uniform)" : "", rel_error(from_frames, from_images, n));
        pinned_frames_equal(gpu, b, frames, b.batch * b.num_cameras, from_frames, call);
        REQUIRE(pi0_sample_actions(cpu, &b, on_cpu, NULL, &err) == PI0_OK, "%s", err.message);
        double e = rel_error(from_frames, on_cpu, n);
        fprintf(stderr, "  call %d: frames on the GPU vs the CPU backend %.3g\n", call, e);
        CHECK(e <= TOL_BF16, "call %d: frames, GPU vs CPU %.3g", call, e);
    }
    for (int i = 0; i < 3 * 64; i++) free((void *)frames[i].pixels);
    free(from_images), free(from_frames), free(on_cpu);
    pi0_model_free(gpu), pi0_model_free(cpu);
    io_close(&f);
}

TEST(bad_input_on_cuda) {
    fixture_io f;
    REQUIRE(io_open(&f, "pi0_tiny") == 0);
    pi0_model *m = load("pi0_tiny", PI0_BACKEND_CUDA);
    REQUIRE(m);
    float out[2 * 10 * 32];
    pi0_error err = {0};
    f.prompt_ids[0] = 99999;
    CHECK(pi0_sample_actions(m, &f.batch, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT && strstr(err.message, "99999"));
    f.prompt_ids[0] = 3;
    CHECK(pi0_sample_actions(m, &f.batch, out, NULL, &err) == PI0_OK, "%s", err.message);
    /* NaN or infinity in a valid camera's image is found on the device (im2col) and named as the CPU's check names
     * it; a masked camera's image is not read; the model serves the next call as before */
    REQUIRE(f.masks[1 * 3 + 1] && !f.masks[0 * 3 + 2], "the fixture's masks changed");
    size_t image = (size_t)224 * 224 * 3;
    float *pixel = &f.images[1][image + (5 * 224 + 7) * 3 + 2], keep = *pixel; /* sample 1, camera 1, y 5, x 7, ch 2 */
    *pixel = NAN;
    CHECK(pi0_sample_actions(m, &f.batch, out, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the image of camera 1, sample 1 is nan at (y 5, x 7, channel 2)"), "%s", err.message);
    *pixel = keep;
    f.images[2][image - 1] = INFINITY; /* sample 0's masked camera, its last value */
    float again[2 * 10 * 32];
    CHECK(pi0_sample_actions(m, &f.batch, again, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(!memcmp(out, again, sizeof out), "the call after the refusal differs from the one before it");
    pi0_model_free(m);
    io_close(&f);
}

/* Images in pinned memory (pi0_host_alloc) go to the device from where they are: the same actions as from malloc's
 * memory to the bit, eager and replayed, with masked cameras skipped or computed (uniform_shape); a NaN or infinity in
 * a valid camera's image is found and named there too, and a masked camera's is not read. */
TEST(pinned_images_on_cuda) {
    fixture_io f;
    REQUIRE(io_open(&f, "pi0_tiny") == 0);
    pi0_model *m = load("pi0_tiny", PI0_BACKEND_CUDA);
    REQUIRE(m);
    size_t image = (size_t)224 * 224 * 3, bytes = 2 * image * sizeof(float);
    REQUIRE(f.batch.batch == 2 && f.batch.num_cameras == 3 && f.masks[1 * 3 + 1] && !f.masks[0 * 3 + 2],
            "the fixture's batch changed");
    float *pinned_images[3];
    const float *ptrs[3];
    for (int c = 0; c < 3; c++) {
        REQUIRE((pinned_images[c] = pi0_host_alloc(bytes)) != NULL);
        memcpy(pinned_images[c], f.images[c], bytes);
        ptrs[c] = pinned_images[c];
        struct cudaPointerAttributes a;
        REQUIRE(cudaPointerGetAttributes(&a, pinned_images[c] + image) == cudaSuccess && a.type == cudaMemoryTypeHost,
                "pi0_host_alloc's memory is not page-locked: the test would not take the pinned path");
    }
    pi0_batch paged = f.batch, locked = f.batch;
    locked.images = ptrs;
    float want[2][2 * 10 * 32], got[2 * 10 * 32];
    pi0_error err = {0};
    for (int uniform = 0; uniform < 2; uniform++) {
        paged.uniform_shape = locked.uniform_shape = uniform;
        REQUIRE(pi0_sample_actions(m, &paged, want[uniform], NULL, &err) == PI0_OK, "%s", err.message);
        for (int call = 0; call < 2; call++) { /* a new shape's first call runs eagerly, the next replays its graph */
            memset(got, 0, sizeof got);
            REQUIRE(pi0_sample_actions(m, &locked, got, NULL, &err) == PI0_OK, "%s", err.message);
            CHECK(!memcmp(want[uniform], got, sizeof got), "uniform %d, call %d: pinned images give other actions (%.3g)",
                  uniform, call, rel_error(got, want[uniform], 2 * 10 * 32));
        }
    }
    locked.uniform_shape = 0;
    float *pixel = &pinned_images[1][image + (5 * 224 + 7) * 3 + 2], keep = *pixel; /* sample 1, camera 1, y 5, x 7 */
    *pixel = NAN;
    CHECK(pi0_sample_actions(m, &locked, got, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the image of camera 1, sample 1 is nan at (y 5, x 7, channel 2)"), "%s", err.message);
    *pixel = keep;
    pinned_images[0][2 * image - 1] = -INFINITY; /* sample 1, camera 0, its last value */
    CHECK(pi0_sample_actions(m, &locked, got, NULL, &err) == PI0_ERR_INVALID_ARGUMENT &&
              strstr(err.message, "the image of camera 0, sample 1 is -inf at (y 223, x 223, channel 2)"), "%s",
          err.message);
    pinned_images[0][2 * image - 1] = f.images[0][2 * image - 1];
    pinned_images[2][image - 1] = INFINITY; /* sample 0's masked camera, its last value */
    CHECK(pi0_sample_actions(m, &locked, got, NULL, &err) == PI0_OK, "%s", err.message);
    CHECK(!memcmp(want[0], got, sizeof got), "the call after the refusals differs");
    for (int c = 0; c < 3; c++) pi0_host_free(pinned_images[c]);
    pi0_model_free(m);
    io_close(&f);
}

/* Eight samples at the real size: 88 suffix rows, past the skinny Linears (the expert through cuBLASLt, in partial
 * sums) with the few-queries attention over 8 segments, a path only the benchmarks' batch rows took. Samples 0-1 are
 * `two`'s (the caller compares them with the CPU's), samples 2-7 new ones with other cameras and prompt lengths, each
 * also run alone (the one-sample path, which the caller checks against the CPU): a8 gets the batch's actions, alone
 * the lone runs' (samples 2-7 at 2..7). */
enum { B8 = 8 };
static void batch_of_8_on_gpu(pi0_model *gpu, const pi0_batch *two, float *a8, float *alone) {
    const size_t image = 224 * 224 * 3;
    const int H = two->horizon, P = two->prompt_len, A = H * 32;
    float *imgs[3], *state = malloc(B8 * 32 * sizeof(float)), *noise = malloc((size_t)B8 * A * sizeof(float));
    const float *ptrs[3];
    uint8_t masks[B8 * 3], *id_mask = malloc((size_t)B8 * P);
    int32_t *ids = malloc((size_t)B8 * P * sizeof(int32_t));
    for (int c = 0; c < 3; c++) {
        ptrs[c] = imgs[c] = malloc(B8 * image * sizeof(float));
        memcpy(imgs[c], two->images[c], 2 * image * sizeof(float));
        fill_uniform(imgs[c] + 2 * image, (B8 - 2) * image, 1.0f);
    }
    static const uint8_t valid[B8 - 2][3] = {{1, 1, 1}, {1, 1, 1}, {0, 1, 0}, {1, 1, 0}, {1, 1, 1}, {0, 1, 1}};
    memcpy(masks, two->image_masks, 2 * 3), memcpy(masks + 2 * 3, valid, sizeof valid);
    memcpy(ids, two->prompt_ids, 2 * P * sizeof(int32_t)), memcpy(id_mask, two->prompt_mask, 2 * P);
    for (int i = 2 * P; i < B8 * P; i++) ids[i] = (int32_t)((gpu_uniform() + 1) * 128000), id_mask[i] = i % P < P - i / P;
    memcpy(state, two->state, 2 * 32 * sizeof(float)), memcpy(noise, two->noise, 2 * (size_t)A * sizeof(float));
    fill_uniform(state + 2 * 32, (B8 - 2) * 32, 1.0f), fill_uniform(noise + 2 * A, (size_t)(B8 - 2) * A, 1.5f);
    pi0_batch batch = *two;
    batch.batch = B8, batch.images = ptrs, batch.image_masks = masks, batch.prompt_ids = ids, batch.prompt_mask = id_mask,
    batch.state = state, batch.noise = noise;
    pi0_error err = {0};
    REQUIRE(pi0_sample_actions(gpu, &batch, a8, NULL, &err) == PI0_OK, "%s", err.message);
    for (int b = 2; b < B8; b++) {
        const float *one_ptrs[3] = {imgs[0] + b * image, imgs[1] + b * image, imgs[2] + b * image};
        pi0_batch one = batch;
        one.batch = 1, one.images = one_ptrs, one.image_masks = masks + 3 * b, one.prompt_ids = ids + b * P,
        one.prompt_mask = id_mask + b * P, one.state = state + b * 32, one.noise = noise + (size_t)b * A;
        REQUIRE(pi0_sample_actions(gpu, &one, alone + (size_t)b * A, NULL, &err) == PI0_OK, "%s", err.message);
    }
    for (int c = 0; c < 3; c++) free(imgs[c]);
    free(state), free(noise), free(id_mask), free(ids);
}

/* The real size: the same random weights on both backends, actions within 2e-2. */
static void full_size_cuda_vs_cpu(pi0_dims dims) {
    pi0_options gpu_opts = {.backend = PI0_BACKEND_CUDA}, cpu_opts = {.backend = PI0_BACKEND_CPU};
    pi0_model *gpu = NULL, *cpu = NULL;
    pi0_error err = {0};
    REQUIRE(pi0_model_random(&dims, 5, &gpu_opts, &gpu, &err) == PI0_OK, "%s", err.message);
    fprintf(stderr, "  gpu memory after load: %.2f GB\n", pi0_model_device_memory(gpu) / 1e9);
    enum { B = 2, H = 10 };
    size_t image = 224 * 224 * 3;
    float *imgs[3];
    const float *ptrs[3];
    uint8_t masks[B * 3] = {1, 1, 0, 1, 1, 1};
    int32_t ids[B * 20];
    uint8_t id_mask[B * 20];
    float state[B * 32], noise[B * H * 32], a_gpu[B * H * 32], a_cpu[B * H * 32];
    for (int c = 0; c < 3; c++) {
        ptrs[c] = imgs[c] = malloc(B * image * sizeof(float));
        fill_uniform(imgs[c], B * image, 1.0f);
    }
    for (int i = 0; i < B * 20; i++) ids[i] = (int32_t)((gpu_uniform() + 1) * 128000), id_mask[i] = i < 20 || i % 20 < 12;
    fill_uniform(state, B * 32, 1.0f), fill_uniform(noise, B * H * 32, 1.5f);
    pi0_batch batch = {.batch = B, .num_cameras = 3, .images = ptrs, .image_masks = masks, .prompt_len = 20,
                       .prompt_ids = ids, .prompt_mask = id_mask, .state = state, .horizon = H, .noise = noise,
                       .num_steps = 10};
    pi0_timings t;
    float a_one[H * 32], noise_h50[50 * 32], a_h50[50 * 32], a_h50_cpu[50 * 32];
    REQUIRE(pi0_sample_actions(gpu, &batch, a_gpu, &t, &err) == PI0_OK, "%s", err.message);
    pi0_batch first = batch; /* sample 0 alone: another shape, another graph */
    first.batch = 1;
    REQUIRE(pi0_sample_actions(gpu, &first, a_one, &t, &err) == PI0_OK, "%s", err.message);
    /* sample 0 at horizon 50: the expert through cuBLASLt, with its Linears in partial sums (forward.c's stack_parts) */
    pi0_batch h50 = first;
    h50.horizon = 50, h50.noise = noise_h50;
    fill_uniform(noise_h50, 50 * 32, 1.5f);
    float a_h50_again[50 * 32]; /* the first call of a shape runs eagerly, the next from its graph (step 0 beside) */
    REQUIRE(pi0_sample_actions(gpu, &h50, a_h50, &t, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(gpu, &h50, a_h50_again, &t, &err) == PI0_OK, "%s", err.message);
    float *a8 = malloc(B8 * H * 32 * sizeof(float)), *a8_alone = malloc(B8 * H * 32 * sizeof(float));
    batch_of_8_on_gpu(gpu, &batch, a8, a8_alone);
    pi0_model_free(gpu);
    REQUIRE(pi0_model_random(&dims, 5, &cpu_opts, &cpu, &err) == PI0_OK, "%s", err.message);
    REQUIRE(pi0_sample_actions(cpu, &h50, a_h50_cpu, &t, &err) == PI0_OK, "%s", err.message);
    fprintf(stderr, "  cpu, one sample at horizon 50: %.0f ms\n", t.total_ms);
    REQUIRE(pi0_sample_actions(cpu, &batch, a_cpu, &t, &err) == PI0_OK, "%s", err.message);
    fprintf(stderr, "  cpu: %.0f ms\n", t.total_ms);
    double e_h50 = rel_error(a_h50, a_h50_cpu, 50 * 32);
    fprintf(stderr, "  sample 0 at horizon 50: cuda vs cpu rel error %.3g\n", e_h50);
    CHECK(e_h50 <= TOL_FULL_SIZE, "sample 0 at horizon 50: %.3g > %g", e_h50, TOL_FULL_SIZE);
    CHECK(!memcmp(a_h50, a_h50_again, sizeof a_h50), "horizon 50: the graph's actions differ from the eager call's");
    for (int b = 0; b < B; b++) {
        double e = rel_error(a_gpu + b * H * 32, a_cpu + b * H * 32, H * 32);
        fprintf(stderr, "  sample %d: cuda vs cpu rel error %.3g\n", b, e);
        CHECK(e <= TOL_FULL_SIZE, "sample %d: %.3g > %g", b, e, TOL_FULL_SIZE);
    }
    double e_one = rel_error(a_one, a_cpu, H * 32);
    fprintf(stderr, "  sample 0 alone: cuda vs cpu rel error %.3g\n", e_one);
    CHECK(e_one <= TOL_FULL_SIZE, "sample 0 alone: %.3g > %g", e_one, TOL_FULL_SIZE);
    for (int b = 0; b < B8; b++) { /* 0-1 against the CPU, 2-7 against the same sample alone */
        const float *ref = b < 2 ? a_cpu + b * H * 32 : a8_alone + b * H * 32;
        double e = rel_error(a8 + b * H * 32, ref, H * 32);
        fprintf(stderr, "  batch of 8, sample %d: vs %s %.3g\n", b, b < 2 ? "cpu" : "alone on cuda", e);
        CHECK(e <= TOL_FULL_SIZE, "batch of 8, sample %d: %.3g > %g", b, e, TOL_FULL_SIZE);
    }
    free(a8), free(a8_alone);
    for (int c = 0; c < 3; c++) free(imgs[c]);
    pi0_model_free(cpu);
}

TEST(full_size_pi0_cuda_vs_cpu) { full_size_cuda_vs_cpu(pi0_dims_pi0()); }
TEST(full_size_pi05_cuda_vs_cpu) { full_size_cuda_vs_cpu(pi0_dims_pi05()); }

int main(int argc, char **argv) {
    check_init(argc, argv);
    gpu_seed();
    RUN(fixture_pi0_tiny);
    RUN(fixture_pi0_tiny_h50);
    RUN(fixture_pi05_tiny);
    RUN(fixture_pi05_tiny_h50);
    RUN(fixture_pi0_tiny_by_sample);
    RUN(fixture_pi05_tiny_by_sample);
    RUN(fixture_pi0_tiny_intermediates);
    RUN(fixture_pi05_tiny_intermediates);
    RUN(ragged_batch_matches_cpu);
    RUN(single_sample_matches_cpu);
    RUN(horizon_20_pi0_matches_cpu);
    RUN(horizon_20_pi05_matches_cpu);
    RUN(horizon_32_pi0_matches_cpu);
    RUN(graph_replay_equals_eager_and_repeats);
    RUN(first_step_beside_prefix_pi0);
    RUN(first_step_beside_prefix_pi05);
    RUN(first_step_beside_prefix_full_size);
    RUN(fused_euler_pi0);
    RUN(fused_euler_pi05);
    RUN(graph_cache_many_shapes);
    RUN(frames_resized_on_gpu_equal_host_images);
    RUN(bad_input_on_cuda);
    RUN(pinned_images_on_cuda);
    RUN(full_size_pi0_cuda_vs_cpu);
    RUN(full_size_pi05_cuda_vs_cpu);
    return check_finish();
}
