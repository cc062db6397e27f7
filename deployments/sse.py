"""Server-sent events: one request's engine chunks framed as OpenAI's streaming chunks.

Every choice's chunks go out on one stream, each carrying its choice's ``index``; the first event of a
choice carries ``role`` (chat) or the echoed prompt (completions with ``echo``). With tools, a choice's
text goes through a ``ToolCallStreamer``, which turns call blocks into OpenAI's tool-call deltas and
holds back text that may be the start of a tag, so an engine chunk can make no event, or several.
Pure: no Ray, no I/O; the ingress reads the engine and writes what this returns.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deployments import choices as C
from deployments import protocol as P
from deployments import tools as T

DONE = b"data: [DONE]\n\n"


def event(obj: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def error_event(message: str, type_: str, code: Any = None) -> bytes:
    return event(P.error_body(message, type_, code=code))


class SSEFramer:
    """The events of one streamed request, choice by choice, as its engine chunks arrive."""

    def __init__(
        self,
        rid: str,
        model: str,
        is_chat: bool,
        choices: list[C.Choice],
        tokenizer: Any,
        want_logprobs: bool,
        continuous_usage: bool,
        echo: list[str],
        tool_prompt: Any = None,
        tool_names: list[str] | None = None,
    ) -> None:
        self.rid, self.model, self.is_chat, self.choices = rid, model, is_chat, choices
        self.tokenizer, self.want_logprobs, self.continuous_usage, self.echo = (
            tokenizer,
            want_logprobs,
            continuous_usage,
            echo,
        )
        self.created = int(time.time())
        self.fingerprint = choices[0].last.get("system_fingerprint") if choices[0].last else None
        # where the next token's text starts in the returned text: after the echoed prompt, or at 0 when the
        # prompt's own tokens lead the logprobs (echo + logprobs)
        self.offsets = [0 if c.prompt_logprobs else len(echo[c.prompt_index]) for c in choices]
        # per choice: reads call blocks out of the text as it streams (OpenAI's tool-call deltas)
        self.streamers = [
            None if tool_names is None or not is_chat else T.ToolCallStreamer(tool_prompt, tool_names) for _ in choices
        ]
        self.role = [True] * len(choices)  # the choice's next event is its first
        self.pending: list[list] = [(c.prompt_logprobs or []) + list(c.logprobs) for c in choices]  # logprobs not sent

    def first(self, j: int) -> bytes:
        """The event for choice ``j``'s first chunk (read before the stream began)."""
        return self._emit(j, self.choices[j].last, force=True)  # type: ignore[arg-type]

    def next(self, j: int, item: dict[str, Any]) -> bytes:
        """The events for a later chunk of choice ``j`` (already added to the choice)."""
        self.pending[j].extend(item.get("logprobs") or [])
        return self._emit(j, item, force=False)

    def usage(self) -> bytes:
        """The final usage-only chunk (``stream_options.include_usage``)."""
        return event(
            {
                "id": self.rid,
                "object": "chat.completion.chunk" if self.is_chat else "text_completion",
                "created": self.created,
                "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [],
                "usage": C.usage(self.choices),
            }
        )

    def _emit(self, j: int, item: dict[str, Any], force: bool) -> bytes:
        if not (force or item["text"] or item["finished"] or (self.want_logprobs and self.pending[j])):
            return b""
        finish = item["finish_reason"] if item["finished"] else None
        if self.streamers[j] is not None:
            out = self._tool_chunks(j, item["text"], finish)
        else:
            out = self._chunk(j, item["text"], finish)
        if out:  # text a tool-call reader holds back (a possible tag) makes no event yet
            self.role[j], self.pending[j] = False, []
        return out

    def _chunk(self, j: int, text: str, finish: str | None) -> bytes:
        c, role, lps = self.choices[j], self.role[j], self.pending[j]
        if self.is_chat:
            delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            obj = P.chat_chunk(self.rid, self.model, delta, finish, self.created)
            if self.want_logprobs:
                obj["choices"][0]["logprobs"] = P.chat_logprobs(lps, self.tokenizer)
        else:
            echo = self.echo[c.prompt_index] if role else ""
            obj = P.completion_chunk(self.rid, self.model, echo + text, finish, self.created)
            if self.want_logprobs:
                obj["choices"][0]["logprobs"] = P.completion_logprobs(lps, self.tokenizer, self.offsets[j])
        obj["choices"][0]["index"] = c.index
        obj["system_fingerprint"] = self.fingerprint
        self.offsets[j] += len(text) + (len(self.echo[c.prompt_index]) if role and c.prompt_logprobs else 0)
        if self.continuous_usage:
            obj["usage"] = C.usage(self.choices)
        return event(obj)

    def _tool_chunks(self, j: int, text: str, finish: str | None) -> bytes:
        """One event per delta: content, a call's name, then its argument fragments; finish on the last."""
        s = self.streamers[j]
        assert s is not None
        deltas = s.feed(text) + (s.finish() if finish else [])
        if finish:
            finish = T.finish_reason(finish, s.num_calls)
        if self.role[j]:
            deltas = [{"role": "assistant", **(deltas[0] if deltas else {"content": ""})}] + deltas[1:]
        if not deltas and not finish:
            return b""
        events = []
        for i, delta in enumerate(deltas or [{}]):
            last = i == max(len(deltas), 1) - 1
            obj = P.chat_chunk(self.rid, self.model, delta, finish if last else None, self.created)
            if self.want_logprobs and i == 0:
                obj["choices"][0]["logprobs"] = P.chat_logprobs(self.pending[j], self.tokenizer)
            obj["choices"][0]["index"] = self.choices[j].index
            obj["system_fingerprint"] = self.fingerprint
            if self.continuous_usage and last:
                obj["usage"] = C.usage(self.choices)
            events.append(event(obj))
        return b"".join(events)
