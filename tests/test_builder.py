"""The Serve graph build_app wires from ray_config.yaml: limits from YAML reach every deployment.

Serve's own default of 5 requests in flight per replica, left on the Ingress, once capped the
whole service at 5 concurrent streams (HTTP c=16 ran 5 at a time, TTFT 25 s). No cluster needed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from cluster.local_cluster import shipped_app_args
from deployments.builder import build_app

ROOT = Path(__file__).resolve().parent.parent


def _graph(args: dict) -> dict:
    """name -> Deployment, walking the bound init args from the Ingress."""
    found: dict = {}

    def walk(app) -> None:
        bd = app._bound_deployment
        found[bd.name] = bd
        for a in list(bd.init_args) + list(bd.init_kwargs.values()):
            if hasattr(a, "_bound_deployment"):
                walk(a)

    walk(build_app(args))
    return found


def test_limits_from_yaml_reach_every_deployment() -> None:
    args = shipped_app_args()
    args["ingress"]["max_ongoing_requests"] = 300
    g = _graph(args)
    assert {"Ingress", "TargetWorker", "Router"} <= set(g)
    assert g["Ingress"].max_ongoing_requests == 300
    assert g["TargetWorker"].max_ongoing_requests == args["target"]["max_ongoing_requests"]
    assert g["TargetWorker"].max_queued_requests == args["target"]["max_queued_requests"]
    assert g["Router"].max_ongoing_requests >= 1000
    assert min(d.max_ongoing_requests for d in g.values()) > 5  # nothing left at Serve's default


def test_default_ingress_limit_is_not_serves_default() -> None:
    g = _graph({})
    assert g["Ingress"].max_ongoing_requests == 256


def test_app_build_router_and_ingress_never_import_torch() -> None:
    """`serve deploy` imports the builder to build the graph, and the Router and the Ingress only route
    and speak HTTP: importing torch and transformers there would cost each seconds and hundreds of MB
    for nothing. Only the target and draft replicas load them, when they start."""
    code = (
        "import sys, deployments.builder, deployments.router, deployments.ingress; "
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=ROOT)
