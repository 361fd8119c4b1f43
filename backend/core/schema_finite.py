"""Does a JSON schema have a finite instance? A schema whose every instance is infinite (a required
property whose `$ref` is the schema itself, or any required recursion with no base case) compiles,
and the grammar then generates until `max_tokens`: `check_finite` refuses it before any compile.
No torch, no xgrammar; linear in the schema's size (backend/core/schema_check.py calls it).

A Horn-clause fixpoint, as a grammar's productive symbols are found: each subschema holds a list of
clauses, each clause an OR of subschemas; a subschema has a finite instance once every clause has one
member that has. The clauses follow what xgrammar generates:
- `true`, an `enum` or a `const`: none (a literal is finite); `false`: one empty clause;
- a local `$ref`: its target (only the reference is followed, as xgrammar does);
- an object (declared, or an untyped schema with `properties`/`required`, which xgrammar makes an
  object): each required property's schema (its `properties` entry, else `additionalProperties`);
- an array: the schema of each of its first `minItems` items (`prefixItems`, then `items`);
- `allOf`: each branch; `anyOf`/`oneOf`: one of the branches;
- a type list with a scalar type in it, or no type at all: nothing more (a scalar is finite).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

_SCALARS = {"string", "number", "integer", "boolean", "null"}


def check_finite(schema: Any, where: str, nodes: list[tuple[Any, str]],
                 resolve: Callable[[str], Optional[Any]]) -> None:
    """Raise ValueError naming `where` when no finite JSON value satisfies `schema`. `nodes`: every
    subschema with its pointer (the root first); `resolve`: a local $ref -> its target, or None."""
    index = {id(node): i for i, (node, _) in enumerate(nodes)}
    clauses = [_clauses(node, index, resolve) for node, _ in nodes]
    unmet = [len(c) for c in clauses]
    watchers: list[list[tuple[int, int]]] = [[] for _ in nodes]
    for i, node_clauses in enumerate(clauses):
        for c, members in enumerate(node_clauses):
            for member in members:
                watchers[member].append((i, c))
    done = [[False] * len(c) for c in clauses]
    finite = [n == 0 for n in unmet]
    work = [i for i, ok in enumerate(finite) if ok]
    while work:
        member = work.pop()
        for i, c in watchers[member]:
            if not done[i][c]:
                done[i][c] = True
                unmet[i] -= 1
                if unmet[i] == 0 and not finite[i]:
                    finite[i] = True
                    work.append(i)
    if nodes and not finite[0]:
        raise ValueError(f"{where}: no finite value satisfies the schema: {_why(0, nodes, clauses, done)} "
                         "(a required recursion with no base case: generation would never end)")


def _clauses(node: Any, index: dict[int, int], resolve: Callable[[str], Optional[Any]]) -> list[list[int]]:
    if node is True:
        return []
    if not isinstance(node, dict):
        return [[]]
    if "enum" in node or "const" in node:
        return []

    def ref(child: Any) -> list[int]:
        return [index[id(child)]] if id(child) in index else []  # unknown: no condition

    target = node.get("$ref")
    if isinstance(target, str):
        found = resolve(target)
        return [ref(found)] if found is not None and id(found) in index else []
    out = [ref(branch) for branch in node.get("allOf") or []]
    for key in ("anyOf", "oneOf"):
        branches = node.get(key) or []
        if branches:
            out.append([i for b in branches for i in ref(b)] if all(id(b) in index for b in branches) else [])
    kinds = node.get("type")
    kinds = set(kinds) if isinstance(kinds, list) else {kinds} if isinstance(kinds, str) else \
        {"object"} if ("properties" in node or "required" in node) else None
    if kinds is None or kinds & _SCALARS or len(kinds) != 1:
        return out  # a scalar is allowed (an object-or-array is not judged)
    if kinds == {"object"}:
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties")
        for name in node.get("required") or []:
            schema = properties.get(name, extra if isinstance(extra, (dict, bool)) else True)
            if schema is not True:
                out.append(ref(schema) if schema is not False else [])
    elif kinds == {"array"}:
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        need = node.get("minItems", 0)
        for i in range(min(int(need), len(prefix) + 1) if isinstance(need, (int, float)) else 0):
            schema = prefix[i] if i < len(prefix) else node.get("items", True)
            if schema is not True:
                out.append(ref(schema) if schema is not False else [])
    return out


def _why(i: int, nodes: list[tuple[Any, str]], clauses: list[list[list[int]]], done: list[list[bool]]) -> str:
    """The first requirement of subschema i that nothing finite meets, as its pointer."""
    for c, members in enumerate(clauses[i]):
        if not done[i][c]:
            if not members:
                return f"{nodes[i][1] or '/'} requires a value no schema allows"
            pointers = ", ".join(nodes[m][1] or "/" for m in members[:3])
            return f"{nodes[i][1] or '/'} requires {pointers}, which has no finite instance either"
    return f"{nodes[i][1] or '/'} has no finite instance"
