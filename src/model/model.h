/*
 * model.h - what a pi0_model is inside: dims, float32 host weights, and the backend that runs it.
 *
 * A backend is a table of functions. The CPU backend works straight from the host weights; a GPU
 * backend prepares its own copy in `init` and keeps it in backend_state. A backend with a `keep`
 * function has only the tensors it accepts widened into the host arena; it streams the others in
 * `init` from model_tensor_range (the checkpoint's mapping, or the random generator), so that a GPU
 * model costs the host no float32 copy of its weights. Callers of the public API never see which one runs.
 */
#ifndef PI0_MODEL_MODEL_H
#define PI0_MODEL_MODEL_H

#include "io/safetensors.h"
#include "model/plan.h"
#include "model/weights.h"
#include "pi0.h"

/* Every RMSNorm and LayerNorm of both networks (openpi's 1e-6). */
#define NORM_EPS 1e-6f

typedef struct pi0_backend_ops {
    const char *name;
    pi0_status (*init)(pi0_model *model, pi0_error *err);
    pi0_status (*sample)(pi0_model *model, const pi0_plan *plan, float *actions, pi0_timings *timings,
                         pi0_error *err);
    void (*release)(pi0_model *model);
    uint64_t (*device_bytes)(const pi0_model *model); /* peak accelerator memory held */
    uint64_t (*graph_captures)(const pi0_model *model); /* batch shapes prepared so far */
    weight_keep_fn keep; /* NULL: every tensor stays on the host */
    int checks_images;   /* sample finds NaN or infinity in the images itself (plan_name_nonfinite_image names it) */
} pi0_backend_ops;

struct checkpoint_s;

struct pi0_model {
    pi0_dims dims;
    int horizon_given;  /* dims.action_horizon came from config.json (or the caller), not a default */
    pi0_weights weights;
    weight_spec *specs;
    int num_specs;
    pi0_backend backend;
    const pi0_backend_ops *ops;
    void *backend_state;
    /* during init only: where the tensors without a host slot come from */
    const struct checkpoint_s *source; /* the checkpoint being loaded, or NULL: random weights of `seed` */
    uint64_t seed;
    void (*progress)(void *user, const char *what, uint64_t done, uint64_t total);
    void *progress_user;
};

/* The spec whose slot is `slot` (an address inside model->weights), or NULL. */
const weight_spec *model_spec_of(const pi0_model *model, float *const *slot);

/* For a backend's init: elements [first, first + count) of a tensor, as they are stored: a pointer into the
 * checkpoint's mapping with its dtype (no copy), or, for random weights, float32 generated into `scratch`
 * (room for count floats). */
const void *model_tensor_range(const pi0_model *model, const weight_spec *spec, uint64_t first, uint64_t count,
                               float *scratch, st_dtype *dtype);

extern const pi0_backend_ops pi0_cpu_backend;
#ifdef PI0_WITH_CUDA
extern const pi0_backend_ops pi0_cuda_backend;
/* Non-zero when a CUDA device can be used. */
int pi0_cuda_available(void);
/* Page-locked host memory (pi0_host_alloc's), NULL when the driver has none to give; and its release. */
void *pi0_cuda_host_alloc(size_t bytes);
void pi0_cuda_host_free(void *ptr);
#endif

#endif
