"""Tool calls without a model: request validation, the Hermes prompt, the llguidance grammar walked token by
token with SmolLM2's tokenizer, and the parser, whole and streamed at random split points."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llguidance import LLMatcher
from pydantic import ValidationError

from deployments.protocol import ChatCompletionRequest, ChatMessage, Tool
from deployments.tools import (
    DEFAULT_SYSTEM_TEMPLATE,
    ToolCallStreamer,
    ToolPromptFormat,
    effective_tool_choice,
    finish_reason,
    parse_tool_calls,
    render_messages,
    tool_call_grammar,
    tool_call_lark,
)

# SmolLM2's tokenizer and chat template, shipped with the trained draft (no weights loaded)
TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"

FMT = ToolPromptFormat()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Current weather in a city. Say # or // freely: "quoted", café.',
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: no arguments
TOOLS = [Tool.model_validate(WEATHER), Tool.model_validate(NOW)]
NAMES = {"get_weather", "now"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def call(id_: str, name: str, arguments: str) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": arguments}}


def msgs(*ms: dict) -> list[ChatMessage]:
    return [ChatMessage.model_validate(m) for m in ms]


# ---- request models ----------------------------------------------------------------------------------------

ASKED = {"role": "assistant", "content": None, "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}')]}


@pytest.mark.parametrize(
    "patch, field",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "now"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools.0.function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
            "tools.0.function.parameters",
        ),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools.0.function.strict"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        (
            {"messages": [{"role": "user", "content": "x"}, ASKED, {"role": "tool", "content": "sunny"}]},
            "messages.2.tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, ASKED, {"role": "tool", "tool_call_id": "c1"}]},
            "messages.2.content",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    ASKED,
                    {"role": "tool", "tool_call_id": "c9", "content": "s"},
                ]
            },
            "messages",
        ),
        ({"messages": [{"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, "messages"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [call("c1", "get_weather", '{"city": ')]},
                ]
            },
            "messages.1.tool_calls",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
                ]
            },
            "messages.1.tool_calls.0.type",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": [call("c1", "f", "{}")]}]},
            "messages.0.tool_calls",
        ),
        ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c1"}]}, "messages.0.tool_call_id"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
            "messages.1.content",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}]},
            "messages.1.content",
        ),
    ],
)
def test_bad_tool_requests_are_errors_naming_the_field(patch: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate({**CHAT, **patch})
    locs = [".".join(str(p) for p in err["loc"]) for err in e.value.errors()]
    assert locs[0] == field, locs  # the first error is the one the 400 reports


def test_tool_requests_as_clients_send_them() -> None:
    r = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "tools": [WEATHER, NOW],
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris and the time?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [call("c1", "get_weather", '{"city": "Paris"}'), call("c2", "now", "{}")],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "12:00"}]},
                {"role": "assistant", "content": "Sunny, and noon."},
                {"role": "user", "content": "Thanks"},
            ],
        }
    )
    assert r.tool_choice is None and r.parallel_tool_calls is True
    assert effective_tool_choice(r.tools, r.tool_choice) == "auto"
    assert effective_tool_choice(None, None) == "none"
    assert r.messages[2].text() == "" and r.messages[4].text() == "12:00"
    named = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
        }
    )
    assert named.tool_choice.function.name == "get_weather" and not named.parallel_tool_calls  # type: ignore[union-attr]
    for choice in ("none", "auto", "required"):
        r = ChatCompletionRequest.model_validate({**CHAT, "tools": [NOW], "tool_choice": choice})
        assert r.tool_choice == choice


def test_prompt_format_config() -> None:
    assert ToolPromptFormat.model_validate({}).model_dump() == FMT.model_dump()
    with pytest.raises(ValidationError, match="tool_rol"):
        ToolPromptFormat.model_validate({"tool_rol": "user"})
    with pytest.raises(ValidationError, match="system_template"):
        ToolPromptFormat(system_template="no placeholder")
    with pytest.raises(ValidationError, match="call_open"):
        ToolPromptFormat(call_open=" <tool_call>")
    with pytest.raises(ValidationError, match="tool_role"):
        ToolPromptFormat(tool_role="function")  # type: ignore[arg-type]
    assert all(f.description for f in ToolPromptFormat.model_fields.values())


# ---- prompt ----------------------------------------------------------------------------------------------

SYSTEM_NOW = DEFAULT_SYSTEM_TEMPLATE.replace("{tools}", '{"type": "function", "function": {"name": "now"}}')


def test_default_system_prompt_text() -> None:
    out = render_messages(msgs({"role": "user", "content": "time?"}), [Tool.model_validate(NOW)], None, FMT)
    assert out == [{"role": "system", "content": SYSTEM_NOW}, {"role": "user", "content": "time?"}]
    assert (
        SYSTEM_NOW
        == """\
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "now"}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>"""
    )


def test_tools_listed_one_per_line() -> None:
    system = render_messages(msgs({"role": "user", "content": "x"}), TOOLS, "required", FMT)[0]["content"]
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].split("\n")
    assert [json.loads(line) for line in listed] == [WEATHER, NOW]


def test_tool_prompt_joins_the_own_system_message() -> None:
    for role in ("system", "developer"):
        out = render_messages(
            msgs({"role": role, "content": "Be brief."}, {"role": "user", "content": "x"}),
            [Tool.model_validate(NOW)],
            "auto",
            FMT,
        )
        assert out[0] == {"role": "system", "content": "Be brief.\n\n" + SYSTEM_NOW} and len(out) == 2


def test_history_with_calls_and_results() -> None:
    history = msgs(
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [call("c1", "get_weather", '{"city":"Paris",  "unit":"celsius"}'), call("c2", "now", "{}")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21"},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "user", "content": "And London?"},
        {"role": "assistant", "tool_calls": [call("c3", "get_weather", '{"city": "London", "unit": "celsius"}')]},
        {"role": "tool", "tool_call_id": "c3", "content": "rain"},
    )
    out = render_messages(history, TOOLS, "none", FMT)  # "none": no tool prompt, the history still converted
    assert out == [
        {"role": "user", "content": "Weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": '<tool_response>\n{"tool_call_id": "c1", "name": "get_weather", "content": '
            '"sunny, 21"}\n</tool_response>\n<tool_response>\n{"tool_call_id": "c2", '
            '"name": "now", "content": "12:00"}\n</tool_response>',
        },
        {"role": "user", "content": "And London?"},
        {
            "role": "assistant",
            "content": '<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "London", "unit": "celsius"}}\n</tool_call>',
        },
        {
            "role": "user",
            "content": '<tool_response>\n{"tool_call_id": "c3", "name": "get_weather", "content": '
            '"rain"}\n</tool_response>',
        },
    ]
    assert render_messages(history, TOOLS, "auto", FMT)[1:] == out
    tool_role = render_messages(history, TOOLS, "none", ToolPromptFormat(tool_role="tool"))
    assert [m["role"] for m in tool_role] == ["user", "assistant", "tool", "user", "assistant", "tool"]
    # the calls in the history are what the parser reads back
    content, calls = parse_tool_calls(out[1]["content"], FMT, NAMES)
    assert content == "Let me look." and [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
        ("now", "{}"),
    ]


def test_without_tools_messages_pass_through() -> None:
    ms = msgs(
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": "hello"},
    )
    want = [m.for_template() for m in ms]
    assert render_messages(ms, None, None, FMT) == want
    assert render_messages(ms, TOOLS, "none", FMT) == want


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))


def test_smollm2_template_takes_the_rendered_messages(tokenizer: Any) -> None:
    history = msgs(
        {"role": "user", "content": "Paris?"}, ASKED, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    )
    text = tokenizer.apply_chat_template(
        render_messages(history, TOOLS, "auto", FMT), tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\n# Tools\n") and "SmolLM" not in text  # ours replaced the default
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' in text
    assert '<|im_start|>user\n<tool_response>\n{"tool_call_id": "c1"' in text
    assert text.endswith("<|im_start|>assistant\n")


# ---- grammar ---------------------------------------------------------------------------------------------

NAMED_NOW = {"type": "function", "function": {"name": "now"}}


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer: Any) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer)


def walk(ll_tokenizer: Any, tokenizer: Any, grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of ``text`` accepted, the grammar complete after it)."""
    m = LLMatcher(ll_tokenizer, grammar, log_level=0)
    ok = all(m.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok, ok and m.is_accepting()


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


PARIS = block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}')
NOON = block('{"name": "now", "arguments": {}}')


