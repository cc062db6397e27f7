"""Router: holds the routing policy and the live load of every target replica.

Target replicas push a load snapshot every ``report_interval_s`` (50 ms by default), so
the view is at most one interval plus one RPC old (the age is reported with every route
decision). For each request the Router picks the least-loaded fresh replica and the
path the policy would give it there (for metrics and traces: the engine re-applies the
policy every step, so a request admitted at low load stops speculating when load rises).

Placement: a burst arrives faster than replicas report, so the Router adds every request it
sends to its replica's load until a report counts it (optimistic increment), and breaks near-ties
(loads within one request) with two random choices, so that equal replicas share a burst instead
of all of it landing on the first. A report counts a request once the engine was handed it (the
snapshot's ``handed`` counter): a request still on its way (the ingress's call, the target's
queue) when the replica reports stays counted here, so a burst's placement holds the balance and
the affinity threshold it was given. A request that never reaches the engine (its client left)
stops counting after ``router.stale_after_s``. The load is what the policy cares
about: requests in the engine (running, waiting) plus the share of the KV cache in use.

Prefix affinity: the ingress sends the chained hashes of the prompt's full KV blocks, and among
the replicas within ``router.prefix_affinity_max_imbalance`` requests of the least busy, the one the
Router sent the most of those leading blocks gets the request (deployments/prefix_affinity.py), so
a conversation's next turn finds its KV cached. Stale replicas are never candidates.

The Router is off the failure path: the ingress bounds its call (``router.route_timeout_s``)
and serves the request without it, and a restarted Router rebuilds its view from the next
reports and its policy from the deployed user_config.
"""

from __future__ import annotations

import os
import random
import time
from collections import deque
from typing import Any

from opentelemetry.metrics import Observation
from ray import serve

from cluster.config import AppConfig, RouterUserConfig
from cluster.telemetry import Telemetry
from deployments.prefix_affinity import PrefixIndex, affine
from policies.registry import make_policy
from workers.decision import SpecCandidate
from workers.stats import LoadSnapshot


