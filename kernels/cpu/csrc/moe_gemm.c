/* The experts' GEMMs of a mixture-of-experts layer on the CPU, every active expert in one call
   (llama.cpp's mul_mat_id does the same): out[r] = x[r] @ W[e]^T for the rows r of expert e, the
   rows sorted by expert (rows offsets[e] .. offsets[e + 1] - 1).

   Why not one oneDNN GEMM per expert: at a decode batch each expert gets a few rows (64 tokens,
   top-2 of 8: ~16), and a library GEMM at 16 rows reaches a fraction of its 64-row speed while all
   the experts' weights (352 MB a layer at Mixtral's shape ratio, hidden 1024) stream from memory
   once per step. This kernel is built for that: every weight is loaded once and feeds all of the
   expert's rows (up to ROWS1 at a time), and the weights it reads next are prefetched far ahead,
   so that reading memory and the FMAs overlap (docs/performance.md, "Mixture of experts").

   Weights are laid out once, at load (kernels/cpu_moe.py `pack_panels`), in panels of PANEL = 16
   output columns, K-major: panel p of expert e holds W[e][16p .. 16p + 15][k] for every k, 16
   consecutive values per k (zero columns past N). float32: [E, P, K, 16], one 64-byte line per k.
   bfloat16: [E, P, ceil(K / 2), 16, 2], the values of k and k + 1 side by side (a zero k past an
   odd K), one line per pair of k: the layout AVX512_BF16's dot product reads, and any other build
   widens the pair to two float vectors with a shift and a mask.

   The rows are copied first, transposed (`pack_rows`): [K][m] per block of rows, so the values of
   all the block's rows at one k are one contiguous run (one broadcast each, no strided loads).
   The rows stay float32 for bf16 weights too (each weight widened exactly to float32): every
   build computes the same float32 products.

   Sum order (what the float32 result depends on): each output is one float32 accumulator, over k
   ascending (bf16: per pair of k, the even k then the odd), a multiply-add per k, whatever the number of rows or the blocking of k (a block
   stores its accumulators and the next reloads them: no rounding added). kernels/moe_reference.py
   `expert_gemm` is the oracle (float64 sums), within float32 rounding.

   One source for every CPU: the vector type is the target's own width (AVX-512: 16 floats; AVX2:
   8; SSE2: 4), a panel's 16 columns one to four of them; the rows per block are chosen so that
   the accumulators fit that target's register file. Threads: (expert, group of
   panels) items handed out dynamically over the OpenMP team. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefetch.h"

#define PANEL 16
#if defined(__AVX512F__)
#define VEC 16
#define REGS 32
#elif defined(__AVX__)
#define VEC 8
#define REGS 16
#else
#define VEC 4
#define REGS 16
#endif
#define NV (PANEL / VEC) /* registers one panel row of accumulators takes */
/* Rows per block against np panels: the accumulators (rows x np x NV registers), the np weight
   vectors and a broadcast fit the register file (AVX-512: 28 and 14 rows for 1 and 2 panels;
   AVX2: 6 and 2; SSE2: 2 and 1). */
#define ROWS_MAX 28
#define ROWS_FIT_(np) ((REGS - (np) * NV - 1) / ((np) * NV))
#define ROWS_FIT(np) (ROWS_FIT_(np) > ROWS_MAX ? ROWS_MAX : ROWS_FIT_(np))
/* A run of one panel: 64 lines, 4 KB of weights (64 k of float32, 128 of bf16); the block's packed
   rows for it stay in L1 while every panel of the item goes by (docs/performance.md has the
   measurements behind these three numbers). */
#ifndef RUN_LINES
#define RUN_LINES 64
#endif
#ifndef PANELS_PER_ITEM
#define PANELS_PER_ITEM 8 /* 128 columns: one unit of work for a thread */
#endif

/* The target's own vector width (a wider generic vector, split by the compiler, went through the
   stack on AVX2: 10x slower); the _u types load and store at any alignment. */
typedef float vf __attribute__((vector_size(VEC * 4)));
typedef float vf_u __attribute__((vector_size(VEC * 4), aligned(4)));
typedef uint32_t vu __attribute__((vector_size(VEC * 4)));
typedef uint32_t vu_u __attribute__((vector_size(VEC * 4), aligned(4)));

enum { F32 = 0, BF16 = 1 };

