"""Hostile and malformed requests for the bad-input test (tests/test_reliability.py), as data.

Each case: (name, route, raw body bytes or JSON merged over a valid body (None drops the field;
"_keep_null" keeps explicit nulls), the error ``param`` expected, the HTTP status expected (None:
any 4xx)). ``send`` posts one.
"""

from __future__ import annotations

from typing import Any

import httpx

MODEL = "SmolLM2-135M-Instruct"

# Together with tests/test_e2e_http.py's 21 cases this makes well over 30 kinds.
# (name, route, raw body or JSON merged over a valid body (None = drop the field), expected param, status)
CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
BIG = 1_100_000  # above the default max_body_bytes (1 MB)
HOSTILE: list[tuple[str, str, Any, str | None, int | None]] = [
    ("body above max_body_bytes", CHAT, {"messages": [{"role": "user", "content": "a" * BIG}]}, None, 413),
    ("huge stop list", CHAT, {"stop": ["x"] * 10_000}, "stop", None),
    ("stop string too long", CHAT, {"stop": ["s" * 1000]}, "stop", None),
    ("empty stop string", CHAT, {"stop": [""]}, "stop", None),
    ("stop wrong type", CHAT, {"stop": 42}, "stop", None),
    ("messages a string", CHAT, {"messages": "hello"}, "messages", None),
    ("messages of strings", CHAT, {"messages": ["hello"]}, "messages.0", None),
    ("message missing content", CHAT, {"messages": [{"role": "user"}]}, "messages.0.content", None),
    ("temperature a string", CHAT, {"temperature": "hot"}, "temperature", None),
    ("temperature above 2", CHAT, {"temperature": 7}, "temperature", None),
    (
        "temperature NaN",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}' % MODEL.encode(),
        "temperature",
        None,
    ),
    ("stream wrong type", CHAT, {"stream": {"on": True}}, "stream", None),
    ("stream a string", CHAT, {"stream": "yes"}, "stream", None),
    ("max_tokens a numeric string", CHAT, {"max_tokens": "5"}, "max_tokens", None),
    (
        "stream_options nested garbage",
        CHAT,
        {"stream": True, "stream_options": {"include_usage": {"a": [1]}}},
        "stream_options.include_usage",
        None,
    ),
    (
        "null model",
        CHAT,
        {"model": None, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "_keep_null": True},
        "model",
        None,
    ),
    ("null temperature", CHAT, {"temperature": None, "_keep_null": True}, "temperature", None),
    (
        "nested garbage content",
        CHAT,
        {"messages": [{"role": "user", "content": {"a": [1, {"b": None}]}}]},
        "messages.0.content",
        None,
    ),
    (
        "unknown field in a message",
        CHAT,
        {"messages": [{"role": "user", "content": "x", "evil": {"a": 1}}]},
        "messages.0.evil",
        None,
    ),
    ("JSON nested 100k deep", CHAT, b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, None),
    (
        "lone surrogate",
        CHAT,
        b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode(),
        None,
        None,
    ),
    ("empty body", CHAT, b"", None, None),
    ("form-encoded body", CHAT, b"model=x&messages=y", None, None),
    ("max_tokens fractional", CHAT, {"max_tokens": 1.5}, "max_tokens", None),
    ("max_tokens 10**30", CHAT, {"max_tokens": 10**30}, "max_tokens", None),
    ("top_k negative", CHAT, {"top_k": -1}, "top_k", None),
    ("top_logprobs above 20", CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("top_logprobs without logprobs", CHAT, {"top_logprobs": 2}, "top_logprobs", None),
    ("logprobs a string", CHAT, {"logprobs": "yes"}, "logprobs", None),
    ("completions logprobs above 20", COMPL, {"logprobs": 21}, "logprobs", None),
    ("seed not an integer", CHAT, {"seed": 1.5}, "seed", None),
    ("seed a string", COMPL, {"seed": "42"}, "seed", None),
    ("presence_penalty below -2", CHAT, {"presence_penalty": -3.0}, "presence_penalty", None),
    ("frequency_penalty a string", CHAT, {"frequency_penalty": "high"}, "frequency_penalty", None),
    ("repetition_penalty zero", CHAT, {"repetition_penalty": 0}, "repetition_penalty", None),
    ("completions empty prompt", COMPL, {"prompt": ""}, "prompt", None),
    ("completions empty token list", COMPL, {"prompt": []}, "prompt", None),
    ("completions token id above vocab", COMPL, {"prompt": [1, 2, 10**9]}, "prompt", None),
    ("completions negative token id", COMPL, {"prompt": [-1, 5]}, "prompt", None),
    ("completions prompts nested too deep", COMPL, {"prompt": [[[1, 2]]]}, None, None),
    ("completions too many prompts", COMPL, {"prompt": ["a"] * 40}, "prompt", None),
    ("completions max_tokens 0 without echo", COMPL, {"max_tokens": 0}, "max_tokens", None),
    ("chat max_tokens 0", CHAT, {"max_tokens": 0}, "max_tokens", None),
    ("completions prompt a number", COMPL, {"prompt": 12345}, None, None),
    ("completions with messages", COMPL, {"messages": [{"role": "user", "content": "x"}]}, "messages", None),
    ("completions unknown proposer", COMPL, {"proposer": "telepathy"}, "proposer", None),
    # the e2e cluster serves max_model_len 512 (cluster/local_cluster.py); " word" is one token
    ("prompt + max_tokens over max_model_len", COMPL, {"prompt": " word" * 400, "max_tokens": 200}, "max_tokens", 400),
    ("chat prompt over max_model_len", CHAT, {"messages": [{"role": "user", "content": " w" * 600}]}, "messages", 400),
    ("completions prompt over max_model_len", COMPL, {"prompt": " word" * 600, "max_tokens": None}, "prompt", 400),
    ("unknown route", "/v1/embeddings", {}, None, 404),
    ("wrong method", "GET " + CHAT, None, None, 405),
]


def send(url: str, route: str, payload: Any) -> httpx.Response:
    if route.startswith("GET "):
        return httpx.get(url + route[4:], timeout=60)
    if isinstance(payload, bytes):
        return httpx.post(url + route, content=payload, headers={"content-type": "application/json"}, timeout=60)
    base = (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        if route == CHAT
        else {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    )
    keep_null = payload.pop("_keep_null", False) if isinstance(payload, dict) else False
    merged = {**base, **payload}
    if not keep_null:
        merged = {k: v for k, v in merged.items() if v is not None}
    return httpx.post(url + route, json=merged, timeout=60)
