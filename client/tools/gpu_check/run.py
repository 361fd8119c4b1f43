"""`inflight gpu-check`: the GPU acceptance run. One command, under 10 minutes on an H100/H200 with
a cold Triton cache, from a plain source checkout with nothing installed:

    PYTHONPATH=. python3 -m client.tools.gpu_check --out DIR      (or: inflight gpu-check --out DIR;
    make gpu-check; in the image: docker run --gpus all --rm -v $PWD:/workspace --entrypoint inflight
    inflight gpu-check --out /workspace/gpu-check)

The parts, their budgets and what each needs are client/tools/gpu_check/plan.py's; each runs in
its own process, within its budget (then SIGTERM: it reports what it has), and one that needs a
package or program this machine lacks is skipped with the reason (xgrammar, tritonserver, a second
GPU). As each part ends, DIR/NAME.json and DIR/NAME.log are written and DIR/gpu_check.json and
DIR/gpu_check.md rewritten, so a run stopped from outside still leaves every finished part. The
one-page table (part, PASS/FAIL/SKIP/CUT, seconds, budget, figures) is printed at the end and on
SIGTERM. Exit 0 if every part that ran passed, 1 if not, 2 without a GPU (outside --dry-run).

`--only PART[,PART]` runs those parts alone (the others SKIP): a failed part rerun in what is left
of a GPU lease.

`--dry-run` prints the plan with each part's budget, then rehearses every part on the CPU with
tiny shapes (Triton kernels under TRITON_INTERPRET=1; compile for sm_90 with the real compiler;
timings mean nothing). There, by design, the served part's device check must FAIL (the instances
serve from the CPU): the dry run passes only if it does.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Optional

from client.tools.gpu_check import plan as plan_mod
from client.tools.gpu_check.plan import DRY, FULL, PART_NAMES, PARTS, ROOT, TOTAL_BUDGET_S
from client.tools.gpu_check.report import details, table, verdict

GRACE_S = 10   # after SIGTERM, the seconds a part has to write what it has before SIGKILL


class Stop(BaseException):
    """SIGTERM: stop the part, write what there is (a BaseException: no `except Exception` swallows it)."""


def _raise_stop(signum, frame):
    raise Stop(f"signal {signum}")


def environment(dry_run: bool) -> dict:
    """torch, CUDA, triton and what Triton needs to build its launcher (a C compiler, Python.h)."""
    import torch

    try:
        from serving.triton_install import find_tritonserver
        server = str(find_tritonserver().binary)
    except Exception as exc:  # reported: the served part is skipped
        server, server_error = None, str(exc)
    else:
        server_error = ""
    python_h = Path(sysconfig.get_paths()["include"], "Python.h").is_file()
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    res = dict(torch=torch.__version__, cuda=torch.version.cuda, python=platform.python_version(), tritonserver=server,
               tritonserver_error=server_error, cuda_available=torch.cuda.is_available(), python_h=python_h, cc=cc)
    if res["cuda_available"]:
        res["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        res["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    import triton
    res["triton"] = triton.__version__
    res["ok"] = dry_run or (res["cuda_available"] and python_h and bool(cc))
    if not res["ok"]:
        res["error"] = "Triton builds its launcher with a C compiler against Python.h: " + ", ".join(
            m for m, ok in (("no C compiler", cc), ("no Python.h", python_h), ("no CUDA", res["cuda_available"])) if not ok)
    return res


def run_part(name: str, dry_run: bool, work: Path, out: Path) -> dict:
    """One part, in this (child) process; its result goes to out/NAME.json, also when cut."""
    plan = DRY if dry_run else FULL
    progress: dict = {}
    counter = None
    try:
        # first, and inside the try: a part stopped while importing torch reports too, from the handler's
        # first moment (installed before the try, a signal between the two would escape it)
        signal.signal(signal.SIGTERM, _raise_stop)
        from client.tools.gpu_check.compile import CompileCounter
        counter = CompileCounter().install()
        res = _part(name, plan, dry_run, work / "model", work, progress)
    except Stop as exc:
        res = dict(progress, ok=False, cut=True, error=f"cut by {exc}; partial results kept")
        if name == "kernels":   # kernel_bench writes its JSON after each section
            partial = work / "kernel_bench.json"
            res.update(json.loads(partial.read_text()) if partial.exists() else {}, ok=False, cut=True)
    res["triton_compiles"] = counter.report() if counter else {}
    (out / f"{name}.json").write_text(json.dumps(res, default=str, indent=1))
    return res


def _part(name: str, plan: dict, dry_run: bool, model_dir: Path, work: Path, progress: dict) -> dict:
    import torch

    gpu = not dry_run
    if name == "compile":
        from client.tools.gpu_check.compile import compile_kernels
        arch = None
        if gpu:
            major, minor = torch.cuda.get_device_capability(0)
            arch = 10 * major + minor
        return compile_kernels(plan, arch, progress)
    if name == "kernels":
        from client.tools.benchmarks import kernel_bench as bench
        path = work / "kernel_bench.json"
        code = bench.main(["--out", str(path), *plan["kernels"]])
        res = json.loads(path.read_text()) if path.exists() else {}
        return dict(res, ok=code == 0 and res.get("failed_checks", 1) == 0)
    last_gpu = f"cuda:{torch.cuda.device_count() - 1}" if gpu else "cpu"
    if name == "greedy":
        from client.tools.gpu_check.greedy import greedy
        return greedy(plan, model_dir, last_gpu)
    if name == "decode":
        from client.tools.gpu_check.engine import decode
        return decode(plan, model_dir, "cuda:0" if gpu else "cpu")
    if name == "structured":
        from client.tools.gpu_check.structured import structured
        return structured(plan, model_dir, "cuda:0" if gpu else "cpu")
    if name == "served":
        from client.tools.gpu_check.served import served
        res = served(plan, model_dir, on_gpu=gpu)
        return dict(res, ok=all(check["ok"] for check in res.values() if isinstance(check, dict)))
    if name == "tp":
        from client.tools.gpu_check.tp import tensor_parallel
        return tensor_parallel(plan, model_dir)
    raise ValueError(f"unknown part {name}")


class Run:
    """The parent: the parts one after another, each result written as soon as it is known."""

    def __init__(self, out: Path, dry_run: bool, device: str):
        self.out, self.dry_run, self.start = out, dry_run, time.time()
        self.res = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        device=device, dry_run=dry_run, environment={}, parts={})
        self.child: Optional[subprocess.Popen] = None

    def part(self, name: str, work: Path, env: dict, budget: int, limit: float) -> None:
        t0 = time.time()
        cmd = [sys.executable, "-m", "client.tools.gpu_check", "--part", name, "--work", str(work), "--out", str(self.out)]
        print(f"$ gpu_check --part {name}   (budget {budget} s, {limit:.0f} s left)", flush=True)
        with open(self.out / f"{name}.log", "w") as log:
            self.child = subprocess.Popen(cmd + (["--dry-run"] if self.dry_run else []), cwd=ROOT, env=env,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            cut = ""
            try:
                code = self.child.wait(timeout=max(limit, 1))
            except subprocess.TimeoutExpired:
                cut = f"stopped after {limit:.0f} s (budget {budget} s)"
                code = self._stop_child()
            except Stop:
                cut = "stopped by SIGTERM"
                self._stop_child()
                self.record(name, self._result(name, code=None, cut=cut), t0, budget)
                raise
        self.record(name, self._result(name, code, cut), t0, budget)

    def _stop_child(self) -> Optional[int]:
        """SIGTERM to the part's process group (it writes what it has), then SIGKILL."""
        child, self.child = self.child, None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(child.pid, sig)
                return child.wait(timeout=GRACE_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        return child.poll()

    def _result(self, name: str, code: Optional[int], cut: str) -> dict:
        path = self.out / f"{name}.json"
        if path.exists():
            res = json.loads(path.read_text())
        else:
            tail = (self.out / f"{name}.log").read_text()[-1500:]
            res = dict(ok=False, error=f"exited {code}: {tail}")
        if cut:   # the part's own account (it wrote what it had) after why it was stopped
            res.update(ok=False, cut=True, error=f"{cut}: {res['error']}" if res.get("cut") else cut)
        return res

    def record(self, name: str, part: dict, t0: float, budget: int) -> None:
        part.update(seconds=round(time.time() - t0, 1), budget=budget)
        self.res["parts"][name] = part
        (self.out / f"{name}.json").write_text(json.dumps(part, default=str, indent=1))
        status = "SKIP" if part.get("skipped") else "CUT" if part.get("cut") else "ok" if part.get("ok") else "FAIL"
        print(f"  {name}: {status} in {part['seconds']:.0f} s", flush=True)
        self.write()

    def write(self) -> str:
        res = self.res
        ok, res["problems"] = verdict(res["parts"], self.dry_run)
        res["ok"] = ok and bool(res["environment"].get("ok")) and not res.get("stopped")
        res["wall_s"] = time.time() - self.start
        (self.out / "gpu_check.json").write_text(json.dumps(res, indent=1, default=str))
        page = table(res)
        report = page + details(res) + "\n```json\n" + json.dumps(res, indent=1, default=str) + "\n```\n"
        (self.out / "gpu_check.md").write_text(report)
        return page


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight gpu-check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="results folder (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, then rehearse it on the CPU")
    parser.add_argument("--only", type=_part_list, default=None, metavar="PART[,PART...]",
                        help=f"run these parts alone (the rest SKIP), e.g. to rerun a failed one: {','.join(PART_NAMES)}")
    parser.add_argument("--part", choices=PART_NAMES, help=argparse.SUPPRESS)      # a child process: one part
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:
        run_part(args.part, args.dry_run, args.work, args.out)
        return 0
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not args.dry_run and not gpus:
        print("inflight gpu-check needs a CUDA GPU; --dry-run rehearses it on the CPU", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args.out, args.dry_run, torch.cuda.get_device_name(0) if gpus else "CPU dry run (timings meaningless)")
    signal.signal(signal.SIGTERM, _raise_stop)
    try:
        _run_all(run, args.dry_run, gpus, args.only)
    except Stop as exc:
        run.res["stopped"] = f"SIGTERM ({exc}) after {time.time() - run.start:.0f} s"
    page = run.write()
    print("\n" + page + f"\nwrote {args.out / 'gpu_check.md'} (and each part's NAME.json, NAME.log)", flush=True)
    return 0 if run.res["ok"] else 1


