/* Causal prefill attention on the CPU over the paged cache in place (issue 47): the attention of a
   step's prompt rows, for the C layer stack (decode_stack.c) and the CPU engine's Python layers.

   S sequences' query chunks lie back to back in q [T, H, D]: sequence s at rows cu[s] .. cu[s+1],
   its L = seq_lens[s] cached tokens including the chunk's own (already stored), so query i of the
   chunk sits at position L - qlen + i and sees keys 0 .. its position (with a window > 0, a local
   layer: only the last `window` of them, itself included). Earlier context (a previous chunk, a
   reused prefix) is read from the blocks like the rest: no gather, no padded copy, no mask.
   Layouts, all contiguous: q, out [T, H, D]; k_cache, v_cache [NB, BS, G, D];
   block_tables [S, MB] int32; cu_seqlens_q [S + 1] int32; seq_lens [S] int32.
   The wrapper (kernels/cpu/prefill_attention.py) checks every shape, dtype and bound.

   Blocked, flash-attention style. A task is one sequence, one kv head and a tile of QT queries:
   its rows are those queries under every query head of the group (GQA: the group shares each key
   read); a short chunk at a long context also splits its keys into parts, a task each, merged
   afterwards (prefill_split.h). It walks the keys its rows can see in tiles of KT, each tile
   copied once out of its blocks (transposed K, widened from bfloat16 where the cache is), and
   keeps per row the running max, sum and weighted V (online softmax), so no [Q, K] score matrix
   exists. Each row sums exactly the keys
   it sees (a range per row, no -inf: -ffast-math assumes none). Tasks are independent, so the
   result does not depend on the thread count.

   Speed (docs/benchmarks.md, "A prompt token's price"): a tile's scores and weighted V are RB rows
   x 4 vectors of accumulators in registers, each K or V vector loaded once into a register and fed
   to RB FMAs (IN_REG; GCC otherwise re-read it from memory for every FMA, and the loads, not the
   FMAs, set the pace: 1.5x on SmolLM2's shapes); a task takes QT = 32 queries, so each key tile
   is widened and transposed once for 32 x (heads per group) rows (1.1x over 16); a task's last
   rows, fewer than RB, are a block of their own (prefill_vec.h BY_ROWS); and with AVX-512
   a tile's K is transposed 16 x 16 in registers (prefill_vec.h), not element by element (1.1-1.2x).
   The vector width and RB are the build's (prefill_vec.h). */
#ifndef CACHE_T
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QT 32 /* queries per task (times the group's heads: its rows); each K/V tile is read once per task */
#include "prefill_vec.h"
#include "prefill_split.h"

/* One row's online softmax over a block of keys [j0, j1) of which it sees [a, e) (a < e): its scores
   sr (times scale) become exp(score - the new max) there and 0 elsewhere; its max m and sum l move on;
   returns keep, the factor its sums of weighted V so far are multiplied by (0 for its first keys). */
static inline float softmax_row(float *restrict sr, int64_t j0, int64_t a, int64_t e, int64_t j1, float scale,
                                float *restrict m, float *restrict l) {
    float top = sr[a] * scale;
    for (int64_t j = a + 1; j < e; j++) top = sr[j] * scale > top ? sr[j] * scale : top;
    const int first = *l == 0.0f;
    const float new_m = first || top > *m ? top : *m;
    const float keep = first ? 0.0f : expf(*m - new_m);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = a; j < e; j++) {
        sr[j] = expf(sr[j] * scale - new_m);
        sum += sr[j];
    }
    for (int64_t j = j0; j < a; j++) sr[j] = 0.0f;
    for (int64_t j = e; j < j1; j++) sr[j] = 0.0f;
    *l = *l * keep + sum;
    *m = new_m;
    return keep;
}

#ifdef PREFILL_AMX /* the amx_bf16 build: bfloat16 caches on AMX's tiles (prefill_attention_amx.h) */
#include "prefill_attention_amx.h"
#endif

/* Compiled twice, as decode_attention.c: float32 caches (prefill_attention_f32) and bfloat16 ones
   (prefill_attention_bf16). */
