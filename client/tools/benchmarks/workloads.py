"""Seeded benchmark workloads (docs/design.md, "Performance: how we measure").

    from client.tools.benchmarks.workloads import make_workload
    items = make_workload("mixed", num_requests=200, seed=0)            # token-id prompts, all at once
    items = make_workload("mixed", 200, rate=4.0, prompt_format="text", tokenizer=tok)  # Poisson 4/s
    items = make_workload("traces.jsonl", 200)                          # recorded requests

- `fixed`: every prompt `fixed_prompt_len` tokens, every answer `fixed_output_len` tokens.
- `mixed`: prompt lengths lognormal(mean 4.5, sigma 0.8) clipped to 8..1024, output lengths
  lognormal(4.2, 0.7) clipped to 8..512 (numpy's `lognormal(mean, sigma)`: the parameters of the
  underlying normal). Every request sets `ignore_eos`, so it generates exactly its output length.
- `hol` (head of line): every `HOL["every"]`-th request asks for a very large `max_tokens`
  (`HOL["large_output"]`), the others are small (prompts 16..64, outputs 8..48): under strict
  no-evict admission a large request that does not fit blocks every small one behind it.
- `extractive`: answers that quote long spans of their prompt (chat, code editing, RAG and
  summarization copy from the context; what speculative decoding's n-gram proposer finds): each
  prompt asks to repeat a passage of the repository's corpus (`EXTRACTIVE["passage"]` tokens)
  verbatim, through the checkpoint's chat template when it has one, and `max_tokens` is the
  passage's length plus a few. It needs a tokenizer for exact lengths (token ids by default, the
  text with `prompt_format="text"`); without one, text measured in words.
- `images`: chat with images (docs/vision.md): each request one or two images (`IMAGES`: sizes
  224x224 to 1024x768, seeded random pixels as PNG files, every image its own: two of the largest
  stay under the OpenAI server's 8 MiB request body as data URLs), a question of
  16..64 tokens and an answer of 16..96; the target puts each image before the question (the
  model's begin-of-image token in-process, an `image_url` data URL through the OpenAI port).
- `embeddings`: pooling requests for a pooling model (docs/pooling.md): prompt lengths
  lognormal(4.0, 0.7) clipped to 4..512, no output tokens (`max_tokens` 1, unused).
- `FILE.jsonl`: one request per line, `{"prompt": "..."}` or `{"input_ids": [...]}` plus
  `"max_tokens"` (or `"output_len"`), and optionally `"arrival_s"` (seconds from the start),
  `"images"` (base64 files) and `"kind": "embed"` (a pooling request).
  Lines beyond `num_requests` are ignored; fewer lines are cycled.

Arrivals: all at once (`rate=None`: every `arrival_s` is 0 and the concurrency limit alone paces
the requests) or Poisson at `rate` requests/s (exponential gaps, seeded).

Prompts are token ids by default: exact lengths, no tokenizer needed, ids drawn uniformly from
[FIRST_ID, vocab_size) so that no special token (unk/bos/eos at 0..2) appears. `prompt_format="text"`
makes text prompts from the repository's corpus, cut to the target length with `tokenizer` (any
object with encode/decode), or by words when there is none.
"""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

FIRST_ID = 3  # ids 0..2 are <unk>, <s>, </s> in the default model
DEFAULT_VOCAB_SIZE = 2000  # the default model's
MIXED = dict(prompt_mean=4.5, prompt_sigma=0.8, prompt_min=8, prompt_max=1024,
             output_mean=4.2, output_sigma=0.7, output_min=8, output_max=512)
HOL = dict(every=8, large_prompt=64, large_output=600, small_prompt=(16, 64), small_output=(8, 48))
# The instruction is the one SmolLM2-135M-Instruct follows best (checked on 6 passages: 5 answers
# quote their passage for 85-96% of their 4-grams; "copy ... word for word" and "rewrite ... exactly"
# did so for 2 or 3 of 6).
EXTRACTIVE = dict(passage=(120, 360), extra_output=8, instruction="Repeat this passage verbatim:")
IMAGES = dict(sizes=((224, 224), (448, 336), (640, 480), (1024, 768)), per_request=(1, 2), prompt=(16, 65),
              output=(16, 97))
EMBEDDINGS = dict(prompt_mean=4.0, prompt_sigma=0.7, prompt_min=4, prompt_max=512)
WORKLOADS = ("fixed", "mixed", "hol", "extractive", "images", "embeddings")


@dataclass
class WorkItem:
    index: int
    prompt: Union[str, list[int]]
    prompt_len: int  # in tokens (for text: as the tokenizer counts; by words without one)
    max_tokens: int
    arrival_s: float = 0.0  # seconds after the start of the run
    ignore_eos: bool = True
    images: tuple = ()  # PNG files (bytes), placed before the prompt, one marker each (the target's)
    kind: str = "generate"  # or "embed": a pooling request (its output is a vector, no tokens)


