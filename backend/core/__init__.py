"""core: what every layer shares, as data. No torch, no device, no threads.

Owns the engine's settings (`config.py`: `EngineConfig`, validated once, and its parsed parts:
`speculative_config.py`, `kv_events_config.py`, `kv_tiers_config.py`, `lora.py`), a request (`request.py`) and its
sampling parameters (`sampling_params.py`), the errors raised on purpose (`errors.py`), what the
engine hands back (`outputs.py`), the doors' input guard (`input_guard.py`), the constraint a
structured output must follow (`structured.py`, `schema_check.py`), one place for each default
(`defaults.py`), what a pooling model pools and a pooling request asks (`pooling.py`), the step contract between the scheduler and the worker (`step.py`), and the freeze
of a serving process's heap once it has started (`gc_heap.py`: the `llm` stub, a tensor-parallel rank, the OpenAI server).

Imports nothing else of backend: it is the bottom of core < text < kv < sched < models < worker <
speculative < engine (docs/design.md, "Map").
"""
