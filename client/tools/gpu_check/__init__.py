"""`inflight gpu-check`: the GPU acceptance script (`run.py`), its plan (`plan.py`), report
(`report.py`) and parts, each run in its own process (compile, engine, greedy, served, structured,
tiers, tp). Runs from a plain source checkout on a bare GPU image: `python -m client.tools.gpu_check`."""
