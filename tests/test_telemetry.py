"""Telemetry without Ray: Prometheus rendering, the in-memory metric reader, spec_decode summaries,
W3C propagation, the target's spans from engine step events, and the engine's event / verify hooks."""

from __future__ import annotations

import math

import pytest

from cluster.config import AppConfig, TelemetryConfig
from cluster.telemetry import (
    Telemetry,
    dedupe_by_replica,
    extract,
    inject,
    render_prometheus,
    spec_decode_summary,
    tokens_bucket,
)
from deployments.target_telemetry import TargetTelemetry
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.proposers.draft_model import DraftModelProposer
from workers.request import StepEvent
from workers.stats import LoadSnapshot

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


# ------------------------------------------------------------------ Prometheus text


def test_render_prometheus_hand_written_samples():
    samples = [
        {
            "name": "spec_decode_num_draft_tokens",
            "kind": "counter",
            "description": "Draft tokens.",
            "labels": {"proposer": "ngram", "replica": "a"},
            "value": 12,
        },
        {
            "name": "specserve_num_requests_running",
            "kind": "gauge",
            "description": "Running\nrequests \\ now",
            "labels": {"replica": 'we"ird\\na\nme'},
            "value": 3.5,
        },
        {
            "name": "spec_decode_num_draft_tokens",
            "kind": "counter",
            "description": "Draft tokens.",
            "labels": {"proposer": "ngram", "replica": "b"},
            "value": 4,
        },
        {
            "name": "lat_seconds",
            "kind": "histogram",
            "description": "",
            "labels": {"replica": "a"},
            "bounds": [0.1, 1.0],
            "buckets": [2, 3, 1],
            "sum": 4.25,
            "count": 6,
        },
        {"name": "already_total", "kind": "counter", "description": "x", "labels": {}, "value": 1},
        {"name": "odd.name-1", "kind": "gauge", "description": "", "labels": {"bad-label": "v"}, "value": math.inf},
    ]
    assert render_prometheus(samples) == (
        "# HELP spec_decode_num_draft_tokens_total Draft tokens.\n"
        "# TYPE spec_decode_num_draft_tokens_total counter\n"
        'spec_decode_num_draft_tokens_total{proposer="ngram",replica="a"} 12\n'
        'spec_decode_num_draft_tokens_total{proposer="ngram",replica="b"} 4\n'
        "# HELP specserve_num_requests_running Running\\nrequests \\\\ now\n"
        "# TYPE specserve_num_requests_running gauge\n"
        'specserve_num_requests_running{replica="we\\"ird\\\\na\\nme"} 3.5\n'
        "# HELP lat_seconds lat_seconds\n"
        "# TYPE lat_seconds histogram\n"
        'lat_seconds_bucket{replica="a",le="0.1"} 2\n'
        'lat_seconds_bucket{replica="a",le="1.0"} 5\n'
        'lat_seconds_bucket{replica="a",le="+Inf"} 6\n'
        'lat_seconds_sum{replica="a"} 4.25\n'
        'lat_seconds_count{replica="a"} 6\n'
        "# HELP already_total x\n"
        "# TYPE already_total counter\n"
        "already_total 1\n"
        "# HELP odd_name_1 odd.name-1\n"
        "# TYPE odd_name_1 gauge\n"
        'odd_name_1{bad_label="v"} +Inf\n'
    )
    assert render_prometheus([]) == ""


def test_prometheus_text_parses_with_the_reference_parser():
    prom = pytest.importorskip("prometheus_client.parser")
    samples = [
        {"name": "c", "kind": "counter", "description": "a counter", "labels": {"replica": "r"}, "value": 2},
        {
            "name": "h_seconds",
            "kind": "histogram",
            "description": "h",
            "labels": {"replica": "r"},
            "bounds": [0.5],
            "buckets": [1, 1],
            "sum": 1.2,
            "count": 2,
        },
    ]
    fams = {f.name: f for f in prom.text_string_to_metric_families(render_prometheus(samples))}
    assert fams["c"].type == "counter" and fams["c"].samples[0].value == 2
    h = {(s.name, s.labels.get("le")): s.value for s in fams["h_seconds"].samples}
    assert h[("h_seconds_bucket", "+Inf")] == 2 and h[("h_seconds_count", None)] == 2


# ------------------------------------------------------------------ the in-memory reader


