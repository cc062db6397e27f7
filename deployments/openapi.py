"""The service's /openapi.json, from the pydantic models the ingress validates requests with.

The routes read their bodies by hand (so that every bad input gets our 4xx, naming the field), so
FastAPI sees no body parameters; this module describes each route's request body from
``protocol.ChatCompletionRequest`` / ``CompletionRequest`` themselves, and its responses from the
models below, which tests/test_openapi_e2e.py holds to what the service really answers.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from cluster.config import AppConfig
from deployments import protocol as P


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error body: every 4xx and 5xx of this service."""

    error: ErrorDetail


class SpeculationUsage(BaseModel):
    proposer: str | None
    spec_steps: int
    plain_steps: int
    draft_tokens: int
    accepted_tokens: int
    grammar_draft_tokens: int
    grammar_accepted_tokens: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculation: SpeculationUsage


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[P.ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed piece of a tool call: the first carries id, type and name, later ones argument text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str]


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None
    logprobs: dict[str, Any] | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (with ``include_usage``, a last one with no choices)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """One event of a streamed completion: the choices carry text, as in the unary response."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


REQUEST_MODELS: list[type[BaseModel]] = [P.ChatCompletionRequest, P.CompletionRequest]
RESPONSE_MODELS: list[type[BaseModel]] = [
    ErrorResponse,
    ChatCompletion,
    Completion,
    ChatCompletionChunk,
    CompletionChunk,
    ModelList,
    ModelCard,
    Health,
]

# The statuses a route answers besides 200, each in the error body: which one means what.
ERRORS = {
    "400": "A bad request: the message names the problem and ``param`` the field.",
    "401": "Missing or wrong API key (only when one is configured).",
    "404": "No such model (or route).",
    "405": "Wrong method.",
    "408": "The request ran past ingress.request_timeout_s.",
    "413": "The body is larger than ingress.max_body_bytes.",
    "500": "A bug in the service.",
    "503": "At capacity (Retry-After), or the target worker failed.",
}
_COMPLETION_ERRORS = ("400", "401", "405", "408", "413", "500", "503")
_GET_ERRORS = ("401", "405", "500")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(codes: tuple[str, ...]) -> dict[str, Any]:
    return {
        c: {"description": ERRORS[c], "content": {"application/json": {"schema": _ref("ErrorResponse")}}} for c in codes
    }


def _event(chunk: str) -> dict[str, Any]:
    """One server-sent event of a stream (OpenAPI 3.1: a text/event-stream ``schema`` describes each event):
    a chunk as JSON, an error as the error body (a failure after the stream began), or the final [DONE]."""
    payload = {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
                ]
            }
        },
    }


def _completion_op(request: str, response: str, chunk: str) -> dict[str, Any]:
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {
                "description": f"The {response}; with ``stream: true`` server-sent events instead: one "
                f"``data: <{chunk} JSON>`` per chunk, then ``data: [DONE]``.",
                "content": {
                    "application/json": {"schema": _ref(response)},
                    "text/event-stream": {"schema": _event(chunk)},
                },
            },
            **_errors(_COMPLETION_ERRORS),
        },
    }


def _get_op(schema: dict[str, Any], errors: tuple[str, ...], media: str = "application/json") -> dict[str, Any]:
    return {"responses": {"200": {"description": "OK", "content": {media: {"schema": schema}}}, **_errors(errors)}}


def _deployment_limits(defs: dict[str, Any], cfg: AppConfig, proposers: list[str], vocab_size: int | None) -> None:
    """What this deployment accepts beyond the models' own bounds: its model name, its proposers, the
    ingress limits and the rules between fields (the checks ``request_parsing.parse_body`` and
    ``engine_params`` make after validating with the models)."""
    ing = cfg.ingress
    stop = {"type": "string", "minLength": 1, "maxLength": ing.max_stop_chars}
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = defs[name]["properties"]
        props["model"] = {"type": "string", "enum": [cfg.engine.served_model_name], "title": "Model"}
        props["proposer"] = {"anyOf": [{"type": "string", "enum": proposers}, {"type": "null"}], "default": None}
        props["stop"] = {
            "anyOf": [stop, {"type": "array", "items": stop, "maxItems": ing.max_stop_strings}, {"type": "null"}]
        }
        props["n"] = {**props["n"], "maximum": ing.max_n}
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props:
                props[field]["anyOf"][0]["maximum"] = ing.max_tokens_cap
    chat = defs["ChatCompletionRequest"]
    chat["properties"]["max_tokens"]["anyOf"][0]["minimum"] = 1  # 0 scores a prompt: completions with echo only
    chat["if"] = {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]}
    chat["then"] = {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}
    completion = defs["CompletionRequest"]
    completion["if"] = {"properties": {"max_tokens": {"const": 0}}, "required": ["max_tokens"]}
    completion["then"] = {"properties": {"echo": {"const": True}}, "required": ["echo"]}
    prompt = copy.deepcopy(completion["properties"]["prompt"])
    for variant in prompt["anyOf"]:
        if vocab_size is not None and variant.get("items", {}).get("type") == "integer":
            variant["items"]["maximum"] = vocab_size - 1
        elif variant.get("items", {}).get("type") == "array":
            variant["maxItems"] = ing.max_prompts
            if vocab_size is not None:
                variant["items"]["items"]["maximum"] = vocab_size - 1
        elif variant.get("items", {}).get("type") == "string":
            variant["maxItems"] = ing.max_prompts
    completion["properties"]["prompt"] = prompt


def describe(
    app: FastAPI,
    cfg: AppConfig | None = None,
    proposers: list[str] | None = None,
    vocab_size: int | None = None,
    version: str = "1",
) -> dict[str, Any]:
    """The OpenAPI document of ``app``: FastAPI's paths, with every operation's body and responses
    replaced by the ones this service really takes and gives; with ``cfg``, narrowed to what this
    deployment accepts."""
    doc = get_openapi(title=app.title, version=version, routes=app.routes)
    _, defs = models_json_schema(
        [(m, "validation") for m in REQUEST_MODELS] + [(m, "serialization") for m in RESPONSE_MODELS],
        ref_template="#/components/schemas/{model}",
    )
    ops = {
        ("/v1/chat/completions", "post"): _completion_op(
            "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"
        ),
        ("/v1/completions", "post"): _completion_op("CompletionRequest", "Completion", "CompletionChunk"),
        ("/v1/models", "get"): _get_op(_ref("ModelList"), _GET_ERRORS),
        ("/v1/models/{model_id}", "get"): _get_op(_ref("ModelCard"), (*_GET_ERRORS, "404")),
        ("/health", "get"): _get_op(_ref("Health"), ()),
        ("/metrics", "get"): _get_op({"type": "string"}, _GET_ERRORS, "text/plain"),
        ("/v1/speculation/stats", "get"): _get_op({"type": "object"}, _GET_ERRORS),
    }
    for (path, method), op in ops.items():
        old = doc["paths"][path][method]
        new = {k: v for k, v in old.items() if k not in ("requestBody", "responses")}
        if path == "/health":
            new["responses"] = op["responses"]
            new["responses"]["503"] = {
                "description": "No target replica is ready.",
                "content": {"application/json": {"schema": _ref("Health")}},
            }
        else:
            new.update(op)
            new["security"] = [{}, {"bearer": []}]  # the key is needed only when one is configured
        doc["paths"][path][method] = new
    if cfg is not None:
        _deployment_limits(defs["$defs"], cfg, proposers or [], vocab_size)
    doc.setdefault("components", {})["schemas"] = defs["$defs"]
    doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
