/* bench.c - `pi0 bench`: latency of sample_actions on a synthetic robot workload. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "cli.h"
#include "util/clock.h"
#include "util/rng.h"

static const char *help =
    "usage: pi0 bench [--checkpoint DIR | --model pi0|pi05 | --dims FILE] [--backend auto|cpu|cuda] [--batch B]\n"
    "                 [--cameras 3] [--masked-cameras 1] [--prompt-len 20] [--horizon 10] [--steps 10]\n"
    "                 [--frame HxW] [--pageable] [--warmup W] [--iters N] [--seed N] [--json]\n"
    "\n"
    "Times sample_actions on random images, state, prompt and noise. --frame 256x256 gives the cameras as\n"
    "H x W uint8 frames, as a robot sends them, which the engine resizes and scales as openpi does (on the GPU\n"
    "with the cuda backend): what `pi0 serve` runs. Without it, images of the model's size in [-1, 1]. Either\n"
    "in memory from pi0_host_alloc (pinned: the GPU reads it as it is), or with --pageable in malloc's (the\n"
    "engine copies it into pinned memory first).\n"
    "Without --checkpoint the model\n"
    "is built from random weights of the real size of --model (default pi0), or of the dims in FILE (a\n"
    "config.json with a `dims` block as `pi0 init` writes). The default workload is the seed documents': one sample,\n"
    "3 cameras with the last one masked, 20 prompt tokens, horizon 10, 10 steps.\n"
    "Defaults: --warmup 1 --iters 5 on the CPU, --warmup 10 --iters 100 on a GPU.\n"
    "Prints mean, p50, p95, min, max latency, Hz, samples/s, peak memory and the time per stage.\n";

typedef struct {
    long long batch, cameras, masked, prompt_len, horizon, steps, warmup, iters, seed;
    int frame_h, frame_w; /* > 0: the cameras as uint8 frames of this size (pi0_batch.frames) */
    int pageable;         /* the images or frames in malloc's memory rather than pi0_host_alloc's */
} workload;

/* Random but deterministic inputs of the workload's shape. */
typedef struct {
    float **images;      /* from pi0_host_alloc, or malloc with pageable (as frame_pixels) */
    int pageable;
    pi0_frame *frames;   /* (B, cameras) with --frame, pointing into frame_pixels */
    uint8_t *frame_pixels;
    uint8_t *image_masks;
    int32_t *prompt_ids;
    uint8_t *prompt_mask;
    float *state, *noise, *actions;
} bench_inputs;

static void inputs_free(bench_inputs *in, int cameras) {
    for (int c = 0; in->images && c < cameras; c++) in->pageable ? free(in->images[c]) : pi0_host_free(in->images[c]);
    in->pageable ? free(in->frame_pixels) : pi0_host_free(in->frame_pixels);
    free(in->images), free(in->frames), free(in->image_masks), free(in->prompt_ids);
    free(in->prompt_mask);
    free(in->state), free(in->noise), free(in->actions);
}

