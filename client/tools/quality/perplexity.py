"""Perplexity of the engine's model on a text, computed the way llama.cpp's `llama-perplexity` does,
so that the two can be set side by side on the same GGUF file (docs/quantization.md, Quality):

    python -m client.tools.quality.perplexity --model-path models/smollm2-135m-instruct-q4_1
    python -m client.tools.quality.perplexity --model-path models/smollm2-135m-instruct-q4_1 --param quantization=none
    python -m client.tools.quality.perplexity --model-path models/gemma3-270m \
        --llama-perplexity ~/.cache/inflight-peers/llama.cpp-build/bin/llama-perplexity \
        --gguf models/.cache/gemma-3-270m-q4_k_m.gguf      # both figures and their ratio

The text (default: tests/data/alice_chapters_1_2.txt, Lewis Carroll, public domain) is tokenized
whole, cut into windows of `--ctx` tokens (the tail that does not fill one is dropped), each window
run through the engine's model in one prefill on a cache of its own (BOS in front of it when the
tokenizer adds one, replacing its first token, as llama-perplexity does), and only the second half
of each window's next-token predictions is scored, so every scored token has at least ctx/2 tokens
of context. Perplexity = exp(mean negative log-likelihood).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from templates.render import parse_param

TEXT = Path(__file__).resolve().parents[3] / "tests" / "data" / "alice_chapters_1_2.txt"


@torch.inference_mode()
def window_logprobs(llm, ids: Sequence[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for i in 0..n-2, from one prefill of ``ids`` through the
    engine's model (its own kernels and weights) on a throwaway paged cache."""
    runner = llm.engine.runner
    n, device = len(ids), runner.env.tensor_device
    tokens = torch.tensor(list(ids), dtype=torch.long, device=device)
    hidden = runner.model(tokens, torch.arange(n, device=device), runner.prefill_context(n), runner.rope)
    logits = runner.model.logits(hidden[:-1]).float()
    return torch.log_softmax(logits, dim=-1).gather(1, tokens[1:, None])[:, 0]


def perplexity(llm, ids: Sequence[int], ctx: int = 512, bos_token_id: Optional[int] = None) -> dict:
    """llama-perplexity's figure over ``ids``: windows of ``ctx``, the second half of each scored."""
    if ctx < 4:
        raise ValueError(f"ctx must be >= 4; got {ctx}")
    windows = len(ids) // ctx
    if windows < 1:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {ctx}")
    first = ctx // 2
    nll, count = 0.0, 0
    for w in range(windows):
        window = list(ids[w * ctx:(w + 1) * ctx])
        if bos_token_id is not None:
            window[0] = bos_token_id
        logprobs = window_logprobs(llm, window)[first - 1:]  # predictions of tokens first..ctx-1
        nll -= float(logprobs.double().sum())
        count += len(logprobs)
    return {"perplexity": math.exp(nll / count), "scored_tokens": count, "windows": windows, "ctx": ctx,
            "text_tokens": len(ids)}


def text_perplexity(llm, text: str, ctx: int = 512) -> dict:
    """``perplexity`` of ``text`` as tokenized by the engine's tokenizer, with BOS in front of each
    window when the tokenizer adds one (as llama-perplexity does)."""
    tokenizer = llm.tokenizer
    ids = tokenizer.encode(text)
    add_bos = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    return perplexity(llm, ids, ctx, tokenizer.bos_token_id if add_bos else None)


def llama_perplexity(binary: Path, gguf: Path, text: Path, ctx: int = 512, threads: int = 2) -> dict:
    """llama.cpp's own figure for the same text and windows: ``llama-perplexity`` run on the GGUF
    file, its "Final estimate: PPL = ..." read back."""
    cmd = [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if done.returncode != 0 or not found:
        tail = (done.stdout + done.stderr)[-2000:]
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode} without a final estimate:\n{tail}")
    return {"perplexity": float(found.group(1)), "command": " ".join(cmd)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.quality.perplexity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--param", action="append", type=parse_param, default=[], metavar="KEY=VALUE",
                   help="an engine parameter (config.pbtxt key), e.g. quantization=none")
    p.add_argument("--llama-perplexity", type=Path, metavar="BIN",
                   help="also run llama.cpp's llama-perplexity on --gguf (same text, same windows)")
    p.add_argument("--gguf", type=Path, help="the GGUF file the model was imported from")
    p.add_argument("--threads", type=int, default=2, help="llama-perplexity's -t")
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    if args.llama_perplexity and not args.gguf:
        p.error("--llama-perplexity needs --gguf")
    from backend import LLM, EngineConfig
    params = dict(args.param)
    overrides = EngineConfig.typed_overrides(params)
    # the windows run on caches of their own: the engine's needs only a token
    llm = LLM(args.model_path, **{"max_model_len": max(args.ctx, 64), "cpu_kv_cache_tokens": 64, **overrides})
    result = text_perplexity(llm, args.text.read_text(encoding="utf-8"), args.ctx)
    result.update(model_path=args.model_path, text=str(args.text), params=params,
                  quantization=llm.engine.runner.weights.quantization)
    print(f"perplexity {result['perplexity']:.4f} over {result['scored_tokens']} tokens "
          f"({result['windows']} windows of {args.ctx}); {llm.engine.runner.weights.summary}")
    if args.llama_perplexity:
        peer = llama_perplexity(args.llama_perplexity, args.gguf, args.text, args.ctx, args.threads)
        result["llama_perplexity"] = peer
        print(f"llama-perplexity {peer['perplexity']:.4f} ({peer['command']}); inflight / llama.cpp "
              f"{result['perplexity'] / peer['perplexity']:.4f}")
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
