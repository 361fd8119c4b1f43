/* The AVX-512 build's tile kernel of quant_gemm.c (included there under QUANT_AVX512: AVX512-F/BW/VL,
   VNNI, F16C): one 512-bit vector holds the 4 codes of each of a tile's 16 rows, vpdpbusd multiplies
   them by 4 activation codes broadcast to every lane. quant_gemm.c's header comment has the layout
   and the sums; quant_gemm_avx2.h is the same on 256 bits. */
/* A tile-group's codes as 8 vectors of 4 codes x 16 rows (wlo: values 0-15, whi: 16-31; unsigned,
   the 5th and 6th bits or-ed in; with HI16, a 4-bit format's whi are 16 times the values, see
   tile_rows), and its scales as 16 lanes: dvec (K-quants: times the group's
   sub-scale), mvec (the group's min, or the super-block's times the sub-min; else zero), and Q6_K's
   two sub-scales a half in sclo / schi. Shared by the VNNI tile below and quant_gemm_amx.h. */
static inline __attribute__((always_inline)) void group_codes(const int TYPE, const int HI16, const qweight_t *w,
                                                              int64_t tg, __m512i wlo[4], __m512i whi[4]) {
    const __m512i nib = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(0x01), two = _mm512_set1_epi8(0x03);
    if (TYPE == Q8_0) {
        const uint8_t *p = w->qs + tg * 512;
        for (int c = 0; c < 4; c++) {
            wlo[c] = _mm512_loadu_si512(p + c * 64);
            whi[c] = _mm512_loadu_si512(p + (c + 4) * 64);
        }
    } else {
        const uint8_t *p = w->qs + tg * 256;
        for (int c = 0; c < 4; c++) {
            const __m512i x = _mm512_loadu_si512(p + c * 64);
            wlo[c] = _mm512_and_si512(x, nib);
            whi[c] = HI16 ? _mm512_and_si512(x, _mm512_set1_epi8((char)0xF0)) /* see tile_rows */
                          : _mm512_and_si512(_mm512_srli_epi32(x, 4), nib);
        }
    }
    if (high_bits(TYPE) == 1) {
        const __m512i h = _mm512_loadu_si512(w->qh + tg * 64);
        for (int c = 0; c < 4; c++) {
            wlo[c] = _mm512_or_si512(wlo[c], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, c), one), 4));
            whi[c] = _mm512_or_si512(whi[c], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h, c + 4), one), 4));
        }
    } else if (high_bits(TYPE) == 2) {
        const __m512i h0 = _mm512_loadu_si512(w->qh + tg * 128), h1 = _mm512_loadu_si512(w->qh + tg * 128 + 64);
        for (int c = 0; c < 4; c++) {
            wlo[c] = _mm512_or_si512(wlo[c], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h0, 2 * c), two), 4));
            whi[c] = _mm512_or_si512(whi[c], _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(h1, 2 * c), two), 4));
        }
    }
}

/* A K-quant super-block's two fp16 scale vectors (d, min), converted once for its 8 groups. */
static inline __attribute__((always_inline)) void block_scales(const int TYPE, const qweight_t *w, int64_t t,
                                                               int64_t g, __m512 *dsb, __m512 *msb) {
    const int64_t ts = t * (w->K / 256) + g / 8;
    *dsb = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + ts * TILE)));
    *msb = TYPE == Q6_K ? _mm512_setzero_ps() : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + ts * TILE)));
}

/* group_scales with the K-quants' super-block scales given (block_scales'): the tile kernel's loop
   converts them once a super-block. */
static inline __attribute__((always_inline)) void group_scales_in(const int TYPE, const qweight_t *w, int64_t t,
                                                                  int64_t g, __m512 dsb, __m512 msb, __m512 *dvec,
                                                                  __m512 *mvec, __m512i *sclo, __m512i *schi) {
    const int64_t G = w->K / QK, tg = t * G + g;
    *mvec = _mm512_setzero_ps();
    *sclo = *schi = _mm512_setzero_si512();
    if (!k_quant(TYPE)) {
        *dvec = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->scales + tg * TILE)));
        if (has_group_mins(TYPE)) *mvec = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w->mins + tg * TILE)));
    } else if (TYPE == Q6_K) {
        *dvec = dsb;
        *sclo = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w->sub_scales + tg * 2 * TILE)));
        *schi = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w->sub_scales + tg * 2 * TILE + TILE)));
    } else {
        const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->sub_scales + tg * TILE))));
        const __m512 mn = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w->sub_mins + tg * TILE))));
        *mvec = _mm512_mul_ps(msb, mn);
        *dvec = _mm512_mul_ps(dsb, sc);
    }
}