def _lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float, lo: int, hi: int) -> list[int]:
    return [int(x) for x in np.clip(np.round(rng.lognormal(mean, sigma, n)), lo, hi)]


def _arrivals(rng: np.random.Generator, n: int, rate: Optional[float]) -> list[float]:
    if not rate or rate == float("inf"):
        return [0.0] * n
    return [float(t) for t in np.cumsum(rng.exponential(1.0 / rate, n))]


def _corpus_words() -> list[str]:
    path = Path(__file__).resolve().parents[3] / "backend" / "models" / "data" / "corpus.txt"
    words = path.read_text(encoding="utf-8").split() if path.exists() else []
    return words or ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog"]


def _text_prompt(rng: np.random.Generator, words: Sequence[str], length: int, tokenizer) -> tuple[str, int]:
    start = int(rng.integers(0, max(1, len(words) - 2 * length)))
    chunk = [words[(start + i) % len(words)] for i in range(2 * length + 8)]
    text = " ".join(chunk)
    if tokenizer is None:
        return " ".join(chunk[:length]), length
    ids = list(tokenizer.encode(text))[:length]
    text = tokenizer.decode(ids) if hasattr(tokenizer, "decode") else text
    return text, len(tokenizer.encode(text))


def make_workload(name: str, num_requests: int, *, seed: int = 0, rate: Optional[float] = None,
                  prompt_format: str = "ids", vocab_size: int = DEFAULT_VOCAB_SIZE, tokenizer=None,
                  fixed_prompt_len: int = 128, fixed_output_len: int = 64,
                  max_output_len: Optional[int] = None) -> list[WorkItem]:
    """The requests of one benchmark run, reproducible from `seed`. `max_output_len` caps the
    output lengths (e.g. to fit a small max_model_len), changing nothing else."""
    if num_requests < 1:
        raise ValueError("num_requests must be >= 1")
    if prompt_format not in ("ids", "text"):
        raise ValueError(f"prompt_format must be ids or text; got {prompt_format!r}")
    rng = np.random.default_rng(seed)
    if name not in WORKLOADS:
        return _from_file(Path(name), num_requests, rng, rate)
    if name == "extractive":
        return _extractive(rng, num_requests, _arrivals(rng, num_requests, rate), prompt_format, tokenizer,
                           max_output_len)
    if name in ("images", "embeddings"):
        return _images_or_embeddings(name, rng, num_requests, prompt_format, vocab_size, tokenizer, max_output_len,
                                     _arrivals(rng, num_requests, rate))
    if name == "fixed":
        prompt_lens = [fixed_prompt_len] * num_requests
        output_lens = [fixed_output_len] * num_requests
    elif name == "hol":
        prompt_lens, output_lens = _head_of_line_lengths(rng, num_requests)
    else:
        m = MIXED
        prompt_lens = _lognormal_lengths(rng, num_requests, m["prompt_mean"], m["prompt_sigma"],
                                         m["prompt_min"], m["prompt_max"])
        output_lens = _lognormal_lengths(rng, num_requests, m["output_mean"], m["output_sigma"],
                                         m["output_min"], m["output_max"])
    if max_output_len:
        output_lens = [min(n, max_output_len) for n in output_lens]
    arrivals = _arrivals(rng, num_requests, rate)
    words = _corpus_words() if prompt_format == "text" else []
    items = []
    for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, arrivals)):
        if prompt_format == "ids":
            prompt: Union[str, list[int]] = [int(x) for x in rng.integers(FIRST_ID, vocab_size, p)]
            n = p
        else:
            prompt, n = _text_prompt(rng, words, p, tokenizer)
        items.append(WorkItem(i, prompt, n, o, t))
    return items


def _extractive(rng: np.random.Generator, n: int, arrivals: list[float], prompt_format: str, tokenizer,
                max_output_len: Optional[int]) -> list[WorkItem]:
    words = _corpus_words()
    items = []
    for i, t in enumerate(arrivals):
        passage, passage_len = _text_prompt(rng, words, int(rng.integers(*EXTRACTIVE["passage"])), tokenizer)
        ask = f"{EXTRACTIVE['instruction']}\n\n{passage}"
        max_tokens = passage_len + EXTRACTIVE["extra_output"]
        if max_output_len:
            max_tokens = min(max_tokens, max_output_len)
        if tokenizer is None:
            items.append(WorkItem(i, ask + "\n\n", len(ask.split()), max_tokens, t))
            continue
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.render_chat([{"role": "user", "content": ask}])
            ids = list(tokenizer.encode(text, add_special_tokens=False))
        else:
            text = ask + "\n\n"
            ids = list(tokenizer.encode(text))
        items.append(WorkItem(i, ids if prompt_format == "ids" else text, len(ids), max_tokens, t))
    return items


