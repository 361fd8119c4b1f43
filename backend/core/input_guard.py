"""The guard every door puts around what a client sends (the OpenAI server's body, the Triton
adapter's request parameters and `sampling_parameters`): what Python raises on hostile JSON —
`RecursionError` (nesting), `OverflowError` (1e400, 10**400 as a float), `UnicodeError` (a lone
surrogate such as "\\ud800", which JSON escapes allow and UTF-8 cannot carry) — becomes a
ValueError naming the field, which each door answers as a 400 / INVALID_ARG. No torch here.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1


def lone_surrogate(value: Any, where: str) -> Optional[str]:
    """Where in a JSON value (keys included) a string holds a lone surrogate, as `where.key[2]`;
    None when there is none. Iterative: a value nested however deep is walked without recursion."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and not _encodable(key):
                    return f"{path} (a key)"
                stack.append((child, f"{path}.{key}"))
        elif isinstance(item, (list, tuple)):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def check_text(value: Any, where: str) -> None:
    """Refuse a value with a lone surrogate anywhere in it, naming where."""
    path = lone_surrogate(value, where)
    if path is not None:
        raise ValueError(f"{path} is not valid Unicode text: it holds a lone surrogate (an unpaired \\ud800-\\udfff "
                         "escape), which UTF-8 cannot encode")


@contextlib.contextmanager
def guarded(field: str) -> Iterator[None]:
    """Turn what hostile JSON makes Python raise, inside the block, into a ValueError naming `field`."""
    try:
        yield
    except RecursionError:
        raise ValueError(f"{field} is nested too deeply") from None
    except OverflowError as exc:
        raise ValueError(f"{field}: a number is out of range ({exc})") from None
    except UnicodeError as exc:
        raise ValueError(f"{field} is not valid Unicode text ({getattr(exc, 'reason', exc)})") from None


def int32(value: Any, field: str) -> int:
    """An integer field carried as INT32 (priority): a JSON number or its text, integral, in range."""
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ValueError(f"{field} must be an integer; got {value!r}") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{field} must be an integer in [{INT32_MIN}, {INT32_MAX}]; got {value!r}")
    return value
