"""What a request asks its output to follow: vLLM's `StructuredOutputsParams`, checked. No torch,
no xgrammar: the Triton adapter and the OpenAI server build and check these before any model loads.

One constraint per request, as vLLM: a JSON schema (`json`), any JSON (`json_object`), a regular
expression (`regex`), one of a list of strings (`choice`), an EBNF or Lark grammar (`grammar`), or
an xgrammar structural tag (`structural_tag`, what tool calling compiles to). They arrive as an
object or as its JSON text (the vLLM backend sends `structured_outputs` as a JSON string inside
`sampling_parameters`), or in the older flat spellings `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`, `guided_json_object` (and `guided_decoding`, the object's old
name). Compiling needs the model's tokenizer: that is backend/engine/structured/compiler.py, at arrival.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Iterator, Mapping, Optional, Union

from backend.core.schema_check import check_json_depth, check_schema

FIELD = "structured_outputs"
KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
MAX_CONSTRAINT_CHARS = 1 << 16  # a schema, regex or grammar; compile time grows with it
MAX_CHOICES = 1024
# The older flat keys (vLLM's OpenAI server and GuidedDecodingParams) -> the field they set.
LEGACY_KEYS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
               "guided_grammar": "grammar", "guided_json_object": "json_object",
               "guided_whitespace_pattern": "whitespace_pattern", "guided_decoding_backend": "backend"}
OBJECT_KEYS = (FIELD, "guided_decoding")  # the object itself, by its current and its old name


@dataclass(frozen=True)
class StructuredOutputs:
    """vLLM's StructuredOutputsParams: exactly one of the constraint fields is set."""
    json: Optional[Union[dict, bool, str]] = None  # a JSON schema, or its JSON text
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None  # EBNF (xgrammar's, GBNF-like) or Lark
    json_object: Optional[bool] = None
    structural_tag: Optional[Union[dict, str]] = None  # xgrammar's structural tag, or its JSON text
    disable_any_whitespace: bool = False  # JSON: no optional whitespace between tokens
    disable_additional_properties: bool = False  # JSON schema: objects without additionalProperties are closed
    # Accept JSON-schema keywords xgrammar cannot enforce (schema_check.py), unenforced, instead of a 400.
    allow_unenforced_keywords: bool = False
    # Accepted so that vLLM clients work; xgrammar has no fallback and no custom whitespace.
    disable_fallback: bool = False
    whitespace_pattern: Optional[str] = None
    backend: Optional[str] = None

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json, str):  # the JSON text of a schema: parsed once, here
            object.__setattr__(self, "json", _parse_json(f"{FIELD}.json", self.json))
        if isinstance(self.structural_tag, str):
            object.__setattr__(self, "structural_tag", _parse_json(f"{FIELD}.structural_tag", self.structural_tag))
        self.validate()

    def _given(self) -> list[str]:
        return [k for k in KINDS if _set(k, getattr(self, k))]

    @property
    def kind(self) -> str:
        return self._given()[0]

    def validate(self) -> None:
        """Raise ValueError naming the field for anything that is wrong before compiling."""
        given = self._given()
        if len(given) != 1:
            raise ValueError(f"{FIELD}: set exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if not isinstance(self.json, (dict, bool, type(None))):
            raise ValueError(f"{FIELD}.json must be a JSON schema (an object, or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{FIELD}.{name} must be a non-empty string")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"{FIELD}.choice must be a list of 1..{MAX_CHOICES} strings")
        if self.json_object not in (None, True, False):
            raise ValueError(f"{FIELD}.json_object must be a boolean")
        if self.structural_tag is not None and not isinstance(self.structural_tag, dict):
            raise ValueError(f"{FIELD}.structural_tag must be an object (or its JSON text)")
        for name in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback",
                     "allow_unenforced_keywords"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{FIELD}.{name} must be a boolean")
        if self.whitespace_pattern is not None:
            raise ValueError(f"{FIELD}.whitespace_pattern is not supported (xgrammar has no custom "
                             "whitespace); disable_any_whitespace is")
        if self.backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"{FIELD}.backend: only xgrammar is available; got {self.backend!r}")
        where = f"{FIELD}.{self.kind}"
        check_json_depth(getattr(self, self.kind), where)  # before anything recurses into it
        size = len(self.source)
        if size > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{where} is {size} characters; the limit is {MAX_CONSTRAINT_CHARS}")
        try:
            self.source.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{where} is not valid Unicode text: a lone surrogate "
                             f"({self.source[exc.start]!a}) at character {exc.start}") from None
        if self.kind == "json":
            check_schema(self.json, where, allow_unenforced=self.allow_unenforced_keywords)
        elif self.kind == "structural_tag":
            for path, schema in tag_schemas(self.structural_tag):
                check_schema(schema, f"{where}{path}", allow_unenforced=self.allow_unenforced_keywords)

    @property
    def source(self) -> str:
        """The constraint as text: what is compiled, and (with the options) the cache key. Key order
        is kept: a schema's property order is the order the output writes them in."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        if self.kind == "choice":
            return json.dumps(list(value), ensure_ascii=False)
        return "" if value is True else value

    @property
    def cache_key(self) -> tuple:
        return (self.kind, self.source, self.disable_any_whitespace, self.disable_additional_properties)

    # -- from JSON ---------------------------------------------------------------------------------
    @classmethod
    def parse(cls, value: Any, where: str = FIELD) -> "StructuredOutputs":
        """From an instance, an object of its fields, or that object's JSON text (as the vLLM
        backend sends it)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = _parse_json(where, value)
        if not isinstance(value, Mapping):
            raise ValueError(f"{where} must be an object with one of {', '.join(KINDS)} (or its JSON text)")
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                             f"{', '.join(sorted(known))}")
        return cls(**{k: v for k, v in value.items() if v is not None})


