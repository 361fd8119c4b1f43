/* The AMX build's GEMM for many rows (included by quant_gemm.c under QUANT_AMX, beside the AVX-512
   tile kernel it shares its helpers with; AMX-TILE and AMX-INT8, Intel Sapphire Rapids and later).

   Blocks of 16 activation rows against a tile of 16 weight rows: per group of 32 values one tdpbsud
   takes the block's 16 x 32 signed activation codes (tile A: the quantized activations re-laid by
   block and group, 512 contiguous bytes) and the group's 32 x 16 unsigned weight codes (tile B, 8
   rows of 64 bytes: exactly the tile layout's 8 vectors of 4 codes x 16 rows, so Q8_0's are loaded
   where they lie and the 4- and 5-bit ones unpacked once a tile) into 16 x 16 int32 dot products:
   the integer sums the VNNI kernel builds with 8 vpdpbusd a row. They are stored and scaled a row at
   a time with group_row_sum's float operations in its order (amx_scale_group), so every output
   equals the AVX-512 build's bit for bit. The int8 work leaves the vector ports; what remains a row
   and group is the scaling (~5 vector instructions against the VNNI kernel's ~15) and the tile store.
   A last block of fewer than 16 rows is padded with zero rows and costs a whole one, where the VNNI
   kernel pays by the row: hence `amx_takes`, and `amx_tail`, the last rows left to the VNNI kernel.

   Q6_K (a sub-scale per 16 values, applied in integers) makes two products a group, one per half
   (amx_block_q6k). Calls `amx_takes` refuses (a decode step's few rows, Q6_K's under 4 blocks)
   keep the VNNI tile kernel, as does a process the kernel refuses the tile state to (`amx_ready`,
   amx.h): where the tiles are refused or kill the build's probe, the AVX512-VNNI build runs instead. */
#include "amx.h"

#define AMX_ROWS 16 /* activation rows a block: tile A's and C's rows */

/* Which rows of a call the tiles take. A block of 16 rows on the tiles costs what ~4-8 rows cost the
   VNNI kernel beside it in the same pass over a weight tile, and ~11-12 rows alone (1 thread), and
   the two give the same bits, so a call shares its rows: its whole blocks on the tiles and its last
   M % 16 rows (the tail) on the VNNI kernel, right after the tiles' blocks of each weight tile,
   unless the tail is nearly a whole block (its padded rows at most AMX_TAIL_PAD), which the tiles
   then take padded. A call of fewer than 16 rows takes the tiles only as one padded block (at most
   AMX_ONE_PAD rows of padding), a longer one from AMX_MIN_BLOCKS whole blocks. Measured per row count
   (docs/performance.md, "The tiles by how full their last block is" and "Issue 45's paced steps,
   continued"). Per type class: the 4- and 5-bit formats, Q8_0, Q6_K (two products a
   group: it ties the VNNI kernel up to ~4 blocks); -1: never. */
static const int8_t AMX_ONE_PAD[3] = {2, -1, -1};
static const int8_t AMX_MIN_BLOCKS[3] = {1, 1, 4};
static const int8_t AMX_TAIL_PAD[3] = {10, 7, 15};

static inline int amx_class(int type) { return type == Q8_0 ? 1 : type == Q6_K ? 2 : 0; }

static inline int amx_takes(int type, int64_t M) {
    if (M < AMX_ROWS) return AMX_ROWS - M <= AMX_ONE_PAD[amx_class(type)];
    return M / AMX_ROWS >= AMX_MIN_BLOCKS[amx_class(type)];
}

/* The last rows of a call the tiles take (amx_takes) that the VNNI kernel takes instead: 0 or M % 16. */
static inline int64_t amx_tail(int type, int64_t M) {
    const int64_t r = M % AMX_ROWS;
    return M > AMX_ROWS && r && AMX_ROWS - r > AMX_TAIL_PAD[amx_class(type)] ? r : 0;
}

