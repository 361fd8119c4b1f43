/* Paged decode attention on the CPU, reading K/V in place from the block-paged cache.

   One query token per sequence. Each cached token's K and V rows (all kv heads) are read once
   per layer, straight out of their blocks, with no padded copy; the query heads that share a kv
   head (GQA) read it from cache. Softmax in float32 over exactly the sequence's own tokens (no
   padding, no mask); a sequence of length 0 (the runner's padding rows) gets zeros. A sliding
   window (window > 0: a local layer) is where the walk starts: the last `window` tokens only,
   and the blocks before them are never read. Layouts, all contiguous:
     q, out [S, H, D]; k_cache, v_cache [NB, BS, G, D]; block_tables [S, MB] int32; seq_lens [S] int32
   The Python wrapper (kernels/cpu_decode_attention.py) checks shapes, dtypes and that every
   seq_len fits its table, and that every block id is in range.

   A task is a chunk of one sequence's tokens (whole blocks): its own max, sum and weighted V per
   head, merged per sequence afterwards (flash-decoding's split). A few long sequences, the tail
   of a workload, would otherwise leave all but one core idle. Chunks are at least MIN_CHUNK
   tokens and sized from the batch alone (about TASKS of them), not from the thread count, so a
   result does not depend on how many threads ran it. Where there are fewer chunks than threads (a
   batch-1 step under MIN_CHUNK tokens), a chunk's heads are shared out over tasks (heads_t).

   Speed (docs/performance.md): the kernel waits on memory, rows scattered block by block. The
   loops walk blocks, not tokens (no division per token), head sizes 32, 64, 128 and 256 get their
   own copies with a known trip count (256, Gemma 3's: its global layers at 8,192 tokens 1.23-1.46x
   faster than in the general copy, a Zen 4 EPYC, 2 threads), and each row is prefetched early. 30 layers of
   SmolLM2's caches, 2 threads: batch 32 at ~150 tokens 16.8 -> 13.8 ms (the same rows only
   summed take 9.4 ms); one sequence of 900 tokens 5.8 -> 3.1 ms. The prefetch runs AHEAD_BYTES
   of rows ahead (16 of SmolLM2's rows, 12 of Gemma 3's, 3 of Qwen3's): where the blocks lie
   scattered, as a cache's do after some turnover, 4 rows ahead left one AMD EPYC core reading at
   ~10 GB/s; 6 KB ahead 1.18-1.40x on those shapes (blocks in order: 1.0-1.12x; 1 and 2 threads,
   A/B interleaved). The V pass takes a block's tokens two at a time (pv_rows2): each head's sums are
   loaded and stored once a pair instead of once a token, the same multiply-adds in the same order
   (Qwen3's shapes, a bfloat16 cache, 2 threads: 1.1-1.2x at 100-400 tokens, the same bits; four at a
   time was no faster). Tried, not kept: widening each kv head's rows once per run of 16 tokens for
   its group's heads and holding their weighted sums in registers through the run (0.5-0.8x: the
   walk then crosses each row once per kv head; GCC already widens a K row once for the group). */
#ifndef CACHE_T
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "merge_parts.h"
#include "prefetch.h"

/* x * y + z rounded once: the multiply-add GCC contracts `z += x * y` into where the CPU has FMA
   (-march=native), written out where two tokens' sums are chained, so both paths make the same bits. */
#ifdef __FMA__
#define MADD(x, y, z) __builtin_fmaf(x, y, z)
#else
#define MADD(x, y, z) ((z) + (x) * (y))
#endif
/* A task's query heads: h = g * rep + r for kv heads g in [g0, g1) and r in [r0, r1) of each group's
   rep. Every head of a chunk normally; where a batch has fewer chunks than threads (one short
   sequence: a batch-1 decode step), each chunk's heads are shared out over several tasks. A head's
   work is the same whichever task does it, so the bits do not depend on the split. */
typedef struct {
    int64_t g0, g1, r0, r1;
} heads_t;

