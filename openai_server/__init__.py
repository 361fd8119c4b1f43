"""An OpenAI-compatible HTTP server in front of the `llm` model: a thin translator to Triton over
gRPC (the engine stays inside Triton).

    python -m openai_server --grpc-url localhost:8001 --model-path models/default --port 9000

`inflight serve` starts it beside tritonserver (`--openai-port`, default 9000; 0 turns it off).
"""
