"""Scale-out without a single point of failure, over real HTTP on a real local cluster.

One cluster whose target deployment autoscales between 1 and 2 replicas (thresholds lowered so a
test can trigger it): load makes Serve add a replica and the Router sends it work; a burst spreads
over both; a killed Router costs no request and stalls none; a killed target replica costs no
stream, and every stream's text is what an uninterrupted run writes. Module order matters: the
scale-up comes first and the replica kill last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from cluster.local_cluster import LocalCluster
from tests.e2e_helpers import in_threads, run_all, started, wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Write one sentence about the sea.",
    "What is the capital of France?",
    "List three colours.",
    "Describe a lighthouse in two sentences.",
]
AUTOSCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 1,
    "downscale_delay_s": 3600,
    "metrics_interval_s": 0.5,
    "look_back_period_s": 2,
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with started(
        LocalCluster(
            tmp_path_factory.mktemp("scale"),
            policy={"name": "goodput"},
            args_patch={
                "target": {"num_cpus": 0.25, "autoscaling_config": AUTOSCALING},
                "draft": {"enabled": False},
                "engine": {"proposers": [{"name": "ngram"}, {"name": "suffix"}]},
            },
        )
    ) as c:
        yield c


CONSTRAINED = {
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "note",
            "schema": {
                "type": "object",
                "properties": {
                    "topic": {"type": "string", "maxLength": 30},
                    "words": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}},
                    "rating": {"enum": [1, 2, 3]},
                },
                "required": ["topic", "words", "rating"],
                "additionalProperties": False,
            },
        },
    }
}


def body(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def stream(cluster, b: dict, stop: threading.Event | None = None) -> dict[str, Any]:
    """A streamed request read to its end, or until ``stop`` is set (the client hangs up): text, the
    longest wait for a chunk (first included), errors."""
    text, err, done, gaps = "", None, False, []
    t = time.monotonic()
    with httpx.stream("POST", f"{cluster.base_url}/v1/chat/completions", json={**b, "stream": True}, timeout=300) as r:
        if r.status_code != 200:
            r.read()
            return {"status": r.status_code, "body": r.text}
        for line in r.iter_lines():
            if stop is not None and stop.is_set():
                break
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            gaps.append(now - t)
            t = now
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                err = obj["error"]
            for c in obj.get("choices", []):
                text += (c.get("delta") or {}).get("content") or ""
    return {"status": 200, "text": text, "error": err, "done": done, "max_gap_s": max(gaps or [0.0])}


def stream_openai(cluster, b: dict) -> dict[str, Any]:
    """The same read through the official ``openai`` client, as users stream: an error event raises
    there, and a stream counts as done when it ends with a finish_reason."""
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    std = ("model", "messages", "max_tokens", "temperature")
    text, err, finish, gaps = "", None, None, []
    t = time.monotonic()
    try:
        for ch in client.chat.completions.create(
            **{k: b[k] for k in std}, stream=True, extra_body={k: v for k, v in b.items() if k not in std}
        ):
            now = time.monotonic()
            gaps.append(now - t)
            t = now
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
    except openai.APIStatusError as e:
        return {"status": e.status_code, "body": str(e)}
    except openai.APIError as e:  # an error event in the stream
        err = {"message": str(e)}
    return {"status": 200, "text": text, "error": err, "done": finish is not None, "max_gap_s": max(gaps or [0.0])}


def replicas(cluster) -> dict[str, dict[str, Any]]:
    """Target replicas that reported in the last 2 s, with their load snapshots."""
    return {r: v for r, v in cluster.stats()["replicas"].items() if v["age_s"] < 2}


@pytest.fixture(scope="module")
def refs(cluster) -> dict[str, str]:
    """Each prompt's greedy text with speculation off: what every run below must reproduce."""
    out = {}
    for p in PROMPTS:
        r = httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body(p, 48, speculation="off"), timeout=300)
        assert r.status_code == 200, r.text
        out[p] = r.json()["choices"][0]["message"]["content"]
    return out


