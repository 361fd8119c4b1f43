/* GEMM on float weights, CPU: out[M, N] (row stride ldo) = x[M, K] @ W[N, K]^T (+ bias), with x
   float32 and W float32, bfloat16 or float16 (issue 47: the C layer stack for float checkpoints).

   W stays as torch holds it (row-major [N, K], no copy, no re-layout: a tied lm_head shares the
   embedding's table, and torch's own GEMMs can take the same tensor), so each output is a dot
   product along K: the K values of one weight row and of one activation row are both contiguous.
   A block of MR activation rows x NR weight rows keeps MR x NR vector accumulators; per step of K
   it loads NR weight vectors (converted to float32 where they are 16-bit) and MR activation
   vectors, and multiplies each pair. At the end each accumulator is summed across its lanes in a
   fixed tree, then the bias is added. So an output's arithmetic is the same whatever block it fell
   in and however many threads ran: the Python layers and the C layer stack get the same bits
   (tests/test_native_decode.py), one row or many.

   Builds (kernels/cpu/float_gemm.py picks one at run time, as quant.py picks quant_gemm's), told
   apart by the compiler's own macros:
     __AVX512BF16__  bfloat16 weights by vdpbf16ps: the activations rounded to bfloat16 once per call
                     (round to nearest even, as torch's .to(bfloat16) and oneDNN's bf16 GEMM do),
                     32 products a step into float32 lanes; float32 and float16 weights as below
     __AVX512F__     16 lanes: float32 loads, float16 by vcvtph2ps (F16C), bfloat16 by a 16-bit shift
     __AVX2__        the same on 8 lanes (FMA, F16C)
     neither         plain C on 8-float structs the compiler vectorizes for its baseline
   K must be a multiple of 32 (the wrapper checks; every model's widths are). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "prefetch.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F32, BF16, F16 };
#define M_CHUNK 64 /* activation rows per pass over the weights: they stay in L2 */
#define N_BLOCK 16 /* weight rows per work item of the parallel loop */

/* One float matrix as torch holds it. */
typedef struct {
    const void *w; /* [N, K] row-major, float32 / bfloat16 / float16 */
    int64_t type, N, K;
} fweight_t;

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t bits;
    if (exp == 0x1F) bits = sign | 0x7F800000 | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ---- the vector of each build: VEC, LANES, and its five operations ---- */
