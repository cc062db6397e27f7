"""SSE framing without Ray (``deployments/sse.py``): engine chunks in, OpenAI's streaming events out."""

from __future__ import annotations

import json
from typing import Any

from cluster.config import ToolPromptFormat
from deployments import choices as C
from deployments import sse


def _chunk(text: str, finished: bool = False, n: int = 1) -> dict[str, Any]:
    return {
        "text": text,
        "token_ids": [1] * n,
        "finished": finished,
        "finish_reason": "stop" if finished else None,
        "num_prompt_tokens": 3,
        "num_output_tokens": 2,
        "proposer": "ngram",
        "system_fingerprint": "fp",
        "spec": {"spec_steps": 1, "plain_steps": 0, "num_draft_tokens": 2, "num_accepted_tokens": 1},
    }


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]


def _framer(choices: list[C.Choice], is_chat: bool = True, **kw: Any) -> sse.SSEFramer:
    args: dict[str, Any] = dict(want_logprobs=False, continuous_usage=False, echo=[""] * 2)
    args.update(kw)
    return sse.SSEFramer("id", "m", is_chat, choices, None, **args)


def _started(n: int, first: str = "He") -> list[C.Choice]:
    choices = [C.Choice(index=i, prompt_index=0) for i in range(n)]
    for c in choices:
        c.add(_chunk(first))
    return choices


def test_chat_first_event_carries_the_role_and_each_choice_its_index():
    choices = _started(2)
    f = _framer(choices)
    first = [_events(f.first(j))[0]["choices"][0] for j in range(2)]
    assert [c["delta"] for c in first] == [{"role": "assistant", "content": "He"}] * 2
    assert [c["index"] for c in first] == [0, 1]
    choices[1].add(_chunk(""))
    assert f.next(1, choices[1].last) == b""  # no text, not finished, no logprobs: no event
    choices[1].add(_chunk("llo", finished=True))
    (last,) = _events(f.next(1, choices[1].last))
    assert last["choices"][0] == {"index": 1, "delta": {"content": "llo"}, "finish_reason": "stop", "logprobs": None}
    assert last["system_fingerprint"] == "fp" and "usage" not in last


def test_completion_echo_leads_the_first_event_only():
    choices = _started(1, first="a")
    f = _framer(choices, is_chat=False, echo=["Say: "])
    assert _events(f.first(0))[0]["choices"][0]["text"] == "Say: a"
    choices[0].add(_chunk("b"))
    assert _events(f.next(0, choices[0].last))[0]["choices"][0]["text"] == "b"


def test_usage_chunk_and_continuous_usage():
    choices = _started(2)
    f = _framer(choices, continuous_usage=True)
    assert _events(f.first(0))[0]["usage"]["completion_tokens"] == 4  # over both choices
    (u,) = _events(f.usage())
    assert u["choices"] == [] and u["object"] == "chat.completion.chunk" and u["usage"]["prompt_tokens"] == 3


def test_tool_calls_stream_as_name_then_arguments_and_finish_says_tool_calls():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    choices = _started(1, first="")
    f = _framer(choices, tool_prompt=ToolPromptFormat(), tool_names=["get_weather"])
    assert _events(f.first(0))[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = []
    for i, piece in enumerate([call[:5], call[5:30], call[30:]]):
        choices[0].add(_chunk(piece, finished=i == 2))
        deltas += [e["choices"][0] for e in _events(f.next(0, choices[0].last))]
    calls = [d["delta"]["tool_calls"][0] for d in deltas if "tool_calls" in d["delta"]]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["type"] == "function"
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])