def test_load_makes_serve_add_a_replica_and_the_router_sends_it_work(cluster, refs):
    assert len(replicas(cluster)) == 1
    stop = threading.Event()

    def load():
        while not stop.is_set():
            httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body(PROMPTS[0], 32), timeout=300)

    ts = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in ts:
        t.start()
    try:
        took = wait_for(lambda: len(replicas(cluster)) == 2, 180, "a second target replica")
        print(f"scaled to 2 target replicas {took:.0f}s into the load")
        first = set(replicas(cluster))
        base = {r: v["output_tokens"] for r, v in replicas(cluster).items()}
        wait_for(
            lambda: all(v["output_tokens"] > base.get(r, 0) for r, v in replicas(cluster).items()),
            60,
            "both replicas writing tokens",
        )
        assert set(replicas(cluster)) == first
    finally:
        stop.set()
        for t in ts:
            t.join(300)


def test_a_burst_spreads_over_both_replicas(cluster, refs):
    wait_for(
        lambda: len(replicas(cluster)) == 2 and all(v["running"] == 0 for v in replicas(cluster).values()),
        60,
        "two idle replicas",
    )
    before = {r: v["output_tokens"] for r, v in replicas(cluster).items()}
    got = run_all([lambda i=i: stream(cluster, body(PROMPTS[i % 4], 48)) for i in range(16)])
    for i in range(16):
        assert got[i]["status"] == 200 and got[i]["text"] == refs[PROMPTS[i % 4]], got[i]
    after = {r: v["output_tokens"] for r, v in replicas(cluster).items()}
    served = {r: (after[r] - before[r]) // 48 for r in before}
    print(f"burst of 16 by replica: {served}")
    assert all(n >= 4 for n in served.values()), served


def test_a_killed_router_costs_no_request_and_stalls_none(cluster, probe, refs):
    pid = probe.call("Router", "placement")["pid"]
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    health = httpx.get(f"{cluster.base_url}/health", timeout=10)  # the replicas can still serve: healthy
    assert health.status_code == 200, health.text
    got = run_all([lambda i=i: stream(cluster, body(PROMPTS[i % 4], 48)) for i in range(8)])
    for i in range(8):
        r = got[i]
        assert not isinstance(r, BaseException), r
        assert r["status"] == 200 and r["error"] is None and r["done"], r
        assert r["text"] == refs[PROMPTS[i % 4]]
    stall = max(r["max_gap_s"] for r in got.values())
    print(f"Router killed: 8 of 8 streams identical; longest wait for a chunk {stall:.2f}s")
    assert stall < 2.0
    back = wait_for(lambda: probe.call("Router", "placement")["pid"] != pid, 120, "a restarted Router")
    print(f"Router back {time.monotonic() - t_kill:.1f}s after the kill (polled for {back:.1f}s)")


def test_a_request_given_up_before_its_first_token_leaves_no_slot_in_use(cluster, refs):
    """Every KV slot of both replicas busy and requests waiting in the engine queues; one more
    request's client gives up before its first token (the ingress's own timeout takes the same path:
    the call is cancelled end to end). The engine drops it at once; then every busy client hangs up
    mid-stream, and nothing is left in use afterwards."""
    wait_for(
        lambda: len(replicas(cluster)) == 2 and all(v["running"] == 0 for v in replicas(cluster).values()),
        60,
        "two idle replicas",
    )
    per_replica, n = 8, 22  # max_num_seqs 8 (LocalCluster) on each of 2 replicas; the rest queue
    stop = threading.Event()
    # Plain decoding and long outputs: no busy request can finish during the few seconds checked below.
    busy_body = body(PROMPTS[0], 440, speculation="off")
    ts, busy = in_threads([lambda: stream(cluster, busy_body, stop) for _ in range(n)])

    def load() -> Any:
        """True once both replicas are full and every request arrived; else the (running, waiting) seen,
        and what the clients that already returned got (an early 4xx/5xx or exception shows here)."""
        rs = replicas(cluster)
        full = (
            len(rs) == 2
            and all(v["running"] == per_replica for v in rs.values())
            and sum(v["running"] + v["waiting"] for v in rs.values()) == n
        )
        returned = {i: r if isinstance(r, BaseException) else str(r)[:200] for i, r in list(busy.items())}
        return full or {"replicas": {r: (v["running"], v["waiting"]) for r, v in rs.items()}, "returned": returned}

    try:
        wait_for(load, 60, "every slot busy and the rest queued", interval_s=0.1)
        w0 = sum(v["waiting"] for v in replicas(cluster).values())
        assert w0 == n - 2 * per_replica
        peak = [w0]
        polling = threading.Event()

        def poll() -> None:
            while not polling.is_set():
                peak[0] = max(peak[0], sum(v["waiting"] for v in replicas(cluster).values()))
                time.sleep(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{cluster.base_url}/v1/chat/completions", json=body(PROMPTS[1], 16), timeout=1.5)
        polling.set()
        poller.join()
        assert peak[0] == w0 + 1, f"the request never queued in an engine: {peak[0]} waiting at most, {w0} before"
        waited = wait_for(
            lambda: sum(v["waiting"] for v in replicas(cluster).values()) == w0,
            5,
            "the given-up request out of the queue",
            interval_s=0.1,
        )
        print(f"a request given up while queued was gone from the engine {waited:.2f}s later")
    finally:
        stop.set()
        for t in ts:
            t.join(60)
    assert all(isinstance(busy[i], dict) and busy[i]["status"] == 200 and busy[i]["error"] is None for i in range(n)), (
        busy
    )
    wait_for(
        lambda: all(
            v["running"] == 0 and v["waiting"] == 0 and v["kv_tokens_in_use"] == 0 for v in replicas(cluster).values()
        ),
        30,
        "no slot in use",
    )


def test_a_killed_target_replica_costs_no_stream(cluster, probe, refs):
    wait_for(lambda: len(replicas(cluster)) == 2, 120, "two target replicas")
    pids = {rid: probe.call("TargetWorker", "placement", replica_id=rid)["pid"] for rid in replicas(cluster)}
    assert len(pids) == 2 and all(
        probe.call("TargetWorker", "placement", replica_id=rid)["replica_id"] == rid for rid in pids
    )  # each call reached the replica it named
    # half the streams are constrained: a stream resumed on the other replica continues under its grammar
    b = [body(PROMPTS[i % 4], 160, **(CONSTRAINED if i % 2 else {})) for i in range(8)]
    result: dict[int, Any] = {}
    t = threading.Thread(
        target=lambda: result.update(run_all([lambda i=i: stream_openai(cluster, b[i]) for i in range(8)])), daemon=True
    )
    t.start()
    wait_for(
        lambda: (
            sum(v["output_tokens"] > 0 and v["running"] for v in replicas(cluster).values()) >= 1
            and sum(v["running"] for v in replicas(cluster).values()) >= 8
        ),
        120,
        "8 streams running",
        interval_s=0.1,
    )
    busiest = max(replicas(cluster).items(), key=lambda kv: kv[1]["running"])[0]
    n_on_it = replicas(cluster)[busiest]["running"]
    time.sleep(1.0)  # the streams are well into their output
    os.kill(pids[busiest], signal.SIGKILL)
    t.join(300)
    full = {
        (p, c): httpx.post(
            f"{cluster.base_url}/v1/chat/completions",
            timeout=300,
            json=body(p, 160, speculation="off", **(CONSTRAINED if c else {})),
        ).json()["choices"][0]["message"]["content"]
        for p in PROMPTS
        for c in (0, 1)
    }
    lost = [
        i
        for i in range(8)
        if isinstance(result.get(i), BaseException)
        or result[i]["status"] != 200
        or result[i]["error"] is not None
        or not result[i]["done"]
    ]
    changed = [i for i in range(8) if i not in lost and result[i]["text"] != full[PROMPTS[i % 4], i % 2]]
    assert all(json.loads(full[p, 1]) for p in PROMPTS)  # the constrained ones are whole JSON objects
    gap = max(r["max_gap_s"] for r in result.values() if isinstance(r, dict) and "max_gap_s" in r)
    print(
        f"target replica killed with {n_on_it} of 8 streams on it: lost {lost}, changed {changed}; "
        f"longest wait for a chunk {gap:.2f}s"
    )
    assert lost == [] and changed == []
