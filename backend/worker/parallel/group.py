"""A tensor-parallel group over torch.distributed: the rendezvous, the collectives, a lost rank.

Rendezvous (torchrun's variables): rank 0 listens on MASTER_ADDR:MASTER_PORT (default 127.0.0.1
and a free port) with a TCPStore, writes the engine's setup there (the EngineConfig, the
max_model_len, its device) and starts the local ranks (backend/worker/parallel/launcher.py). Ranks on
other machines are started there with the same variables pointing at rank 0
(`python -m backend.worker.parallel.worker --rank R`): the code is the same. Every rank reports in the
store that it started (or why it could not) before the process group forms, so a rank that cannot
start is an error at load that names it, not a timeout.

Two groups: the model's collectives (NCCL on GPU, gloo on CPU) and, on GPU, a gloo group for the
step messages, which rank 0 builds on the host (step_message.py): a worker reads the header's
shapes on the host without waiting for its device. On CPU one gloo group does both.

A rank that dies: gloo's pending collectives fail at once (the peer's socket closes); rank 0 also
watches its local workers' processes, so an idle engine learns it too. Either way the group
records why (the rank, its exit, its last output) and calls `on_failure` callbacks once: the engine
then fails what runs and refuses new requests (backend/engine/async_engine.py).
"""
from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections import defaultdict
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist

from backend.worker.device import DeviceEnv
from backend.core.errors import RankLostError
from backend.worker.parallel import shm
from backend.worker.parallel.launcher import LocalWorkers
from backend.models.parallel.plan import ShardPlan
from backend.worker.parallel.step_message import HEADER_LEN, STEP, STOP, StepMessage, decode, encode, payload_length