def _part_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in PART_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"--only: unknown part {', '.join(unknown) or '(none)'}; "
                                         f"the parts are {', '.join(PART_NAMES)}")
    return names


def _run_all(run: Run, dry_run: bool, gpus: int, only: Optional[tuple[str, ...]] = None) -> None:
    env = run.res["environment"] = environment(dry_run)
    interpreted = any(p.interpreted for p in PARTS if only is None or p.name in only)
    interpreter = plan_mod.interpreter_problem() if dry_run and interpreted else None
    reasons = {p.name: "not asked for (--only)" if only is not None and p.name not in only
               else plan_mod.skip_reason(p, dry_run, gpus, env["tritonserver"], interpreter) for p in PARTS}
    print(plan_mod.plan_table(dry_run, reasons), flush=True)
    run.write()
    deadline = run.start + (TOTAL_BUDGET_S if not dry_run else 10 * 3600)
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryDirectory(prefix="inflight-gpu-check-") as tmp:
        work = Path(tmp)
        from backend.models.make_model import make_model

        make_model(work / "model", seed=3, **(DRY if dry_run else FULL)["model"])
        for p in PARTS:
            budget = plan_mod.budget(p, dry_run)
            if reasons[p.name]:
                run.record(p.name, dict(ok=True, skipped=reasons[p.name]), time.time(), budget)
                continue
            left = deadline - time.time()
            if left < 5:
                run.record(p.name, dict(ok=True, skipped=f"no time left of the run's {TOTAL_BUDGET_S} s"), time.time(), budget)
                continue
            limit = min(budget, left)
            part_env = dict(child_env)
            if dry_run and p.interpreted:
                part_env["TRITON_INTERPRET"] = "1"   # chosen before triton loads in the child
            else:
                part_env.pop("TRITON_INTERPRET", None)
            if dry_run and not p.interpreted:    # the rehearsal compiles into a cache of its own
                part_env["TRITON_CACHE_DIR"] = str(work / "triton-cache")
            run.part(p.name, work, part_env, budget, limit)


if __name__ == "__main__":
    sys.exit(main())
