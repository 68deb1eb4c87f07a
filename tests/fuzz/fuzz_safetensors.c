/*
 * fuzz_safetensors.c - libFuzzer harness: the bytes are a checkpoint's model.safetensors. st_open must refuse
 * anything malformed; whatever it accepts must convert (st_to_f32) within its bounds; a checkpoint must then
 * derive its dims (config.c, where shapes are untrusted sizes) and check its tensors against the table
 * (weights.c) without allocating the weights. Seeds: micro Pi0 and Pi0.5 checkpoints in F32 and BF16.
 */
#include "fuzz.h"
#include "io/safetensors.h"
#include "model/checkpoint.h"
#include "model/weights.h"

#define MAX_CONVERT ((uint64_t)1 << 20) /* elements converted per tensor: bounds the time of one input */

/* <fuzz_dir>/model.safetensors -> the memfd, so checkpoint_open reads the fuzzer's bytes. */
static const char *checkpoint_dir(void) {
    static char dir[256];
    if (!dir[0]) {
        char link[512];
        snprintf(dir, sizeof dir, "%s/checkpoint", fuzz_dir());
        snprintf(link, sizeof link, "%s/model.safetensors", dir);
        if (mkdir(dir, 0755) || symlink(fuzz_file(NULL, 0), link)) perror(dir), abort();
    }
    return dir;
}

static void write_seeds(const char *seeds) {
    const pi0_model_kind kinds[2] = {PI0_MODEL_PI0, PI0_MODEL_PI05};
    for (int k = 0; k < 2; k++) {
        for (int bf16 = 0; bf16 < 2; bf16++) {
            char dir[512], path[600], name[64];
            snprintf(dir, sizeof dir, "%s/seed_%d_%d", fuzz_dir(), k, bf16);
            pi0_dims d = fuzz_micro_dims(kinds[k]);
            d.vocab_size = 32; /* a smaller seed: the embedding is most of it */
            pi0_options opts = {.backend = PI0_BACKEND_CPU, .num_threads = 1};
            pi0_model *m = NULL;
            pi0_error err = {0};
            if (pi0_model_random(&d, 1, &opts, &m, &err) || pi0_model_save(m, dir, bf16, &err))
                fprintf(stderr, "%s\n", err.message), abort();
            pi0_model_free(m);
            snprintf(path, sizeof path, "%s/model.safetensors", dir);
            size_t size;
            uint8_t *data = fuzz_read_file(path, &size);
            snprintf(name, sizeof name, "%s_%s", pi0_model_kind_name(kinds[k]), bf16 ? "bf16" : "f32");
            fuzz_write_seed(seeds, name, "", 0, data, size);
            free(data);
        }
    }
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    fuzz_seeds_then_exit(write_seeds);
    checkpoint_dir();
    return 0;
}

static void convert_all(const st_file *f) {
    for (int i = 0; i < f->num_tensors; i++) {
        const st_tensor *t = &f->tensors[i];
        if (t->numel > MAX_CONVERT) continue;
        float *out = malloc(t->numel * sizeof(float) + 1);
        if (!out) abort();
        st_to_f32(t, out);
        free(out);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    st_file file;
    pi0_error err = {0};
    if (st_open(fuzz_file(data, size), &file, &err) == PI0_OK) convert_all(&file);
    st_close(&file);
    checkpoint ck;
    if (checkpoint_open(checkpoint_dir(), &ck, &err)) return 0;
    pi0_weights w = {0};
    weight_spec *specs = NULL;
    int count = weights_specs(&ck.dims, &w, &specs);
    if (count < 0) abort();
    checkpoint_check(&ck, specs, count, &err);
    free(specs);
    weights_free(&w);
    checkpoint_close(&ck);
    return 0;
}
