"""What the tensor-parallel tests share (tests/test_tensor_parallel*.py, tests/e2e/test_tensor_parallel.py):
random prompts, greedy parameters, and the worker processes a process started."""
from __future__ import annotations

import random
from typing import Optional

import psutil

from backend import SamplingParams
from backend.worker.parallel.launcher import worker_processes

# SmolLM2's greedy comparisons: text it continues sensibly, so that its top tokens are far apart
NATURAL_PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "The largest planet in our solar system is",
    "def fibonacci(n):\n    ", "Once upon a time, there was a", "The chemical symbol for gold is",
    "To make a cup of tea, first", "The opposite of hot is", "In 1969, Neil Armstrong",
    "Photosynthesis is the process by which", "The three primary colors are", "A triangle has three",
    "The quick brown fox", "Machine learning is a field of", "The Pacific Ocean is the", "Shakespeare wrote the play"]


def random_prompts(n: int = 16, seed: int = 0, vocab: int = 2000) -> list[list[int]]:
    """`n` prompts of 3 to 44 token ids (lengths that are not block multiples)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 45))] for _ in range(n)]


def greedy(max_tokens: int, logprobs=None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def tp_workers(pid: Optional[int] = None) -> list[psutil.Process]:
    """The tensor-parallel worker processes below `pid` (default: this process)."""
    return worker_processes(pid)
