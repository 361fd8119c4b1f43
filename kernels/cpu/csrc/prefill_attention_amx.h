/* Prefill attention on AMX's bfloat16 tiles (AMX-TILE, AMX-BF16: Intel Sapphire Rapids and later):
   the amx_bf16 build of prefill_attention.c (PREFILL_AMX), for bfloat16 caches, in a process the
   kernel grants the tiles (amx.h). Same arguments and layouts as prefill_attention.c's kernel.

   A task is one sequence, one kv head and up to AROWS rows (queries x the group's heads, as there),
   in blocks of 16. Per block of AKB keys it lays the keys out once as tiles B: K's rows transposed
   by pairs of bfloat16 (a 16 x 16 transposition of 32-bit words: tile B's rows are pairs of head
   dims, its columns keys) and V's rows interleaved by pairs of keys. Then per block of 16 rows: the
   scores, 16 rows x up to 64 keys a pass in four tiles C, tdpbf16ps per 32 head dims and 16 keys;
   the online softmax over the block's scores in float32 (the running max, sum and rescaling of
   prefill_attention.c, once per AKB keys, not per 64; exp inline, exp_neg); the probabilities
   multiplied with V, 32 keys a tdpbf16ps, into 16 x 16 float32 tiles added to the rows' sums.
   A row's keys are taken in parts of APK from key 0, each part's max, sum and weighted V computed
   from scratch and folded into the row's total part after part (amx_fold). A short chunk at a long
   context (a paced prompt's, beside decode steps) is few (tile, kv head) pairs: 3 on SmolLM2, one
   thread idle a third of the time on two; its parts are then tasks of their own, folded after
   (amx_merge), with the same bits, since the fold is the same either way.

   Numbers: K and V are bfloat16 already; the queries (the softmax scale folded in) and the
   probabilities go in as two bfloat16 each, hi + lo (lo: what hi's rounding left), so each product
   is two tile products and the result is float32's but for ~2^-16 of each query and weight and the
   order of the sums (1e-5 of the outputs; one bfloat16 each was 2^-9, and moved a tensor-parallel
   run's greedy tokens off the one-rank run's where their top two were 0.29 apart). A row's result
   does not depend on the other rows of its chunk, on how its prompt was chunked or on how its parts
   were shared out: key blocks and parts start at multiples of AKB and APK from position 0, and each
   row's sums are its own. */
#include "amx.h"
#include "prefetch.h"
#include "prefill_amx_parts.h"

#define AKB 256   /* keys a block: their tiles B laid out once per task, a row's max and sum updated once */
#define AROWS 128 /* a task's rows at most (before padding to 16) */
_Static_assert(APK % AKB == 0, "a part is whole key blocks");

static int64_t amx_attention_count; /* calls that ran on the tiles (tests) */
int64_t amx_attention_calls(void) { return __atomic_load_n(&amx_attention_count, __ATOMIC_RELAXED); }

static const uint16_t amx_zero_row[256] __attribute__((aligned(64))); /* keys past the last: D <= 256 */

/* Tile 0-3: C (16 x 16 float32), 4: A (16 rows x 32 bfloat16), 5-7: B (16 pairs x 16 columns). */
static void amx_attention_configure(void) {
    amx_config_t c = amx_config();
    for (int t = 0; t < 8; t++) c.rows[t] = 16, c.colsb[t] = 64;
    _tile_loadconfig(&c);
}

#define APF 32 /* keys ahead whose K and V rows the loader asks into L2 while it lays out the keys before */

/* Key row `at` of the caches (kv head g's D values in K and in V) asked into L2. */
static inline void amx_prefetch_key(const uint16_t *k_cache, const uint16_t *v_cache, int64_t at, int64_t D) {
    const char *k = (const char *)(k_cache + at), *v = (const char *)(v_cache + at);
    for (int64_t b = 0; b < D * 2; b += 64) PREFETCH_READ(k + b), PREFETCH_READ(v + b);
}

/* A walk over kv head g's key rows from key `at` on: each key's row offset in the caches, its block
   looked up once a block and not by a division a key (the loader's loads wait on their addresses). */
typedef struct {
    const int32_t *table;
    int64_t blk, slot, first, g, G, D, BS;
} key_walk_t;

