/* Paged decode attention on the CPU, reading K/V in place from the block-paged cache.

   One query token per sequence, one sequence per task. Each cached token's K and V rows (all kv
   heads) are read once per layer, straight out of their blocks, with no padded copy; the query
   heads that share a kv head (GQA) read it from cache. Softmax in float32 over exactly the sequence's own tokens (no
   padding, no mask). Layouts, all contiguous:
     q, out [S, H, D]; k_cache, v_cache [NB, BS, G, D]; block_tables [S, MB] int32; seq_lens [S] int32
   The Python wrapper (kernels/cpu_decode_attention.py) checks shapes, dtypes and that every
   seq_len fits its table, and that every block id is in range. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void decode_attention_f32(const float *restrict q, const float *restrict k_cache,
                          const float *restrict v_cache, const int32_t *restrict block_tables,
                          const int32_t *restrict seq_lens, float *restrict out,
                          int64_t S, int64_t H, int64_t G, int64_t D, int64_t BS, int64_t MB,
                          float scale) {
    const int64_t rep = H / G;
    const int64_t row = G * D; /* floats between one cached token and the next */
#pragma omp parallel
    {
        float *scores = NULL; /* [H, len] for one sequence, grown as needed, one per thread */
        int64_t capacity = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < S; s++) {
            const int64_t len = seq_lens[s];
            const int32_t *table = block_tables + s * MB;
            const float *qs = q + s * H * D;
            float *os = out + s * H * D;
            memset(os, 0, sizeof(float) * H * D);
            if (len <= 0) continue;
            if (H * len > capacity) {
                free(scores);
                capacity = H * len;
                scores = malloc(sizeof(float) * capacity);
            }
            /* A token's K row holds every kv head (G * D floats, contiguous), and a block's rows
               follow each other: reading all heads of a token together streams each block once. */
            for (int64_t t = 0; t < len; t++) {
                const float *k = k_cache + ((int64_t)table[t / BS] * BS + t % BS) * row;
                for (int64_t h = 0; h < H; h++) {
                    const float *qh = qs + h * D, *kh = k + (h / rep) * D;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < D; d++) acc += qh[d] * kh[d];
                    scores[h * len + t] = acc * scale;
                }
            }
            for (int64_t h = 0; h < H; h++) { /* softmax over the sequence's own tokens */
                float *sh = scores + h * len;
                float top = sh[0];
                for (int64_t t = 1; t < len; t++) top = sh[t] > top ? sh[t] : top;
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; t++) {
                    sh[t] = expf(sh[t] - top);
                    sum += sh[t];
                }
                const float inv = 1.0f / sum;
#pragma omp simd
                for (int64_t t = 0; t < len; t++) sh[t] *= inv;
            }
            for (int64_t t = 0; t < len; t++) { /* out = sum_t p_t v_t */
                const float *v = v_cache + ((int64_t)table[t / BS] * BS + t % BS) * row;
                for (int64_t h = 0; h < H; h++) {
                    const float p = scores[h * len + t], *vh = v + (h / rep) * D;
                    float *o = os + h * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; d++) o[d] += p * vh[d];
                }
            }
        }
        free(scores);
    }
}
