/* inspect.c - `pi0 inspect`: what a checkpoint holds, and how it maps onto the model. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "model/checkpoint.h"
#include "model/config.h"

static const char *help =
    "usage: pi0 inspect --checkpoint DIR [--json]\n"
    "\n"
    "Prints which model the checkpoint holds (Pi0 or Pi0.5, told from its tensor names, and why), the\n"
    "dims derived from its shapes and config.json, the dtypes it stores, the parameter count per part,\n"
    "and the tensors that are missing, mis-shaped or unused. Exits 1 when the checkpoint cannot be\n"
    "loaded as it is.\n";

typedef struct {
    uint64_t params[PART_COUNT], dtype_count[8], dtype_bytes[8];
    json_t *missing, *misshaped, *unused, *ignored;
} inspection;

static void inspect_tensors(const checkpoint *ck, const weight_spec *specs, int count, uint8_t *used, inspection *r) {
    char want[96], have[96];
    for (int i = 0; i < count; i++) {
        const st_tensor *t = checkpoint_tensor(ck, &specs[i]);
        st_shape_str(specs[i].rank, specs[i].shape, want, sizeof want);
        if (!t) {
            json_array_append_new(r->missing, json_pack("{s:s,s:s}", "name", specs[i].name, "expected", want));
            continue;
        }
        used[t - ck->file.tensors] = 1;
        int same = t->rank == specs[i].rank;
        for (int k = 0; same && k < t->rank; k++) same = t->shape[k] == specs[i].shape[k];
        if (!same)
            json_array_append_new(r->misshaped, json_pack("{s:s,s:s,s:s}", "name", t->name, "expected", want, "found",
                                                          st_shape_str(t->rank, t->shape, have, sizeof have)));
        r->params[specs[i].part] += specs[i].numel;
    }
    for (int i = 0; i < ck->file.num_tensors; i++) {
        const st_tensor *t = &ck->file.tensors[i];
        r->dtype_count[t->dtype]++;
        r->dtype_bytes[t->dtype] += t->nbytes;
        if (!used[i]) json_array_append_new(checkpoint_ignored(t->name) ? r->ignored : r->unused, json_string(t->name));
    }
}

static json_t *inspection_json(const checkpoint *ck, const inspection *r) {
    const pi0_dims *d = &ck->dims;
    json_t *dtypes = json_object(), *params = json_object();
    uint64_t total = 0;
    for (int t = ST_F32; t <= ST_U8; t++)
        if (r->dtype_count[t])
            json_object_set_new(dtypes, st_dtype_name((st_dtype)t),
                                json_pack("{s:I,s:I}", "tensors", (json_int_t)r->dtype_count[t], "bytes", (json_int_t)r->dtype_bytes[t]));
    for (int p = 0; p < PART_COUNT; p++) {
        json_object_set_new(params, weight_part_name((weight_part)p), json_integer((json_int_t)r->params[p]));
        total += r->params[p];
    }
    json_object_set_new(params, "total", json_integer((json_int_t)total));
    return json_pack("{s:s,s:s,s:s,s:{s:o,s:i,s:i,s:o,s:o,s:i,s:i,s:i,s:i},s:o,s:o,s:O,s:O,s:O,s:O}", "model",
                     pi0_model_kind_name(d->kind), "model_reason", config_model_kind_reason(d->kind), "prefix", ck->prefix, "dims",
                     "vision", config_stack_json(&d->vision), "patch_size", d->patch_size, "image_size", d->image_size, "llm",
                     config_stack_json(&d->llm), "expert", config_stack_json(&d->expert), "vocab_size", d->vocab_size, "action_dim",
                     d->action_dim, "action_horizon", d->action_horizon, "max_token_len", d->max_token_len, "dtypes",
                     dtypes, "params", params, "missing", r->missing, "misshaped", r->misshaped, "unused", r->unused,
                     "ignored", r->ignored);
}

static void print_stack(const char *name, const pi0_stack_dims *d) {
    printf("  %-8s width %5d  depth %3d  mlp %6d  heads %3d  kv heads %3d  head_dim %4d\n", name, d->width, d->depth,
           d->mlp_dim, d->num_heads, d->num_kv_heads, d->head_dim);
}

static void print_names(const char *title, json_t *list) {
    size_t i;
    json_t *v;
    printf("%s: %zu\n", title, json_array_size(list));
    json_array_foreach(list, i, v) {
        if (json_is_string(v)) printf("  %s\n", json_string_value(v));
        else printf("  %s: expected %s%s%s\n", json_string_value(json_object_get(v, "name")),
                    json_string_value(json_object_get(v, "expected")), json_object_get(v, "found") ? ", found " : "",
                    json_object_get(v, "found") ? json_string_value(json_object_get(v, "found")) : "");
    }
}

static void print_text(const checkpoint *ck, const inspection *r) {
    const pi0_dims *d = &ck->dims;
    uint64_t total = 0;
    printf("model: %s (%s)\n", d->kind == PI0_MODEL_PI05 ? "Pi0.5" : "Pi0", config_model_kind_reason(d->kind));
    printf("checkpoint: %d tensors%s%s%s\n", ck->file.num_tensors, ck->prefix[0] ? ", name prefix '" : "", ck->prefix,
           ck->prefix[0] ? "'" : "");
    printf("dims:\n");
    print_stack("vision", &d->vision);
    print_stack("llm", &d->llm);
    print_stack("expert", &d->expert);
    printf("  image %d (patch %d), vocab %d, action_dim %d, action_horizon %d, max_token_len %d\n", d->image_size,
           d->patch_size, d->vocab_size, d->action_dim, d->action_horizon, d->max_token_len);
    printf("dtypes:\n");
    for (int t = ST_F32; t <= ST_U8; t++)
        if (r->dtype_count[t])
            printf("  %-5s %5llu tensors  %8.3f GB\n", st_dtype_name((st_dtype)t), (unsigned long long)r->dtype_count[t],
                   (double)r->dtype_bytes[t] / 1e9);
    printf("parameters:\n");
    for (int p = 0; p < PART_COUNT; p++) {
        printf("  %-13s %14llu\n", weight_part_name((weight_part)p), (unsigned long long)r->params[p]);
        total += r->params[p];
    }
    printf("  %-13s %14llu\n", "total", (unsigned long long)total);
    print_names("missing tensors", r->missing);
    print_names("mis-shaped tensors", r->misshaped);
    print_names("unused tensors", r->unused);
    print_names("ignored tensors (lm_head)", r->ignored);
}

int cmd_inspect(int argc, char **argv) {
    const char *dir = NULL;
    int json = 0, r;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return fputs(help, stdout), EXIT_OK;
        if (!strcmp(argv[i], "--json")) { json = 1; continue; }
        if ((r = flag_value(argc, argv, &i, "--checkpoint", &dir))) {
            if (r < 0) return usage_error("inspect", "--checkpoint needs a value");
            continue;
        }
        return usage_error("inspect", "unknown option '%s'", argv[i]);
    }
    if (!dir) return usage_error("inspect", "--checkpoint is required");
    pi0_error err = {0};
    checkpoint ck;
    if (checkpoint_open(dir, &ck, &err)) return run_error("inspect", &err);
    pi0_weights w = {0};
    weight_spec *specs = NULL;
    int count = weights_specs(&ck.dims, &w, &specs);
    uint8_t *used = calloc((size_t)ck.file.num_tensors + 1, 1);
    if (count < 0 || !used) {
        checkpoint_close(&ck);
        free(used);
        fprintf(stderr, "pi0 inspect: out of memory\n");
        return EXIT_FAILURE_RUN;
    }
    inspection rep = {.missing = json_array(), .misshaped = json_array(), .unused = json_array(), .ignored = json_array()};
    inspect_tensors(&ck, specs, count, used, &rep);
    int loadable = json_array_size(rep.missing) == 0 && json_array_size(rep.misshaped) == 0;
    if (json) {
        json_t *o = inspection_json(&ck, &rep);
        json_object_set_new(o, "loadable", json_boolean(loadable));
        if (print_json("inspect", o, JSON_PRESERVE_ORDER | JSON_INDENT(2))) loadable = 0;
    } else {
        print_text(&ck, &rep);
    }
    json_decref(rep.missing), json_decref(rep.misshaped), json_decref(rep.unused), json_decref(rep.ignored);
    free(used);
    free(specs);
    weights_free(&w);
    checkpoint_close(&ck);
    return loadable ? EXIT_OK : EXIT_FAILURE_RUN;
}