#define AHEAD_BYTES 6144 /* how far ahead rows are prefetched: rows of this many bytes, at least 2 */
#define MIN_CHUNK 128 /* tokens, a floor that keeps each merge small against its chunk (not tuned) */
#define TASKS 16      /* chunks a batch is cut into, about: enough for every core of a small server */


/* The kernel below is compiled twice, cache_types.h including this file: for float32 caches
   (decode_attention_f32) and for bfloat16 ones (decode_attention_bf16, kv_cache_dtype=bfloat16:
   each K/V element widened as it is read; q, the scores and the sums stay float32). */
#define KERNEL_FILE "decode_attention.c"
#include "cache_types.h"
#else /* the kernel, for one cache element type */
/* The hardware prefetcher stops at each 4 KB page and knows nothing of the block table. Into L2
   (prefetch.h): into L1 (until 2026-12-06) a Qwen3-shaped row of 2 KB, 3 of them ahead, read at 10-15
   GB/s on a Zen 4 EPYC and at 23-26 into L2 (SmolLM2's and Gemma 3's rows 1.04-1.35x; docs/performance.md,
   "Issue 47 on a Zen 4 EPYC"). */
static inline void NAME(prefetch_row)(const CACHE_T *cache, const int32_t *table, int64_t t, int64_t end,
                                int64_t BS, int64_t row) {
    if (t >= end) return;
    const char *p = (const char *)(cache + ((int64_t)table[t / BS] * BS + t % BS) * row);
    for (int64_t b = 0; b < row * (int64_t)sizeof(CACHE_T); b += 64) PREFETCH_READ(p + b);
}

/* Scores of one cached token (its K row holds every kv head) against the task's query heads. */
static inline __attribute__((always_inline)) void NAME(qk_row)(
        const CACHE_T *restrict k, int64_t i, const float *restrict qs, float *restrict scores,
        int64_t n, int64_t H, int64_t G, const int64_t D, float scale, heads_t hs) {
    const int64_t rep = H / G;
    for (int64_t g = hs.g0; g < hs.g1; g++) {
        const CACHE_T *kg = k + g * D;
        for (int64_t r = hs.r0; r < hs.r1; r++) {
            const int64_t h = g * rep + r;
            const float *qh = qs + h * D;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t d = 0; d < D; d++) acc += qh[d] * TO_F32(kg[d]);
            scores[h * n + i] = acc * scale;
        }
    }
}

/* One cached token's V row, weighted by its probability under every head, into the heads' sums. */
static inline __attribute__((always_inline)) void NAME(pv_row)(
        const CACHE_T *restrict v, int64_t i, const float *restrict scores, float *restrict part,
        int64_t n, int64_t H, int64_t G, const int64_t D, heads_t hs) {
    const int64_t rep = H / G, stride = D + 2;
    for (int64_t g = hs.g0; g < hs.g1; g++) {
        const CACHE_T *vg = v + g * D;
        for (int64_t r = hs.r0; r < hs.r1; r++) {
            const int64_t h = g * rep + r;
            const float p = scores[h * n + i];
            float *o = part + h * stride + 2;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] = MADD(p, TO_F32(vg[d]), o[d]);
        }
    }
}

/* Two consecutive cached tokens' V rows at once: each head's sums loaded and stored once for both,
   each element's two multiply-adds in token order, as pv_row makes them one token at a time (the
   same bits). */
static inline __attribute__((always_inline)) void NAME(pv_rows2)(
        const CACHE_T *restrict v0, const CACHE_T *restrict v1, int64_t i, const float *restrict scores,
        float *restrict part, int64_t n, int64_t H, int64_t G, const int64_t D, heads_t hs) {
    const int64_t rep = H / G, stride = D + 2;
    for (int64_t g = hs.g0; g < hs.g1; g++) {
        const CACHE_T *a = v0 + g * D, *b = v1 + g * D;
        for (int64_t r = hs.r0; r < hs.r1; r++) {
            const int64_t h = g * rep + r;
            const float p0 = scores[h * n + i], p1 = scores[h * n + i + 1];
            float *o = part + h * stride + 2;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] = MADD(p1, TO_F32(b[d]), MADD(p0, TO_F32(a[d]), o[d]));
        }
    }
}

