"""The TensorRT-LLM ensemble's inputs that are not plain sampling keys (beam_width, return_log_probs,
end_id, pad_id, embedding_bias_words / embedding_bias_weights), turned into the request's sampling
keys where inflight has the feature and refused by name where it does not. No Triton imports."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import numpy as np

from tensor_values import tensor_strings, tensor_value

Encode = Callable[[str], list[int]]  # text -> token ids, no special tokens added


def trtllm_inputs(get: Mapping[str, np.ndarray], sampling: dict[str, Any], vocab_size: Optional[int]) -> None:
    """The TensorRT-LLM ensemble's inputs that are not plain sampling keys: honoured where we have
    the feature, refused by name where we do not."""
    if "beam_width" in get and tensor_value("beam_width", get["beam_width"]) != 1:  # beam search (docs/beam_search.md)
        width = tensor_value("beam_width", get["beam_width"])
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"beam_width must be an integer >= 1; got {width}")
        sampling.update(use_beam_search=True, best_of=width)
        sampling.setdefault("n", width)  # TensorRT-LLM returns every beam (num_return_sequences: fewer)
        sampling.setdefault("temperature", 0.0)
    if "return_log_probs" in get and tensor_value("return_log_probs", get["return_log_probs"]):
        if sampling.get("logprobs") is None:  # the engine's logprobs: 0 is the sampled token's alone (beams too)
            sampling["logprobs"] = 0
    if "end_id" in get:  # TensorRT-LLM: this token ends generation in place of the model's EOS
        end_id = tensor_value("end_id", get["end_id"])
        if end_id < 0 or (vocab_size is not None and end_id >= vocab_size):
            # -1 would otherwise end nothing: the model's EOS off, silently
            raise ValueError(f"end_id must be a token id in [0, {vocab_size or 'the vocabulary size'}); got {end_id} "
                             "(to generate past EOS, send ignore_eos=true)")
        sampling["stop_token_ids"] = list(sampling.get("stop_token_ids", [])) + [end_id]
        sampling["ignore_eos"] = True
    if "pad_id" in get:  # no effect: outputs are padded only across beams, with -1
        tensor_value("pad_id", get["pad_id"])


def embedding_bias(get: Mapping[str, np.ndarray], sampling: dict[str, Any], encode: Optional[Encode]) -> None:
    """TensorRT-LLM's embedding_bias_words / embedding_bias_weights: each word's tokens get its
    weight (summed where words share a token), added to the request's logit_bias."""
    words, weights = get.get("embedding_bias_words"), get.get("embedding_bias_weights")
    if words is None and weights is None:
        return
    if words is None or weights is None:
        raise ValueError("embedding_bias_words and embedding_bias_weights go together (one weight per word)")
    words = tensor_strings("embedding_bias_words", words)
    if weights.dtype.kind not in "fiu" or weights.size != len(words):
        raise ValueError(f"embedding_bias_weights must hold one FP32 weight per word ({len(words)}); "
                         f"got {weights.size} of {weights.dtype}")
    if encode is None:
        raise ValueError("embedding_bias_words needs a tokenizer: this checkpoint has no tokenizer.json")
    bias: dict[int, float] = {}
    for word, weight in zip(words, weights.reshape(-1).tolist()):
        for tok in encode(word):
            bias[tok] = bias.get(tok, 0.0) + float(weight)
    for tok, value in (sampling.get("logit_bias") or {}).items():
        tok = int(tok)
        bias[tok] = bias.get(tok, 0.0) + float(value)
    sampling["logit_bias"] = bias
