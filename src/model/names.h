/*
 * names.h - the roots of openpi's PyTorch checkpoint names (docs/checkpoints.md#tensor-names), for
 * the weights table and for reading dims and the model kind off a checkpoint.
 */
#ifndef PI0_MODEL_NAMES_H
#define PI0_MODEL_NAMES_H

#define NAME_VISION "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
#define NAME_PROJECTOR "paligemma_with_expert.paligemma.model.multi_modal_projector.linear"
#define NAME_LLM "paligemma_with_expert.paligemma.model.language_model."
#define NAME_EXPERT "paligemma_with_expert.gemma_expert.model."
#define NAME_EMBEDDING NAME_LLM "embed_tokens.weight"
/* PaliGemma ties its output head to the embedding: a checkpoint (LeRobot's) may store only the head. */
#define NAME_TIED_EMBEDDING "paligemma_with_expert.paligemma.lm_head.weight"
/* Tensors only Pi0.5 has: its expert's adaptive norms and the time conditioning's MLP. */
#define NAME_PI05_NORM NAME_EXPERT "layers.0.input_layernorm.dense.weight"
#define NAME_PI05_TIME_MLP "time_mlp_in.weight"

#endif