static inline key_walk_t key_walk(const int32_t *table, int64_t at, int64_t g, int64_t G, int64_t D, int64_t BS) {
    return (key_walk_t){table, at / BS, at % BS, (int64_t)table[at / BS] * BS, g, G, D, BS};
}

/* This key's row offset; the walk moves on to the next (whose block is looked up only when asked for). */
static inline int64_t key_next(key_walk_t *w) {
    if (w->slot == w->BS) w->slot = 0, w->first = (int64_t)w->table[++w->blk] * w->BS;
    return ((w->first + w->slot++) * w->G + w->g) * w->D;
}

/* The next block of keys asked into L2 a few keys at a time while this block's rows compute (the
   loader's own prefetch runs only APF keys ahead of its copies, and the copies then wait on memory:
   a short chunk's rows, a paced prompt's, spend most of their time there). Keys [next, end). */
typedef struct {
    const uint16_t *k_cache, *v_cache;
    key_walk_t walk; /* at `next` (set only where next < end) */
    int64_t next, end;
} amx_ahead_t;

static inline void amx_ahead(amx_ahead_t *a, int64_t keys) {
    for (const int64_t stop = a->next + keys < a->end ? a->next + keys : a->end; a->next < stop; a->next++)
        amx_prefetch_key(a->k_cache, a->v_cache, key_next(&a->walk), a->walk.D);
}

/* Keys k0 + [j0, j1) (multiples of 32; those at or past n zeros) of kv head g as tiles B:
   kk [AKB / 16][D / 32] tiles: pair p of head dims (row) x 16 keys (columns), for the scores;
   vv [AKB / 32][D / 16] tiles: pair p of keys (row) x 16 head dims (columns), for the weighted V. */
static void amx_load_keys(const uint16_t *restrict k_cache, const uint16_t *restrict v_cache,
                          const int32_t *restrict table, int64_t k0, int64_t n, int64_t j0, int64_t j1,
                          int64_t g, int64_t G, int64_t D, int64_t BS, uint16_t *restrict kk, uint16_t *restrict vv) {
    static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i mix = _mm512_loadu_si512(pairs);
    const int64_t DC = D / 32, DN = D / 16;
    int64_t off[AKB]; /* each key's row offset in the caches (key_walk) */
    const int64_t last = j1 < n ? j1 : n;
    if (j0 < last) {
        key_walk_t walk = key_walk(table, k0 + j0, g, G, D, BS);
        for (int64_t j = j0; j < last; j++) off[j] = key_next(&walk);
    }
    for (int64_t j = j0; j < j0 + APF && j < last; j++) amx_prefetch_key(k_cache, v_cache, off[j], D);
    for (int64_t j = j0; j < j1; j += 16) {
        for (int64_t i = j + APF; i < j + APF + 16 && i < last; i++) amx_prefetch_key(k_cache, v_cache, off[i], D);
        const uint16_t *kr[16];
        for (int i = 0; i < 16; i++) kr[i] = j + i < n ? k_cache + off[j + i] : amx_zero_row;
        for (int64_t c = 0; c < DC; c++) {
            __m512 r[16]; /* key i's 16 pairs of dims 32c .. 32c + 31, as 32-bit words */
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps((const float *)(kr[i] + 32 * c));
            transpose16_regs(r); /* r[p]: pair p of the 16 keys */
            uint16_t *dst = kk + ((j / 16) * DC + c) * 512;
            for (int p = 0; p < 16; p++) _mm512_storeu_ps((float *)(dst + 32 * p), r[p]);
        }
    }
    for (int64_t j = j0; j < j1; j += 32)
        for (int p = 0; p < 16; p++) {
            const int64_t a = j + 2 * p, b = a + 1;
            const uint16_t *va = a < n ? v_cache + off[a] : amx_zero_row;
            const uint16_t *vb = b < n ? v_cache + off[b] : amx_zero_row;
            for (int64_t c = 0; c < DN; c++) {
                const __m512i both = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(va + 16 * c))),
                    _mm256_loadu_si256((const __m256i *)(vb + 16 * c)), 1);
                _mm512_storeu_si512(vv + (((j / 32) * DN + c) * 16 + p) * 32, _mm512_permutexvar_epi16(mix, both));
            }
        }
}

/* s [16][AKB] (float32) = the 16 rows of the queries against keys [j0, j1) (a multiple of 32 apart);
   each query is two rows of bfloat16, qh + ql (ql: what qh's rounding left), so a score is two tile
   products and as exact as float32's but for ~2^-16 of each query value. */
