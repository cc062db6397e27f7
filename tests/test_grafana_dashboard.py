"""docs/grafana/specserve.json queries only metrics the project exports, and shows all of them.

The names the code declares are read by building each process's telemetry (the ingress's, a target
replica's, the Router's and the draft worker's) on a meter that records every instrument created,
then turned into the names ``cluster.telemetry.render_prometheus`` exposes (``_total`` for counters,
``_bucket`` / ``_sum`` / ``_count`` for histograms). tests/test_observability_e2e.py checks the same
dashboard against a live cluster's ``GET /metrics``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "specserve.json"
_NAME = re.compile(r"\b((?:spec_decode|specserve)_[A-Za-z0-9_]+)\b")
# Counters created on their first event: absent from a scrape until something happened (the e2e check
# allows them; the check against the code below does not).
EVENT_ONLY = frozenset({"specserve_route_fallbacks_total", "specserve_stream_resumes_total"})


def _panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for p in panels:
        out.append(p)
        out += _panels(p.get("panels", []))  # a collapsed row holds its panels
    return out


def dashboard_queries(path: Path = DASHBOARD) -> list[str]:
    """Every PromQL expression of the dashboard (panel targets and query variables)."""
    dash = json.loads(path.read_text())
    exprs = [t["expr"] for p in _panels(dash["panels"]) for t in p.get("targets", [])]
    exprs += [v["query"] for v in dash.get("templating", {}).get("list", []) if v.get("type") == "query"]
    return exprs


def dashboard_metric_names(path: Path = DASHBOARD) -> set[str]:
    """The project's metric names (as exposed to Prometheus) that the dashboard queries."""
    return {m for e in dashboard_queries(path) for m in _NAME.findall(e)}


# ---------------------------------------------------------------------------- names declared in code


class _Instrument:
    def add(self, *a: Any, **k: Any) -> None: ...
    def record(self, *a: Any, **k: Any) -> None: ...
    def set(self, *a: Any, **k: Any) -> None: ...


class _RecordingMeter:
    """Stands in for an OpenTelemetry meter: remembers each instrument's name and Prometheus type
    (as ``cluster.telemetry.metrics_to_samples`` maps them: a monotonic sum is a counter, any other
    sum or gauge a gauge)."""

    KINDS: ClassVar[dict[str, str]] = {
        "create_counter": "counter",
        "create_observable_counter": "counter",
        "create_histogram": "histogram",
        "create_gauge": "gauge",
        "create_observable_gauge": "gauge",
        "create_up_down_counter": "gauge",
        "create_observable_up_down_counter": "gauge",
    }

    def __init__(self) -> None:
        self.kinds: dict[str, str] = {}

    def __getattr__(self, attr: str) -> Any:
        kind = self.KINDS.get(attr)
        if kind is None:
            raise AttributeError(attr)

        def create(name: str, *a: Any, **k: Any) -> _Instrument:
            self.kinds[name] = kind
            return _Instrument()

        return create


def declared_metrics(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Metric name -> Prometheus type, for every instrument the four kinds of process create."""
    from ray import serve

    import deployments.draft as draft_mod
    import deployments.ingress_telemetry as ingress_mod
    import deployments.router as router_mod
    import deployments.target_telemetry as target_mod
    from cluster.config import AppConfig

    meter = _RecordingMeter()

    class FakeTelemetry:
        def __init__(self, config: Any, component: str, replica: str) -> None:
            self.config, self.replica, self.meter, self.tracer = config, replica, meter, None

    for mod in (ingress_mod, target_mod, router_mod, draft_mod):
        monkeypatch.setattr(mod, "Telemetry", FakeTelemetry)
    monkeypatch.setattr(serve, "get_replica_context", lambda: None)
    cfg = AppConfig()
    ingress_mod.IngressTelemetry(cfg, "ingress")
    target_mod.TargetTelemetry(cfg, "target", ["ngram"], snapshot=lambda: None, draft_proxy=object())
    router_mod.Router.func_or_class(cfg.model_dump(mode="json"))
    worker = object.__new__(draft_mod.DraftWorker.func_or_class)
    worker._init_metrics(cfg)
    return meter.kinds


def exposed_names(kinds: dict[str, str]) -> set[str]:
    """The sample names ``render_prometheus`` writes for these metrics."""
    out: set[str] = set()
    for name, kind in kinds.items():
        if kind == "counter":
            out.add(name if name.endswith("_total") else name + "_total")
        elif kind == "histogram":
            out |= {name + "_bucket", name + "_sum", name + "_count"}
        else:
            out.add(name)
    return out


@pytest.fixture(scope="module")
def declared() -> dict[str, str]:
    with pytest.MonkeyPatch.context() as mp:
        return declared_metrics(mp)


def test_the_recording_meter_sees_every_process(declared):
    # one known metric of each process: a missed constructor would silently shrink the set
    for name in (
        "specserve_http_requests",
        "spec_decode_num_draft_tokens",
        "specserve_route_decisions",
        "specserve_draft_calls",
    ):
        assert name in declared, name
    assert declared["specserve_target_step_seconds"] == "histogram"
    assert declared["specserve_num_requests_running"] == "gauge"
    assert EVENT_ONLY <= exposed_names(declared)


def test_dashboard_queries_only_exported_metrics(declared):
    unknown = dashboard_metric_names() - exposed_names(declared)
    assert not unknown, f"docs/grafana/specserve.json queries metrics no process exports: {sorted(unknown)}"


def test_dashboard_shows_every_exported_metric(declared):
    queried = dashboard_metric_names()
    unshown = sorted(n for n, kind in declared.items() if not any(e in queried for e in exposed_names({n: kind})))
    assert not unshown, f"metrics with no panel in docs/grafana/specserve.json: {unshown}"


def test_dashboard_is_an_importable_grafana_dashboard():
    dash = json.loads(DASHBOARD.read_text())
    panels = _panels(dash["panels"])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    assert any(v["type"] == "datasource" and v["name"] == "datasource" for v in dash["templating"]["list"])
    for p in panels:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"] and all(t["refId"] and t["expr"] for t in p["targets"]), p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), (p["title"], t["expr"])