/* The tile shapes, per thread (the configuration is a thread's state): A 16 rows x 32 codes,
   B 8 rows x 64 bytes (32 values x 16 lanes), C 16 x 16 int32; tiles 0-2 and again 3-5. */
static void amx_configure(void) {
    amx_config_t c = amx_config();
    for (int set = 0; set < 6; set += 3) { /* two sets: see AMX_ISSUE */
        c.rows[set] = AMX_ROWS, c.colsb[set] = QK;
        c.rows[set + 1] = QK / 4, c.colsb[set + 1] = 64;
        c.rows[set + 2] = AMX_ROWS, c.colsb[set + 2] = 64;
    }
    _tile_loadconfig(&c);
}

/* A last block's `rows` (< 16) outputs: its accumulators copied out first, so that no access with
   a row index known only at run time keeps them out of registers (stored to the stack and loaded
   back at every group, they cost more than the tile products: the scaling is this kernel's work). */
static inline __attribute__((always_inline)) void amx_store_part(int64_t rows, const __m512 *acc, int64_t t,
                                                                 int64_t m0, int64_t N, const float *bias,
                                                                 float *out, int64_t ldo, int stream) {
    __m512 part[AMX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) part[r] = acc[r];
    store_rows(rows, part, t, m0, N, bias, out, ldo, stream);
}

/* Group g's tiles: its weight codes into tile B (from `codes`: the tile's, unpacked once a tile
   by amx_tile, or Q8_0's where they lie), the block's activation codes into A, their products into
   C. Two sets of tiles, (0, 1, 2) and (3, 4, 5), so one group's products are made while the last
   one's are scaled. */
#define AMX_ISSUE(A_, B_, C_, g_)                                               \
    do {                                                                        \
        const uint8_t *b_ = codes + (g_) * 512;                                 \
        if (UNPACK) { /* a lone block: this group's codes, unpacked here */     \
            store_group_codes(TYPE, w, t * G + (g_), own[(A_) != 0]);           \
            b_ = own[(A_) != 0];                                                \
        }                                                                       \
        _tile_loadd(A_, qa + ((m0) / AMX_ROWS * G + (g_)) * AMX_ROWS * QK, QK); \
        _tile_loadd(B_, b_, 64);                                                \
        _tile_zero(C_);                                                         \
        _tile_dpbsud(C_, A_, B_);                                               \
    } while (0)

/* Group g's int32 products (`dots`, row-major 16 x 16) into the rows' accumulators: the zero
   point's share added in integers, then the VNNI kernel's group_row_sum (so the same float result).
   zs and ms: each row's -zero x its codes' sum and da x that sum, made once per call (qgemm_amx). */
static inline __attribute__((always_inline)) void amx_scale_group(
        const int TYPE, const qweight_t *w, int64_t t, int64_t g, int64_t m0, const int32_t *dots,
        const float *da, const int32_t *zs, const float *ms, __m512 *acc) {
    const int64_t G = w->K / QK;
    __m512 dvec, mvec;
    __m512i sclo, schi;
    group_scales(TYPE, w, t, g, &dvec, &mvec, &sclo, &schi);
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) {
        const int64_t i = (m0 / AMX_ROWS * G + g) * AMX_ROWS + r;
        __m512i dot = _mm512_load_si512(dots + r * TILE);
        if (zero_point(TYPE)) dot = _mm512_add_epi32(_mm512_set1_epi32(zs[i]), dot);
        acc[r] = group_row_sum(TYPE, acc[r], dot, dvec, mvec, da[i], ms[i]);
    }
}

/* Tile t's outputs for activation rows [m0, m0 + rows) (rows <= 16; the quantized activations are
   padded with zero rows to a whole block, whose outputs are not stored). `codes`: the tile's weight
   codes, 512 bytes a group in tile B's layout; with UNPACK (a tile's only block) each group's 4- or
   5-bit codes are unpacked as it is issued instead. */