static void amx_scores(const uint16_t *restrict qh, const uint16_t *restrict ql, const uint16_t *restrict kk,
                       int64_t D, int64_t j0, int64_t j1, float *restrict s) {
    const int64_t DC = D / 32;
    for (int64_t j = j0; j < j1; j += 64) {
        const int wide = j1 - j >= 64; /* four tiles of 16 keys, else two */
        const uint16_t *b = kk + (j / 16) * DC * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < DC; c++) {
            _tile_loadd(4, qh + 32 * c, D * 2);
            _tile_loadd(5, ql + 32 * c, D * 2);
            _tile_loadd(6, b + c * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 5, 6);
            _tile_loadd(7, b + (DC + c) * 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(1, 5, 7);
            if (wide) {
                _tile_loadd(6, b + (2 * DC + c) * 512, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                _tile_loadd(7, b + (3 * DC + c) * 512, 64);
                _tile_dpbf16ps(3, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, s + j, AKB * 4);
        _tile_stored(1, s + j + 16, AKB * 4);
        if (wide) {
            _tile_stored(2, s + j + 32, AKB * 4);
            _tile_stored(3, s + j + 48, AKB * 4);
        }
    }
}

/* x (float32) as hi + lo, two bfloat16 each: hi = x rounded, lo = the rest rounded. */
static inline __attribute__((always_inline)) void split_bf16_16(__m512 v, uint16_t *restrict hi, uint16_t *restrict lo) {
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_storeu_si256((__m256i *)hi, h);
    _mm256_storeu_si256((__m256i *)lo, (__m256i)_mm512_cvtneps_pbh(v - back));
}

/* x (float32, n a multiple of 16) as hi + lo (split_bf16_16). */
static inline void split_bf16(const float *restrict x, int64_t n, uint16_t *restrict hi, uint16_t *restrict lo) {
    for (int64_t j = 0; j < n; j += 16) split_bf16_16(_mm512_loadu_ps(x + j), hi + j, lo + j);
}

/* exp(x) for x <= 0, 16 at once, to about 1 ulp of float32 (inline: libmvec's expf is a call per 16
   values, about half a softmax's time here): x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so
   r is exact), exp(r) by Cephes' degree-7 polynomial, 2^n by vscalefps; x is held at -104 (below
   which float32's exp is 0) so that r stays small. */
static inline __attribute__((always_inline)) __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* The lanes of keys [j, j + 16) that a row sees, [a, e). */
static inline __mmask16 seen(int64_t j, int64_t a, int64_t e) {
    const int64_t from = a > j ? a - j : 0, to = e < j + 16 ? e - j : 16;
    return from >= to ? 0 : (__mmask16)(((1u << to) - 1) & ~((1u << from) - 1));
}

/* The block's scores into the 16 rows' running max m and sum l, their probabilities over [j0, j1)
   as ph + pl (bfloat16 pairs, as the queries; zero outside each row's keys [lo, hi)), and keep: the
   factor the rows' sums of weighted V so far are multiplied by (0 for a row's first keys, 1 for a
   row without any). prefill_attention.c's online softmax (softmax_row), in one pass over the scores
   after the max: each probability split as it is made, never stored as float32. Before each row,
   `ahead_keys` keys of the next block are asked for (amx_ahead). */
static void amx_softmax(const float *restrict s, uint16_t *restrict ph, uint16_t *restrict pl, int64_t j0, int64_t j1,
                        const int64_t *restrict lo, const int64_t *restrict hi, float *restrict m,
                        float *restrict l, float *restrict keep, amx_ahead_t *ahead, int64_t ahead_keys) {
    for (int r = 0; r < 16; r++) {
        amx_ahead(ahead, ahead_keys);
        const float *sr = s + r * AKB;
        uint16_t *hr = ph + r * AKB, *lr = pl + r * AKB;
        const int64_t a = lo[r], e = hi[r];
        if (a >= e) { /* sees none of these keys: weights 0, its state as it was */
            memset(hr + j0, 0, sizeof(uint16_t) * (size_t)(j1 - j0));
            memset(lr + j0, 0, sizeof(uint16_t) * (size_t)(j1 - j0));
            keep[r] = 1.0f;
            continue;
        }
        __m512 top16 = _mm512_set1_ps(-3.402823466e38f) /* below any score */;
        for (int64_t j = a / 16 * 16; j < e; j += 16)
            top16 = _mm512_mask_max_ps(top16, seen(j, a, e), top16, _mm512_loadu_ps(sr + j));
        const float top = _mm512_reduce_max_ps(top16);
        const int first = l[r] == 0.0f;
        const float new_m = first || top > m[r] ? top : m[r];
        keep[r] = first ? 0.0f : expf(m[r] - new_m);
        const __m512 mv = _mm512_set1_ps(new_m);
        __m512 sum16 = _mm512_setzero_ps();
        for (int64_t j = j0; j < j1; j += 16) {
            const __mmask16 k = seen(j, a, e);
            const __m512 p = k ? _mm512_maskz_mov_ps(k, exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sr + j), mv)))
                               : _mm512_setzero_ps();
            sum16 = _mm512_add_ps(sum16, p);
            split_bf16_16(p, hr + j, lr + j);
        }
        l[r] = l[r] * keep[r] + _mm512_reduce_add_ps(sum16);
        m[r] = new_m;
    }
}

