"""The engine's online model of a step's wall time on its device (docs/design.md, "Scheduling";
issue 45), read by the prefill pacer (pacing.py), the queue's drain estimate (drain.py) and the tier
choice (tier_choice.py). No torch here.

t = base + per_row x decode rows + per_kv x decode context / 1024 + fixed x [prompt tokens > 0]
  + per_token x prompt tokens + per_pair x attention pairs / 1024

A decode row at position p reads p + 1 positions of KV; a chunk of n prompt tokens from position s
attends to n x (s + n/2) earlier positions. `StepCost` fits it by least squares in relative error over
the last steps the engine ran (`observe`), a window per kind of step. Without the context term the
decode rows' price lags their growth: six streams' step goes from ~17 ms at 300 tokens of context to
~78 ms at 1,500 on a 2-core CPU. `fixed` is what a step pays for having prompt rows at all: on a GPU a
decode step replays a CUDA graph and a mixed one launches its kernels; on the CPU, where both run the
C layer stack, it is small (a paced chunk's steps show 0-2 ms). `batch_shape` reads a
step's features off the scheduler's output.
"""
from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from backend.sched.batch import SchedulerOutput

FEATURES = 6              # 1, decode rows, decode context / 1024, [prompt tokens > 0], prompt tokens, attention pairs / 1024
DECODE_FEATURES = 3       # a decode-only step's features past the first three are all 0
KV, FIXED, TOKENS = 2, 3, 4  # the indices of the decode context, [prompt tokens > 0] and prompt tokens
WINDOW = 128              # the fit uses the last this many steps of each kind: decode-only, small chunks, large chunks
# Steps with prompt tokens are kept in two windows by the chunk's size. A paced prompt's hundreds of
# steps are chunks of a few tokens at a slowly moving start: alone they cannot tell a token's price
# from its attention pairs' (a 2-core Xeon's fit, with the large chunks gone from one shared window,
# priced a token at 2,100 tokens of context at 36 ms where it cost ~7, capped the chunks at one token,
# and so never saw a larger chunk again). Whole prompts' chunks, kept apart, hold the split.
LARGE_CHUNK = 128
RIDGE = 1e-9              # relative to the normal matrix's trace: a direction no step has shown stays at 0
# The fixed price of prompt rows is held to 0 harder than the rest: where the steps seen cannot tell it
# from the per-token price (a paced prompt's chunks all of one size), a chunk's whole price goes to its
# tokens, so a larger chunk is priced high, not low (its step then within the target, not over it).
# FIXED_RIDGE alone (relative to the whole trace) left it free: paced chunks of 5-17 tokens at up to
# 3,000 tokens of context gave a fixed price of 1-15 ms and tokens at 1e-8 s, where a chunk's steps
# show ~0 (a 2-core Xeon, SmolLM2 Q4_1); the floor, which counts the fixed price, then took steps
# 1.2-1.7x over the target. FIXED_SHRINK adds that share of its own diagonal: a fixed price the steps
# show clearly (chunks of many sizes) loses a few %, one they cannot tell from the tokens' goes to ~2 ms.
FIXED_RIDGE = 30.0
FIXED_SHRINK = 0.03
PAIR_UNIT = 1024.0
MIN_SECONDS = 1e-5        # a step's weight is capped at this (relative-error weighting)
MIN_TOKEN_SECONDS = 1e-8  # a prompt token's price is never below this (a fit can only say "cheap")


def step_features(decode_rows: int, prompt_tokens: int, pairs: float, decode_kv: float = 0.0) -> list[float]:
    """`decode_kv`: the positions the decode rows read (a row at position p reads p + 1)."""
    return [1.0, float(decode_rows), decode_kv / PAIR_UNIT, 1.0 if prompt_tokens else 0.0, float(prompt_tokens),
            pairs / PAIR_UNIT]


def chunk_pairs(start: int, n: int) -> float:
    """The attention pairs of a prompt chunk of n tokens from position start (causal)."""
    return n * (start + (n + 1) / 2.0)


class _Window:
    """The last WINDOW observations' normal equations (sum of x x^T and of x y) over their first k
    features, kept as sums (a decode-only step's features past its context are all 0: k = 3 for them)."""

    def __init__(self, k: int):
        self.k = k
        self.rows: deque = deque()
        self.a = [[0.0] * k for _ in range(k)]
        self.b = [0.0] * k

    def add(self, x: list[float], y: float) -> None:
        x = x[:self.k]
        self._apply(x, y, 1.0)
        self.rows.append((x, y))
        if len(self.rows) > WINDOW:
            self._apply(*self.rows.popleft(), -1.0)

    def _apply(self, x: list[float], y: float, sign: float) -> None:
        for i, xi in enumerate(x):
            self.b[i] += sign * xi * y
            row = self.a[i]
            for j, xj in enumerate(x):
                row[j] += sign * xi * xj