/* Rows per block for an expert of M rows: as few blocks as fit, as even as possible. */
static inline int64_t blocks_of(int64_t M, int64_t rows_max) { return (M + rows_max - 1) / rows_max; }
static inline int64_t block_rows(int64_t M, int64_t nblocks, int64_t b) {
    return M / nblocks + (b < M % nblocks);
}

/* x rows [M, K] (row stride ldx) -> per block of rows, [Kp][rows]; Kp = K rounded up to even for
   bf16 weights, the pad 0. */
static void pack_rows(const float *x, int64_t ldx, int64_t M, int64_t K, int64_t Kp,
                      int64_t rows_max, float *dst) {
    const int64_t nb = blocks_of(M, rows_max);
    int64_t m0 = 0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t mr = block_rows(M, nb, b);
        float *d = dst + m0 * Kp;
        for (int64_t m = 0; m < mr; m++) {
            const float *xr = x + (m0 + m) * ldx;
            for (int64_t k = 0; k < K; k++) d[k * mr + m] = xr[k];
            for (int64_t k = K; k < Kp; k++) d[k * mr + m] = 0.0f; /* bf16's pad k */
        }
        m0 += mr;
    }
}

/* Per k: the line of each panel's stream at pf (+ a panel apart), k - k0 lines on; none without pf. */
#define PREFETCH(k)                                                                                 \
    if (pf)                                                                                         \
        for (int j = 0; j < NP; j++) PREFETCH_READ(pf + j * panel_bytes + ((k) - k0) / ((DT == F32) ? 1 : 2) * 64)

/* One block of R rows against NP consecutive panels (R and NP constants where it is called), k in
   [k0, k1): acc[m][j] += sum_k xp[k][m] * W_j[k]. The accumulators start at zero (k0 == 0) or
   from out, and are stored into out at the end (n_valid columns of the group's NP * 16). pf: the
   weights needed next, prefetched line for line as k advances (NULL: none). */
static inline __attribute__((always_inline)) void block(
        const int DT, const int NP, const int R, const float *xp, const char *w, int64_t panel_bytes,
        int64_t k0, int64_t k1, float *out, int64_t ldo, int64_t n_valid, const char *pf) {
    const int S = NP * NV; /* accumulator registers per row: panel j's columns VEC at a time */
    vf acc[ROWS_MAX][2 * NV]; /* constant sizes: a variable-length array would never live in registers */
    const vf zero = {0};
#pragma GCC unroll 32
    for (int m = 0; m < R; m++)
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) {
            const float *src = out + m * ldo + s * VEC;
            if (k0 == 0) acc[m][s] = zero;
            else if (s * VEC + VEC <= n_valid) acc[m][s] = *(const vf_u *)src;
            else {
                float t[VEC] = {0};
                if (s * VEC < n_valid) memcpy(t, src, sizeof(float) * (size_t)(n_valid - s * VEC));
                acc[m][s] = *(const vf_u *)t; /* (never &acc: it would keep the accumulators in memory) */
            }
        }
    if (DT == F32) {
        for (int64_t k = k0; k < k1; k++) {
            PREFETCH(k);
            vf wv[2 * NV];
#pragma GCC unroll 8
            for (int s = 0; s < S; s++)
                wv[s] = *(const vf_u *)(w + (s / NV) * panel_bytes + (k * PANEL + (s % NV) * VEC) * 4);
            const float *xk = xp + k * R;
#pragma GCC unroll 32
            for (int m = 0; m < R; m++)
#pragma GCC unroll 8
                for (int s = 0; s < S; s++) acc[m][s] += xk[m] * wv[s];
        }
    } else {
        for (int64_t k = k0; k < k1; k += 2) {
            PREFETCH(k);
            vf even[2 * NV], odd[2 * NV];
#pragma GCC unroll 8
            for (int s = 0; s < S; s++) {
                const vu pair = *(const vu_u *)(w + (s / NV) * panel_bytes + (k * PANEL + (s % NV) * VEC * 2) * 2);
                even[s] = (vf)(pair << 16);
                odd[s] = (vf)(pair & 0xFFFF0000u);
            }
            const float *xe = xp + k * R, *xo = xe + R;
#pragma GCC unroll 32
            for (int m = 0; m < R; m++)
#pragma GCC unroll 8
                for (int s = 0; s < S; s++) {
                    acc[m][s] += xe[m] * even[s];
                    acc[m][s] += xo[m] * odd[s];
                }
        }
    }
