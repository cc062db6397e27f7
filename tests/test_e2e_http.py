"""End to end: a real two-node local Ray cluster, the app deployed with `serve deploy`,
the real SmolLM2, real HTTP, driven by the official ``openai`` client."""

from __future__ import annotations

import json
import os
import threading

import httpx
import openai
import psutil
import pytest
import torch

from cluster import cpu_priority
from cluster.local_cluster import LocalCluster
from cluster.serve_env import SERVE_ENV
from tests.e2e_helpers import started
from workers.hardware import resolve_dtype

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
COPY = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with started(LocalCluster(tmp_path_factory.mktemp("serve"), policy={"name": "goodput"})) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, content: str, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=24, temperature=0, extra_body=extra
    )


def test_models_and_health(cluster, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{cluster.base_url}/health").status_code == 200
    (replica,) = cluster.stats()["replicas"].values()
    assert replica["batch_invariant"] and replica["attention_kernel"] == "native"  # CI has a C compiler
    assert replica["dtype"] == str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")  # dtype: auto


def test_target_and_draft_on_different_nodes_and_the_engine_first_on_the_cpu(cluster):
    t = cluster.call("TargetWorker", "placement")
    d = cluster.call("DraftWorker", "placement")
    assert t["node_id"] != d["node_id"]
    if not hasattr(os, "sched_getscheduler"):
        return
    # cluster/cpu_priority.py: the engine's loop thread runs SCHED_OTHER at nice 0, the rest of its replica
    # and the raylets SCHED_BATCH at nice 0, the GCS SCHED_BATCH at nice 10, the dashboard SCHED_IDLE
    assert t["engine_cpu_priority"] == "other/0"
    assert os.sched_getscheduler(t["engine_thread"]) == os.SCHED_OTHER
    assert os.sched_getscheduler(t["pid"]) == os.SCHED_BATCH and os.getpriority(os.PRIO_PROCESS, t["pid"]) == 0
    by_name = {" ".join(p.cmdline()[:1]).rsplit("/", 1)[-1]: p for p in cluster.processes()}
    assert os.sched_getscheduler(by_name["raylet"].pid) == os.SCHED_BATCH
    assert os.sched_getscheduler(by_name["gcs_server"].pid) == os.SCHED_BATCH
    assert os.getpriority(os.PRIO_PROCESS, by_name["gcs_server"].pid) == cpu_priority.DAEMON_NICE
    dashboard = [p for p in cluster.processes() if "dashboard/dashboard.py" in " ".join(p.cmdline()[:3])]
    assert dashboard and all(os.sched_getscheduler(p.pid) == os.SCHED_IDLE for p in dashboard)


def test_serve_processes_run_with_the_serve_env(cluster):
    """cluster/serve_env.py reaches the processes that read it: the Serve controller and the replicas."""
    t = cluster.call("TargetWorker", "placement")
    controller = [p for p in cluster.processes() if "ServeController" in " ".join(p.cmdline()[:4])]
    assert controller
    for proc in [psutil.Process(t["pid"]), *controller]:
        env = proc.environ()
        assert {k: env.get(k) for k in SERVE_ENV} == SERVE_ENV, proc.cmdline()[:2]


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "draft_model"])
def test_greedy_speculation_on_equals_off(client, proposer):
    for prompt in (COPY, "What is the capital of France?"):
        off = chat(client, prompt, speculation="off")
        on = chat(client, prompt, speculation="on", proposer=proposer)
        assert on.choices[0].message.content == off.choices[0].message.content
        s_on, s_off = on.usage.model_extra["speculation"], off.usage.model_extra["speculation"]
        assert s_off["spec_steps"] == 0 and s_off["draft_tokens"] == 0
        assert s_on["proposer"] == proposer
        assert 0 <= s_on["accepted_tokens"] <= s_on["draft_tokens"]
        assert on.usage.completion_tokens == off.usage.completion_tokens
        # prefix caching: every chat prompt starts with the template's system prompt, which the
        # target replica (one in this cluster) has computed before
        assert 0 < on.usage.prompt_tokens_details.cached_tokens < on.usage.prompt_tokens
    if proposer != "suffix":  # n-gram on a verbatim repeat, and the target as its own draft, must draft
        assert (
            chat(client, COPY, speculation="on", proposer=proposer).usage.model_extra["speculation"]["draft_tokens"] > 0
        )


