/*
 * weights.h - the float32 host copy of every parameter, and the one table that names them.
 *
 * weights_specs() lists every tensor the engine uses for the given dims (Pi0 or Pi0.5) with its
 * checkpoint name (docs/checkpoints.md#tensor-names), its shape, the part of the model it belongs to
 * and the slot that holds it. Loading, random initialisation, saving, `pi0 inspect` and parameter
 * counting all walk this one table, so the checkpoint layout is written down exactly once.
 */
#ifndef PI0_MODEL_WEIGHTS_H
#define PI0_MODEL_WEIGHTS_H

#include <stdint.h>

#include "pi0.h"

typedef struct {
    float *ln1_w, *ln1_b;
    float *q_w, *q_b, *k_w, *k_b, *v_w, *v_b, *o_w, *o_b;
    float *ln2_w, *ln2_b;
    float *fc1_w, *fc1_b, *fc2_w, *fc2_b;
} vit_layer;

/* One Gemma block of either expert. Linear weights are (out, in); no biases. A norm is either a plain
 * RMSNorm (its scale, used as 1 + w) or, in Pi0.5's action expert, an adaptive one whose dense layer
 * maps the time conditioning to (scale | shift | gate) (docs/model.md#adaptive-rmsnorm); the other
 * pointer is NULL. */
typedef struct {
    float *input_norm;                  /* (W) RMSNorm scale, or NULL */
    float *input_norm_dense_w, *input_norm_dense_b; /* (3W, W), (3W) adaptive, or NULL */
    float *q_w, *k_w, *v_w, *o_w;
    float *post_attn_norm;
    float *post_norm_dense_w, *post_norm_dense_b;
    float *gate_w, *up_w, *down_w;
} gemma_layer;

typedef struct {
    /* SigLIP vision tower + projector */
    float *patch_w, *patch_b;          /* (Dv, 3, p, p), (Dv) */
    float *pos_emb;                    /* (num_patches, Dv) */
    vit_layer *vit;                    /* [vision.depth] */
    float *post_ln_w, *post_ln_b;
    float *proj_w, *proj_b;            /* (D, Dv), (D) */
    /* Gemma LLM over the prefix */
    float *embed;                      /* (vocab, D) */
    gemma_layer *llm;                  /* [llm.depth] */
    float *llm_norm;                   /* kept for saving; the prefix pass does not need it */
    /* action expert over the suffix */
    gemma_layer *expert;               /* [expert.depth] */
    float *expert_norm;                /* Pi0: (We) */
    float *expert_norm_dense_w, *expert_norm_dense_b; /* Pi0.5: (3 We, We), (3 We) */
    /* action heads */
    float *action_in_w, *action_in_b;          /* (We, A) */
    float *action_out_w, *action_out_b;        /* (A, We) */
    float *state_proj_w, *state_proj_b;        /* Pi0: (We, A) */
    float *action_time_in_w, *action_time_in_b;   /* Pi0: (We, 2 We) over [action token, time embedding] */
    float *action_time_out_w, *action_time_out_b; /* Pi0: (We, We) */
    float *time_mlp_in_w, *time_mlp_in_b;      /* Pi0.5: (We, We), the time conditioning's MLP */
    float *time_mlp_out_w, *time_mlp_out_b;    /* Pi0.5: (We, We) */
    float *arena;                      /* one allocation holding every tensor above */
} pi0_weights;

typedef enum { PART_VISION, PART_PROJECTOR, PART_EMBEDDING, PART_LLM, PART_EXPERT, PART_ACTION_HEADS, PART_COUNT } weight_part;

/* How random weights are drawn for a tensor. */
typedef enum {
    INIT_FAN_IN,   /* uniform with std 1/sqrt(last dim product) */
    INIT_BIAS,     /* small uniform */
    INIT_ZERO_MEAN_SCALE, /* RMSNorm scale w, used as 1 + w: small around 0 */
    INIT_UNIT_SCALE,      /* LayerNorm scale: around 1 */
} weight_init;

typedef struct {
    char name[128];      /* checkpoint name without any prefix */
    const char *alt_name; /* another name the same tensor may have (a tied copy), or NULL */
    int rank;
    int64_t shape[4];
    uint64_t numel;
    weight_part part;
    weight_init init;
    float **slot;        /* where the tensor's pointer lives in pi0_weights */
} weight_spec;

const char *weight_part_name(weight_part part);

/* Allocates the layer arrays of `w` and returns the table for `dims` in *specs (caller frees).
 * Returns the number of entries, or -1 when out of memory. */
int weights_specs(const pi0_dims *dims, pi0_weights *w, weight_spec **specs);

/* Which tensors a backend reads from the host arena; the others it streams once, at init. */
typedef int (*weight_keep_fn)(const pi0_weights *w, const weight_spec *spec);

/* Allocates one arena for the tensors of `specs` that `keep` accepts (NULL: all of them) and points their
 * slots into it; the other slots stay NULL. */
pi0_status weights_alloc(pi0_weights *w, const weight_spec *specs, int count, weight_keep_fn keep, pi0_error *err);

/* Fills every allocated tensor from a counter-based generator: same seed, same weights, any thread count. */
void weights_init_random(const weight_spec *specs, int count, uint64_t seed);
/* Elements [first, first + count) of the random tensor `spec` (as weights_init_random draws it) into out. */
void weights_random_range(const weight_spec *spec, uint64_t seed, uint64_t first, uint64_t count, float *out);

void weights_free(pi0_weights *w);

#endif
