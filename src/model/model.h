/*
 * model.h - what a pi0_model is inside: dims, float32 host weights, and the backend that runs it.
 *
 * A backend is a table of three functions. The CPU backend works straight from the host weights;
 * a GPU backend prepares its own copy in `init` and keeps it in backend_state. Callers of the
 * public API never see which one runs.
 */
#ifndef PI0_MODEL_MODEL_H
#define PI0_MODEL_MODEL_H

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
} pi0_backend_ops;

struct pi0_model {
    pi0_dims dims;
    int horizon_given;  /* dims.action_horizon came from config.json (or the caller), not a default */
    pi0_weights weights;
    weight_spec *specs;
    int num_specs;
    pi0_backend backend;
    const pi0_backend_ops *ops;
    void *backend_state;
};

extern const pi0_backend_ops pi0_cpu_backend;
#ifdef PI0_WITH_CUDA
extern const pi0_backend_ops pi0_cuda_backend;
/* Non-zero when a CUDA device can be used. */
int pi0_cuda_available(void);
#endif

#endif
