/* A step's whole layer stack in one call, for the CPU engine (backend/worker/native_decode.py):
   decode rows, and since issue 47 prompt chunks beside them (prefill and mixed steps).

   Why: at a small decode batch the kernels of a layer take tens of microseconds each, and the
   Python around them (a module call, a wrapper's checks and a ctypes call per kernel, about twelve
   per layer) cost as much again: on SmolLM2-135M (30 layers, packed Q4_1) a batch-1 step was half
   matmuls, half the rest (docs/performance.md, issue 37). This loop runs the same kernels, in the
   same order, on the same buffers' values, so its result is bit for bit the Python path's
   (backend/models/llama.py): it adds no arithmetic of its own but the bias of a projection whose
   parts have different types (added after, as ConcatLinear does).

   It calls the kernels through function pointers the wrapper (kernels/cpu_decode_stack.py) takes
   from the libraries already loaded: each projection's GEMM (quant_gemm.c's for packed matrices,
   float_gemm.c's for float32 / bfloat16 / float16 ones since issue 47, per part, each of the build
   chosen for this CPU; oneDNN's, called back, where it is faster for the step's rows), RMSNorm,
   RoPE, the cache store and SiLU·mul (elementwise.c), the paged decode attention
   (decode_attention.c) and, for prompt rows, the paged prefill attention (prefill_attention.c). So this file needs no instruction set of its own and each kernel
   keeps its own OpenMP parallelism.

   T rows: ND decode rows (one query token per sequence), then prompt chunks. Per layer, as
   llama.py's DecoderLayer (attention: decode rows by decode_attention, chunks by prefill_attention):
     h, residual = rmsnorm(x (+ residual)) ; qkv = h @ Wqkv (+ b) ; [q/k head norms] ; rope(q, k)
     store k, v at the slots ; attn = decode_attention(q) ; o = attn @ Wo (+ b)
     Llama:  h, residual = rmsnorm(o + residual) ; x = down(act(gate) * up), gate | up = h @ Wgate_up (+ b)
     Gemma's sandwich norms: h = rmsnorm(o) ; h, residual = rmsnorm(h + residual) ;
             x = rmsnorm(down(act(gate) * up))
   act: SiLU, or GELU's tanh form (Gemma's GeGLU), whichever act_mul the wrapper passes. A layer
   whose MLP is a mixture of experts runs its router (a projection, ROUTER) and then moe_block.c's
   call (the route, the experts, the weighted sum: ops->moe), as the Python block does with the
   CPU's kernels; one whose experts that call does not take calls back into the caller (ops->mlp).
   After the last layer: out = rmsnorm(x + residual) with the model's final norm.
   On a tensor-parallel rank (issue 47) the projections are the rank's shard and the attention output
   projection's and the MLP's outputs (after their LoRA deltas, before any norm) are its partial
   sums: each is all-reduced where the Python layers' RowParallel does it, through shared memory in
   C (ops->shm_reduce, shm_reduce.c) or else the group's own all_reduce, called back (ops->reduce:
   gloo, a tensor larger than a slot, and every error).
   The wrapper checks every shape, dtype and index bound; this code checks nothing. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* quant_gemm.c's qgemm and float_gemm.c's fgemm: out[M, N] (row stride ldo) = x @ W^T (+ bias) */
typedef void (*gemm_fn)(const void *w, const float *x, int64_t M, const float *bias, float *out, int64_t ldo);
typedef void (*rms_norm_fn)(const float *x, const float *residual, const float *weight, float *out, float *h,
                            int64_t T, int64_t N, float eps);
typedef void (*rotary_fn)(const float *q, int64_t q_row_stride, const float *k, int64_t k_row_stride,
                          float *q_out, float *k_out, const int64_t *positions, const float *cos_cache,
                          const float *sin_cache, int64_t T, int64_t H, int64_t G, int64_t D);
typedef void (*store_kv_fn)(const float *key, int64_t key_row_stride, const float *value,
                            int64_t value_row_stride, void *k_cache, void *v_cache, const int64_t *slots,
                            int64_t T, int64_t row);
typedef void (*attention_fn)(const float *q, const void *k_cache, const void *v_cache, const int32_t *tables,
                             const int32_t *seq_lens, float *out, int64_t S, int64_t H, int64_t G, int64_t D,
                             int64_t BS, int64_t MB, float scale, int64_t window);