#pragma GCC unroll 32
    for (int m = 0; m < R; m++)
#pragma GCC unroll 8
        for (int s = 0; s < S; s++) {
            float *dst = out + m * ldo + s * VEC;
            if (s * VEC + VEC <= n_valid) *(vf_u *)dst = acc[m][s];
            else if (s * VEC < n_valid) {
                float t[VEC];
                *(vf_u *)t = acc[m][s];
                memcpy(dst, t, sizeof(float) * (size_t)(n_valid - s * VEC));
            }
        }
}

/* Each (dtype, panels, rows) block compiled as a function of its own (inlined into one big switch,
   the compiler spilled the accumulators), found through a table. Rows past what fits the register
   file get a stub that is never called. */
typedef void (*block_fn)(const float *, const char *, int64_t, int64_t, int64_t, float *, int64_t, int64_t,
                         const char *);
#define DEFINE(DT, NP_, R_)                                                                          \
    static void block_##DT##_##NP_##_##R_(const float *xp, const char *w, int64_t pb, int64_t k0,      \
                                          int64_t k1, float *out, int64_t ldo, int64_t n_valid,        \
                                          const char *pf) {                                            \
        block(DT, NP_, (R_) <= ROWS_FIT(NP_) ? (R_) : 1, xp, w, pb, k0, k1, out, ldo, n_valid, pf);     \
    }
#define ROWS_UP_TO_6(X, DT, NP_) X(DT, NP_, 1) X(DT, NP_, 2) X(DT, NP_, 3) X(DT, NP_, 4) X(DT, NP_, 5) X(DT, NP_, 6)
#define ROWS_UP_TO_14(X, DT, NP_) ROWS_UP_TO_6(X, DT, NP_) X(DT, NP_, 7) X(DT, NP_, 8) X(DT, NP_, 9) \
    X(DT, NP_, 10) X(DT, NP_, 11) X(DT, NP_, 12) X(DT, NP_, 13) X(DT, NP_, 14)
#define ROWS_UP_TO_28(X, DT, NP_) ROWS_UP_TO_14(X, DT, NP_) X(DT, NP_, 15) X(DT, NP_, 16) X(DT, NP_, 17) \
    X(DT, NP_, 18) X(DT, NP_, 19) X(DT, NP_, 20) X(DT, NP_, 21) X(DT, NP_, 22) X(DT, NP_, 23)        \
    X(DT, NP_, 24) X(DT, NP_, 25) X(DT, NP_, 26) X(DT, NP_, 27) X(DT, NP_, 28)
#define ALL(X, DT) ROWS_UP_TO_28(X, DT, 1) ROWS_UP_TO_14(X, DT, 2)
ALL(DEFINE, F32)
ALL(DEFINE, BF16)
#define ENTRY(DT, NP_, R_) [DT][NP_ - 1][R_] = block_##DT##_##NP_##_##R_,
static const block_fn BLOCKS[2][2][ROWS_MAX + 1] = {ALL(ENTRY, F32) ALL(ENTRY, BF16)};

static inline void run_block(int dtype, int np, int64_t R, const float *xp, const char *w, int64_t panel_bytes,
                             int64_t k0, int64_t k1, float *out, int64_t ldo, int64_t n_valid, const char *pf) {
    BLOCKS[dtype][np - 1][R](xp, w, panel_bytes, k0, k1, out, ldo, n_valid, pf);
}

/* Panels per block for an expert of M rows: one while one panel's block holds them all (every
   weight loaded once, for all the rows), else two (AVX-512: 14 rows, fewer loads per FMA than 28
   rows of one panel); AVX2 holds 2 rows against two panels, too few: one. */
static inline int panels_per_block(int64_t M) { return M > ROWS_FIT(1) && ROWS_FIT(2) >= 4 ? 2 : 1; }

/* Every panel of [p0, p1) of one expert against its M packed rows (xp), columns into out: for each
   run of K_BLOCK k, every group of panels and every block of rows, the accumulators carried in out
   from one run to the next.

   Prefetch: each group's first block of rows prefetches the run that comes after its own (the
   next group's, then the first group's next run, then the next item's or expert's first; panels
   and experts lie one after the other), one line per line it reads. So the weights stream from
   memory while the FMAs run, from several panels at once: measured, this and the short runs read
   memory faster than one panel front to back with a prefetch far ahead (docs/performance.md). */
