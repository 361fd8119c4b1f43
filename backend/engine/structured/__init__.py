"""Structured outputs' compilation, off the request path: the engine's `ConstraintCompiler` and its
bounded cache (`compiler.py`), the process-wide pool of grammar worker processes
(`compile_pool.py`) and the worker itself (`compile_worker.py`). The constraint as data is
core/structured.py; each sequence's grammar state and the step's bitmask, sched/grammar.py; the
mask applied to the logits, worker/sampler.py. See docs/design.md, "Structured outputs".
"""