def fold_legacy_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """A sampling dict with the older spellings (`guided_json`, ..., `guided_decoding`) folded into
    one `structured_outputs` object; raises ValueError when two disagree on the constraint."""
    legacy = {k: v for k, v in data.items() if k in LEGACY_KEYS and v is not None}
    objects = [k for k in OBJECT_KEYS if data.get(k) is not None]
    out = {k: v for k, v in data.items() if k not in LEGACY_KEYS and k not in OBJECT_KEYS}
    if not legacy and not objects:
        return out
    if len(objects) > 1:
        raise ValueError(f"send {FIELD} or guided_decoding, not both")
    merged: dict[str, Any] = {}
    if objects:
        merged.update(StructuredOutputs.parse(data[objects[0]], objects[0]).__dict__)
        merged = {k: v for k, v in merged.items() if _set(k, v)}
    for key, value in legacy.items():
        # Triton request parameters are scalars: a schema or a choice list comes as its JSON text
        if key in ("guided_json", "guided_choice", "guided_json_object") and isinstance(value, str):
            value = _parse_json(key, value.lower() if key == "guided_json_object" else value)
        merged[LEGACY_KEYS[key]] = value
    given = [k for k in KINDS if _set(k, merged.get(k))]
    if len(given) > 1:
        raise ValueError(f"{FIELD}: one constraint per request; got {' and '.join(given)} "
                         f"(from {', '.join(objects + sorted(legacy))})")
    out[FIELD] = StructuredOutputs.parse(merged, objects[0] if objects else next(iter(legacy)))
    return out


def _set(name: str, value: Any) -> bool:
    """Whether a field carries a constraint (json_object: false is the same as absent)."""
    return value is not None and not (name == "json_object" and value is False)


def _parse_json(where: str, text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
        raise ValueError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:  # json's scanner recurses once per nesting level
        raise ValueError(f"{where} is nested too deeply to be a constraint") from None


def tag_schemas(tag: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """The JSON schemas inside a structural tag, with where each sits (".format.tags[0].content"):
    xgrammar's `{"type": "json_schema", "json_schema": ...}` contents and the older `structures`'
    `schema`. The tag's depth is checked before (no deep recursion here)."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            yield path, tag["json_schema"]
        elif "schema" in tag and "begin" in tag:  # {"structures": [{"begin", "schema", "end"}]}
            yield path + ".schema", tag["schema"]
        for key, value in tag.items():
            if key not in ("json_schema", "schema") and isinstance(value, (dict, list)):
                yield from tag_schemas(value, f"{path}.{key}")
    elif isinstance(tag, list):
        for i, value in enumerate(tag):
            yield from tag_schemas(value, f"{path}[{i}]")


@dataclass(frozen=True)
class CompiledConstraint:
    """A compiled grammar and what is known of it from its first state."""
    grammar: Any  # xgrammar.CompiledGrammar
    kind: str
    vocab_size: int
    only_empty: bool  # it admits nothing but the end of the output