#define KERNEL_FILE "prefill_attention.c"
#include "cache_types.h"

#ifdef PREFILL_AMX
/* The amx_bf16 build's probe (kernels/cpu/prefill_attention.py runs it in a child process): 16
   queries of one head over their own 16 keys, D = 64, through the tiles. Key j is dim j's unit
   vector, query i -200 but at dim i (so it sees its own key 0 and every earlier one -200: weights
   1 and exactly 0), V's row j is j + 1 throughout: each output row i is i + 1, and the sum
   64 x 136 = 8704. -1 where the kernel refuses the tile state (a NaN is the kernel's fault). */
float probe(void) {
    enum { N = 16, PD = 64 };
    static float q[N * PD], out[N * PD];
    static uint16_t k[N * PD], v[N * PD];
    const int32_t table[1] = {0}, cu[2] = {0, N}, lens[1] = {N};
    if (!amx_ready()) return -1.0f;
    for (int i = 0; i < N; i++)
        for (int d = 0; d < PD; d++) {
            q[i * PD + d] = d == i ? 0.0f : -200.0f;
            k[i * PD + d] = d == i ? 0x3F80 : 0; /* 1.0 */
        }
    for (int i = 0; i < N; i++) {
        const float x = (float)(i + 1);
        uint32_t u;
        memcpy(&u, &x, 4);
        for (int d = 0; d < PD; d++) v[i * PD + d] = (uint16_t)(u >> 16); /* i + 1 <= 16: exact in bfloat16 */
    }
    prefill_attention_bf16(q, k, v, table, cu, lens, out, 1, 1, 1, PD, N, 1, 1.0f, 0);
    float s = 0.0f;
    for (int n = 0; n < N * PD; n++) s += out[n];
    return s;
}
#endif
#else /* the kernel, for one cache element type */

/* Keys [k0, k0 + n) of kv head g, out of their blocks: kt [D][KT] (transposed, zero past n) and
   vt [KT][D]. With AVX-512 or AVX2 a whole tile's K rows are widened like V's into `rows` and
   transposed TW x TW in registers (prefill_vec.h): the element-wise transposition was a quarter of a
   small chunk's attention with AVX-512, and with AVX2 the 8 x 8 one made a 4,096-token prompt's
   attention 1.08-1.11x faster (Qwen3-MoE's shapes; docs/performance.md). */
static void NAME(load_tile)(const CACHE_T *restrict k_cache, const CACHE_T *restrict v_cache,
                            const int32_t *restrict table, int64_t k0, int64_t n, int64_t g, int64_t G,
                            int64_t D, int64_t BS, float *restrict kt, float *restrict vt, float *restrict rows) {
    const int whole = TW > 1 && n == KT && D % TW == 0;
    if (n < KT)
        for (int64_t d = 0; d < D; d++) memset(kt + d * KT + n, 0, sizeof(float) * (KT - n));
    for (int64_t j = 0; j < n; j++) {
        const int64_t t = k0 + j, at = (((int64_t)table[t / BS] * BS + t % BS) * G + g) * D;
        const CACHE_T *kr = k_cache + at, *vr = v_cache + at;
        if (whole) {
#pragma omp simd
            for (int64_t d = 0; d < D; d++) rows[j * D + d] = TO_F32(kr[d]);
        } else {
            for (int64_t d = 0; d < D; d++) kt[d * KT + j] = TO_F32(kr[d]);
        }
#pragma omp simd
        for (int64_t d = 0; d < D; d++) vt[j * D + d] = TO_F32(vr[d]);
    }
    if (whole)
        for (int64_t j0 = 0; j0 < KT; j0 += TW)
            for (int64_t d0 = 0; d0 < D; d0 += TW) transpose_block(rows + j0 * D + d0, D, kt + d0 * KT + j0, KT);
}

