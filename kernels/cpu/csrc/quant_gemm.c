/* GEMM on packed quantized weights (docs/quantization.md), CPU: out[M, N] = x[M, K] @ W[N, K]^T.

   The weights stay packed: each call reads them once per block of activation rows, 4 or 5 bits
   a value plus their scales, and never writes a dequantized copy. As llama.cpp does, the
   activations are quantized per row in groups of 32 (int8 codes, a float scale per group, the
   codes' sum per 16), so each group's product is an integer dot product, scaled once:
     sum_k w[n,k] x[m,k] ~= sum_g da[m,g] * ( d[n,g] * (dot(q[n,g], qa[m,g]) - zero * sum(qa[m,g]))
                                            + min[n,g] * sum(qa[m,g]) )
   (K-quants: d and min are the super-block's times the group's 6-bit sub-scale and sub-min; Q6_K
   has a sub-scale per 16 values, applied in integers.) kernels/quant_reference.py `qmatmul` is the
   same computation in torch, the oracle of tests/kernels/test_cpu_quant.py.

   The weights are re-laid at load (kernels/cpu_quant.py `tile_layout`) in tiles of 16 output rows
   so that one 64-byte vector holds 4 consecutive codes of each of the 16 rows: VNNI's vpdpbusd
   multiplies it with 4 activation codes broadcast to every lane and accumulates one int32 per row,
   with no horizontal sums. Per tile and group of 32:
     qs      4-bit: 4 vectors; byte (c, n, b): low nibble = value 4c+b of row n, high = 16+4c+b
             8-bit (Q8_0): 8 vectors; byte (c, n, b) = value 4c+b, stored + 128 (unsigned)
     qh      Q5: 1 vector; lane n, byte b, bit c = bit 4 of value 4c+b (c < 4) or 16+4(c-4)+b
             Q6_K: 2 vectors (lo, hi quads); byte b bits 2j, 2j+1 = bits 4, 5 of that value
     scales, mins (fp16) and sub-scales / sub-mins (bytes) as 16 lanes per group or super-block.
   Unsigned weight codes times signed activation codes is exactly vpdpbusd's operand order.

   Builds of this one file (kernels/cpu/quant.py picks), each with its own tile kernel:
   QUANT_AVX512 (AVX512-F/BW/VNNI, F16C: quant_gemm_avx512.h), with QUANT_AMX also AMX's int8 tiles
   for the row counts where they pay (quant_gemm_amx.h amx_takes), QUANT_AVX2 (AVX2, FMA, F16C:
   quant_gemm_avx2.h's maddubs kernel) and the portable one (quant_gemm_portable.h), plain C over
   the same layout, for any other CPU. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefetch.h"

#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
#include <immintrin.h>
#endif

enum { Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K };
#define TILE 16
#define QK 32
#define M_CHUNK 256 /* activation rows per pass over the weights: their codes stay in L2 */

