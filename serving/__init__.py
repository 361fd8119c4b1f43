"""The production launch code that `inflight serve` runs: the tritonserver launcher
(`triton_launcher.py`: the wheel's binary, its Python stub, the run copy of the model repository)
and the OpenAI server's launcher (`openai_launcher.py`). Nothing here imports client.tools: serving
never depends on a tool (tests/test_import_graph.py)."""
