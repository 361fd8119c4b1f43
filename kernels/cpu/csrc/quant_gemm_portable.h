/* The portable build's tile kernel of quant_gemm.c (included there when no intrinsics build is
   asked for): the same sums over the same layout in plain C (auto-vectorized by the compiler for
   whatever the build targets). Per tile and group the 16 x 32 codes are decoded once into int16 (straight loops over
   the tile layout), then every activation row of the block is dotted with them. */
static void decode_tile_group(const qweight_t *w, int64_t tg, int16_t codes[QK][TILE]) {
    const int type = (int)w->type;
    if (type == Q8_0) {
        const uint8_t *q = w->qs + tg * 512;
        for (int c = 0; c < 8; c++)
            for (int n = 0; n < TILE; n++)
                for (int b = 0; b < 4; b++) codes[4 * c + b][n] = (int16_t)q[(c * TILE + n) * 4 + b];
        return;
    }
    const uint8_t *q = w->qs + tg * 256;
    for (int c = 0; c < 4; c++)
        for (int n = 0; n < TILE; n++)
            for (int b = 0; b < 4; b++) {
                const uint8_t byte = q[(c * TILE + n) * 4 + b];
                codes[4 * c + b][n] = byte & 15;
                codes[16 + 4 * c + b][n] = byte >> 4;
            }
    const int bits = high_bits(type);
    if (bits == 1) {
        const uint8_t *h = w->qh + tg * 64;
        for (int c = 0; c < 4; c++)
            for (int n = 0; n < TILE; n++)
                for (int b = 0; b < 4; b++) {
                    codes[4 * c + b][n] |= ((h[n * 4 + b] >> c) & 1) << 4;
                    codes[16 + 4 * c + b][n] |= ((h[n * 4 + b] >> (c + 4)) & 1) << 4;
                }
    } else if (bits == 2) {
        const uint8_t *h0 = w->qh + tg * 128, *h1 = h0 + 64;
        for (int c = 0; c < 4; c++)
            for (int n = 0; n < TILE; n++)
                for (int b = 0; b < 4; b++) {
                    codes[4 * c + b][n] |= ((h0[n * 4 + b] >> (2 * c)) & 3) << 4;
                    codes[16 + 4 * c + b][n] |= ((h1[n * 4 + b] >> (2 * c)) & 3) << 4;
                }
    }
}

static void tile_all_rows(int type, const qweight_t *w, int64_t t, int64_t m0, int64_t m1, const int8_t *qa,
                          const float *da, const int32_t *sa, const float *ms, const float *bias, float *out,
                          int64_t ldo, int stream) {
    (void)stream;
    const int64_t K = w->K, G = K / QK, S = K / 256, N = w->N, n0 = t * TILE;
    const int64_t valid = N - n0 < TILE ? N - n0 : TILE, rows = m1 - m0;
    int16_t codes[QK][TILE];
    float d[TILE], mn[TILE], acc[M_CHUNK][TILE];
    int32_t sc_lo[TILE], sc_hi[TILE];
    memset(acc, 0, sizeof(float) * TILE * (size_t)rows);
    for (int64_t g = 0; g < G; g++) {
        const int64_t tg = t * G + g, ts = t * S + g / 8;
        decode_tile_group(w, tg, codes);
        for (int n = 0; n < TILE; n++) { /* each row's scale and min for this group */
            mn[n] = 0.0f;
            if (type == Q6_K) {
                d[n] = half_to_float(w->scales[ts * TILE + n]);
                sc_lo[n] = (int8_t)w->sub_scales[tg * 2 * TILE + n];
                sc_hi[n] = (int8_t)w->sub_scales[tg * 2 * TILE + TILE + n];
            } else if (k_quant(type)) {
                d[n] = half_to_float(w->scales[ts * TILE + n]) * (float)w->sub_scales[tg * TILE + n];
                mn[n] = half_to_float(w->mins[ts * TILE + n]) * (float)w->sub_mins[tg * TILE + n];
            } else {
                d[n] = half_to_float(w->scales[tg * TILE + n]);
                if (has_group_mins(type)) mn[n] = half_to_float(w->mins[tg * TILE + n]);
            }
        }
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *a = qa + m * K + g * QK;
            const int32_t s0 = sa[(m * G + g) * 2], s1 = sa[(m * G + g) * 2 + 1];
            const float dm = da[m * G + g], msum = ms[m * G + g];
            float *o = acc[m - m0];
            int32_t lo[TILE] = {0}, hi[TILE] = {0};
            for (int v = 0; v < 16; v++) /* over the 16 rows: one vector lane each */
                for (int n = 0; n < TILE; n++) lo[n] += codes[v][n] * a[v];
            for (int v = 16; v < QK; v++)
                for (int n = 0; n < TILE; n++) hi[n] += codes[v][n] * a[v];
            for (int n = 0; n < TILE; n++) {
                const int32_t dot = type == Q6_K ? (lo[n] - 32 * s0) * sc_lo[n] + (hi[n] - 32 * s1) * sc_hi[n]
                                                 : lo[n] + hi[n] - zero_point(type) * (s0 + s1);
                o[n] += (float)dot * (d[n] * dm) + mn[n] * msum;
            }
        }
    }
    for (int64_t m = m0; m < m1; m++)
        for (int n = 0; n < valid; n++) out[m * ldo + n0 + n] = acc[m - m0][n] + (bias ? bias[n0 + n] : 0.0f);
}
