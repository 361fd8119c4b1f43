"""Multi-LoRA serving: PEFT adapters applied beside the base weights, mixed in one step.

- `sources.py` (no torch): where adapters come from (`multi_lora.json` in the checkpoint folder,
  the `lora_modules` parameter, `inflight serve --lora-modules`), `LoRARequest`, the names.
- `peft_format.py`: reads and checks a PEFT adapter folder against the base model.
- `manager.py`: the loaded adapters (by name), their resident slots on the device, run-time
  load and unload.
- `bank.py`: the device tensors of the resident adapters, stacked per projection.
- `segments.py` (no torch): a step's rows grouped by adapter, once per step.
- `step.py`: the per-step object every layer reads (`AttentionContext.lora`): the low-rank
  products of each adapter segment, added to a projection's output.
See docs/lora.md.
"""
