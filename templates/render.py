"""`inflight config`: render templates/llm/config.pbtxt into model_repository/llm/config.pbtxt.

The rendered file is the user's to edit: its first line records the sha256 of what was rendered,
so a later `inflight config` can tell a hand-edited file apart and keeps it unless `--force`.
The input and output entries come from the table in `tensors.py`.
`instance_group` is `KIND_GPU` with a `gpus` list where GPUs exist, `KIND_CPU` where none.

`apply_overrides` sets parameter values inside a config text while keeping everything else
(comments included); `inflight serve --param` uses it on a run copy.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Optional, Sequence

from templates import tensors

TEMPLATE = Path(__file__).resolve().parent / "llm" / "config.pbtxt"
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = REPO_ROOT / "model_repository" / "llm" / "config.pbtxt"
HEADER = "# inflight-config: rendered from templates/llm/config.pbtxt; sha256="


def detect_gpus() -> list[int]:
    """Indices of the visible GPUs: nvidia-smi if present, else torch; [] where there are none."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
            if out.returncode == 0:
                n = sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
                if n:
                    return list(range(n))
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        import torch
        return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    except Exception:  # a broken CUDA install means: no GPU for us
        return []


def instance_group(gpus: Sequence[int], count: int = 1, tp: int = 1) -> str:
    """KIND_GPU on the GPUs (count engines each), KIND_CPU where none. With tensor parallelism
    over N > 1 GPUs: one KIND_MODEL instance per N GPUs, instance i on cuda:i*N .. cuda:i*N+N-1
    (docs/parallelism.md)."""
    if count < 1:
        raise ValueError(f"instance count must be >= 1; got {count}")
    if tp > 1 and gpus:
        if count != 1:
            raise ValueError("--count with --tp: each group of tensor-parallel GPUs runs one engine")
        if len(gpus) < tp:
            raise ValueError(f"--tp {tp} needs {tp} GPUs; found {len(gpus)}")
        return f"instance_group [ {{ count: {len(gpus) // tp} kind: KIND_MODEL }} ]"
    if gpus:
        listed = ", ".join(str(g) for g in gpus)
        return f"instance_group [ {{ count: {count} kind: KIND_GPU gpus: [ {listed} ] }} ]"
    return f"instance_group [ {{ count: {count} kind: KIND_CPU }} ]"


_PARAM = r'(key\s*:\s*"{key}"\s*(?:#[^\n]*\n\s*)*value\s*:?\s*\{{\s*(?:#[^\n]*\n\s*)*string_value\s*:\s*)"((?:[^"\\]|\\.)*)"'


def _quote(value: str) -> str:
    return json.dumps(str(value))  # a pbtxt string literal: the same escapes as JSON for our values


def apply_overrides(text: str, overrides: Mapping[str, str]) -> str:
    """Set `parameters` values in a config.pbtxt text; add a parameter that is not there yet."""
    for key, value in overrides.items():
        pattern = re.compile(_PARAM.format(key=re.escape(key)))
        matches = list(pattern.finditer(text))
        if matches:
            for m in reversed(matches):
                text = text[:m.start()] + m.group(1) + _quote(value) + text[m.end():]
        else:
            if not text.endswith("\n"):
                text += "\n"
            text += f'parameters {{ key: {_quote(key)} value: {{ string_value: {_quote(value)} }} }}\n'
    return text


def tensor_parallel_problem(text: str, tp: int) -> str:
    """Why a config.pbtxt cannot run engines of `tp` GPUs each ('' when it can): KIND_GPU puts an
    engine on every GPU it lists (count of them each), and an engine takes its GPU and the tp - 1
    after it, so listed GPUs closer than tp, or several engines on one, would share devices."""
    if tp <= 1:
        return ""
    from tritonclient.grpc import model_config_pb2

    for group in parse_config(text).instance_group:
        gpus = sorted(group.gpus)
        if group.kind != model_config_pb2.ModelInstanceGroup.KIND_GPU:
            continue
        if not gpus or group.count > 1 or any(b - a < tp for a, b in zip(gpus, gpus[1:])):
            return (f"config.pbtxt runs KIND_GPU engines on GPUs {gpus or 'all'} (count {group.count}); with "
                    f"tensor_parallel_size {tp} each engine takes {tp} consecutive GPUs, so they would share "
                    f"devices. Render it with `inflight config --tp {tp} --force` (one KIND_MODEL instance per "
                    f"{tp} GPUs) or list GPUs {tp} apart")
    return ""


def read_parameters(text: str) -> dict[str, str]:
    """The `parameters` map of a config.pbtxt text, parsed with Triton's own ModelConfig proto."""
    return {k: v.string_value for k, v in parse_config(text).parameters.items()}


