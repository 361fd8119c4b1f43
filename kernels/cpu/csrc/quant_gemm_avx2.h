/* The AVX2 build's tile kernel of quant_gemm.c (included there under QUANT_AVX2): the same tiles,
   the same sums, with the integer dot products AVX2 has. It holds no AVX-512 instruction, so it
   runs on AVX2-only CPUs (AMD Zen 1-3, most laptops); tests/kernels/test_cpu_quant.py checks the
   built library for zmm registers.

   AVX2 has no vpdpbusd; as llama.cpp does, `_mm256_maddubs_epi16` multiplies unsigned weight codes
   by signed activation codes and adds adjacent pairs into int16, then `_mm256_madd_epi16` by ones
   adds adjacent int16 pairs into int32: together one vpdpbusd (4 products into each row's int32
   lane). The int16 step saturates, so each format adds in int16 only as many products as cannot
   overflow (activation codes are at most 127 in magnitude):
     4-bit codes (<= 15): 8 maddubs per 32 values, 8 x 2 x 15 x 127 = 30480, one madd;
     5-bit (<= 31): 4 maddubs, 31496, so two madds; Q6_K (<= 63): 2 maddubs, 32004, four madds;
     Q8_0: codes are stored + 128, so 255 x 127 x 2 would overflow: the code is made signed again
       (xor 0x80) and the sign moved onto the activation (`_mm256_sign_epi8`: |w| x sign(w) a,
       at most 128 x 127 x 2 = 32512), one madd per maddubs, and no zero point to take off.
   A 256-bit vector holds 8 of a tile's 16 rows (4 bytes each), so a tile runs as two halves of 8
   rows, each over every group: 8 weight vectors and MT accumulators stay in the 16 registers. A
   one-row GEMV (a decode step) takes both halves of each group in turn instead: each 64-byte line of
   codes is used whole at once and the loads run in address order (7-9% faster on SmolLM2's
   weights, 2 threads).

   With QUANT_AVXVNNI (the avx_vnni build: Intel Alder Lake and later client CPUs, AMD Zen 5) the
   dot product is AVX-VNNI's 256-bit vpdpbusd instead, as the AVX-512 build does on 512 bits. */

/* Activation bytes a[4c..4c+3], broadcast to every row's lane. */
static inline __m256i quad(const int8_t *a, int c) {
    int32_t q;
    memcpy(&q, a + 4 * c, 4);
    return _mm256_set1_epi32(q);
}

/* One group's integer dot product for each of the 8 rows, zero point off (Q6_K: sub-scaled). */
static inline __attribute__((always_inline)) __m256i group_dot(
        const int TYPE, const __m256i *wq, const int8_t *a, int32_t s0, int32_t s1, __m256i sclo, __m256i schi) {
#ifdef QUANT_AVXVNNI /* 256-bit vpdpbusd: no int16 step, Q8_0's codes stay unsigned (+128) */
    __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
    for (int c = 0; c < 4; c++) {
        lo = _mm256_dpbusd_avx_epi32(lo, wq[c], quad(a, c));
        hi = _mm256_dpbusd_avx_epi32(hi, wq[c + 4], quad(a, c + 4));
    }
    if (TYPE == Q6_K)
        return _mm256_add_epi32(_mm256_mullo_epi32(_mm256_sub_epi32(lo, _mm256_set1_epi32(32 * s0)), sclo),
                                _mm256_mullo_epi32(_mm256_sub_epi32(hi, _mm256_set1_epi32(32 * s1)), schi));
    return _mm256_sub_epi32(_mm256_add_epi32(lo, hi), _mm256_set1_epi32(zero_point(TYPE) * (s0 + s1)));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i p[8];
    for (int c = 0; c < 8; c++) /* Q8_0: |w| times a with w's sign (the codes are signed here) */
        p[c] = TYPE == Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(wq[c], wq[c]), _mm256_sign_epi8(quad(a, c), wq[c]))
                            : _mm256_maddubs_epi16(wq[c], quad(a, c));
    if (TYPE == Q8_0) {
        __m256i dot = _mm256_madd_epi16(p[0], ones);
        for (int c = 1; c < 8; c++) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(p[c], ones));
        return dot;
    }
    if (TYPE == Q6_K) { /* pairs in int16; lo (values 0-15) and hi apart: their sub-scales */
        __m256i lo = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[0], p[1]), ones),
                                      _mm256_madd_epi16(_mm256_add_epi16(p[2], p[3]), ones));
        __m256i hi = _mm256_add_epi32(_mm256_madd_epi16(_mm256_add_epi16(p[4], p[5]), ones),
                                      _mm256_madd_epi16(_mm256_add_epi16(p[6], p[7]), ones));
        lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(32 * s0));
        hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(32 * s1));
        return _mm256_add_epi32(_mm256_mullo_epi32(lo, sclo), _mm256_mullo_epi32(hi, schi));
    }
    const __m256i lo = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
    const __m256i hi = _mm256_add_epi16(_mm256_add_epi16(p[4], p[5]), _mm256_add_epi16(p[6], p[7]));
    const __m256i dot = high_bits(TYPE) /* 5-bit: 4 maddubs per int16 sum at most */
                      ? _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
                      : _mm256_madd_epi16(_mm256_add_epi16(lo, hi), ones);
    return _mm256_sub_epi32(dot, _mm256_set1_epi32(zero_point(TYPE) * (s0 + s1)));
