"""The engine's device: which one `device` and `dtype` name, and what the runner asks of it.

Everything the runner needs from `torch.cuda` goes through `DeviceEnv` (binding the device to the
thread, free memory, the allocator's peak, synchronizing, the device's identity), so the GPU path
can be rehearsed on a machine with no GPU (tests/test_gpu_rehearsal.py): `torch.cuda` is patched
to look like a 2-GPU machine and `tensor_device_for` places the tensors on the CPU, while the
selection, sizing and warm-up code that runs is the real one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    """`device` -> a torch.device; a CUDA device always carries its index (torch.cuda.set_device and
    the metrics need it): auto and cuda mean the current CUDA device."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N; got '{name}'")
    if not torch.cuda.is_available():
        raise ValueError(f"device '{name}' requested but CUDA is not available")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if not 0 <= index < count:
        raise ValueError(f"device '{name}': this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device,
                  capability: Optional[tuple[int, int]] = None, keep_on_cpu: bool = False) -> torch.dtype:
    """`dtype` -> torch dtype. auto: float32 on the CPU (half-precision matmuls are slow there and
    less exact), but the checkpoint's float16/bfloat16 with `keep_on_cpu` (a GGUF F16/BF16 file's
    folder, ModelConfig.keeps_dtype_on_cpu: float_gemm.c reads it in place, float32 activations);
    on CUDA vLLM's rule: the checkpoint's half type, and a float32 checkpoint in the
    device's preferred half type, bfloat16 from compute capability 8.0 (Ampere) on, float16 before
    (which has no bfloat16). `capability` is the device's (major, minor), read when not given."""
    if device.type != "cuda":
        if name == "auto":
            kept = DTYPES.get(checkpoint_dtype) if keep_on_cpu else None
            return kept if kept in (torch.float16, torch.bfloat16) else torch.float32
        return DTYPES[name]
    if capability is None:
        capability = tuple(torch.cuda.get_device_capability(device))
    has_bf16 = capability >= (8, 0)
    if name == "bfloat16" and not has_bf16:
        raise ValueError(f"dtype bfloat16 needs compute capability 8.0 or newer; {device} has "
                         f"{capability[0]}.{capability[1]} (use float16)")
    if name != "auto":
        return DTYPES[name]
    wanted = DTYPES.get(checkpoint_dtype, torch.float32)
    if wanted == torch.float32 or (wanted == torch.bfloat16 and not has_bf16):
        return torch.bfloat16 if has_bf16 else torch.float16
    return wanted


def tensor_device_for(device: torch.device) -> torch.device:
    """Where the engine's tensors live: its device. The CPU rehearsal of the GPU path replaces this
    (and only this) so that an engine that selected, bound and sized `cuda:1` computes on the CPU."""
    return device


@dataclass
class DeviceEnv:
    """The engine's device as configured and reported (`device`, e.g. cuda:1), where its tensors
    live (`tensor_device`: the same but in the rehearsal), and the device queries the runner makes.
    On the CPU the memory queries are not used (the cache is sized by cpu_kv_cache_tokens)."""
    device: torch.device
    tensor_device: torch.device

    @classmethod
    def for_device(cls, device: torch.device) -> "DeviceEnv":
        return cls(device, tensor_device_for(device))

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def can_capture_graphs(self) -> bool:
        """CUDA graphs record real device work: only where the tensors are on the GPU."""
        return self.tensor_device.type == "cuda"

    def bind(self) -> None:
        """Make the device current for the calling thread (the engine thread), as Triton's own
        backends do for a KIND_GPU instance, so every default-device call lands on it."""
        if self.is_cuda:
            torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device, as the driver reports them."""
        free, total = torch.cuda.mem_get_info(self.device)
        return int(free), int(total)

    def release_cached(self) -> None:
        """Hand the allocator's unused cached blocks back to the driver (before measuring)."""
        torch.cuda.empty_cache()

    def reset_peak(self) -> int:
        """Start measuring the allocator's peak; returns the bytes allocated now."""
        torch.cuda.reset_peak_memory_stats(self.device)
        return int(torch.cuda.memory_allocated(self.device))

    def peak_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.device))

    def identity(self) -> str:
        """The physical device, the same in every process whatever CUDA_VISIBLE_DEVICES says: its
        UUID (several Triton instances on one GPU agree on it)."""
        uuid = getattr(torch.cuda.get_device_properties(self.device), "uuid", None)
        return str(uuid) if uuid else f"cuda{self.device.index}"

    def capability(self) -> tuple[int, int]:
        return tuple(torch.cuda.get_device_capability(self.device))

    # -- copies beside the model's steps (the KV tiers, backend/worker/kv_copier.py) ---------------
    def host_buffer(self, num_bytes: int) -> torch.Tensor:
        return host_empty(num_bytes, pinned=self.is_cuda)

    def current_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_stream(self):
        return torch.cuda.Stream(self.device)

    def new_event(self):
        return torch.cuda.Event()

    def on_stream(self, stream):
        """A context in which torch's work goes to `stream`."""
        return torch.cuda.stream(stream)


def host_empty(num_bytes: int, pinned: bool) -> torch.Tensor:
    """Host memory that device copies read and write (the KV tiers' host pool): page-locked when
    `pinned`, so that copies to and from a GPU are asynchronous DMA; else touched now, at start,
    rather than page by page by the first saves of a serving engine (a first touch can cost tens of
    microseconds a 4 KiB page in a VM: seconds a GiB, docs/performance.md). The rehearsal replaces it."""
    if pinned:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    return torch.zeros(num_bytes, dtype=torch.uint8)


def to_device(array, device: torch.device) -> torch.Tensor:
    """A host numpy array as a tensor on `device`: on the CPU the array's own memory, on a GPU one
    asynchronous copy from pinned memory (the host does not wait for it)."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
