"""End to end against hostile clients, on one small cluster (a tiny random model, an API key, a short
request timeout): the served /openapi.json holds for real traffic, a bounded schemathesis fuzz over it
finds nothing, and shapes fuzzers miss (a client that stops reading, a 10,000-message conversation,
JSON nested 100k deep) get a 4xx or an answer, quickly, and leave the engine free.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import jsonschema
import pytest

from benchmarks.serving.fuzz import fuzz, greedy
from cluster.local_cluster import LocalCluster
from tests.e2e_helpers import started, wait_for

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
KEY = "sk-test"
TIMEOUT_S = 90.0  # the stalled-stream test sends 128 choices; on a slow 2-core host the last starts after 20 s
IDLE_S = 8.0  # ingress.stream_idle_timeout_s: a stream whose client takes nothing for this long is cut
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    args = {
        "engine": {"model": tiny_model_dir, "proposers": [{"name": "ngram"}, {"name": "suffix"}]},
        "draft": {"enabled": False},
        # a small max_tokens cap: the description says so, and the fuzzer's requests stay cheap
        "ingress": {
            "api_key": KEY,
            "request_timeout_s": TIMEOUT_S,
            "stream_idle_timeout_s": IDLE_S,
            "max_tokens_cap": 128,
            "default_max_tokens": 32,
        },
    }
    with started(LocalCluster(tmp_path_factory.mktemp("hostile"), nodes=1, args_patch=args)) as c:
        yield c


@pytest.fixture(scope="module")
def doc(cluster) -> dict[str, Any]:
    r = httpx.get(f"{cluster.base_url}/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def conforms(doc: dict[str, Any], instance: Any, schema: dict[str, Any]) -> None:
    """``instance`` against ``schema``, whose $refs point into the document's components."""
    jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(instance)


def response_schema(doc: dict[str, Any], path: str, method: str, status: int, media: str) -> dict[str, Any]:
    responses = doc["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answered {status}, which is not described"
    content = responses[str(status)]["content"]
    assert media in content, f"{method.upper()} {path} {status} answered {media}, not among {list(content)}"
    return content[media]["schema"]


def exchange(
    doc: dict[str, Any], base: str, method: str, path: str, body: Any = None, valid: bool = True, **kw: Any
) -> httpx.Response:
    """One real request: its body conforms to the description iff ``valid``; the response conforms."""
    route = "/v1/models/{model_id}" if path.startswith("/v1/models/") else path
    if body is not None:
        body_schema = doc["paths"][route][method]["requestBody"]["content"]["application/json"]["schema"]
        if valid:
            conforms(doc, body, body_schema)
        else:  # what the description refuses, the service refuses
            with pytest.raises(jsonschema.ValidationError):
                conforms(doc, body, body_schema)
    r = httpx.request(method.upper(), base + path, json=body, timeout=60, **kw)
    media = r.headers["content-type"].split(";")[0]
    schema = response_schema(doc, route, method, r.status_code, media)
    if media == "application/json":
        conforms(doc, r.json(), schema)
    elif media == "text/event-stream":  # each event: a chunk or error as JSON, or the final [DONE]
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]"
        for data in events[:-1]:
            conforms(doc, {"data": data}, schema)
            conforms(doc, json.loads(data), schema["properties"]["data"]["anyOf"][1]["contentSchema"])
    return r


def chat_body(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0, **kw}