/* One group's scales on their own, its super-block's converted here (the AMX kernel's scaling). */
static inline __attribute__((always_inline)) void group_scales(const int TYPE, const qweight_t *w, int64_t t,
                                                               int64_t g, __m512 *dvec, __m512 *mvec,
                                                               __m512i *sclo, __m512i *schi) {
    __m512 dsb = _mm512_setzero_ps(), msb = dsb;
    if (k_quant(TYPE)) block_scales(TYPE, w, t, g, &dsb, &msb);
    group_scales_in(TYPE, w, t, g, dsb, msb, dvec, mvec, sclo, schi);
}

/* A row's share of a group, added to its accumulator: the int32 dot products (zero point and, for
   Q6_K, the sub-scales applied) scaled by the weights' and the row's scales, then the mins' term
   (dms: the row's scale times its codes' sum, dm * (float)s). quant_gemm_amx.h scales its tiles'
   products with it too, so both kernels' outputs are the same bits. */
static inline __attribute__((always_inline)) __m512 group_row_sum(const int TYPE, __m512 acc, __m512i dot,
                                                                  __m512 dvec, __m512 mvec, float dm, float dms) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dvec, _mm512_set1_ps(dm)), acc);
    if (has_group_mins(TYPE) || TYPE == Q4_K || TYPE == Q5_K)
        acc = _mm512_fmadd_ps(mvec, _mm512_set1_ps(dms), acc);
    return acc;
}

/* A tile-group's codes in tile B's layout (quant_gemm_amx.h): group_codes' 8 vectors, values 0-15
   then 16-31, into 512 bytes at `dst` (64-byte aligned). */
static inline __attribute__((always_inline)) void store_group_codes(const int TYPE, const qweight_t *w, int64_t tg,
                                                                    uint8_t *dst) {
    __m512i wlo[4], whi[4];
    group_codes(TYPE, 0, w, tg, wlo, whi);
    for (int c = 0; c < 4; c++) {
        _mm512_store_si512(dst + c * 64, wlo[c]);
        _mm512_store_si512(dst + (c + 4) * 64, whi[c]);
    }
}

