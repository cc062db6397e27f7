"""The Router's placement without a cluster: optimistic increments and near-tie choices spread a
burst over equal replicas; reports reset the increments; the load counts KV in use."""

from __future__ import annotations

import dataclasses

import pytest
from ray import serve

from cluster.config import AppConfig
from deployments.router import Router
from workers.stats import LoadSnapshot


@pytest.fixture(autouse=True)
def _outside_serve(monkeypatch):
    monkeypatch.setattr(serve, "get_replica_context", lambda: None)  # the Router built outside a replica


def _router() -> object:
    return Router.func_or_class(AppConfig().model_dump(mode="json"))


def _snap(**kw) -> dict:
    return dataclasses.asdict(LoadSnapshot(**{"kv_tokens_capacity": 1000, **kw}))


def test_a_burst_spreads_over_equal_replicas_between_reports():
    r = _router()
    for rid in ("a", "b"):
        r.report(rid, _snap(), r.version)
    picks = [r.route("auto", None, 4)["replica_id"] for _ in range(16)]
    assert picks.count("a") == 8 and picks.count("b") == 8  # no report came in: the increments alone spread it
    r.report("a", _snap(running=8), r.version)  # a's report now counts its 8; b has not reported yet
    assert r.assigned == {"a": 0, "b": 8}


def test_ties_are_broken_at_random_and_the_lighter_replica_wins_otherwise():
    r = _router()
    r.report("a", _snap(running=3), r.version)
    r.report("b", _snap(running=3), r.version)
    r.report("c", _snap(running=9), r.version)
    seen = set()
    for _ in range(40):
        r.assigned = {"a": 0, "b": 0, "c": 0}
        seen.add(r.route("auto", None, 4)["replica_id"])
    assert seen == {"a", "b"}  # equal: either; c is never chosen
    r.report("b", _snap(running=3, kv_tokens_in_use=500), r.version)  # same requests, more of its KV in use
    for _ in range(10):
        r.assigned = {"a": 0, "b": 0, "c": 0}
        assert r.route("auto", None, 4)["replica_id"] == "a"
    assert r.route("auto", None, 4, exclude="a")["replica_id"] == "b"  # a resubmission avoids the failed one


def test_router_keys_are_validated():
    from pydantic import ValidationError

    from cluster.config import RouterConfig

    with pytest.raises(ValidationError, match="heartbeat_s"):
        RouterConfig(heartbeat_s=3.0)  # longer than stale_after_s: an idle replica would look dead
    with pytest.raises(ValidationError, match="route_timeout_s"):
        RouterConfig(route_timeout_s=0)
    with pytest.raises(ValidationError, match="route_timout_s"):
        AppConfig.model_validate({"router": {"route_timout_s": 0.1}})
