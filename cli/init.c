/* init.c - `pi0 init`: a checkpoint of deterministic random weights, of the real size or any dims. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char *help =
    "usage: pi0 init --output DIR [--model pi0|pi05] [--dims FILE] [--seed N] [--bf16]\n"
    "\n"
    "Writes DIR/model.safetensors and DIR/config.json holding random weights drawn from --seed\n"
    "(default 0): the real size of --model (default pi0), or the dims of FILE (a config.json with a\n"
    "`dims` block, e.g. one written by this command or the fixtures'; its \"model\" key gives the kind\n"
    "unless --model does). --bf16 stores bfloat16 instead of float32.\n";

int cmd_init(int argc, char **argv) {
    const char *output = NULL, *dims_path = NULL, *model_name = NULL;
    long long seed = 0;
    int bf16 = 0, r, bad;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return fputs(help, stdout), EXIT_OK;
        if (!strcmp(argv[i], "--bf16")) { bf16 = 1; continue; }
        if ((r = flag_value(argc, argv, &i, "--output", &output)) || (r = flag_value(argc, argv, &i, "--dims", &dims_path)) ||
            (r = flag_value(argc, argv, &i, "--model", &model_name))) {
            if (r < 0) return usage_error("init", "%s needs a value", argv[i]);
            continue;
        }
        const int_flag seed_flag = {"--seed", 0, INT64_MAX, &seed};
        if (int_flag_value(argc, argv, &i, &seed_flag, 1, &bad)) {
            if (bad) return int_flag_error("init", &seed_flag);
            continue;
        }
        return usage_error("init", "unknown option '%s'", argv[i]);
    }
    if (!output) return usage_error("init", "--output is required");
    pi0_model_kind kind = PI0_MODEL_PI0;
    if (model_name && model_kind_from_name(model_name, &kind))
        return usage_error("init", "--model takes pi0 or pi05, not '%s'", model_name);
    pi0_error err = {0};
    pi0_model *model = NULL;
    if (open_model(NULL, dims_path, model_name ? (int)kind : -1, (uint64_t)seed, PI0_BACKEND_CPU, 0, &model, &err) ||
        pi0_model_save(model, output, bf16, &err)) {
        pi0_model_free(model);
        return run_error("init", &err);
    }
    fprintf(stderr, "wrote %s (%s, %s)\n", output, pi0_model_kind_name(pi0_model_dims(model)->kind),
            bf16 ? "bfloat16" : "float32");
    pi0_model_free(model);
    return EXIT_OK;
}
