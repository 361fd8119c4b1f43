/* A mixture-of-experts block's work after its router, in one call, for the CPU engine: the route
   (softmax over the experts, the top K, renormalized or not), the (token, slot) pairs sorted by
   expert, every active expert's gate/up in one GEMM call, the activation·mul, every down
   projection in one call, and the weighted outputs added into their tokens.

   Why: in Python this was ~20 small torch ops a layer (softmax, topk, sort, bincount, cumsum,
   index_select, mul, index_add, the expert tally's scatter_add), ~2 ms of a Qwen3-MoE-shaped
   batch-1 step of ~8 ms (docs/performance.md, issue 47), and it kept the C layer stack calling
   back into Python for every MoE layer. Both the C layer stack (decode_stack.c) and the Python
   block (backend/models/moe.py, with the CPU's kernels) call this, so their results are the same
   bits; kernels/cpu/moe.py `sorted_moe` on kernels/moe_reference.py `route` is the oracle, within
   float32 rounding.

   The experts' GEMMs are called through pointers (the wrapper, kernels/cpu/moe_block.py, takes
   them from the libraries already loaded): quant_gemm.c's `qgemm_experts` on packed experts, or
   moe_gemm.c's `moe_gemm` on float panels. The activation·mul is elementwise.c's.

   Order of the float sums (what the bits depend on; no row's result depends on the others or on
   the thread count): a row's softmax sums its experts in one fixed order (the build's); ties in the top K go to the
   lower expert; the renormalization sums the K weights best first; a token's output is
   0 + w·y over its pairs in the sorted order (by expert, as torch's index_add_ adds them).
   The wrapper checks every shape and pointer; this code checks nothing. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*act_mul_fn)(const float *x, float *out, int64_t T, int64_t I);
/* quant_gemm.c's: out [R, ldo] = x [R, K] against expert e's matrix for rows offsets[e] .. */
typedef void (*qexperts_fn)(const void *ws, int64_t E, const float *x, const int64_t *offsets, float *out,
                            int64_t ldo);
/* moe_gemm.c's, on panels of dtype 0 (float32) or 1 (bfloat16) */
typedef void (*panels_fn)(int dtype, const float *x, int64_t ldx, const void *w, const int64_t *offsets, int64_t E,
                          int64_t N, int64_t K, float *out, int64_t ldo, float *scratch);

/* One projection of every expert: packed (`panels_dtype` -1: `gemm` is qgemm_experts, `w` the
   experts' qweight_t array) or float panels (moe_gemm, `w` the panels of that dtype). */
typedef struct {
    void *gemm;
    const void *w;
    int64_t panels_dtype;
} experts_t;

typedef struct {
    experts_t gate_up, down; /* [E, 2I, hidden] and [E, hidden, I] */
    act_mul_fn act_mul;
    int64_t experts, top_k, renormalize, hidden, intermediate;
    int64_t *counts; /* the engine's tally of this layer's tokens per expert [E]; NULL: none */
} moe_t;

#define MAX_TOP_K 64 /* the wrapper refuses more experts a token */
#define ALIGN(n) (((n) + 63) / 64 * 64)

/* moe_block's scratch for T rows, each region 64-byte aligned: laid out from `base` (NULL: only
   sized) by scratch_layout, the one description of it; moe_scratch_bytes is its size. */
typedef struct {
    float *weights;       /* [P] the pairs' routing weights */
    int32_t *ids;         /* [P] the pairs' experts */
    int64_t *order;       /* [P] sorted place -> pair */
    int64_t *place;       /* [P] pair -> sorted place */
    int64_t *offsets;     /* [E + 1] each expert's first place, then [E] each one's next while sorting */
    float *rows;          /* [P, H] the pairs' tokens, sorted; later their outputs */
    float *gate_up;       /* [P, 2I] */
    float *act;           /* [P, I] */
    float *gemm_scratch;  /* [P, max(H, I) + 2] moe_gemm's (bfloat16 panels' rows) */
} scratch_t;

static int64_t scratch_layout(const moe_t *m, int64_t T, char *base, scratch_t *s) {
    const int64_t P = T * m->top_k, H = m->hidden, I = m->intermediate, wide = H > I ? H : I;
    const int64_t sizes[9] = {4 * P, 4 * P, 8 * P, 8 * P, 16 * (m->experts + 1), 4 * P * H, 4 * P * 2 * I,
                              4 * P * I, 4 * P * (wide + 2)};
    int64_t at[10] = {0};
    for (int i = 0; i < 9; i++) at[i + 1] = at[i] + ALIGN(sizes[i]);
    if (base) {
        s->weights = (float *)(base + at[0]);
        s->ids = (int32_t *)(base + at[1]);
        s->order = (int64_t *)(base + at[2]);
        s->place = (int64_t *)(base + at[3]);
        s->offsets = (int64_t *)(base + at[4]);
        s->rows = (float *)(base + at[5]);
        s->gate_up = (float *)(base + at[6]);
        s->act = (float *)(base + at[7]);
        s->gemm_scratch = (float *)(base + at[8]);
    }
    return at[9];
}