class StepCost:
    """Least squares over `step_features` on a sliding window, in relative error: each step weighs
    by 1/its seconds, since a step's noise grows with its length and a long prompt's chunk must not
    drown a decode step's figure. Decode-only steps, small chunks and large chunks have a window each,
    so a long run of decode steps never forgets what a prompt token costs. Pure Python: 3 x 3 and 5 x 5 solves."""

    def __init__(self):
        self.decode_only = _Window(DECODE_FEATURES)
        self.small_chunks, self.large_chunks = _Window(FEATURES), _Window(FEATURES)
        self._theta = [0.0] * FEATURES
        self._stale = False  # observed since the last fit: solved again when next read (most steps never read it)
        self.steps = 0
        self.prompt_steps = 0  # observed steps that had prompt tokens: the per-token cost is known after one
        self.kv_per_row = 0.0  # the last step's decode context per row: what a decode row reads now

    def predict(self, x: Sequence[float]) -> float:
        return sum(t * v for t, v in zip(self.theta, x))

    def observe(self, x: Sequence[float], seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        scale = 1.0 / max(seconds, MIN_SECONDS)
        prompt = x[TOKENS] > 0
        window = self.decode_only if not prompt else \
            self.large_chunks if x[TOKENS] >= LARGE_CHUNK else self.small_chunks
        window.add([v * scale for v in x], seconds * scale)
        self.steps += 1
        self.prompt_steps += prompt
        if x[1] > 0:
            self.kv_per_row = x[2] * PAIR_UNIT / x[1]
        self._stale = True

    @property
    def theta(self) -> list[float]:
        if self._stale:
            self._theta, self._stale = self._fit(), False
        return self._theta

    def _fit(self) -> list[float]:
        """The context's price from the decode-only steps alone, then the rest from both windows
        with it taken off. While a prompt is paced in, its chunks' start and the decode rows'
        context grow together, step after step: fitted jointly, those steps cannot tell the
        decode rows' context from the chunk's attention pairs, and a mix of the two mispriced a
        chunk of another size. Steps of decode rows alone can."""
        kv = max(0.0, _ridge_solve(self.decode_only.a, self.decode_only.b)[KV])
        a = [[0.0] * FEATURES for _ in range(FEATURES)]
        b = [0.0] * FEATURES
        for window in (self.decode_only, self.small_chunks, self.large_chunks):
            for i, row in enumerate(window.a):
                b[i] += window.b[i]
                for j, v in enumerate(row):
                    a[i][j] += v
        a[FIXED][FIXED] *= 1.0 + FIXED_SHRINK
        rest = [i for i in range(FEATURES) if i != KV]
        theta = _ridge_solve([[a[i][j] for j in rest] for i in rest], [b[i] - kv * a[i][KV] for i in rest],
                             [FIXED_RIDGE if i == FIXED else 1.0 for i in rest])
        theta.insert(KV, kv)
        return theta

    def decode_seconds(self, rows: int, kv: Optional[float] = None) -> float:
        """A step of `rows` decode rows reading `kv` positions in all (None: at the context per row
        of the last step that had decode rows)."""
        kv = rows * self.kv_per_row if kv is None else kv
        return max(0.0, self.predict(step_features(rows, 0, 0.0, kv)))

    def prices(self) -> tuple[float, float, float]:
        """A step's price of prompt rows: fixed, per token, per attention pair / PAIR_UNIT (each >= 0; a
        token never below MIN_TOKEN_SECONDS)."""
        fixed, per_token, per_pair = (max(0.0, v) for v in self.theta[FIXED:])
        return fixed, max(MIN_TOKEN_SECONDS, per_token), per_pair

    def prompt_seconds(self, start: int, n: int) -> float:
        """What n prompt tokens from position start add to a step."""
        fixed, per_token, per_pair = self.prices()
        return fixed + per_token * n + per_pair * chunk_pairs(start, n) / PAIR_UNIT

    def tokens_within(self, start: int, seconds: float) -> int:
        """The most prompt tokens from position start whose price (fixed part included) fits in seconds."""
        fixed, per_token, per_pair = self.prices()
        a, b, c = per_pair / PAIR_UNIT / 2, per_token + per_pair * (start + 0.5) / PAIR_UNIT, \
            fixed - seconds  # a n^2 + b n + c <= 0
        if c >= 0:
            return 0
        n = -c / b if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
        return int(min(n, 1e9))


def batch_shape(batch: "SchedulerOutput") -> tuple[int, int, float, int]:
    """A step's decode rows, prompt tokens (a verify row's drafts count as prompt tokens: positions
    computed beside the row's own), prompt chunks' attention pairs and the positions its decode
    rows read (a row from position s computing k tokens reads s + k). A one-token prompt chunk runs
    as a decode row (batch.py) but is priced as what it is, a prompt token at its position, as the
    scheduler charges it to the step's prompt cap (the prompt's last token excepted: the scheduler
    runs that one as a decode). Counted as a decode row, a paced prompt's one-token chunks at long
    context taught the model that decode rows cost what they do, and the prompt's price was never
    learnt from them."""
    rows = tokens = kv = 0
    pairs = 0.0
    for s in batch.decodes:
        if s.num_new_tokens == 1 and s.start < s.request.num_prompt_tokens - 1:
            tokens += 1
            pairs += chunk_pairs(s.start, 1)
            continue
        rows += 1
        tokens += s.num_new_tokens - 1
        kv += s.start + s.num_new_tokens
    for s in batch.prefills:
        tokens += s.num_new_tokens
        pairs += chunk_pairs(s.start, s.num_new_tokens)
    return rows, tokens, pairs, kv


def _ridge_solve(a: list[list[float]], b: list[float], weights: Optional[Sequence[float]] = None) -> list[float]:
    """The least-squares solution of normal equations a x = b with a ridge of RIDGE x trace(a) on
    the diagonal (times `weights`): a direction no step has shown stays at 0."""
    n = len(b)
    ridge = RIDGE * sum(a[i][i] for i in range(n)) + 1e-30
    a = [[v + (ridge * (weights[i] if weights else 1.0) if i == j else 0.0) for j, v in enumerate(row)]
         for i, row in enumerate(a)]
    return _solve(a, b)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is symmetric positive definite after the ridge)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[pivot] = m[pivot], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