/* Scores of NR rows (NR = RB or 1) against a key tile: s[b][j] = q_b . k_j, the NR x 4 sums in registers. */
static inline __attribute__((always_inline)) void NAME(scores)(const int NR, const float *restrict qs,
                                                             const float *restrict kt, const int64_t D,
                                                             float s[RB][KT]) {
    vf_t a[RB][4];
    for (int b = 0; b < NR; b++)
        for (int c = 0; c < 4; c++) a[b][c] = vset(0.0f);
    for (int64_t d = 0; d < D; d++) {
        const float *kd = kt + d * KT;
        vf_t k0 = vload(kd), k1 = vload(kd + VW), k2 = vload(kd + 2 * VW), k3 = vload(kd + 3 * VW);
        IN_REG(k0); IN_REG(k1); IN_REG(k2); IN_REG(k3);
        for (int b = 0; b < NR; b++) {
            const vf_t qb = vset(qs[b * D + d]);
            a[b][0] += qb * k0, a[b][1] += qb * k1, a[b][2] += qb * k2, a[b][3] += qb * k3;
        }
    }
    for (int b = 0; b < NR; b++)
        for (int c = 0; c < 4; c++) vstore(s[b] + c * VW, a[b][c]);
}

/* NR rows' weighted V over tile keys [ja, je): acc[b] = acc[b] * keep[b] + sum_j s[b][j] v_j, four vectors
   of head_dim at a time in registers (then one), D a multiple of VW. */
static inline __attribute__((always_inline)) void NAME(weighted_v)(const int NR, const float *restrict vt,
                                                                 const int64_t D, float s[RB][KT],
                                                                 const float *keep, int64_t ja, int64_t je,
                                                                 float *restrict acc) {
    int64_t c0 = 0;
    for (; c0 + 4 * VW <= D; c0 += 4 * VW) {
        vf_t o[RB][4];
        for (int b = 0; b < NR; b++)
            for (int c = 0; c < 4; c++) o[b][c] = vload(acc + b * D + c0 + c * VW) * keep[b];
        for (int64_t j = ja; j < je; j++) {
            const float *vj = vt + j * D + c0;
            vf_t v0 = vload(vj), v1 = vload(vj + VW), v2 = vload(vj + 2 * VW), v3 = vload(vj + 3 * VW);
            IN_REG(v0); IN_REG(v1); IN_REG(v2); IN_REG(v3);
            for (int b = 0; b < NR; b++) {
                const vf_t p = vset(s[b][j]);
                o[b][0] += p * v0, o[b][1] += p * v1, o[b][2] += p * v2, o[b][3] += p * v3;
            }
        }
        for (int b = 0; b < NR; b++)
            for (int c = 0; c < 4; c++) vstore(acc + b * D + c0 + c * VW, o[b][c]);
    }
    for (; c0 < D; c0 += VW) {
        vf_t o[RB];
        for (int b = 0; b < NR; b++) o[b] = vload(acc + b * D + c0) * keep[b];
        for (int64_t j = ja; j < je; j++) {
            const vf_t v = vload(vt + j * D + c0);
            for (int b = 0; b < NR; b++) o[b] += vset(s[b][j]) * v;
        }
        for (int b = 0; b < NR; b++) vstore(acc + b * D + c0, o[b]);
    }
}

/* One key tile into the rows' running statistics: row r sees tile keys [lo[r], hi[r]) (possibly
   none). m, l: its max and sum; acc [R][D] its weighted V. */
