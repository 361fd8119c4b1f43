/* Flash-decoding's merge, shared by the attention kernels that split one row's keys into parts
   (decode_attention.c's chunks of a sequence, prefill_split.h's key parts of a short chunk). */
#ifndef INFLIGHT_MERGE_PARTS_H
#define INFLIGHT_MERGE_PARTS_H
#include <math.h>
#include <stdint.h>
#include <string.h>

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
