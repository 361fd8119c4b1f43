"""The tools around the client library: the local server launcher (`server.py`), the benchmark
(`bench*.py`, `workloads.py`), the soak test and the Locust files. The library itself
(`client.protocol`, `client.grpc_client`, `client.http_client`) needs none of them."""
