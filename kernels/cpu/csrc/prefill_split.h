/* prefill_attention.c's tasks and their key parts (flash-decoding's split, as decode_attention.c's):
   included once, before the kernel.

   A task is one sequence, one kv head, a tile of up to QT queries and a part of the keys those
   queries see. A short chunk at a long context is few tasks (9 tokens of SmolLM2 at 1,500 tokens of
   context: one tile x 3 kv heads, 3 tasks on 2 threads, one thread idle a third of the time), and
   prefill pacing puts such a chunk beside every decode step. So a sequence with fewer than MIN_TASKS
   (tile, kv head) pairs splits the keys its queries see into parts of at least MIN_PART_KEYS (whole
   key tiles): each part a task with its own max, sum and weighted V per row, merged afterwards
   (`merge_parts`). The split is chosen from the sequence's own shape alone, not the thread count nor
   its neighbours in the call, so a result depends on neither; a sequence that does not split is
   computed as before, straight into `out`. */
#ifndef INFLIGHT_PREFILL_SPLIT_H
#define INFLIGHT_PREFILL_SPLIT_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "merge_parts.h"

#define MIN_TASKS 16
#define MIN_PART_KEYS 256

typedef struct {
    /* task j: sequence owner[j], j - first[s] = ((tile x G) + kv head) x parts[s] + part */
    int64_t tasks, *first, *owner;
    /* sequence s: parts[s] key parts of part_keys[s] keys from key k_from[s]; its parts' rows at
       held + part_at[s], `stride` floats a task (QT x rep rows of max, sum and weighted V) */
    int64_t *parts, *part_keys, *k_from, *part_at, stride;
    float *held;
} split_plan_t;

/* Sequence s's parts over `span` keys, for its `pairs` (tile, kv head) tasks; *part_keys 0: no split. */
static int64_t key_parts(int64_t pairs, int64_t span, int64_t *part_keys) {
    *part_keys = 0;
    if (pairs >= MIN_TASKS || span < 2 * MIN_PART_KEYS) return 1;
    int64_t parts = (MIN_TASKS + pairs - 1) / pairs;
    parts = parts < span / MIN_PART_KEYS ? parts : span / MIN_PART_KEYS;
    *part_keys = ((span + parts - 1) / parts + KT - 1) / KT * KT;
    return (span + *part_keys - 1) / *part_keys;
}

static split_plan_t split_plan(const int32_t *cu_seqlens_q, const int32_t *seq_lens, int64_t S, int64_t G,
                               int64_t rep, int64_t D, int64_t qt, int64_t window) {
    split_plan_t p;
    p.stride = qt * rep * (D + 2);
    p.first = malloc(sizeof(int64_t) * (size_t)(5 * S + 1));
    p.parts = p.first + S + 1, p.part_keys = p.parts + S, p.k_from = p.part_keys + S, p.part_at = p.k_from + S;
    p.first[0] = 0;
    int64_t held = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t qlen = cu_seqlens_q[s + 1] - cu_seqlens_q[s], pairs = (qlen + qt - 1) / qt * G;
        const int64_t base = seq_lens[s] - qlen; /* the first query's position */
        p.k_from[s] = window > 0 && base - window + 1 > 0 ? base - window + 1 : 0;
        p.parts[s] = qlen ? key_parts(pairs, seq_lens[s] - p.k_from[s], p.part_keys + s) : 1;
        p.part_at[s] = held;
        held += p.parts[s] > 1 ? pairs * p.parts[s] * p.stride : 0;
        p.first[s + 1] = p.first[s] + pairs * p.parts[s];
    }
    p.tasks = p.first[S];
    p.owner = task_owners(p.first, S);
    p.held = held ? malloc(sizeof(float) * (size_t)held) : NULL;
    return p;
}

static void split_plan_free(split_plan_t *p) {
    free(p->held);
    free(p->owner);
    free(p->first);
}

/* Task j's place: its (tile x G + kv head) `pair`, its keys [*k_from, *k_to) and where its rows' part
   goes (NULL: its sequence is not split, the rows' results go to `out`). */
static inline int64_t split_task(const split_plan_t *p, int64_t j, const int32_t *seq_lens, int64_t *k_from,
                                 int64_t *k_to, float **part) {
    const int64_t s = p->owner[j], P = p->parts[s], at = j - p->first[s];
    if (P == 1) {
        *k_from = 0, *k_to = seq_lens[s], *part = NULL;
        return at;
    }
    *k_from = p->k_from[s] + at % P * p->part_keys[s];
    *k_to = *k_from + p->part_keys[s];
    *part = p->held + p->part_at[s] + at * p->stride;
    return at / P;
}

/* The first task of each split (tile, kv head) pair merges its `R` rows' parts into `out`. */
static void merge_parts(const split_plan_t *p, int64_t j, int64_t R, int64_t D, int64_t rep, int64_t H,
                        int64_t G, int64_t row0, int64_t q0, float *restrict out) {
    const int64_t s = p->owner[j], P = p->parts[s], pair = (j - p->first[s]) / P, g = pair % G;
    const float *at = p->held + p->part_at[s] + pair * P * p->stride;
    for (int64_t row = 0; row < R; row++)
        merge_parts_row(at + row * (D + 2), P, p->stride, D,
                        out + ((row0 + q0 + row / rep) * H + g * rep + row % rep) * D);
}
#endif