static inline int high_bits(int type) { return type == Q6_K ? 2 : (type == Q5_0 || type == Q5_1 || type == Q5_K); }
static inline int zero_point(int type) { return type == Q8_0 ? 128 : type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0; }
static inline int has_group_mins(int type) { return type == Q4_1 || type == Q5_1; }
static inline int k_quant(int type) { return type >= Q4_K; }
static inline int64_t qs_bytes(int type) { return type == Q8_0 ? 512 : 256; } /* per tile and group */

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) bits = sign | 0x7F800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else { /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* The weights of one packed matrix, tiled (see above). Unused arrays are NULL. */
typedef struct {
    const uint8_t *qs, *qh;
    const uint16_t *scales, *mins; /* fp16 */
    const uint8_t *sub_scales, *sub_mins;
    int64_t type, N, K;
} qweight_t;

/* ---- the code of value v (0..31) of lane n in a tile-group, and its float weight ---- */
static inline int code_of(const qweight_t *w, int64_t t, int64_t g, int64_t n, int v) {
    const int64_t G = w->K / QK, tg = t * G + g;
    const int hi = v >= 16, c = (v & 15) >> 2, b = v & 3;
    if (w->type == Q8_0) return (int)w->qs[tg * 512 + ((hi * 4 + c) * TILE + n) * 4 + b] - 128;
    const uint8_t byte = w->qs[tg * 256 + (c * TILE + n) * 4 + b];
    int q = hi ? byte >> 4 : byte & 15;
    const int bits = high_bits(w->type);
    if (bits == 1) q |= ((w->qh[tg * 64 + n * 4 + b] >> (hi * 4 + c)) & 1) << 4;
    if (bits == 2) q |= ((w->qh[(tg * 2 + hi) * 64 + n * 4 + b] >> (2 * c)) & 3) << 4;
    return q;
}

/* Rows `ids` of the matrix, dequantized with the layout's formulas (the quantized embedding). */
void dequant_rows(const qweight_t *w, const int64_t *ids, int64_t R, float *out) {
    const int64_t G = w->K / QK, S = w->K / 256;
#pragma omp parallel for if (R * w->K >= 262144) schedule(static)
    for (int64_t r = 0; r < R; r++) {
        const int64_t t = ids[r] / TILE, n = ids[r] % TILE;
        for (int64_t g = 0; g < G; g++) {
            float *o = out + r * w->K + g * QK;
            const int64_t s = g / 8;
            for (int v = 0; v < QK; v++) {
                const float q = (float)code_of(w, t, g, n, v);
                switch (w->type) {
                case Q8_0: /* code_of gives Q8_0's signed code */
                    o[v] = half_to_float(w->scales[(t * G + g) * TILE + n]) * q;
                    break;
                case Q4_0: case Q5_0:
                    o[v] = half_to_float(w->scales[(t * G + g) * TILE + n]) * (q - (float)zero_point(w->type));
                    break;
                case Q4_1: case Q5_1:
                    o[v] = half_to_float(w->scales[(t * G + g) * TILE + n]) * q + half_to_float(w->mins[(t * G + g) * TILE + n]);
                    break;
                case Q4_K: case Q5_K:
                    o[v] = (half_to_float(w->scales[(t * S + s) * TILE + n]) * (float)w->sub_scales[(t * G + g) * TILE + n]) * q
                           + half_to_float(w->mins[(t * S + s) * TILE + n]) * (float)w->sub_mins[(t * G + g) * TILE + n];
                    break;
                default: /* Q6_K */
                    o[v] = (half_to_float(w->scales[(t * S + s) * TILE + n])
                            * (float)(int8_t)w->sub_scales[((t * G + g) * 2 + (v >= 16)) * TILE + n]) * (q - 32.0f);
                }
            }
        }
    }
}

/* ---- activations: int8 codes per group of 32, the group's scale (da), the codes' sum per 16 (sa),
   and the scale times the group's sum (ms: the mins' factor, a float once here, not a scalar
   conversion and product per row, group and tile in the kernels) ---- */
static void quantize_rows(const float *x, int64_t M, int64_t K, int8_t *qa, float *da, int32_t *sa, float *ms) {
    const int64_t G = K / QK;
#pragma omp parallel for if (M * K >= 65536) schedule(static)
    for (int64_t m = 0; m < M; m++) {
        for (int64_t g = 0; g < G; g++) {
            const float *xg = x + m * K + g * QK;
            int8_t *q = qa + m * K + g * QK;
#ifdef QUANT_AVX512
            const __m512 x0 = _mm512_loadu_ps(xg), x1 = _mm512_loadu_ps(xg + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
            const float d = amax / 127.0f, id = amax > 0.0f ? 1.0f / d : 0.0f;
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, _mm512_set1_ps(id)));
            const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, _mm512_set1_ps(id)));
            _mm_storeu_si128((__m128i *)q, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtsepi32_epi8(q1));
            sa[(m * G + g) * 2] = _mm512_reduce_add_epi32(q0);
            sa[(m * G + g) * 2 + 1] = _mm512_reduce_add_epi32(q1);
#elif defined(QUANT_AVX2) /* the same arithmetic in four 8-lane vectors; packs + permute put the codes in order */
            const __m256 sign = _mm256_set1_ps(-0.0f);
            __m256 v[4], top = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xg + 8 * i);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 t4 = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t4 = _mm_max_ps(t4, _mm_movehl_ps(t4, t4));
            const float amax = _mm_cvtss_f32(_mm_max_ss(t4, _mm_movehdup_ps(t4)));
            const float d = amax / 127.0f, id = amax > 0.0f ? 1.0f / d : 0.0f;
            __m256i c[4];
            for (int i = 0; i < 4; i++) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(id)));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
            _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            const __m256i h0 = _mm256_add_epi32(c[0], c[1]), h1 = _mm256_add_epi32(c[2], c[3]);
            const __m256i both = _mm256_hadd_epi32(h0, h1); /* [h0 01, h0 23, h1 01, h1 23 | h0 45, ...] */
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
            s4 = _mm_hadd_epi32(s4, s4); /* [h0's sum, h1's sum, ...] */
            sa[(m * G + g) * 2] = _mm_cvtsi128_si32(s4);
            sa[(m * G + g) * 2 + 1] = _mm_extract_epi32(s4, 1);
