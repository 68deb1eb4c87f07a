/* sample.c - `pi0 sample`: model-level inference from a safetensors file of inputs. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "io/safetensors.h"
#include "util/error.h"
#include "util/finite.h"

static const char *help =
    "usage: pi0 sample --checkpoint DIR --inputs IN.safetensors --output OUT.safetensors\n"
    "                  [--steps N] [--backend auto|cpu|cuda] [--seed N] [--json] [--quiet]\n"
    "\n"
    "Runs sample_actions on the batch in IN and writes `actions` (B, H, action_dim) float32 to OUT.\n"
    "Inputs, named as in openpi's fixtures (other tensors are ignored):\n"
    "  image/<cam>            (B, S, S, 3) float in [-1, 1], HWC; cameras base_0_rgb, left_wrist_0_rgb,\n"
    "                         right_wrist_0_rgb first, then any others by name\n"
    "  image_mask/<cam>       (B) bool; absent = valid\n"
    "  state                  (B, n) float, n <= action_dim (zero-padded)\n"
    "  tokenized_prompt       (B, L) int32/int64\n"
    "  tokenized_prompt_mask  (B, L) bool; absent = all valid\n"
    "  noise                  (B, H, action_dim) float; absent = standard normal from --seed\n"
    "\n"
    "  --steps N     Euler steps (default 10)\n"
    "  --seed N      noise seed when the inputs carry no noise (default 0)\n"
    "  --json        print a JSON summary (shape, timings) on stdout\n";

#define MAX_CAMS 16

typedef struct {
    st_file file;
    int batch, num_cameras, prompt_len, horizon;
    const char *camera_names[MAX_CAMS];
    float *images[MAX_CAMS];
    uint8_t *image_masks;
    int32_t *prompt_ids;
    uint8_t *prompt_mask;
    float *state, *noise;
} sample_inputs;

static void inputs_free(sample_inputs *in) {
    for (int c = 0; c < in->num_cameras; c++) free(in->images[c]);
    free(in->image_masks), free(in->prompt_ids), free(in->prompt_mask), free(in->state), free(in->noise);
    st_close(&in->file);
}

static float *tensor_f32(const st_tensor *t) {
    float *out = malloc(t->numel * sizeof(float) + 1);
    if (out) st_to_f32(t, out);
    return out;
}

static pi0_status expect_shape(const st_tensor *t, int rank, const int64_t *shape, pi0_error *err) {
    char want[96], have[96];
    int ok = t->rank == rank;
    for (int i = 0; ok && i < rank; i++) ok = shape[i] < 0 || t->shape[i] == shape[i];
    if (ok) return PI0_OK;
    return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "input %s has shape %s, expected %s (-1 = any)", t->name,
                    st_shape_str(t->rank, t->shape, have, sizeof have), st_shape_str(rank, shape, want, sizeof want));
}

/* Camera order: openpi's three Pi0 cameras first, then any other image/<cam> by name. */
static pi0_status find_cameras(sample_inputs *in, pi0_error *err) {
    static const char *standard[] = {"image/base_0_rgb", "image/left_wrist_0_rgb", "image/right_wrist_0_rgb"};
    for (int i = 0; i < 3; i++)
        if (st_find(&in->file, standard[i])) in->camera_names[in->num_cameras++] = standard[i];
    for (int i = 0; i < in->file.num_tensors; i++) {
        const char *name = in->file.tensors[i].name;
        int known = 0;
        for (int j = 0; j < 3; j++) known |= !strcmp(name, standard[j]);
        if (known || strncmp(name, "image/", 6)) continue;
        if (in->num_cameras == MAX_CAMS) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "more than %d cameras", MAX_CAMS);
        in->camera_names[in->num_cameras++] = name;
    }
    return PI0_OK;
}

static pi0_status read_cameras(sample_inputs *in, const pi0_dims *dims, pi0_error *err) {
    pi0_status st = find_cameras(in, err);
    if (st) return st;
    int B = in->batch, S = dims->image_size;
    in->image_masks = malloc((size_t)B * in->num_cameras + 1);
    if (!in->image_masks) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    for (int c = 0; c < in->num_cameras; c++) {
        const st_tensor *img = st_find(&in->file, in->camera_names[c]);
        st = expect_shape(img, 4, (int64_t[]){B, S, S, 3}, err);
        if (st) return st;
        if (!(in->images[c] = tensor_f32(img))) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
        char mask_name[256];
        snprintf(mask_name, sizeof mask_name, "image_mask/%s", in->camera_names[c] + 6);
        const st_tensor *mask = st_find(&in->file, mask_name);
        if (mask && (st = expect_shape(mask, 1, (int64_t[]){B}, err))) return st;
        float *m = mask ? tensor_f32(mask) : NULL;
        for (int b = 0; b < B; b++) in->image_masks[b * in->num_cameras + c] = m ? m[b] != 0 : 1;
        free(m);
    }
    return PI0_OK;
}

