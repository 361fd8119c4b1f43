"""Perplexity of the engine's model on a text, computed the way llama.cpp's `llama-perplexity` does,
so that the two can be set side by side on the same GGUF file (docs/quantization.md, Quality):

    python -m client.tools.perplexity --model-path models/smollm2-135m-instruct-q4_1
    python -m client.tools.perplexity --model-path models/smollm2-135m-instruct-q4_1 --param quantization=none

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
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from templates.render import parse_param

TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "alice_chapters_1_2.txt"


@torch.inference_mode()
def window_logprobs(llm, ids: Sequence[int]) -> torch.Tensor:
    """log p(ids[i + 1] | ids[: i + 1]) for i in 0..n-2, from one prefill of ``ids`` through the
    engine's model (its own kernels and weights) on a throwaway paged cache."""
    from backend.attention import AttentionContext
    runner = llm.engine.runner
    cfg, n, bs = runner.model_cfg, len(ids), runner.block_size
    blocks = -(-n // bs)
    shape = (blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.zeros(shape, dtype=runner.kv_dtype), torch.zeros(shape, dtype=runner.kv_dtype))
              for _ in range(cfg.num_layers)]
    table = torch.arange(blocks, dtype=torch.int32)[None]
    lens = torch.tensor([n], dtype=torch.int32)
    ctx = AttentionContext(ops=runner.ops, kv_caches=caches, scale=cfg.attention_scale,
                           layer_windows=cfg.layer_windows,
                           slot_mapping=torch.arange(n), num_decode_tokens=0,
                           decode_block_tables=table[:0], decode_seq_lens=lens[:0],
                           prefill_block_tables=table, prefill_cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                           prefill_seq_lens=lens, prefill_max_q_len=n)
    tokens = torch.tensor(list(ids), dtype=torch.long)
    hidden = runner.model(tokens, torch.arange(n), ctx, runner.rope)
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.tools.perplexity", description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--param", action="append", type=parse_param, default=[], metavar="KEY=VALUE",
                   help="an engine parameter (config.pbtxt key), e.g. quantization=none")
    p.add_argument("--output-json", type=Path)
    args = p.parse_args(argv)
    from backend import LLM, EngineConfig
    from backend.text.tokenizer import Tokenizer
    params = dict(args.param)
    overrides = EngineConfig.typed_overrides(params)
    tokenizer = Tokenizer.from_dir(args.model_path)
    ids = tokenizer.encode(args.text.read_text(encoding="utf-8"))
    # the windows run on caches of their own: the engine's needs only a token
    llm = LLM(args.model_path, **{"max_model_len": max(args.ctx, 64), "cpu_kv_cache_tokens": 64, **overrides})
    add_bos = ids[:1] == [tokenizer.bos_token_id] and tokenizer.bos_token_id is not None
    result = perplexity(llm, ids, args.ctx, tokenizer.bos_token_id if add_bos else None)
    result.update(model_path=args.model_path, text=str(args.text), params=params,
                  quantization=llm.engine.runner.weights.quantization)
    print(f"perplexity {result['perplexity']:.4f} over {result['scored_tokens']} tokens "
          f"({result['windows']} windows of {args.ctx}); {llm.engine.runner.weights.summary}")
    if args.output_json:
        args.output_json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