/* The tile's 16 outputs of each row [m0, m0 + MT) (+ bias), stored (see qgemm for `stream`). */
static inline __attribute__((always_inline)) void store_rows(const int MT, const __m512 *acc, int64_t t,
                                                             int64_t m0, int64_t N, const float *bias,
                                                             float *out, int64_t ldo, int stream) {
    const int64_t n0 = t * TILE, valid = N - n0 < TILE ? N - n0 : TILE;
    const __mmask16 mask = (__mmask16)((1u << valid) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    if (valid == TILE && stream) /* see qgemm */
        for (int r = 0; r < MT; r++) _mm512_stream_ps(out + (m0 + r) * ldo + n0, _mm512_add_ps(acc[r], b));
    else if (valid == TILE) /* whole lines: plain stores (a masked one may read the line first) */
        for (int r = 0; r < MT; r++) _mm512_storeu_ps(out + (m0 + r) * ldo + n0, _mm512_add_ps(acc[r], b));
    else
        for (int r = 0; r < MT; r++) _mm512_mask_storeu_ps(out + (m0 + r) * ldo + n0, mask, _mm512_add_ps(acc[r], b));
}

/* One tile (16 output rows) against activation rows [m0, m0 + MT): TYPE and MT are constants
   where it is called, so each (type, MT) pair compiles to its own straight-line loop. */
static inline __attribute__((always_inline)) void tile_rows(
        const int TYPE, const int MT, const qweight_t *w, int64_t t, int64_t m0, const int8_t *qa,
        const float *da, const int32_t *sa, const float *ms, const float *bias, float *out, int64_t ldo,
        int stream, int64_t pass, int64_t passes) {
    const int64_t K = w->K, G = K / QK;
    __m512 acc[MT_WIDE > MT_MAX ? MT_WIDE : MT_MAX]; /* a fixed size (MT <= it), not a VLA: in registers */
    for (int r = 0; r < MT; r++) acc[r] = _mm512_setzero_ps();
    __m512 dsb = _mm512_setzero_ps(), msb = dsb; /* K-quants: the super-block's scales */
    /* HI16: a 4-bit format's high codes multiplied where they lie, 16 times their value (an and,
       not a shift and an and, per 64 bytes), the row's sum of them shifted back once: exact (a
       multiple of 16, at most 240 x 127 x 32 in int32), so the same sums: 4 shifts a group fewer, one
       a row more, so for 1-2 rows (a decode step's GEMV, whose compute the weights' stream from
       memory waits on). */
    const int HI16 = MT <= 2 && high_bits(TYPE) == 0 && TYPE != Q8_0;
    int64_t g_fetch = pass; /* this pass's next group to prefetch for: pass, pass + passes, ... (no division per group) */
    for (int64_t g = 0; g < G; g++) {
        const int64_t tg = t * G + g;
        __m512i wlo[4], whi[4];
        if (PREFETCH && g == g_fetch) { /* see PREFETCH */
            g_fetch += passes;
            const char *next = (const char *)(w->qs + (tg + G) * qs_bytes(TYPE));
            for (int c = 0; c < qs_bytes(TYPE) / 64; c++) PREFETCH_READ(next + c * 64);
        }
        if (k_quant(TYPE) && (g & 7) == 0) block_scales(TYPE, w, t, g, &dsb, &msb);
        group_codes(TYPE, HI16, w, tg, wlo, whi);
        __m512 dvec, mvec;
        __m512i sclo, schi;
        group_scales_in(TYPE, w, t, g, dsb, msb, &dvec, &mvec, &sclo, &schi);
        for (int r = 0; r < MT; r++) {
            const int64_t m = m0 + r;
            const int8_t *a = qa + m * K + g * QK;
            const int32_t s0 = sa[(m * G + g) * 2], s1 = sa[(m * G + g) * 2 + 1];
            /* the zero point's share (-zero x the codes' sum) starts the sum: exact in int32, the
               same sum as subtracting it after, one instruction fewer a row */
            __m512i lo = TYPE != Q6_K && zero_point(TYPE) ? _mm512_set1_epi32(-zero_point(TYPE) * (s0 + s1))
                                                          : _mm512_setzero_si512();
            __m512i hi = _mm512_setzero_si512();
            for (int c = 0; c < 4; c++) {
                int32_t alo, ahi;
                memcpy(&alo, a + 4 * c, 4);
                memcpy(&ahi, a + 16 + 4 * c, 4);
                lo = _mm512_dpbusd_epi32(lo, wlo[c], _mm512_set1_epi32(alo));
                hi = _mm512_dpbusd_epi32(hi, whi[c], _mm512_set1_epi32(ahi));
            }
            __m512i dot;
            if (TYPE == Q6_K) {
                lo = _mm512_sub_epi32(lo, _mm512_set1_epi32(32 * s0));
                hi = _mm512_sub_epi32(hi, _mm512_set1_epi32(32 * s1));
                dot = _mm512_add_epi32(_mm512_mullo_epi32(lo, sclo), _mm512_mullo_epi32(hi, schi));
            } else {
                dot = _mm512_add_epi32(lo, HI16 ? _mm512_srai_epi32(hi, 4) : hi);
            }
            acc[r] = group_row_sum(TYPE, acc[r], dot, dvec, mvec, da[m * G + g], ms[m * G + g]);
        }
    }
    store_rows(MT, acc, t, m0, w->N, bias, out, ldo, stream);
}

static void tile_all_rows(int type, const qweight_t *w, int64_t t, int64_t m0, int64_t m1, const int8_t *qa,
                          const float *da, const int32_t *sa, const float *ms, const float *bias, float *out,
                          int64_t ldo, int stream) {
#define TILE_ROWS(T_, MT_) tile_rows(T_, MT_, w, t, m, qa, da, sa, ms, bias, out, ldo, stream, pass, passes)
    const int64_t passes = row_blocks(type, m1 - m0);
    int64_t m = m0, pass = 0;
    ROW_BLOCKS(TILE_ROWS, pass++)
#undef TILE_ROWS
}