def test_openapi_describes_real_requests_and_responses(cluster, doc):
    base = cluster.base_url
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert doc["paths"][path]["post"]["requestBody"]["required"]
    r = exchange(doc, base, "post", "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=2), headers=AUTH)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"]["content"]
    r = exchange(
        doc,
        base,
        "post",
        "/v1/completions",
        {"model": MODEL, "prompt": ["a b", "c d"], "max_tokens": 4, "n": 2, "echo": True, "logprobs": 1, "stop": "x"},
        headers=AUTH,
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    so = {"include_usage": True}
    r = exchange(doc, base, "post", "/v1/chat/completions", chat_body(stream=True, stream_options=so), headers=AUTH)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    body = {"model": MODEL, "prompt": "a", "max_tokens": 6, "stream": True, "logprobs": 2, "echo": True}
    assert exchange(doc, base, "post", "/v1/completions", body, headers=AUTH).status_code == 200
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for stream in (False, True):
        body = chat_body(tools=tools, tool_choice="required", stream=stream, max_tokens=40)
        assert exchange(doc, base, "post", "/v1/chat/completions", body, headers=AUTH).status_code == 200
    # errors: each in the described error body, naming the problem
    r = exchange(doc, base, "post", "/v1/chat/completions", chat_body(), headers={})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = exchange(doc, base, "post", "/v1/chat/completions", chat_body(temperature=7), False, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = exchange(doc, base, "post", "/v1/chat/completions", chat_body(max_tokens=100_000), False, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    junk = {"type": "text", "json_schema": {"name": "x", "schema": False}}  # the fuzzer's find: was a 200
    r = exchange(doc, base, "post", "/v1/chat/completions", chat_body(response_format=junk), False, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")
    body = chat_body(response_format={"type": "text"})
    assert exchange(doc, base, "post", "/v1/chat/completions", body, headers=AUTH).status_code == 200
    r = exchange(doc, base, "post", "/v1/chat/completions", chat_body(model="gpt-4"), False, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    r = exchange(doc, base, "get", "/v1/models/nope", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert exchange(doc, base, "get", f"/v1/models/{MODEL}", headers=AUTH).json()["id"] == MODEL
    assert exchange(doc, base, "get", "/v1/models", headers=AUTH).status_code == 200
    assert exchange(doc, base, "get", "/health").status_code == 200
    assert exchange(doc, base, "get", "/metrics", headers=AUTH).status_code == 200
    assert exchange(doc, base, "get", "/v1/speculation/stats", headers=AUTH).status_code == 200
    big = httpx.post(base + "/v1/chat/completions", content=b" " * 1_100_000, headers=AUTH, timeout=60)
    assert big.status_code == 413
    conforms(doc, big.json(), response_schema(doc, "/v1/chat/completions", "post", 413, "application/json"))


def test_bounded_fuzz_finds_nothing_and_leaves_no_state(cluster):
    """schemathesis over the served description, every operation with and without the key: no 5xx, no
    answer past the request timeout, every response as described; the same greedy answer after."""
    before = greedy(cluster.base_url, KEY)
    out = fuzz(cluster.base_url, KEY, max_examples=30, request_timeout_s=TIMEOUT_S)
    assert out["cases"] >= 300, out["by_operation"]
    assert out["findings"] == [], json.dumps(out["findings"], indent=1)[:5000]
    assert out["slowest_s"] < TIMEOUT_S + 5
    assert greedy(cluster.base_url, KEY) == before


def engine_busy(cluster) -> int:
    """Requests the engine holds (running or waiting), over every target replica."""
    stats = httpx.get(f"{cluster.base_url}/v1/speculation/stats", headers=AUTH, timeout=30).json()
    return sum(r["running"] + r["waiting"] for r in stats["replicas"].values())


def test_a_client_that_stops_reading_is_cut_after_the_idle_limit(cluster):
    """A stream whose client reads the headers and then nothing, without disconnecting: the engine
    finishes it (or aborts it, once cut) and frees its slot, other requests go on, and once the client
    has taken nothing for ``stream_idle_timeout_s`` the HTTP proxy gives the stream up
    (deployments/proxy_middleware.py): a client that reads again gets what its socket held, then the
    close, never the end of the stream."""
    # 128 streams of 128 tokens with logprobs: megabytes, more than the sockets' buffers take
    prompts = [f"count {i}" for i in range(16)]
    body = {
        "model": MODEL,
        "prompt": prompts,
        "stream": True,
        "max_tokens": 128,
        "n": 8,
        "ignore_eos": True,
        "logprobs": 5,
    }
    raw = json.dumps(body).encode()
    host, port = cluster.base_url.removeprefix("http://").split(":")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect((host, int(port)))
    try:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nConnection: close\r\nHost: %s\r\nAuthorization: Bearer %s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (host.encode(), KEY.encode(), len(raw), raw)
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1)
        stalled_at = time.monotonic()
        assert b" 200 " in head.split(b"\r\n")[0], head
        assert b"x-specserve" not in head.lower()  # the limit travels from the ingress to the proxy only
        r = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=chat_body(), headers=AUTH, timeout=60)
        assert r.status_code == 200
        wait_for(lambda: engine_busy(cluster) == 0, TIMEOUT_S + 10, "the stalled stream's engine slot freed")
        time.sleep(max(0.0, stalled_at + IDLE_S + 4 - time.monotonic()))
        rest = head.split(b"\r\n\r\n", 1)[1]
        s.settimeout(30)
        while chunk := s.recv(1 << 16):  # reading again: what the socket held, then the close
            rest += chunk
        assert rest.count(b"data: ") > 0
        assert b"data: [DONE]" not in rest, "the stalled stream was not cut"
        assert rest.count(b'"finish_reason": "length"') < 128
    finally:
        s.close()
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=chat_body(), headers=AUTH, timeout=60)
    assert r.status_code == 200


def test_a_10000_message_conversation_is_refused_quickly_naming_the_context(cluster):
    messages = [{"role": ("user", "assistant")[i % 2], "content": "hi"} for i in range(10_000)]
    body = {"model": MODEL, "messages": messages, "max_tokens": 4}
    assert len(json.dumps(body)) < 1_000_000  # under the body limit: the context is what refuses it
    t0 = time.monotonic()
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert "context" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 15


def test_json_nested_100k_deep_in_messages_is_a_400(cluster):
    raw = b'{"model": "%s", "messages": ' % MODEL.encode() + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = httpx.post(
        f"{cluster.base_url}/v1/chat/completions",
        content=raw,
        headers={**AUTH, "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