def test_in_memory_reader_round_trip():
    from opentelemetry.metrics import Observation

    tel = Telemetry(TelemetryConfig(), "test", "replica-1")
    c = tel.meter.create_counter("things", description="Things done.")
    level = {"v": 7}
    tel.meter.create_observable_gauge("level", callbacks=[lambda _o: [Observation(level["v"], {"kind": "x"})]])
    tel.meter.create_observable_counter("seen", callbacks=[lambda _o: [Observation(41, {"proposer": "ngram"})]])
    h = tel.meter.create_histogram("lat_seconds", explicit_bucket_boundaries_advisory=[0.1, 1.0])
    c.add(2, {"route": "/a"})
    c.add(3, {"route": "/a"})
    for v in (0.05, 0.5, 0.7, 3.0):
        h.record(v)
    by = {s["name"]: s for s in tel.samples()}
    assert by["things"] == {
        "name": "things",
        "kind": "counter",
        "description": "Things done.",
        "labels": {"route": "/a", "replica": "replica-1"},
        "value": 5,
    }
    assert by["level"]["kind"] == "gauge" and by["level"]["value"] == 7
    assert by["seen"]["kind"] == "counter" and by["seen"]["value"] == 41
    assert by["lat_seconds"]["bounds"] == [0.1, 1.0] and by["lat_seconds"]["buckets"] == [1, 2, 1]
    assert by["lat_seconds"]["count"] == 4 and by["lat_seconds"]["sum"] == pytest.approx(4.25)
    # cumulative: a second scrape sees the totals, not deltas; gauges read their callback now
    c.add(1, {"route": "/a"})
    level["v"] = 9
    by = {s["name"]: s for s in tel.samples()}
    assert by["things"]["value"] == 6 and by["level"]["value"] == 9 and by["lat_seconds"]["count"] == 4
    text = render_prometheus(tel.samples())
    assert 'things_total{replica="replica-1",route="/a"} 6' in text
    assert 'lat_seconds_bucket{replica="replica-1",le="+Inf"} 4' in text


def test_dedupe_keeps_one_list_per_replica():
    a = [{"name": "x", "kind": "gauge", "labels": {"replica": "a"}, "value": 1}]
    a2 = [{"name": "x", "kind": "gauge", "labels": {"replica": "a"}, "value": 2}]
    b = [{"name": "x", "kind": "gauge", "labels": {"replica": "b"}, "value": 3}]
    assert [s["value"] for s in dedupe_by_replica([a, [], a2, b])] == [1, 3]


# ------------------------------------------------------------------ spec_decode summary


