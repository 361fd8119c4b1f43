"""LoRA as the model sees it (docs/lora.md): PEFT adapter folders read and checked against the base
model (`peft_format.py`), the adapters a server is configured with, checked before it starts
(`served.py`), and `lora_project` (`project.py`), the one call a layer makes per projection to get
the step's adapter deltas added. Where adapters come from and their names: core/lora.py; their device
tensors, slots and per-step products: worker/lora/; admission by adapter: sched/lora_slots.py;
adapters by name: engine/loras.py.
"""
