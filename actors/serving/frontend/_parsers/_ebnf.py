"""Grammars that force tool calls, written in the EBNF dialect SGLang, xgrammar and llguidance
all read (GBNF-like: ``name ::= ...``, quoted literals, character classes, ``* + ?``).

A call's arguments follow its function's JSON schema: objects with their properties (required ones
first, in the schema's order, then the optional ones, each optional, in order), arrays of their
items, strings, numbers, integers, booleans, null, ``enum``, ``const``, ``anyOf``/``oneOf`` and
type lists. What a plain grammar cannot say (``$ref``, ``pattern``, lengths, bounds,
``additionalProperties``) is relaxed to "any JSON value of that type". JSON is written as
``json.dumps`` writes it: one optional space after ``,`` and ``:``, none elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ._types import ToolSpec

__all__ = ["EbnfBuilder", "alternatives", "literal"]

_BASE = r"""sp ::= " "?
json-value ::= json-object | json-array | json-string | json-number | "true" | "false" | "null"
json-object ::= "{" "}" | "{" json-member ("," sp json-member)* "}"
json-member ::= json-string ":" sp json-value
json-array ::= "[" "]" | "[" json-value ("," sp json-value)* "]"
json-string ::= "\"" json-char* "\""
json-char ::= [^"\\\x00-\x1f] | "\\" (["\\/bfnrt] | "u" json-hex json-hex json-hex json-hex)
json-hex ::= [0-9a-fA-F]
json-integer ::= "-"? ("0" | [1-9] [0-9]*)
json-number ::= json-integer ("." [0-9]+)? ([eE] ("+" | "-")? [0-9]+)?
json-boolean ::= "true" | "false"
"""

_SCALARS = {
    "string": "json-string",
    "integer": "json-integer",
    "number": "json-number",
    "boolean": "json-boolean",
    "null": '"null"',
}


def literal(text: str) -> str:
    """``text`` as an EBNF string literal (JSON's escapes are the dialect's)."""
    return json.dumps(text, ensure_ascii=False)


class EbnfBuilder:
    """Collects rules: :meth:`value` turns a JSON schema into an expression, adding the rules it
    needs; :meth:`grammar` writes the whole grammar with ``root`` as given."""

    def __init__(self) -> None:
        self._rules: list[str] = []
        self._count = 0

    def call(self, tools: Sequence[ToolSpec], arguments: str = "arguments") -> str:
        """A rule for one call of one of ``tools``, ``{"name": ..., "<arguments>": {...}}``,
        its arguments by the function's parameter schema; its name."""
        calls = [
            literal(f'{{"name": {_dump(t.name)}, {_dump(arguments)}: ')
            + f" {self.value(t.parameters or {'type': 'object'})} "
            + literal("}")
            for t in tools
        ]
        return self.rule(alternatives(calls))

    def rule(self, expr: str, stem: str = "r") -> str:
        """A new rule for ``expr``; its name."""
        self._count += 1
        name = f"{stem}-{self._count}"
        self._rules.append(f"{name} ::= {expr}")
        return name

    def grammar(self, root: str) -> str:
        return "\n".join([f"root ::= {root}", *self._rules]) + "\n" + _BASE

    def value(self, schema: Any, depth: int = 0) -> str:
        """An expression for the JSON values ``schema`` allows."""
        if not isinstance(schema, dict) or depth > 32:
            return "json-value"
        if "const" in schema:
            return literal(_dump(schema["const"]))
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(literal(_dump(v)) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            options = schema.get(key)
            if isinstance(options, list) and options:
                return "(" + " | ".join(self.value(s, depth + 1) for s in options) + ")"
        all_of = schema.get("allOf")
        if isinstance(all_of, list) and len(all_of) == 1:
            return self.value(all_of[0], depth + 1)
        kind = schema.get("type")
        if isinstance(kind, list):
            if not kind:
                return "json-value"
            return "(" + " | ".join(self.value({**schema, "type": t}, depth) for t in kind) + ")"
        if kind == "object" or (kind is None and isinstance(schema.get("properties"), dict)):
            return self._object(schema, depth)
        if kind == "array":
            items = schema.get("items")
            if not isinstance(items, dict):
                return "json-array"
            item = self.value(items, depth + 1)
            return self.rule(f'"[" "]" | "[" {item} ("," sp {item})* "]"', "array")
        if isinstance(kind, str) and kind in _SCALARS:
            return _SCALARS[kind]
        return "json-value"

    def _object(self, schema: dict[str, Any], depth: int) -> str:
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return "json-object"
        required = schema.get("required")
        needed = set(required) if isinstance(required, list) else set()
        members = {
            key: f'{literal(_dump(key))} ":" sp {self.value(sub, depth + 1)}'
            for key, sub in properties.items()
        }
        must = [members[k] for k in properties if k in needed]
        may = [members[k] for k in properties if k not in needed]
        if must:
            body = ' "," sp '.join(must) + "".join(f' ("," sp {m})?' for m in may)
            return self.rule(f'"{{" {body} "}}"', "object")
        options = [
            m + "".join(f' ("," sp {later})?' for later in may[i + 1 :]) for i, m in enumerate(may)
        ]
        return self.rule('"{" (' + " | ".join(options) + ')? "}"', "object")


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def alternatives(exprs: Sequence[str]) -> str:
    """One expression for any of ``exprs``."""
    return "(" + " | ".join(exprs) + ")"
