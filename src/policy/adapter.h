/*
 * adapter.h - a robot's observation dict mapped onto the model's inputs (openpi's *_policy.py input and
 * output transforms, and what its training configs set for the robot): which keys are which camera,
 * which keys make up the state, where the prompt is, how many action dims go back to the robot, whether
 * Pi0.5 reads the state from the prompt, and the action horizon openpi's configs use.
 *
 * Built in (docs/policy.md#adapters):
 *   libero: base_0_rgb <- observation/image, left_wrist_0_rgb <- observation/wrist_image,
 *           right_wrist_0_rgb: zeros, mask false; state <- observation/state (8); 7 action dims.
 *           Pi0.5 (pi05_libero): no discrete state, horizon 10.
 *   droid:  base_0_rgb <- observation/exterior_image_1_left, left_wrist_0_rgb <- observation/wrist_image_left,
 *           right_wrist_0_rgb: zeros, mask false; state <- observation/joint_position (7) ++
 *           observation/gripper_position (1); 8 action dims. Pi0 (pi0_droid): horizon 10; Pi0.5 (pi05_droid):
 *           discrete state, horizon 15.
 * The horizon applies only when the checkpoint's config.json gives none (and `--horizon` is not set).
 * Generic: a JSON file, e.g.
 *   {"name": "my_arm",                                     optional; default: the file name without .json
 *    "cameras": ["images/top", "images/wrist", null],     model camera order (1..8); null = absent (mask false)
 *    "optional_cameras": ["images/wrist"],                 cameras an observation may leave out (optional):
 *                                                          zeros with the mask false then, as openpi's ALOHA
 *                                                          policy does for a missing wrist camera
 *    "state": ["joints", "gripper"],                       concatenated in this order (1..16 keys), each a
 *                                                          number or a vector of any numeric dtype
 *    "prompt": "prompt",                                   key of the instruction string; optional: absent
 *                                                          means "prompt", null means prompts are not read
 *    "default_prompt": "pick up the cup",                  used when the key is missing (optional)
 *    "action_dims": 7,                                     the first action_dims of the model's actions
 *    "discrete_state": true,                               Pi0.5: the normalized state written into the prompt
 *                                                          (optional; default true, as openpi's Pi0.5 configs;
 *                                                          true with a Pi0 checkpoint is refused)
 *    "horizon": 15}                                        optional: the horizon when config.json has none
 * Unknown keys, duplicate keys, empty key strings, all-null cameras, an optional camera not in "cameras" and no prompt source at all (null
 * "prompt" without "default_prompt") are refused with PI0_ERR_FORMAT naming the file and the key.
 * Nested observation maps are flattened with '/' (msgpack_numpy.h), so "images/top" finds {"images": {"top"}}.
 */
#ifndef PI0_POLICY_ADAPTER_H
#define PI0_POLICY_ADAPTER_H

#include "pi0.h"

#define PI0_ADAPTER_MAX_CAMERAS 8
#define PI0_ADAPTER_MAX_STATE_KEYS 16

typedef struct {
    char *name;
    int num_cameras;
    char *camera_keys[PI0_ADAPTER_MAX_CAMERAS]; /* NULL: a camera this robot does not have */
    int camera_optional[PI0_ADAPTER_MAX_CAMERAS]; /* 1: a missing key is zeros with the mask false */
    int num_state_keys;
    char *state_keys[PI0_ADAPTER_MAX_STATE_KEYS];
    char *prompt_key;     /* NULL: prompts are not read from the observation */
    char *default_prompt; /* NULL: a missing prompt is an error */
    int action_dims;
    int discrete_state;   /* -1: the model's own (on for Pi0.5, off for Pi0); 0: off; 1: on */
    int horizon[2];       /* per pi0_model_kind: the horizon when config.json gives none; 0: none */
} pi0_adapter;

/* "libero", "droid", or the path of a generic adapter JSON file (a name that is neither and no readable file:
 * PI0_ERR_IO). On failure *out is NULL. */
pi0_status pi0_adapter_open(const char *name_or_path, pi0_adapter **out, pi0_error *err);
void pi0_adapter_free(pi0_adapter *a);

#endif
