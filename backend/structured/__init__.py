"""Structured outputs: constraints (JSON schema, regex, choice, grammar, structural tag) that a
request's output must follow, compiled by xgrammar and enforced by a token mask at each step.

- `spec.py`: `StructuredOutputs`, the request's constraint, checked (no torch, no xgrammar);
- `compiler.py`: the engine's compiler and its bounded cache (xgrammar loads on first use);
- `matcher.py`: each sequence's grammar state, and the step's batched mask (torch).
See docs/design.md, "Structured outputs".
"""
from backend.structured.spec import StructuredOutputs, fold_legacy_keys

__all__ = ["StructuredOutputs", "fold_legacy_keys"]
