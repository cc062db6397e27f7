"""/openapi.json (deployments/openapi.py) agrees with the validation it describes, without a cluster:
every route has its body and responses, and the request cases the service refuses (tests/bad_inputs.py)
are refused by the description too, while the requests it answers conform to it."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from cluster.config import AppConfig
from cluster.local_cluster import shipped_app_args
from deployments import protocol as P
from deployments.ingress import app
from deployments.openapi import describe
from tests.bad_inputs import CHAT, HOSTILE, MODEL

VOCAB = 49152
# Refused for what no schema can say: the key, the body's bytes, a route, a token the model lacks.
# a schema cannot count tokens: context-length refusals depend on the tokenizer and the deployment
NOT_DESCRIBABLE = {
    "body above max_body_bytes",
    "unknown route",
    "wrong method",
    "prompt + max_tokens over max_model_len",
    "chat prompt over max_model_len",
    "completions prompt over max_model_len",
}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return describe(app, AppConfig.model_validate(shipped_app_args()), ["ngram", "suffix"], VOCAB)


def accepts(doc: dict[str, Any], name: str, instance: Any) -> bool:
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(instance)


def test_every_route_has_its_body_and_responses(doc):
    jsonschema.Draft202012Validator.check_schema(doc["components"]["schemas"]["ChatCompletionRequest"])
    posts = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}
    for path, name in posts.items():
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            assert "200" in op["responses"], (method, path)
            for status, resp in op["responses"].items():
                if status.startswith(("4", "5")) and path != "/health":
                    assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert accepts(doc, "ErrorResponse", P.error_body("bad", param="x"))

    def refs(x: Any) -> list[str]:
        if isinstance(x, dict):
            return ([x["$ref"]] if "$ref" in x else []) + [r for v in x.values() for r in refs(v)]
        return [r for v in x for r in refs(v)] if isinstance(x, list) else []

    names = {r.removeprefix("#/components/schemas/") for r in refs(doc)}
    assert names <= set(doc["components"]["schemas"]), names - set(doc["components"]["schemas"])


def test_the_description_refuses_what_the_service_refuses(doc):
    checked = 0
    for name, route, payload, _param, _status in HOSTILE:
        if name in NOT_DESCRIBABLE or not isinstance(payload, dict) or route.startswith("GET "):
            continue
        payload = dict(payload)
        keep_null = payload.pop("_keep_null", False)
        base = {"model": MODEL, "max_tokens": 4}
        base.update({"messages": [{"role": "user", "content": "hi"}]} if route == CHAT else {"prompt": "hi"})
        body = {**base, **payload}
        if not keep_null:
            body = {k: v for k, v in body.items() if v is not None}
        schema = "ChatCompletionRequest" if route == CHAT else "CompletionRequest"
        assert not accepts(doc, schema, body), name
        checked += 1
    assert checked > 30


@pytest.mark.parametrize(
    "schema,body",
    [
        ("ChatCompletionRequest", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
        (
            "ChatCompletionRequest",
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "tool", "content": "42", "tool_call_id": "c1"},
                ],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": True,
                "top_logprobs": 3,
                "stop": "\n",
                "speculation": "off",
                "proposer": "suffix",
                "response_format": {"type": "text"},
            },
        ),
        ("CompletionRequest", {"model": MODEL, "prompt": [[1, 2], [3]], "max_tokens": 0, "echo": True, "logprobs": 2}),
        ("CompletionRequest", {"model": MODEL, "prompt": ["a", "b"], "structured_outputs": {"regex": "[ab]+"}}),
    ],
)
def test_requests_the_service_answers_conform(doc, schema, body):
    model = P.ChatCompletionRequest if schema == "ChatCompletionRequest" else P.CompletionRequest
    model.model_validate(body)
    assert accepts(doc, schema, body)


def test_a_tool_message_without_its_call_id_is_refused_by_both(doc):
    body = {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}
    assert not accepts(doc, "ChatCompletionRequest", body)
    with pytest.raises(ValueError, match="tool_call_id"):
        P.ChatCompletionRequest.model_validate(body)


def test_a_streamed_event_is_described_as_its_chunk_not_as_a_string(doc):
    """What the fuzzer found first: the stream's schema said "string", while OpenAPI 3.1 reads a
    text/event-stream schema as each event's; each event's data is now a chunk, an error body or [DONE]."""
    event = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]["schema"]
    payload = event["properties"]["data"]["anyOf"][1]["contentSchema"]
    chunk = P.chat_chunk("chatcmpl-1", MODEL, {"role": "assistant", "content": "hi"}, None, 0)
    for data in ("[DONE]", '{"id": "x"}'):
        assert jsonschema.Draft202012Validator(event).is_valid({"data": data})
    check = jsonschema.Draft202012Validator({**payload, "components": doc["components"]})
    assert check.is_valid(chunk) and check.is_valid(P.error_body("failed", "server_error"))
    assert not check.is_valid({"id": "x"})
    completion = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]["text/event-stream"]
    payload = completion["schema"]["properties"]["data"]["anyOf"][1]["contentSchema"]
    check = jsonschema.Draft202012Validator({**payload, "components": doc["components"]})
    assert check.is_valid(P.completion_chunk("cmpl-1", MODEL, "hi", "stop", 0))
