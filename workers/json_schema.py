"""Closing a JSON schema's objects: what a constrained decoder should write, not all the schema allows.

A schema whose object lists ``properties`` but says nothing of ``additionalProperties`` allows any
other key too, and a small model takes that door: after the listed keys it keeps inventing more
until ``max_tokens`` cuts it off (seen with SmolLM2 and the function schemas langchain sends). Closing
such objects, as xgrammar's default ``strict_mode`` does, only narrows the output: every object
written under the closed schema is valid under the original one.
"""

from __future__ import annotations

from typing import Any

_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas")  # name -> schema
_SCHEMA_ONE = (
    "items",
    "additionalItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
    "additionalProperties",
    "unevaluatedItems",
)  # -> one schema
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")  # -> schemas; allOf is left open (closed parts would clash)
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def close_objects(schema: Any) -> Any:
    """A copy of ``schema`` where every object that lists ``properties`` and none of ``additionalProperties``,
    ``patternProperties`` or ``unevaluatedProperties`` gets ``additionalProperties: false``."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and not any(k in out for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: close_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = close_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [close_objects(sub) for sub in out[key]]
    return out
