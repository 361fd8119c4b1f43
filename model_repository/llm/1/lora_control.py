"""LoRA adapters loaded and unloaded at run time through this door (docs/lora.md, "Adapters at run
time"). Free of Triton imports.

A request whose parameters hold `lora_action` is a control request, not a generation: no input
tensor is read. The OpenAI server's /v1/load_lora_adapter and /v1/unload_lora_adapter send these
over the same gRPC channel as its generations, so both doors act on the one engine that serves
them, and an adapter loaded through either is a `lora_name` / `model` on both.

- `{"lora_action": "list"}`: the adapters requests may name now (always allowed);
- `{"lora_action": "load", "lora_name": N, "lora_path": P}`: checked exactly as at start;
- `{"lora_action": "unload", "lora_name": N}` (`lora_int_id` accepted, as vLLM's body has it):
  new requests naming N are refused at once; the answer comes once N's running requests have
  finished and it is unloaded.

Load and unload need `enable_runtime_lora=true` (off by default, as vLLM). The answer is one
response whose `text_output` is a JSON object: `message` (vLLM's success text), `lora_name`,
`adapters` (the names loaded after it). A refusal is an error naming why: INVALID_ARG, NOT_FOUND
(no such adapter), ALREADY_EXISTS (the name is loaded).
"""
from __future__ import annotations

import json
import threading
from typing import Any, Callable, Optional

import numpy as np

from triton_errors import Error

ACTION = "lora_action"
ACTIONS = ("list", "load", "unload")
_KEYS = {"list": (), "load": ("lora_name", "lora_path", "lora_int_id"), "unload": ("lora_name", "lora_int_id")}
_WAIT_POLL_S = 0.5  # an unload's wait looks at the engine this often (a dead engine ends it)


def control_of(parameters: Optional[str]) -> Optional[dict[str, Any]]:
    """The control request in a request's parameters (a JSON object), or None for a generation."""
    if not parameters or ACTION not in parameters:
        return None
    try:
        data = json.loads(parameters)
    except ValueError:
        return None  # parse_request refuses it, naming the problem
    if not isinstance(data, dict) or ACTION not in data:
        return None
    return {k: v for k, v in data.items() if not k.startswith("triton_") and k not in ("id", "priority", "timeout")}


class LoRAControl:
    def __init__(self, engine: Any, respond: Callable, enabled: bool):
        self.engine = engine
        self.respond = respond
        self.enabled = enabled

    def handle(self, control: dict[str, Any], sender: Any) -> None:
        """Answer a control request (an unload's answer comes from a thread of its own, once done)."""
        try:
            action, name = self._check(control)
            if action == "list":
                self._answer(sender, None, "")
            elif action == "load":
                self._load(name, control["lora_path"])
                self._answer(sender, name, f"Success: LoRA adapter '{name}' added successfully.")
            else:
                done = self.engine.unload_lora(name)
                threading.Thread(target=self._finish_unload, args=(name, done, sender),
                                 name=f"inflight-unload-{name}", daemon=True).start()
        except ValueError as exc:
            self.respond(sender, None, Error(str(exc), _code(str(exc))), True)

    def _check(self, control: dict[str, Any]) -> tuple[str, Optional[str]]:
        action = control[ACTION]
        if action not in ACTIONS:
            raise ValueError(f"{ACTION} must be one of {', '.join(ACTIONS)}; got {action!r}")
        unknown = sorted(k for k in control if k != ACTION and k not in _KEYS[action])
        if unknown:
            raise ValueError(f"{ACTION} {action}: unknown key(s) {', '.join(unknown)}; it takes "
                             f"{', '.join(_KEYS[action]) or 'nothing else'}")
        if action == "list":
            return action, None
        if not self.enabled:
            raise ValueError(f"{ACTION} {action}: loading and unloading LoRA adapters at run time is off on this "
                             "model; set enable_runtime_lora=true in its config.pbtxt (inflight serve "
                             "--enable-runtime-lora)")
        name = control.get("lora_name")
        if action == "load" and (not isinstance(name, str) or not name or not isinstance(control.get("lora_path"), str)
                                 or not control["lora_path"]):
            raise ValueError("load_lora_adapter needs both lora_name and lora_path (strings)")
        if action == "unload" and (not isinstance(name, str) or not name):
            if control.get("lora_int_id") is not None:
                raise ValueError(f"LoRA adapter with lora_int_id {control['lora_int_id']!r} is not loaded: adapters "
                                 "are named here, send its lora_name")
            raise ValueError("unload_lora_adapter needs lora_name")
        return action, name

    def _load(self, name: str, path: str) -> None:
        if name in self.engine.engine.loras.names():  # vLLM refuses a name it holds, whatever the path
            raise ValueError(f"LoRA adapter '{name}' is already loaded; unload it first")
        self.engine.load_lora(name, path)

    def _finish_unload(self, name: str, done: threading.Event, sender: Any) -> None:
        while not done.wait(_WAIT_POLL_S):
            failure = getattr(self.engine, "failure", None)
            if failure:
                self.respond(sender, None, Error(f"the engine stopped before LoRA adapter '{name}' was unloaded: "
                                                 f"{failure}", "UNAVAILABLE"), True)
                return
        self._answer(sender, name, f"Success: LoRA adapter '{name}' removed successfully.")

    def _answer(self, sender: Any, name: Optional[str], message: str) -> None:
        body = {"message": message, "lora_name": name, "adapters": self.engine.engine.loras.names()}
        self.respond(sender, {"text_output": np.array([json.dumps(body).encode()], dtype=np.object_),
                              "output_ids": np.zeros([0], dtype=np.int32)}, None, True)


def _code(message: str) -> str:
    if "is not loaded" in message:
        return "NOT_FOUND"
    if "already loaded" in message:
        return "ALREADY_EXISTS"
    return "INVALID_ARG"
