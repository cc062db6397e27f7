"""OpenAI request models: strict types and unknown fields rejected, naming the field (no cluster needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.protocol import ChatCompletionRequest, CompletionRequest, strip_unsupported

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"stream": "yes"}, "stream"),
        ({"stream": 1}, "stream"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"temperature": "0.5"}, "temperature"),
        ({"stream_options": {"include_usage": "true"}}, "stream_options.include_usage"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages.0.content"),
        ({"speculation": "yes"}, "speculation"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_wrong_types_are_errors_naming_the_field(patch: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT, **patch})
    assert field in {".".join(str(p) for p in err["loc"]) for err in e.value.errors()}


def test_what_json_clients_send_still_parses() -> None:
    r = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "temperature": 1,
            "top_p": 1,
            "max_tokens": 8,
            "stream": True,
            "stop": "END",
            "stream_options": {"include_usage": True},
        }
    )
    assert r.temperature == 1.0 and r.stream and r.stop == ["END"]
    c = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2, 3], "presence_penalty": 0})
    assert c.prompt == [1, 2, 3]


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"response_format": {"type": "text", "json_schema": {"name": "x", "schema": False}}}, "response_format"),
        ({"response_format": {"type": "text", "junk": 1}}, "response_format.junk"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ],
)
def test_settings_that_ask_for_nothing_are_still_validated(patch: dict, field: str) -> None:
    """Found by fuzzing /openapi.json: ``response_format`` of type text and ``parallel_tool_calls``
    without tools were dropped before validation, so anything beside them was accepted."""
    data = {**CHAT, **patch}
    assert strip_unsupported(data, chat=True) is None
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(data)
    assert any(".".join(str(p) for p in err["loc"]).startswith(field) for err in e.value.errors())


def test_plain_text_format_and_null_flags_still_parse() -> None:
    data = {**CHAT, "response_format": {"type": "text"}, "parallel_tool_calls": None}
    assert strip_unsupported(data, chat=True) is None
    r = ChatCompletionRequest.model_validate(data)
    assert r.response_format is not None and r.response_format.type == "text" and r.parallel_tool_calls