#else
            float amax = 0.0f;
            for (int i = 0; i < QK; i++) amax = xg[i] > amax ? xg[i] : -xg[i] > amax ? -xg[i] : amax;
            const float d = amax / 127.0f, id = amax > 0.0f ? 1.0f / d : 0.0f;
            int32_t s0 = 0, s1 = 0;
            for (int i = 0; i < QK; i++) {
                const float v = __builtin_nearbyintf(xg[i] * id); /* round half to even, as cvtps */
                q[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : v);
                if (i < 16) s0 += q[i]; else s1 += q[i];
            }
            sa[(m * G + g) * 2] = s0;
            sa[(m * G + g) * 2 + 1] = s1;
#endif
            da[m * G + g] = d;
            ms[m * G + g] = d * (float)(sa[(m * G + g) * 2] + sa[(m * G + g) * 2 + 1]);
        }
    }
}

/* The intrinsics builds' loop over a tile's activation rows [m, m1): blocks of rows, each through
   ROWS(TYPE, MT) with the weight type and the block's rows as compile-time constants, so each pair
   compiles to its own straight-line loop; NEXT runs after each block of 4 or more. A block unpacks
   each group's codes and scales once for its MT rows. With AVX-512 (32 vector registers) the packed
   4- and 5-bit formats take blocks of 8 (MT_WIDE): ~6-13% faster from 16 rows on (Q4_K, Q4_1);
   Q8_0 (nothing to unpack) and Q6_K keep 4 (Q8_0 at 8 was ~17% slower). The rest: with blocks of 8,
   5-7 rows left over are one block (a decode step of 7 rows, or 6 decode rows beside a paced chunk
   of 9 tokens, unpacks each group twice, not three times: SmolLM2's layer in Q4_1 and Q4_K
   1.05-1.09x at 5-7 rows, 1.01-1.08x at 13-15, AMD EPYC, A/B interleaved); else a block of 4, then
   1-3 rows. `row_blocks` counts the blocks, the passes the prefetch spreads over. */
#define MT_MAX 4
#if defined(QUANT_AVX512)
#define MT_WIDE 8
#else
#define MT_WIDE 0
#endif
static inline int wide_rows(int type) { return MT_WIDE && type != Q8_0 && type != Q6_K; }
static inline int64_t row_blocks(int type, int64_t rows) {
    const int64_t wide = wide_rows(type) ? rows / 8 : 0, rest = rows - 8 * wide;
    return wide + (wide_rows(type) && rest > MT_MAX ? 1 : (rest + MT_MAX - 1) / MT_MAX);
}
#define BY_TYPE(ROWS, MT_)                                                      \
    switch (type) {                                                             \
    case Q8_0: ROWS(Q8_0, MT_); break; case Q4_0: ROWS(Q4_0, MT_); break;       \
    case Q4_1: ROWS(Q4_1, MT_); break; case Q5_0: ROWS(Q5_0, MT_); break;       \
    case Q5_1: ROWS(Q5_1, MT_); break; case Q4_K: ROWS(Q4_K, MT_); break;       \
    case Q5_K: ROWS(Q5_K, MT_); break; default: ROWS(Q6_K, MT_); break;         \
    }
#define BY_WIDE_TYPE(ROWS, MT_)                                                 \
    switch (type) {                                                             \
    case Q4_0: ROWS(Q4_0, MT_); break; case Q4_1: ROWS(Q4_1, MT_); break;       \
    case Q5_0: ROWS(Q5_0, MT_); break; case Q5_1: ROWS(Q5_1, MT_); break;       \
    case Q4_K: ROWS(Q4_K, MT_); break; default: ROWS(Q5_K, MT_); break;         \
    }