log = logging.getLogger(__name__)
FAILED_KEY = "inflight/failed/"  # + rank: why a rank that had joined could not go on
LEFT_KEY = "inflight/left/"  # + rank: the rank has left the process group after STOP
SHM_KEY = "inflight/shm"  # the shared-memory segment of the ranks' collectives ("" when gloo carries them)
LEAVE_TIMEOUT = 10.0  # seconds rank 0 waits for the ranks on other machines to leave
# Waiting for the next step is not a fault: an idle server's workers wait in a broadcast for hours.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelGroup:
    """This process's rank of a tensor-parallel group: the collectives, timed, and the fault watch."""

    def __init__(self, rank: int, size: int, device: torch.device, store, plan: ShardPlan,
                 workers: Optional[LocalWorkers] = None):
        self.rank, self.size, self.device, self.store, self.plan = rank, size, device, store, plan
        self.workers = workers
        # NCCL where the tensors are on a GPU; gloo on the CPU (and in the CPU rehearsal of a GPU)
        self.backend = "nccl" if DeviceEnv.for_device(device).tensor_device.type == "cuda" else "gloo"
        self.seconds: dict[str, float] = defaultdict(float)  # time in collectives, by kind (host clock)
        self.calls: dict[str, int] = defaultdict(int)
        self.failure: Optional[str] = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._closed = False
        if dist.is_initialized():
            raise RuntimeError("a tensor-parallel engine already runs in this process (one per process)")
        kwargs = {"device_id": device} if self.backend == "nccl" else {}
        timeout = IDLE_TIMEOUT if self.backend == "gloo" else datetime.timedelta(minutes=10)
        dist.init_process_group(self.backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=size,
                                timeout=timeout, **kwargs)
        self.cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT) if self.backend == "nccl" else None
        self.shm = self._shared_memory()
        if workers is not None:
            threading.Thread(target=self._watch, name="inflight-tp-watch", daemon=True).start()

    def _shared_memory(self) -> Optional[shm.ShmCollectives]:
        """On the CPU with every rank on rank 0's machine: the collectives through shared memory
        (shm.py; INFLIGHT_TP_SHM=0 keeps gloo). Rank 0 decides and says so in the store."""
        if self.backend != "gloo":
            return None
        if self.rank == 0:
            local = self.workers is not None and len(self.workers.procs) == self.size - 1
            on = local and shm.usable() and os.environ.get("INFLIGHT_TP_SHM", "1") != "0"
            name = shm.new_segment_name() if on else ""
            segment = shm.ShmCollectives(name, 0, self.size, lambda: self.failure, create=True) if on else None
            self.store.set(SHM_KEY, name)
            if segment is not None:  # every rank maps it, then its file goes
                self.store.wait([f"{SHM_KEY}/{r}" for r in range(1, self.size)])
                segment.unlink()
            return segment
        name = self.store.get(SHM_KEY).decode()
        segment = shm.ShmCollectives(name, self.rank, self.size, lambda: self.failure) if name else None
        if segment is not None:
            self.store.set(f"{SHM_KEY}/{self.rank}", "")
        return segment

    # -- the model's collectives -------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (a row-parallel layer's partial outputs)."""
        with self._timed("all_reduce"):
            if self.shm is not None and self.shm.fits(tensor):
                self.shm.all_reduce(tensor)
            else:
                dist.all_reduce(tensor)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` side by side along the last dimension (the vocabulary shards)."""
        if self.shm is not None and self.shm.fits(tensor):
            with self._timed("all_gather"):
                return self.shm.all_gather_last(tensor)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        with self._timed("all_gather"):
            dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's `tensor` on every rank, in place (a step's image rows: parallel/vision.py)."""
        with self._timed("broadcast"):
            if self.shm is not None and self.shm.fits(tensor):
                self.shm.broadcast(tensor)
            else:
                dist.broadcast(tensor, src=0)
        return tensor

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value` (KV blocks: the group's capacity is its smallest rank's)."""
        return min(self.gather_ints(value))

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's `value`, by rank (at start: each rank's KV blocks; whether it runs the C stack)."""
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        with self._timed("setup"):
            dist.all_gather(parts, torch.tensor([value], dtype=torch.int64), group=self.cpu_group)
        return [int(p.item()) for p in parts]

    def count(self, kind: str, calls: int, seconds: float) -> None:
        """Collectives made where `_timed` does not see them (the C layer stack's: kernels/cpu/shm_reduce.py)."""
        self.calls[kind] += calls
        self.seconds[kind] += seconds

    # -- the step message --------------------------------------------------------------------------
    def send_step(self, plan, graph_size: int = 0, lora: tuple = ((), ())) -> None:
        """Rank 0: the step every rank runs next (its plan, backend/core/step.py)."""
        self._send(StepMessage(STEP, graph_size, plan, lora))

    def receive_step(self) -> StepMessage:
        """Ranks 1..N-1: the next step (or STOP) rank 0 sends."""
        header = np.zeros(HEADER_LEN, dtype=np.int64)
        with self._timed("step_message"):
            self._broadcast(header)
            payload = np.empty(payload_length(header), dtype=np.int64)
            if payload.size:
                self._broadcast(payload)
        return decode(header, payload)

    def _send(self, message: StepMessage) -> None:
        header, payload = encode(message)
        with self._timed("step_message"):
            self._broadcast(header)
            if payload.size:
                self._broadcast(payload)

    def _broadcast(self, array: np.ndarray) -> None:
        dist.broadcast(torch.from_numpy(array), src=0, group=self.cpu_group)

    # -- faults ------------------------------------------------------------------------------------
    def _timed(self, kind: str):
        return _Timed(self, kind)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once when a rank is lost (at once if it already was)."""
        with self._lock:
            failed = self.failure
            if failed is None:
                self._callbacks.append(callback)
        if failed is not None:
            callback(failed)

    def lost(self, exc: BaseException) -> RankLostError:
        """The error a failed collective becomes: which rank was lost and how, when it can be told."""
        if self._closed:
            return RankLostError(f"the tensor-parallel group is closed ({exc})")
        deadline = time.monotonic() + 2.0  # the socket closes a moment before the exit shows
        reason = None
        while reason is None and time.monotonic() < deadline:
            reason = self._diagnose()
            if reason is None:
                time.sleep(0.05)
        self._fail(reason or f"a tensor-parallel collective failed: {exc}")
        return RankLostError(self.failure)

    def _diagnose(self) -> Optional[str]:
        for rank in range(self.size):
            try:
                if rank != self.rank and self.store.check([f"{FAILED_KEY}{rank}"]):
                    return f"tensor-parallel rank {rank} failed: {self.store.get(f'{FAILED_KEY}{rank}').decode()}"
            except Exception:  # the store lives in rank 0: gone with it
                return "tensor-parallel rank 0 is gone (its rendezvous store closed)"
        if self.workers is not None:
            rank = self.workers.first_exit()
            if rank is not None:
                return f"tensor-parallel {self.workers.describe(rank)}"
        return None

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            callbacks, self._callbacks = self._callbacks, []
        if getattr(self, "shm", None) is not None:  # a C all-reduce's wait stops too
            self.shm.fail()
        log.error("%s; the engine cannot run any step: restart it", reason)
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("a tensor-parallel failure callback failed")

    def report_failure(self, message: str) -> None:
        """A worker that cannot go on says why, for rank 0's error (before it exits)."""
        try:
            self.store.set(f"{FAILED_KEY}{self.rank}", message[-2000:])
        except Exception:
            pass

    def _watch(self) -> None:
        """Rank 0: notice a local worker's death even while no step runs."""
        while not self._closed and self.failure is None:
            rank = self.workers.first_exit()
            if rank is not None and not self._closed:
                reason = self._diagnose()
                self._fail(reason or f"tensor-parallel {self.workers.describe(rank)}")
                if self.backend == "nccl":  # a pending NCCL collective would wait for the dead rank
                    try:
                        dist.distributed_c10d._abort_process_group()
                    except Exception:
                        log.exception("aborting the NCCL communicators failed")
                return
            time.sleep(0.2)

    # -- the end -----------------------------------------------------------------------------------
    def close(self, graceful: bool = True) -> None:
        """Rank 0: tell the workers to stop (graceful: they wait for the next step; not while they
        may still be starting) and end them; every rank: leave the process group."""
        if self._closed:
            return
        if self.rank == 0 and self.failure is None and graceful:
            try:
                self._send(StepMessage(STOP))
            except Exception:
                log.warning("could not send STOP to the tensor-parallel ranks; ending them")
        self._closed, self._callbacks = True, []  # a closed group tells no one (the AsyncEngine's callback goes)
        if self.shm is not None:
            self.shm.close()
        if self.workers is not None:
            self.workers.stop(LEAVE_TIMEOUT if graceful else 0.0)
        if self.rank == 0 and self.failure is None and graceful:
            self._wait_remote_ranks_left()
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.rank != 0:
            try:
                self.store.set(f"{LEFT_KEY}{self.rank}", "")
            except Exception:  # rank 0 already gone: nobody waits
                pass

    def _wait_remote_ranks_left(self) -> None:
        """Rank 0 holds the store every rank's group runs on: closing it while a rank started elsewhere
        still tears its group down makes that rank abort (SIGABRT). The local ranks have exited."""
        remote = [r for r in range(1, self.size) if self.workers is None or r not in self.workers.procs]
        deadline = time.monotonic() + LEAVE_TIMEOUT
        while remote and time.monotonic() < deadline:
            remote = [r for r in remote if not self.store.check([f"{LEFT_KEY}{r}"])]
            if remote:
                time.sleep(0.02)

    def stats(self) -> dict:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}


class _Timed:
    """Times a collective (host clock: exact on CPU, launch time only for NCCL) and turns its failure
    into a RankLostError naming the rank."""

    def __init__(self, group: TensorParallelGroup, kind: str):
        self.group, self.kind = group, kind

    def __enter__(self):
        self.t0 = time.perf_counter()

    def __exit__(self, exc_type, exc, tb):
        self.group.seconds[self.kind] += time.perf_counter() - self.t0
        self.group.calls[self.kind] += 1
        if exc is not None and not isinstance(exc, RankLostError) and isinstance(exc, (RuntimeError, OSError)):
            raise self.group.lost(exc) from exc
        return False

