/*
 * pi0.h - inference engine for Physical Intelligence's Pi0 and Pi0.5 vision-language-action policies.
 *
 * The library loads an openpi PyTorch checkpoint (model.safetensors + config.json) and computes
 * `sample_actions`: camera images, robot state and prompt token ids in, a chunk of actions out
 * (docs/model.md). pi0_policy.h adds openpi's Policy.infer around it: raw robot observations in.
 *
 * Conventions:
 *  - Every function that can fail returns a pi0_status and, when `err` is not NULL, fills it with a
 *    one-line message naming the problem. The library never prints, exits or aborts.
 *  - All arrays are dense, row-major, little-endian host memory owned by the caller.
 *  - A pi0_model may be used by one thread at a time; load several models for concurrency.
 *
 * Environment switches the library reads when a model is loaded (for same-run A/B benchmarks and
 * debugging; the defaults are the fast, tested paths):
 *   PI0_CUDA_GRAPHS=0   run every call eagerly instead of replaying one CUDA graph per input shape
 *   PI0_CUDA_MAX_GRAPHS=n  keep at most n captured shapes (default 1024), dropping the least recently used
 *   PI0_SKINNY=0        cuBLASLt instead of the engine's skinny Linears for small denoise steps
 *   PI0_ATTN_DECODE=0   the tiled attention instead of the few-queries one for small denoise steps
 *   PI0_ATTN_SPLIT=n    cap the key split of the tiled attention at n blocks
 *   PI0_ATTN_WGMMA=0    the mma.sync tiled attention instead of the wgmma/TMA one at head dims 256 and 72 (H100/H200)
 *   PI0_PDL=0           no programmatic dependent launch (the denoise kernels, the prefix's gate|up; sm_90+)
 *   PI0_BESIDE=0        a graph's first denoise step after the prefix instead of beside it (CUDA, <= 64 suffix rows)
 *   PI0_PARTS=0         cuBLASLt's own split-K reductions instead of partial sums added by the next norm (CUDA)
 *   PI0_GATE_UP=0       the prefix's gate|up through cuBLASLt, then gelu x up, instead of one fused kernel (H100/H200)
 *   PI0_FUSED_EULER=0   a batch-1 step's Euler update and the next step's input Linear as separate kernels (CUDA)
 *   PI0_STAGE=0         the skinny Linears' later passes load their weights after the pass before, not ahead (CUDA)
 *   PI0_PERSISTENT=1    each batch-1 denoise step as one persistent kernel (sm_90+; opt-in: slower today)
 *   PI0_PERSISTENT_SLOTS=n  weight slots its ring keeps in flight per SM (default 4)
 *   PI0_GEMM_TUNE=0     take cuBLASLt's first heuristic pick per GEMM shape instead of timing candidates
 * They change speed only: every path computes the same function within the backend's tolerance.
 */
#ifndef PI0_H
#define PI0_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* What the shared library exports: this API and nothing else (it is built with hidden visibility). */
#if defined(__GNUC__)
#define PI0_API __attribute__((visibility("default")))
#else
#define PI0_API
#endif

/* Limits on a request, far above real use; past them a call fails with PI0_ERR_INVALID_ARGUMENT. */
#define PI0_MAX_BATCH 4096       /* samples in one call */
#define PI0_MAX_CAMERAS 64       /* camera slots of a batch */
#define PI0_MAX_PROMPT_LEN 65536 /* prompt tokens per sample */
#define PI0_MAX_HORIZON 4096     /* action steps H */
#define PI0_MAX_STEPS 10000      /* Euler steps */
#define PI0_MAX_IMAGE_SIDE 4096  /* camera frames the policy resizes (pi0_policy.h) */

typedef enum {
    PI0_OK = 0,
    PI0_ERR_INVALID_ARGUMENT, /* a caller-side mistake: bad shape, NULL pointer, out-of-range id */
    PI0_ERR_IO,               /* a file could not be opened, mapped or written */
    PI0_ERR_FORMAT,           /* a file is corrupt, truncated or not what it claims to be */
    PI0_ERR_CHECKPOINT,       /* a tensor is missing or has the wrong shape or dtype */
    PI0_ERR_OUT_OF_MEMORY,
    PI0_ERR_BACKEND,          /* the backend is unavailable or failed (e.g. no GPU) */
    PI0_ERR_NUMERIC,          /* finite inputs gave a NaN or infinite result (pi0_policy_infer's actions): the
                                 weights, the norm stats or an extreme input overflowed; nothing may act on it */
} pi0_status;

typedef struct {
    pi0_status status;
    char message[512];
} pi0_error;

