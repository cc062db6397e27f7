"""OpenAI tool calls for a model whose chat template knows no tools: the prompt, the grammar, the parser.

The tools reach the model as text (SmolLM2's template has only system, user and assistant roles), in the
Hermes format that open models are commonly trained on: the functions as JSON inside ``<tools></tools>``
in the system prompt, each call answered as a ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``
block, each result returned inside ``<tool_response></tool_response>``. ``tool_choice`` "required" or a
named function becomes a grammar that forces call blocks whose arguments follow the tool's parameters
schema (vLLM's approach); "auto" leaves the model free, and the parser finds the blocks in its text.

Pure: no engine, no Ray, no torch. The one format lives in ``ToolPromptFormat``, configurable per model.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Collection, Sequence
from typing import Any, Literal

from llguidance import LLMatcher
from pydantic import BaseModel, ConfigDict, Field, field_validator

from deployments.protocol import ChatMessage, FunctionCall, NamedToolChoice, Tool, ToolCall, ToolChoice
from workers.json_schema import close_objects

DEFAULT_SYSTEM_TEMPLATE = """\
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""


class ToolPromptFormat(BaseModel):
    """How tools, calls and results are written into a model's prompt, and how calls are found in its answer."""

    model_config = ConfigDict(extra="forbid")

    system_template: str = Field(
        DEFAULT_SYSTEM_TEMPLATE,
        description="The system prompt that offers the tools; '{tools}' becomes the tools as JSON, one per line "
        "(replaced as text, not str.format, so JSON braces need no escaping). It is appended to the request's "
        "own system message, or is the system message when there is none.",
    )
    call_open: str = Field("<tool_call>", description="Opens a call block in the model's answer.")
    call_close: str = Field("</tool_call>", description="Closes a call block.")
    response_open: str = Field("<tool_response>", description="Opens a tool result block in the prompt.")
    response_close: str = Field("</tool_response>", description="Closes a tool result block.")
    tool_role: Literal["user", "system", "tool"] = Field(
        "user", description="The role tool results are rendered as: 'user' for chat templates without a tool role."
    )

    @field_validator("system_template")
    @classmethod
    def _has_tools(cls, v: str) -> str:
        if "{tools}" not in v:
            raise ValueError("must contain '{tools}', where the tools are listed")
        return v

    @field_validator("call_open", "call_close", "response_open", "response_close")
    @classmethod
    def _tag(cls, v: str) -> str:
        # The parser drops the whitespace around call blocks; a tag that began or ended with some would blur that.
        if not v or v != v.strip():
            raise ValueError("must be non-empty, without leading or trailing whitespace")
        return v


EffectiveChoice = Literal["none", "auto", "required"] | NamedToolChoice


def effective_tool_choice(tools: Sequence[Tool] | None, tool_choice: ToolChoice | None) -> EffectiveChoice:
    """OpenAI's defaults: "none" without tools, "auto" with tools and no choice."""
    if not tools:
        return "none"
    return "auto" if tool_choice is None else tool_choice


# ---- prompt ----------------------------------------------------------------------------------------------


def _system_prompt(tools: Sequence[Tool], fmt: ToolPromptFormat) -> str:
    listed = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return fmt.system_template.replace("{tools}", listed)


