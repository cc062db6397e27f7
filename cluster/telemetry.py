"""OpenTelemetry setup for one process (one Serve replica), and the plain-data side of metrics.

Metrics: every replica owns a ``MeterProvider`` with an ``InMemoryMetricReader``. Nothing is
pushed; ``Telemetry.samples()`` collects (running the observable callbacks) at scrape time,
so a scrape sees exact cumulative values with no export lag. Samples are plain dicts, so they
travel over Ray to the ingress, which renders the whole cluster's with ``render_prometheus``:

    {"name", "kind": "counter" | "gauge" | "histogram", "description", "labels": {...},
     "value"}                                    # counter, gauge
     "bounds": [b0..], "buckets": [n0..nB], "sum", "count"}   # histogram (buckets not cumulative,
                                                               #  len(bounds) + 1, the last is +Inf)

Every sample carries a ``replica`` label (the Serve replica id of the process that made it).

Traces: a ``TracerProvider`` of our own (never the global one: Ray's processes have their own
OTel users) when ``telemetry.tracing`` is not "off"; with "off" there is no tracer at all and
callers skip every span and per-step event (zero cost). W3C ``traceparent`` travels in plain
dict carriers (``extract`` / ``inject``).

Names follow vLLM's spec_decode metrics (``spec_decode_num_drafts`` ...); the stats objects that
feed them (workers/stats.py) know nothing about OTel. The metrics vLLM also has are exported a second
time under vLLM's own names (``vllm:prefix_cache_hits`` ..., labelled ``model_name`` as vLLM's are;
see ``VLLM_ALIASES``), so a dashboard or alert written for vLLM reads this service unchanged.
"""

from __future__ import annotations

import collections
import math
import re
from typing import Any, Iterable, Mapping

from opentelemetry import trace as trace_api
from opentelemetry.context import Context
from opentelemetry.metrics import NoOpMeterProvider
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import Gauge, Histogram, InMemoryMetricReader, MetricsData, Sum
from opentelemetry.sdk.resources import Resource
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from cluster.config import TelemetryConfig
from workers.stats import SpecDecodeStats

Sample = dict[str, Any]

# Histogram bounds (seconds). Latencies span a 20 ms CPU step to minutes-long requests.
LATENCY_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)

_PROPAGATOR = TraceContextTextMapPropagator()


def tokens_bucket(n: int) -> str:
    """Label for a step's token count: "1", "2-4", "5-8", ... "129-256", "257+" (power-of-two ranges)."""
    if n <= 1:
        return "1"
    hi = 4
    while hi < n and hi < 256:
        hi *= 2
    if n > 256:
        return "257+"
    lo = 2 if hi == 4 else hi // 2 + 1
    return f"{lo}-{hi}"


# ---------------------------------------------------------------------------- samples

# Our metric -> vLLM's name for the same quantity (same unit and meaning). OTel instrument names
# cannot hold ':', so the aliases are added to the plain samples (``with_vllm_aliases``).
VLLM_ALIASES = {
    "specserve_num_requests_running": "vllm:num_requests_running",
    "specserve_num_requests_waiting": "vllm:num_requests_waiting",
    "specserve_kv_cache_usage": "vllm:kv_cache_usage_perc",  # a fraction 0..1, as vLLM's despite the name
    "specserve_prefix_cache_queries": "vllm:prefix_cache_queries",  # tokens
    "specserve_prefix_cache_hits": "vllm:prefix_cache_hits",  # tokens
    "specserve_num_preemptions": "vllm:num_preemptions",
    "spec_decode_num_drafts": "vllm:spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos",
}


def with_vllm_aliases(samples: list[Sample], model_name: str) -> list[Sample]:
    """``samples`` and, for each that vLLM has a name for, a copy under that name with vLLM's
    ``model_name`` label added."""
    out = list(samples)
    for s in samples:
        alias = VLLM_ALIASES.get(s["name"])
        if alias is not None:
            out.append({**s, "name": alias, "labels": {**s.get("labels", {}), "model_name": model_name}})
    return out


