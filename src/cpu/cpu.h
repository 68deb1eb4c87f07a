/*
 * cpu.h - the float32 CPU backend: the project's reference for every other backend.
 */
#ifndef PI0_CPU_CPU_H
#define PI0_CPU_CPU_H

#include "model/model.h"

/* Intermediates a test may ask for; any pointer may be NULL. */
typedef struct {
    float *vision_tokens; /* (num_images * tokens_per_image, llm width): projector output, plan order */
    float **cache_k;      /* [llm depth] pointers to (cache_rows, kv_heads * head_dim): K after RoPE */
    float **cache_v;      /* [llm depth] likewise for V */
} cpu_trace;

/* sample_actions on the CPU, optionally copying intermediates into `trace`. */
pi0_status cpu_sample_traced(const pi0_model *model, const pi0_plan *plan, float *actions, pi0_timings *timings,
                             cpu_trace *trace, pi0_error *err);

#endif
