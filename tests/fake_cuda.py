"""`torch.cuda` as a machine with GPUs would answer, for rehearsing the GPU path on the CPU.

`FakeCuda.install(monkeypatch)` patches the `torch.cuda` functions the engine calls (availability,
device count, current/set device with torch's own refusal of an index-less device, capability,
properties, free memory, the allocator's statistics, synchronize) and `backend.worker.device.
tensor_device_for`, so an engine that selects, binds and sizes `cuda:1` computes on CPU tensors.
Each GPU has its own memory figures, so using the wrong device shows in the numbers. Every call is
recorded with the device it named (`calls`).

Streams and events (the KV tiers' copies, backend/worker/kv_copier.py) are recorded in order in
`timeline`: ("wait_stream", waiter, waited), ("record", event, stream), ("wait_event", stream,
event), ("enter", stream) / ("exit", stream) for `torch.cuda.stream(...)`. Work on the CPU is done
when it is issued, so an event completes when recorded, unless `hold_events` is set: then it stays
pending (query() is False) until `release_events()`, which is how a test keeps a copy "in flight".
Host memory asked for pinned (backend.worker.device.host_empty) is recorded in `pinned` (its bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

GIB = 2 ** 30
MIB = 2 ** 20


@dataclass
class FakeGpu:
    total: int
    free: int                 # what mem_get_info reports as free (after every other allocation)
    allocated: int = 0        # torch.cuda.memory_allocated before the warm-up
    activation: int = 0       # what max_memory_allocated rises by over the warm-up


class FakeStream:
    def __init__(self, cuda: "FakeCuda", name: str):
        self.cuda, self.name = cuda, name

    def wait_stream(self, other: "FakeStream") -> None:
        self.cuda.timeline.append(("wait_stream", self, other))

    def wait_event(self, event: "FakeEvent") -> None:
        self.cuda.timeline.append(("wait_event", self, event))

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, cuda: "FakeCuda"):
        self.cuda, self.complete, self.stream = cuda, True, None

    def record(self, stream: "FakeStream" = None) -> None:
        self.stream = stream or self.cuda.now
        self.complete = not self.cuda.hold_events
        self.cuda.events.append(self)
        self.cuda.timeline.append(("record", self, self.stream))

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True


@dataclass
class FakeCuda:
    # Small figures: the KV cache sized from them is allocated for real, on the CPU.
    gpus: list[FakeGpu] = field(default_factory=lambda: [FakeGpu(2 * GIB, 1536 * MIB, 64 * MIB, 96 * MIB),
                                                          FakeGpu(GIB, 384 * MIB, 32 * MIB, 48 * MIB)])
    capability: tuple[int, int] = (9, 0)
    current: int = 0
    calls: list[tuple[str, int]] = field(default_factory=list)
    peak_reset: set = field(default_factory=set)
    timeline: list = field(default_factory=list)
    events: list = field(default_factory=list)
    hold_events: bool = False
    pinned: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.compute = FakeStream(self, "compute")  # the default stream, where the model runs
        self.now = self.compute

    def _index(self, name: str, device=None) -> int:
        if device is None:
            index = self.current
        elif isinstance(device, int):
            index = device
        else:
            device = torch.device(device)
            index = self.current if device.index is None else device.index
        if not 0 <= index < len(self.gpus):
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.calls.append((name, index))
        return index

    # -- the torch.cuda functions ----------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.gpus)

    def current_device(self) -> int:
        return self.current

    def set_device(self, device) -> None:
        if isinstance(device, (str, torch.device)) and torch.device(device).index is None:
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:cuda")
        self.current = self._index("set_device", device)

    def get_device_capability(self, device=None) -> tuple[int, int]:
        self._index("get_device_capability", device)
        return self.capability

    def get_device_properties(self, device=None):
        i = self._index("get_device_properties", device)
        return SimpleNamespace(name="Fake H200", uuid=f"GPU-fake-{i}", total_memory=self.gpus[i].total,
                               multi_processor_count=132, major=self.capability[0], minor=self.capability[1])

    def get_device_name(self, device=None) -> str:
        return self.get_device_properties(device).name

    def mem_get_info(self, device=None) -> tuple[int, int]:
        gpu = self.gpus[self._index("mem_get_info", device)]
        return gpu.free, gpu.total

    def memory_allocated(self, device=None) -> int:
        return self.gpus[self._index("memory_allocated", device)].allocated

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak_reset.add(self._index("reset_peak_memory_stats", device))

    def max_memory_allocated(self, device=None) -> int:
        i = self._index("max_memory_allocated", device)
        gpu = self.gpus[i]
        return gpu.allocated + (gpu.activation if i in self.peak_reset else 0)

    def synchronize(self, device=None) -> None:
        self._index("synchronize", device)

    def empty_cache(self) -> None:
        self.calls.append(("empty_cache", self.current))

    # -- streams, events, pinned memory -----------------------------------------------------------
    def stream_and_event_classes(self) -> tuple[type, type]:
        """torch.cuda.Stream and Event as classes bound to this fake (code that only names them as
        types, `torch.cuda.Stream | None` in transformers, keeps working)."""
        cuda = self

        class Stream(FakeStream):
            def __init__(self, device=None, priority=0):
                super().__init__(cuda, "copy")

        class Event(FakeEvent):
            def __init__(self, *args, **kwargs):
                super().__init__(cuda)

        return Stream, Event

    def current_stream(self, device=None) -> FakeStream:
        return self.now

    def stream(self, stream: FakeStream):
        cuda = self

        class _On:
            def __enter__(self):
                self.before, cuda.now = cuda.now, stream
                cuda.timeline.append(("enter", stream))

            def __exit__(self, *exc):
                cuda.now = self.before
                cuda.timeline.append(("exit", stream))
        return _On()

    def host_empty(self, num_bytes: int, pinned: bool) -> torch.Tensor:
        if pinned:
            self.pinned.append(num_bytes)
        return torch.empty(num_bytes, dtype=torch.uint8)

    def release_events(self) -> None:
        for event in self.events:
            event.complete = True

    FUNCTIONS = ("is_available", "device_count", "current_device", "set_device", "get_device_capability",
                 "get_device_properties", "get_device_name", "mem_get_info", "memory_allocated",
                 "reset_peak_memory_stats", "max_memory_allocated", "synchronize", "empty_cache",
                 "current_stream", "stream")

    def install(self, monkeypatch) -> "FakeCuda":
        import backend.worker.device

        for name in self.FUNCTIONS:
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        for cls in self.stream_and_event_classes():
            monkeypatch.setattr(torch.cuda, cls.__name__, cls)
        monkeypatch.setattr(backend.worker.device, "tensor_device_for",
                            lambda device: torch.device("cpu") if device.type == "cuda" else device)
        monkeypatch.setattr(backend.worker.device, "host_empty", self.host_empty)
        return self

    def devices_used(self, *names: str) -> set[int]:
        return {i for name, i in self.calls if not names or name in names}
