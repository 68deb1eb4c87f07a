/*
 * pi0.c - the public API: load or create a model, choose its backend, run sample_actions.
 */
#include <cblas.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "model/checkpoint.h"
#include "model/config.h"
#include "model/model.h"
#include "util/error.h"
#include "util/finite.h"
#ifdef PI0_WITH_CUDA
#include "cuda/limits.h"
#endif

int pi0_backend_from_name(const char *name, pi0_backend *out) {
    if (!name) return -1;
    if (!strcmp(name, "auto")) *out = PI0_BACKEND_AUTO;
    else if (!strcmp(name, "cpu")) *out = PI0_BACKEND_CPU;
    else if (!strcmp(name, "cuda")) *out = PI0_BACKEND_CUDA;
    else return -1;
    return 0;
}

const char *pi0_model_kind_name(pi0_model_kind kind) {
    return kind == PI0_MODEL_PI05 ? "pi05" : "pi0";
}

const char *pi0_backend_name(pi0_backend backend) {
    switch (backend) {
    case PI0_BACKEND_AUTO: return "auto";
    case PI0_BACKEND_CPU: return "cpu";
    case PI0_BACKEND_CUDA: return "cuda";
    }
    return "?";
}

/* auto: the GPU when there is one and its kernels take these dims (pi0_cuda_check_dims), else the CPU. */
static pi0_status pick_backend(pi0_backend wanted, const pi0_dims *dims, pi0_backend *chosen, const pi0_backend_ops **ops,
                               pi0_error *err) {
#ifdef PI0_WITH_CUDA
    if (wanted == PI0_BACKEND_CUDA ||
        (wanted == PI0_BACKEND_AUTO && pi0_cuda_available() && pi0_cuda_check_dims(dims, NULL) == PI0_OK)) {
        pi0_status st = pi0_cuda_check_dims(dims, err);
        if (st) return st;
        if (!pi0_cuda_available()) return pi0_fail(err, PI0_ERR_BACKEND, "the cuda backend needs a CUDA GPU; none is usable");
        *chosen = PI0_BACKEND_CUDA;
        *ops = &pi0_cuda_backend;
        return PI0_OK;
    }
#else
    (void)dims;
    if (wanted == PI0_BACKEND_CUDA)
        return pi0_fail(err, PI0_ERR_BACKEND, "this build of pi0 has no cuda backend (nvcc was not found at build time)");
#endif
    *chosen = PI0_BACKEND_CPU;
    *ops = &pi0_cpu_backend;
    return PI0_OK;
}

/* The CPU backend's thread count; process-wide settings, so only when that backend runs. */
static void apply_threads(const pi0_options *opts, pi0_backend backend) {
    if (backend == PI0_BACKEND_CPU && opts && opts->num_threads > 0) {
        omp_set_num_threads(opts->num_threads);
        openblas_set_num_threads(opts->num_threads);
    }
}

/* A model with its table and arena allocated for `dims`, weights not yet filled. */
static pi0_status model_new(const pi0_dims *dims, const pi0_options *opts, pi0_model **out, pi0_error *err) {
    pi0_model *m = calloc(1, sizeof *m);
    if (!m) return pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    m->dims = *dims;
    pi0_status st = pick_backend(opts ? opts->backend : PI0_BACKEND_AUTO, dims, &m->backend, &m->ops, err);
    if (!st && (m->num_specs = weights_specs(dims, &m->weights, &m->specs)) < 0)
        st = pi0_fail(err, PI0_ERR_OUT_OF_MEMORY, "out of memory");
    if (!st) st = weights_alloc(&m->weights, m->specs, m->num_specs, m->ops->keep, err);
    if (st) {
        m->ops = NULL;
        pi0_model_free(m);
        return st;
    }
    apply_threads(opts, m->backend);
    *out = m;
    return PI0_OK;
}

/* Hands the host weights (and where the others come from) to the backend. */
static pi0_status model_ready(pi0_model *m, pi0_model **out, pi0_error *err) {
    pi0_status st = m->ops->init(m, err);
    m->source = NULL, m->progress = NULL, m->progress_user = NULL;
    if (st) {
        m->ops = NULL;
        pi0_model_free(m);
        return st;
    }
    *out = m;
    return PI0_OK;
}

