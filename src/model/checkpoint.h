/*
 * checkpoint.h - an openpi PyTorch checkpoint directory (model.safetensors + config.json) mapped
 * onto pi0_weights through the table of weights.h.
 *
 * Names may carry a prefix (LeRobot stores the same modules under "model."); it is found from the
 * embedding. lm_head tensors are ignored (PaliGemma's is tied to the embedding and serves as it when the
 * embedding itself is not stored, docs/checkpoints.md#tied-embedding; the expert's is
 * untrained). Every tensor is checked for presence and shape before anything is copied.
 */
#ifndef PI0_MODEL_CHECKPOINT_H
#define PI0_MODEL_CHECKPOINT_H

#include "io/safetensors.h"
#include "model/weights.h"

typedef struct checkpoint_s {
    st_file file;
    char prefix[128];
    pi0_dims dims;
    int horizon_given; /* config.json gave action_horizon (else dims holds the default) */
} checkpoint;

/* Maps dir/model.safetensors, finds the name prefix and derives dims. */
pi0_status checkpoint_open(const char *dir, checkpoint *ck, pi0_error *err);
void checkpoint_close(checkpoint *ck);

/* The dims of the checkpoint in `dir` (its header and config.json only; no weight is read). */
pi0_status checkpoint_peek_dims(const char *dir, pi0_dims *dims, pi0_error *err);

/* The checkpoint tensor for `spec`, or NULL when missing. */
const st_tensor *checkpoint_tensor(const checkpoint *ck, const weight_spec *spec);

/* Non-zero when the engine deliberately ignores this checkpoint tensor (lm_head). */
int checkpoint_ignored(const char *name);

/* Fails with the tensor's name and both shapes on the first missing or mis-shaped tensor. */
pi0_status checkpoint_check(const checkpoint *ck, const weight_spec *specs, int count, pi0_error *err);

/* Widens every tensor that has a slot (weights_alloc) to float32 into it; reports progress in bytes read. */
pi0_status checkpoint_read(const checkpoint *ck, const weight_spec *specs, int count,
                           void (*progress)(void *, const char *, uint64_t, uint64_t), void *user,
                           pi0_error *err);

/* Writes dir/model.safetensors (F32 or BF16) and dir/config.json. */
pi0_status checkpoint_write(const char *dir, const pi0_dims *dims, const weight_spec *specs, int count, int bf16,
                            pi0_error *err);

#endif