int64_t moe_scratch_bytes(const moe_t *m, int64_t T) { return scratch_layout(m, T, NULL, NULL); }

/* logits [T, E] -> weights [T, K] float32 and ids [T, K] int32, best first (torch.topk's order). */
void moe_route(const float *logits, int64_t T, int64_t E, int64_t K, int64_t renormalize, float *weights,
               int32_t *ids) {
    float *p = malloc(sizeof(float) * (size_t)E);
    for (int64_t t = 0; t < T; t++) {
        const float *row = logits + t * E;
        float top = row[0], sum = 0.0f;
        for (int64_t e = 1; e < E; e++) top = row[e] > top ? row[e] : top;
        for (int64_t e = 0; e < E; e++) {
            p[e] = expf(row[e] - top);
            sum += p[e];
        }
        float picked = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++) {
                if (p[e] < 0.0f) continue; /* taken */
                if (best < 0 || p[e] > p[best]) best = e;
            }
            weights[t * K + k] = p[best] / sum;
            ids[t * K + k] = (int32_t)best;
            picked += weights[t * K + k];
            p[best] = -1.0f;
        }
        if (renormalize)
            for (int64_t k = 0; k < K; k++) weights[t * K + k] /= picked;
    }
    free(p);
}

static void experts_gemm(const experts_t *x_of, const moe_t *m, const float *x, int64_t K, int64_t N,
                         const int64_t *offsets, float *out, float *scratch) {
    if (x_of->panels_dtype < 0)
        ((qexperts_fn)x_of->gemm)(x_of->w, m->experts, x, offsets, out, N);
    else
        ((panels_fn)x_of->gemm)((int)x_of->panels_dtype, x, K, x_of->w, offsets, m->experts, N, K, out, N, scratch);
}

/* out [T, hidden] = the experts' weighted outputs for h [T, hidden], from the router's logits
   [T, E]. valid [T]: the tally's weight of each row (1 real, 0 padding), NULL: no tally this step. */
void moe_block(const moe_t *m, const float *h, const float *logits, int64_t T, float *out, const int64_t *valid,
               void *scratch) {
    const int64_t K = m->top_k, E = m->experts, H = m->hidden, I = m->intermediate, P = T * K;
    scratch_t sc;
    scratch_layout(m, T, scratch, &sc);
    float *weights = sc.weights, *rows = sc.rows, *gate_up = sc.gate_up, *act = sc.act, *gemm_scratch = sc.gemm_scratch;
    int32_t *ids = sc.ids;
    int64_t *order = sc.order, *place = sc.place, *offsets = sc.offsets, *fill = offsets + E + 1;

    moe_route(logits, T, E, K, m->renormalize, weights, ids);
    memset(offsets, 0, sizeof(int64_t) * (size_t)(E + 1));
    for (int64_t p = 0; p < P; p++) offsets[ids[p] + 1]++;
    if (m->counts && valid)
        for (int64_t p = 0; p < P; p++) m->counts[ids[p]] += valid[p / K];
    for (int64_t e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    for (int64_t e = 0; e < E; e++) fill[e] = offsets[e];
    for (int64_t p = 0; p < P; p++) { /* a counting sort, stable: token order within an expert */
        place[p] = fill[ids[p]]++;
        order[place[p]] = p;
    }
#pragma omp parallel for schedule(static) if (P * H >= (1 << 16))
    for (int64_t r = 0; r < P; r++) memcpy(rows + r * H, h + (order[r] / K) * H, sizeof(float) * (size_t)H);
    experts_gemm(&m->gate_up, m, rows, H, 2 * I, offsets, gate_up, gemm_scratch);
    m->act_mul(gate_up, act, P, I);
    experts_gemm(&m->down, m, act, I, H, offsets, rows, gemm_scratch);
#pragma omp parallel for schedule(static) if (P * H >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        int64_t mine[MAX_TOP_K]; /* this token's places, ascending: the order index_add_ adds them in */
        for (int64_t k = 0; k < K; k++) {
            int64_t j = k, v = place[t * K + k];
            for (; j > 0 && mine[j - 1] > v; j--) mine[j] = mine[j - 1];
            mine[j] = v;
        }
        float *o = out + t * H;
        for (int64_t c = 0; c < H; c++) o[c] = 0.0f;
        for (int64_t k = 0; k < K; k++) {
            const float w = weights[order[mine[k]]], *y = rows + mine[k] * H;
            for (int64_t c = 0; c < H; c++) o[c] += w * y[c];
        }
    }
}
