"""Test-only faults in the model step, armed only by INFLIGHT_FAULT_INJECTION=1 at server start."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Optional

FAULT_ENV = "INFLIGHT_FAULT_INJECTION"  # "1" at server start arms the injector
FAULT_FILE_ENV = "INFLIGHT_FAULT_FILE"  # where the trigger file is (default: <model dir>/.inflight-fault)
FAULT_FILE = ".inflight-fault"


class InjectedFault(RuntimeError):
    """A failure made on purpose by the fault injector."""


class FaultInjector:
    """Test-only faults, so the tests can prove that a failed model step fails only its requests.

    Armed only when the server starts with INFLIGHT_FAULT_INJECTION=1 (never set it in production);
    otherwise nothing is installed and no file is ever looked at. Armed, it reads the trigger file
    before every model step:
    - `model_step N`: the next N steps raise InjectedFault inside the model run (each consumed step
      is written back; the file is removed at 0);
    - `stall`: every step waits while the file says so (at most STALL_LIMIT_S each), like a hung
      device: the queue then holds still while a test looks at it. Remove the file to go on.
    The server log says when the injector is armed."""

    STALL_LIMIT_S = 60.0

    def __init__(self, path: Path):
        self.path = Path(path)
        self.injected = 0

    @classmethod
    def from_env(cls, model_dir: Path, environ: Mapping[str, str] = os.environ) -> Optional["FaultInjector"]:
        if environ.get(FAULT_ENV, "") != "1":
            return None
        return cls(Path(environ.get(FAULT_FILE_ENV) or Path(model_dir) / FAULT_FILE))

    def _words(self) -> list[str]:
        try:
            return self.path.read_text().split()
        except OSError:
            return []

    def stall(self) -> float:
        """Wait while the trigger file says `stall`; the seconds waited."""
        started = time.monotonic()
        while self._words() == ["stall"] and time.monotonic() - started < self.STALL_LIMIT_S:
            time.sleep(0.005)
        return time.monotonic() - started

    def take(self, kind: str) -> bool:
        """Consume one `kind` fault from the trigger file; True when one was there."""
        words = self._words()
        if len(words) != 2 or words[0] != kind or not words[1].isdigit() or int(words[1]) < 1:
            return False
        left = int(words[1]) - 1
        if left:
            self.path.write_text(f"{kind} {left}\n")
        else:
            self.path.unlink(missing_ok=True)
        self.injected += 1
        return True

    def install(self, engine: Any) -> None:
        """Wrap the model run of an AsyncEngine (or LLMEngine) so that armed steps raise."""
        core = getattr(engine, "engine", engine)
        runner = core.runner
        real_run = runner.execute

        def run(plan):
            if not plan.is_empty:  # (a plan of no row only tells the worker what left)
                self.stall()
                if self.take("model_step"):
                    raise InjectedFault("injected fault in the model step (INFLIGHT_FAULT_INJECTION)")
            return real_run(plan)

        runner.execute = run
