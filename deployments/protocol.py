"""OpenAI-compatible request models and response builders (chat and text completions).

Field names and error shapes follow the OpenAI API so the official client works
unchanged; our extensions (``speculation``, ``proposer``, ``top_k``, ``ignore_eos``)
arrive through the client's ``extra_body``. Unknown fields are rejected (400 naming
them) rather than silently ignored. Types are strict (pydantic ``strict=True``): ``"stream": "yes"``
or ``"max_tokens": "5"`` is a 400 naming the field, not a guess at what the client meant.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator

from deployments.structured import ResponseFormat, StructuredOutputs

Role = Literal["system", "developer", "user", "assistant", "tool"]
# Content part types OpenAI defines that this (text-only) model cannot take: a 400 says so, not "unknown".
NON_TEXT_PARTS = ("image_url", "input_audio", "file", "image", "audio", "video", "refusal")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


# The fields checked by hand-written validators (so that an error names the field itself) are described to
# /openapi.json by these schemas: what the validators accept, nothing more.
_TEXT_PART_SCHEMA = TextPart.model_json_schema()
_TEXT_PART_SCHEMA.pop("title", None)
_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART_SCHEMA}, {"type": "null"}]}
_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
        {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1},
    ]
}
_STOP_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]}


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str = Field(description="The arguments as JSON text (OpenAI sends a string, not an object).")


class ToolCall(BaseModel):
    """One call of a tool, as an assistant message carries it and as a response returns it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"]
    function: FunctionCall


def _message_by_role(schema: dict[str, Any]) -> None:
    """ChatMessage's JSON schema as its validators judge it: one shape per role (content may be null only
    on an assistant message, tool_call_id only and always on a 'tool' message)."""
    props = schema.pop("properties")
    schema.pop("required", None)
    schema.pop("additionalProperties", None)
    content = {"anyOf": _CONTENT_SCHEMA["anyOf"][:2]}

    def shape(roles: list[str], required: list[str], **fields: Any) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"role": {"type": "string", "enum": roles}, "name": props["name"], **fields},
            "required": ["role", *required],
            "additionalProperties": False,
        }

    schema["anyOf"] = [
        shape(["system", "developer", "user"], ["content"], content=content),
        {  # content, or calls (then content may be null)
            **shape(["assistant"], [], content=props["content"], tool_calls=props["tool_calls"]),
            "anyOf": [
                {"required": ["content"], "properties": {"content": content}},
                {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}},
            ],
        },
        shape(["tool"], ["content", "tool_call_id"], content=content, tool_call_id={"type": "string"}),
    ]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_message_by_role)

    # tool_calls and tool_call_id come before content: the validators of the later fields read the earlier ones.
    role: Role
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(
        None, description="Calls an assistant message made (its content may then be null)."
    )
    tool_call_id: str | None = Field(None, validate_default=True, description="The call a 'tool' message answers.")
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = Field(
        None, validate_default=True, description="A string, or a list of text parts."
    )

    @field_validator("tool_calls")
    @classmethod
    def _calls_from_assistant(cls, v: list[ToolCall] | None, info: ValidationInfo) -> list[ToolCall] | None:
        if v and info.data.get("role") != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        for i, call in enumerate(v or []):
            try:
                json.loads(call.function.arguments)
            except ValueError as e:  # the error names the call, since a field validator cannot point deeper
                raise ValueError(f"tool_calls.{i}.function.arguments is not valid JSON ({e})") from None
        return v or None  # [] is what some clients send for "no calls"

    @field_validator("tool_call_id")
    @classmethod
    def _id_on_tool_messages(cls, v: str | None, info: ValidationInfo) -> str | None:
        role = info.data.get("role")
        if role == "tool" and v is None:
            raise ValueError("a 'tool' message needs the tool_call_id of the call it answers")
        if role is not None and role != "tool" and v is not None:
            raise ValueError("only 'tool' messages carry tool_call_id")
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: object, info: ValidationInfo) -> object:
        # One validator instead of a pydantic union, so that an error names 'messages.N.content' itself.
        if v is None:
            # tool_calls missing from info.data failed validation: its own error says why, not this one
            if info.data.get("role") == "assistant" and (info.data.get("tool_calls") or "tool_calls" not in info.data):
                return None
            raise ValueError("is required (it may be null only on an assistant message with tool_calls)")
        if isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of text parts")
        parts = []
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NON_TEXT_PARTS:
                raise ValueError(f"content part {i} is of type '{kind}', which this model does not support (text only)")
            if kind != "text" or not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise ValueError(f"content part {i} must be {{'type': 'text', 'text': <string>}}")
            parts.append(TextPart(type="text", text=part["text"]))
        return parts

    def text(self) -> str:
        """The message's text: a string, or its text parts joined (as OpenAI concatenates them)."""
        if self.content is None:  # an assistant message that only calls tools
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, str]:
        """What the chat template gets: ``developer`` is OpenAI's newer name for ``system``."""
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM: usage on every chunk.")