static inline __attribute__((always_inline)) void amx_block(
        const int TYPE, const int UNPACK, const qweight_t *w, int64_t t, int64_t m0, int64_t rows, const uint8_t *codes,
        const int8_t *qa, const float *da, const int32_t *zs, const float *ms, const float *bias, float *out,
        int64_t ldo, int stream) {
    const int64_t K = w->K, G = K / QK;
    __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    _Alignas(64) int32_t dots[2][AMX_ROWS * TILE];
    _Alignas(64) uint8_t own[2][UNPACK ? 8 * 64 : 64];
    /* Group g's products are stored one group after they were issued and scaled one group after
       they were stored: a tile store's lines are read back only once the next group's is under way. */
    AMX_ISSUE(0, 1, 2, 0);
    for (int64_t g = 0; g < G; g += 2) { /* g in tiles 0-2, g + 1 in 3-5 */
        if (g + 1 < G) AMX_ISSUE(3, 4, 5, g + 1);
        _tile_stored(2, dots[0], 64);
        if (g > 0) amx_scale_group(TYPE, w, t, g - 1, m0, dots[1], da, zs, ms, acc);
        if (g + 1 < G) {
            if (g + 2 < G) AMX_ISSUE(0, 1, 2, g + 2);
            _tile_stored(5, dots[1], 64);
            amx_scale_group(TYPE, w, t, g, m0, dots[0], da, zs, ms, acc);
        }
    }
    if (G % 2) amx_scale_group(TYPE, w, t, G - 1, m0, dots[0], da, zs, ms, acc);
    else amx_scale_group(TYPE, w, t, G - 1, m0, dots[1], da, zs, ms, acc);
    if (rows == AMX_ROWS) store_rows(AMX_ROWS, acc, t, m0, w->N, bias, out, ldo, stream);
    else amx_store_part(rows, acc, t, m0, w->N, bias, out, ldo, stream);
}

/* Q6_K's block: each group's values 0-15 and 16-31 take their own sub-scale, applied to their
   integer sums (as the VNNI kernel does), so a group makes two products: tile A against B_lo (the
   group's first 16 values, the rest zero) and against B_hi (its last 16). `codes`: 1024 bytes a
   group, B_lo then B_hi. zs, zh: each row's -32 x its codes' sum over values 0-15 and over 16-31. */
static void amx_block_q6k(const qweight_t *w, int64_t t, int64_t m0, int64_t rows, const uint8_t *codes,
                          const int8_t *qa, const float *da, const int32_t *zs, const int32_t *zh,
                          const float *bias, float *out, int64_t ldo, int stream) {
    const int64_t G = w->K / QK;
    __m512 acc[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    _Alignas(64) int32_t lo[AMX_ROWS * TILE], hi[AMX_ROWS * TILE];
    for (int64_t g = 0; g < G; g++) {
        _tile_loadd(0, qa + (m0 / AMX_ROWS * G + g) * AMX_ROWS * QK, QK);
        _tile_loadd(1, codes + g * 1024, 64);
        _tile_loadd(4, codes + g * 1024 + 512, 64);
        _tile_zero(2);
        _tile_zero(5);
        _tile_dpbsud(2, 0, 1);
        _tile_dpbsud(5, 0, 4);
        _tile_stored(2, lo, 64);
        _tile_stored(5, hi, 64);
        __m512 dvec, mvec;
        __m512i sclo, schi;
        group_scales(Q6_K, w, t, g, &dvec, &mvec, &sclo, &schi);
        for (int r = 0; r < AMX_ROWS; r++) {
            const int64_t i = (m0 / AMX_ROWS * G + g) * AMX_ROWS + r;
            const __m512i l = _mm512_add_epi32(_mm512_load_si512(lo + r * TILE), _mm512_set1_epi32(zs[i]));
            const __m512i h = _mm512_add_epi32(_mm512_load_si512(hi + r * TILE), _mm512_set1_epi32(zh[i]));
            const __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(l, sclo), _mm512_mullo_epi32(h, schi));
            acc[r] = group_row_sum(Q6_K, acc[r], dot, dvec, mvec, da[i], 0.0f); /* Q6_K: no mins */
        }
    }
    if (rows == AMX_ROWS) store_rows(AMX_ROWS, acc, t, m0, w->N, bias, out, ldo, stream);
    else amx_store_part(rows, acc, t, m0, w->N, bias, out, ldo, stream);
}

