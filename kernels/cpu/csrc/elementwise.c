/* The CPU engine's per-layer elementwise kernels, float32, one call where torch needs several ops
   (and as many passes over memory): at a decode batch of a few rows each op's dispatch, not its
   arithmetic, is the cost, and a 30-layer model runs ~60 of them per layer per step.

   Rows are independent; every kernel splits them over the OpenMP team when there is enough work
   (below PARALLEL_MIN floats, waking the team costs more than the loop). Layouts are given as row
   strides in floats; within a row the data is contiguous. The Python wrappers
   (kernels/cpu_elementwise.py) check shapes, dtypes, strides and index bounds. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN 16384

/* h = x + residual (or x); out = h * rsqrt(mean(h^2) + eps) * weight.  x, residual, out, h [T, N]. */
void rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *h,
                  int64_t T, int64_t N, float eps) {
#pragma omp parallel for if (T * N >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *xr = x + t * N;
        float *hr = h + t * N, *outr = out + t * N;
        float ss = 0.0f;
        if (residual) {
            const float *rr = residual + t * N;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < N; i++) {
                hr[i] = xr[i] + rr[i];
                ss += hr[i] * hr[i];
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < N; i++) {
                hr[i] = xr[i];
                ss += xr[i] * xr[i];
            }
        }
        const float inv = 1.0f / sqrtf(ss / (float)N + eps);
#pragma omp simd
        for (int64_t i = 0; i < N; i++) outr[i] = hr[i] * inv * weight[i];
    }
}

/* x [T, 2I] = [gate | up] -> out [T, I] = silu(gate) * up. e^-g is taken at -g <= 88 (e^88 is still
   finite in float32, so no value changes where it was): past that, -ffast-math assumes no infinity,
   and a gate below -88 (an outlier's pre-activation) gave NaN where torch gives 0. */
void silu_mul_f32(const float *x, float *out, int64_t T, int64_t I) {
#pragma omp parallel for if (T * I >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) o[i] = g[i] / (1.0f + expf(fminf(-g[i], 88.0f))) * u[i];
    }
}

/* x [T, 2I] = [gate | up] -> out [T, I] = gelu_tanh(gate) * up (Gemma's GeGLU, HF's
   "gelu_pytorch_tanh"): 0.5 g (1 + tanh(u)), u = sqrt(2/pi) (g + 0.044715 g^3), computed as its
   equal g / (1 + e^-2u), which vectorizes with expf and has no 1 + tanh to cancel where tanh is
   near -1. u is clamped at -40 (the result is 0 in float32 long before), since -ffast-math assumes
   no infinity for e^-2u to overflow to. */
void gelu_tanh_mul_f32(const float *x, float *out, int64_t T, int64_t I) {
    const float k0 = 0.7978845608028654f, k1 = 0.044715f;
#pragma omp parallel for if (T * I >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *g = x + t * 2 * I, *u = g + I;
        float *o = out + t * I;
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float inner = fmaxf(k0 * (g[i] + k1 * g[i] * g[i] * g[i]), -40.0f);
            o[i] = g[i] / (1.0f + expf(-2.0f * inner)) * u[i];
        }
    }
}

/* Neox (rotate-half) RoPE of one [T, heads, D] tensor whose rows are row_stride floats apart,
   into out [T, heads, D] contiguous. cos/sin [max_pos, D/2]. */
static void rope_one(const float *x, int64_t row_stride, float *out, const int64_t *positions,
                     const float *cos_cache, const float *sin_cache, int64_t T, int64_t heads,
                     int64_t D) {
    const int64_t half = D / 2;
#pragma omp parallel for if (T * heads * D >= PARALLEL_MIN) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_cache + positions[t] * half, *s = sin_cache + positions[t] * half;
        for (int64_t h = 0; h < heads; h++) {
            const float *xr = x + t * row_stride + h * D;
            float *o = out + (t * heads + h) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                o[i] = xr[i] * c[i] - xr[i + half] * s[i];
                o[i + half] = xr[i + half] * c[i] + xr[i] * s[i];
            }
        }
    }
}

void rotary_f32(const float *q, int64_t q_row_stride, const float *k, int64_t k_row_stride,
                float *q_out, float *k_out, const int64_t *positions, const float *cos_cache,
                const float *sin_cache, int64_t T, int64_t H, int64_t G, int64_t D) {
    rope_one(q, q_row_stride, q_out, positions, cos_cache, sin_cache, T, H, D);
    rope_one(k, k_row_stride, k_out, positions, cos_cache, sin_cache, T, G, D);
}

/* float32 -> bfloat16, rounding to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* Copy key/value rows [T, G*D] (rows key_row_stride / value_row_stride floats apart) into the
   cache at slot_mapping[t] (block * BS + offset, rows of G*D elements); slot -1: not stored. The
   cache holds float32, or bfloat16 (kv_cache_dtype=bfloat16: rounded as it is stored). */
static void store_kv(const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
                     void *k_cache, void *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row, int bf16) {
    for (int64_t t = 0; t < T; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const float *k = key + t * key_row_stride, *v = value + t * value_row_stride;
        if (!bf16) {
            memcpy((float *)k_cache + slot * row, k, sizeof(float) * row);
            memcpy((float *)v_cache + slot * row, v, sizeof(float) * row);
            continue;
        }
        uint16_t *kc = (uint16_t *)k_cache + slot * row, *vc = (uint16_t *)v_cache + slot * row;
#pragma omp simd
        for (int64_t i = 0; i < row; i++) {
            kc[i] = f32_to_bf16(k[i]);
            vc[i] = f32_to_bf16(v[i]);
        }
    }
}

void store_kv_f32(const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
                  float *k_cache, float *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row) {
    store_kv(key, key_row_stride, value, value_row_stride, k_cache, v_cache, slot_mapping, T, row, 0);
}

void store_kv_bf16(const float *key, int64_t key_row_stride, const float *value, int64_t value_row_stride,
                   uint16_t *k_cache, uint16_t *v_cache, const int64_t *slot_mapping, int64_t T, int64_t row) {
    store_kv(key, key_row_stride, value, value_row_stride, k_cache, v_cache, slot_mapping, T, row, 1);
}
