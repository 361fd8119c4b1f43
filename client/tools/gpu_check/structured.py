"""gpu-check's structured part: constrained decoding through the engine on the GPU.

xgrammar's token bitmask is applied to logits on the engine's device (backend/structured/): on a
GPU that is the first time the mask meets device logits. One engine, greedy, two constraints at
once in one batch (so masked and unmasked rows share steps): a JSON schema without optional
whitespace (a random model would spend its tokens on it), whose output must parse and validate, and a choice list, whose output must be one of the choices; and an unconstrained
request beside them must still produce all its tokens. Then the sampling knobs on the same device
(client/tools/gpu_check/sampling.py): the sampler against a numpy sampler on fixed logits
(`knobs`), and min_p, logit_bias, allowed_token_ids, the text switches and truncate_prompt_tokens
through the engine, one of them beside a JSON schema (`knobs_engine`); and beam search, whose
beams copy KV blocks on the device (`beams`: client/tools/gpu_check/beams.py).
"""
from __future__ import annotations

import json
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "count"], "additionalProperties": False}
CHOICES = ["alpha", "beta", "gamma"]


def structured(plan: dict, model_dir: Path, device: str) -> dict:
    from backend import LLM, SamplingParams
    from client.tools.gpu_check.beams import beam_check
    from client.tools.gpu_check.sampling import engine_check, sampler_check

    llm = LLM(str(model_dir), device=device, attention_backend=plan["structured_attention_backend"], max_num_seqs=4,
              max_num_batched_tokens=plan["max_num_batched_tokens"], max_model_len=plan["max_model_len"])
    try:
        greedy = dict(temperature=0.0, max_tokens=48)
        outs = llm.generate(["The record:", "Pick one:", "Free text:"],
                            [SamplingParams(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}, **greedy),
                             SamplingParams(structured_outputs={"choice": CHOICES}, **greedy),
                             SamplingParams(ignore_eos=True, **dict(greedy, max_tokens=8))])
        knobs_engine = engine_check(llm, SCHEMA, device)
        beams = beam_check(llm)  # beam search's copy-on-write on the device (client/tools/gpu_check/beams.py)
    finally:
        llm.close()
    text_json, text_choice, free_text = (o.text for o in outs)
    checks = dict(json=_json_check(text_json), choice=dict(ok=text_choice in CHOICES, text=text_choice),
                  unconstrained=dict(ok=len(outs[2].token_ids) == 8, tokens=len(outs[2].token_ids)),
                  knobs=sampler_check(device), knobs_engine=knobs_engine, beams=beams)
    return dict(checks, ok=all(c["ok"] for c in checks.values()), device=device)


def _json_check(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        return dict(ok=False, text=text[:200], error=f"not JSON: {exc}")
    ok = (isinstance(value, dict) and set(value) == {"name", "count"} and isinstance(value["name"], str)
          and len(value["name"]) <= 8 and isinstance(value["count"], int) and 0 <= value["count"] <= 99)
    return dict(ok=ok, text=text[:200], error="" if ok else "does not match the schema")
