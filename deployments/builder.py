"""The one place the Serve graph is wired: validate the YAML ``args``, bind the deployments.

``serve run ray_config.yaml`` / ``serve deploy ray_config.yaml`` call ``build_app(args)``.
A misspelled key anywhere in ``args`` fails here, naming it, before anything starts.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import RequestRouterConfig

from cluster.config import DRAFT_WORKER_PROPOSERS, AppConfig
from deployments.draft import DraftWorker
from deployments.ingress import Ingress
from deployments.router import Router
from deployments.target import TargetWorker


def build_app(args: dict[str, Any] | None = None):
    cfg = AppConfig.model_validate(args or {})
    raw = cfg.model_dump(mode="json")
    router = Router.bind(raw)
    draft = None
    if cfg.draft.enabled and any(p.name in DRAFT_WORKER_PROPOSERS for p in cfg.engine.proposers):
        d = cfg.draft.resources
        draft = DraftWorker.options(
            num_replicas=d.num_replicas,
            ray_actor_options=d.ray_actor_options(),
            max_ongoing_requests=d.max_ongoing_requests,
        ).bind(raw)
    t = cfg.target
    scaling: dict[str, Any] = (
        {"autoscaling_config": t.autoscaling_config.model_dump(exclude_none=True)}
        if t.autoscaling_config is not None
        else {"num_replicas": t.num_replicas}
    )
    target = TargetWorker.options(
        **scaling,
        ray_actor_options=t.ray_actor_options(),
        max_ongoing_requests=t.max_ongoing_requests,
        max_queued_requests=t.max_queued_requests,
        request_router_config=RequestRouterConfig(
            request_router_class="deployments.replica_router:HintedReplicaRouter"
        ),
        health_check_period_s=5,
        health_check_timeout_s=30,
    ).bind(raw, router, draft)
    ing = cfg.ingress
    return Ingress.options(num_replicas=ing.num_replicas, max_ongoing_requests=ing.max_ongoing_requests).bind(
        raw, target, router, draft
    )
