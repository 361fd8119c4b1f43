"""Helpers of the CPU engine: OpenMP thread pinning, glibc's memory thresholds."""