def random_png(rng: np.random.Generator, width: int, height: int) -> bytes:
    """A seeded image of random RGB pixels as a PNG file (fast to write; as large as images get)."""
    import io

    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB").save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def _images_or_embeddings(name: str, rng: np.random.Generator, n: int, prompt_format: str, vocab_size: int,
                          tokenizer, max_output_len: Optional[int], arrivals: list[float]) -> list[WorkItem]:
    words = _corpus_words() if prompt_format == "text" else []
    if name == "images":
        im = IMAGES
        prompt_lens = [int(x) for x in rng.integers(*im["prompt"], n)]
        output_lens = [int(x) for x in rng.integers(*im["output"], n)]
    else:
        e = EMBEDDINGS
        prompt_lens = _lognormal_lengths(rng, n, e["prompt_mean"], e["prompt_sigma"], e["prompt_min"], e["prompt_max"])
        output_lens = [1] * n
    items = []
    for i, (p, o, t) in enumerate(zip(prompt_lens, output_lens, arrivals)):
        if prompt_format == "ids":
            prompt: Union[str, list[int]] = [int(x) for x in rng.integers(FIRST_ID, vocab_size, p)]
        else:
            prompt, p = _text_prompt(rng, words, p, tokenizer)
        images: tuple = ()
        if name == "images":
            count = int(rng.choice(IMAGES["per_request"]))
            sizes = [IMAGES["sizes"][int(k)] for k in rng.integers(0, len(IMAGES["sizes"]), count)]
            images = tuple(random_png(rng, w, h) for w, h in sizes)
        items.append(WorkItem(i, prompt, p, min(o, max_output_len) if max_output_len else o, t, images=images,
                              kind="generate" if name == "images" else "embed"))
    return items


def _head_of_line_lengths(rng: np.random.Generator, n: int) -> tuple[list[int], list[int]]:
    h = HOL
    large = [i % h["every"] == 0 for i in range(n)]
    prompts = [h["large_prompt"] if big else int(rng.integers(*h["small_prompt"])) for big in large]
    outputs = [h["large_output"] if big else int(rng.integers(*h["small_output"])) for big in large]
    return prompts, outputs


def _from_file(path: Path, num_requests: int, rng: np.random.Generator, rate: Optional[float]) -> list[WorkItem]:
    if not path.is_file():
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)} or a .jsonl file; "
                         f"{str(path)!r} is neither")
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompt = row["prompt"] if "prompt" in row else [int(t) for t in row["input_ids"]]
            max_tokens = int(row.get("max_tokens", row.get("output_len", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: expected {{\"prompt\" or \"input_ids\", \"max_tokens\"}}: {exc}") from None
        if max_tokens < 1:
            raise ValueError(f"{path}:{lineno}: max_tokens must be >= 1")
        extra = {"images": tuple(base64.b64decode(x) for x in row.get("images", ())), "kind": row.get("kind", "generate")}
        rows.append((prompt, max_tokens, row.get("arrival_s"), bool(row.get("ignore_eos", True)), extra))
    if not rows:
        raise ValueError(f"{path}: no requests in it")
    arrivals = _arrivals(rng, num_requests, rate)
    items = []
    for i in range(num_requests):
        prompt, max_tokens, arrival, ignore_eos, extra = rows[i % len(rows)]
        n = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        t = float(arrival) if arrival is not None and rate is None and i < len(rows) else arrivals[i]
        items.append(WorkItem(i, prompt, n, max_tokens, t, ignore_eos, **extra))
    return items


def summary(items: Sequence[WorkItem]) -> dict:
    """Lengths at a glance, for the report."""
    p = np.array([w.prompt_len for w in items])
    o = np.array([w.max_tokens for w in items])
    return {"num_requests": len(items), "prompt_len_mean": float(p.mean()), "prompt_len_max": int(p.max()),
            "output_len_mean": float(o.mean()), "output_len_max": int(o.max()),
            "total_output_tokens": int(o.sum()), "images": sum(len(w.images) for w in items),
            "embeddings": sum(w.kind == "embed" for w in items)}


def write_jsonl(items: Sequence[WorkItem], path: Union[str, Path]) -> None:
    """Save a workload so another tool (or another run) replays exactly these requests."""
    with open(path, "w", encoding="utf-8") as f:
        for w in items:
            key = "prompt" if isinstance(w.prompt, str) else "input_ids"
            f.write(json.dumps({key: w.prompt, "max_tokens": w.max_tokens, "arrival_s": w.arrival_s,
                                "ignore_eos": w.ignore_eos,
                                **({"images": [base64.b64encode(x).decode() for x in w.images]} if w.images else {}),
                                **({"kind": w.kind} if w.kind != "generate" else {})}) + "\n")
