/* bf16.h - how C code of the CUDA backend holds bfloat16: as its 16 bits (CUDA's __nv_bfloat16
 * is C++-only); the .cu files reinterpret these pointers as __nv_bfloat16. */
#ifndef PI0_CUDA_BF16_H
#define PI0_CUDA_BF16_H

#include <stdint.h>

typedef uint16_t pi0_bf16;

#endif