static void expert_panels(int dtype, const char *w, int64_t N, int64_t Kp, int64_t M, const float *xp,
                          int64_t p0, int64_t p1, float *out, int64_t ldo) {
    const int64_t panel_bytes = Kp * PANEL * (dtype == F32 ? 4 : 2), k_per_line = dtype == F32 ? 1 : 2;
    const int np_max = panels_per_block(M);
    const int64_t nb = blocks_of(M, ROWS_FIT(np_max));
    const int64_t run = RUN_LINES * k_per_line;
    for (int64_t k0 = 0; k0 < Kp; k0 += run) {
        const int64_t k1 = k0 + run < Kp ? k0 + run : Kp;
        for (int64_t p = p0; p < p1;) {
            const int np = p + np_max <= p1 ? np_max : 1; /* a last odd panel alone */
            const int64_t n0 = p * PANEL, n_valid = N - n0 < np * PANEL ? N - n0 : np * PANEL;
            const char *group = w + p * panel_bytes;
            const char *pf = p + np < p1 ? group + np * panel_bytes + k0 / k_per_line * 64
                           : k1 < Kp     ? w + p0 * panel_bytes + k1 / k_per_line * 64
                                         : w + p1 * panel_bytes;
            int64_t m0 = 0;
            for (int64_t b = 0; b < nb; b++) {
                const int64_t mr = block_rows(M, nb, b);
                run_block(dtype, np, mr, xp + m0 * Kp, group, panel_bytes, k0, k1,
                          out + m0 * ldo + n0, ldo, n_valid, b == 0 ? pf : NULL);
                m0 += mr;
            }
            p += np;
        }
    }
}

/* out[R, N] (row stride ldo) = x[R, K] (row stride ldx) against each row's expert: rows
   offsets[e] .. offsets[e+1] - 1 use W[e]. w: panels (see the top). scratch: R * Kp floats. */
void moe_gemm(int dtype, const float *x, int64_t ldx, const void *w, const int64_t *offsets, int64_t E,
              int64_t N, int64_t K, float *out, int64_t ldo, float *scratch) {
    const int64_t P = (N + PANEL - 1) / PANEL, Kp = dtype == F32 ? K : (K + 1) / 2 * 2;
    const int64_t expert_bytes = P * Kp * PANEL * (dtype == F32 ? 4 : 2);
    const int64_t chunks = (P + PANELS_PER_ITEM - 1) / PANELS_PER_ITEM, rows = offsets[E] - offsets[0];
    int64_t items = 0;
    for (int64_t e = 0; e < E; e++) items += offsets[e + 1] > offsets[e] ? chunks : 0;
    int64_t *item_expert = malloc(sizeof(int64_t) * (size_t)(items ? items : 1));
    items = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t c = 0; offsets[e + 1] > offsets[e] && c < chunks; c++) item_expert[items++] = e * chunks + c;
#pragma omp parallel if (rows * N * K >= (1 << 22))
    {
#pragma omp for schedule(static)
        for (int64_t e = 0; e < E; e++) {
            const int64_t M = offsets[e + 1] - offsets[e], r0 = offsets[e] - offsets[0];
            if (M <= 0) continue;
            pack_rows(x + r0 * ldx, ldx, M, K, Kp, ROWS_FIT(panels_per_block(M)), scratch + r0 * Kp);
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            const int64_t e = item_expert[i] / chunks, c = item_expert[i] % chunks;
            const int64_t M = offsets[e + 1] - offsets[e], r0 = offsets[e] - offsets[0];
            const int64_t p0 = c * PANELS_PER_ITEM, p1 = p0 + PANELS_PER_ITEM < P ? p0 + PANELS_PER_ITEM : P;
            expert_panels(dtype, (const char *)w + e * expert_bytes, N, Kp, M, scratch + r0 * Kp, p0, p1,
                          out + r0 * ldo, ldo);
        }
    }
    free(item_expert);
}

/* The build's choices, for the tests and the benchmark: [panel, rows a block against one panel,
   against two]. */
void moe_gemm_config(int64_t *cfg) {
    cfg[0] = PANEL;
    cfg[1] = ROWS_FIT(1);
    cfg[2] = ROWS_FIT(2);
}