static inline __attribute__((always_inline)) void NAME(tile)(
        const float *restrict qs, const float *restrict kt, const float *restrict vt, int64_t R, const int64_t D,
        const int64_t *restrict lo, const int64_t *restrict hi, float *restrict m, float *restrict l,
        float *restrict acc, float scale) {
    float s[RB][KT];
    for (int64_t r0 = 0; r0 < R; r0 += RB) {
        const int64_t rb = R - r0 < RB ? R - r0 : RB;
#define SCORES(NR) NAME(scores)(NR, qs + r0 * D, kt, D, s)
        BY_ROWS(SCORES)
#undef SCORES
        int64_t ja = KT, je = 0; /* the block's keys: the union of its rows' ranges */
        float keep[RB];
        for (int64_t b = 0; b < rb; b++) {
            const int64_t r = r0 + b, a = lo[r], e = hi[r];
            float *sr = s[b];
            keep[b] = 1.0f;
            if (a >= e) { /* sees none of these keys: weights 0, its state as it was */
                memset(sr, 0, sizeof(float) * KT);
                continue;
            }
            ja = a < ja ? a : ja;
            je = e > je ? e : je;
            keep[b] = softmax_row(sr, 0, a, e, KT, scale, m + r, l + r);
        }
        if (ja >= je) continue;
        if (D % VW) { /* a head size the vectors do not divide: plain loops */
            for (int64_t b = 0; b < rb; b++) {
                float *ar = acc + (r0 + b) * D;
                for (int64_t d = 0; d < D; d++) ar[d] *= keep[b];
                for (int64_t j = ja; j < je; j++)
                    for (int64_t d = 0; d < D; d++) ar[d] += s[b][j] * vt[j * D + d];
            }
        } else {
#define WEIGHTED_V(NR) NAME(weighted_v)(NR, vt, D, s, keep, ja, je, acc + r0 * D)
            BY_ROWS(WEIGHTED_V)
#undef WEIGHTED_V
        }
    }
}

/* Queries [q0, q1) of one sequence (its chunk's rows from `row0`, its L cached tokens) under kv
   head g's query heads, over the keys they see in [k_from, k_to) (a part of them: key_parts). With
   `part` NULL (every key) the rows' results go to `out`; else each row's max, sum and unnormalized
   weighted V go to part[row * (D + 2)] (sum 0: the row saw none of these keys). */
static inline __attribute__((always_inline)) void NAME(task)(
        const float *restrict q, const CACHE_T *restrict k_cache, const CACHE_T *restrict v_cache,
        const int32_t *restrict table, int64_t row0, int64_t qlen, int64_t L, int64_t q0, int64_t q1,
        int64_t g, float *restrict out, int64_t H, int64_t G, const int64_t D, int64_t BS, float scale,
        int64_t window, int64_t k_from, int64_t k_to, float *restrict part, float *restrict buf) {
    const int64_t rep = H / G, R = (q1 - q0) * rep, base = L - qlen; /* query i at position base + i */
    float *qs = buf, *kt = qs + QT * rep * D, *vt = kt + D * KT, *acc = vt + KT * D;
    float *m = acc + QT * rep * D, *l = m + QT * rep;
    int64_t *lo = (int64_t *)(l + QT * rep), *hi = lo + QT * rep;
    float *rows = (float *)(hi + QT * rep); /* K's rows widened, before their transposition */
    for (int64_t i = q0; i < q1; i++) /* row (i - q0) * rep + r: query i under head g * rep + r */
        for (int64_t r = 0; r < rep; r++) {
            memcpy(qs + ((i - q0) * rep + r) * D, q + ((row0 + i) * H + g * rep + r) * D, sizeof(float) * D);
        }
    memset(acc, 0, sizeof(float) * R * D);
    memset(l, 0, sizeof(float) * R);
    const int64_t first_pos = base + q0, last_pos = base + q1 - 1;
    int64_t start = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    start = start > k_from ? start : k_from;
    const int64_t end = last_pos + 1 < k_to ? last_pos + 1 : k_to; /* keys [start, end) */
    for (int64_t k0 = start; k0 < end; k0 += KT) {
        const int64_t n = end - k0 < KT ? end - k0 : KT;
        int64_t any = 0;
        for (int64_t i = q0; i < q1; i++) { /* query i sees keys [from, p]; here [a, e) of the tile */
            const int64_t p = base + i, from = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
            int64_t a = from - k0, e = p + 1 - k0;
            a = a < 0 ? 0 : a;
            e = e > n ? n : e;
            any |= a < e;
            for (int64_t r = 0; r < rep; r++) lo[(i - q0) * rep + r] = a, hi[(i - q0) * rep + r] = e;
        }
        if (!any) continue;
        NAME(load_tile)(k_cache, v_cache, table, k0, n, g, G, D, BS, kt, vt, rows);
        NAME(tile)(qs, kt, vt, R, D, lo, hi, m, l, acc, scale);
    }
    if (part) {
        for (int64_t row = 0; row < R; row++) {
            float *p = part + row * (D + 2);
            p[0] = l[row] > 0.0f ? m[row] : 0.0f;
            p[1] = l[row];
            memcpy(p + 2, acc + row * D, sizeof(float) * D);
        }
        return;
    }
    for (int64_t i = q0; i < q1; i++)
        for (int64_t r = 0; r < rep; r++) {
            const int64_t row = (i - q0) * rep + r;
            float *o = out + ((row0 + i) * H + g * rep + r) * D;
            const float inv = l[row] > 0.0f ? 1.0f / l[row] : 0.0f;
#pragma omp simd
            for (int64_t d = 0; d < D; d++) o[d] = acc[row * D + d] * inv;
        }
}

