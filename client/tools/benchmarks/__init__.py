"""Benchmarks: the served and in-process benchmark (`bench.py`: `inflight bench`, with `measure.py`,
`report.py`, `spec.py`, `targets.py`, `workloads.py`), the step probe and host overhead of a step,
and one benchmark per feature (admission, backfill, kernels, packed CPU GEMM, KV tiers, LoRA, MoE,
prefix reuse cost, tensor parallelism, structured outputs, the scheduler's trace, the KV-cache
figure)."""
