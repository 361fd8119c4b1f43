/* prefill_attention.c's vectors, per build: the width of one register of floats (GCC's vector
   extension, so one source serves the AVX-512, AVX2 and portable builds), the rows a tile computes
   together, and the transposition of a key tile in registers (16 x 16 with AVX-512, 8 x 8 with AVX).
   Included once, before the kernel. */
#ifndef INFLIGHT_PREFILL_VEC_H
#define INFLIGHT_PREFILL_VEC_H
#include <stdint.h>
#include <string.h>

/* A key tile's scores are four vectors a row. */
#if defined(__AVX512F__)
#define VW 16
#define RB 4 /* rows computed together: each K or V load feeds RB FMAs; RB x 4 accumulators in registers */
#elif defined(__AVX__)
#define VW 8
#define RB 2
#else
#define VW 4
#define RB 2
#endif
#define KT (4 * VW) /* keys per tile */
/* CALL(NR) for a block of rb rows with NR = rb a constant: the last rows of a task (a chunk of 9
   tokens x 3 heads is 27 rows: 6 blocks of 4 and 3 left) share each K or V load too. One row at a
   time, as they were, cost a small chunk's attention ~30% more a token than a large one's. */
#if RB == 4
#define BY_ROWS(CALL)                                                                    \
    switch (rb) {                                                                        \
    case 4: CALL(4); break; case 3: CALL(3); break; case 2: CALL(2); break; default: CALL(1); \
    }
#else
#define BY_ROWS(CALL) switch (rb) { case 2: CALL(2); break; default: CALL(1); }
#endif
typedef float vf_t __attribute__((vector_size(VW * sizeof(float))));
static inline vf_t vload(const float *p) { vf_t v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf_t v) { memcpy(p, &v, sizeof v); }
static inline vf_t vset(float x) { const vf_t z = {0}; return z + x; }
/* Keeps a loaded vector in its register: without it GCC folds the load into each FMA that uses it, and
   four loads of one vector leave the FMAs waiting on the load ports. */
#if defined(__x86_64__) && defined(__SSE__)
#define IN_REG(v) __asm__("" : "+v"(v))
#else
#define IN_REG(v) (void)0
#endif

/* dst[c][r] = src[r][c] for a TW x TW block of floats (row strides ls, ld), in registers: 16 x 16 with
   AVX-512 (unpack 32-bit and 64-bit pairs, then swap 128-bit lanes twice), 8 x 8 with AVX (unpack
   32-bit pairs, shuffle 64-bit pairs, swap 128-bit halves); the portable build has none (TW 1). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define TW 16
/* In place in 16 registers: r[c] lane i = r[i] lane c (32-bit lanes; a permutation, so bit patterns
   pass unchanged: prefill_attention_amx.h transposes pairs of bfloat16 with it). */
static inline void transpose16_regs(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 1]);
        const __m512d c = _mm512_castps_pd(t[i + 2]), d = _mm512_castps_pd(t[i + 3]);
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
    }
}

static inline void transpose_block(const float *restrict src, int64_t ls, float *restrict dst, int64_t ld) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_ps(src + i * ls);
    transpose16_regs(r);
    for (int i = 0; i < 16; i++) _mm512_storeu_ps(dst + i * ld, r[i]);
}
#elif defined(__AVX__)
#include <immintrin.h>
#define TW 8
static inline void transpose_block(const float *restrict src, int64_t ls, float *restrict dst, int64_t ld) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * ls);
    for (int i = 0; i < 8; i += 2) { /* t[i]: rows i, i+1 interleaved, elements 0-1 | 4-5; t[i+1]: 2-3 | 6-7 */
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* r[i + c]: column c (and c + 4) of rows i .. i+3 */
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int c = 0; c < 4; c++) {
        _mm256_storeu_ps(dst + c * ld, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
        _mm256_storeu_ps(dst + (c + 4) * ld, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
    }
}
#else
#define TW 1 /* no transposition in registers: load_tile transposes element by element */
static inline void transpose_block(const float *src, int64_t ls, float *dst, int64_t ld) {
    (void)src, (void)ls, (void)dst, (void)ld;
}
#endif

#endif