# Real OpenAI fields this server does not implement, looked for before validation so that the 400 can say
# "not supported" (a feature gap) instead of "unknown field" (a typo): see ``strip_unsupported``.
UNSUPPORTED_CHAT = (
    "functions",
    "function_call",
    "logit_bias",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
    "reasoning_effort",
)
UNSUPPORTED_COMPLETION = ("suffix", "best_of", "logit_bias")


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo (score the prompt).")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, description="Choices per prompt, each its own engine request (seed + i when seeded).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[list[str], WithJsonSchema(_STOP_SCHEMA)] = Field(
        default_factory=list, description="A string or a list of strings."
    )
    seed: int | None = None
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM's multiplicative penalty; 1 = off.")
    ignore_eos: bool = False
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema: constrained output.")
    # extensions
    speculation: Literal["auto", "on", "off"] = "auto"
    proposer: str | None = None
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM's: json, regex, choice or grammar.")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v


TOOL_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=TOOL_NAME_PATTERN, description="Unique among the request's tools.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="A JSON schema of type 'object'; absent: no arguments.")
    strict: bool | None = Field(
        None, description="OpenAI's structured-outputs flag (required and named choices are enforced anyway)."
    )

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # The arguments are a JSON object in every tool-call format, so their schema must describe one.
        if v is not None and v.get("type") != "object":
            got = json.dumps(v.get("type"))
            raise ValueError(f'must be a JSON schema with "type": "object", got "type": {got}')
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """``tool_choice`` naming one function: the model must call that one."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(_Common):
    """OpenAI's chat completions request with our extensions. Types are strict: an integer field refuses
    5.0 (which a JSON schema cannot tell from 5) and "5", a boolean refuses 1."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Return each output token's log probability.")
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="Most likely alternatives per token (needs logprobs)."
    )
    # tools before tool_choice: tool_choice's validator reads the validated tools
    tools: list[Tool] | None = Field(None, min_length=1, max_length=128, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(
        None, description="'none', 'auto' (the default with tools), 'required', or one named function."
    )
    parallel_tool_calls: bool = Field(True, description="Allow more than one call in an answer.")

    @field_validator("messages")
    @classmethod
    def _tool_messages_answer_calls(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        # As OpenAI: a tool result follows the assistant message that made the call (other results between).
        open_ids: set[str] = set()
        for i, m in enumerate(v):
            if m.role == "tool":
                if m.tool_call_id not in open_ids:
                    raise ValueError(
                        f"messages.{i} is a 'tool' message whose tool_call_id {m.tool_call_id!r} "
                        f"answers no tool call of the assistant message before it"
                    )
                continue
            open_ids = {c.id for c in m.tool_calls or ()}
        return v

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[Tool] | None) -> list[Tool] | None:
        # A call names its function, so two tools of one name would make the answer ambiguous.
        seen: set[str] = set()
        for i, t in enumerate(v or ()):
            if t.function.name in seen:
                raise ValueError(f"tools.{i}.function.name {t.function.name!r} is used by an earlier tool")
            seen.add(t.function.name)
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, v: object) -> object:
        # Checked by hand instead of by the union, so that an error names 'tool_choice' itself.
        if v is None or v in ("none", "auto", "required"):
            return v
        fn = v.get("function") if isinstance(v, dict) else None
        if (
            not isinstance(v, dict)
            or set(v) != {"type", "function"}
            or v["type"] != "function"
            or not isinstance(fn, dict)
            or set(fn) != {"name"}
            or not isinstance(fn["name"], str)
        ):
            raise ValueError(
                "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': <string>}}"
            )
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_in_tools(cls, v: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if v is None or "tools" not in info.data:  # tools itself failed: its own error says why
            return v
        tools: list[Tool] | None = info.data["tools"]
        if tools is None:
            raise ValueError("tool_choice is only allowed when tools are given")
        if isinstance(v, NamedToolChoice) and v.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names the function {v.function.name!r}, which is not among the tools")
        return v


class CompletionRequest(_Common):
    """OpenAI's (legacy) completions request with our extensions. Types are strict: an integer field
    refuses 5.0 (which a JSON schema cannot tell from 5) and "5", a boolean refuses 1."""

    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)] = Field(
        description="Text, token ids, or a list of either (one choice set per prompt)."
    )
    echo: bool = Field(False, description="Return the prompt before the completion.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Log probability of each token and this many alternatives."
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        # One validator instead of a pydantic union, so that an error names 'prompt' itself.

        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        ok = (
            isinstance(v, str)
            or ids(v)
            or (isinstance(v, list) and (all(isinstance(p, str) for p in v) or all(ids(p) for p in v)))
        )
        if not ok:
            raise ValueError("must be a string, a list of token ids, or a list of strings or of token-id lists")
        if len(v) == 0 or (isinstance(v, list) and any(isinstance(p, (str, list)) and len(p) == 0 for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts of a (possibly batched) request."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


def strip_unsupported(data: dict[str, Any], chat: bool) -> str | None:
    """Before validation: drop the settings that ask for nothing this server does not do anyway
    (``best_of`` = n, a null ``parallel_tool_calls`` without tools) and return the
    first real OpenAI field it does not implement, or None. The 400 then says "not supported" (a
    feature gap), not "unknown field" (a typo)."""
    if not chat and "best_of" in data and data["best_of"] == data.get("n", 1):
        data.pop("best_of")
    if data.get("tools") is None and "parallel_tool_calls" in data and data["parallel_tool_calls"] is None:
        data.pop("parallel_tool_calls")  # what is there is validated: a flag of the wrong type is a 400
    for name in UNSUPPORTED_CHAT if chat else UNSUPPORTED_COMPLETION:
        if data.get(name) is not None:
            return name
    return None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None, code: Any = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(final: dict) -> dict:
    """OpenAI usage plus our ``speculation`` block, from the target's last chunk."""
    spec = final["spec"]
    return {
        "prompt_tokens": final["num_prompt_tokens"],
        "completion_tokens": final["num_output_tokens"],
        "total_tokens": final["num_prompt_tokens"] + final["num_output_tokens"],
        "prompt_tokens_details": {"cached_tokens": final.get("num_cached_tokens", 0)},
        "speculation": {
            "proposer": final["proposer"],
            "spec_steps": spec["spec_steps"],
            "plain_steps": spec["plain_steps"],
            "draft_tokens": spec["num_draft_tokens"],
            "accepted_tokens": spec["num_accepted_tokens"],
            # of the draft / accepted tokens, those the grammar forced (structured output), not the proposer's
            "grammar_draft_tokens": spec.get("num_grammar_draft_tokens", 0),
            "grammar_accepted_tokens": spec.get("num_grammar_accepted_tokens", 0),
        },
    }


# Logprob entries travel from the target as [token_id, logprob, [[token_id, logprob], ...]].
LogprobEntry = list  # [int, float, list[list]]


def _token(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    text = tokenizer.decode([token_id])
    return text, list(text.encode("utf-8"))


def chat_logprobs(entries: list[LogprobEntry], tokenizer: Any) -> dict:
    """OpenAI chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    content = []
    for tid, lp, top in entries:
        text, raw = _token(tokenizer, tid)
        alts = []
        for aid, alp in top:
            atext, araw = _token(tokenizer, aid)
            alts.append({"token": atext, "logprob": alp, "bytes": araw})
        content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": alts})
    return {"content": content}


def completion_logprobs(entries: list[LogprobEntry], tokenizer: Any, text_offset: int = 0) -> dict:
    """OpenAI completions ``logprobs``: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs``
    (one ``{token: logprob}`` per position) and ``text_offset`` (each token's start in the text)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp, top in entries:
        text, _ = _token(tokenizer, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)  # None for the first prompt token (nothing before it)
        out["top_logprobs"].append(None if top is None else {_token(tokenizer, aid)[0]: alp for aid, alp in top})
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out


def chat_response(rid: str, model: str, text: str, finish_reason: str | None, final: dict) -> dict:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
                "logprobs": None,
            }
        ],
        "usage": usage(final),
    }


def completion_response(rid: str, model: str, text: str, finish_reason: str | None, final: dict) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
        "usage": usage(final),
    }


def chat_chunk(rid: str, model: str, delta: dict, finish_reason: str | None, created: int) -> dict:
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
    }


def completion_chunk(rid: str, model: str, text: str, finish_reason: str | None, created: int) -> dict:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}],
    }
