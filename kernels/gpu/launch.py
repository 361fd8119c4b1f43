"""A kernel launch as data: the kernel, its grid, its arguments and its launch configuration.

Each wrapper's `plan_*` function chooses the configuration (tile sizes, num_warps, num_stages,
split-K) and returns these objects; the wrapper calls them, and `python -m kernels.aot` compiles
the very same objects for sm_80 and sm_90 without a GPU. So the configurations checked ahead of
time are, by construction, the ones launched. Nothing here imports triton.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional

# While set, launches are appended here instead of run (`recording`).
_recorded: Optional[list] = None


@dataclass(frozen=True)
class Launch:
    kernel: Any                       # a triton JITFunction
    grid: tuple[int, ...]
    args: tuple                       # positional (runtime) arguments, in the kernel's order
    constexprs: Mapping[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: Optional[int] = None  # None: Triton's default for the target
    min_arch: int = 0                 # the compute capability it needs (FP8: 89); kernels.aot skips older targets

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__.strip("_") if hasattr(self.kernel, "fn") else str(self.kernel)

    def options(self) -> dict[str, int]:
        options = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            options["num_stages"] = self.num_stages
        return options

    def config(self) -> dict[str, Any]:
        """What identifies this launch's compiled binary apart from argument types: the
        constexprs and the launch options (for reports)."""
        return {**self.constexprs, **self.options()}

    def __call__(self) -> None:
        if _recorded is not None:
            _recorded.append(self)
            return
        self.kernel[self.grid](*self.args, **self.constexprs, **self.options())


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Within the block every launch is recorded instead of run (the list it yields): for counting
    launches, and for checking which compiled variants a run asks for, on a machine with no GPU.
    The kernels' outputs are then left unwritten."""
    global _recorded
    outer, _recorded = _recorded, []
    try:
        yield _recorded
    finally:
        _recorded = outer