static pi0_status read_prompt(sample_inputs *in, pi0_error *err) {
    const st_tensor *ids = st_find(&in->file, "tokenized_prompt");
    if (!ids) return PI0_OK;
    pi0_status st = expect_shape(ids, 2, (int64_t[]){in->batch, -1}, err);
    if (st) return st;
    if (ids->dtype != ST_I32 && ids->dtype != ST_I64)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "tokenized_prompt must be int32 or int64, not %s",
                        st_dtype_name(ids->dtype));
    if (ids->shape[1] > PI0_MAX_PROMPT_LEN)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "input tokenized_prompt has %lld tokens per sample, over the "
                        "limit %d", (long long)ids->shape[1], PI0_MAX_PROMPT_LEN);
    in->prompt_len = (int)ids->shape[1];
    const st_tensor *mask = st_find(&in->file, "tokenized_prompt_mask");
    if (mask && (st = expect_shape(mask, 2, ids->shape, err))) return st;
    size_t n = ids->numel;
    float *mask_values = mask ? tensor_f32(mask) : NULL;
    in->prompt_ids = malloc(n * sizeof(int32_t) + 1);
    in->prompt_mask = malloc(n + 1);
    if (!in->prompt_ids || !in->prompt_mask || (mask && !mask_values))
        return free(mask_values), pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    for (size_t i = 0; i < n; i++) {
        int64_t id = 0;
        if (ids->dtype == ST_I32) {
            int32_t v;
            memcpy(&v, (const char *)ids->data + 4 * i, 4);
            id = v;
        } else {
            memcpy(&id, (const char *)ids->data + 8 * i, 8);
        }
        /* out-of-int32 ids are clamped to -1 so the engine reports them as out of range */
        in->prompt_ids[i] = id < INT32_MIN || id > INT32_MAX ? -1 : (int32_t)id;
        in->prompt_mask[i] = mask_values ? mask_values[i] != 0 : 1;
    }
    free(mask_values);
    return PI0_OK;
}

static pi0_status read_state_and_noise(sample_inputs *in, const pi0_dims *dims, int horizon, pi0_error *err) {
    const st_tensor *state = st_find(&in->file, "state");
    if (!state) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "input has no `state` tensor");
    pi0_status st = expect_shape(state, 2, (int64_t[]){in->batch, -1}, err);
    if (st) return st;
    if (state->shape[1] > dims->action_dim)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "state has %lld dims, more than action_dim %d",
                        (long long)state->shape[1], dims->action_dim);
    float *raw = tensor_f32(state);
    in->state = calloc((size_t)in->batch * dims->action_dim, sizeof(float));
    if (!raw || !in->state) return free(raw), pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    for (int b = 0; b < in->batch; b++)
        memcpy(in->state + (size_t)b * dims->action_dim, raw + (size_t)b * state->shape[1], state->shape[1] * sizeof(float));
    free(raw);

    const st_tensor *noise = st_find(&in->file, "noise");
    in->horizon = horizon;
    if (!noise) return PI0_OK;
    if ((st = expect_shape(noise, 3, (int64_t[]){in->batch, -1, dims->action_dim}, err))) return st;
    /* the horizon is the noise's: 0 must not reach pi0_batch.horizon, where it means the model's default */
    if (noise->shape[1] < 1 || noise->shape[1] > PI0_MAX_HORIZON) {
        char have[96];
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "input noise has shape %s: its horizon (axis 1) must be in 1..%d",
                        st_shape_str(noise->rank, noise->shape, have, sizeof have), PI0_MAX_HORIZON);
    }
    in->horizon = (int)noise->shape[1];
    if (!(in->noise = tensor_f32(noise))) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    return PI0_OK;
}

static pi0_status read_inputs(const char *path, const pi0_dims *dims, sample_inputs *in, pi0_error *err) {
    memset(in, 0, sizeof *in);
    pi0_status st = st_open(path, &in->file, err);
    if (st) return st;
    const st_tensor *state = st_find(&in->file, "state");
    if (!state || state->rank < 1) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s has no `state` tensor", path);
    if (state->shape[0] <= 0 || state->shape[0] > PI0_MAX_BATCH)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "%s: batch %lld is outside 1..%d", path, (long long)state->shape[0],
                        PI0_MAX_BATCH);
    in->batch = (int)state->shape[0];
    if ((st = read_cameras(in, dims, err)) || (st = read_prompt(in, err)) ||
        (st = read_state_and_noise(in, dims, dims->action_horizon, err)))
        return st;
    return PI0_OK;
}

/* Writes the actions, which must all be finite: nothing downstream may act on a NaN (pi0_sample_actions checks
 * its inputs, not its outputs). */