#if defined(__AVX512F__)
typedef __m512 VEC;
#define LANES 16
#define MR_MAX 4
#define NR_MAX 4
#define VZERO() _mm512_setzero_ps()
#define VLOADX(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline VEC vload_w(int type, const void *w, int64_t i) {
    if (type == F32) return _mm512_loadu_ps((const float *)w + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    if (type == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline float vhsum(VEC v) { /* halves added in a fixed order */
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#elif defined(__AVX2__)
typedef __m256 VEC;
#define LANES 8
#define MR_MAX 4
#define NR_MAX 2
#define VZERO() _mm256_setzero_ps()
#define VLOADX(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline VEC vload_w(int type, const void *w, int64_t i) {
    if (type == F32) return _mm256_loadu_ps((const float *)w + i);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    if (type == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float vhsum(VEC v) {
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}
#else
typedef struct { float v[8]; } VEC;
#define LANES 8
#define MR_MAX 2
#define NR_MAX 2
static inline VEC VZERO(void) { VEC r; for (int i = 0; i < 8; i++) r.v[i] = 0.0f; return r; }
static inline VEC VLOADX(const float *p) { VEC r; memcpy(r.v, p, sizeof r.v); return r; }
static inline VEC VFMA(VEC a, VEC b, VEC c) { for (int i = 0; i < 8; i++) c.v[i] += a.v[i] * b.v[i]; return c; }
static inline VEC vload_w(int type, const void *w, int64_t i) {
    VEC r;
    for (int l = 0; l < 8; l++) {
        if (type == F32) {
            r.v[l] = ((const float *)w)[i + l];
        } else {
            const uint16_t h = ((const uint16_t *)w)[i + l];
            if (type == F16) r.v[l] = half_to_float(h);
            else { const uint32_t bits = (uint32_t)h << 16; memcpy(&r.v[l], &bits, 4); }
        }
    }
    return r;
}
static inline float vhsum(VEC v) {
    const float a0 = v.v[0] + v.v[4], a1 = v.v[1] + v.v[5], a2 = v.v[2] + v.v[6], a3 = v.v[3] + v.v[7];
    return (a0 + a2) + (a1 + a3);
}
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* While a block multiplies, the weight rows AHEAD rows on are prefetched at the same columns, a line
   a step: a decode step streams every weight from memory once, and the hardware prefetcher alone
   left the C kernel reading them more slowly than oneDNN (docs/performance.md, issue 47). Past the
   last row the addresses run beyond the weights: a prefetch never faults. Into L2, as every kernel's
   (prefetch.h): into L1 (until 2026-12-06) the one-row GEMV over SmolLM2's 30 layers and lm_head read
   float16 and bfloat16 weights at 17-21 GB/s on a Zen 4 EPYC (2 threads) and at 24-32 GB/s into L2,
   float32 21-25 -> 27-37, the AVX2 build alike (docs/performance.md, "Issue 47 on a Zen 4 EPYC"). */
#ifndef AHEAD
#define AHEAD 8
#endif

/* out[m .. m+MR, n .. n+NR]: the dot products of MR activation rows with NR weight rows. */
ALWAYS_INLINE void block(const int type, const int MR, const int NR, const fweight_t *w, const float *x,
                         const uint16_t *xb, int64_t m, int64_t n, const float *bias, float *out, int64_t ldo) {
    const int64_t K = w->K;
    VEC acc[MR_MAX][NR_MAX];
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = VZERO();
#if defined(__AVX512BF16__)
    if (type == BF16) { /* 32 products a step, the activations' bfloat16 pairs against the weights' */
        const uint16_t *wr = (const uint16_t *)w->w + n * K;
        for (int64_t k = 0; k < K; k += 32) {
            __m512i wv[NR_MAX];
            for (int j = 0; j < NR; j++) {
                wv[j] = _mm512_loadu_si512(wr + j * K + k);
                PREFETCH_READ(wr + (AHEAD + j) * K + k);
            }
            for (int i = 0; i < MR; i++) {
                const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + (m + i) * K + k);
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], (__m512bh)wv[j], xv);
            }
        }
        goto sum;
    }
#else
    (void)xb;
#endif
    /* a 64-byte line of each weight row a step: VECS vectors (one of float32 with AVX-512, up to
       four of 16-bit values with 8 lanes) into the same accumulators in order, so the sums are the
       one-vector loop's, and one prefetch a line. (With one vector a step, the AVX2 build issued a
       prefetch per vector, four a line: one a line made its one-row GEMV 8-10% faster, 20 -> 22 GB/s
       on SmolLM2's layers in float16, bfloat16 and float32; Sapphire Rapids Xeon, 2 threads.) */
    const int VECS = 64 / (LANES * (type == F32 ? 4 : 2));
    for (int64_t k = 0; k < K; k += VECS * LANES) {
        for (int j = 0; j < NR; j++)
            PREFETCH_READ((const char *)w->w + ((n + AHEAD + j) * K + k) * (type == F32 ? 4 : 2));
        for (int v = 0; v < VECS; v++) {
            const int64_t kv = k + v * LANES;
            VEC wv[NR_MAX];
            for (int j = 0; j < NR; j++) wv[j] = vload_w(type, w->w, (n + j) * K + kv);
            for (int i = 0; i < MR; i++) {
                const VEC xv = VLOADX(x + (m + i) * K + kv);
                for (int j = 0; j < NR; j++) acc[i][j] = VFMA(wv[j], xv, acc[i][j]);
            }
        }
    }
#if defined(__AVX512BF16__)
sum:
#endif
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            const float s = vhsum(acc[i][j]);
            out[(m + i) * ldo + n + j] = bias ? s + bias[n + j] : s;
        }
}