/* acc [16][D] = acc * keep + (ph + pl) [16][AKB] (keys [j0, j1), a multiple of 32 apart) @ V's tiles. */
static void amx_weighted_v(const uint16_t *restrict ph, const uint16_t *restrict pl, const uint16_t *restrict vv,
                           int64_t D, int64_t j0, int64_t j1, const float *restrict keep, float *restrict acc,
                           float *restrict tmp) {
    const int64_t DN = D / 16;
    for (int64_t c0 = 0; c0 < DN; c0 += 4) {
        const int wide = DN - c0 >= 4; /* four tiles of 16 head dims, else two (D is a multiple of 32) */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t j = j0; j < j1; j += 32) {
            const uint16_t *b = vv + ((j / 32) * DN + c0) * 512;
            _tile_loadd(4, ph + j, AKB * 2);
            _tile_loadd(5, pl + j, AKB * 2);
            _tile_loadd(6, b, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(0, 5, 6);
            _tile_loadd(7, b + 512, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(1, 5, 7);
            if (wide) {
                _tile_loadd(6, b + 1024, 64);
                _tile_dpbf16ps(2, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
                _tile_loadd(7, b + 1536, 64);
                _tile_dpbf16ps(3, 4, 7);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, tmp, 256);
        _tile_stored(1, tmp + 16, 256);
        if (wide) {
            _tile_stored(2, tmp + 32, 256);
            _tile_stored(3, tmp + 48, 256);
        }
        const int cols = wide ? 4 : 2;
        for (int r = 0; r < 16; r++) {
            const __m512 k = _mm512_set1_ps(keep[r]);
            for (int c = 0; c < cols; c++) {
                float *o = acc + r * D + (c0 + c) * 16;
                _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(o), k, _mm512_loadu_ps(tmp + r * 64 + c * 16)));
            }
        }
    }
}

typedef struct { /* a thread's buffers; rp: a task's rows, padded to 16 */
    uint16_t *qh, *ql, *kk, *vv, *ph, *pl;
    float *acc, *s, *m, *l, *tmp, *total; /* total: the rows' parts folded so far (amx_fold) */
    int64_t *lo, *hi;
} amx_buffers_t;

static int amx_buffers(amx_buffers_t *b, int64_t rp, int64_t D) {
    b->qh = aligned_alloc(64, (size_t)(rp * D * 2));
    b->ql = aligned_alloc(64, (size_t)(rp * D * 2));
    b->kk = aligned_alloc(64, (size_t)(AKB * D * 2));
    b->vv = aligned_alloc(64, (size_t)(AKB * D * 2));
    b->ph = aligned_alloc(64, (size_t)(16 * AKB * 2));
    b->pl = aligned_alloc(64, (size_t)(16 * AKB * 2));
    b->acc = aligned_alloc(64, (size_t)(rp * D * 4));
    b->s = aligned_alloc(64, (size_t)(16 * AKB * 4));
    b->tmp = aligned_alloc(64, 16 * 64 * 4);
    b->total = aligned_alloc(64, (size_t)(rp * (D + 2) * 4));
    b->m = malloc(sizeof(float) * (size_t)rp), b->l = malloc(sizeof(float) * (size_t)rp);
    b->lo = malloc(sizeof(int64_t) * (size_t)rp), b->hi = malloc(sizeof(int64_t) * (size_t)rp);
    return b->qh && b->ql && b->kk && b->vv && b->ph && b->pl && b->acc && b->s && b->tmp && b->total && b->m &&
           b->l && b->lo && b->hi;
}

static void amx_buffers_free(amx_buffers_t *b) {
    free(b->qh), free(b->ql), free(b->kk), free(b->vv), free(b->ph), free(b->pl), free(b->acc), free(b->s), free(b->tmp);
    free(b->total), free(b->m), free(b->l), free(b->lo), free(b->hi);
}

/* Queries [q0, q1) of one sequence (its chunk's rows from row0, its L cached tokens) under kv head
   g's query heads, over key parts [pa, pb) (APK keys each, from key 0): each part's state computed
   from scratch and folded into the rows' total (amx_fold), written normalized to out; or, with
   `part` (a split task: one part), the part's state left there for the merge (amx_merge). */
static void amx_task(const float *restrict q, const uint16_t *restrict k_cache, const uint16_t *restrict v_cache,
                     const int32_t *restrict table, int64_t row0, int64_t qlen, int64_t L, int64_t q0, int64_t q1,
                     int64_t g, float *restrict out, int64_t H, int64_t G, int64_t D, int64_t BS, float scale,
                     int64_t window, int64_t pa, int64_t pb, float *part, const amx_buffers_t *b) {
    const int64_t rep = H / G, R = (q1 - q0) * rep, RP = (R + 15) / 16 * 16, base = L - qlen;
    for (int64_t row = 0; row < RP; row++) { /* row (i - q0) * rep + h: query i under head g * rep + h */
        uint16_t *hi = b->qh + row * D, *lo = b->ql + row * D;
        if (row >= R) {
            memset(hi, 0, sizeof(uint16_t) * (size_t)D);
            memset(lo, 0, sizeof(uint16_t) * (size_t)D);
            continue;
        }
        const float *src = q + ((row0 + q0 + row / rep) * H + g * rep + row % rep) * D;
        float scaled[256];
        for (int64_t d = 0; d < D; d++) scaled[d] = src[d] * scale;
        split_bf16(scaled, D, hi, lo);
    }
    const amx_state_t total = amx_state_at(b->total, RP, D);
    const amx_state_t st = part ? amx_state_at(part, RP, D) : (amx_state_t){b->m, b->l, b->acc};
    memset(total.l, 0, sizeof(float) * (size_t)RP);
    const int64_t first_pos = base + q0, last_pos = base + q1 - 1;
    const int64_t start = window > 0 && first_pos - window + 1 > 0 ? first_pos - window + 1 : 0;
    const int64_t task_end = pb * APK < last_pos + 1 ? pb * APK : last_pos + 1; /* past the task's last key */
    for (int64_t pp = pa; pp < pb; pp++) {
        memset(st.acc, 0, sizeof(float) * (size_t)(RP * D));
        memset(st.l, 0, sizeof(float) * (size_t)RP);
        memset(st.m, 0, sizeof(float) * (size_t)RP);
        const int64_t from = start - start % AKB > pp * APK ? start - start % AKB : pp * APK;
        for (int64_t k0 = from; k0 < (pp + 1) * APK && k0 <= last_pos; k0 += AKB) {
            const int64_t n = last_pos + 1 - k0 < AKB ? last_pos + 1 - k0 : AKB;
            int64_t ja = AKB, je = 0; /* the keys any row sees */
            for (int64_t row = 0; row < RP; row++) { /* row sees keys [from, p]: [a, e) of the block */
                int64_t a = 0, e = 0;
                if (row < R) {
                    const int64_t p = base + q0 + row / rep, w0 = window > 0 && p - window + 1 > 0 ? p - window + 1 : 0;
                    a = w0 - k0 > 0 ? w0 - k0 : 0;
                    e = p + 1 - k0 < n ? p + 1 - k0 : n;
                }
                if (a < e) ja = a < ja ? a : ja, je = e > je ? e : je;
                b->lo[row] = a, b->hi[row] = e;
            }
            if (ja >= je) continue;
            amx_load_keys(k_cache, v_cache, table, k0, n, ja / 32 * 32, (je + 31) / 32 * 32, g, G, D, BS, b->kk, b->vv);
            const int64_t after = k0 + AKB + AKB < task_end ? k0 + AKB + AKB : task_end;
            amx_ahead_t ahead = {k_cache, v_cache, {0}, k0 + AKB, after};
            if (ahead.next < ahead.end) ahead.walk = key_walk(table, ahead.next, g, G, D, BS);
            const int64_t ahead_keys = after > k0 + AKB ? (after - k0 - AKB + RP - 1) / RP : 0; /* a share a row */
            for (int64_t r0 = 0; r0 < RP; r0 += 16) {
                int64_t ba = AKB, be = 0;
                for (int64_t r = r0; r < r0 + 16; r++)
                    if (b->lo[r] < b->hi[r]) ba = b->lo[r] < ba ? b->lo[r] : ba, be = b->hi[r] > be ? b->hi[r] : be;
                if (ba >= be) continue;
                const int64_t j0 = ba / 32 * 32, j1 = (be + 31) / 32 * 32;
                float keep[16];
                amx_scores(b->qh + r0 * D, b->ql + r0 * D, b->kk, D, j0, j1, b->s);
                amx_softmax(b->s, b->ph, b->pl, j0, j1, b->lo + r0, b->hi + r0, st.m + r0, st.l + r0, keep, &ahead,
                            ahead_keys);
                amx_weighted_v(b->ph, b->pl, b->vv, D, j0, j1, keep, st.acc + r0 * D, b->tmp);
            }
        }
        if (!part) amx_fold(total, st, R, D);
    }
    if (!part) amx_write_rows(total, R, out, row0, q0, g, rep, H, D);
}

/* prefill_attention_bf16's work where it runs on the tiles: D a multiple of 32, at most 256. */
static void prefill_attention_amx(const float *restrict q, const uint16_t *restrict k_cache,
                                  const uint16_t *restrict v_cache, const int32_t *restrict block_tables,
                                  const int32_t *restrict cu_seqlens_q, const int32_t *restrict seq_lens,
                                  float *restrict out, int64_t S, int64_t H, int64_t G, int64_t D, int64_t BS,
                                  int64_t MB, float scale, int64_t window) {
    const int64_t rep = H / G, qt = rep < AROWS ? AROWS / rep : 1, rp = (qt * rep + 15) / 16 * 16;
    task_plan_t plan = task_plan(cu_seqlens_q, seq_lens, S, G, qt, rep, D, window);
    __atomic_add_fetch(&amx_attention_count, 1, __ATOMIC_RELAXED);
#pragma omp parallel
    {
        amx_buffers_t b;
        if (!amx_buffers(&b, rp, D)) abort(); /* a few hundred KB a thread */
        amx_attention_configure();
#pragma omp for schedule(dynamic, 1)
        for (int64_t jj = 0; jj < plan.tasks; jj++) {
            const int64_t j = plan.tasks - 1 - jj; /* a chunk's last tiles see the most keys: they go first */
            const int64_t s = plan.owner[j], parts = plan.pb[s] - plan.pa[s], at = j - plan.first[s];
            const int64_t pair = plan.split[s] ? at / parts : at, tile = pair / G, g = pair % G;
            const int64_t qlen = cu_seqlens_q[s + 1] - cu_seqlens_q[s], q0 = tile * qt;
            const int64_t q1 = q0 + qt < qlen ? q0 + qt : qlen;
            const int64_t pa = plan.split[s] ? plan.pa[s] + at % parts : plan.pa[s];
            const int64_t pb = plan.split[s] ? pa + 1 : plan.pb[s];
            float *part = plan.split[s] ? plan.held + plan.held_at[s] + at * plan.stride[s] : NULL;
            amx_task(q, k_cache, v_cache, block_tables + s * MB, cu_seqlens_q[s], qlen, seq_lens[s], q0, q1, g, out,
                     H, G, D, BS, scale, window, pa, pb, part, &b);
        }
        _tile_release();
        if (plan.held) {
#pragma omp for schedule(static)
            for (int64_t j = 0; j < plan.tasks; j++) {
                const int64_t s = plan.owner[j];
                if (plan.split[s] && (j - plan.first[s]) % (plan.pb[s] - plan.pa[s]) == 0) /* once a split pair */
                    amx_merge(&plan, j, cu_seqlens_q, out, H, G, D, qt, b.total);
            }
        }
        amx_buffers_free(&b);
    }
    task_plan_free(&plan);
}