void NAME(prefill_attention)(const float *restrict q, const CACHE_T *restrict k_cache,
                             const CACHE_T *restrict v_cache, const int32_t *restrict block_tables,
                             const int32_t *restrict cu_seqlens_q, const int32_t *restrict seq_lens,
                             float *restrict out, int64_t S, int64_t H, int64_t G, int64_t D, int64_t BS,
                             int64_t MB, float scale, int64_t window) {
#ifdef PREFILL_AMX
    if (CACHE_IS_BF16 && D % 32 == 0 && D <= 256 && amx_ready()) {
        prefill_attention_amx(q, (const uint16_t *)(const void *)k_cache, (const uint16_t *)(const void *)v_cache,
                              block_tables, cu_seqlens_q, seq_lens, out, S, H, G, D, BS, MB, scale, window);
        return;
    }
#endif
    const int64_t rep = H / G;
    split_plan_t plan = split_plan(cu_seqlens_q, seq_lens, S, G, rep, D, QT, window);
    const size_t floats = (size_t)(QT * rep * D * 2 + 3 * D * KT + QT * rep * 2) + 2 * (size_t)QT * rep * 2;
#pragma omp parallel
    {
        float *buf = malloc(sizeof(float) * floats);
#pragma omp for schedule(dynamic, 1)
        for (int64_t jj = 0; jj < plan.tasks; jj++) {
            const int64_t j = plan.tasks - 1 - jj; /* a chunk's last tiles see the most keys: they go first */
            int64_t k_from, k_to;
            float *part;
            const int64_t s = plan.owner[j], pair = split_task(&plan, j, seq_lens, &k_from, &k_to, &part);
            const int64_t tile = pair / G, g = pair % G, qlen = cu_seqlens_q[s + 1] - cu_seqlens_q[s], q0 = tile * QT;
            const int64_t q1 = q0 + QT < qlen ? q0 + QT : qlen;
            const int32_t *table = block_tables + s * MB;
            if (D == 64) /* the common head sizes, each with its inner loops' trip count known */
                NAME(task)(q, k_cache, v_cache, table, cu_seqlens_q[s], qlen, seq_lens[s], q0, q1, g, out, H, G,
                           64, BS, scale, window, k_from, k_to, part, buf);
            else if (D == 128)
                NAME(task)(q, k_cache, v_cache, table, cu_seqlens_q[s], qlen, seq_lens[s], q0, q1, g, out, H, G,
                           128, BS, scale, window, k_from, k_to, part, buf);
            else
                NAME(task)(q, k_cache, v_cache, table, cu_seqlens_q[s], qlen, seq_lens[s], q0, q1, g, out, H, G,
                           D, BS, scale, window, k_from, k_to, part, buf);
        }
        free(buf);
        if (plan.held) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < plan.tasks; j++) {
                const int64_t s = plan.owner[j], P = plan.parts[s], at = j - plan.first[s];
                if (P == 1 || at % P) continue; /* once per split (tile, kv head) pair */
                const int64_t qlen = cu_seqlens_q[s + 1] - cu_seqlens_q[s], q0 = at / P / G * QT;
                const int64_t q1 = q0 + QT < qlen ? q0 + QT : qlen;
                merge_parts(&plan, j, (q1 - q0) * rep, D, rep, H, G, cu_seqlens_q[s], q0, out);
            }
        }
    }
    split_plan_free(&plan);
}
#endif