# Every request asks the Router once and every target replica reports to it every 50 ms: cheap
# calls that must never queue behind Serve's default limit of 5 in flight.
@serve.deployment(name="Router", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
class Router:
    def __init__(self, app_config: dict) -> None:
        self.cfg = AppConfig.model_validate(app_config)
        self.user_config = RouterUserConfig()
        self.policy = make_policy(self.user_config.policy)
        self.version = 0
        self.loads: dict[str, tuple[float, dict[str, Any]]] = {}  # replica id -> (received at, snapshot)
        # replica id -> send times (monotonic, oldest first) of the requests sent there its reports do not count yet
        self.unacked: dict[str, deque[float]] = {}
        self.handed: dict[str, int] = {}  # replica id -> its engine's ``handed`` counter in its last report
        self.rng = random.Random()
        self.prefixes = PrefixIndex(self.cfg.router.prefix_index_blocks)
        ctx = serve.get_replica_context()
        self.telemetry = Telemetry(self.cfg.telemetry, "router", ctx.replica_id.unique_id if ctx else "router")
        # per-request decisions, cumulative across policy swaps (the policy's own count starts over)
        self.route_decisions = self.telemetry.meter.create_counter(
            "specserve_route_decisions", description="Per-request routing decisions, by path and K."
        )
        self.prefix_routed = self.telemetry.meter.create_counter(
            "specserve_router_prefix_affinity",
            description="Requests placed where their leading KV blocks were sent before (hit) or by load alone (miss).",
        )
        self.telemetry.meter.create_observable_gauge(
            "specserve_policy_version",
            callbacks=[lambda _o: [Observation(self.version, {"policy": self.policy.name})]],
            description="Live policy version (bumped by every reconfigure), labelled with the policy name.",
        )

    def reconfigure(self, user_config: dict) -> None:
        """Live policy change from ``serve deploy`` (validated; unknown keys fail the deploy)."""
        uc = RouterUserConfig.model_validate(user_config or {})
        self.policy = make_policy(uc.policy)
        self.user_config = uc
        self.version += 1

    def report(self, replica_id: str, snapshot: dict[str, Any], version: int) -> dict[str, Any] | None:
        self.loads[replica_id] = (time.time(), snapshot)
        handed, before = snapshot.get("handed", 0), self.handed.get(replica_id)
        self.handed[replica_id] = handed
        sent = self.unacked.setdefault(replica_id, deque())
        if before is not None:  # else its first report (or this Router's): nothing sent yet to match
            # the engine got these requests since its last report (oldest sent first, as near as matters); a
            # request that reached it unrouted (a resumed stream, a route timed out) counts one too many, once
            for _ in range(min(max(handed - before, 0), len(sent))):
                sent.popleft()
        if version != self.version:
            return {"version": self.version, "policy": self.user_config.policy_dump()}
        return None

    def _fresh(self) -> dict[str, tuple[float, dict[str, Any]]]:
        now = time.time()
        return {r: v for r, v in self.loads.items() if now - v[0] <= self.cfg.router.stale_after_s}

    def route(
        self,
        speculation: str,
        proposer: str | None,
        k_max: int,
        exclude: str | None = None,
        prefix: list[int] | None = None,
    ) -> dict[str, Any]:
        """The replica for a new request (never ``exclude``: one that just failed it) and its expected path.
        ``prefix``: the chained hashes of the prompt's full KV blocks (``workers.kv_blocks.block_hashes``)."""
        fresh = {r: v for r, v in self._fresh().items() if r != exclude}
        if not fresh:
            return {
                "replica_id": None,
                "path": "unknown",
                "k": None,
                "load_age_s": None,
                "policy_version": self.version,
            }
        rid, cached_blocks = self.pick(fresh, prefix or [])
        if prefix:
            self.prefixes.add(prefix, rid)
            self.prefix_routed.add(1, {"result": "hit" if cached_blocks else "miss"})
        at, snap = fresh[rid]
        self.unacked.setdefault(rid, deque()).append(time.monotonic())
        s = LoadSnapshot(**snap)
        s.decoding += self.in_flight(rid)  # as if this request and the others its report misses were running
        k = self.policy.decide(s, [SpecCandidate("route", proposer or "default", speculation, k_max)])[0]
        self.route_decisions.add(1, {"path": "spec" if k > 0 else "plain", "k": str(k)})
        return {
            "replica_id": rid,
            "path": "spec" if k > 0 else "plain",
            "k": k,
            "load_age_s": time.time() - at,
            "policy_version": self.version,
            "prefix_blocks": cached_blocks,
        }

    def policy(self) -> dict[str, Any]:
        """The live policy and its version: a target handed a request routed under a newer version than
        its own fetches it here before admitting the request (an idle target reports, and so learns of
        a change, only every heartbeat)."""
        return {"version": self.version, "policy": self.user_config.policy_dump()}

    def in_flight(self, replica_id: str) -> int:
        """Requests sent to the replica that its last report does not count, less those sent longer than
        ``router.stale_after_s`` ago (lost on the way: a client that left before the engine got it)."""
        sent = self.unacked.get(replica_id)
        if not sent:
            return 0
        oldest = time.monotonic() - self.cfg.router.stale_after_s
        while sent and sent[0] < oldest:
            sent.popleft()
        return len(sent)

    def requests(self, replica_id: str, snap: dict[str, Any]) -> int:
        """Requests in the replica's engine and on their way to it."""
        return snap["running"] + snap["waiting"] + self.in_flight(replica_id)

    def load(self, replica_id: str, snap: dict[str, Any]) -> float:
        """Its requests plus its KV share in use."""
        kv = snap.get("kv_tokens_in_use", 0) / max(snap.get("kv_tokens_capacity", 0), 1)
        return self.requests(replica_id, snap) + kv

    def pick(self, fresh: dict[str, tuple[float, dict[str, Any]]], prefix: list[int]) -> tuple[str, int]:
        """The replica, and how many of the prompt's leading blocks it was sent before: among the replicas
        sent the most of them (all, if none was; see ``affine``), the least-loaded; among near-ties
        (within one request), the better of two random ones."""
        reqs = {r: self.requests(r, snap) for r, (_, snap) in fresh.items()}
        keep, depth = affine(reqs, self.prefixes, prefix, self.cfg.router.prefix_affinity_max_imbalance)
        loads = {r: self.load(r, snap) for r, (_, snap) in fresh.items() if r in keep}
        best = min(loads.values())
        near = sorted(r for r, v in loads.items() if v < best + 1.0)
        if len(near) == 1:
            return near[0], depth
        a, b = self.rng.sample(near, 2)  # in random order: a tie goes to either
        return (a if loads[a] <= loads[b] else b), depth

    def stats(self) -> dict[str, Any]:
        now = time.time()
        return {
            "policy": self.policy.describe(),
            "policy_version": self.version,
            "replicas": {r: {"age_s": now - at, **snap} for r, (at, snap) in self.loads.items()},
            "decisions": {f"{p}:{k}": n for (p, k), n in self.policy.decisions.items()},
            "prefix_index_blocks": len(self.prefixes),
        }

    def metrics_samples(self) -> list[dict[str, Any]]:
        """The Router's metric samples (plain dicts) for the ingress's ``/metrics``."""
        return self.telemetry.samples()

    def replica_ids(self) -> list[str]:
        """Target replicas that reported recently: the ones ``/metrics`` asks for their samples."""
        return sorted(self._fresh())

    def placement(self) -> dict[str, Any]:
        """This replica's process (tests kill it to show the Router is off the failure path)."""
        return {"pid": os.getpid()}

    def healthy(self) -> bool:
        """At least one target replica reported recently (its loop is alive and stepping)."""
        return bool(self._fresh())