static int inputs_make(bench_inputs *in, const workload *w, const pi0_dims *d) {
    size_t B = (size_t)w->batch, image = (size_t)d->image_size * d->image_size * 3, noise = B * w->horizon * d->action_dim;
    uint64_t stream = rng_mix64((uint64_t)w->seed);
    memset(in, 0, sizeof *in);
    in->pageable = w->pageable;
    in->images = calloc((size_t)w->cameras + 1, sizeof(float *));
    in->image_masks = malloc(B * w->cameras + 1);
    in->prompt_ids = malloc(B * w->prompt_len * sizeof(int32_t) + 1);
    in->prompt_mask = malloc(B * w->prompt_len + 1);
    in->state = malloc(B * d->action_dim * sizeof(float));
    in->noise = malloc(noise * sizeof(float));
    in->actions = malloc(noise * sizeof(float));
    if (!in->images || !in->image_masks || !in->prompt_ids || !in->prompt_mask || !in->state || !in->noise || !in->actions)
        return -1;
    for (int c = 0; c < w->cameras && !w->frame_h; c++) {
        size_t bytes = B * image * sizeof(float);
        if (!(in->images[c] = w->pageable ? malloc(bytes) : pi0_host_alloc(bytes))) return -1;
        for (size_t i = 0; i < B * image; i++) in->images[c][i] = rng_uniform_pm1(stream + 1 + c, i);
    }
    if (w->frame_h) {
        size_t frame = (size_t)w->frame_h * w->frame_w * 3, count = B * w->cameras;
        in->frame_pixels = w->pageable ? malloc(count * frame + 1) : pi0_host_alloc(count * frame + 1);
        if (!(in->frames = calloc(count + 1, sizeof *in->frames)) || !in->frame_pixels) return -1;
        for (size_t i = 0; i < count * frame; i++) in->frame_pixels[i] = (uint8_t)(rng_mix64(stream + 400 + i) >> 56);
        for (size_t i = 0; i < count; i++) in->frames[i] = (pi0_frame){in->frame_pixels + i * frame, w->frame_h, w->frame_w};
    }
    for (size_t b = 0; b < B; b++)
        for (int c = 0; c < w->cameras; c++) in->image_masks[b * w->cameras + c] = c < w->cameras - w->masked;
    for (size_t i = 0; i < B * w->prompt_len; i++) {
        in->prompt_ids[i] = (int32_t)(rng_mix64(stream + 100 + i) % (uint64_t)d->vocab_size);
        in->prompt_mask[i] = 1;
    }
    for (size_t i = 0; i < B * d->action_dim; i++) in->state[i] = rng_normal(stream + 200, i);
    for (size_t i = 0; i < noise; i++) in->noise[i] = rng_normal(stream + 300, i);
    return 0;
}

static int compare_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted values. */
static double percentile(const double *sorted, int n, double p) {
    int rank = (int)(p / 100.0 * n + 0.999999);
    if (rank < 1) rank = 1;
    return sorted[(rank > n ? n : rank) - 1];
}

typedef struct {
    double mean, p50, p95, min, max, vision, prefix, denoise;
} bench_stats;

/* How the model got ready: seconds to load (or build) it and the host memory the process then held. */
typedef struct {
    double seconds, host_gb;
} load_stats;

static int report(const workload *w, const bench_stats *s, pi0_model *model, const load_stats *load, double peak_gb,
                  int json) {
    double hz = 1000.0 / s->mean, samples_per_s = hz * (double)w->batch;
    double gpu_gb = (double)pi0_model_device_memory(model) / 1e9;
    char frame[32] = "";
    if (w->frame_h) snprintf(frame, sizeof frame, "%dx%d", w->frame_h, w->frame_w);
    if (json) {
        json_t *o = json_pack(
            "{s:s,s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:s?,s:b,s:{s:f,s:f,s:f,s:f,s:f},s:f,s:f,s:f,s:f,s:{s:f,s:f,s:f},s:f,s:f}", "model",
            pi0_model_kind_name(pi0_model_dims(model)->kind), "backend", pi0_backend_name(pi0_model_backend(model)),
            "batch", w->batch, "cameras", w->cameras, "masked_cameras",
            w->masked, "prompt_len", w->prompt_len, "horizon", w->horizon, "steps", w->steps, "iters", w->iters,
            "frame", w->frame_h ? frame : NULL, "pageable", w->pageable,
            "latency_ms", "mean", s->mean, "p50", s->p50, "p95", s->p95, "min", s->min, "max", s->max, "hz", hz,
            "samples_per_s", samples_per_s, "peak_host_memory_gb", peak_gb, "peak_gpu_memory_gb", gpu_gb, "stages_ms", "vision", s->vision, "prefix",
            s->prefix, "denoise", s->denoise, "load_s", load->seconds, "host_memory_after_load_gb", load->host_gb);
        return print_json("bench", o, JSON_PRESERVE_ORDER);
    }
    printf("pi0 bench: %s, backend %s, batch %lld, %lld cameras (%lld masked)%s%s%s, %lld prompt tokens, horizon %lld, "
           "%lld steps, %lld iterations\n",
           pi0_model_kind_name(pi0_model_dims(model)->kind), pi0_backend_name(pi0_model_backend(model)), w->batch, w->cameras,
           w->masked, *frame ? " as frames of " : "", frame, w->pageable ? " in pageable memory" : "",
           w->prompt_len, w->horizon, w->steps, w->iters);
    printf("latency ms: mean %.2f  p50 %.2f  p95 %.2f  min %.2f  max %.2f\n", s->mean, s->p50, s->p95, s->min, s->max);
    printf("throughput: %.2f Hz, %.2f samples/s\n", hz, samples_per_s);
    printf("stages ms (mean): vision %.2f  prefix %.2f  denoise %.2f\n", s->vision, s->prefix, s->denoise);
    printf("peak memory: host %.2f GB, gpu %.2f GB; after loading (%.1f s): host %.2f GB\n", peak_gb, gpu_gb,
           load->seconds, load->host_gb);
    return EXIT_OK;
}