def parse_config(text: str):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(text, model_config_pb2.ModelConfig())


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def render(gpus: Optional[Sequence[int]] = None, count: int = 1,
           overrides: Optional[Mapping[str, str]] = None, template: Path = TEMPLATE, tp: int = 1) -> str:
    """The rendered config text: the template with its instance group and any overrides filled in."""
    if gpus is None:
        gpus = detect_gpus()
    body = (template.read_text()
            .replace("{{inputs}}", tensors.pbtxt(tensors.INPUTS, optional=True))
            .replace("{{outputs}}", tensors.pbtxt(tensors.OUTPUTS, optional=False))
            .replace("{{instance_group}}", instance_group(gpus, count, tp)))
    overrides = dict(overrides or {})
    if tp > 1:
        overrides["tensor_parallel_size"] = str(tp)
    body = apply_overrides(body, overrides)
    return f"{HEADER}{_digest(body)}\n{body}"


TRTLLM_MODEL = "llm_trtllm"
TRTLLM_CONFIG = REPO_ROOT / "model_repository" / TRTLLM_MODEL / "config.pbtxt"


def render_trtllm() -> str:
    """model_repository/llm_trtllm/config.pbtxt: `llm`'s inputs and outputs with a batch dimension
    (max_batch_size 1), for clients that send the TensorRT-LLM format ([1, 1] shapes). It is
    committed as rendered (nothing in it depends on the machine) and a test keeps it in step."""
    return f"""# The `llm` model in the TensorRT-LLM request format: every input and output has a batch
# dimension of 1 ([1, 1] where `llm` takes [1]), as Triton's OpenAI frontend and TensorRT-LLM
# clients send them. Each request is passed to `llm` (BLS): one engine serves both models.
# Rendered by templates/render.py (render_trtllm) from templates/tensors.py; do not edit.
name: "{TRTLLM_MODEL}"
backend: "python"
max_batch_size: 1
model_transaction_policy {{ decoupled: true }}
input [
{tensors.pbtxt(tensors.INPUTS, optional=True)}
]
output [
{tensors.pbtxt(tensors.OUTPUTS, optional=False)}
]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]  # it only forwards: no device of its own
"""


def is_hand_edited(text: str) -> bool:
    first, _, body = text.partition("\n")
    if not first.startswith(HEADER):
        return True
    return first[len(HEADER):].strip() != _digest(body)


def missing_tensors(text: str) -> list[str]:
    """The inputs and outputs of tensors.py that a config text does not declare: a hand-edited
    file kept from an older checkout (clients that ask for a newer output then fail)."""
    declared = set(re.findall(r'name:\s*"([^"]+)"', text))
    return [t.name for t in tensors.INPUTS + tensors.OUTPUTS if t.name not in declared]


def stale_warning(path: Path, text: str) -> Optional[str]:
    missing = missing_tensors(text)
    if not missing:
        return None
    return (f"{path} lacks {', '.join(missing)} (it is older than this checkout): carry your edits into a new "
            "render (`inflight config --force`), or requests that ask for them fail")


def write_config(output: Path = DEFAULT_OUTPUT, *, force: bool = False,
                 gpus: Optional[Sequence[int]] = None, count: int = 1,
                 overrides: Optional[Mapping[str, str]] = None, tp: int = 1) -> str:
    """Render into `output`. Returns 'written', 'unchanged' or 'kept' (hand edits, no --force)."""
    output = Path(output)
    text = render(gpus, count, overrides, tp=tp)
    if output.exists():
        old = output.read_text()
        if old == text:
            return "unchanged"
        if is_hand_edited(old) and not force:
            return "kept"
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(output)
    return "written"


def parse_param(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got '{item}'")
    return key.strip(), value.strip()


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (--tp 0 is refused with the option's name by argparse)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got '{text}'") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (tensor_parallel_size), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT,
                        help="where to write (default: model_repository/llm/config.pbtxt)")
    parser.add_argument("--force", action="store_true",
                        help="overwrite a hand-edited config.pbtxt")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--gpus", help="comma-separated GPU indices for KIND_GPU (default: all found)")
    where.add_argument("--cpu", action="store_true", help="KIND_CPU even where GPUs exist")
    parser.add_argument("--count", type=int, default=1, help="engine instances per device (default 1)")
    parser.add_argument("--tp", type=positive_int, default=1, metavar="N",
                        help="tensor_parallel_size: each engine on N devices; on GPUs one KIND_MODEL "
                             "instance per N of them (default 1)")
    parser.add_argument("--param", action="append", type=parse_param, default=[], metavar="KEY=VALUE",
                        help="set a parameter in the rendered file (repeatable)")


def run(args: argparse.Namespace) -> int:
    if args.cpu:
        gpus: Optional[list[int]] = []
    elif args.gpus:
        gpus = [int(g) for g in args.gpus.split(",") if g.strip()]
    else:
        gpus = None
    try:
        status = write_config(args.output, force=args.force, gpus=gpus, count=args.count,
                              overrides=dict(args.param), tp=args.tp)
    except ValueError as exc:
        print(f"inflight config: {exc}", file=sys.stderr)
        return 2
    if status == "kept":
        print(f"{args.output} has hand edits: kept as it is (use --force to render it anew)")
        warning = stale_warning(Path(args.output), Path(args.output).read_text())
        if warning:
            print(f"inflight config: warning: {warning}", file=sys.stderr)
    else:
        print(f"{args.output}: {status}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="inflight config", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
