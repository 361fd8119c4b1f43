"""Forming a tensor-parallel group: rank 0 starts it (`start_group`), every other rank joins it
(`join_group`), on this machine or another (see backend/worker/parallel/group.py for the protocol).

Variables (torchrun's names where it has one):
  MASTER_ADDR, MASTER_PORT       where rank 0's rendezvous listens (default 127.0.0.1, a free port)
  INFLIGHT_TP_LOCAL_RANKS        ranks rank 0 starts on its own machine (default all of them); the
                                 others are started elsewhere with `python -m backend.worker.parallel.worker`
  INFLIGHT_TP_JOIN_TIMEOUT       seconds rank 0 waits for ranks to join (default 600)
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import socket
import time
from typing import Optional

import torch
import torch.distributed as dist

from backend.core.config import EngineConfig
from backend.worker.device import resolve_device
from backend.models.loader import load_model_config
from backend.worker.parallel.group import TensorParallelGroup
from backend.worker.parallel.launcher import LocalWorkers
from backend.models.parallel.plan import ShardPlan

SETUP_KEY, JOINED_KEY = "inflight/setup", "inflight/joined/"


def join_timeout() -> float:
    return float(os.environ.get("INFLIGHT_TP_JOIN_TIMEOUT") or 600)


def rendezvous_address() -> tuple[str, int]:
    addr = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = os.environ.get("MASTER_PORT")
    if port:
        return addr, int(port)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((addr, 0))
        return addr, s.getsockname()[1]


def plan_for(config: EngineConfig, model_cfg, rank: int) -> ShardPlan:
    """The rank's ShardPlan, after every divisibility check (heads, MLP, quantization groups)."""
    quantized = model_cfg.quantized_modules if config.quantization in ("auto", "gguf") else None
    return ShardPlan.check(model_cfg, config.tensor_parallel_size, rank, quantized,
                           int8=config.quantization == "int8")


def local_devices(device: torch.device, size: int) -> dict[int, str]:
    """The device of each rank rank 0 starts itself: the instance's device and the next ones (on
    GPU, `cuda:base+r`: instance i of a KIND_MODEL group starts at cuda:i*N, docs/parallelism.md)."""
    local = int(os.environ.get("INFLIGHT_TP_LOCAL_RANKS") or size)
    if not 1 <= local <= size:
        raise ValueError(f"INFLIGHT_TP_LOCAL_RANKS must be 1 to tensor_parallel_size ({size}); got {local}")
    if device.type != "cuda":
        return {r: str(device) for r in range(1, local)}
    count = torch.cuda.device_count()
    last = device.index + local - 1
    if last >= count:
        raise ValueError(
            f"tensor_parallel_size {size}: this engine's ranks need cuda:{device.index} to cuda:{last}; this machine "
            f"has {count} CUDA device(s) (cuda:0 to cuda:{count - 1}). Lower tensor_parallel_size or the number of "
            "instances (docs/parallelism.md)")
    return {r: f"cuda:{device.index + r}" for r in range(1, local)}


def start_group(config: EngineConfig, model_cfg, max_model_len: int) -> Optional[TensorParallelGroup]:
    """Rank 0: check the split, open the rendezvous, start the local ranks, wait until every rank
    has joined, form the group. None when tensor_parallel_size is 1."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    plan = plan_for(config, model_cfg, 0)  # refused here, before any process starts
    device = resolve_device(config.device)
    devices = local_devices(device, size)
    addr, port = rendezvous_address()
    try:
        store = dist.TCPStore(addr, port, size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=join_timeout()))
    except Exception as exc:
        raise RuntimeError(f"tensor-parallel rank 0 cannot open the rendezvous on {addr}:{port} "
                           f"(MASTER_ADDR/MASTER_PORT): {exc}") from None
    store.set(SETUP_KEY, json.dumps({"config": dataclasses.asdict(config), "max_model_len": max_model_len,
                                     "device": str(device)}))
    workers = LocalWorkers()
    try:
        workers.start(devices, addr, port)
        _wait_joined(store, size, workers, addr, port)
        return TensorParallelGroup(0, size, device, store, plan, workers)
    except BaseException:
        workers.stop(0)
        raise


def _wait_joined(store, size: int, workers: LocalWorkers, addr: str, port: int) -> None:
    waiting = set(range(1, size))
    deadline = time.monotonic() + join_timeout()
    while waiting:
        for rank in sorted(waiting):
            if store.check([f"{JOINED_KEY}{rank}"]):
                problem = store.get(f"{JOINED_KEY}{rank}").decode()
                if problem:
                    raise RuntimeError(f"tensor-parallel rank {rank} could not start: {problem}")
                waiting.discard(rank)
        gone = workers.first_exit()
        if gone is not None and gone in waiting:
            raise RuntimeError(f"tensor-parallel {workers.describe(gone)} before it joined the group")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(
                f"tensor-parallel rank(s) {sorted(waiting)} did not join the rendezvous at {addr}:{port} within "
                f"{join_timeout():.0f} s (INFLIGHT_TP_JOIN_TIMEOUT); ranks on other machines start with "
                "`python -m backend.worker.parallel.worker --rank R` and MASTER_ADDR/MASTER_PORT pointing here")
        time.sleep(0.05)


def join_group(rank: int, device_name: Optional[str] = None):
    """Ranks 1..N-1: reach rank 0's rendezvous, take its setup, check this rank can run it, form the
    group. Returns (group, config, model_cfg, max_model_len); raises after telling rank 0 why not."""
    addr, port = os.environ.get("MASTER_ADDR") or "127.0.0.1", os.environ.get("MASTER_PORT")
    if not port:
        raise ValueError(f"tensor-parallel rank {rank}: MASTER_PORT is not set (rank 0's rendezvous port)")
    try:
        store = dist.TCPStore(addr, int(port), is_master=False, timeout=datetime.timedelta(seconds=join_timeout()))
        setup = json.loads(store.get(SETUP_KEY))
    except Exception as exc:
        raise RuntimeError(f"tensor-parallel rank {rank} cannot reach the rendezvous at {addr}:{port}: {exc}") from None
    try:
        config = EngineConfig(**setup["config"])
        if not 0 < rank < config.tensor_parallel_size:
            raise ValueError(f"rank {rank} is not one of 1..{config.tensor_parallel_size - 1} "
                             f"(tensor_parallel_size {config.tensor_parallel_size})")
        leader = torch.device(setup["device"])
        name = device_name or os.environ.get("INFLIGHT_TP_DEVICE") or (
            f"cuda:{int(os.environ.get('LOCAL_RANK') or 0)}" if leader.type == "cuda" else "cpu")
        device = resolve_device(name)
        if device.type != leader.type:
            raise ValueError(f"rank 0 runs on {leader.type} and this rank on {device.type}: every rank of a group "
                             "runs on the same kind of device")
        config = dataclasses.replace(config, device=str(device))
        model_cfg = load_model_config(config.model_path)
        plan = plan_for(config, model_cfg, rank)
    except Exception as exc:
        store.set(f"{JOINED_KEY}{rank}", f"{exc}")
        raise
    store.set(f"{JOINED_KEY}{rank}", "")
    group = TensorParallelGroup(rank, config.tensor_parallel_size, device, store, plan)
    return group, config, model_cfg, int(setup["max_model_len"])