/* Weight rows [n0, n1) against activation rows [m0, m1): blocks of MR_MAX x NR_MAX, then the rest. */
#define BY_NR(TYPE, MR)                                                                       \
    {                                                                                         \
        int64_t n = n0;                                                                       \
        for (; n + NR_MAX <= n1; n += NR_MAX) block(TYPE, MR, NR_MAX, w, x, xb, m, n, bias, out, ldo); \
        for (; n < n1; n++) block(TYPE, MR, 1, w, x, xb, m, n, bias, out, ldo);               \
    }
ALWAYS_INLINE void rows(const int type, const fweight_t *w, const float *x, const uint16_t *xb, int64_t m0,
                        int64_t m1, int64_t n0, int64_t n1, const float *bias, float *out, int64_t ldo) {
    int64_t m = m0;
    for (; m + MR_MAX <= m1; m += MR_MAX) BY_NR(type, MR_MAX)
    for (; m < m1; m++) BY_NR(type, 1)
}

static void rows_of_type(const fweight_t *w, const float *x, const uint16_t *xb, int64_t m0, int64_t m1,
                         int64_t n0, int64_t n1, const float *bias, float *out, int64_t ldo) {
    switch (w->type) {
    case F32: rows(F32, w, x, xb, m0, m1, n0, n1, bias, out, ldo); break;
    case F16: rows(F16, w, x, xb, m0, m1, n0, n1, bias, out, ldo); break;
    default: rows(BF16, w, x, xb, m0, m1, n0, n1, bias, out, ldo); break;
    }
}

/* out[M, N] (row stride ldo) = x[M, K] @ W^T (+ bias: NULL for none). The same signature as
   quant_gemm.c's qgemm, so decode_stack.c calls either through one pointer type. */
void fgemm(const fweight_t *w, const float *x, int64_t M, const float *bias, float *out, int64_t ldo) {
    const int64_t N = w->N, K = w->K, items = (N + N_BLOCK - 1) / N_BLOCK;
    const uint16_t *xb = NULL;
#if defined(__AVX512BF16__)
    uint16_t *xbuf = NULL;
    if (w->type == BF16) { /* the activations as bfloat16, rounded to nearest even, once */
        xbuf = malloc(sizeof(uint16_t) * (size_t)(M * K) + 64);
        for (int64_t i = 0; i < M * K; i += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
            _mm512_storeu_si512(xbuf + i, (__m512i)v);
        }
        xb = xbuf;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += M_CHUNK) {
        const int64_t m1 = m0 + M_CHUNK < M ? m0 + M_CHUNK : M;
#pragma omp parallel for schedule(static) if ((m1 - m0) * N * K >= (1 << 16))
        for (int64_t it = 0; it < items; it++) {
            const int64_t n0 = it * N_BLOCK, n1 = n0 + N_BLOCK < N ? n0 + N_BLOCK : N;
            rows_of_type(w, x, xb, m0, m1, n0, n1, bias, out, ldo);
        }
    }
#if defined(__AVX512BF16__)
    free(xbuf);
#endif
}

/* The ISA check (kernels/cpu/float_gemm.py runs it in a child process before trusting a build):
   one row of 64 against 5 bfloat16 and 5 float16 weight rows of small integers (exact in either
   type, and their sums exact in float32): the total of both products, which the caller knows. */
float probe(void) {
    static uint16_t wb[5 * 64], wh[5 * 64];
    static float x[64], out[5];
    for (int i = 0; i < 5 * 64; i++) {
        const float v = (float)((i * 7) % 13 - 6);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        wb[i] = (uint16_t)(bits >> 16);
        wh[i] = v == 0.0f ? 0 : (uint16_t)(((bits >> 16) & 0x8000) | (((bits >> 23) & 0xFF) - 112) << 10 |
                                            ((bits >> 13) & 0x3FF));
    }
    for (int i = 0; i < 64; i++) x[i] = (float)(i % 9 - 4);
    float s = 0.0f;
    const fweight_t b = {wb, BF16, 5, 64}, h = {wh, F16, 5, 64};
    fgemm(&b, x, 1, NULL, out, 5);
    for (int n = 0; n < 5; n++) s += out[n];
    fgemm(&h, x, 1, NULL, out, 5);
    for (int n = 0; n < 5; n++) s += out[n];
    return s;
}