/* A short static name for a status ("invalid argument", ...). */
PI0_API const char *pi0_status_name(pi0_status status);

typedef enum {
    PI0_BACKEND_AUTO = 0, /* CUDA when the library was built with it and a GPU is present, else CPU */
    PI0_BACKEND_CPU,      /* float32 reference backend */
    PI0_BACKEND_CUDA,
} pi0_backend;

/* Parses "auto", "cpu" or "cuda". Returns 0 on success, -1 for an unknown name. */
PI0_API int pi0_backend_from_name(const char *name, pi0_backend *out);
PI0_API const char *pi0_backend_name(pi0_backend backend);

/* Which model a checkpoint holds (docs/model.md): Pi0, or Pi0.5 with its adaptive norms in the expert,
 * time-conditioned instead of time-concatenated, and no state token. Told from tensor names alone. */
typedef enum {
    PI0_MODEL_PI0 = 0,
    PI0_MODEL_PI05,
} pi0_model_kind;

/* "pi0" or "pi05". */
PI0_API const char *pi0_model_kind_name(pi0_model_kind kind);

/* Dimensions of one transformer stack. */
typedef struct {
    int width;
    int depth;
    int mlp_dim;
    int num_heads;
    int num_kv_heads;
    int head_dim;
} pi0_stack_dims;

/* Every dimension of a model. Loaded checkpoints derive these from tensor shapes and config.json. */
typedef struct {
    pi0_model_kind kind;
    pi0_stack_dims vision;  /* SigLIP ViT (num_kv_heads == num_heads) */
    int patch_size;         /* 14 */
    int image_size;         /* 224: sqrt(number of position embeddings) * patch_size */
    pi0_stack_dims llm;     /* Gemma prefix model ("expert 0") */
    pi0_stack_dims expert;  /* action expert ("expert 1") */
    int vocab_size;
    int action_dim;         /* 32 */
    int action_horizon;     /* default horizon H from config.json */
    int max_token_len;      /* tokenized prompt length the policy pads to */
} pi0_dims;

/* The real Pi0 dimensions (So400m/14, gemma_2b, gemma_300m, H = 50, 48 prompt tokens). */
PI0_API pi0_dims pi0_dims_pi0(void);
/* The real Pi0.5 dimensions: Pi0's networks, H = 50, 200 prompt tokens. */
PI0_API pi0_dims pi0_dims_pi05(void);

typedef struct {
    pi0_backend backend;
    int num_threads; /* CPU backend threads; 0 (or negative) = one per core. Other backends leave the process's
                        thread settings (OpenMP, OpenBLAS) alone. */
    /* Called during loading with a stage name and progress in bytes; may be NULL. */
    void (*progress)(void *user, const char *stage, uint64_t done, uint64_t total);
    void *progress_user;
} pi0_options;

typedef struct pi0_model pi0_model;

/* Loads `dir`/model.safetensors and `dir`/config.json. `options` may be NULL (defaults). */
PI0_API pi0_status pi0_model_load(const char *dir, const pi0_options *options, pi0_model **out, pi0_error *err);

/* Builds a model of the given dims with deterministic random weights drawn from `seed`. */
PI0_API pi0_status pi0_model_random(const pi0_dims *dims, uint64_t seed, const pi0_options *options,
                            pi0_model **out, pi0_error *err);

/* Writes the model as a checkpoint directory (model.safetensors + config.json), in float32 or
 * bfloat16 (`bf16` != 0). Creates `dir` if needed. Only a cpu-backend model can be saved: the cuda
 * backend keeps no host copy of its weights (PI0_ERR_INVALID_ARGUMENT). */
PI0_API pi0_status pi0_model_save(const pi0_model *model, const char *dir, int bf16, pi0_error *err);

PI0_API void pi0_model_free(pi0_model *model);

PI0_API const pi0_dims *pi0_model_dims(const pi0_model *model);
PI0_API pi0_backend pi0_model_backend(const pi0_model *model);
/* Peak bytes of accelerator memory the model's backend has held (weights, graphs, activations);
 * 0 on the CPU backend. */
PI0_API uint64_t pi0_model_device_memory(const pi0_model *model);

/* How many batch shapes the backend has prepared so far: on CUDA, graphs captured (each costs a
 * capture and GEMM choices on the call that meets the shape first); 0 on the CPU. A server that
 * warmed up (pi0_policy_warmup) can watch it stay constant. */
PI0_API uint64_t pi0_model_graph_captures(const pi0_model *model);

