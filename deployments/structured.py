"""The request fields that constrain output: OpenAI's ``response_format`` and vLLM's ``structured_outputs``.

Both turn into one ``StructuredOutput`` (workers/sampling_params.py) that travels with the sampling
params to the target, whose engine compiles it off its step loop (workers/grammar.py). Here only
the shape is checked; whether a schema, regex or grammar compiles is the engine's 400 to give,
since only it holds the tokenizer the grammar is compiled against.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="A JSON schema; absent = any JSON.")
    strict: bool | None = Field(None, description="Accepted; the output always follows the schema exactly.")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a 'json_schema' object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"'json_schema' is only for type 'json_schema', not {self.type!r}")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` extension: exactly one of the constraints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (object or JSON text).")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = Field(None, description="A Lark or GBNF grammar.")
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            names = [g.rstrip("_") for g in given]
            raise ValueError(f"set exactly one of json, regex, choice, grammar, json_object (got {names or 'none'})")
        return self


def structured_params(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None
) -> dict[str, Any] | None:
    """The ``structured`` entry of the engine's sampling params, or None (unconstrained). Raises
    ``ValueError`` naming the field when both fields constrain the same request."""
    fmt = response_format if response_format is not None and response_format.type != "text" else None
    if fmt is not None and structured_outputs is not None:
        raise ValueError("give response_format or structured_outputs, not both")
    if fmt is not None:
        if fmt.type == "json_object" or fmt.json_schema is None or fmt.json_schema.schema_ is None:
            return {"kind": "json_object", "param": "response_format"}
        return {"kind": "json", "value": _canonical(fmt.json_schema.schema_), "param": "response_format.json_schema"}
    so = structured_outputs
    if so is None:
        return None
    if so.json_ is not None:
        schema = so.json_ if isinstance(so.json_, dict) else _parse(so.json_, "structured_outputs.json")
        return {"kind": "json", "value": _canonical(schema), "param": "structured_outputs.json"}
    if so.regex is not None:
        return {"kind": "regex", "value": so.regex, "param": "structured_outputs.regex"}
    if so.choice is not None:
        return {"kind": "choice", "value": list(so.choice), "param": "structured_outputs.choice"}
    if so.grammar is not None:
        return {"kind": "grammar", "value": so.grammar, "param": "structured_outputs.grammar"}
    return {"kind": "json_object", "param": "structured_outputs.json_object"}


def _canonical(schema: Any) -> str:
    """One compact text per schema, so equal schemas share the engine's compiled-grammar cache. Keys keep
    their order: a schema's ``properties`` order is the order the object's keys are written in."""
    return json.dumps(schema, separators=(",", ":"))


def _parse(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ValueError(f"{param}: not valid JSON ({e})") from None