static int run_bench(pi0_model *model, const workload *w, const load_stats *load, int json) {
    const pi0_dims *d = pi0_model_dims(model);
    bench_inputs in;
    pi0_error err = {0};
    int rc = EXIT_OK;
    double *lat = calloc((size_t)w->iters, sizeof(double));
    if (!lat || inputs_make(&in, w, d)) {
        free(lat);
        inputs_free(&in, (int)w->cameras);
        fprintf(stderr, "pi0 bench: out of memory for the inputs\n");
        return EXIT_FAILURE_RUN;
    }
    pi0_batch batch = {.batch = (int)w->batch, .num_cameras = (int)w->cameras,
                       .images = in.frames ? NULL : (const float *const *)in.images, .frames = in.frames,
                       .image_masks = in.image_masks, .prompt_len = (int)w->prompt_len, .prompt_ids = in.prompt_ids,
                       .prompt_mask = in.prompt_mask, .state = in.state, .horizon = (int)w->horizon, .noise = in.noise,
                       .num_steps = (int)w->steps};
    bench_stats s = {0};
    for (long long i = 0; i < w->warmup + w->iters; i++) {
        pi0_timings t;
        double t0 = pi0_now_ms();
        if (pi0_sample_actions(model, &batch, in.actions, &t, &err)) {
            rc = run_error("bench", &err);
            goto done;
        }
        double ms = pi0_now_ms() - t0;
        int timed = i >= w->warmup;
        if (timed) {
            lat[i - w->warmup] = ms;
            s.vision += t.vision_ms / (double)w->iters, s.prefix += t.prefix_ms / (double)w->iters;
            s.denoise += t.denoise_ms / (double)w->iters;
        }
        if (!json && (ms > 1000 || i + 1 == w->warmup + w->iters))
            fprintf(stderr, "\r%s %lld/%lld: %.1f ms   ", timed ? "iteration" : "warm-up", timed ? i - w->warmup + 1 : i + 1,
                    timed ? w->iters : w->warmup, ms);
    }
    if (!json) fprintf(stderr, "\n");
    qsort(lat, (size_t)w->iters, sizeof(double), compare_double);
    for (long long i = 0; i < w->iters; i++) s.mean += lat[i] / (double)w->iters;
    s.p50 = percentile(lat, (int)w->iters, 50), s.p95 = percentile(lat, (int)w->iters, 95);
    s.min = lat[0], s.max = lat[w->iters - 1];
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    rc = report(w, &s, model, load, (double)usage.ru_maxrss * 1024.0 / 1e9, json);
done:
    free(lat);
    inputs_free(&in, (int)w->cameras);
    return rc;
}

