"""Structured output end to end: a real local Ray cluster, the real SmolLM2, real HTTP, driven by the
clients users have (the official ``openai`` SDK's ``parse``, litellm, langchain-openai).

Every constrained answer validates against its schema; the same request writes the same text with
speculation off, on and auto, streamed or not; bad constraints are a 400 naming the field while a
neighbour's request goes on."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from cluster.local_cluster import LocalCluster
from tests.e2e_helpers import in_threads, started

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)
    continent: Literal["Africa", "Asia", "Europe", "North America", "South America", "Oceania"]
    capital: bool


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"},
        "skills": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 12}},
    },
    "required": ["name", "age", "email", "skills"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with started(LocalCluster(tmp_path_factory.mktemp("structured"), policy={"name": "goodput"}, nodes=1)) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


def ask(client, content: str, **kw):
    kw.setdefault("max_tokens", 96)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def test_openai_parse_with_a_pydantic_model_on_every_path(client):
    msgs = [{"role": "user", "content": "Describe Paris as JSON."}]
    outs = {}
    for mode in ("off", "on", "auto"):
        r = client.chat.completions.parse(
            model=MODEL,
            messages=msgs,
            response_format=City,
            max_tokens=96,
            temperature=0,
            extra_body={"speculation": mode},
        )
        assert r.choices[0].finish_reason == "stop"
        city = r.choices[0].message.parsed
        assert isinstance(city, City)
        outs[mode] = r.choices[0].message.content
        spec = r.usage.model_extra["speculation"]
        if mode == "off":
            assert spec["draft_tokens"] == 0
        else:  # the keys, quotes and enum tails the schema forces were free drafts, and accepted
            assert spec["grammar_draft_tokens"] > 5 and spec["grammar_accepted_tokens"] > 5
    assert outs["off"] == outs["on"] == outs["auto"]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (0.8, 11)], ids=["greedy", "seeded"])
def test_json_schema_streamed_and_not_validates_and_matches(client, temperature, seed):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(response_format=rf, temperature=temperature, seed=seed)
    whole = ask(client, "Invent a person.", **kw, extra_body={"speculation": "off"})
    text = whole.choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in ask(client, "Invent a person.", **kw, stream=True, extra_body={"speculation": "on"})
        if c.choices
    )
    assert streamed == text


def test_json_object_regex_choice_and_grammar(client, cluster):
    obj = ask(
        client,
        "Give me a JSON object with a dog's name and age.",
        response_format={"type": "json_object"},
        max_tokens=160,
    )
    if obj.choices[0].finish_reason == "stop":  # a small model may ramble inside a free string until the cut
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:
        assert obj.choices[0].finish_reason == "length" and obj.choices[0].message.content.startswith("{")
    rx = ask(client, "A phone number?", extra_body={"structured_outputs": {"regex": "\\(\\d{3}\\) \\d{3}-\\d{4}"}})
    content = rx.choices[0].message.content
    assert len(content) == 14 and content[0] == "(" and content[9] == "-"
    ch = ask(client, "Is the sky blue?", extra_body={"structured_outputs": {"choice": ["yes", "no", "unsure"]}})
    assert ch.choices[0].message.content in ("yes", "no", "unsure")
    gr = ask(
        client, "Count.", extra_body={"structured_outputs": {"grammar": 'start: "one" (", " NUM)~1..3\nNUM: /[0-9]/'}}
    )
    assert gr.choices[0].message.content.startswith("one, ")
    comp = client.completions.create(
        model=MODEL,
        prompt="The answer is",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["42", "unknown"]}},
    )
    assert comp.choices[0].text in ("42", "unknown")


BAD = [
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs"),
    ({"response_format": {"type": "xml"}}, "response_format.type", ""),
    ({"structured_outputs": {"regex": "([a-z"}}, "structured_outputs.regex", ""),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar", ""),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
        "response_format.json_schema",
        "",
    ),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format", "not both"),
]


def test_bad_constraints_are_a_400_naming_the_field_and_neighbours_go_on(cluster, client):
    ts, out = in_threads([lambda: ask(client, "Write a long story about a cat.", max_tokens=48)])
    for body, param, words in BAD:
        r = httpx.post(
            f"{cluster.base_url}/v1/chat/completions",
            timeout=60,
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **body},
        )
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"], (body, err)
    for t in ts:
        t.join(300)
    assert out[0].choices[0].finish_reason == "length" and out[0].usage.completion_tokens == 48


def test_length_cut_says_length(client):
    r = ask(
        client,
        "Invent a person.",
        max_tokens=5,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "Paris?"}], response_format=City, max_tokens=5
        )


def test_litellm_and_langchain_structured_output(cluster):
    import litellm
    from langchain_openai import ChatOpenAI

    r = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=f"{cluster.base_url}/v1",
        api_key="unused",
        messages=[{"role": "user", "content": "Describe Tokyo."}],
        max_tokens=96,
        temperature=0,
        response_format=City,
    )
    City.model_validate_json(r.choices[0].message.content)
    llm = ChatOpenAI(
        model=MODEL, base_url=f"{cluster.base_url}/v1", api_key="unused", temperature=0, max_tokens=96, max_retries=0
    )
    city = llm.with_structured_output(City, method="json_schema").invoke("Describe Rome.")
    assert isinstance(city, City)


# ----------------------------------------------------------------------------- tool calls


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = openai.pydantic_function_tool(GetWeather, name="get_weather")
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
WEATHER_Q = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_and_named_tool_choice_return_valid_calls(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_Q,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
        parallel_tool_calls=False,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        GetWeather.model_validate(args)
    assert r.usage.model_extra["speculation"]["grammar_draft_tokens"] > 3  # the call's envelope was forced
    named = client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_Q,
        tools=[WEATHER, TIME],
        max_tokens=64,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
    )
    assert [c.function.name for c in named.choices[0].message.tool_calls] == ["get_time"]
    assert "zone" in json.loads(named.choices[0].message.tool_calls[0].function.arguments)


def test_streamed_tool_calls_assemble_to_the_whole_answer(client):
    # one call: with parallel calls allowed, this small model repeats its call block until max_tokens
    kw = dict(
        model=MODEL,
        messages=WEATHER_Q,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=64,
        temperature=0,
        parallel_tool_calls=False,
    )
    whole = client.chat.completions.create(**kw)
    with client.chat.completions.stream(**kw) as stream:
        deltas = [e for e in stream if e.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    (a,), (b,) = whole.choices[0].message.tool_calls, final.choices[0].message.tool_calls
    assert (a.function.name, a.function.arguments) == (b.function.name, b.function.arguments)
    assert len(deltas) >= 2  # arguments arrived in fragments, not in one piece
    assert final.choices[0].finish_reason == "tool_calls"
    assert isinstance(b.function.parsed_arguments, GetWeather)  # the SDK's strict-tool parsing


def test_a_tool_result_round_trip_and_auto(client):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    msgs = WEATHER_Q + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], max_tokens=40, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    none = client.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=24, temperature=0
    )
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_langchain_bind_tools_and_function_calling_structured_output(cluster):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{cluster.base_url}/v1", api_key="unused", temperature=0, max_tokens=64, max_retries=0
    )
    bound = llm.bind_tools([GetWeather], tool_choice="GetWeather")
    ai = bound.invoke([HumanMessage("Weather in Oslo?")])
    (tc,) = ai.tool_calls
    assert tc["name"] == "GetWeather"
    GetWeather.model_validate(tc["args"])
    after = llm.bind_tools([GetWeather]).invoke(
        [HumanMessage("Weather in Oslo?"), ai, ToolMessage("2 degrees, snow", tool_call_id=tc["id"])]
    )
    assert after.content or after.tool_calls
    city = llm.with_structured_output(City, method="function_calling").invoke("Describe Madrid.")
    assert isinstance(city, City)
