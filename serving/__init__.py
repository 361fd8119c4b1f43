"""The production launch code that `inflight serve` runs: the tritonserver launcher
(`triton_launcher.py`, with `triton_install.py`: the wheel's binary, its Python stub, its environment;
`run_repository.py`: the run copy of the model repository; `triton_log.py`: what is read back from
its log; `stub_watch.py`: stubs Triton gave up on, and its known crashes at start; `proc_stacks.py`:
where its threads stand, read from /proc; `shm_regions.py`: its stubs' shared memory; `ports.py`:
free ports; `process_group.py`: a child that dies with its parent, a process group ended whole) and
the OpenAI server's launcher (`openai_launcher.py`). Nothing here imports client.tools: serving
never depends on a tool (tests/test_import_graph.py)."""