int cmd_bench(int argc, char **argv) {
    const char *checkpoint = NULL, *dims_path = NULL, *backend_name = "auto", *model_name = NULL, *frame = NULL;
    workload w = {.batch = 1, .cameras = 3, .masked = 1, .prompt_len = 20, .horizon = 10, .steps = 10, .warmup = -1,
                  .iters = -1, .seed = 0};
    const int_flag ints[] = {
        {"--batch", 1, PI0_MAX_BATCH, &w.batch},      {"--cameras", 0, 16, &w.cameras},   {"--masked-cameras", 0, 16, &w.masked},
        {"--prompt-len", 0, PI0_MAX_PROMPT_LEN, &w.prompt_len}, {"--horizon", 1, PI0_MAX_HORIZON, &w.horizon},
        {"--steps", 1, PI0_MAX_STEPS, &w.steps},
        {"--warmup", 0, 1000000, &w.warmup}, {"--iters", 1, 1000000, &w.iters}, {"--seed", 0, INT64_MAX, &w.seed},
    };
    int json = 0, r, bad;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return fputs(help, stdout), EXIT_OK;
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if (!strcmp(argv[i], "--pageable")) { w.pageable = 1; continue; }
        if ((r = flag_value(argc, argv, &i, "--checkpoint", &checkpoint)) || (r = flag_value(argc, argv, &i, "--dims", &dims_path)) ||
            (r = flag_value(argc, argv, &i, "--backend", &backend_name)) || (r = flag_value(argc, argv, &i, "--model", &model_name)) ||
            (r = flag_value(argc, argv, &i, "--frame", &frame))) {
            if (r < 0) return usage_error("bench", "%s needs a value", argv[i]);
            continue;
        }
        const int_flag *f = int_flag_value(argc, argv, &i, ints, sizeof ints / sizeof ints[0], &bad);
        if (!f) return usage_error("bench", "unknown option '%s'", argv[i]);
        if (bad) return int_flag_error("bench", f);
    }
    if (w.masked > w.cameras) return usage_error("bench", "--masked-cameras exceeds --cameras");
    char tail;
    if (frame && (sscanf(frame, "%dx%d%c", &w.frame_h, &w.frame_w, &tail) != 2 || w.frame_h < 1 || w.frame_w < 1 ||
                  w.frame_h > PI0_MAX_IMAGE_SIDE || w.frame_w > PI0_MAX_IMAGE_SIDE))
        return usage_error("bench", "--frame takes HEIGHTxWIDTH with sides in 1..%d, not '%s'", PI0_MAX_IMAGE_SIDE, frame);
    if (checkpoint && (dims_path || model_name))
        return usage_error("bench", "--checkpoint excludes --dims and --model (the checkpoint says what it is)");
    pi0_model_kind kind = PI0_MODEL_PI0;
    if (model_name && model_kind_from_name(model_name, &kind))
        return usage_error("bench", "--model takes pi0 or pi05, not '%s'", model_name);
    pi0_backend backend;
    if (pi0_backend_from_name(backend_name, &backend)) return usage_error("bench", "unknown backend '%s'", backend_name);

    pi0_error err = {0};
    pi0_model *model = NULL;
    double t0 = pi0_now_ms();
    if (open_model(checkpoint, dims_path, model_name ? (int)kind : -1, (uint64_t)w.seed, backend, json, &model, &err))
        return run_error("bench", &err);
    load_stats load = {(pi0_now_ms() - t0) / 1e3, (double)host_anon_bytes() / 1e9};
    int gpu = pi0_model_backend(model) == PI0_BACKEND_CUDA;
    if (w.warmup < 0) w.warmup = gpu ? 10 : 1;
    if (w.iters < 0) w.iters = gpu ? 100 : 5;
    int rc = run_bench(model, &w, &load, json);
    pi0_model_free(model);
    return rc;
}
