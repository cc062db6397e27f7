"""Target worker: a Serve replica that runs the engine loop (plain and speculative steps).

It pushes its live load to the Router every ``report_interval_s`` and takes the current
routing policy back in the answer, so a ``serve deploy`` that changes the Router's
``user_config`` reaches every engine without restarting it. n-gram and suffix proposers
run here; the draft model is a batched RPC to the draft worker (deployments/draft.py).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from cluster.config import DRAFT_WORKER_PROPOSERS, AppConfig
from deployments.calls import within
from deployments.target_telemetry import TargetTelemetry
from policies.registry import make_policy
from workers.cost_model import StepCostModel
from workers.errors import InvalidRequestError
from workers.request import RequestOutput

if TYPE_CHECKING:
    from workers.engine import LLMEngine
    from workers.proposers.base import Proposer

log = logging.getLogger("ray.serve")

TRACE_STEPS = 4096  # engine steps policy_trace keeps


def output_dict(o: RequestOutput, fingerprint: str | None = None, replica_id: str | None = None) -> dict[str, Any]:
    return {
        "system_fingerprint": fingerprint,
        "replica_id": replica_id,  # which replica wrote it: a resubmission after its death avoids it
        "seed": o.seed,  # the request's noise seed (drawn here if it gave none): a resubmission continues with it
        "text": o.text,
        "token_ids": o.token_ids,
        "finished": o.finished,
        "finish_reason": o.finish_reason,
        "num_prompt_tokens": o.num_prompt_tokens,
        "num_output_tokens": o.num_output_tokens,
        "num_cached_tokens": o.num_cached_tokens,
        "proposer": o.proposer,
        "spec": o.spec.as_dict(),
        "logprobs": None
        if o.logprobs is None
        else [[e.token_id, e.logprob, [list(t) for t in e.top]] for e in o.logprobs],
        # the first prompt token has nothing before it: its entry is None
        "prompt_logprobs": None
        if o.prompt_logprobs is None
        else [None if e is None else [e.token_id, e.logprob, [list(t) for t in e.top]] for e in o.prompt_logprobs],
    }


@serve.deployment(name="TargetWorker")
class TargetWorker:
    def __init__(self, app_config: dict, router: DeploymentHandle, draft: DeploymentHandle | None) -> None:
        # The engine's modules (torch, transformers) load here, in the replica: `serve deploy` imports this
        # module only to build the app graph, and that build then takes a second instead of several.
        from deployments.remote_draft import RemoteDraftProposer, RemoteEagleProposer
        from workers.async_engine import AsyncEngine
        from workers.engine import LLMEngine
        from workers.model_loader import load_model
        from workers.proposers.registry import make_proposer

        cfg = AppConfig.model_validate(app_config)
        self.cfg = cfg
        proposers: dict[str, Proposer] = {}
        for p in cfg.engine.proposers:
            if p.name in DRAFT_WORKER_PROPOSERS:
                if draft is not None:
                    remote = RemoteEagleProposer if p.name == "eagle" else RemoteDraftProposer
                    proposers[p.name] = remote(  # handle calls on this replica's loop (deployments/remote_draft.py)
                        draft,
                        timeout_s=cfg.draft.call_timeout_s,
                        retry_after_s=cfg.draft.retry_after_s,
                        loop=asyncio.get_running_loop(),
                    )
            else:
                proposers[p.name] = make_proposer(p.name, **p.options)
        self.policy_version = -1
        # Step cost belongs to this replica's hardware, not to a policy: the engine measures every step
        # into it and its scheduler sizes prompt chunks from it; each policy that predicts from it
        # (goodput) gets the same model, so a live swap keeps what was learned.
        self.step_costs = StepCostModel()
        self.policy = self._make_policy({"name": "goodput"})
        # The last steps' decisions and costs, for `policy_trace` (debugging a policy on live load).
        self._trace: collections.deque[dict[str, Any]] = collections.deque(maxlen=TRACE_STEPS)
        self._pending_ks: list[int] = []
        self._pending_why: dict[str, Any] = {}  # the policy's step_detail() for the step in flight
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id if ctx is not None else f"local-{os.getpid()}"
        self._fp: str | None = None  # system_fingerprint, computed once the engine has started
        draft_proxy = proposers.get("draft_model")
        self.telemetry = TargetTelemetry(
            cfg, self.replica_id, list(proposers), snapshot=lambda: self.engine.snapshot(), draft_proxy=draft_proxy
        )
        if isinstance(draft_proxy, RemoteDraftProposer):
            draft_proxy.on_call = self.telemetry.on_draft_call
        self.engine = AsyncEngine(
            lambda: LLMEngine(  # built in the engine thread: see AsyncEngine
                cfg.engine,
                load_model(cfg.engine.model),
                proposers=proposers,
                decide=self._decide,
                on_step=self._on_step,
                on_verify=self.telemetry.on_verify,
                cost_model=self.step_costs,
            ),
            claim_cpu=cfg.engine.cpu_priority == "engine_first",
        )
        self.router = router
        self._reporter = asyncio.get_event_loop().create_task(self._report_loop())

    def _make_policy(self, config: dict[str, Any]):
        policy = make_policy(config)
        if hasattr(policy, "use_cost_model"):
            policy.use_cost_model(self.step_costs)
        return policy

    # The engine thread calls this every step; it reads ``self.policy`` (swapped atomically).
    def _decide(self, snapshot, candidates):
        ks = self.policy.decide(snapshot, candidates)
        self.telemetry.count_decisions(ks)  # cumulative across policy swaps (a policy's own count resets)
        self._pending_ks = list(ks)
        self._pending_why = self.policy.step_detail()
        return ks

    def _on_step(self, tokens: int, seconds: float, requests: int | None = None) -> None:  # engine thread
        self.policy.observe_step(tokens, seconds, requests)
        self.telemetry.on_step(tokens, seconds)
        self._trace.append(
            {
                "ks": self._pending_ks,
                "tokens": tokens,
                "seconds": seconds,
                "requests": requests,
                "why": self._pending_why,
            }
        )
        self._pending_ks, self._pending_why = [], {}

    async def _report_loop(self) -> None:
        """Push this replica's load to the Router when it changes (requests running / waiting /
        decoding / handed to the engine), and at least every ``router.heartbeat_s``. Why not every interval: on a small
        machine each report is a Ray call in this process and in the Router, and any CPU work beside
        the engine's threads stretches its steps; a steady load need not be re-sent 20 times a second."""
        interval = self.cfg.router.report_interval_s
        last_key: tuple | None = None
        last_sent = 0.0
        while True:
            try:
                if not self.engine.healthy(stall_s=self.cfg.router.stale_after_s * 5):
                    # A dead or wedged loop stops reporting: the Router drops this replica as stale
                    # (no new requests, /health 503 when it was the last) before Serve replaces it.
                    await asyncio.sleep(interval)
                    continue
                snap = self.engine.snapshot()
                key = (snap.running, snap.waiting, snap.decoding, snap.handed)
                if key == last_key and time.monotonic() - last_sent < self.cfg.router.heartbeat_s:
                    await asyncio.sleep(interval)
                    continue
                last_key, last_sent = key, time.monotonic()
                answer = await self.router.report.remote(self.replica_id, snap.as_dict(), self.policy_version)
                if answer:
                    self._apply_policy(answer)
            except asyncio.CancelledError:
                raise
            except Exception:  # the router restarting must not take the engine down
                log.warning("load report to the router failed", exc_info=True)
            await asyncio.sleep(interval)

    def _apply_policy(self, answer: dict[str, Any]) -> None:
        if answer.get("version", -1) != self.policy_version:  # != : a restarted Router counts from 0 again
            self.policy = self._make_policy(answer["policy"])
            self.policy_version = answer["version"]

    async def _catch_up_policy(self, version: int | None) -> None:
        """Before admitting a request routed under policy ``version``, fetch that policy if this replica
        has not seen it yet: a request sent after ``serve deploy`` returns runs under the new policy.
        Bounded by ``router.route_timeout_s`` like the route itself, so the Router is never on a
        request's failure path; a request the Router did not route (it was slow) carries no version."""
        if version is None or version <= self.policy_version:
            return
        resp = self.router.policy.remote()
        try:
            self._apply_policy(await within(resp, self.cfg.router.route_timeout_s))
        except Exception:  # slow or restarting: the request runs under the policy this replica has
            resp.cancel()
            log.warning("could not fetch policy version %s from the router", version, exc_info=True)

    async def generate(self, request: dict[str, Any], replica_id: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """Stream output chunks as dicts; an invalid request yields one ``{"error": ...}`` chunk.

        With tracing on, ``request["trace_context"]`` (a W3C carrier from the ingress) makes the
        engine record this request's steps, emitted as spans when it finishes.
        """
        parent = self.telemetry.trace_parent(request.get("trace_context"))
        start_ns = time.time_ns() if parent is not None else 0
        finish_reason = "abort"
        await self._catch_up_policy(request.get("policy_version"))
        try:
            async for o in self.engine.generate(
                request["request_id"],
                request["prompt_ids"],
                params=request["params"],
                proposer=request.get("proposer"),
                speculation=request.get("speculation", "auto"),
                record_events=parent is not None,
                resume_output_ids=request.get("resume_output_ids") or (),
            ):
                if o.finished:
                    finish_reason = o.finish_reason or "stop"
                    if parent is not None:
                        self.telemetry.emit_request_spans(
                            parent,
                            start_ns,
                            time.time_ns(),
                            o.events,
                            {
                                "request_id": o.request_id,
                                "proposer": o.proposer or "",
                                "finish_reason": finish_reason,
                                "num_output_tokens": o.num_output_tokens,
                                "num_draft_tokens": o.spec.num_draft_tokens,
                                "num_accepted_tokens": o.spec.num_accepted_tokens,
                            },
                        )
                yield output_dict(o, self._fingerprint(), self.replica_id)
        except InvalidRequestError as e:
            finish_reason = "invalid"
            yield {"error": {"message": e.message, "param": e.param}}
        except Exception:
            finish_reason = "error"  # e.g. the engine loop died
            raise
        finally:
            self.telemetry.requests.add(1, {"finish_reason": finish_reason})

    def _fingerprint(self) -> str:
        """OpenAI's ``system_fingerprint``: the configuration that, with the seed, fixes the output (the
        served model, resolved dtype, invariant kernels and which attention and GEMMs, verification rule, torch,
        CPU/GPU kind)."""
        if self._fp is None:
            import hashlib

            import torch

            snap = self.engine.snapshot()
            e = self.cfg.engine
            kind = (
                torch.cuda.get_device_name() if torch.cuda.is_available() else torch.backends.cpu.get_cpu_capability()
            )
            key = (
                f"{e.model}|{e.served_model_name}|{snap.dtype}|{snap.batch_invariant}|{snap.attention_kernel}|"
                f"{snap.gemm_kernel}|{e.verification}|{torch.__version__}|{kind}"
            )
            self._fp = "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]
        return self._fp

    def load(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, **self.engine.snapshot().as_dict()}

    def placement(self, replica_id: str | None = None) -> dict[str, Any]:
        """Where this replica runs (tests assert the target and the draft are on different nodes).
        ``replica_id`` only steers the call to that replica (deployments/replica_router.py)."""
        import ray

        return {
            "replica_id": self.replica_id,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "engine_thread": self.engine.thread_id,
            "engine_cpu_priority": self.engine.cpu_priority,
        }

    async def stats(self) -> dict[str, Any]:
        def collect(e: LLMEngine) -> dict[str, Any]:
            return {name: s.as_dict() for name, s in e.stats.items()}

        return {"replica_id": self.replica_id, "proposers": await self.engine.call(collect), "load": self.load()}

    async def policy_trace(self, replica_id: str | None = None) -> dict[str, Any]:
        """The active policy's state (its cost model, last decisions) and the last ``TRACE_STEPS``
        engine steps: the K asked of each decoding request (``ks``, empty on a step with none),
        the tokens fed, the seconds taken, the decoding requests of a prefill-free step, and the
        policy's reasons (``why``: :meth:`Policy.step_detail`, e.g. goodput's prediction per K)."""

        def collect(e: LLMEngine) -> dict[str, Any]:  # in the engine thread, which owns both
            return {
                "policy": self.policy.state(),
                "policy_name": self.policy.name,
                "policy_version": self.policy_version,
                "steps": list(self._trace),
            }

        return {"replica_id": self.replica_id, **await self.engine.call(collect)}

    async def metrics_samples(self, replica_id: str | None = None) -> list[dict[str, Any]]:
        """This replica's metric samples (plain dicts, labelled ``replica``) for the ingress's ``/metrics``.
        ``replica_id`` pins the call to that replica (deployments/replica_router.py)."""
        return await self.telemetry.samples(self.engine.call)

    def debug_spans(self, replica_id: str | None = None) -> list[dict[str, Any]]:
        """Finished spans, when ``telemetry.tracing`` is "memory" (tests); else empty."""
        return self.telemetry.tel.finished_spans()

    def check_health(self) -> None:
        if not self.engine.healthy():
            raise RuntimeError("engine loop is dead or wedged")

    def __del__(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            pass
