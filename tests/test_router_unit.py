"""The Router's placement without a cluster: optimistic increments and near-tie choices spread a
burst over equal replicas; a report takes back the increments of the requests its engine got; the
load counts KV in use; prefix affinity sends a continued prompt to the replica holding its blocks,
within the load balance."""

from __future__ import annotations

import dataclasses

import pytest
from ray import serve

from cluster.config import AppConfig
from deployments.prefix_affinity import PrefixIndex, affine
from deployments.router import Router
from workers.kv_blocks import block_hashes
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
    r.report("a", _snap(running=3, handed=3), r.version)  # a's engine got 3 of its 8 so far
    assert (r.in_flight("a"), r.in_flight("b")) == (5, 8)
    r.report("a", _snap(running=8, handed=8), r.version)  # a's report now counts its 8; b has not reported yet
    assert (r.in_flight("a"), r.in_flight("b")) == (0, 8)
    assert r.requests("a", r.loads["a"][1]) == r.requests("b", r.loads["b"][1]) == 8


def test_a_report_that_misses_requests_on_their_way_keeps_them_in_the_load(monkeypatch):
    """A replica reporting while part of a burst is still on its way to its engine (the ingress's call,
    the target's queue) must not look emptier than it is: the burst stays balanced."""
    r = _router()
    for rid in ("a", "b"):
        r.report(rid, _snap(), r.version)
    picks = []
    for _ in range(22):
        picks.append(r.route("auto", None, 4)["replica_id"])
        r.report("a", _snap(), r.version)  # a reports between every two requests; none reached its engine yet
    assert picks.count("a") == picks.count("b") == 11
    assert (r.in_flight("a"), r.in_flight("b")) == (11, 11)
    # a request whose client left before the engine got it stops counting after stale_after_s
    later = r.cfg.router.stale_after_s + 0.1
    clock = __import__("time").monotonic
    monkeypatch.setattr("deployments.router.time.monotonic", lambda: clock() + later)
    assert (r.in_flight("a"), r.in_flight("b")) == (0, 0)


def test_a_restarted_engine_counter_and_unrouted_requests_never_make_the_load_negative():
    r = _router()
    r.report("a", _snap(handed=40), r.version)  # a replica that served before this Router started
    for _ in range(3):
        r.route("auto", None, 4)
    r.report("a", _snap(running=1, handed=41), r.version)  # one of the three reached it
    assert r.in_flight("a") == 2
    r.report("a", _snap(running=1, handed=50), r.version)  # more arrived than were sent (unrouted ones)
    assert r.in_flight("a") == 0
    r.report("a", _snap(running=0, handed=2), r.version)  # a counter that went back: nothing matched
    assert r.in_flight("a") == 0 and r.requests("a", r.loads["a"][1]) == 0


def test_ties_are_broken_at_random_and_the_lighter_replica_wins_otherwise():
    r = _router()
    r.report("a", _snap(running=3), r.version)
    r.report("b", _snap(running=3), r.version)
    r.report("c", _snap(running=9), r.version)
    seen = set()
    for _ in range(40):
        r.unacked.clear()
        seen.add(r.route("auto", None, 4)["replica_id"])
    assert seen == {"a", "b"}  # equal: either; c is never chosen
    r.report("b", _snap(running=3, kv_tokens_in_use=500), r.version)  # same requests, more of its KV in use
    for _ in range(10):
        r.unacked.clear()
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


SYSTEM = list(range(1000, 1040))  # a shared head: 2 full blocks of 16 and 8 more tokens


def _chat(conv: int, turns: int) -> list[int]:
    """A conversation's prompt after ``turns`` turns: the shared head, then 30 tokens per turn."""
    return SYSTEM + [t for i in range(turns) for t in range(conv * 1000 + i * 30, conv * 1000 + i * 30 + 30)]