#if MT_WIDE
#define WIDE_BLOCKS(ROWS, NEXT)                                                 \
    if (wide_rows(type)) {                                                      \
        for (; m + MT_WIDE <= m1; m += MT_WIDE, NEXT) BY_WIDE_TYPE(ROWS, MT_WIDE) \
        switch (m1 - m) {                                                       \
        case 7: BY_WIDE_TYPE(ROWS, 7) m += 7, NEXT; break;                      \
        case 6: BY_WIDE_TYPE(ROWS, 6) m += 6, NEXT; break;                      \
        case 5: BY_WIDE_TYPE(ROWS, 5) m += 5, NEXT; break;                      \
        default: break;                                                         \
        }                                                                       \
    }
#else
#define WIDE_BLOCKS(ROWS, NEXT)
#endif
#define ROW_BLOCKS(ROWS, NEXT)                                                  \
    WIDE_BLOCKS(ROWS, NEXT)                                                     \
    for (; m + MT_MAX <= m1; m += MT_MAX, NEXT) BY_TYPE(ROWS, MT_MAX)           \
    switch (m1 - m) {                                                           \
    case 3: BY_TYPE(ROWS, 3) break;                                             \
    case 2: BY_TYPE(ROWS, 2) break;                                             \
    case 1: BY_TYPE(ROWS, 1) break;                                             \
    default: break;                                                             \
    }

/* While a tile computes, the next tile's codes are prefetched into L2, one group's lines per group
   and spread over the passes of rows (pass p takes the groups g with g % passes == p). Why: where
   the weights stream from memory (a MoE layer's experts, a large lm_head) the hardware prefetcher
   stops at every 4 KB page and runs only while the first pass misses, so memory sat idle through
   the later passes (the AVX2 build prefetches the same lines in its first row half). Measured
   (docs/performance.md, "Mixture of experts on the CPU"): Q8_0 experts at ~16 rows each 23%
   faster; the AVX2 build's batch-1 SmolLM2 engine step ~15% faster. Past the last tile the
   addresses run beyond the weights: a prefetch never faults. -DPREFETCH=0 turns it off, for
   measuring. */
#ifndef PREFETCH
#define PREFETCH 1
#endif
#if defined(QUANT_AVX512)
#include "quant_gemm_avx512.h"
#elif defined(QUANT_AVX2)
#include "quant_gemm_avx2.h"
#else
#include "quant_gemm_portable.h"
#endif
#ifdef QUANT_AMX
#include "quant_gemm_amx.h"
#endif

/* out[M, N] (row stride ldo) = x[M, K] @ W^T + bias.

   A large output (the lm_head's: 49152 floats a row, 3 x 2^16 bytes) is written with streaming
   stores: each tile writes 64 bytes into each of its rows, and rows that far apart all fall in one
   L1 and one L2 set, so ordinary stores miss on nearly every line (4x slower at 64 rows). */
void qgemm(const qweight_t *w, const float *x, int64_t M, const float *bias, float *out, int64_t ldo) {
    const int64_t K = w->K, G = K / QK, T = (w->N + TILE - 1) / TILE;
    const int stream = ((uintptr_t)out % 64 == 0) && (ldo % 16 == 0) && M * ldo * 4 > (4 << 20);
#ifdef QUANT_AMX
    if (amx_takes((int)w->type, M) && amx_ready()) {
        qgemm_amx(w, x, M, bias, out, ldo, stream);
        return;
    }
#endif
    int8_t *qa = malloc((size_t)(M * K));
    float *da = malloc(sizeof(float) * (size_t)(M * G));
    int32_t *sa = malloc(sizeof(int32_t) * (size_t)(M * G * 2));
    float *ms = malloc(sizeof(float) * (size_t)(M * G));
    quantize_rows(x, M, K, qa, da, sa, ms);
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) tile_all_rows((int)w->type, w, t, m0, m1, qa, da, sa, ms, bias, out, ldo, stream);
    }
#ifdef QUANT_AVX512
    if (stream) _mm_sfence(); /* streaming stores are weakly ordered: visible before returning */