def _neighbour_load(client, stop: threading.Event, n: int = 15) -> list[threading.Thread]:
    """``n`` clients sending assorted requests back to back until ``stop`` is set."""

    def loop(i: int) -> None:
        while not stop.is_set():
            try:
                chat(client, f"Tell me fact number {i} about the sea.", speculation=["on", "off", "auto"][i % 3])
            except openai.APIError:
                pass

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def _answer(client, content: str, sampled: bool, stream: bool, **extra) -> tuple[str, list]:
    kw = dict(temperature=0.8, top_p=0.95, seed=11) if sampled else dict(temperature=0)
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        max_tokens=16,
        logprobs=True,
        top_logprobs=3,
        stream=stream,
        extra_body=extra,
        **kw,
    )
    if not stream:
        return r.choices[0].message.content, [
            (e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in r.choices[0].logprobs.content
        ]
    text, lps = "", []
    for ch in r:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            if ch.choices[0].logprobs and ch.choices[0].logprobs.content:
                lps += [
                    (e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs])
                    for e in ch.choices[0].logprobs.content
                ]
    return text, lps


def test_output_and_logprobs_are_a_function_of_the_request_under_load(client):
    """Greedy and seeded (T=0.8, top-p 0.95) chat with logprobs: the text and every logprob are
    identical alone with speculation off, and with speculation on (n-gram, draft model) or auto
    while 15 other clients keep the batch busy; streamed and not."""
    prompts = (COPY, "Name three rivers in Europe.")
    ref = {(p, s): _answer(client, p, s, False, speculation="off") for p in prompts for s in (False, True)}
    for (p, s), (text, lps) in ref.items():
        assert text and 1 <= len(lps) <= 16, (p, s)
        assert all(len(top) == 3 and lp <= 0 for _, lp, top in lps)
    assert any(ref[(p, False)] != ref[(p, True)] for p in prompts)  # the sampled requests really sampled
    stop = threading.Event()
    threads = _neighbour_load(client, stop)
    try:
        for stream, extra in (
            (False, {"speculation": "on", "proposer": "ngram"}),
            (True, {"speculation": "on", "proposer": "ngram"}),
            (False, {"speculation": "on", "proposer": "draft_model"}),
            (True, {"speculation": "auto"}),
        ):
            for (p, s), want in ref.items():
                assert _answer(client, p, s, stream, **extra) == want, (extra, p, s, stream)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def test_streaming_matches_non_streaming_with_usage(client):
    full = chat(client, COPY, speculation="on")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": COPY}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"speculation": "on"},
    )
    text, usage, finish = "", None, None
    for ch in stream:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            finish = ch.choices[0].finish_reason or finish
        if ch.usage:
            usage = ch.usage
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.model_extra["speculation"]["accepted_tokens"] <= usage.model_extra["speculation"]["draft_tokens"]


def test_completions_text_and_token_prompt(client):
    a = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert a.choices[0].text and a.usage.completion_tokens <= 12
    b = client.completions.create(
        model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0, extra_body={"speculation": "off"}
    )
    assert b.usage.prompt_tokens == 4


