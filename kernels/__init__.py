"""inflight's kernels: Triton kernels for the paged KV cache and attention, with torch references."""