def test_prefix_index_matches_the_deepest_block_and_forgets_the_least_recently_routed():
    ix = PrefixIndex(max_blocks=8)
    t1, t2 = block_hashes(_chat(1, 1), 16), block_hashes(_chat(1, 2), 16)  # 4 and 6 full blocks
    assert t2[:4] == t1  # the next turn's prompt starts with the last one's full blocks
    ix.add(t1, "a")
    assert ix.match(t2, {"a", "b"}) == (4, {"a"}, {"a"})  # a continuation: t1 ended there
    assert ix.match(t2, {"b"}) == (0, set(), set())  # only replicas asked about count
    other = block_hashes(_chat(2, 1), 16)
    assert ix.match(other, {"a", "b"}) == (2, {"a"}, set())  # the shared head only: no prompt ended there
    ix.add(other, "b")
    assert len(ix) == 6 and ix.blocks[t1[0]] == {"a": False, "b": False}
    ix.add(block_hashes(_chat(3, 1), 16), "b")  # 2 new blocks: 8 in all
    ix.add(block_hashes(_chat(4, 1), 16), "a")  # 2 more: the least recently routed 2 (t1's) go
    assert len(ix) == 8 and ix.match(t2, {"a", "b"})[0] == 2  # only the head is left of conversation 1
    assert PrefixIndex(0).match(t1, {"a"}) == (0, set(), set())  # size 0: nothing is kept


def test_affinity_holds_within_the_imbalance_threshold_and_yields_beyond_it():
    ix = PrefixIndex(1000)
    t1, t2 = block_hashes(_chat(1, 1), 16), block_hashes(_chat(1, 2), 16)
    ix.add(t1, "a")
    assert affine({"a": 2, "b": 0}, ix, t2, 2.0) == ({"a"}, 4)  # 2 requests busier, within 2: a
    assert affine({"a": 3, "b": 0}, ix, t2, 2.0) == ({"a", "b"}, 0)  # beyond 2: load decides
    assert affine({"a": 1, "b": 0}, ix, t2, 0.0) == ({"a", "b"}, 0)  # 0 turns affinity off
    assert affine({"b": 0}, ix, t2, 2.0) == ({"b"}, 0)  # a is gone (not fresh): never chosen
    other = block_hashes(_chat(2, 1), 16)
    assert affine({"a": 1, "b": 0}, ix, other, 2.0) == ({"a", "b"}, 0)  # a shared head: load decides
    ix.add(t1, "b")
    assert affine({"a": 1, "b": 0}, ix, t2, 2.0) == ({"a", "b"}, 0)  # both hold it: load decides


def test_the_router_sends_each_turn_where_its_blocks_are_and_spreads_new_conversations():
    r = _router()
    for rid in ("a", "b"):
        r.report(rid, _snap(), r.version)
    first = {c: r.route("auto", None, 4, prefix=block_hashes(_chat(c, 1), 16)) for c in range(8)}
    homes = {c: v["replica_id"] for c, v in first.items()}
    assert sorted(homes.values()).count("a") == 4  # new conversations (a shared head) spread by load
    assert all(v["prefix_blocks"] == 0 for v in first.values())
    for turn in (2, 3):
        for c in range(8):
            got = r.route("auto", None, 4, prefix=block_hashes(_chat(c, turn), 16))
            assert got["replica_id"] == homes[c] and got["prefix_blocks"] > 0
    # a replica whose reports stopped gets none of its conversations: they go where the load is
    r.loads["a"] = (r.loads["a"][0] - 60, r.loads["a"][1])
    for c in range(8):
        assert r.route("auto", None, 4, prefix=block_hashes(_chat(c, 4), 16))["replica_id"] == "b"


def test_prefix_affinity_keys_are_validated():
    from pydantic import ValidationError

    from cluster.config import RouterConfig

    with pytest.raises(ValidationError, match="prefix_affinity_max_imbalance"):
        RouterConfig(prefix_affinity_max_imbalance=-1)
    with pytest.raises(ValidationError, match="prefix_index_blocks"):
        RouterConfig(prefix_index_blocks=-1)


def test_a_hot_prompt_stays_on_its_replica_only_up_to_the_threshold_then_spreads():
    r = _router()
    for rid in ("a", "b"):
        r.report(rid, _snap(), r.version)
    hot = block_hashes(_chat(1, 1), 16)
    picks = [r.route("auto", None, 4, prefix=hot)["replica_id"] for _ in range(8)]
    assert len(set(picks[:3])) == 1 and picks[3] != picks[0]  # 2 more than the idle one, then it spills
    assert picks.count("a") == picks.count("b") == 4  # both hold it now: the load balance decides