/* Tile t against activation rows [m0, m1): for more than one block of 16 rows, its 4- and 5-bit
   codes unpacked once into `buffer` (G x 512 bytes, Q6_K's G x 1024; written well before a tile load
   reads them back), then each block. */
static inline __attribute__((always_inline)) void amx_tile(
        const int TYPE, const qweight_t *w, int64_t t, int64_t m0, int64_t m1, int64_t M, uint8_t *buffer,
        const int8_t *qa, const float *da, const int32_t *zs, const int32_t *zh, const float *ms,
        const float *bias, float *out, int64_t ldo, int stream) {
    const int64_t G = w->K / QK;
    const uint8_t *codes = w->qs + t * G * 512;
    if (TYPE == Q6_K) { /* B_lo and B_hi a group (amx_block_q6k) */
        const __m512i zero = _mm512_setzero_si512();
        for (int64_t g = 0; g < G; g++) {
            __m512i wlo[4], whi[4];
            group_codes(Q6_K, 0, w, t * G + g, wlo, whi);
            for (int c = 0; c < 4; c++) {
                _mm512_store_si512(buffer + g * 1024 + c * 64, wlo[c]);
                _mm512_store_si512(buffer + g * 1024 + (c + 4) * 64, zero);
                _mm512_store_si512(buffer + g * 1024 + 512 + c * 64, zero);
                _mm512_store_si512(buffer + g * 1024 + 512 + (c + 4) * 64, whi[c]);
            }
        }
        for (int64_t mb = m0; mb < m1; mb += AMX_ROWS)
            amx_block_q6k(w, t, mb, M - mb < AMX_ROWS ? M - mb : AMX_ROWS, buffer, qa, da, zs, zh, bias, out, ldo, stream);
        return;
    }
    if (TYPE != Q8_0 && m1 - m0 <= AMX_ROWS) {
        amx_block(TYPE, 1, w, t, m0, M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS, codes, qa, da, zs, ms, bias, out, ldo, stream);
        return;
    }
    if (TYPE != Q8_0) {
        for (int64_t g = 0; g < G; g++) store_group_codes(TYPE, w, t * G + g, buffer + g * 512);
        codes = buffer;
    }
    for (int64_t mb = m0; mb < m1; mb += AMX_ROWS)
        amx_block(TYPE, 0, w, t, mb, M - mb < AMX_ROWS ? M - mb : AMX_ROWS, codes, qa, da, zs, ms, bias, out, ldo, stream);
}

#define AMX_BY_TYPE(ROWS)                                                       \
    switch (w->type) {                                                          \
    case Q8_0: ROWS(Q8_0); break; case Q4_0: ROWS(Q4_0); break;                 \
    case Q4_1: ROWS(Q4_1); break; case Q5_0: ROWS(Q5_0); break;                 \
    case Q5_1: ROWS(Q5_1); break; case Q4_K: ROWS(Q4_K); break;                 \
    case Q5_K: ROWS(Q5_K); break; default: ROWS(Q6_K); break;                   \
    }

/* How many qgemm calls took the tiles, and how many rows of theirs the VNNI kernel took beside them
   (tests/kernels/test_cpu_quant_amx.py: the outputs alone cannot tell, being the VNNI kernel's bit
   for bit). */
static int64_t amx_call_count = 0, amx_tail_count = 0;
int64_t amx_calls(void) { return __atomic_load_n(&amx_call_count, __ATOMIC_RELAXED); }
int64_t amx_tail_rows(void) { return __atomic_load_n(&amx_tail_count, __ATOMIC_RELAXED); }