typedef void (*prefill_fn)(const float *q, const void *k_cache, const void *v_cache, const int32_t *tables,
                           const int32_t *cu_seqlens_q, const int32_t *seq_lens, float *out, int64_t S, int64_t H,
                           int64_t G, int64_t D, int64_t BS, int64_t MB, float scale, int64_t window);
typedef void (*act_mul_fn)(const float *x, float *out, int64_t T, int64_t I);
/* A layer's MLP run by the caller (a mixture of experts whose experts moe_block.c does not take):
   out [T, hidden] from h; nonzero if it failed (the stack then stops). */
typedef int (*mlp_fn)(int64_t layer, const float *h, int64_t T, float *out);
/* The step's LoRA deltas of projection `which` (QKV, O, GATE_UP, DOWN) added to its output out
   [T, N] from its input x [T, K], by the caller (backend/lora: the adapters' segments of rows);
   nonzero if it failed. NULL in a step with no adapter's row. */
typedef int (*delta_fn)(int64_t layer, int64_t which, const float *x, int64_t T, float *out);
/* A projection the caller computes (the Python module's own GEMM, oneDNN's, where that is faster
   for the step's rows: backend/models/float_linear.py): out [T, N] from x [T, K]; nonzero if it
   failed. */
typedef int (*project_fn)(int64_t layer, int64_t which, const float *x, int64_t T, float *out);
/* The group's all_reduce of x [n] in place, by the caller (backend/worker/parallel/group.py); nonzero
   if it failed. */
typedef int (*reduce_fn)(float *x, int64_t n);
/* shm_reduce.c's: 0 summed, else not (1: the caller's path; 2: the group stopped while waiting). */
typedef int (*shm_reduce_fn)(void *group, float *x, int64_t n);
/* moe_block.c's: a mixture of experts after its router, out [T, hidden] from h and the router's
   logits; valid: the rows its tally counts (NULL: none); scratch of moe_scratch_bytes(moe, T). */
typedef void (*moe_fn)(const void *moe, const float *h, const float *logits, int64_t T, float *out,
                       const int64_t *valid, void *scratch);
typedef int64_t (*moe_scratch_fn)(const void *moe, int64_t T);
enum { QKV, O, GATE_UP, DOWN, ROUTER };

typedef struct {
    rms_norm_fn rms_norm;
    rotary_fn rotary;
    store_kv_fn store_kv;
    attention_fn attention;
    act_mul_fn act_mul;
    mlp_fn mlp;
    delta_fn delta;
    prefill_fn prefill; /* prefill_attention.c's, for a step's prompt rows */
    project_fn project; /* for projections with caller_from */
    reduce_fn reduce;   /* tensor parallelism: the partial sums' all-reduce; NULL on one rank */
    shm_reduce_fn shm_reduce; /* and the same in C where the ranks share memory; NULL otherwise */
    void *shm;
    moe_fn moe;                  /* for layers with a moe_t; NULL if none has */
    moe_scratch_fn moe_scratch;
} stack_ops_t;

#define MAX_PARTS 4
/* One projection: a matrix (parts == 1, its bias added by the GEMM, as QuantLinear and FloatLinear
   do) or several side by side (ConcatLinear: each part's columns at its offset, the bias added
   after). Each part has its own GEMM: packed (quant_gemm.c's qgemm on a qweight_t) or float
   (float_gemm.c's fgemm on an fweight_t), so one model mixes them per tensor. */
typedef struct {
    gemm_fn gemm[MAX_PARTS];
    const void *w[MAX_PARTS]; /* the GEMM's weight struct, opaque here */
    int64_t col[MAX_PARTS];
    int64_t parts, N;
    const float *bias;   /* NULL: none */
    int64_t caller_from; /* steps of this many rows or more: ops->project computes it; 0: never */
} proj_t;

typedef struct {
    proj_t qkv, o, gate_up, down; /* gate_up.parts == 0: the MLP is ops->mlp's */
    const float *input_norm, *post_attn_norm;
    const float *pre_ff_norm, *post_ff_norm; /* Gemma's sandwich norms; NULL otherwise */
    const float *q_norm, *k_norm;            /* Qwen3's and Gemma's per-head norms; NULL otherwise */
    void *k_cache, *v_cache;                 /* [NB, BS, G, D] */
    const float *cos, *sin;                  /* this layer's RoPE table [max_pos, D/2] */
    int64_t group, window;                   /* its KV-cache group; its sliding window (0: none) */
    proj_t router;                           /* a mixture of experts in C: its router [E, hidden] */
    const void *moe;                         /* and its moe_t (moe_block.c); NULL: not one */
} stack_layer_t;