def _call_json(name: str, arguments: str) -> str:
    """A call as the model is asked to write it: name first, then the arguments, ``json.dumps`` separators
    (the grammar's too), so that past calls in the prompt look like the ones the model should make."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
    except ValueError:  # the request models refuse this; kept verbatim rather than failing here
        args = arguments
    return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}'


def _call_block(call: ToolCall, fmt: ToolPromptFormat) -> str:
    return f"{fmt.call_open}\n{_call_json(call.function.name, call.function.arguments)}\n{fmt.call_close}"


def _response_block(m: ChatMessage, name: str | None, fmt: ToolPromptFormat) -> str:
    body: dict[str, Any] = {"tool_call_id": m.tool_call_id}
    if name is not None:
        body["name"] = name
    body["content"] = m.text()
    return f"{fmt.response_open}\n{json.dumps(body, ensure_ascii=False)}\n{fmt.response_close}"


def render_messages(
    messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, fmt: ToolPromptFormat
) -> list[dict[str, str]]:
    """The ``{"role", "content"}`` list the chat template gets: assistant ``tool_calls`` become call blocks in
    the assistant's text, each run of ``tool`` messages one ``fmt.tool_role`` message of result blocks, and,
    unless the choice is "none", the tool prompt joins the system message (or becomes the first message)."""
    out: list[dict[str, str]] = []
    names: dict[str, str] = {}  # call id -> function name, for the results that answer those calls
    results: list[str] = []
    for m in messages:
        if m.role == "tool":
            results.append(_response_block(m, names.get(m.tool_call_id or ""), fmt))
            continue
        if results:
            out.append({"role": fmt.tool_role, "content": "\n".join(results)})
            results = []
        if m.role == "assistant" and m.tool_calls:
            names.update({c.id: c.function.name for c in m.tool_calls})
            parts = ([m.text()] if m.text() else []) + [_call_block(c, fmt) for c in m.tool_calls]
            out.append({"role": "assistant", "content": "\n".join(parts)})
        else:
            out.append(m.for_template())
    if results:
        out.append({"role": fmt.tool_role, "content": "\n".join(results)})
    if tools and effective_tool_choice(tools, tool_choice) != "none":
        prompt = _system_prompt(tools, fmt)
        if out and out[0]["role"] == "system":
            own = out[0]["content"]
            out[0] = {"role": "system", "content": f"{own}\n\n{prompt}" if own else prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


# ---- grammar ---------------------------------------------------------------------------------------------

# The arguments as json.dumps writes them: ", " and ": ", no other whitespace (llguidance's JSON options).
_ARGS_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# OpenAI: a function without parameters takes none, so its arguments are the empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a Lark string literal: JSON's escapes are Lark's


def tool_call_lark(
    tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool, fmt: ToolPromptFormat
) -> str | None:
    """The Lark text of ``tool_call_grammar`` (None for "auto" and "none"): one call block, or blocks
    separated by newlines when ``parallel_tool_calls`` with "required" (a named function is called once, as
    OpenAI does); in each the envelope is literal text, so "name" comes
    first, and the arguments are the chosen tool's parameters schema inlined with ``%json``."""
    choice = effective_tool_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        allowed = [t for t in tools or () if t.function.name == choice.function.name]
    elif choice == "required":
        allowed = list(tools or ())
    else:
        return None
    fns = " | ".join(f"fn_{i}" for i in range(len(allowed)))
    nl, call_open, call_close = _lark_str("\n"), _lark_str(fmt.call_open + "\n"), _lark_str("\n" + fmt.call_close)
    several = parallel_tool_calls and not isinstance(choice, NamedToolChoice)  # a named function: one call, as OpenAI
    lines = [f"start: call ({nl} call)*" if several else "start: call", f"call: {call_open} ({fns}) {call_close}"]
    for i, t in enumerate(allowed):
        schema = close_objects(dict(t.function.parameters or _NO_PARAMETERS))  # no invented arguments
        own = schema.get("x-guidance")
        schema["x-guidance"] = {**(own if isinstance(own, dict) else {}), **_ARGS_STYLE}
        head = f'{{"name": {json.dumps(t.function.name)}, "arguments": '
        lines.append(f"fn_{i}: {_lark_str(head)} args_{i} {_lark_str('}')}")
        lines.append(f"args_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def tool_call_grammar(
    tools: Sequence[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool, fmt: ToolPromptFormat
) -> str | None:
    """For "required" and a named function: the llguidance grammar that forces the answer to be call blocks
    (``LLMatcher(tokenizer, grammar)``); None for "auto" and "none", which decode unconstrained. A schema
    llguidance cannot compile shows in ``LLMatcher.validate_grammar``, not here."""
    lark = tool_call_lark(tools, tool_choice, parallel_tool_calls, fmt)
    return None if lark is None else LLMatcher.grammar_from_lark(lark)


# ---- parser ----------------------------------------------------------------------------------------------

_WS = " \t\n\r"  # JSON's whitespace: what the parser drops around call blocks and arguments
# The head of a call block, up to where the arguments begin: {"name": "<name>", "arguments":
_HEAD = re.compile(
    r'[ \t\n\r]*\{[ \t\n\r]*"name"[ \t\n\r]*:[ \t\n\r]*"([a-zA-Z0-9_-]{1,64})"'
    r'[ \t\n\r]*,[ \t\n\r]*"arguments"[ \t\n\r]*:'
)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class _ValueEnd:
    """Where one JSON value ends, in text that arrives in pieces: brackets counted outside strings, a bare
    scalar ended by a delimiter. Validity is not judged, so that the streamed and the parsed arguments of a
    malformed call still agree (OpenAI's clients are told that arguments may not be valid JSON)."""

    def __init__(self) -> None:
        self.started = False
        self.scalar = False
        self.depth = 0
        self.in_string = False
        self.escape = False

    def feed(self, text: str) -> int | None:
        """Index in ``text`` just past the value's end, or None while the value goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if not self.started:
                self.started, self.scalar = True, ch not in '{["'
            if self.scalar:
                if ch in ",}]" + _WS:
                    return i
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
        return None


def _arguments(rest: str) -> str:
    """The arguments text after a block's head: up to the value's end, or all of it (right-stripped) when
    the block closes or the answer stops before the value does."""
    rest = rest.lstrip(_WS)
    end = _ValueEnd().feed(rest)
    return rest[:end] if end is not None else rest.rstrip(_WS)


def _whole_block(inner: str, tool_names: Collection[str]) -> tuple[str, str] | None:
    """A closed block without the canonical head (e.g. arguments first): a call if it is a JSON object
    naming a known tool, its arguments an object (absent: none), rewritten in the canonical style."""
    try:
        obj = json.loads(inner)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or obj["name"] not in tool_names:
        return None
    args = obj.get("arguments", {})
    return (obj["name"], json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def _head(inner: str, tool_names: Collection[str]) -> re.Match[str] | None:
    m = _HEAD.match(inner)
    return m if m is not None and m.group(1) in tool_names else None


def parse_tool_calls(
    text: str, fmt: ToolPromptFormat, tool_names: Collection[str]
) -> tuple[str | None, list[ToolCall]]:
    """The content outside call blocks (None if empty) and the calls, from a whole answer.

    A block (``call_open`` to the next ``call_close``, or to the end of the answer) is a call when it starts
    with the head ``{"name": "<a known tool>", "arguments":`` (its arguments are then the JSON value's text
    as written, as the streamer sends it), or else when it is a JSON object naming a known tool. Any other
    block stays in the content as text. Whitespace between a call and its neighbours is dropped.
    ``ToolCallStreamer`` yields the same content and calls, piece by piece.
    """
    out: list[str] = []
    calls: list[ToolCall] = []
    pos, after_call = 0, False
    while (start := text.find(fmt.call_open, pos)) >= 0:
        body = start + len(fmt.call_open)
        end = text.find(fmt.call_close, body)
        inner = text[body:] if end < 0 else text[body:end]
        stop = len(text) if end < 0 else end + len(fmt.call_close)
        seg = text[pos:start].lstrip(_WS) if after_call else text[pos:start]
        if (m := _head(inner, tool_names)) is not None:
            call: tuple[str, str] | None = (m.group(1), _arguments(inner[m.end() :]))
        else:
            call = _whole_block(inner, tool_names) if end >= 0 else None
        if call is None:  # not a call: plain text
            out.append(seg + text[start:stop])
        else:
            out.append(seg.rstrip(_WS))
            fn = FunctionCall(name=call[0], arguments=call[1])
            calls.append(ToolCall(id=_call_id(), type="function", function=fn))
        pos, after_call = stop, call is not None
    out.append(text[pos:].lstrip(_WS) if after_call else text[pos:])
    return "".join(out) or None, calls


def _partial_tag(s: str, tag: str) -> int:
    """Length of the longest end of ``s`` that could be the start of ``tag``."""
    for k in range(min(len(s), len(tag) - 1), 0, -1):
        if s.endswith(tag[:k]):
            return k
    return 0


class ToolCallStreamer:
    """``parse_tool_calls`` as the text arrives: OpenAI chat-chunk ``delta`` dicts, so that the concatenated
    deltas give the same content and calls. Held back: only what may still turn out to be a tag or the
    whitespace beside a call; a block that is not (yet) known to be a call, until it closes. A call's first
    delta carries its index, id, type and name (arguments ""), as soon as the head ``{"name": "<known
    tool>", "arguments":`` is complete; its arguments follow as fragments as they arrive."""

    def __init__(self, fmt: ToolPromptFormat, tool_names: Collection[str]) -> None:
        self.fmt, self.tool_names = fmt, frozenset(tool_names)
        self.state: Literal["content", "block", "args", "after_args"] = "content"
        self.buf = ""  # text not yet sent or resolved, in the current state
        self.after_call = False  # content just after a call: its leading whitespace is dropped
        self.ws_before = ""  # the whitespace before the open block: dropped if a call, content if not
        self.num_calls = 0
        self.args_started = False
        self.value_end = _ValueEnd()
        self.deltas: list[dict[str, Any]] = []

    # -- output --

    def _content(self, text: str) -> None:
        if not text:
            return
        if self.deltas and "content" in self.deltas[-1]:
            self.deltas[-1]["content"] += text
        else:
            self.deltas.append({"content": text})

    def _start_call(self, name: str) -> None:
        self.deltas.append(
            {
                "tool_calls": [
                    {
                        "index": self.num_calls,
                        "id": _call_id(),
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
            }
        )
        self.num_calls += 1

    def _args(self, text: str) -> None:
        if not text:
            return
        last = self.deltas[-1]["tool_calls"][0] if self.deltas and "tool_calls" in self.deltas[-1] else None
        if last is not None and "id" not in last:  # a fragment of this call (the header keeps arguments "")
            last["function"]["arguments"] += text
        else:
            self.deltas.append({"tool_calls": [{"index": self.num_calls - 1, "function": {"arguments": text}}]})

    def _take(self) -> list[dict[str, Any]]:
        out, self.deltas = self.deltas, []
        return out

    # -- states --

    def _end_call(self, rest: str) -> None:
        self.state, self.buf, self.after_call = "content", rest, True

    def _step(self) -> bool:
        """Advance on the buffer; True when the state changed and the buffer needs another look."""
        fmt = self.fmt
        if self.state == "content":
            if self.after_call:
                self.buf = self.buf.lstrip(_WS)
                self.after_call = not self.buf
            i = self.buf.find(fmt.call_open)
            if i >= 0:
                seg = self.buf[:i]
                kept = seg.rstrip(_WS)
                self._content(kept)
                self.ws_before = seg[len(kept) :]
                self.state, self.buf = "block", self.buf[i + len(fmt.call_open) :]
                return True
            held = len(self.buf) - _partial_tag(self.buf, fmt.call_open)
            held = len(self.buf[:held].rstrip(_WS))
            self._content(self.buf[:held])
            self.buf = self.buf[held:]
            return False
        if self.state == "block":
            i = self.buf.find(fmt.call_close)
            inner = self.buf if i < 0 else self.buf[:i]
            if (m := _head(inner, self.tool_names)) is not None:
                self._start_call(m.group(1))
                self.state, self.buf = "args", self.buf[m.end() :]
                self.args_started, self.value_end = False, _ValueEnd()
                return True
            if i < 0:
                return False  # wait for the close: only the whole block can tell
            rest = self.buf[i + len(fmt.call_close) :]
            call = _whole_block(inner, self.tool_names)
            if call is None:
                self._content(self.ws_before + fmt.call_open + inner + fmt.call_close)
                self.state, self.buf = "content", rest
            else:
                self._start_call(call[0])
                self._args(call[1])
                self._end_call(rest)
            return True
        if self.state == "args":
            if not self.args_started:
                self.buf = self.buf.lstrip(_WS)
                self.args_started = bool(self.buf)
            i = self.buf.find(fmt.call_close)
            if i >= 0:
                chunk = self.buf[:i]
            else:
                held = len(self.buf) - _partial_tag(self.buf, fmt.call_close)
                chunk = self.buf[: len(self.buf[:held].rstrip(_WS))]
            end = self.value_end.feed(chunk)
            if end is not None:
                self._args(chunk[:end])
                self.state, self.buf = "after_args", self.buf[end:]
                return True
            if i >= 0:
                self._args(chunk.rstrip(_WS))
                self._end_call(self.buf[i + len(fmt.call_close) :])
                return True
            self._args(chunk)
            self.buf = self.buf[len(chunk) :]
            return False
        # after_args: the value is complete; skip to the close
        i = self.buf.find(fmt.call_close)
        if i >= 0:
            self._end_call(self.buf[i + len(fmt.call_close) :])
            return True
        self.buf = self.buf[len(self.buf) - _partial_tag(self.buf, fmt.call_close) :]
        return False

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas that ``text`` (the answer's next piece) completes."""
        self.buf += text
        while self._step():
            pass
        return self._take()

    def finish(self) -> list[dict[str, Any]]:
        """The deltas still held back, at the end of the answer."""
        if self.state == "content":
            self._content(self.buf.lstrip(_WS) if self.after_call else self.buf)
        elif self.state == "block":  # never closed and no call: text
            self._content(self.ws_before + self.fmt.call_open + self.buf)
        elif self.state == "args":  # cut inside the arguments (e.g. by max_tokens): the call keeps what came
            end = self.value_end.feed(self.buf)  # (leading whitespace is already gone: _step strips it)
            self._args(self.buf[:end] if end is not None else self.buf.rstrip(_WS))
        self.state, self.buf = "content", ""
        return self._take()


def finish_reason(engine_reason: str | None, num_tool_calls: int) -> str | None:
    """ "tool_calls" when the answer made calls and ended by itself; otherwise the engine's reason (a
    "length" cut stays "length": its last call may be incomplete)."""
    return "tool_calls" if num_tool_calls and engine_reason == "stop" else engine_reason