def _spec_samples(replica: str, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> list[dict]:
    lab = {"proposer": "ngram", "replica": replica}
    out = [
        {"name": "spec_decode_num_drafts", "kind": "counter", "labels": lab, "value": drafts},
        {"name": "spec_decode_num_draft_tokens", "kind": "counter", "labels": lab, "value": draft_tokens},
        {"name": "spec_decode_num_accepted_tokens", "kind": "counter", "labels": lab, "value": accepted},
    ]
    out += [
        {
            "name": "spec_decode_num_accepted_tokens_per_pos",
            "kind": "counter",
            "labels": {**lab, "position": str(i)},
            "value": n,
        }
        for i, n in enumerate(per_pos)
    ]
    return out


def test_acceptance_rate_with_zero_drafts_does_not_raise():
    s = spec_decode_summary(_spec_samples("a", 0, 0, 0, []))
    assert s["ngram"]["acceptance_rate"] == 0.0
    assert s["ngram"]["mean_acceptance_length"] == 1.0
    assert spec_decode_summary([]) == {}


def test_spec_decode_summary_sums_replicas():
    samples = _spec_samples("a", 2, 8, 5, [2, 2, 1]) + _spec_samples("b", 1, 4, 1, [1])
    s = spec_decode_summary(samples)["ngram"]
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (3, 12, 6)
    assert s["accepted_per_pos"] == [3, 2, 1]
    assert s["acceptance_rate"] == pytest.approx(0.5)
    assert s["mean_acceptance_length"] == pytest.approx(3.0)


def test_tokens_bucket():
    assert [tokens_bucket(n) for n in (1, 2, 4, 5, 8, 9, 200, 256, 257, 5000)] == [
        "1",
        "2-4",
        "2-4",
        "5-8",
        "5-8",
        "9-16",
        "129-256",
        "129-256",
        "257+",
        "257+",
    ]


# ------------------------------------------------------------------ traces


def test_tracing_off_means_no_tracer():
    tel = Telemetry(TelemetryConfig(), "test", "r")
    assert tel.tracer is None and not tel.tracing and tel.finished_spans() == []


def test_w3c_round_trip():
    ctx = extract({"traceparent": TRACEPARENT})
    carrier = inject(ctx)
    assert carrier["traceparent"] == TRACEPARENT
    assert extract({}) is not None  # no header: an empty context, not an error


def _target_telemetry(tracing: str = "memory") -> TargetTelemetry:
    cfg = AppConfig.model_validate({"telemetry": {"tracing": tracing}})
    return TargetTelemetry(cfg, "t1", ["ngram"], snapshot=lambda: LoadSnapshot(running=2, waiting=1))


def test_target_spans_from_step_events_carry_the_incoming_trace():
    tt = _target_telemetry()
    parent = tt.trace_parent({"traceparent": TRACEPARENT})
    assert parent is not None
    ms = 1_000_000
    events = [
        StepEvent(0, 10 * ms, "prefill", 0, 0, 1 * ms),
        StepEvent(10 * ms, 20 * ms, "prefill", 0, 0, 11 * ms),
        StepEvent(20 * ms, 30 * ms, "spec", 4, 3, 22 * ms),
        StepEvent(30 * ms, 40 * ms, "plain", 0, 0, 31 * ms),
        StepEvent(40 * ms, 50 * ms, "plain", 0, 0, 41 * ms),
        StepEvent(50 * ms, 60 * ms, "spec", 2, 0, 52 * ms),
    ]
    tt.emit_request_spans(parent, 0, 61 * ms, events, {"proposer": "ngram", "request_id": "r1"})
    spans = tt.tel.finished_spans()
    assert [s["name"] for s in spans] == ["prefill", "spec_step", "plain_steps", "spec_step", "TargetWorker.generate"]
    assert {s["trace_id"] for s in spans} == {TRACE_ID}
    root = spans[-1]
    assert root["parent_span_id"] == "00f067aa0ba902b7"
    assert all(s["parent_span_id"] == root["span_id"] for s in spans[:-1])
    assert spans[0]["attributes"]["steps"] == 2 and spans[0]["end_ns"] == 20 * ms
    assert spans[1]["attributes"]["num_draft_tokens"] == 4 and spans[1]["attributes"]["num_accepted_tokens"] == 3
    assert spans[1]["attributes"]["proposer"] == "ngram"
    assert spans[2]["attributes"]["steps"] == 2 and (spans[2]["start_ns"], spans[2]["end_ns"]) == (30 * ms, 50 * ms)


def test_unsampled_or_missing_trace_context_records_nothing():
    tt = _target_telemetry()
    assert tt.trace_parent(None) is None
    assert tt.trace_parent({"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-00"}) is None
    assert _target_telemetry("off").trace_parent({"traceparent": TRACEPARENT}) is None


def test_target_samples_from_engine_view():
    import asyncio

    class FakeStats:
        num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_pos = 3, 12, 7, [3, 2, 2]

    class FakeEngine:
        stats = {"ngram": FakeStats()}
        prefix_cache_queries, prefix_cache_hits = 50, 20
        num_preemptions = 3

    tt = _target_telemetry("off")
    tt.count_decisions([0, 4, 4])
    tt.on_step(9, 0.05)
    tt.on_verify("ngram", 4, 2)

    async def call(fn):
        return fn(FakeEngine())

    samples = asyncio.run(tt.samples(call))
    val = {(s["name"], tuple(sorted(s["labels"].items()))): s for s in samples}
    lab = (("proposer", "ngram"), ("replica", "t1"))
    assert val[("spec_decode_num_draft_tokens", lab)]["value"] == 12
    assert val[("spec_decode_num_accepted_tokens", lab)]["value"] == 7
    assert val[("spec_decode_num_accepted_tokens_per_pos", (("position", "1"),) + lab)]["value"] == 2
    assert val[("specserve_step_decisions", (("k", "4"), ("path", "spec"), ("replica", "t1")))]["value"] == 2
    assert val[("specserve_num_requests_running", (("replica", "t1"),))]["value"] == 2
    assert val[("specserve_prefix_cache_queries", (("replica", "t1"),))]["value"] == 50
    assert val[("specserve_prefix_cache_hits", (("replica", "t1"),))]["value"] == 20
    assert val[("specserve_num_preemptions", (("replica", "t1"),))]["value"] == 3
    # the ones vLLM has, again under vLLM's names and label: its dashboards read them unchanged
    vl = (("model_name", "SmolLM2-135M-Instruct"), ("replica", "t1"))
    assert val[("vllm:prefix_cache_queries", vl)]["value"] == 50
    assert val[("vllm:prefix_cache_hits", vl)]["value"] == 20
    assert val[("vllm:num_preemptions", vl)]["value"] == 3
    assert val[("vllm:num_requests_running", vl)]["value"] == 2
    assert val[("vllm:kv_cache_usage_perc", vl)]["kind"] == "gauge"
    assert val[("vllm:spec_decode_num_draft_tokens", (("model_name", "SmolLM2-135M-Instruct"),) + lab)]["value"] == 12
    text = render_prometheus(samples)
    assert 'vllm:prefix_cache_hits_total{model_name="SmolLM2-135M-Instruct",replica="t1"} 20' in text
    step = val[("specserve_target_step_seconds", (("replica", "t1"), ("tokens_per_step", "9-16")))]
    assert step["count"] == 1
    acc = val[("spec_decode_acceptance_length", lab)]
    assert acc["count"] == 1 and acc["sum"] == 3


# ------------------------------------------------------------------ engine hooks


def _engine(loaded, **kw) -> LLMEngine:
    conf = EngineConfig(
        max_num_seqs=4,
        max_model_len=128,
        num_speculative_tokens=3,
        max_num_batched_tokens=16,
        proposers=[{"name": "draft_model"}],
    )
    prop = DraftModelProposer(
        model=loaded.model, num_slots=4, max_model_len=128, target_vocab_size=loaded.model.config.vocab_size
    )
    return LLMEngine(conf, loaded, proposers={"draft_model": prop}, **kw)


def test_engine_records_step_events_only_when_asked(tiny_loaded, one_thread):
    verifies: list[tuple[str, int, int]] = []
    eng = _engine(tiny_loaded, on_verify=lambda p, d, a: verifies.append((p, d, a)))
    prompt = list(range(100, 140))  # 40 tokens: three prefill chunks of the 16-token budget
    params = {"max_tokens": 12, "ignore_eos": True}
    eng.add_request("traced", prompt, params, record_events=True)
    eng.add_request("plain", prompt, params, speculation="off")
    finals = {}
    while eng.has_work():
        for o in eng.step():
            if o.finished:
                finals[o.request_id] = o
    assert finals["plain"].events is None
    ev = finals["traced"].events
    kinds = [e.kind for e in ev]
    assert kinds[0] == "prefill" and "spec" in kinds
    assert kinds.count("prefill") >= 3  # 40 tokens in chunks of at most 16
    assert all(k != "prefill" for k in kinds[kinds.index("spec") :])  # prefill strictly first
    for e in ev:
        assert e.t_start_ns <= e.t_proposed_ns <= e.t_end_ns
        assert 0 <= e.num_accepted <= e.num_draft and (e.num_draft > 0) == (e.kind == "spec")
    spec = finals["traced"].spec
    assert sum(e.num_draft for e in ev) == spec.num_draft_tokens
    assert sum(e.num_accepted for e in ev) == spec.num_accepted_tokens
    # on_verify: once per speculative verify, over both requests, summing to the engine's stats
    st = eng.stats["draft_model"]
    assert len(verifies) == st.num_drafts
    assert sum(d for _, d, _ in verifies) == st.num_draft_tokens
    assert sum(a for _, _, a in verifies) == st.num_accepted_tokens
    assert eng._num_recording == 0


def test_engine_abort_releases_event_recording(tiny_loaded, one_thread):
    eng = _engine(tiny_loaded)
    eng.add_request("a", list(range(100, 120)), {"max_tokens": 8}, record_events=True)
    assert eng._num_recording == 1
    eng.step()
    out = eng.abort("a")
    assert out is not None and out.events is not None and eng._num_recording == 0


@pytest.mark.parametrize("tracing", ["console", "otlp"])
def test_span_exporters_from_config(tracing):
    cfg = TelemetryConfig(tracing=tracing, otlp_endpoint="http://127.0.0.1:9/v1/traces" if tracing == "otlp" else None)
    tel = Telemetry(cfg, "test", "r")
    assert tel.tracing and tel.finished_spans() == []  # only the memory exporter keeps spans
    tel.shutdown()


def test_yaml_off_is_tracing_off():
    assert TelemetryConfig.model_validate({"tracing": False}).tracing == "off"  # YAML 1.1 reads `off` as false
    with pytest.raises(ValueError):
        TelemetryConfig.model_validate({"tracing": "jaeger"})
    with pytest.raises(ValueError):
        TelemetryConfig.model_validate({"exporter": "otlp"})


def test_metrics_off_records_nothing_and_costs_no_reader():
    cfg = AppConfig.model_validate({"telemetry": {"metrics": False}})
    tt = TargetTelemetry(cfg, "t1", ["ngram"], snapshot=lambda: LoadSnapshot(running=2, waiting=1))
    tt.on_step(5, 0.01)
    tt.on_verify("ngram", 4, 3)
    assert tt.tel.reader is None and tt.tel.samples() == []
    assert render_prometheus([]) == "" or "spec_decode" not in render_prometheus([])
    on = _target_telemetry("off")
    on.on_verify("ngram", 4, 3)
    assert any(s["name"] == "spec_decode_num_draft_tokens" for s in on.tel.samples())
