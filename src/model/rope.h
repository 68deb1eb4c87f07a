/*
 * rope.h - the rotary position table both backends read (docs/model.md#rope): cos and sin of
 * pos / 10000^(2i / head_dim) for every position and frequency, computed once in double.
 */
#ifndef PI0_MODEL_ROPE_H
#define PI0_MODEL_ROPE_H

typedef struct {
    int max_pos, half;   /* positions [0, max_pos), frequencies [0, half = head_dim / 2) */
    float *cos, *sin;    /* (max_pos, half) each */
} rope_table;

/* Returns 0, or -1 when out of memory (the table is then empty but may be freed). */
int rope_table_init(rope_table *t, int max_pos, int head_dim);
void rope_table_free(rope_table *t);

#endif