/* One pass over the rows of tokens [t0, t1): block by block (no division per token; a window's
   first block is entered part way), the row `ahead` on prefetched. `values` (a constant where it is
   called) picks the pass: K rows into scores, or V rows into the weighted sums. */
static inline __attribute__((always_inline)) void NAME(walk)(
        int values, const CACHE_T *restrict cache, const int32_t *restrict table, int64_t t0, int64_t t1,
        const float *restrict qs, float *restrict scores, float *restrict part,
        int64_t H, int64_t G, const int64_t D, int64_t BS, float scale, heads_t hs) {
    const int64_t row = G * D, n = t1 - t0;
    const int64_t fit = AHEAD_BYTES / (row * (int64_t)sizeof(CACHE_T)), ahead = fit > 2 ? fit : 2;
    for (int64_t t = t0, m; t < t1; t += m) {
        const int64_t offset = t % BS;
        const CACHE_T *block = cache + ((int64_t)table[t / BS] * BS + offset) * row;
        m = t1 - t < BS - offset ? t1 - t : BS - offset;
        int64_t j = 0;
        if (values)
            for (; j + 2 <= m; j += 2) {
                NAME(prefetch_row)(cache, table, t + j + ahead, t1, BS, row);
                NAME(prefetch_row)(cache, table, t + j + 1 + ahead, t1, BS, row);
                NAME(pv_rows2)(block + j * row, block + (j + 1) * row, t - t0 + j, scores, part, n, H, G, D, hs);
            }
        for (; j < m; j++) {
            NAME(prefetch_row)(cache, table, t + j + ahead, t1, BS, row);
            if (values)
                NAME(pv_row)(block + j * row, t - t0 + j, scores, part, n, H, G, D, hs);
            else
                NAME(qk_row)(block + j * row, t - t0 + j, qs, scores, n, H, G, D, scale, hs);
        }
    }
}

/* Tokens [t0, t1) of one sequence: per head h, part[h] = (m, l, acc[D]) with m the chunk's top
   score, l = sum_t exp(s_t - m) and acc = sum_t exp(s_t - m) v_t. */
static inline __attribute__((always_inline)) void NAME(one_chunk)(
        const float *restrict qs, const CACHE_T *restrict k_cache, const CACHE_T *restrict v_cache,
        const int32_t *restrict table, int64_t t0, int64_t t1, float *restrict part,
        float *restrict scores, int64_t H, int64_t G, const int64_t D, int64_t BS, float scale, heads_t hs) {
    const int64_t n = t1 - t0, stride = D + 2, rep = H / G;
    NAME(walk)(0, k_cache, table, t0, t1, qs, scores, part, H, G, D, BS, scale, hs);
    for (int64_t g = hs.g0; g < hs.g1; g++)
    for (int64_t h = g * rep + hs.r0; h < g * rep + hs.r1; h++) {
        float *sh = scores + h * n, *ph = part + h * stride;
        float top = sh[0];
        for (int64_t i = 1; i < n; i++) top = sh[i] > top ? sh[i] : top;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            sh[i] = expf(sh[i] - top);
            sum += sh[i];
        }
        ph[0] = top;
        ph[1] = sum;
        memset(ph + 2, 0, sizeof(float) * D);
    }
    NAME(walk)(1, v_cache, table, t0, t1, qs, scores, part, H, G, D, BS, scale, hs);
}

