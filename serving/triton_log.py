"""What inflight reads back from a tritonserver log: the models that failed to load and why
(`load_errors`; `log_excerpt` for an error message), and each `llm` instance's start line
(`engine_reports`: the ENGINE_REPORT line model_repository/llm/1/instance_config.py writes).
"""
from __future__ import annotations

import json
import re

ENGINE_REPORT = "inflight: engine as served: "  # starts the line model.py logs at start (instance_config.py imports it)

_LOAD_ERROR = re.compile(r"failed to load '([^']+)' version (\d+): (.*)")


def load_errors(log: str) -> list[str]:
    """'model load failed: <reason>' for each model-load error in a tritonserver log."""
    found = []
    for line in log.splitlines():
        m = _LOAD_ERROR.search(line)
        if m:
            reason = m.group(3).rstrip('"').replace("\\n", "\n").replace('\\"', '"')
            reason = reason.split("\n\nAt:")[0].strip()
            found.append(f"model '{m.group(1)}' failed to load: {reason}")
    return list(dict.fromkeys(found))


def engine_reports(log: str) -> list[dict]:
    """The ENGINE_REPORT lines of a tritonserver log, as JSON objects, in the order logged."""
    found = []
    for line in log.splitlines():
        start = line.find(ENGINE_REPORT)
        if start < 0:
            continue
        if start > 0 and line[start - 1] == '"':  # Triton's log quotes a message, escaping as JSON does
            line, start = json.loads(line[start - 1:line.rindex('"') + 1]), 0
        found.append(json.loads(line[start + len(ENGINE_REPORT):line.rindex("}") + 1]))
    return found


def log_excerpt(text: str, lines: int = 15) -> str:
    """For an error message: the load errors of a tritonserver log, then its last `lines` lines
    (its tables left out); "" for an empty log."""
    if not text:
        return ""
    head = "".join(f"\n{e}" for e in load_errors(text))
    kept = [line for line in text.splitlines() if line and line[0] not in "|+"]
    tail = "\n".join(kept[-lines:])
    return f"{head}\n--- tritonserver log (last {lines} lines, tables left out) ---\n{tail}"