def metrics_to_samples(data: MetricsData | None, extra_labels: Mapping[str, str] | None = None) -> list[Sample]:
    """Flatten ``InMemoryMetricReader.get_metrics_data()`` into plain sample dicts."""
    out: list[Sample] = []
    if data is None:
        return out
    extra = dict(extra_labels or {})
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                d = m.data
                if isinstance(d, Histogram):
                    for p in d.data_points:
                        out.append(
                            {
                                "name": m.name,
                                "kind": "histogram",
                                "description": m.description or "",
                                "labels": {**_labels(p.attributes), **extra},
                                "bounds": [float(b) for b in p.explicit_bounds],
                                "buckets": [int(c) for c in p.bucket_counts],
                                "sum": float(p.sum),
                                "count": int(p.count),
                            }
                        )
                elif isinstance(d, (Sum, Gauge)):
                    kind = "counter" if isinstance(d, Sum) and d.is_monotonic else "gauge"
                    for p in d.data_points:
                        out.append(
                            {
                                "name": m.name,
                                "kind": kind,
                                "description": m.description or "",
                                "labels": {**_labels(p.attributes), **extra},
                                "value": p.value,
                            }
                        )
    return out


def _labels(attrs: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (attrs or {}).items()}


_NAME_BAD = re.compile(r"[^a-zA-Z0-9_:]")
_LABEL_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(name: str) -> str:
    name = _NAME_BAD.sub("_", name)
    return "_" + name if name[:1].isdigit() else name


def _label_name(name: str) -> str:
    name = _LABEL_BAD.sub("_", name)
    return "_" + name if name[:1].isdigit() else name


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _num(v: float | int) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _label_str(labels: Mapping[str, str], extra: tuple[str, str] | None = None) -> str:
    items = [(_label_name(k), str(v)) for k, v in sorted(labels.items())]
    if extra is not None:
        items.append(extra)
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in items) + "}"


def render_prometheus(samples: Iterable[Sample]) -> str:
    """Prometheus text exposition (format 0.0.4) of plain samples.

    Counters are exposed as ``<name>_total``; histograms as cumulative ``_bucket{le=...}``
    series ending at ``le="+Inf"``, then ``_sum`` and ``_count``. ``# HELP`` / ``# TYPE``
    appear once per metric name, with all of that name's samples under them.
    """
    groups: dict[str, list[Sample]] = collections.OrderedDict()
    for s in samples:
        groups.setdefault(s["name"], []).append(s)
    lines: list[str] = []
    for name, group in groups.items():
        kind = group[0]["kind"]
        base = _metric_name(name)
        family = base if kind != "counter" or base.endswith("_total") else base + "_total"
        desc = next((s.get("description") for s in group if s.get("description")), "") or name
        lines.append(f"# HELP {family} {_escape_help(desc)}")
        lines.append(f"# TYPE {family} {kind}")
        for s in group:
            if s["kind"] != kind:  # one name, one type: a clash is dropped rather than emitted invalid
                continue
            labels = s.get("labels", {})
            if kind == "histogram":
                cum = 0
                for bound, n in zip(list(s["bounds"]) + [math.inf], s["buckets"]):
                    cum += n
                    lines.append(f"{base}_bucket{_label_str(labels, ('le', _num(float(bound))))} {cum}")
                lines.append(f"{base}_sum{_label_str(labels)} {_num(s['sum'])}")
                lines.append(f"{base}_count{_label_str(labels)} {_num(s['count'])}")
            else:
                lines.append(f"{family}{_label_str(labels)} {_num(s['value'])}")
    return "\n".join(lines) + "\n" if lines else ""


def spec_decode_summary(samples: Iterable[Sample]) -> dict[str, dict[str, Any]]:
    """Per proposer, the spec_decode counters summed over every replica in ``samples``,
    with acceptance rate (accepted / draft tokens, 0 when nothing was drafted) and mean
    acceptance length (1 + accepted / drafts, 1 when there were no drafts)."""
    agg: dict[str, SpecDecodeStats] = collections.defaultdict(SpecDecodeStats)
    for s in samples:
        name, labels = s["name"], s.get("labels", {})
        proposer = labels.get("proposer")
        if proposer is None or s["kind"] != "counter" or not name.startswith("spec_decode_"):
            continue
        st, v = agg[proposer], int(s["value"])
        if name == "spec_decode_num_drafts":
            st.num_drafts += v
        elif name == "spec_decode_num_draft_tokens":
            st.num_draft_tokens += v
        elif name == "spec_decode_num_accepted_tokens":
            st.num_accepted_tokens += v
        elif name == "spec_decode_num_accepted_tokens_per_pos":
            pos = int(labels.get("position", 0))
            if len(st.accepted_per_pos) <= pos:
                st.accepted_per_pos.extend([0] * (pos + 1 - len(st.accepted_per_pos)))
            st.accepted_per_pos[pos] += v
    keep = (
        "num_drafts",
        "num_draft_tokens",
        "num_accepted_tokens",
        "accepted_per_pos",
        "acceptance_rate",
        "mean_acceptance_length",
    )
    return {p: {k: v for k, v in st.as_dict().items() if k in keep} for p, st in sorted(agg.items())}