/* qgemm for the row counts amx_takes: the activations quantized as qgemm does; the rows the tiles
   take re-laid by block and padded to whole blocks with zeros, the tail (amx_tail) left as the VNNI
   kernel reads them, each weight tile's tail rows made right after its blocks. */
static void qgemm_amx(const qweight_t *w, const float *x, int64_t M, const float *bias, float *out,
                      int64_t ldo, int stream) {
    const int64_t K = w->K, G = K / QK, T = (w->N + TILE - 1) / TILE;
    const int64_t tail = amx_tail((int)w->type, M), Mt = M - tail; /* rows [0, Mt) on the tiles */
    const int64_t Mp = (Mt + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS, Mq = Mp > M ? Mp : M;
    __atomic_add_fetch(&amx_call_count, 1, __ATOMIC_RELAXED);
    __atomic_add_fetch(&amx_tail_count, tail, __ATOMIC_RELAXED);
    int8_t *qa = malloc((size_t)(Mq * K));
    float *da = malloc(sizeof(float) * (size_t)(Mq * G));
    int32_t *sa = malloc(sizeof(int32_t) * (size_t)(Mq * G * 2));
    int32_t *zs = malloc(sizeof(int32_t) * (size_t)(Mp * G)), *zh = malloc(sizeof(int32_t) * (size_t)(Mp * G));
    float *ms = malloc(sizeof(float) * (size_t)(Mp * G)), *msa = malloc(sizeof(float) * (size_t)(Mq * G));
    quantize_rows(x, M, K, qa, da, sa, msa);
    memset(qa + M * K, 0, (size_t)((Mq - M) * K));
    memset(da + M * G, 0, sizeof(float) * (size_t)((Mq - M) * G));
    memset(sa + M * G * 2, 0, sizeof(int32_t) * (size_t)((Mq - M) * G * 2));
    memset(msa + M * G, 0, sizeof(float) * (size_t)((Mq - M) * G));
    /* re-laid by block of 16 rows and group: [Mp / 16][G][16] (and 32 codes a row for A), so a tile
       load reads 512 contiguous bytes and a group's 16 rows' scales sit on one line */
    int8_t *qb = aligned_alloc(64, (size_t)(Mp * K));
    float *db = malloc(sizeof(float) * (size_t)(Mp * G));
    const int zp = zero_point((int)w->type);
    for (int64_t m = 0; m < Mp; m++)
        for (int64_t g = 0; g < G; g++) {
            const int64_t i = m * G + g, j = (m / AMX_ROWS * G + g) * AMX_ROWS + m % AMX_ROWS;
            const int32_t s = sa[2 * i] + sa[2 * i + 1];
            memcpy(qb + j * QK, qa + i * QK, QK);
            db[j] = da[i];
            zs[j] = w->type == Q6_K ? -32 * sa[2 * i] : -zp * s;
            zh[j] = -32 * sa[2 * i + 1];
            ms[j] = msa[i];
        }
    for (int64_t m0 = 0; m0 < Mp; m0 += M_CHUNK) {
        const int64_t m1 = m0 + M_CHUNK < Mp ? m0 + M_CHUNK : Mp;
        const int last = m1 == Mp;
#pragma omp parallel
        {
            uint8_t *buffer = aligned_alloc(64, (size_t)(G * 1024));
            amx_configure();
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
#define AMX_TILE_OF(TYPE_) amx_tile(TYPE_, w, t, m0, m1, Mt, buffer, qb, db, zs, zh, ms, bias, out, ldo, stream)
                AMX_BY_TYPE(AMX_TILE_OF)
#undef AMX_TILE_OF
                if (last && tail) tile_all_rows((int)w->type, w, t, Mt, M, qa, da, sa, msa, bias, out, ldo, stream);
            }
            _tile_release();
            free(buffer);
        }
    }
    if (stream) _mm_sfence();
    free(qa);
    free(da);
    free(qb);
    free(db);
    free(sa);
    free(zs);
    free(zh);
    free(ms);
    free(msa);
}
