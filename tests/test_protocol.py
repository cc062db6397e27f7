"""OpenAI request models: strict types and unknown fields rejected, naming the field (no cluster needed)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from deployments.protocol import ChatCompletionRequest, CompletionRequest

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
