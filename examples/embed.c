/*
 * embed.c - a robot program's use of libpi0: open a policy, hand it one observation as the robot has it
 * (camera frames, joint state, an instruction), print the chunk of actions. Nothing but libpi0:
 *
 *   cc embed.c $(pkg-config --cflags --libs pi0) -o embed && ./embed CHECKPOINT_DIR
 *
 * CHECKPOINT_DIR holds model.safetensors, config.json, norm stats under assets/ and the tokenizer (e.g. one made
 * by tests/make_policy_checkpoint.sh, or converted from openpi's with `pi0 convert`). LIBERO's keys.
 */
#include <stdio.h>
#include <stdlib.h>

#include <pi0_policy.h>

int main(int argc, char **argv) {
    if (argc != 2) return fprintf(stderr, "usage: %s CHECKPOINT_DIR\n", argv[0]), 2;
    pi0_error err;
    pi0_policy *policy = NULL;
    pi0_policy_options options = {.checkpoint = argv[1], .adapter = "libero"};
    if (pi0_policy_open(&options, &policy, &err)) return fprintf(stderr, "%s\n", err.message), 1;

    /* what the robot has: two 256x256 RGB frames, an 8-dim state, the instruction */
    static uint8_t image[256 * 256 * 3], wrist[256 * 256 * 3];
    for (int i = 0; i < 256 * 256 * 3; i++) image[i] = (uint8_t)(i * 7), wrist[i] = (uint8_t)(i * 13);
    const float state[8] = {0.0f, 0.1f, 0.8f, 3.0f, -0.2f, 0.1f, 0.02f, -0.02f};
    pi0_observation obs = {0};
    int failed = pi0_observation_add_array(&obs, "observation/image", PI0_DTYPE_U8, 3, (int64_t[]){256, 256, 3}, image, &err) ||
                 pi0_observation_add_array(&obs, "observation/wrist_image", PI0_DTYPE_U8, 3, (int64_t[]){256, 256, 3}, wrist, &err) ||
                 pi0_observation_add_array(&obs, "observation/state", PI0_DTYPE_F32, 1, (int64_t[]){8}, state, &err) ||
                 pi0_observation_add_string(&obs, "prompt", "pick up the black bowl", &err);

    pi0_policy_result result = {0};
    const pi0_observation *batch[1] = {&obs};
    if (!failed && (pi0_policy_infer(policy, batch, NULL, 1, &result, NULL, &err) || result.error.status))
        failed = 1, err = result.error.status ? result.error : err;
    if (failed) fprintf(stderr, "%s\n", err.message);
    else {
        printf("%s policy, %d steps x %d dims; first step:", pi0_model_kind_name(pi0_model_dims(pi0_policy_model(policy))->kind),
               result.horizon, result.action_dims);
        for (int a = 0; a < result.action_dims; a++) printf(" %.5f", result.actions[a]);
        printf("\n");
    }
    pi0_policy_result_free(&result);
    pi0_observation_free(&obs);
    pi0_policy_free(policy);
    return failed;
}
