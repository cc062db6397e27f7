"""OpenAI-compatible request models and response builders (chat and text completions).

Field names and error shapes follow the OpenAI API so the official client works
unchanged; our extensions (``speculation``, ``proposer``, ``top_k``, ``ignore_eos``)
arrive through the client's ``extra_body``. Unknown fields are rejected (400 naming
them) rather than silently ignored. Types are strict (pydantic ``strict=True``): ``"stream": "yes"``
or ``"max_tokens": "5"`` is a 400 naming the field, not a guess at what the client meant.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Role = Literal["system", "user", "assistant"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Role
    content: str
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: Literal[1] = Field(1, description="Only n=1 is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: list[str] = Field(default_factory=list, description="A string or a list of strings.")
    seed: int | None = None
    user: str | None = None
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0
    ignore_eos: bool = False
    # extensions
    speculation: Literal["auto", "on", "off"] = "auto"
    proposer: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if v is None:
            return []
        return [v] if isinstance(v, str) else v


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = Field(False, description="Return each output token's log probability.")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="Most likely alternatives per token (needs logprobs).")


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(description="Text, or token ids.")
    logprobs: int | None = Field(None, ge=0, le=20, description="Log probability of each token and this many alternatives.")

    @field_validator("prompt")
    @classmethod
    def _nonempty(cls, v: str | list[int]) -> str | list[int]:
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v


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
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_token(tokenizer, aid)[0]: alp for aid, alp in top})
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
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason, "logprobs": None}
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
