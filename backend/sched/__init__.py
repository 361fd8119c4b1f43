"""sched: who runs each engine step, with how many tokens, and the plan the worker gets of it. No
torch at import.

- `scheduler.py`: batch forming for in-flight batching (`Scheduler`), composed of `pool.py` (who
  waits and who runs, and every move between them), `admission.py` (which waiting requests start;
  `backfill.py` for the head's reservation; `siblings.py` for the n sequences of one prompt, a beam
  search's started as one; `tier_admission.py` for a prefix the KV tiers bring back), `policies.py` (capacity: who may hold KV blocks) and
  `batching.py` (the `batching_mode` gates); `batch.py`, its batch of one step over live requests;
- `step_plan.py`: the step plan made of a batch (backend/core/step.py): what the worker does not
  know yet of each sequence, by id; with the grammar bitmask of the constrained rows (`grammar.py`:
  each sequence's grammar state, advanced by the update) and the KV tiers' copies;
- `step_cost.py`: the engine's model of its step time; `pacing.py`: the prefill pacer on it; `tier_choice.py`:
  whether a prefix the KV tiers hold is loaded or computed again, priced by that model;
- `speculation.py`: room for drafts in a formed batch; `lora_slots.py`: adapters per step;
  `grammar_waitlist.py`: requests whose constraint compiles, out of the queue until it is ready;
- `padded.py`: request-level padded batches (static, dynamic), all of them; `factory.py` picks one.
May import core, text and kv. See docs/design.md, "Scheduling and admission".
"""