def test_no_grammar_unless_a_call_is_required() -> None:
    assert tool_call_grammar(TOOLS, None, True, FMT) is None  # "auto" by default
    assert tool_call_grammar(TOOLS, "auto", True, FMT) is None
    assert tool_call_grammar(TOOLS, "none", True, FMT) is None
    assert tool_call_grammar(None, None, True, FMT) is None


@pytest.mark.parametrize("choice", ["required", NAMED_NOW])
@pytest.mark.parametrize("parallel", [True, False])
def test_grammar_validates(ll_tokenizer: Any, choice: Any, parallel: bool) -> None:
    req = ChatCompletionRequest.model_validate({**CHAT, "tools": [WEATHER, NOW], "tool_choice": choice})
    grammar = tool_call_grammar(req.tools, req.tool_choice, parallel, FMT)
    assert grammar is not None
    assert LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""


def test_schemas_with_refs_and_arrays(tokenizer: Any, ll_tokenizer: Any) -> None:
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    params: dict[str, Any] = {
        "type": "object",
        "$defs": {"P": point},
        "required": ["p"],
        "properties": {"p": {"$ref": "#/$defs/P"}, "tags": {"type": "array", "items": {"type": "string"}}},
    }
    tools = [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": params}})]
    grammar = tool_call_grammar(tools, "required", False, FMT)
    assert grammar is not None and LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
    text = block('{"name": "f", "arguments": {"p": {"x": 1.5}, "tags": ["a", "b"]}}')
    assert walk(ll_tokenizer, tokenizer, grammar, text) == (True, True)
    assert walk(ll_tokenizer, tokenizer, grammar, block('{"name": "f", "arguments": {"p": {}}}'))[0] is False
    # a schema llguidance cannot compile: the grammar is still built; validation says why (a 400 for the caller)
    params["properties"]["p"] = {"$ref": "#/$defs/Nope"}
    broken = tool_call_grammar(
        [Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": params}})],
        "required",
        False,
        FMT,
    )
    assert broken is not None and "Nope" in LLMatcher.validate_grammar(broken, ll_tokenizer)


def test_grammar_shape() -> None:
    lark = tool_call_lark([Tool.model_validate(NOW)], "required", True, FMT)
    assert lark == (
        'start: call ("\\n" call)*\n'
        'call: "<tool_call>\\n" (fn_0) "\\n</tool_call>"\n'
        'fn_0: "{\\"name\\": \\"now\\", \\"arguments\\": " args_0 "}"\n'
        'args_0: %json {"type": "object", "properties": {}, "additionalProperties": false, "x-guidance": '
        '{"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}\n'
    )


@pytest.mark.parametrize(
    "text, required, parallel",
    [
        (PARIS, True, True),
        (NOON, True, False),
        (block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 3}}'), True, True),
        (PARIS + "\n" + NOON + "\n" + PARIS, True, True),
        (PARIS + "\n" + NOON, False, False),  # one call only
        (block('{"name": "get_time", "arguments": {}}'), False, True),  # no such tool
        (block('{"name": "get_weather", "arguments": {"city": "Paris"}}'), False, True),  # required unit missing
        (block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}'), False, True),  # enum
        (block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": 9}}'), False, True),
        (block('{"name": "get_weather", "arguments": {"city":"Paris", "unit":"celsius"}}'), False, True),  # style
        (block('{"arguments": {}, "name": "now"}'), False, True),  # name first
        (block('{"name": "now", "arguments": {"x": 1}}'), False, True),  # no parameters: no arguments
        ("Sure! " + NOON, False, True),  # nothing before the call
    ],
)
def test_grammar_walk_with_smollm2_tokens(
    tokenizer: Any, ll_tokenizer: Any, text: str, required: bool, parallel: bool
) -> None:
    grammar = tool_call_grammar(TOOLS, "required", parallel, FMT)
    assert grammar is not None
    ok, complete = walk(ll_tokenizer, tokenizer, grammar, text)
    assert (ok and complete) == required
    if required:
        assert len(parse_tool_calls(text, FMT, NAMES)[1]) == text.count("<tool_call>")


def test_named_choice_forces_that_tool(tokenizer: Any, ll_tokenizer: Any) -> None:
    req = ChatCompletionRequest.model_validate({**CHAT, "tools": [WEATHER, NOW], "tool_choice": NAMED_NOW})
    grammar = tool_call_grammar(req.tools, req.tool_choice, False, FMT)
    assert grammar is not None
    assert walk(ll_tokenizer, tokenizer, grammar, NOON) == (True, True)
    assert walk(ll_tokenizer, tokenizer, grammar, PARIS)[0] is False
    parallel = tool_call_grammar(req.tools, req.tool_choice, True, FMT)  # named: one call even when parallel
    assert parallel is not None
    assert walk(ll_tokenizer, tokenizer, parallel, NOON + "\n" + NOON)[0] is False


def test_history_calls_satisfy_the_grammar(tokenizer: Any, ll_tokenizer: Any) -> None:
    """The calls a prompt shows are written as the grammar makes the model write them (llguidance also keeps
    the schema's property order, which the history keeps as the client sent it)."""
    history = msgs(
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [
                call("c1", "get_weather", '{"city":"Zürich",\n"unit":"fahrenheit","days":2}'),
                call("c2", "now", "{ }"),
            ],
        },
    )
    answer = render_messages(history, TOOLS, "required", FMT)[-1]["content"]
    grammar = tool_call_grammar(TOOLS, "required", True, FMT)
    assert grammar is not None
    assert walk(ll_tokenizer, tokenizer, grammar, answer) == (True, True)


def test_any_text_the_grammar_allows_parses_into_calls(ll_tokenizer: Any) -> None:
    """Random walks over the allowed tokens (stopping where the grammar may end): every answer parses into
    calls of known tools whose arguments are JSON meeting the schema's required fields."""
    schema = {
        "type": "object",
        "properties": {
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "ok": {"type": "boolean"},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["unit", "ok"],
        "additionalProperties": False,
    }
    tools = [
        Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": schema}}),
        Tool.model_validate(NOW),
    ]
    grammar = tool_call_grammar(tools, "required", True, FMT)
    assert grammar is not None
    rng = np.random.default_rng(0)
    for _ in range(10):
        m = LLMatcher(ll_tokenizer, grammar, log_level=0)
        ids: list[int] = []
        while not (m.is_accepting() and (rng.random() < 0.5 or len(ids) > 150)):
            mask = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.flatnonzero(mask[: ll_tokenizer.vocab_size])
            tok = int(rng.choice(allowed[allowed != ll_tokenizer.eos_token]))
            assert m.consume_token(tok), m.get_error()
            ids.append(tok)
        text = ll_tokenizer.decode_str(ids)
        content, calls = parse_tool_calls(text, FMT, {"f", "now"})
        assert content is None and calls and len(calls) == text.count("<tool_call>")
        for c in calls:
            args = json.loads(c.function.arguments)
            assert args == {} if c.function.name == "now" else {"unit", "ok"} <= set(args)


# ---- parser ----------------------------------------------------------------------------------------------

ARGS = '{"city": "Paris", "unit": "celsius"}'
TEXTS: dict[str, tuple[str, str | None, list[tuple[str, str]]]] = {
    # name: (answer, content, calls)
    "plain": ("Hello! How can I help?\n", "Hello! How can I help?\n", []),
    "one call": (PARIS, None, [("get_weather", ARGS)]),
    "content then calls": (
        "Let me check.\n" + PARIS + "\n" + NOON + "\n",
        "Let me check.",
        [("get_weather", ARGS), ("now", "{}")],
    ),
    "text between calls": (PARIS + "\nand then\n" + NOON, "and then", [("get_weather", ARGS), ("now", "{}")]),
    "unknown tool": (
        "A " + block('{"name": "get_time", "arguments": {}}') + " B",
        "A " + block('{"name": "get_time", "arguments": {}}') + " B",
        [],
    ),
    "not json": (
        "x\n" + block("I cannot call <tool_call> now") + "\n" + NOON,
        "x\n" + block("I cannot call <tool_call> now"),
        [("now", "{}")],
    ),
    "arguments not an object": (
        block('{"arguments": [1], "name": "now"}') + NOON,
        block('{"arguments": [1], "name": "now"}'),
        [("now", "{}")],
    ),
    "arguments first": (
        block('{"arguments": {"city":"Oslo"},\n "name": "get_weather"}'),
        None,
        [("get_weather", '{"city": "Oslo"}')],
    ),
    "no arguments key": (block('{"name": "now"}'), None, [("now", "{}")]),
    "loose whitespace": (
        '<tool_call>{ "name" :"now",\n"arguments":\n  {"a": [1, {"b": "}"}]} }</tool_call>',
        None,
        [("now", '{"a": [1, {"b": "}"}]}')],
    ),
    "escaped quote and brace in a string": (
        block('{"name": "now", "arguments": {"q": "a\\"}{b"}}'),
        None,
        [("now", '{"q": "a\\"}{b"}')],
    ),
    "scalar arguments": (block('{"name": "now", "arguments": 5 }'), None, [("now", "5")]),
    "malformed arguments stay a call": (
        block('{"name": "now", "arguments": {"a": 1, }') + "done",
        "done",
        [("now", '{"a": 1, }')],
    ),
    "arguments cut at the close tag": (block('{"name": "now", "arguments": {"a": "x  '), None, [("now", '{"a": "x')]),
    "cut inside the arguments": (
        'ok <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "ok",
        [("get_weather", '{"city": "Par')],
    ),
    "cut right after the head": ('<tool_call>\n{"name": "now", "arguments":  \n', None, [("now", "")]),
    "cut before the head": ('ok \n<tool_call>\n{"name": "get_wea', 'ok \n<tool_call>\n{"name": "get_wea', []),
    "partial tags in text": ("a < b </tool_call> <tool_cal", "a < b </tool_call> <tool_cal", []),
    "only whitespace around calls": ("\n " + NOON + " \n " + NOON + "\n\n", None, [("now", "{}"), ("now", "{}")]),
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_parse_tool_calls(name: str) -> None:
    text, content, want = TEXTS[name]
    got_content, calls = parse_tool_calls(text, FMT, NAMES)
    assert got_content == content
    assert [(c.function.name, c.function.arguments) for c in calls] == want
    assert all(c.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert len({c.id for c in calls}) == len(calls)


def collect(deltas: list[dict[str, Any]]) -> tuple[str | None, list[tuple[str, str]]]:
    """The OpenAI client's view of a stream of deltas, checking their shape on the way."""
    content, calls = "", list[list[str]]()
    for d in deltas:
        assert len(d) == 1
        if "content" in d:
            assert d["content"]
            content += d["content"]
            continue
        [tc] = d["tool_calls"]
        if "id" in tc:  # a call's first delta: all but the arguments
            assert tc["index"] == len(calls) and tc["type"] == "function" and tc["id"].startswith("call_")
            assert tc["function"]["arguments"] == ""
            calls.append([tc["function"]["name"], ""])
        else:
            assert tc["index"] == len(calls) - 1 and set(tc) == {"index", "function"} and tc["function"]["arguments"]
            calls[-1][1] += tc["function"]["arguments"]
    return content or None, [(n, a) for n, a in calls]


def stream(text: str, cuts: list[int]) -> list[dict[str, Any]]:
    s = ToolCallStreamer(FMT, NAMES)
    out: list[dict[str, Any]] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        out += s.feed(text[a:b])
    return out + s.finish()


@pytest.mark.parametrize("name", list(TEXTS))
def test_streamed_deltas_add_up_to_the_parse(name: str) -> None:
    text = TEXTS[name][0]
    content, calls = parse_tool_calls(text, FMT, NAMES)
    want = (content, [(c.function.name, c.function.arguments) for c in calls])
    rng = random.Random(name)
    splits = [[], list(range(1, len(text)))]  # whole, and one character at a time
    splits += [sorted(rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))) for _ in range(200)]
    for cuts in splits:
        assert collect(stream(text, cuts)) == want, cuts


def test_everything_in_one_answer_at_random_splits() -> None:
    text = "".join(
        TEXTS[n][0]
        for n in (
            "content then calls",
            "not json",
            "unknown tool",
            "loose whitespace",
            "arguments first",
            "plain",
            "cut inside the arguments",
        )
    )
    content, calls = parse_tool_calls(text, FMT, NAMES)
    assert len(calls) == 6 and content is not None and "get_time" in content
    want = (content, [(c.function.name, c.function.arguments) for c in calls])
    rng = random.Random(1)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 40)))
        assert collect(stream(text, cuts)) == want, cuts