BAD = [
    ("malformed json", b"{not json", None),
    ("invalid utf-8", b'{"model": "\xff\xfe"}', None),
    ("not an object", b"[1, 2]", None),
    ("missing messages", {"messages": None}, "messages"),
    ("empty messages", {"model": MODEL, "messages": []}, "messages"),
    ("unknown role", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("content wrong type", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("max_tokens < 1", {"max_tokens": 0}, "max_tokens"),
    ("max_tokens above cap", {"max_tokens": 100000}, "max_tokens"),
    ("max_tokens wrong type", {"max_tokens": "many"}, "max_tokens"),
    ("temperature < 0", {"temperature": -0.5}, "temperature"),
    ("top_p zero", {"top_p": 0}, "top_p"),
    ("top_p above 1", {"top_p": 1.5}, "top_p"),
    ("unknown model", {"model": "gpt-7"}, "model"),
    ("unknown speculation", {"speculation": "maybe"}, "speculation"),
    ("unknown proposer", {"proposer": "oracle"}, "proposer"),
    ("n < 1", {"n": 0}, "n"),
    ("unknown field", {"frobnicate": True}, "frobnicate"),
    ("too many stop strings", {"stop": [str(i) for i in range(50)]}, "stop"),
    ("prompt longer than context", {"messages": [{"role": "user", "content": "word " * 800}]}, "messages"),
    (
        "prompt + max_tokens over context",
        {"messages": [{"role": "user", "content": "word " * 400}], "max_tokens": 400},
        "max_tokens",
    ),
]


def test_bad_input_is_4xx_naming_the_problem_and_service_survives(cluster, client):
    # a good request runs while the bad ones arrive; its output must be unchanged
    ref = chat(client, COPY, speculation="off").choices[0].message.content
    got: dict[str, str] = {}
    t = threading.Thread(
        target=lambda: got.setdefault("x", chat(client, COPY, speculation="on").choices[0].message.content)
    )
    t.start()
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for name, body, param in BAD:
        if isinstance(body, bytes):
            r = httpx.post(
                f"{cluster.base_url}/v1/chat/completions",
                content=body,
                headers={"content-type": "application/json"},
                timeout=30,
            )
        else:
            merged = {k: v for k, v in {**base, **body}.items() if v is not None}  # None = leave the field out
            r = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=merged, timeout=30)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) >= {"message", "type", "param", "code"}, name
        if param is not None:
            assert err["param"] == param, (name, err)
    t.join(timeout=120)
    assert got["x"] == ref
    assert chat(client, COPY, speculation="on").choices[0].message.content == ref


def test_live_policy_reconfigure_without_restart(cluster, client):
    before = cluster.call("TargetWorker", "placement")
    cluster.deploy({"name": "never", "allow_request_override": False})
    _wait_policy(cluster, "never")
    r = chat(client, COPY, speculation="on")
    assert r.usage.model_extra["speculation"]["spec_steps"] == 0
    # switch to always while a request is in flight: it completes, with unchanged output
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("r", chat(client, COPY)))
    t.start()
    cluster.deploy({"name": "always", "num_speculative_tokens": 4})
    _wait_policy(cluster, "always")
    t.join(timeout=120)
    assert result["r"].choices[0].message.content == r.choices[0].message.content
    r2 = chat(client, COPY)
    assert r2.usage.model_extra["speculation"]["spec_steps"] > 0
    assert r2.choices[0].message.content == r.choices[0].message.content
    steps = cluster.call("TargetWorker", "policy_trace")["steps"]  # the operator's view of recent decisions
    assert any(s["ks"] == [4] and s["tokens"] == 5 and s["requests"] == 1 for s in steps), steps[-5:]
    assert all("why" in s for s in steps)  # the policy's reasons per step (`always` has none to give)
    after = cluster.call("TargetWorker", "placement")
    assert after["pid"] == before["pid"] and after["replica_id"] == before["replica_id"]  # not restarted
    cluster.deploy({"name": "goodput"})
    _wait_policy(cluster, "goodput")


def _wait_policy(cluster, name: str, timeout_s: float = 60) -> None:
    """Until the Router and the target run ``name`` (a target fetches a newer policy before admitting a
    request the Router routed, and otherwise with its next load report)."""
    import time

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if (
            cluster.stats()["policy"]["name"] == name
            and cluster.call("TargetWorker", "policy_trace")["policy_name"] == name
        ):
            return
        time.sleep(0.1)
    raise TimeoutError(f"policy {name} not applied")


# ----------------------------------------------------------------------------- request shapes real clients send


def test_chat_content_parts_developer_role_and_fingerprint(client):
    """Content as a list of text parts, the developer role (= system), system_fingerprint."""
    base = client.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}],
    )
    parts = client.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        messages=[
            {
                "role": "developer",
                "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}],
            },
            {"role": "user", "content": [{"type": "text", "text": "Name a fruit."}], "name": "ada"},
        ],
    )
    assert parts.choices[0].message.content == base.choices[0].message.content
    assert base.system_fingerprint and base.system_fingerprint == parts.system_fingerprint