typedef struct {
    int64_t hidden, heads, kv_heads, head_dim, intermediate, block_size, table_width;
    float eps, scale;
    const int64_t *moe_valid; /* this step's rows the experts' tally counts; NULL: none */
} stack_dims_t;

/* A step's rows after its decode rows: S sequences' prompt chunks back to back (issue 47), as
   attention.py's AttentionContext holds them. NULL, or seqs 0: a step of decode rows only. */
typedef struct {
    int64_t seqs, table_width;
    const int32_t *cu_seqlens_q; /* [seqs + 1], from 0 to the prompt rows */
    const int32_t *tables;       /* [groups, seqs, table_width] */
    const int32_t *seq_lens;     /* [seqs], each chunk's own tokens included */
} prompt_rows_t;

/* out = x @ W^T (+ bias), then the step's LoRA deltas, as backend/lora/step.py's lora_project:
   0, or nonzero if the caller's deltas failed. */
static int project(const stack_ops_t *ops, const proj_t *p, int64_t layer, int64_t which, const float *x,
                   int64_t T, float *out) {
    if (p->caller_from && T >= p->caller_from) {
        if (ops->project(layer, which, x, T, out)) return 1;
    } else if (p->parts == 1) {
        p->gemm[0](p->w[0], x, T, p->bias, out, p->N);
    } else {
        for (int64_t i = 0; i < p->parts; i++) p->gemm[i](p->w[i], x, T, NULL, out + p->col[i], p->N);
        if (p->bias)
            for (int64_t t = 0; t < T; t++)
                for (int64_t n = 0; n < p->N; n++) out[t * p->N + n] += p->bias[n];
    }
    return ops->delta && which != ROUTER ? ops->delta(layer, which, x, T, out) : 0;
}

/* A tensor-parallel rank's partial sums, all-reduced in place: 0, or nonzero if the group failed. */
static int all_reduce(const stack_ops_t *ops, float *x, int64_t n) {
    if (!ops->reduce) return 0;
    if (ops->shm_reduce && ops->shm_reduce(ops->shm, x, n) == 0) return 0;
    return ops->reduce(x, n); /* (after a stop too: the Python side raises the group's error) */
}

/* x [T, hidden]: the embeddings (overwritten); out [T, hidden]: the final norm of the last layer's
   output plus the residual stream, as after the Python loop (its call of that norm was 1-2% of a
   batch-1 step). The first ND rows are decode rows (one query each): tables [groups, ND, MB]
   int32, seq_lens [ND] int32; the other T - ND rows are `prompt`'s chunks (the GEMMs, norms, RoPE
   and cache stores run on all T rows at once; attention as attention.py's attend splits it).
   slots [groups, T] int64. 0 on success, -1 if out of memory, -2 if a caller's MLP, LoRA deltas or
   all-reduce failed. */
