"""End to end: a real two-node local Ray cluster, the app deployed with `serve deploy`,
the real SmolLM2, real HTTP, driven by the official ``openai`` client."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

from cluster.local_cluster import LocalCluster

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
COPY = "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("serve"), policy={"name": "goodput"})
    try:
        c.start()
        yield c
    finally:
        c.stop()


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


def test_target_and_draft_on_different_nodes(cluster):
    t = cluster.call("TargetWorker", "placement")
    d = cluster.call("DraftWorker", "placement")
    assert t["node_id"] != d["node_id"]


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
        assert chat(client, COPY, speculation="on", proposer=proposer).usage.model_extra["speculation"]["draft_tokens"] > 0


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
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=24,
                                       logprobs=True, top_logprobs=3, stream=stream, extra_body=extra, **kw)
    if not stream:
        return r.choices[0].message.content, [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs])
                                              for e in r.choices[0].logprobs.content]
    text, lps = "", []
    for ch in r:
        if ch.choices:
            text += ch.choices[0].delta.content or ""
            if ch.choices[0].logprobs and ch.choices[0].logprobs.content:
                lps += [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs])
                        for e in ch.choices[0].logprobs.content]
    return text, lps


def test_output_and_logprobs_are_a_function_of_the_request_under_load(client):
    """Greedy and seeded (T=0.8, top-p 0.95) chat with logprobs: the text and every logprob are
    identical alone with speculation off, and with speculation on (n-gram, draft model) or auto
    while 15 other clients keep the batch busy; streamed and not."""
    prompts = (COPY, "Name three rivers in Europe.")
    ref = {(p, s): _answer(client, p, s, False, speculation="off") for p in prompts for s in (False, True)}
    for (p, s), (text, lps) in ref.items():
        assert text and 1 <= len(lps) <= 24, (p, s)
        assert all(len(top) == 3 and lp <= 0 for _, lp, top in lps)
    assert any(ref[(p, False)] != ref[(p, True)] for p in prompts)  # the sampled requests really sampled
    stop = threading.Event()
    threads = _neighbour_load(client, stop)
    try:
        for stream, extra in ((False, {"speculation": "on", "proposer": "ngram"}),
                              (True, {"speculation": "on", "proposer": "ngram"}),
                              (False, {"speculation": "on", "proposer": "draft_model"}),
                              (True, {"speculation": "auto"})):
            for (p, s), want in ref.items():
                assert _answer(client, p, s, stream, **extra) == want, (extra, p, s, stream)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)


def test_streaming_matches_non_streaming_with_usage(client):
    full = chat(client, COPY, speculation="on")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": COPY}], max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculation": "on"},
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
    b = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0,
                                  extra_body={"speculation": "off"})
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
    ("n > 1", {"n": 3}, "n"),
    ("unknown field", {"frobnicate": True}, "frobnicate"),
    ("too many stop strings", {"stop": [str(i) for i in range(50)]}, "stop"),
    ("prompt longer than context", {"messages": [{"role": "user", "content": "word " * 800}]}, "messages"),
    ("prompt + max_tokens over context", {"messages": [{"role": "user", "content": "word " * 400}],
                                          "max_tokens": 400}, "max_tokens"),
]


def test_bad_input_is_4xx_naming_the_problem_and_service_survives(cluster, client):
    # a good request runs while the bad ones arrive; its output must be unchanged
    ref = chat(client, COPY, speculation="off").choices[0].message.content
    got: dict[str, str] = {}
    t = threading.Thread(target=lambda: got.setdefault("x", chat(client, COPY, speculation="on").choices[0].message.content))
    t.start()
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for name, body, param in BAD:
        if isinstance(body, bytes):
            r = httpx.post(f"{cluster.base_url}/v1/chat/completions", content=body,
                           headers={"content-type": "application/json"}, timeout=30)
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
    import time

    t0 = time.time()
    while time.time() - t0 < timeout_s:
        if cluster.stats()["policy"]["name"] == name:
            time.sleep(0.3)  # the targets pick it up with their next load report (50 ms)
            return
        time.sleep(0.3)
    raise TimeoutError(f"policy {name} not applied")
