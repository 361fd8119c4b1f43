"""Scheduling: who runs each engine step, and with how many tokens. No torch here.

- `step.py`: the step contract (`ScheduledSeq`, `SchedulerOutput`, `Sampled`), data only: all the
  model runner imports from here;
- `scheduler.py`: batch forming for in-flight batching (`Scheduler`), composed of
  `pool.py` (who waits and who runs, and every move between them), `admission.py` (which waiting
  requests start; `backfill.py` for the head's reservation), `policies.py` (capacity: who may hold
  KV blocks) and `batching.py` (the `batching_mode` gates);
- `padded.py`: request-level padded batches (static, dynamic), all of them;
- `factory.py`: `make_scheduler`, which picks one.
See docs/design.md, "Scheduling and admission".
"""