pi0_status pi0_model_load(const char *dir, const pi0_options *opts, pi0_model **out, pi0_error *err) {
    if (!dir || !out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_model_load: dir and out are required");
    *out = NULL;
    checkpoint ck;
    pi0_status st = checkpoint_open(dir, &ck, err);
    if (st) return st;
    pi0_model *m = NULL;
    st = model_new(&ck.dims, opts, &m, err);
    if (!st) m->horizon_given = ck.horizon_given;
    if (!st) st = checkpoint_check(&ck, m->specs, m->num_specs, err);
    if (!st)
        st = checkpoint_read(&ck, m->specs, m->num_specs, opts ? opts->progress : NULL, opts ? opts->progress_user : NULL,
                             err);
    if (st) {
        checkpoint_close(&ck);
        if (m) m->ops = NULL;
        pi0_model_free(m);
        return st;
    }
    m->source = &ck;
    m->progress = opts ? opts->progress : NULL, m->progress_user = opts ? opts->progress_user : NULL;
    st = model_ready(m, out, err);
    checkpoint_close(&ck); /* after init: the backend streamed its tensors from the mapping */
    return st;
}

pi0_status pi0_model_random(const pi0_dims *dims, uint64_t seed, const pi0_options *opts, pi0_model **out,
                            pi0_error *err) {
    if (!dims || !out) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_model_random: dims and out are required");
    *out = NULL;
    pi0_status st = dims_validate(dims, err);
    pi0_model *m = NULL;
    if (!st) st = model_new(dims, opts, &m, err);
    if (st) return st;
    m->horizon_given = 1;
    m->seed = seed;
    m->progress = opts ? opts->progress : NULL, m->progress_user = opts ? opts->progress_user : NULL;
    weights_init_random(m->specs, m->num_specs, seed);
    return model_ready(m, out, err);
}

const weight_spec *model_spec_of(const pi0_model *m, float *const *slot) {
    for (int i = 0; i < m->num_specs; i++)
        if (m->specs[i].slot == slot) return &m->specs[i];
    return NULL;
}

const void *model_tensor_range(const pi0_model *m, const weight_spec *spec, uint64_t first, uint64_t count,
                               float *scratch, st_dtype *dtype) {
    if (m->source) {
        const st_tensor *t = checkpoint_tensor(m->source, spec); /* checked to exist with this shape at load */
        *dtype = t->dtype;
        return (const char *)t->data + first * st_dtype_size(t->dtype);
    }
    weights_random_range(spec, m->seed, first, count, scratch);
    *dtype = ST_F32;
    return scratch;
}

pi0_status pi0_model_save(const pi0_model *m, const char *dir, int bf16, pi0_error *err) {
    if (!m || !dir) return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_model_save: model and dir are required");
    if (m->ops->keep)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_model_save: a model on the %s backend keeps its weights on "
                        "the device only; save it from a cpu-backend model", m->ops->name);
    return checkpoint_write(dir, &m->dims, m->specs, m->num_specs, bf16, err);
}

void pi0_model_free(pi0_model *m) {
    if (!m) return;
    if (m->ops) m->ops->release(m);
    weights_free(&m->weights);
    free(m->specs);
    free(m);
}

const pi0_dims *pi0_model_dims(const pi0_model *m) {
    return &m->dims;
}

pi0_backend pi0_model_backend(const pi0_model *m) {
    return m->backend;
}

uint64_t pi0_model_device_memory(const pi0_model *m) {
    return m->ops->device_bytes(m);
}

uint64_t pi0_model_graph_captures(const pi0_model *m) {
    return m && m->ops->graph_captures ? m->ops->graph_captures(m) : 0;
}

uint64_t pi0_model_num_params(const pi0_model *m) {
    uint64_t n = 0;
    for (int i = 0; i < m->num_specs; i++) n += m->specs[i].numel;
    return n;
}

/* A NaN or infinity the model reads would come out as NaN actions: refused, naming the input and where it is.
 * Only what the model reads is scanned (the valid cameras' images, Pi0's state, the caller's noise); the images by
 * plan_check_images, unless the backend finds them itself (the CUDA backend, on the device). On our 2-core
 * CI machine a sample of three cameras takes 0.06 ms in cache (the policy's images, just written) and 0.27 ms from
 * memory: nothing next to the CPU backend's inference (20 s at the real size), 0.5-2% of a GPU's. */
static pi0_status check_finite_inputs(const pi0_model *m, const pi0_batch *b, const pi0_plan *p, pi0_error *err) {
    const pi0_dims *d = &m->dims;
    size_t A = (size_t)d->action_dim, chunk = (size_t)p->horizon * A, at;
    pi0_status st = m->ops->checks_images ? PI0_OK : plan_check_images(p, d, err);
    if (st) return st;
    for (int s = 0; s < b->batch; s++) {
        if (d->kind == PI0_MODEL_PI0 && (at = first_nonfinite(b->state + s * A, A)) < A)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "the state of sample %d is %g at dim %zu: inputs must be "
                            "finite", s, b->state[s * A + at], at);
        if (b->noise && (at = first_nonfinite(b->noise + s * chunk, chunk)) < chunk)
            return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "the noise of sample %d is %g at step %zu, dim %zu: inputs "
                            "must be finite", s, b->noise[s * chunk + at], at / A, at % A);
    }
    return PI0_OK;
}

/* pi0_host_alloc's blocks start with a header saying which allocator made them; the caller's bytes follow it, as
 * aligned as the block (cudaHostAlloc's are page-aligned, malloc's 16-byte). */
enum { HOST_HEADER = 64 };

void *pi0_host_alloc(size_t bytes) {
    if (bytes > SIZE_MAX - HOST_HEADER) return NULL;
    unsigned char *block = NULL;
    int pinned = 0;
#ifdef PI0_WITH_CUDA
    pinned = pi0_cuda_available() && (block = pi0_cuda_host_alloc(bytes + HOST_HEADER)) != NULL;
#endif
    if (!block && !(block = malloc(bytes + HOST_HEADER))) return NULL;
    memcpy(block, &pinned, sizeof pinned);
    return block + HOST_HEADER;
}

void pi0_host_free(void *ptr) {
    if (!ptr) return;
    unsigned char *block = (unsigned char *)ptr - HOST_HEADER;
    int pinned;
    memcpy(&pinned, block, sizeof pinned);
#ifdef PI0_WITH_CUDA
    if (pinned) {
        pi0_cuda_host_free(block);
        return;
    }
#endif
    free(block);
}

pi0_status pi0_sample_actions(pi0_model *m, const pi0_batch *batch, float *actions, pi0_timings *timings,
                              pi0_error *err) {
    if (!m || !batch || !actions)
        return pi0_fail(err, PI0_ERR_INVALID_ARGUMENT, "pi0_sample_actions: model, batch and actions are required");
    pi0_plan plan;
    pi0_status st = plan_build(&m->dims, batch, &plan, err);
    if (st) return st;
    st = check_finite_inputs(m, batch, &plan, err);
    if (!st) st = m->ops->sample(m, &plan, actions, timings, err);
    plan_free(&plan);
    return st;
}