#endif
}

/* Halves H0 .. H0 + HALVES - 1 of tile t (rows 8H..8H+7 each) against activation rows [m0, m0 + MT):
   acc[h * MT + r]. HALVES = 2 (a one-row GEMV) takes both halves of each group together, so each
   64-byte line of codes is used whole while it is in L1, and the loads stream in order. */
static inline __attribute__((always_inline)) void half_tile_rows(
        const int TYPE, const int MT, const int HALVES, const qweight_t *w, int64_t t, int H0, int64_t m0,
        const int8_t *qa, const float *da, const int32_t *sa, const float *ms, __m256 *acc) {
    const int64_t K = w->K, G = K / QK, S = K / 256;
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < HALVES * MT; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; g++) {
        const int64_t tg = t * G + g;
        if (PREFETCH && H0 == 0) { /* the next tile's codes into L2 while this one computes (see quant_gemm.c) */
            const char *next = (const char *)(w->qs + (tg + G) * (TYPE == Q8_0 ? 512 : 256));
            for (int c = 0; c < (TYPE == Q8_0 ? 8 : 4); c++) PREFETCH_READ(next + c * 64);
        }
        for (int hh = 0; hh < HALVES; hh++) {
            const int H = H0 + hh;
            __m256i wq[8]; /* wq[c]: codes of values 4c..4c+3 of the 8 rows (activation bytes a + 4c) */
            if (TYPE == Q8_0) {
                const uint8_t *p = w->qs + tg * 512 + 32 * H;
                for (int c = 0; c < 8; c++) wq[c] = _mm256_loadu_si256((const __m256i *)(p + c * 64));
#ifndef QUANT_AVXVNNI
                for (int c = 0; c < 8; c++) wq[c] = _mm256_xor_si256(wq[c], _mm256_set1_epi8((char)0x80)); /* signed */
#endif
            } else {
                const uint8_t *p = w->qs + tg * 256 + 32 * H;
                for (int c = 0; c < 4; c++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(p + c * 64));
                    wq[c] = _mm256_and_si256(x, nib);
                    wq[c + 4] = _mm256_and_si256(_mm256_srli_epi16(x, 4), nib);
                }
            }
            if (high_bits(TYPE) == 1) { /* bit c of each byte: bit 4 of quad c's value */
                const __m256i h = _mm256_loadu_si256((const __m256i *)(w->qh + tg * 64 + 32 * H));
                for (int c = 0; c < 8; c++)
                    wq[c] = _mm256_or_si256(wq[c], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, c), 4),
                                                                    _mm256_set1_epi8(0x10)));
            } else if (high_bits(TYPE) == 2) { /* bits 2c, 2c+1: bits 4, 5 (first vector: quads 0-3) */
                const __m256i h0 = _mm256_loadu_si256((const __m256i *)(w->qh + tg * 128 + 32 * H));
                const __m256i h1 = _mm256_loadu_si256((const __m256i *)(w->qh + tg * 128 + 64 + 32 * H));
                for (int c = 0; c < 4; c++) {
                    const __m256i top = _mm256_set1_epi8(0x30);
                    wq[c] = _mm256_or_si256(wq[c], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h0, 2 * c), 4), top));
                    wq[c + 4] = _mm256_or_si256(wq[c + 4], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h1, 2 * c), 4), top));
                }
            }
            /* this half's 8 scales (and mins) for the group */
            __m256 dvec, mvec = _mm256_setzero_ps();
            __m256i sclo = _mm256_setzero_si256(), schi = _mm256_setzero_si256();
            if (!k_quant(TYPE)) {
                dvec = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->scales + tg * TILE + 8 * H)));
                if (has_group_mins(TYPE)) mvec = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mins + tg * TILE + 8 * H)));
            } else {
                const int64_t ts = t * S + g / 8;
                dvec = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->scales + ts * TILE + 8 * H)));
                if (TYPE == Q6_K) {
                    sclo = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w->sub_scales + tg * 2 * TILE + 8 * H)));
                    schi = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w->sub_scales + tg * 2 * TILE + TILE + 8 * H)));
                } else {
                    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w->sub_scales + tg * TILE + 8 * H))));
                    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w->sub_mins + tg * TILE + 8 * H))));
                    mvec = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w->mins + ts * TILE + 8 * H))), mn);
                    dvec = _mm256_mul_ps(dvec, sc);
                }
            }
            for (int r = 0; r < MT; r++) {
                const int64_t m = m0 + r;
                const int32_t s0 = sa[(m * G + g) * 2], s1 = sa[(m * G + g) * 2 + 1];
                const float dm = da[m * G + g];
                const __m256i dot = group_dot(TYPE, wq, qa + m * K + g * QK, s0, s1, sclo, schi);
                acc[hh * MT + r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dvec, _mm256_set1_ps(dm)), acc[hh * MT + r]);
                if (has_group_mins(TYPE) || TYPE == Q4_K || TYPE == Q5_K)
                    acc[hh * MT + r] = _mm256_fmadd_ps(mvec, _mm256_set1_ps(ms[m * G + g]), acc[hh * MT + r]);
            }
        }
    }
}