void NAME(decode_attention)(const float *restrict q, const CACHE_T *restrict k_cache,
                          const CACHE_T *restrict v_cache, const int32_t *restrict block_tables,
                          const int32_t *restrict seq_lens, float *restrict out,
                          int64_t S, int64_t H, int64_t G, int64_t D, int64_t BS, int64_t MB,
                          float scale, int64_t window) {
    /* Sequence s reads tokens [lo(s), seq_lens[s]): all of them, or its window's. */
#define LO(s) (window > 0 && seq_lens[s] > window ? seq_lens[s] - window : 0)
#define SPAN(s) (seq_lens[s] > 0 ? seq_lens[s] - LO(s) : 0)
    int64_t total = 0, longest = 1;
    for (int64_t s = 0; s < S; s++) {
        total += SPAN(s);
        longest = SPAN(s) > longest ? SPAN(s) : longest;
    }
    int64_t chunk = (total + TASKS - 1) / TASKS;
    chunk = chunk < MIN_CHUNK ? MIN_CHUNK : chunk;
    chunk = (chunk + BS - 1) / BS * BS; /* whole blocks' worth */
    /* Chunk c is chunk c - first[s] of sequence owner[c] = s; task j takes chunk j / slices, heads slice j % slices. */
    int64_t *first = malloc(sizeof(int64_t) * (S + 1));
    first[0] = 0;
    for (int64_t s = 0; s < S; s++)
        first[s + 1] = first[s] + (SPAN(s) + chunk - 1) / chunk;
    const int64_t chunks = first[S], stride = D + 2, rep = H / G, threads = omp_get_max_threads();
    /* head slices a chunk: enough to give every thread a task, at most the kv heads (or, one kv
       head, its query heads) */
    const int64_t heads_max = G > 1 ? G : rep, want = chunks && chunks < threads ? (threads + chunks - 1) / chunks : 1;
    const int64_t slices = want < heads_max ? want : heads_max, tasks = chunks * slices;
    float *parts = malloc(sizeof(float) * (chunks ? chunks : 1) * H * stride);
    int64_t *owner = task_owners(first, S);
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * H * (chunk < longest ? chunk : longest));
#pragma omp for schedule(dynamic, 1)
        for (int64_t j = 0; j < tasks; j++) {
            const int64_t c = j / slices, k = j % slices, s = owner[c], t0 = LO(s) + (c - first[s]) * chunk;
            const int64_t t1 = t0 + chunk < seq_lens[s] ? t0 + chunk : seq_lens[s];
            const float *qs = q + s * H * D;
            const int32_t *table = block_tables + s * MB;
            float *part = parts + c * H * stride;
            const heads_t hs = G > 1 ? (heads_t){G * k / slices, G * (k + 1) / slices, 0, rep}
                                     : (heads_t){0, 1, rep * k / slices, rep * (k + 1) / slices};
            if (D == 64) /* the common head sizes, each with its inner loops' trip count known */
                NAME(one_chunk)(qs, k_cache, v_cache, table, t0, t1, part, scores, H, G, 64, BS, scale, hs);
            else if (D == 32)
                NAME(one_chunk)(qs, k_cache, v_cache, table, t0, t1, part, scores, H, G, 32, BS, scale, hs);
            else if (D == 128)
                NAME(one_chunk)(qs, k_cache, v_cache, table, t0, t1, part, scores, H, G, 128, BS, scale, hs);
            else if (D == 256)
                NAME(one_chunk)(qs, k_cache, v_cache, table, t0, t1, part, scores, H, G, 256, BS, scale, hs);
            else
                NAME(one_chunk)(qs, k_cache, v_cache, table, t0, t1, part, scores, H, G, D, BS, scale, hs);
        }
        free(scores);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < S; s++) { /* merge: each chunk rescaled to the sequence's top */
            for (int64_t h = 0; h < H; h++) {
                float *o = out + (s * H + h) * D;
                if (first[s + 1] == first[s])
                    memset(o, 0, sizeof(float) * D);
                else
                    merge_parts_row(parts + (first[s] * H + h) * stride, first[s + 1] - first[s], H * stride, D, o);
            }
        }
    }
    free(parts);
    free(owner);
    free(first);
#undef LO
#undef SPAN
}
#endif
