"""The target replica's metrics and spans (the exporter side; the engine only fills stats objects).

Metrics (all labelled ``replica``; pulled at scrape time by ``samples()``):

- ``spec_decode_num_drafts`` / ``_num_draft_tokens`` / ``_num_accepted_tokens`` /
  ``_num_accepted_tokens_per_pos`` {proposer[, position]}: counters read from the engine's
  per-proposer ``SpecDecodeStats``, copied on the engine thread between steps at scrape time.
- ``specserve_step_decisions`` {path, k}: the policy's per-step decision for every decoding
  request, cumulative across live policy swaps.
- ``specserve_requests`` {finish_reason}: requests finished by this replica.
- ``specserve_prefix_cache_queries`` / ``_hits`` (prompt tokens, each request counted at its first
  admission only) and ``specserve_num_preemptions``: counters copied from the engine at scrape time.
- gauges ``specserve_num_requests_running`` / ``_waiting``, ``specserve_kv_tokens_in_use`` /
  ``_capacity`` and ``specserve_kv_cache_usage`` (their ratio) (the load snapshot the engine
  publishes after each step), and, with the draft
  worker configured, ``specserve_draft_worker_up`` and the counter ``specserve_draft_call_failures``.
- the ones vLLM has, again under vLLM's names (``vllm:prefix_cache_hits`` ...; ``VLLM_ALIASES``).
- histograms ``specserve_target_step_seconds`` {tokens_per_step}, ``specserve_draft_call_seconds``,
  ``spec_decode_acceptance_length`` {proposer} (tokens committed by one verify: accepted + 1).

Spans (only when tracing is on and the ingress passed a sampled trace context): one
"TargetWorker.generate" span per request, child of the ingress's server span, with children
from the engine's per-step events: "prefill" (its chunks), "spec_step" (draft / accepted counts,
draft and verify times) and "plain_steps" (consecutive plain steps as one span with a count).
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, Callable, Mapping, Sequence

from opentelemetry import trace as trace_api
from opentelemetry.metrics import CallbackOptions, Observation

from cluster.config import AppConfig
from cluster.telemetry import STEP_BUCKETS_S, Sample, Telemetry, extract, tokens_bucket, with_vllm_aliases
from workers.request import StepEvent
from workers.stats import LoadSnapshot


class TargetTelemetry:
    def __init__(
        self,
        cfg: AppConfig,
        replica_id: str,
        proposer_names: Sequence[str],
        snapshot: Callable[[], LoadSnapshot],
        draft_proxy: Any | None = None,  # RemoteDraftProposer: .up, .num_failures
    ) -> None:
        self.tel = Telemetry(cfg.telemetry, "target", replica_id)
        self.model_name = cfg.engine.served_model_name
        self.proposer_names = list(proposer_names)
        self._snapshot = snapshot
        self._draft = draft_proxy
        self.decisions: collections.Counter[int] = collections.Counter()  # K -> count; engine thread only
        self._view: dict[str, Any] = {"stats": {}, "decisions": {}}  # engine-thread copy, taken per scrape
        m = self.tel.meter

        def counter(name: str, fn: Callable[[], list[Observation]], description: str) -> None:
            m.create_observable_counter(name, callbacks=[lambda _o: fn()], description=description)

        counter(
            "spec_decode_num_drafts",
            lambda: self._spec("num_drafts"),
            "Speculative verifies (one per request per spec step).",
        )
        counter(
            "spec_decode_num_draft_tokens",
            lambda: self._spec("num_draft_tokens"),
            "Draft tokens proposed and verified.",
        )
        counter(
            "spec_decode_num_accepted_tokens",
            lambda: self._spec("num_accepted_tokens"),
            "Draft tokens accepted (the recovered / bonus token not counted).",
        )
        counter("spec_decode_num_accepted_tokens_per_pos", self._per_pos, "Accepted draft tokens by draft position.")
        counter(
            "specserve_step_decisions",
            self._decisions,
            "Per-step policy decisions for decoding requests, by path and K.",
        )
        counter(
            "specserve_prefix_cache_queries",
            lambda: [Observation(self._view.get("prefix", (0, 0))[0])],
            "Prompt tokens admitted with prefix caching on (vLLM: prefix_cache_queries).",
        )
        counter(
            "specserve_prefix_cache_hits",
            lambda: [Observation(self._view.get("prefix", (0, 0))[1])],
            "Of those, tokens whose KV was reused instead of prefilled (vLLM: prefix_cache_hits).",
        )
        counter(
            "specserve_num_preemptions",
            lambda: [Observation(self._view.get("preemptions", 0))],
            "Requests whose KV blocks were taken back, to be recomputed later (vLLM: num_preemptions).",
        )
        self.requests = m.create_counter("specserve_requests", description="Requests finished, by finish reason.")
        for name, attr, desc in (
            ("specserve_num_requests_running", "running", "Requests holding a KV slot."),
            ("specserve_num_requests_waiting", "waiting", "Requests waiting for KV blocks."),
            ("specserve_kv_tokens_in_use", "kv_tokens_in_use", "KV cache tokens in use."),
            ("specserve_kv_tokens_capacity", "kv_tokens_capacity", "KV cache tokens in the block pool."),
        ):
            m.create_observable_gauge(name, callbacks=[self._gauge(attr)], description=desc)
        m.create_observable_gauge(
            "specserve_kv_cache_usage",
            callbacks=[lambda _o: [Observation(self._kv_usage())]],
            description="Share of the KV block pool held by requests, 0 to 1 (vLLM: kv_cache_usage_perc).",
        )
        if draft_proxy is not None:
            m.create_observable_gauge(
                "specserve_draft_worker_up",
                callbacks=[lambda _o: [Observation(1 if self._draft.up else 0)]],
                description="1 while the last draft worker call succeeded, 0 while backing off after a failure.",
            )
            counter(
                "specserve_draft_call_failures",
                lambda: [Observation(self._draft.num_failures)],
                "Draft worker calls that failed or timed out (those steps ran plain).",
            )
        self.step_seconds = m.create_histogram(
            "specserve_target_step_seconds",
            unit="s",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S,
            description="Target engine step wall time, by tokens fed in the step.",
        )
        self.draft_call_seconds = m.create_histogram(
            "specserve_draft_call_seconds",
            unit="s",
            explicit_bucket_boundaries_advisory=STEP_BUCKETS_S,
            description="Wall time of one batched draft worker call.",
        )
        k_max = max(1, cfg.engine.num_speculative_tokens)
        self.acceptance_length = m.create_histogram(
            "spec_decode_acceptance_length",
            explicit_bucket_boundaries_advisory=[float(i) for i in range(1, k_max + 2)],
            description="Tokens committed by one speculative verify (accepted drafts + 1).",
        )
        self._bucket_attrs = {b: {"tokens_per_step": b} for b in map(tokens_bucket, (1, 2, 5, 9, 17, 33, 65, 129, 257))}
        self._proposer_attrs = {p: {"proposer": p} for p in self.proposer_names}

    # ------------------------------------------------------------------ engine thread hooks (cheap)

    def count_decisions(self, ks: Sequence[int]) -> None:
        for k in ks:
            self.decisions[k] += 1

    def on_step(self, tokens: int, seconds: float) -> None:
        self.step_seconds.record(seconds, self._bucket_attrs[tokens_bucket(tokens)])

    def on_verify(self, proposer: str, num_draft: int, num_accepted: int) -> None:
        attrs = self._proposer_attrs.get(proposer) or {"proposer": proposer}
        self.acceptance_length.record(num_accepted + 1, attrs)

    def on_draft_call(self, seconds: float) -> None:
        self.draft_call_seconds.record(seconds)

    def engine_view(self, engine: Any) -> dict[str, Any]:
        """Run on the engine thread (between steps): a consistent copy of what the counters read."""
        return {
            "stats": {
                name: (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos))
                for name, s in engine.stats.items()
            },
            "decisions": dict(self.decisions),
            "prefix": (engine.prefix_cache_queries, engine.prefix_cache_hits),
            "preemptions": engine.num_preemptions,
        }

    # ------------------------------------------------------------------ scrape

    async def samples(self, call_engine: Callable[..., Any], timeout_s: float = 5.0) -> list[Sample]:
        """Copy the engine's counters (between two steps), then collect. A dead or wedged engine
        keeps the last copy, so a scrape never hangs on it."""
        try:
            self._view = await asyncio.wait_for(call_engine(self.engine_view), timeout_s)
        except Exception:
            pass
        return with_vllm_aliases(self.tel.samples(), self.model_name)

    def _spec(self, field: str) -> list[Observation]:
        idx = {"num_drafts": 0, "num_draft_tokens": 1, "num_accepted_tokens": 2}[field]
        stats = self._view["stats"]
        names = list(dict.fromkeys(self.proposer_names + list(stats)))
        return [Observation(stats[p][idx] if p in stats else 0, {"proposer": p}) for p in names]

    def _per_pos(self) -> list[Observation]:
        return [
            Observation(n, {"proposer": p, "position": str(i)})
            for p, st in self._view["stats"].items()
            for i, n in enumerate(st[3])
        ]

    def _decisions(self) -> list[Observation]:
        return [
            Observation(n, {"path": "spec" if k > 0 else "plain", "k": str(k)})
            for k, n in sorted(self._view["decisions"].items())
        ]

    def _kv_usage(self) -> float:
        s = self._snapshot()
        return s.kv_tokens_in_use / s.kv_tokens_capacity if s.kv_tokens_capacity else 0.0

    def _gauge(self, attr: str) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _o: [Observation(getattr(self._snapshot(), attr))]

    # ------------------------------------------------------------------ traces

    def trace_parent(self, carrier: Mapping[str, str] | None) -> Any | None:
        """The context to parent this request's spans on, or None (tracing off / not sampled)."""
        if self.tel.tracer is None or not carrier:
            return None
        ctx = extract(carrier)
        sc = trace_api.get_current_span(ctx).get_span_context()
        return ctx if sc.is_valid and sc.trace_flags.sampled else None

    def emit_request_spans(
        self, parent: Any, start_ns: int, end_ns: int, events: Sequence[StepEvent] | None, attributes: dict[str, Any]
    ) -> None:
        tracer = self.tel.tracer
        if tracer is None:
            return
        root = tracer.start_span(
            "TargetWorker.generate",
            context=parent,
            kind=trace_api.SpanKind.SERVER,
            start_time=start_ns,
            attributes={"replica": self.tel.replica, **attributes},
        )
        ctx = trace_api.set_span_in_context(root)
        proposer = attributes.get("proposer") or ""
        ev = list(events or [])
        i = 0
        while i < len(ev):
            e = ev[i]
            if e.kind == "spec":
                s = tracer.start_span(
                    "spec_step",
                    context=ctx,
                    start_time=e.t_start_ns,
                    attributes={
                        "num_draft_tokens": e.num_draft,
                        "num_accepted_tokens": e.num_accepted,
                        "proposer": proposer,
                        "draft_s": (e.t_proposed_ns - e.t_start_ns) / 1e9,
                        "verify_s": (e.t_end_ns - e.t_proposed_ns) / 1e9,
                    },
                )
                s.end(end_time=e.t_end_ns)
                i += 1
                continue
            j = i
            while j + 1 < len(ev) and ev[j + 1].kind == e.kind:
                j += 1
            name = "prefill" if e.kind == "prefill" else "plain_steps"
            s = tracer.start_span(name, context=ctx, start_time=e.t_start_ns, attributes={"steps": j - i + 1})
            s.end(end_time=ev[j].t_end_ns)
            i = j + 1
        root.end(end_time=end_ns)
