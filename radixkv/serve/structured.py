"""Structured-output fields of a request body: OpenAI's `response_format`, vLLM's
`structured_outputs` object and its older `guided_*` fields, read into one constraint.

    response_format {"type": "json_object"}                       -> json_object
    response_format {"type": "json_schema", "json_schema": {name, schema, strict}} -> json_schema
    structured_outputs {"json" | "regex" | "choice" | "grammar" | "json_object": ...} (vLLM)
    guided_json | guided_regex | guided_choice | guided_grammar   (vLLM's older names)

A body may set one of them; two are answered 400 naming the second. Every refusal names the
field as the client sent it (`response_format.json_schema.schema`, `structured_outputs.regex`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixkv.serve.protocol import bad_request

# vLLM's names (`structured_outputs` keys, and the `guided_` fields) -> SamplingParams fields
_VLLM_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


@dataclass(frozen=True, slots=True)
class Constraint:
    """One structured-output constraint: `SamplingParams(**{kind: value})`."""

    kind: str  # a SamplingParams field: json_schema, json_object, regex, choice, grammar, ...
    value: Any
    param: str  # the body field it came from, for errors


def read_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """The body's constraint, None without one. APIError(400) for a malformed or second one."""
    found = [
        c
        for c in (_response_format(body), _structured_outputs(body), *_guided(body))
        if c is not None
    ]
    if len(found) > 1:
        raise bad_request(
            f"{found[1].param} conflicts with {found[0].param}: give one structured-output field",
            found[1].param,
        )
    return found[0] if found else None


def _response_format(body: Mapping[str, Any]) -> Constraint | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", True, "response_format")
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be text, json_object or json_schema; got {kind!r:.40}",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(
            "response_format.json_schema must be an object", "response_format.json_schema"
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(
            "response_format.json_schema.name must be a non-empty string",
            "response_format.json_schema.name",
        )
    param = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if schema is None:  # OpenAI: absent means any JSON object (an empty schema: any value)
        return Constraint("json_object", True, param)
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be an object (a JSON schema)", param)
    check_schema_depth(schema, param)
    return Constraint("json_schema", schema, param)


def _structured_outputs(body: Mapping[str, Any]) -> Constraint | None:
    so = body.get("structured_outputs")
    if so is None:
        return None
    if not isinstance(so, dict):
        raise bad_request("structured_outputs must be an object", "structured_outputs")
    given = [k for k in _VLLM_KINDS if so.get(k) not in (None, False)]
    if len(given) > 1:
        param = f"structured_outputs.{given[1]}"
        raise bad_request(f"{param} conflicts with structured_outputs.{given[0]}", param)
    if not given:
        return None
    return _vllm_constraint(given[0], so[given[0]], f"structured_outputs.{given[0]}")


def _guided(body: Mapping[str, Any]) -> list[Constraint | None]:
    return [
        _vllm_constraint(key, body[f"guided_{key}"], f"guided_{key}")
        if body.get(f"guided_{key}") is not None
        else None
        for key in ("json", "regex", "choice", "grammar")
    ]


def _vllm_constraint(key: str, value: Any, param: str) -> Constraint:
    kind = _VLLM_KINDS[key]
    if kind == "json_schema" and isinstance(value, str):
        # vLLM takes the schema as text too (its compile refuses one nested too deep)
        return Constraint(kind, value, param)
    expected = {
        "json_schema": (dict, "an object (a JSON schema)"),
        "regex": (str, "a string"),
        "grammar": (str, "a string"),
        "choice": (list, "an array of strings"),
        "json_object": (bool, "a boolean"),
    }[kind]
    if not isinstance(value, expected[0]):
        raise bad_request(f"{param} must be {expected[1]}", param)
    if kind == "choice":
        value = tuple(value)
    if kind == "json_schema":
        check_schema_depth(value, param)
    return Constraint(kind, value, param)


MAX_SCHEMA_DEPTH = 64  # of nested objects and arrays: real schemas nest far less, and a
# deeper one's compile time soars with its depth


def check_schema_depth(schema: Any, param: str) -> None:
    """APIError(400) naming `param` for a schema nested deeper than MAX_SCHEMA_DEPTH, found
    without recursion: what walks a schema later (xgrammar, the patterns rewrite) recurses,
    and its compile time grows with the depth."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise bad_request(
                f"{param} nests more than {MAX_SCHEMA_DEPTH} objects and arrays deep", param
            )
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