/* Number of parameters the engine uses (lm_head and other ignored tensors excluded). */
PI0_API uint64_t pi0_model_num_params(const pi0_model *model);

/* A camera frame as a robot sends it: RGB, HWC, uint8, any size up to PI0_MAX_IMAGE_SIDE on a side. */
typedef struct {
    const uint8_t *pixels; /* height * width * 3 bytes; NULL only for a masked camera */
    int height, width;
} pi0_frame;

/*
 * A batch of B observations. Camera c of sample b is given one of two ways: as model input, the image
 * images[c] + b*S*S*3 (HWC, float in [-1, 1], S = dims.image_size), or as the robot's frame
 * frames[b*num_cameras + c], which the backend makes model input exactly as openpi's policy transforms do
 * (resize_with_pad with Pillow's bilinear filter, then x / 255 * 2 - 1; on the GPU, on the device). Exactly
 * one of images and frames is non-NULL. A camera takes part iff image_masks[b*num_cameras + c] != 0.
 * Prompt token i of sample b is prompt_ids[b*prompt_len + i], valid iff prompt_mask[b*prompt_len + i] != 0.
 * Invalid cameras and tokens do not change the result; by default they are skipped and cost nothing.
 */
typedef struct {
    int batch;
    int num_cameras;
    const float *const *images;  /* num_cameras pointers, each to (B, S, S, 3); or NULL, and frames */
    const pi0_frame *frames;     /* (B, num_cameras); or NULL, and images */
    const uint8_t *image_masks;  /* (B, num_cameras) */
    int prompt_len;
    const int32_t *prompt_ids;   /* (B, prompt_len) */
    const uint8_t *prompt_mask;  /* (B, prompt_len) */
    const float *state;          /* (B, action_dim), already normalized and padded */
    int horizon;                 /* H in 1..PI0_MAX_HORIZON, or 0 for dims.action_horizon. `noise` and `actions`
                                    hold H steps per sample, with H resolved that way: a caller that takes H
                                    from data (a noise tensor's shape) must refuse 0 itself, since here 0 is
                                    not an empty horizon but the default. Negative: PI0_ERR_INVALID_ARGUMENT. */
    const float *noise;          /* (B, H, action_dim) x at t = 1; NULL = standard normal from noise_seed */
    uint64_t noise_seed;
    int num_steps;               /* Euler steps in 1..PI0_MAX_STEPS, or 0 for 10 (the same caution) */
    int uniform_shape;           /* non-zero: masked cameras (zeros where their image is NULL) and padding tokens
                                    are computed too, never used as keys: the actions are the same, and every
                                    batch of the same size, cameras and prompt_len has the same shape, so a
                                    server's CUDA graphs are made once. 0: they are skipped (less work) */
} pi0_batch;

/* Wall time spent in each stage of the last sample_actions call, in milliseconds. */
typedef struct {
    double vision_ms;  /* ViT + projector over the valid cameras */
    double prefix_ms;  /* embedding + LLM prefix pass filling the K/V cache */
    double denoise_ms; /* all Euler steps of the action expert */
    double total_ms;
} pi0_timings;

/* Computes actions (B, H, action_dim) float32. `timings` may be NULL. What the model reads must be finite (the
 * images of valid cameras, Pi0's state, the caller's noise): a NaN or infinity there is refused naming the input
 * and where it is (PI0_ERR_INVALID_ARGUMENT). The actions themselves are not checked here, since a batch's
 * samples succeed or fail together; pi0_policy_infer checks each observation's. */
PI0_API pi0_status pi0_sample_actions(pi0_model *model, const pi0_batch *batch, float *actions,
                              pi0_timings *timings, pi0_error *err);

/*
 * Host memory for a batch's images or frames that the CUDA backend sends to the GPU from where it is, instead of
 * copying it into a buffer of its own first: page-locked ("pinned") memory of the CUDA driver when a GPU is present,
 * else malloc's. A caller that writes its float images here saves that copy, ~0.1-0.2 ms a call for two 224 x 224
 * images; its uint8 frames, ~0.05 ms for two 256 x 256 and ~0.2 ms for two 480 x 640 (the CUDA backend sends any
 * page-locked memory the same way, e.g. cudaHostAlloc's; pi0_policy's prepared observations live in it). Any backend
 * reads it like other memory. Slow to allocate and free (the driver locks the pages): keep and reuse it. NULL when
 * out of memory; freed only by pi0_host_free.
 */
PI0_API void *pi0_host_alloc(size_t bytes);
PI0_API void pi0_host_free(void *ptr);

#ifdef __cplusplus
}
#endif
#endif /* PI0_H */
