"""The CPU kernels, in C (csrc/) with ctypes wrappers: built on first use for the machine's ISA
(`build.py`), decode attention over the paged cache, elementwise ops, the packed-weight GEMMs and
their ISA choice (`quant.py`), the mixture-of-experts GEMM, and a decode step's whole layer stack in
one call (`decode_stack.py`). Each has a torch reference in kernels/."""