def test_n_choices_and_batched_prompts(client):
    """n > 1: one choice per engine request, seed + i each, so choice i equals a single request with
    seed + i; streamed choices carry their index; batched completions prompts index as prompt * n + i."""
    msgs = [{"role": "user", "content": "Write one word."}]
    eos = {"ignore_eos": True}
    many = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=8, temperature=1.0, seed=5, n=3, extra_body=eos
    )
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert len({c.message.content for c in many.choices}) > 1  # different seeds, different samples
    for c in many.choices:
        one = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=8, temperature=1.0, seed=5 + c.index, extra_body=eos
        )
        assert c.message.content == one.choices[0].message.content
    assert many.usage.completion_tokens == 3 * 8  # summed over the choices
    texts: dict[int, str] = {}
    usage = None
    for ch in client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=8,
        temperature=1.0,
        seed=5,
        n=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=eos,
    ):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        usage = ch.usage or usage
    assert texts == {c.index: c.message.content for c in many.choices}
    assert usage.completion_tokens == many.usage.completion_tokens
    batch = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "The sky is"], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text  # greedy: both choices of a prompt agree
    alone = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=6, temperature=0)
    assert batch.choices[2].text == alone.choices[0].text


def test_echo_penalties_continuous_usage_and_models(cluster, client):
    echo = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert echo.choices[0].text == "Once upon a time" + plain.choices[0].text
    penalties = {"frequency_penalty": 2.0, "presence_penalty": 1.0}
    pen = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": COPY}],
        max_tokens=24,
        temperature=0,
        **penalties,
        extra_body={"repetition_penalty": 1.5},
    )
    nopen = chat(client, COPY)
    assert pen.choices[0].message.content != nopen.choices[0].message.content
    again = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": COPY}],
        max_tokens=24,
        temperature=0,
        **penalties,
        extra_body={"repetition_penalty": 1.5, "speculation": "on", "proposer": "ngram"},
    )
    assert again.choices[0].message.content == pen.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    assert with_choices[-1].usage.completion_tokens == chunks[-1].usage.completion_tokens
    listed = client.models.list().data[0]
    assert listed.created > 0 and listed.model_extra["max_model_len"] == 512 and listed.model_extra["root"]
    assert client.models.retrieve(MODEL).id == MODEL
    r = httpx.get(f"{cluster.base_url}/v1/models/gpt-7", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


UNSUPPORTED = [
    (
        "image part",
        CHAT_ROUTE := "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
        "messages.0.content",
        "does not support",
    ),
    (
        "unknown part type",
        CHAT_ROUTE,
        {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
        "messages.0.content",
        "must be",
    ),
    (
        "tool_choice naming no tool",
        CHAT_ROUTE,
        {
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "tool_choice",
        "g",
    ),
    ("functions (deprecated)", CHAT_ROUTE, {"functions": [{"name": "f"}]}, "functions", "not supported"),
    (
        "response_format of an unknown type",
        CHAT_ROUTE,
        {"response_format": {"type": "yaml"}},
        "response_format.type",
        "'text', 'json_object' or 'json_schema'",
    ),
    ("n above max_n", CHAT_ROUTE, {"n": 9}, "n", "limit"),
    ("presence_penalty above 2", CHAT_ROUTE, {"presence_penalty": 2.5}, "presence_penalty", ""),
    ("echo with chat", CHAT_ROUTE, {"echo": True}, "echo", "unknown"),
    ("best_of", "/v1/completions", {"best_of": 3}, "best_of", "not supported"),
    ("suffix", "/v1/completions", {"suffix": "end"}, "suffix", "not supported"),
]


@pytest.mark.parametrize("name,route,body,param,words", UNSUPPORTED, ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_and_bad_shapes_are_named(cluster, name, route, body, param, words):
    base = (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        if route.endswith("chat/completions")
        else {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    )
    r = httpx.post(cluster.base_url + route, json={**base, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_completions_scoring_as_eval_harnesses_send_it(cluster):
    """lm-evaluation-harness's loglikelihood request: token-id prompts in a batch, echo, logprobs 1,
    max_tokens 0. Every prompt token but the first gets its logprob (the first: null), identical
    for the same tokens whatever else is in the batch, and matching the greedy continuation."""
    tok_prompt = [1, 504, 3458, 282, 4217, 314, 1345]
    body = {
        "model": MODEL,
        "prompt": [tok_prompt, tok_prompt[:4]],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 0,
        "temperature": 0,
    }
    r = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    full, short = r.json()["choices"]
    lp = full["logprobs"]
    assert len(lp["tokens"]) == len(tok_prompt) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x < 0 for x in lp["token_logprobs"][1:]) and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert short["logprobs"]["token_logprobs"] == lp["token_logprobs"][:4]  # same positions, same numbers
    assert full["text"] and full["finish_reason"] == "length"
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # streamed, with one generated token after the prompt: the prompt's entries come first
    streamed = []
    with httpx.stream(
        "POST",
        f"{cluster.base_url}/v1/completions",
        timeout=60,
        json={**body, "prompt": tok_prompt, "max_tokens": 1, "stream": True},
    ) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                if ch["choices"] and ch["choices"][0]["logprobs"]:
                    streamed += ch["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed[: len(tok_prompt)] == lp["token_logprobs"] and len(streamed) == len(tok_prompt) + 1
    bad = httpx.post(f"{cluster.base_url}/v1/completions", json={**body, "echo": False}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


# ----------------------------------------------------------------------------- the clients users have


def test_langchain_openai_invoke_stream_logprobs_and_n(cluster):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL, base_url=f"{cluster.base_url}/v1", api_key="unused", temperature=0, max_tokens=16, max_retries=0
    )
    msg = llm.invoke([("system", "You are terse."), ("human", "Name a fruit.")])
    streamed = "".join(c.content for c in llm.stream([("system", "You are terse."), ("human", "Name a fruit.")]))
    assert msg.content and streamed == msg.content
    lp = llm.bind(logprobs=True, top_logprobs=2).invoke("Say hi.").response_metadata["logprobs"]["content"]
    assert lp and all(len(e["top_logprobs"]) == 2 for e in lp)
    gen = ChatOpenAI(
        model=MODEL,
        base_url=f"{cluster.base_url}/v1",
        api_key="unused",
        temperature=1.0,
        n=2,
        seed=3,
        max_tokens=8,
        max_retries=0,
    ).generate([[HumanMessage("One word, please.")]])
    assert len(gen.generations[0]) == 2


def test_litellm_completion_stream_and_penalties(cluster):
    import litellm

    kw = dict(
        model=f"openai/{MODEL}",
        api_base=f"{cluster.base_url}/v1",
        api_key="unused",
        max_tokens=16,
        temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": COPY}]}],
    )
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert text
    assert "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True)) == text
    pen = litellm.completion(**kw, frequency_penalty=1.0, presence_penalty=0.5, seed=1)
    assert pen.choices[0].message.content


def test_lm_eval_harness_scores_through_completions(cluster, tmp_path):
    """lm-evaluation-harness (`local-completions`) on two tiny tasks whose data the test writes: a
    multiple-choice task (loglikelihood: echo + logprobs + max_tokens 0) and a generate_until task.
    No hub access: local JSON data, the served model's local tokenizer."""
    import subprocess
    import sys

    from workers.model_loader import resolve_model_path

    rows = [
        {"question": "The capital of France is", "choices": [" Paris", " a banana"], "label": 0},
        {"question": "Two plus two equals", "choices": [" four", " purple"], "label": 0},
    ]
    (tmp_path / "mc.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "gen.jsonl").write_text(
        "\n".join(json.dumps({"question": r["question"], "answer": r["choices"][0]}) for r in rows)
    )
    common = "test_split: test\ndataset_path: json\n"
    (tmp_path / "tiny_mc.yaml").write_text(
        f"task: tiny_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"
    )
    (tmp_path / "tiny_gen.yaml").write_text(
        f"task: tiny_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    model_args = (
        f"model={MODEL},base_url={cluster.base_url}/v1/completions,num_concurrent=1,max_retries=1,"
        f"tokenized_requests=True,tokenizer={resolve_model_path('smollm2')},tokenizer_backend=huggingface"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lm_eval",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--tasks",
            "tiny_mc,tiny_gen",
            "--include_path",
            str(tmp_path),
            "--output_path",
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    results = list((tmp_path / "out").rglob("results_*.json"))
    assert results, out.stdout[-2000:]
    metrics = json.loads(results[0].read_text())["results"]
    assert "acc,none" in metrics["tiny_mc"] and "exact_match,none" in metrics["tiny_gen"]
    assert metrics["tiny_mc"]["acc,none"] == 1.0  # SmolLM2 knows Paris from a banana
