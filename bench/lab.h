/* lab.h - what the labs of bench/ share: a CUDA call that fails ends the lab, naming the call, its place and the error. */
#ifndef PI0_BENCH_LAB_H
#define PI0_BENCH_LAB_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#define CK(call)                                                                                  \
    do {                                                                                          \
        cudaError_t e_ = (call);                                                                  \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

#endif
