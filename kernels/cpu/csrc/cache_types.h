/* The KV cache's element types, for the attention kernels that read the paged cache in place
   (decode_attention.c, prefill_attention.c). A kernel file defines KERNEL_FILE (its own name, a
   string) and includes this header where its kernel body should be instantiated: the header
   includes the file back twice, with CACHE_T, CACHE_IS_BF16, SUFFIX and TO_F32 set, so NAME(f) names the float32
   variant f_f32 and the bfloat16 one f_bf16 (kv_cache_dtype=bfloat16: each element widened as it
   is read; queries, scores and sums stay float32). The kernel body sits under `#else` of the
   file's `#ifndef CACHE_T`. */
#ifndef INFLIGHT_CACHE_TYPES_H
#define INFLIGHT_CACHE_TYPES_H
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

#define CAT2(a, b) a##_##b
#define CAT(a, b) CAT2(a, b)
#define NAME(f) CAT(f, SUFFIX)
#endif

#define CACHE_T float
#define CACHE_IS_BF16 0
#define SUFFIX f32
#define TO_F32(x) (x)
#include KERNEL_FILE
#undef CACHE_T
#undef CACHE_IS_BF16
#undef SUFFIX
#undef TO_F32
#define CACHE_T uint16_t
#define CACHE_IS_BF16 1
#define SUFFIX bf16
#define TO_F32(x) bf16_to_f32(x)
#include KERNEL_FILE
