/* Flash-decoding's merge, shared by the attention kernels that split one row's keys into parts
   (decode_attention.c's chunks of a sequence, prefill_split.h's key parts of a short chunk, the AMX
   prefill's parts in prefill_amx_parts.h), and their plans' task owners. */
#ifndef INFLIGHT_MERGE_PARTS_H
#define INFLIGHT_MERGE_PARTS_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The sequence of each of the first[S] tasks (or chunks) of a split plan, whose sequence s has tasks
   first[s] .. first[s + 1] - 1: owner[j] = s (freed by the caller; never a zero-sized malloc). */
static inline int64_t *task_owners(const int64_t *first, int64_t S) {
    int64_t *owner = malloc(sizeof(int64_t) * (size_t)(first[S] ? first[S] : 1));
    for (int64_t s = 0; s < S; s++)
        for (int64_t j = first[s]; j < first[s + 1]; j++) owner[j] = s;
    return owner;
}

/* o[D] = the softmax-weighted V of one row from `count` parts, part k at part + k * step laid out as
   (m: its top score, l: sum of exp(score - m), acc[D]: sum of exp(score - m) v). Each part is
   rescaled to the row's top; a part with l = 0 saw none of the row's keys and is skipped. */
static inline void merge_parts_row(const float *part, int64_t count, int64_t step, int64_t D, float *o) {
    float top = -INFINITY, sum = 0.0f;
    for (int64_t k = 0; k < count; k++) {
        const float *pk = part + k * step;
        top = pk[1] > 0.0f && pk[0] > top ? pk[0] : top;
    }
    memset(o, 0, sizeof(float) * D);
    for (int64_t k = 0; k < count; k++) {
        const float *pk = part + k * step;
        if (pk[1] == 0.0f) continue;
        const float w = expf(pk[0] - top);
        sum += w * pk[1];
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] += w * pk[2 + d];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t d = 0; d < D; d++) o[d] *= inv;
}
#endif
