"""The tools around the client library and the engine, in packages by purpose: `benchmarks/`,
`gpu_check/` (`inflight gpu-check`), `load/` (the soak test and the Locust files), `quality/`,
`peers/` and `docs/` (the map of docs/design.md). No loose modules here. The library itself
(`client.protocol`, `client.grpc_client`, `client.http_client`) needs none of them, and nothing
outside client/ imports them (tests/test_import_graph.py); the server launchers are serving/."""