# ---------------------------------------------------------------------------- tracing helpers


def extract(carrier: Mapping[str, str] | None) -> Context:
    """The W3C trace context in ``carrier`` (HTTP headers or a dict from ``inject``); empty if none."""
    return _PROPAGATOR.extract(dict(carrier or {}))


def inject(ctx: Context) -> dict[str, str]:
    """A plain dict carrying ``ctx`` as ``traceparent`` (and ``tracestate``), to pass over Ray."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=ctx)
    return carrier


def span_dict(span: Any) -> dict[str, Any]:
    """A finished span as a plain dict (``debug_spans``)."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_span_id": format(parent.span_id, "016x") if parent is not None else None,
        "kind": span.kind.name,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "attributes": dict(span.attributes or {}),
        "status": span.status.status_code.name,
    }


# ---------------------------------------------------------------------------- per-process setup


class Telemetry:
    """One process's meter (pull) and, when tracing is on, its tracer."""

    def __init__(self, config: TelemetryConfig, component: str, replica: str) -> None:
        self.config = config
        self.replica = replica
        resource = Resource.create(
            {
                "service.name": config.service_name,
                "service.instance.id": replica,
                "specserve.component": component,
            }
        )
        self.reader: InMemoryMetricReader | None = None
        self.meter_provider: MeterProvider | None = None
        if config.metrics:
            self.reader = InMemoryMetricReader()
            self.meter_provider = MeterProvider(metric_readers=[self.reader], resource=resource, shutdown_on_exit=False)
            self.meter = self.meter_provider.get_meter("specserve")
        else:  # instruments exist (callers need no branches) but record nothing and cost ~nothing
            self.meter = NoOpMeterProvider().get_meter("specserve")
        self.tracer: trace_api.Tracer | None = None
        self._memory = None
        self._tracer_provider = None
        if config.tracing != "off":
            self._setup_tracing(config, resource)

    def _setup_tracing(self, config: TelemetryConfig, resource: Resource) -> None:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        if config.tracing == "memory":
            from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

            self._memory = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(self._memory))
        elif config.tracing == "console":
            provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        else:  # otlp
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint) if config.otlp_endpoint else OTLPSpanExporter()
            provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer_provider = provider
        self.tracer = provider.get_tracer("specserve")

    @property
    def tracing(self) -> bool:
        return self.tracer is not None

    def samples(self) -> list[Sample]:
        """Collect now (observable callbacks run here) and flatten, labelled with this replica."""
        if self.reader is None:
            return []
        return metrics_to_samples(self.reader.get_metrics_data(), {"replica": self.replica})

    def finished_spans(self) -> list[dict[str, Any]]:
        """Spans kept by the 'memory' exporter (empty for any other exporter)."""
        if self._memory is None:
            return []
        return [span_dict(s) for s in self._memory.get_finished_spans()]

    def shutdown(self) -> None:
        try:
            if self.meter_provider is not None:
                self.meter_provider.shutdown()
            if self._tracer_provider is not None:
                self._tracer_provider.shutdown()
        except Exception:
            pass


def dedupe_by_replica(groups: Iterable[list[Sample]]) -> list[Sample]:
    """Concatenate per-replica sample lists, keeping only the first list seen for each replica
    (a call pinned to a replica that is gone lands on another one, which is then seen twice)."""
    seen: set[str] = set()
    out: list[Sample] = []
    for g in groups:
        if not g:
            continue
        rids = {s.get("labels", {}).get("replica", "") for s in g}
        if rids & seen:
            continue
        seen |= rids
        out.extend(g)
    return out