def test_another_format() -> None:
    fmt = ToolPromptFormat(
        call_open="<function_call>",
        call_close="</function_call>",
        response_open="<result>",
        response_close="</result>",
        tool_role="tool",
    )
    parts = ("content then calls", "not json", "loose whitespace", "cut inside the arguments")
    text = "".join(TEXTS[n][0] for n in parts)
    text = text.replace("tool_call>", "function_call>")
    content, calls = parse_tool_calls(text, fmt, NAMES)
    assert content == "Let me check.x\n<function_call>\nI cannot call <function_call> now\n</function_call>ok"
    assert [c.function.name for c in calls] == ["get_weather", "now", "now", "now", "get_weather"]
    s = ToolCallStreamer(fmt, NAMES)
    assert collect([d for ch in text for d in s.feed(ch)] + s.finish()) == (
        content,
        [(c.function.name, c.function.arguments) for c in calls],
    )
    history = msgs({"role": "user", "content": "x"}, ASKED, {"role": "tool", "tool_call_id": "c1", "content": "sun"})
    assert render_messages(history, TOOLS, "none", fmt)[1:] == [
        {
            "role": "assistant",
            "content": '<function_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</function_call>',
        },
        {
            "role": "tool",
            "content": '<result>\n{"tool_call_id": "c1", "name": "get_weather", "content": "sun"}\n</result>',
        },
    ]
    lark = tool_call_lark(TOOLS, "required", False, fmt)
    assert lark is not None
    assert lark.startswith('start: call\ncall: "<function_call>\\n" (fn_0 | fn_1) "\\n</function_call>"\n')


def test_streaming_holds_back_only_what_may_be_a_tag() -> None:
    s = ToolCallStreamer(FMT, NAMES)
    assert s.feed("Hello world") == [{"content": "Hello world"}]
    assert s.feed(", see <tool") == [{"content": ", see"}]  # " <tool" may open a call
    assert s.feed("box>") == [{"content": " <toolbox>"}]
    assert s.feed('\n<tool_call>\n{"name": "get_weather"') == []  # the head is not complete yet
    [head] = s.feed(', "arguments": ')
    assert head["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert s.feed('{"city": "Pa') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}]
    assert s.feed('ris"}}\n</tool') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'ris"}'}}]}]
    assert s.feed("_call>\n") == [] and s.finish() == []


def test_finish_reason() -> None:
    assert finish_reason("stop", 2) == "tool_calls"
    assert finish_reason("stop", 0) == "stop"
    assert finish_reason("length", 1) == "length"  # cut: the last call may be incomplete
    assert finish_reason(None, 1) is None and finish_reason("abort", 1) == "abort"
