"""The production launch code that `inflight serve` runs: the tritonserver launcher
(`triton_launcher.py`, with `triton_install.py`: the wheel's binary, its Python stub, its environment;
`run_repository.py`: the run copy of the model repository; `triton_log.py`: what is read back from its log; `ports.py`: free ports)
and the OpenAI server's launcher (`openai_launcher.py`). Nothing here imports client.tools: serving
never depends on a tool (tests/test_import_graph.py)."""
