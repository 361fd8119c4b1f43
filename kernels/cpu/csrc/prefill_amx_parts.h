/* The AMX prefill attention's key parts (prefill_attention_amx.h): a row's keys are taken in parts
   of APK keys from key 0, each part's state (max, sum, weighted V) folded into the row's total in
   key order (amx_fold); and the plan of a call's tasks, which makes each part of a short chunk at a
   long context a task of its own (few (tile, kv head) pairs otherwise leave a thread idle), its
   parts folded afterwards (amx_merge) with the bits of the unsplit task. Included once, by
   prefill_attention_amx.h, after prefill_split.h (MIN_TASKS). */
#ifndef INFLIGHT_PREFILL_AMX_PARTS_H
#define INFLIGHT_PREFILL_AMX_PARTS_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "merge_parts.h"

#define APK 512 /* keys a part, a multiple of the tiles' key block (AKB) */

static int64_t amx_split_count; /* sequences whose parts were tasks of their own (tests) */
int64_t amx_attention_splits(void) { return __atomic_load_n(&amx_split_count, __ATOMIC_RELAXED); }

/* Rows' state over some keys, laid out as one block of R rows: m [R] (top score), l [R] (sum of
   exp(score - m)), acc [R][D] (sum of exp(score - m) v). */
typedef struct {
    float *m, *l, *acc;
} amx_state_t;

static inline amx_state_t amx_state_at(float *at, int64_t rp, int64_t D) {
    return (amx_state_t){at, at + rp, at + 2 * rp};
}

/* t = t folded with part p, rows [0, R): each rescaled to the larger top (a row of p that saw no keys
   is skipped; into an empty row of t, p's row is copied). The one fold both a task over several parts
   and the merge of parts computed by separate tasks run, part after part in key order, so a row's
   result is the same bits whichever way its parts were shared out. */
static __attribute__((noinline)) void amx_fold(amx_state_t t, amx_state_t p, int64_t R, int64_t D) {
    for (int64_t r = 0; r < R; r++) {
        float *ta = t.acc + r * D;
        const float *pa = p.acc + r * D;
        if (p.l[r] == 0.0f) continue;
        if (t.l[r] == 0.0f) {
            t.m[r] = p.m[r], t.l[r] = p.l[r];
            memcpy(ta, pa, sizeof(float) * (size_t)D);
            continue;
        }
        const float top = p.m[r] > t.m[r] ? p.m[r] : t.m[r];
        const float wt = expf(t.m[r] - top), wp = expf(p.m[r] - top);
        t.l[r] = fmaf(t.l[r], wt, p.l[r] * wp), t.m[r] = top;
        const __m512 vt = _mm512_set1_ps(wt), vp = _mm512_set1_ps(wp);
        for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(ta + d, _mm512_fmadd_ps(_mm512_loadu_ps(ta + d), vt,
                                                     _mm512_mul_ps(_mm512_loadu_ps(pa + d), vp)));
    }
}

/* The R rows of t (row (i - q0) * rep + h: query i under head g * rep + h), normalized, into out. */
static void amx_write_rows(amx_state_t t, int64_t R, float *restrict out, int64_t row0, int64_t q0, int64_t g,
                           int64_t rep, int64_t H, int64_t D) {
    for (int64_t row = 0; row < R; row++) {
        float *o = out + ((row0 + q0 + row / rep) * H + g * rep + row % rep) * D;
        const float inv = t.l[row] > 0.0f ? 1.0f / t.l[row] : 0.0f;
        for (int64_t d = 0; d < D; d++) o[d] = t.acc[row * D + d] * inv;
    }
}

/* The tasks of a call. Sequence s has pairs[s] (tile of qt queries, kv head) pairs, pair = tile x G +
   kv head, over key parts [pa[s], pb[s]); a sequence with few pairs (under MIN_TASKS, as the float
   kernel's split) and several parts is split: each (pair, part) a task, its state kept in `held`
   (stride[s] floats a task: its rows' m, l and acc) and the pair's parts folded afterwards
   (amx_merge); otherwise each pair is a task over all its parts. Task j: sequence owner[j],
   j - first[s] = pair x parts + part (split) or pair. A result does not depend on the split (amx_fold). */
typedef struct {
    int64_t tasks, *first, *owner, *pa, *pb, *split, *held_at, *stride;
    float *held;
} task_plan_t;

static task_plan_t task_plan(const int32_t *cu_seqlens_q, const int32_t *seq_lens, int64_t S, int64_t G, int64_t qt,
                             int64_t rep, int64_t D, int64_t window) {
    task_plan_t p;
    p.first = malloc(sizeof(int64_t) * (size_t)(6 * S + 1));
    p.pa = p.first + S + 1, p.pb = p.pa + S, p.split = p.pb + S, p.held_at = p.split + S, p.stride = p.held_at + S;
    p.first[0] = 0;
    int64_t held = 0;
    for (int64_t s = 0; s < S; s++) {
        const int64_t qlen = cu_seqlens_q[s + 1] - cu_seqlens_q[s], pairs = (qlen + qt - 1) / qt * G;
        const int64_t base = seq_lens[s] - qlen, from = window > 0 && base - window + 1 > 0 ? base - window + 1 : 0;
        p.pa[s] = from / APK, p.pb[s] = qlen ? (seq_lens[s] + APK - 1) / APK : p.pa[s] + 1;
        const int64_t parts = p.pb[s] - p.pa[s];
        p.split[s] = pairs > 0 && pairs < MIN_TASKS && parts > 1;
        if (p.split[s]) __atomic_add_fetch(&amx_split_count, 1, __ATOMIC_RELAXED);
        p.stride[s] = ((qlen < qt ? qlen : qt) * rep + 15) / 16 * 16 * (D + 2); /* its largest tile's rows */
        p.held_at[s] = held;
        held += p.split[s] ? pairs * parts * p.stride[s] : 0;
        p.first[s + 1] = p.first[s] + pairs * (p.split[s] ? parts : 1);
    }
    p.tasks = p.first[S];
    p.owner = task_owners(p.first, S);
    p.held = held ? aligned_alloc(64, sizeof(float) * (size_t)held) : NULL;
    return p;
}

static void task_plan_free(task_plan_t *p) {
    free(p->held);
    free(p->owner);
    free(p->first);
}

/* A split pair's parts (task j, its first part's), folded in key order into the thread's total and
   written normalized to out: the bits amx_task gives a pair that is not split. */
static void amx_merge(const task_plan_t *p, int64_t j, const int32_t *cu_seqlens_q, float *restrict out, int64_t H,
                      int64_t G, int64_t D, int64_t qt, float *scratch) {
    const int64_t s = p->owner[j], parts = p->pb[s] - p->pa[s], pair = (j - p->first[s]) / parts;
    const int64_t rep = H / G, qlen = cu_seqlens_q[s + 1] - cu_seqlens_q[s], q0 = pair / G * qt;
    const int64_t R = ((q0 + qt < qlen ? q0 + qt : qlen) - q0) * rep, RP = (R + 15) / 16 * 16;
    const amx_state_t total = amx_state_at(scratch, RP, D);
    memset(total.l, 0, sizeof(float) * (size_t)RP);
    for (int64_t k = 0; k < parts; k++)
        amx_fold(total, amx_state_at(p->held + p->held_at[s] + (pair * parts + k) * p->stride[s], RP, D), R, D);
    amx_write_rows(total, R, out, cu_seqlens_q[s], q0, pair % G, rep, H, D);
}

#endif