static inline __attribute__((always_inline)) void store_rows(
        const int MT, const __m256 *acc, int64_t m0, int64_t n, int64_t valid, const float *bias, float *out,
        int64_t ldo, int stream) {
    static const int32_t lanes[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    const __m256i mask = _mm256_loadu_si256((const __m256i *)(lanes + 8 - valid)); /* first `valid` lanes */
    const __m256 b = bias ? _mm256_maskload_ps(bias + n, mask) : _mm256_setzero_ps();
    if (valid == 8 && stream) /* see qgemm; 32-byte aligned there */
        for (int r = 0; r < MT; r++) _mm256_stream_ps(out + (m0 + r) * ldo + n, _mm256_add_ps(acc[r], b));
    else if (valid == 8)
        for (int r = 0; r < MT; r++) _mm256_storeu_ps(out + (m0 + r) * ldo + n, _mm256_add_ps(acc[r], b));
    else
        for (int r = 0; r < MT; r++) _mm256_maskstore_ps(out + (m0 + r) * ldo + n, mask, _mm256_add_ps(acc[r], b));
}

/* Tile t against rows [m0, m1): the row halves that hold output rows, MT_MAX rows at a time (one
   row, a decode step's GEMV, is the MT = 1 case). Same signature as the other builds'. */
static void tile_all_rows(int type, const qweight_t *w, int64_t t, int64_t m0, int64_t m1, const int8_t *qa,
                          const float *da, const int32_t *sa, const float *ms, const float *bias, float *out,
                          int64_t ldo, int stream) {
    const int64_t n0 = t * TILE;
    if (m1 - m0 == 1 && n0 + 16 <= w->N) { /* a one-row GEMV over a whole tile: both halves at once */
        int64_t m = m0;
#define GEMV(T_, MT_) do { __m256 acc[2]; half_tile_rows(T_, 1, 2, w, t, 0, m, qa, da, sa, ms, acc);      \
                           store_rows(1, acc, m, n0, 8, bias, out, ldo, stream);                              \
                           store_rows(1, acc + 1, m, n0 + 8, 8, bias, out, ldo, stream); } while (0)
        BY_TYPE(GEMV, 1)
#undef GEMV
    } else {
        for (int H = 0; H < 2 && n0 + 8 * H < w->N; H++) {
            const int64_t n = n0 + 8 * H, valid = w->N - n < 8 ? w->N - n : 8;
#define HALF_ROWS(T_, MT_) do { __m256 acc[MT_]; half_tile_rows(T_, MT_, 1, w, t, H, m, qa, da, sa, ms, acc); \
                                store_rows(MT_, acc, m, n, valid, bias, out, ldo, stream); } while (0)
            int64_t m = m0;
            ROW_BLOCKS(HALF_ROWS, (void)0)
#undef HALF_ROWS
        }
    }
    if (stream) _mm_sfence(); /* streaming stores are weakly ordered: visible before qgemm returns */
}