int decode_stack(const stack_ops_t *ops, const stack_dims_t *d, const stack_layer_t *layers, int64_t L,
                 int64_t T, const int64_t *positions, const int64_t *slots, const int32_t *tables,
                 const int32_t *seq_lens, float *x, const float *final_norm, float *out, int64_t ND,
                 const prompt_rows_t *prompt) {
    const int64_t H = d->heads, G = d->kv_heads, D = d->head_dim, hidden = d->hidden;
    const int64_t q_size = H * D, kv_size = G * D, qkv_n = q_size + 2 * kv_size;
    const int64_t widest = 2 * d->intermediate > qkv_n ? 2 * d->intermediate : qkv_n;
    size_t moe_floats = 0; /* a mixture of experts' logits and scratch, the most any layer needs */
    for (int64_t l = 0; l < L; l++)
        if (layers[l].moe) {
            const size_t need = (size_t)(T * layers[l].router.N + ops->moe_scratch(layers[l].moe, T) / 4 + 32);
            moe_floats = need > moe_floats ? need : moe_floats;
        }
    const size_t floats =
        (size_t)T * (size_t)(4 * hidden + widest + d->intermediate + 3 * q_size + 2 * kv_size) + moe_floats;
    float *buf = malloc(sizeof(float) * floats);
    if (!buf) return -1;
    float *residual = buf, *h = residual + T * hidden; /* [T, hidden] each, as are tmp and scratch */
    float *tmp = h + T * hidden, *scratch = tmp + T * hidden;
    float *wide = scratch + T * hidden;                                     /* qkv, then gate | up */
    float *act = wide + T * widest, *q_rot = act + T * d->intermediate, *attn = q_rot + T * q_size;
    float *qn = attn + T * q_size, *k_rot = qn + T * q_size, *kn = k_rot + T * kv_size;
    float *logits = kn + T * kv_size; /* [T, E], then the experts' scratch, 64-byte aligned */

    for (int64_t l = 0; l < L; l++) {
        const stack_layer_t *ly = &layers[l];
        /* layer 0 has no residual yet: rmsnorm(x), and the residual is x itself */
        ops->rms_norm(x, l ? residual : NULL, ly->input_norm, h, residual, T, hidden, d->eps);
        if (project(ops, &ly->qkv, l, QKV, h, T, wide)) goto failed;
        const float *q = wide, *k = wide + q_size, *v = wide + q_size + kv_size;
        int64_t q_stride = qkv_n, k_stride = qkv_n;
        if (ly->q_norm) { /* each head's RMSNorm over head_dim, on contiguous copies (as torch reshapes) */
            for (int64_t t = 0; t < T; t++) {
                memcpy(qn + t * q_size, q + t * qkv_n, sizeof(float) * q_size);
                memcpy(kn + t * kv_size, k + t * qkv_n, sizeof(float) * kv_size);
            }
            ops->rms_norm(qn, NULL, ly->q_norm, qn, attn, T * H, D, d->eps);
            ops->rms_norm(kn, NULL, ly->k_norm, kn, attn, T * G, D, d->eps);
            q = qn, k = kn, q_stride = q_size, k_stride = kv_size;
        }
        ops->rotary(q, q_stride, k, k_stride, q_rot, k_rot, positions, ly->cos, ly->sin, T, H, G, D);
        ops->store_kv(k_rot, kv_size, v, qkv_n, ly->k_cache, ly->v_cache, slots + ly->group * T, T, kv_size);
        if (ND)
            ops->attention(q_rot, ly->k_cache, ly->v_cache, tables + ly->group * ND * d->table_width, seq_lens,
                           attn, ND, H, G, D, d->block_size, d->table_width, d->scale, ly->window);
        if (ND < T)
            ops->prefill(q_rot + ND * q_size, ly->k_cache, ly->v_cache,
                         prompt->tables + ly->group * prompt->seqs * prompt->table_width, prompt->cu_seqlens_q,
                         prompt->seq_lens, attn + ND * q_size, prompt->seqs, H, G, D, d->block_size,
                         prompt->table_width, d->scale, ly->window);
        if (project(ops, &ly->o, l, O, attn, T, tmp) || all_reduce(ops, tmp, T * hidden)) goto failed;
        if (ly->pre_ff_norm) { /* Gemma: the attention output's own norm, then the pre-feedforward one */
            ops->rms_norm(tmp, NULL, ly->post_attn_norm, scratch, h, T, hidden, d->eps);
            ops->rms_norm(scratch, residual, ly->pre_ff_norm, h, residual, T, hidden, d->eps);
        } else {
            ops->rms_norm(tmp, residual, ly->post_attn_norm, h, residual, T, hidden, d->eps);
        }
        float *mlp_out = ly->post_ff_norm ? tmp : x;
        if (ly->moe) {
            if (project(ops, &ly->router, l, ROUTER, h, T, logits)) goto failed;
            ops->moe(ly->moe, h, logits, T, mlp_out, d->moe_valid,
                     (void *)(((uintptr_t)(logits + T * ly->router.N) + 63) & ~(uintptr_t)63));
        } else if (ly->gate_up.parts == 0) {
            if (ops->mlp(l, h, T, mlp_out)) goto failed;
        } else {
            if (project(ops, &ly->gate_up, l, GATE_UP, h, T, wide)) goto failed;
            ops->act_mul(wide, act, T, d->intermediate);
            if (project(ops, &ly->down, l, DOWN, act, T, mlp_out)) goto failed;
        }
        if (all_reduce(ops, mlp_out, T * hidden)) goto failed;
        if (ly->post_ff_norm) ops->rms_norm(tmp, NULL, ly->post_ff_norm, x, scratch, T, hidden, d->eps);
    }
    ops->rms_norm(x, residual, final_norm, out, residual, T, hidden, d->eps);
    free(buf);
    return 0;
failed:
    free(buf);
    return -2;
}
