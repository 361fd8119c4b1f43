"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the verification of
drafts in the target's step (rejection sampling), and the per-step glue (`Speculator`).

`config.py` and `ngram.py` load no torch; `rejection.py`, `draft.py` and `speculator.py` do. Nothing
is imported here, so `backend.core.config` can read `spec.config` without loading the rest.
See docs/design.md, "Speculative decoding".
"""