static pi0_status write_actions(const char *path, const float *actions, int B, int H, int A, int steps,
                                pi0_error *err) {
    size_t n = (size_t)B * H * A, at = first_nonfinite(actions, n);
    if (at < n)
        return pi0_fail(err, PI0_ERR_NUMERIC, "the actions of sample %zu are %g at step %zu, dim %zu: not writing %s",
                        at / ((size_t)H * A), actions[at], at / A % H, at % A, path);
    st_writer w;
    st_writer_init(&w);
    char steps_text[32];
    snprintf(steps_text, sizeof steps_text, "%d", steps);
    pi0_status st = st_writer_add(&w, "actions", ST_F32, 3, (int64_t[]){B, H, A}, actions, err);
    if (!st) st = st_writer_meta(&w, "num_steps", steps_text, err);
    if (!st) st = st_writer_write(&w, path, err);
    st_writer_free(&w);
    return st;
}

static int print_summary_json(const char *output, int B, int H, int A, const pi0_timings *t, pi0_backend backend) {
    return print_json("sample",
                      json_pack("{s:s,s:[i,i,i],s:s,s:{s:f,s:f,s:f,s:f}}", "output", output, "shape", B, H, A, "backend",
                                pi0_backend_name(backend), "timings_ms", "vision", t->vision_ms, "prefix", t->prefix_ms,
                                "denoise", t->denoise_ms, "total", t->total_ms),
                      JSON_PRESERVE_ORDER);
}

int cmd_sample(int argc, char **argv) {
    const char *checkpoint = NULL, *inputs = NULL, *output = NULL, *backend_name = "auto";
    long long steps = 10, seed = 0;
    int json = 0, quiet = 0, r, bad;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return fputs(help, stdout), EXIT_OK;
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if (!strcmp(argv[i], "--quiet")) { quiet = 1; continue; }
        if ((r = flag_value(argc, argv, &i, "--checkpoint", &checkpoint)) || (r = flag_value(argc, argv, &i, "--inputs", &inputs)) ||
            (r = flag_value(argc, argv, &i, "--output", &output)) || (r = flag_value(argc, argv, &i, "--backend", &backend_name))) {
            if (r < 0) return usage_error("sample", "%s needs a value", argv[i]);
            continue;
        }
        const int_flag ints[] = {{"--steps", 1, PI0_MAX_STEPS, &steps}, {"--seed", 0, INT64_MAX, &seed}}, *f;
        if ((f = int_flag_value(argc, argv, &i, ints, 2, &bad))) {
            if (bad) return int_flag_error("sample", f);
            continue;
        }
        return usage_error("sample", "unknown option '%s'", argv[i]);
    }
    if (!checkpoint || !inputs || !output) return usage_error("sample", "--checkpoint, --inputs and --output are required");
    pi0_backend backend;
    if (pi0_backend_from_name(backend_name, &backend)) return usage_error("sample", "unknown backend '%s'", backend_name);

    pi0_error err = {0};
    pi0_model *model = NULL;
    sample_inputs in = {0};
    float *actions = NULL;
    int rc = EXIT_OK;
    if (open_model(checkpoint, NULL, -1, 0, backend, quiet, &model, &err) ||
        read_inputs(inputs, pi0_model_dims(model), &in, &err)) {
        rc = run_error("sample", &err);
        goto done;
    }
    const pi0_dims *dims = pi0_model_dims(model);
    const float *images[MAX_CAMS];
    for (int c = 0; c < in.num_cameras; c++) images[c] = in.images[c];
    pi0_batch batch = {.batch = in.batch, .num_cameras = in.num_cameras, .images = images, .image_masks = in.image_masks,
                       .prompt_len = in.prompt_len, .prompt_ids = in.prompt_ids, .prompt_mask = in.prompt_mask,
                       .state = in.state, .horizon = in.horizon, .noise = in.noise, .noise_seed = (uint64_t)seed,
                       .num_steps = (int)steps};
    pi0_timings timings;
    actions = malloc((size_t)in.batch * in.horizon * dims->action_dim * sizeof(float));
    if (!actions) {
        pi0_fail(&err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
        rc = run_error("sample", &err);
    } else if (pi0_sample_actions(model, &batch, actions, &timings, &err) ||
               write_actions(output, actions, in.batch, in.horizon, dims->action_dim, (int)steps, &err)) {
        rc = run_error("sample", &err);
    } else if (json) {
        rc = print_summary_json(output, in.batch, in.horizon, dims->action_dim, &timings, pi0_model_backend(model));
    } else if (!quiet) {
        fprintf(stderr, "wrote %s: actions (%d, %d, %d) in %.1f ms (vision %.1f, prefix %.1f, denoise %.1f)\n", output,
                in.batch, in.horizon, dims->action_dim, timings.total_ms, timings.vision_ms, timings.prefix_ms,
                timings.denoise_ms);
    }
done:
    free(actions);
    inputs_free(&in);
    pi0_model_free(model);
    return rc;
}
