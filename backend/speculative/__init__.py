"""speculative: speculative decoding's proposers and the engine's per-step glue: n-gram prompt lookup
(`ngram.py`, no torch), a draft model on a ModelRunner of its own (`draft.py`), and `Speculator`
(`speculator.py`): which decode rows get drafts, and the counts the metrics report. The settings
are core/speculative_config.py; the verification of drafts in the target's step is the worker's
(worker/rejection.py). May import every layer up to the worker. See docs/design.md, "Speculative
decoding".
"""
