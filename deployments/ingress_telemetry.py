"""The ingress's metrics and spans, and the cluster-wide scrape behind ``GET /metrics``.

Metrics (labelled ``replica``, the ingress replica): ``specserve_http_requests`` {route, status};
``specserve_route_fallbacks`` {reason} (requests served without the Router's answer);
``specserve_stream_resumes`` {reason} (requests resubmitted after their target replica failed);
histograms ``specserve_time_to_first_token_seconds``, ``specserve_inter_token_latency_seconds``
(per output token: the gap between two chunks over the tokens the later one carries) and
``specserve_e2e_request_latency_seconds``, all measured here, per request, as the client sees them.

Spans (tracing on): a server span per completion request (``POST /v1/chat/completions``), parent
taken from the incoming W3C ``traceparent``; a child "route" span (path, k, replica); the
server span's context goes to the target in the payload (``trace_context``), where the
target's spans hang under it.

One scrape: ``gather_cluster_samples`` collects the ingress's own samples, the Router's, every
target replica's (one call pinned to each replica id the Router has fresh load from) and the
draft worker's, and keeps one sample list per ``replica`` label.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Mapping

from opentelemetry import trace as trace_api
from opentelemetry.trace import Status, StatusCode
from starlette.responses import Response, StreamingResponse

from cluster.config import AppConfig
from cluster.telemetry import LATENCY_BUCKETS_S, Sample, Telemetry, dedupe_by_replica, extract, inject
from deployments.calls import within

log = logging.getLogger("ray.serve")


class IngressTelemetry:
    def __init__(self, cfg: AppConfig, replica_id: str) -> None:
        self.tel = Telemetry(cfg.telemetry, "ingress", replica_id)
        m = self.tel.meter
        self.http_requests = m.create_counter(
            "specserve_http_requests", description="HTTP requests answered, by route and status."
        )
        self.stream_resumes = m.create_counter(
            "specserve_stream_resumes",
            description="Requests submitted again after their target replica failed, "
            "with the tokens already sent, by the failure.",
        )
        self.route_fallbacks = m.create_counter(
            "specserve_route_fallbacks",
            description="Requests served without the Router's answer (it failed or was too slow), by reason.",
        )

        def hist(name: str, desc: str):
            return m.create_histogram(
                name, unit="s", explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S, description=desc
            )

        self.ttft = hist("specserve_time_to_first_token_seconds", "Request arrival to its first output token.")
        self.itl = hist("specserve_inter_token_latency_seconds", "Time per output token after the first.")
        self.e2e = hist("specserve_e2e_request_latency_seconds", "Request arrival to its last output token.")

    def on_resume(self, reason: str) -> None:
        self.stream_resumes.add(1, {"reason": reason})

    def on_route_fallback(self, reason: str) -> None:
        self.route_fallbacks.add(1, {"reason": reason})
        log.warning("Router unavailable (%s): serving without its choice of replica", reason)

    def count(self, route: str, status: int) -> None:
        self.http_requests.add(1, {"route": route, "status": str(status)})

    def request(self, headers: Mapping[str, str], method: str, route: str) -> RequestTelemetry:
        span = None
        if self.tel.tracer is not None:
            span = self.tel.tracer.start_span(
                f"{method} {route}",
                context=extract(headers),
                kind=trace_api.SpanKind.SERVER,
                attributes={"http.request.method": method, "http.route": route, "replica": self.tel.replica},
            )
        return RequestTelemetry(self, route, span)


class RequestTelemetry:
    """One completion request, observed from outside its path: the ingress hands it the response
    (``answer``), the Router's decision (``routed``) and every chunk (``on_chunk``, as each choice's
    observer), and tells it how a stream ended (``end``). Latency histograms, the request count, and
    the server span when tracing is on."""

    def __init__(self, owner: IngressTelemetry, route: str, span: Any | None) -> None:
        self.owner = owner
        self.route = route
        self.span = span
        self.t0 = time.monotonic()
        self.t_last: float | None = None
        self._ended = False

    # ------------------------------------------------------------------ the hooks the ingress calls

    async def answer(self, response: Awaitable[Response]) -> Response:
        """Await the route's response and count it (a client gone before it: 499). A streamed
        response's span ends with its stream (``end``), any other's here."""
        try:
            resp = await response
        except asyncio.CancelledError:  # client went away before the response started
            self.respond(499, streaming=False)
            raise
        self.respond(resp.status_code, streaming=isinstance(resp, StreamingResponse))
        return resp

    async def routed(self, decision: Awaitable[dict[str, Any]]) -> dict[str, Any]:
        """Await the Router's decision; with tracing on, a child "route" span covers the wait."""
        start_ns = time.time_ns()
        out = await decision
        self.on_route(out, start_ns)
        return out

    # ------------------------------------------------------------------ tracing (no-ops when off)

    def on_route(self, decision: Mapping[str, Any], start_ns: int) -> None:
        tracer = self.owner.tel.tracer
        if tracer is None or self.span is None:
            return
        s = tracer.start_span("route", context=trace_api.set_span_in_context(self.span), start_time=start_ns)
        s.set_attribute("path", str(decision.get("path")))
        s.set_attribute("k", -1 if decision.get("k") is None else int(decision["k"]))
        s.set_attribute("replica", str(decision.get("replica_id")))
        if decision.get("load_age_s") is not None:
            s.set_attribute("load_age_s", float(decision["load_age_s"]))
        s.end()

    def carrier(self) -> dict[str, str] | None:
        """W3C context of the server span, for the target (None when tracing is off)."""
        if self.span is None:
            return None
        return inject(trace_api.set_span_in_context(self.span))

    # ------------------------------------------------------------------ latency

    def on_chunk(self, chunk: Mapping[str, Any]) -> None:
        now = time.monotonic()
        n = len(chunk.get("token_ids") or ())
        if n:
            if self.t_last is None:
                self.owner.ttft.record(now - self.t0)
                n -= 1  # the first token's latency is the TTFT; the rest of its chunk came with it
                gap = 0.0
            else:
                gap = (now - self.t_last) / n
            for _ in range(n):
                self.owner.itl.record(gap)
            self.t_last = now
        if chunk.get("finished"):
            self.owner.e2e.record(now - self.t0)
            if self.span is not None:
                spec = chunk.get("spec") or {}
                self.span.set_attribute("finish_reason", str(chunk.get("finish_reason")))
                self.span.set_attribute("completion_tokens", int(chunk.get("num_output_tokens", 0)))
                self.span.set_attribute("num_draft_tokens", int(spec.get("num_draft_tokens", 0)))
                self.span.set_attribute("num_accepted_tokens", int(spec.get("num_accepted_tokens", 0)))

    def respond(self, status: int, streaming: bool) -> None:
        """The response is out: count it; a streamed one's span ends with its stream (``end``)."""
        self.owner.count(self.route, status)
        if not streaming:
            self.end(status)

    def end(self, status: int = 200, error: str | None = None) -> None:
        if self._ended or self.span is None:
            return
        self._ended = True
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500 or error:
            self.span.set_status(Status(StatusCode.ERROR, error or str(status)))
        self.span.end()


async def _bounded(aw: Awaitable[Any], timeout_s: float, what: str) -> Any:
    try:
        return await within(aw, timeout_s)
    except Exception as e:
        log.warning("metrics scrape: %s failed (%s)", what, type(e).__name__)
        return None


async def gather_cluster_samples(
    own: list[Sample], router: Any, target: Any, draft: Any | None, timeout_s: float = 5.0
) -> list[Sample]:
    """Every process's samples for one scrape. A replica that does not answer in ``timeout_s``
    is left out of this scrape (Prometheus sees a gap, not a hung scrape)."""
    router_samples, ids = await asyncio.gather(
        _bounded(router.metrics_samples.remote(), timeout_s, "router"),
        _bounded(router.replica_ids.remote(), timeout_s, "router replica ids"),
    )
    calls = [_bounded(target.metrics_samples.remote(replica_id=rid), timeout_s, f"target {rid}") for rid in ids or []]
    if draft is not None:
        calls.append(_bounded(draft.metrics_samples.remote(), timeout_s, "draft"))
    groups = await asyncio.gather(*calls)
    return dedupe_by_replica([own, router_samples or [], *[g or [] for g in groups]])
