/* Where the CPU kernels' software prefetches put what they ask for ahead of use: the weights a GEMM
   streams (quant_gemm.c's next tile, float_gemm.c's and moe_gemm.c's rows ahead), the KV rows a decode
   attention walks block by block (decode_attention.c) and the keys AMX's prefill attention lays out
   (prefill_attention_amx.h). One place for all of them, since they share the reason: the hardware
   prefetcher stops at every 4 KB page and knows nothing of a block table.

   Into L2 (__builtin_prefetch's locality 2: prefetcht1 on x86). Into L1 (3, prefetcht0) the float
   GEMV read 16-bit weights at 17-21 GB/s on a Zen 4 EPYC and at 24-32 into L2, and a Qwen3-shaped
   decode attention's 2 KB rows at 10-15 against 23-26 (L1's few miss buffers fill); into L1 the packed
   GEMM's next tile was no faster on an Intel Xeon (docs/performance.md, "Issue 47 on a Zen 4 EPYC" and
   "the batch-1 GEMV's instructions"). The float kernels' L1 against L2 is not yet measured on an Intel
   CPU: -DPREFETCH_LOCALITY=3 builds the other way, to compare. */
#ifndef INFLIGHT_PREFETCH_H
#define INFLIGHT_PREFETCH_H

#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
/* A read of the 64-byte line at p, soon. Never faults: an address past the data is fine. */
#define PREFETCH_READ(p) __builtin_prefetch((p), 0, PREFETCH_LOCALITY)

#endif
