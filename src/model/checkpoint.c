#include "model/checkpoint.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/config.h"
#include "model/names.h"
#include "util/half.h"
#include "util/error.h"

/* Whatever precedes `anchor` in the name of a tensor ending with it, into prefix; 0 when none does. */
static int prefix_before(const st_file *f, const char *anchor, char *prefix, size_t size) {
    size_t anchor_len = strlen(anchor);
    for (int i = 0; i < f->num_tensors; i++) {
        const char *name = f->tensors[i].name;
        size_t len = strlen(name);
        if (len >= anchor_len && len - anchor_len < size && !strcmp(name + len - anchor_len, anchor)) {
            memcpy(prefix, name, len - anchor_len);
            prefix[len - anchor_len] = 0;
            return 1;
        }
    }
    return 0;
}

/* The name prefix (LeRobot's "model.") is what precedes the embedding, stored as itself or as the output
 * head tied to it. */
static pi0_status find_prefix(const st_file *f, char *prefix, size_t size, const char *path, pi0_error *err) {
    if (prefix_before(f, NAME_EMBEDDING, prefix, size) || prefix_before(f, NAME_TIED_EMBEDDING, prefix, size))
        return PI0_OK;
    return pi0_fail(err, PI0_ERR_CHECKPOINT, "%s: not a Pi0 or Pi0.5 checkpoint: no tensor named %s or %s (with any "
                    "prefix)", path, NAME_EMBEDDING, NAME_TIED_EMBEDDING);
}

pi0_status checkpoint_open(const char *dir, checkpoint *ck, pi0_error *err) {
    char path[4096], config[4096];
    memset(ck, 0, sizeof *ck);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    snprintf(config, sizeof config, "%s/config.json", dir);
    pi0_status st = st_open(path, &ck->file, err);
    if (!st) st = find_prefix(&ck->file, ck->prefix, sizeof ck->prefix, path, err);
    if (!st) st = config_derive_dims(&ck->file, ck->prefix, config, &ck->dims, &ck->horizon_given, err);
    if (st) checkpoint_close(ck);
    return st;
}

pi0_status checkpoint_peek_dims(const char *dir, pi0_dims *dims, pi0_error *err) {
    checkpoint ck;
    pi0_status st = checkpoint_open(dir, &ck, err);
    if (st) return st;
    *dims = ck.dims;
    checkpoint_close(&ck);
    return PI0_OK;
}

void checkpoint_close(checkpoint *ck) {
    st_close(&ck->file);
    memset(ck, 0, sizeof *ck);
}

const st_tensor *checkpoint_tensor(const checkpoint *ck, const weight_spec *spec) {
    char name[256];
    snprintf(name, sizeof name, "%s%s", ck->prefix, spec->name);
    const st_tensor *t = st_find(&ck->file, name);
    if (!t && spec->alt_name) {
        snprintf(name, sizeof name, "%s%s", ck->prefix, spec->alt_name);
        t = st_find(&ck->file, name);
    }
    return t;
}

int checkpoint_ignored(const char *name) {
    return strstr(name, "lm_head.") != NULL;
}

static int shape_matches(const st_tensor *t, const weight_spec *s) {
    if (t->rank != s->rank) return 0;
    for (int i = 0; i < s->rank; i++)
        if (t->shape[i] != s->shape[i]) return 0;
    return 1;
}

static int float_dtype(st_dtype dtype) {
    return dtype == ST_F32 || dtype == ST_BF16 || dtype == ST_F16;
}

pi0_status checkpoint_check(const checkpoint *ck, const weight_spec *specs, int count, pi0_error *err) {
    char want[96], have[96];
    for (int i = 0; i < count; i++) {
        const weight_spec *s = &specs[i];
        const st_tensor *t = checkpoint_tensor(ck, s);
        st_shape_str(s->rank, s->shape, want, sizeof want);
        if (!t) return pi0_fail(err, PI0_ERR_CHECKPOINT, "missing tensor %s%s (expected shape %s)", ck->prefix, s->name, want);
        if (!shape_matches(t, s))
            return pi0_fail(err, PI0_ERR_CHECKPOINT, "tensor %s has shape %s, expected %s", t->name,
                            st_shape_str(t->rank, t->shape, have, sizeof have), want);
        if (!float_dtype(t->dtype))
            return pi0_fail(err, PI0_ERR_CHECKPOINT, "tensor %s has dtype %s, expected F32, BF16 or F16", t->name,
                            st_dtype_name(t->dtype));
    }
    return PI0_OK;
}

pi0_status checkpoint_read(const checkpoint *ck, const weight_spec *specs, int count,
                           void (*progress)(void *, const char *, uint64_t, uint64_t), void *user, pi0_error *err) {
    pi0_status st = checkpoint_check(ck, specs, count, err);
    if (st) return st;
    uint64_t total = 0, done = 0;
    for (int i = 0; i < count; i++)
        if (*specs[i].slot) total += checkpoint_tensor(ck, &specs[i])->nbytes;
    for (int i = 0; i < count; i++) {
        if (!*specs[i].slot) continue; /* streamed by the backend (weights_alloc) */
        const st_tensor *t = checkpoint_tensor(ck, &specs[i]);
        st_to_f32(t, *specs[i].slot);
        done += t->nbytes;
        if (progress) progress(user, "loading weights", done, total);
    }
    return PI0_OK;
}

pi0_status checkpoint_write(const char *dir, const pi0_dims *dims, const weight_spec *specs, int count, int bf16,
                            pi0_error *err) {
    char path[4096];
    if (mkdir(dir, 0755) && errno != EEXIST) return pi0_fail(err, PI0_ERR_IO, "cannot create %s: %s", dir, strerror(errno));
    st_writer w;
    st_writer_init(&w);
    uint16_t **halves = calloc((size_t)count, sizeof *halves);
    pi0_status st = halves ? PI0_OK : pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    for (int i = 0; i < count && !st; i++) {
        const weight_spec *s = &specs[i];
        const void *data = *s->slot;
        if (bf16) {
            if (!(halves[i] = malloc(s->numel * sizeof(uint16_t) + 1))) {
                st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory converting %s to bf16", s->name);
                break;
            }
            for (uint64_t j = 0; j < s->numel; j++) halves[i][j] = f32_to_bf16((*s->slot)[j]);
            data = halves[i];
        }
        st = st_writer_add(&w, s->name, bf16 ? ST_BF16 : ST_F32, s->rank, s->shape, data, err);
    }
    if (!st) {
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        st = st_writer_write(&w, path, err);
    }
    if (!st) {
        snprintf(path, sizeof path, "%s/config.json", dir);
        st = config_write(dims, path, bf16, err);
    }
    for (int i = 0; halves && i < count; i++) free(halves[i]);
    free(halves);
    st_writer_free(&w);
    return st;
}
