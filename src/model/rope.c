#include "model/rope.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

int rope_table_init(rope_table *t, int max_pos, int head_dim) {
    t->max_pos = max_pos;
    t->half = head_dim / 2;
    size_t n = (size_t)max_pos * t->half;
    t->cos = malloc(n * sizeof(float) + 1);
    t->sin = malloc(n * sizeof(float) + 1);
    if (!t->cos || !t->sin) return -1;
    for (int i = 0; i < t->half; i++) {
        double timescale = pow(10000.0, 2.0 * i / head_dim);
        for (int p = 0; p < max_pos; p++) {
            double r = p / timescale;
            t->cos[(size_t)p * t->half + i] = (float)cos(r);
            t->sin[(size_t)p * t->half + i] = (float)sin(r);
        }
    }
    return 0;
}

void rope_table_free(rope_table *t) {
    free(t->cos);
    free(t->sin);
    memset(t, 0, sizeof *t);
}