#endif
    free(qa);
    free(da);
    free(sa);
    free(ms);
}

/* The experts of a mixture-of-experts layer in one call (kernels/cpu_quant.py `CpuQuantExperts`):
   rows offsets[e] .. offsets[e + 1] - 1 of x (sorted by expert) against ws[e], every expert of one
   type and shape. The activations are quantized once for every expert, and the (expert, block of
   rows, tile) items share one parallel loop, so a decode batch's ~16 rows an expert pay no call
   and no thread start per expert; each row's result is what qgemm gives it (the same tile code). */
void qgemm_experts(const qweight_t *ws, int64_t E, const float *x, const int64_t *offsets, float *out,
                   int64_t ldo) {
    const int64_t K = ws[0].K, G = K / QK, T = (ws[0].N + TILE - 1) / TILE, R = offsets[E];
    const int stream = ((uintptr_t)out % 64 == 0) && (ldo % 16 == 0) && R * ldo * 4 > (4 << 20);
    int64_t items = 0;
    for (int64_t e = 0; e < E; e++) items += (offsets[e + 1] - offsets[e] + M_CHUNK - 1) / M_CHUNK;
    int8_t *qa = malloc((size_t)(R * K) + 1);
    float *da = malloc(sizeof(float) * (size_t)(R * G + 1));
    int32_t *sa = malloc(sizeof(int32_t) * (size_t)(R * G * 2 + 1));
    float *ms = malloc(sizeof(float) * (size_t)(R * G + 1));
    int64_t *item_rows = malloc(sizeof(int64_t) * (size_t)(2 * items + 1)); /* (expert, first row) */
    quantize_rows(x, R, K, qa, da, sa, ms);
    items = 0;
    for (int64_t e = 0; e < E; e++)
        for (int64_t m0 = offsets[e]; m0 < offsets[e + 1]; m0 += M_CHUNK, items++) {
            item_rows[2 * items] = e;
            item_rows[2 * items + 1] = m0;
        }
#pragma omp parallel for schedule(static) if (R * K * ws[0].N >= (1 << 20))
    for (int64_t i = 0; i < items * T; i++) { /* tiles innermost: one expert's weights stream in order */
        const int64_t e = item_rows[2 * (i / T)], m0 = item_rows[2 * (i / T) + 1];
        const int64_t m1 = m0 + M_CHUNK < offsets[e + 1] ? m0 + M_CHUNK : offsets[e + 1];
        tile_all_rows((int)ws[e].type, &ws[e], i % T, m0, m1, qa, da, sa, ms, NULL, out, ldo, stream);
    }
#ifdef QUANT_AVX512
    if (stream) _mm_sfence();
#endif
    free(qa);
    free(da);
    free(sa);
    free(ms);
    free(item_rows);
}

/* The ISA check (kernels/cpu_quant.py runs it in a child process before trusting this build):
   one Q4_0 tile-group through the kernel, with activations whose codes are exact (max 127, so
   scale 1) and scales 1.0: the result is an integer sum the caller computes on its own. The AMX
   build runs it as a block of 16 rows (the first that row, the rest zeros: they add nothing) through
   its tiles, and returns NaN where the kernel refuses it the tile state. */
#ifdef QUANT_AMX
#define PROBE_ROWS AMX_ROWS
#else
#define PROBE_ROWS 1
#endif
float probe(void) {
    static uint8_t qs[256];
    static uint16_t scales[TILE];
    static float x[PROBE_ROWS * QK], out[PROBE_ROWS * TILE];
    for (int i = 0; i < 256; i++) qs[i] = (uint8_t)(i * 7);
    for (int n = 0; n < TILE; n++) scales[n] = 0x3C00; /* 1.0 */
    for (int i = 0; i < QK; i++) x[i] = (float)(((i % 5) - 2) * 50);
    x[QK - 1] = 127.0f;
#ifdef QUANT_AMX
    if (!amx_ready()) return __builtin_nanf("");
#endif
    qweight_t w = {qs, NULL, scales, NULL, NULL, NULL, Q4_0, TILE, QK};
    qgemm(&w, x, PROBE_ROWS, NULL, out, TILE);
    float s = 0.0f;
    for (int n = 0; n < PROBE_ROWS * TILE; n++) s += out[n];
    return s;
}
