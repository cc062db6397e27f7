"""Routing policies on synthetic load traces: pure Python, a fake clock, no model, no Ray."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from policies import PolicyConfig, StepCostModel, known_policies, make_policy
from policies.goodput import GoodputPolicy, expected_tokens
from policies.k_table import KTablePolicy
from policies.threshold import ThresholdPolicy
from workers.decision import SpecCandidate
from workers.stats import ACCEPTANCE_DECAY, LoadSnapshot, PositionalAcceptance, RateEma


class FakeClock:
    """Advances only when told: step i of a trace happens at i * dt seconds."""

    def __init__(self) -> None:
        self.steps = 0
        self.dt = 0.1

    def __call__(self) -> float:
        return self.steps * self.dt  # exact multiples, no float drift from repeated addition


def cands(n: int, proposer: str | None = "ngram", speculation: str = "auto", k_max: int = 8) -> list[SpecCandidate]:
    return [SpecCandidate(f"r{i}", proposer, speculation, k_max) for i in range(n)]  # type: ignore[arg-type]


def snap(batch: int, acceptance: dict[str, float] | None = None) -> LoadSnapshot:
    return LoadSnapshot(running=batch, decoding=batch, acceptance_ema=dict(acceptance or {}))


def step(policy, batch: int, acceptance: dict[str, float] | None = None, **kw) -> list[int]:
    return policy.decide(snap(batch, acceptance), cands(batch, **kw))


# ----------------------------------------------------------------------------- never / always


def test_never_and_always_trivial() -> None:
    never, always = make_policy({"name": "never"}), make_policy({"name": "always", "num_speculative_tokens": 3})
    for batch in (1, 7, 64):
        assert step(never, batch) == [0] * batch
        assert step(always, batch) == [3] * batch
    assert make_policy({"name": "always"}).decide(snap(1), cands(1)) == [4]  # default K
    assert step(always, 2, k_max=2) == [2, 2]  # clipped to k_max
    assert step(always, 2, proposer=None) == [0, 0]  # no proposer: always plain
    assert always.decide(snap(0), []) == []


def test_default_policy_is_goodput() -> None:
    assert isinstance(make_policy(), GoodputPolicy)
    assert known_policies() == ["always", "goodput", "k_table", "never", "threshold"]


# ----------------------------------------------------------------------------- overrides


def test_override_honoured_when_allowed() -> None:
    never, always = make_policy({"name": "never"}), make_policy({"name": "always", "num_speculative_tokens": 3})
    assert never.decide(snap(2), cands(2, speculation="on")) == [4, 4]  # override_k default
    assert never.decide(snap(1), cands(1, speculation="on", k_max=2)) == [2]  # clipped to k_max
    assert always.decide(snap(2), cands(2, speculation="on")) == [3, 3]  # the policy's own K > 0 is kept
    assert always.decide(snap(2), cands(2, speculation="off")) == [0, 0]
    custom = make_policy({"name": "never", "override_k": 6})
    assert custom.decide(snap(1), cands(1, speculation="on")) == [6]
    # a wish cannot conjure a proposer or draft room
    assert never.decide(snap(1), cands(1, proposer=None, speculation="on")) == [0]
    assert never.decide(snap(1), cands(1, speculation="on", k_max=0)) == [0]


def test_override_ignored_when_not_allowed() -> None:
    never = make_policy({"name": "never", "allow_request_override": False})
    always = make_policy({"name": "always", "allow_request_override": False})
    assert never.decide(snap(2), cands(2, speculation="on")) == [0, 0]
    assert always.decide(snap(2), cands(2, speculation="off")) == [4, 4]


def test_mixed_batch_per_candidate() -> None:
    p = make_policy({"name": "always", "num_speculative_tokens": 4})
    batch = [
        SpecCandidate("a", "ngram", "auto", 8),
        SpecCandidate("b", "ngram", "off", 8),
        SpecCandidate("c", None, "on", 8),
        SpecCandidate("d", "ngram", "on", 1),
    ]
    assert p.decide(snap(4), batch) == [4, 0, 0, 1]


def test_decisions_counted() -> None:
    p = make_policy({"name": "always", "num_speculative_tokens": 3})
    p.decide(snap(3), cands(3))
    p.decide(snap(2), [SpecCandidate("a", "ngram", "off", 8), SpecCandidate("b", "ngram", "auto", 1)])
    assert p.decisions == {("spec", 3): 3, ("plain", 0): 1, ("spec", 1): 1}
    assert p.decisions_as_dict() == {"plain/0": 1, "spec/1": 1, "spec/3": 3}


# ----------------------------------------------------------------------------- threshold


def test_threshold_band_and_state_machine() -> None:
    clock = FakeClock()
    p = make_policy({"name": "threshold", "t_low": 2, "t_high": 4, "min_dwell_s": 0.0}, clock=clock)
    assert isinstance(p, ThresholdPolicy)
    # in SPEC: stays up to t_high inclusive, leaves above it
    assert [step(p, b)[0] for b in (1, 4, 3, 4)] == [4, 4, 4, 4]
    assert step(p, 5)[0] == 0
    # in PLAIN: stays inside the band, returns only at t_low
    assert [step(p, b)[0] for b in (4, 3, 5, 3)] == [0, 0, 0, 0]
    assert step(p, 2)[0] == 4
    assert p.num_switches == 2


def test_threshold_hysteresis_holds_under_oscillating_load() -> None:
    """Load flips around T every step (vLLM #49548); path changes stay >= min_dwell_s apart."""
    clock = FakeClock()
    p = make_policy({"name": "threshold", "t": 4, "min_dwell_s": 1.0}, clock=clock)
    changes: list[float] = []
    last = None
    for i in range(200):  # 20 s of trace
        clock.steps = i
        spec = step(p, 4 if i % 2 else 5)[0] > 0
        if last is not None and spec != last:
            changes.append(clock())
        last = spec
    assert changes, "the load does cross T: the path must change at least once"
    gaps = [b - a for a, b in zip(changes, changes[1:])]
    assert all(g >= 1.0 - 1e-9 for g in gaps), gaps  # <= 1 change per min_dwell window
    assert len(changes) <= 20 + 1
    # without the dwell the same trace flaps every step: the knob has an effect
    q = make_policy({"name": "threshold", "t": 4, "min_dwell_s": 0.0}, clock=clock)
    flips = [step(q, 4 if i % 2 else 5)[0] for i in range(20)]
    assert sum(a != b for a, b in zip(flips, flips[1:])) == 19


def test_threshold_band_stops_flapping_without_dwell() -> None:
    clock = FakeClock()
    p = make_policy({"name": "threshold", "t_low": 2, "t_high": 4, "min_dwell_s": 0.0}, clock=clock)
    ks = [step(p, 3 if i % 2 else 5)[0] for i in range(50)]  # oscillates across t_high, never down to t_low
    assert ks[0] == 0 and set(ks) == {0} and p.num_switches == 1


def test_threshold_dwell_delays_switch() -> None:
    clock = FakeClock()
    p = make_policy({"name": "threshold", "t": 4, "min_dwell_s": 0.5}, clock=clock)
    assert step(p, 9)[0] == 0  # first decision follows the load at once
    for i in range(1, 5):  # 0.1 .. 0.4 s: still dwelling in PLAIN
        clock.steps = i
        assert step(p, 1)[0] == 0
    clock.steps = 5
    assert step(p, 1)[0] == 4


def test_threshold_config_errors_name_fields() -> None:
    with pytest.raises(ValidationError, match=r"t_low \(5\) must be <= t_high \(3\)"):
        make_policy({"name": "threshold", "t_low": 5, "t_high": 3})
    with pytest.raises(ValidationError, match="either t or t_low/t_high"):
        make_policy({"name": "threshold", "t": 3, "t_high": 5})
    cfg = make_policy({"name": "threshold", "t": 3}).config
    assert (cfg.t_low, cfg.t_high) == (3, 3)


# ----------------------------------------------------------------------------- k_table


def test_k_table_boundaries_exact() -> None:
    table = [{"max_batch_size": 4, "k": 4}, {"max_batch_size": 8, "k": 2}, {"max_batch_size": 32, "k": 1}]
    p = make_policy({"name": "k_table", "table": table})
    assert isinstance(p, KTablePolicy)
    expect = {1: 4, 4: 4, 5: 2, 8: 2, 9: 1, 32: 1, 33: 0, 100: 0}
    assert {b: p.lookup(b) for b in expect} == expect
    assert step(p, 8) == [2] * 8 and step(p, 9) == [1] * 9
    q = make_policy({"name": "k_table", "table": {4: 4, 8: 2}, "default_k": 1})  # TRT-LLM style mapping
    assert [q.lookup(b) for b in (4, 5, 8, 9)] == [4, 2, 2, 1]


def test_k_table_validation() -> None:
    with pytest.raises(ValidationError, match="strictly ascending"):
        make_policy({"name": "k_table", "table": [{"max_batch_size": 8, "k": 2}, {"max_batch_size": 8, "k": 1}]})
    with pytest.raises(ValidationError, match="table.0.k"):
        make_policy({"name": "k_table", "table": [{"max_batch_size": 8, "k": -1}]})
    with pytest.raises(ValidationError, match="kk"):
        make_policy({"name": "k_table", "table": [{"max_batch_size": 8, "kk": 1}]})


# ----------------------------------------------------------------------------- goodput


def feed(policy, fn, xs=(1, 2, 4, 8, 16, 32, 64, 128, 256), batches=(None, 1, 2, 8, 32)) -> None:
    """Steps whose cost is ``fn(tokens)`` whatever their composition: prefill-carrying steps (None)
    and decode-only steps of each batch size in ``batches`` (at least one token per request)."""
    for _ in range(3):
        for b in batches:
            for x in xs:
                if b is None or x >= b:
                    policy.observe_step(x, fn(x), b)


def test_expected_tokens() -> None:
    assert expected_tokens(0, 0.9) == 1.0
    assert expected_tokens(4, 1.0) == 5.0
    assert expected_tokens(3, 0.5) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(3, 0.0) == 1.0
    # per-position conditional acceptance; the last measured position stands for the later ones
    assert expected_tokens(3, 0.5, [0.5]) == pytest.approx(expected_tokens(3, 0.5))
    assert expected_tokens(4, 0.1, [0.3, 0.9]) == pytest.approx(1 + 0.3 + 0.27 + 0.243 + 0.2187)


def test_rate_ema_prior_fades_and_one_rejection_is_not_zero() -> None:
    r = RateEma(prior=0.5, prior_weight=2.0, decay=0.9)
    assert r.value == 0.5
    r.update(0, 4)  # one verify, 4 drafts, none accepted
    assert r.value == pytest.approx(0.9 / 5.8)  # (0.5*2*0.9 + 0) / (2*0.9 + 4): low, not 0
    for _ in range(60):
        r.update(3, 4)
    assert r.value == pytest.approx(0.75, abs=0.01)  # the evidence wins, old samples forgotten


def test_positional_acceptance_counts_reached_positions_only() -> None:
    pa = PositionalAcceptance()
    pa.update(4, 0)  # position 1 reached and rejected; 2..4 never reached
    assert [r.num_samples for r in pa.rates] == [1]
    pa.update(4, 2)  # 1, 2 accepted, 3 rejected, 4 not reached
    assert [r.num_samples for r in pa.rates] == [2, 1, 1]
    pa.update(2, 2)  # both drafts accepted; position 3 was not drafted
    assert [r.num_samples for r in pa.rates] == [3, 2, 1]
    v = pa.values()
    assert v[1] > 0.5 > v[2]  # position 2 accepted twice; position 3 rejected once
    d = ACCEPTANCE_DECAY  # sample 1 rejected, 2 and 3 accepted, on the prior of 0.5 x 2 samples
    assert v[0] == pytest.approx((0.5 * 2 * d**3 + d + 1) / (2 * d**3 + d**2 + d + 1))


def test_goodput_keeps_probing_when_requests_end() -> None:
    """At c=1 every request's last step has k_max = 0; that must not restart the count to the next probe."""
    p = make_policy({"name": "goodput", "probe_interval_steps": 10, "probe_k": 2})
    ks = []
    for i in range(60):
        k_max = 0 if i % 7 == 6 else 8  # a request ends every 7 steps
        ks.append(p.decide(snap(1, {"ngram": 0.01}), cands(1, k_max=k_max))[0])
    assert p.num_probes >= 4 and ks.count(2) == p.num_probes


def _chat_costs(x: float) -> float:
    # CPU-like: a 2-token step costs 1.25x a 1-token one, then ~3 ms per extra token
    return 0.040 if x <= 1 else 0.050 + 0.003 * (x - 2)


def test_goodput_values_all_or_nothing_drafts_by_position() -> None:
    """n-gram on open chat: position 1 accepts 25%, later positions 95% once it did (measured
    shape). The overall rate is 0.23, and the i.i.d. formula at 0.23 says every K loses; the
    per-position rates say K=4 wins by ~30%."""
    alphas = [0.25, 0.95]
    rate = sum(math.prod(alphas[min(j, 1)] for j in range(i + 1)) for i in range(4)) / 4  # accepted / drafted at K=4
    iid = make_policy({"name": "goodput", "probe_interval_steps": 0})
    feed(iid, _chat_costs)
    assert iid.decide(snap(1, {"ngram": rate}), cands(1, k_max=4)) == [0]
    pos = make_policy({"name": "goodput", "probe_interval_steps": 0})
    feed(pos, _chat_costs)
    s = LoadSnapshot(running=1, decoding=1, acceptance_ema={"ngram": rate}, acceptance_pos_ema={"ngram": alphas})
    assert pos.decide(s, cands(1, k_max=4)) == [4]
    assert pos.goodput(4, rate, 1, alphas) > 1.2 * pos.goodput(0, rate, 1)


def test_goodput_prices_undrafted_requests_as_plain_steps() -> None:
    p = make_policy({"name": "goodput"})
    feed(p, _chat_costs)
    t1, t2 = (lambda x: p.cost_model.predict(x, requests=1)), (lambda x: p.cost_model.predict(x, requests=2))
    e4 = expected_tokens(4, 0.6)
    assert p.goodput(4, 0.6, 1, proposal_rate=0.0) == pytest.approx(p.goodput(0, 0.6, 1))  # nothing drafted: plain
    assert p.goodput(4, 0.6, 1, proposal_rate=0.5) == pytest.approx((1 + 0.5 * (e4 - 1)) / (0.5 * t1(1) + 0.5 * t1(5)))
    # batch 2: none, one or both requests draft (binomial), each drafting one adds 4 tokens to the step
    want = 2 * (1 + 0.5 * (e4 - 1)) / (0.25 * t2(2) + 0.5 * t2(6) + 0.25 * t2(10))
    assert p.goodput(4, 0.6, 2, proposal_rate=0.5) == pytest.approx(want)
    s = LoadSnapshot(running=1, decoding=1, acceptance_ema={"ngram": 0.6}, proposal_rate_ema={"ngram": 0.5})
    p.decide(s, cands(1, k_max=4))
    assert p.state()["last"]["ngram"]["proposal_rate"] == 0.5


def test_goodput_speculates_when_cost_is_flat() -> None:
    p = make_policy({"name": "goodput"})
    feed(p, lambda x: 0.05 + 1e-5 * x)  # memory bound: extra verify tokens nearly free
    assert p.decide(snap(1, {"ngram": 0.7}), cands(1, k_max=8))[0] > 0


def test_goodput_plain_when_compute_bound() -> None:
    p = make_policy({"name": "goodput"})
    feed(p, lambda x: 0.002 + 0.004 * x)  # batch 32: every extra token costs real compute
    assert step(p, 32, {"ngram": 0.7}) == [0] * 32
    q = make_policy({"name": "goodput"})  # same load with a flat cost speculates: the cost model decides
    feed(q, lambda x: 0.05 + 1e-5 * x)
    assert step(q, 32, {"ngram": 0.7})[0] > 0


def test_goodput_honours_k_max_and_acceptance_floor() -> None:
    p = make_policy({"name": "goodput"})
    feed(p, lambda x: 0.05)
    assert p.decide(snap(1, {"ngram": 0.99}), cands(1, k_max=3)) == [3]  # would take more if allowed
    assert p.decide(snap(1, {"ngram": 0.99}), cands(1, k_max=16)) == [16]
    mixed = [SpecCandidate("a", "ngram", "auto", 2), SpecCandidate("b", "ngram", "auto", 6)]
    assert p.decide(snap(2, {"ngram": 0.99}), mixed) == [2, 6]
    assert step(p, 1, {"ngram": 0.04}) == [0]  # below min_acceptance
    floor = make_policy({"name": "goodput", "min_acceptance": 0.0})
    feed(floor, lambda x: 0.05)
    assert step(floor, 1, {"ngram": 0.04})[0] > 0  # the floor, not the cost, made it 0


def test_goodput_prior_acceptance_and_per_proposer() -> None:
    p = make_policy({"name": "goodput", "prior_acceptance": 0.0})  # untried proposers assumed useless
    batch = [SpecCandidate("a", "ngram", "auto", 8), SpecCandidate("b", "suffix", "auto", 8)]
    ks = p.decide(LoadSnapshot(decoding=2, acceptance_ema={"ngram": 0.8}), batch)
    assert ks[0] > 0 and ks[1] == 0


def test_goodput_does_not_flap_within_switch_margin() -> None:
    # At batch 8 with the prior cost, K=1 is best at acceptance 0.62 and K=2 at 0.645, by < 2%.
    trace = [0.62 if i % 2 else 0.645 for i in range(40)]
    probe = make_policy({"name": "goodput"})
    for a in (0.62, 0.645):
        g1, g2 = probe.goodput(1, a, 8), probe.goodput(2, a, 8)
        assert abs(g2 / g1 - 1) < probe.config.switch_margin
    flappy = make_policy({"name": "goodput", "switch_margin": 0.0})
    ks = [step(flappy, 8, {"ngram": a})[0] for a in trace]
    assert set(ks) == {1, 2}  # the trace does sit on the boundary
    steady = make_policy({"name": "goodput"})
    ks = [step(steady, 8, {"ngram": a})[0] for a in trace]
    assert len(set(ks)) == 1
    # a real change still gets through the margin
    assert step(steady, 8, {"ngram": 0.95})[0] > max(ks)


def test_goodput_learns_a_costly_small_verify_and_goes_plain() -> None:
    """The 1 -> 2 token jump the line cannot see: after measuring it, 20% acceptance goes plain."""
    p = make_policy({"name": "goodput", "probe_interval_steps": 0})
    costs = {1: 0.043}  # measured 2..9-token steps cost 1.4x-2x a 1-token step (small-M GEMM on CPU)
    costs.update({t: 0.061 + 0.004 * (t - 2) for t in range(2, 10)})
    for x in (64, 128, 256):  # prefill chunks: the line's slope comes from these
        for _ in range(3):
            p.observe_step(x, 0.03 + 0.0016 * x)
    ks = []
    for _ in range(80):  # the engine loop: decide, run the step, feed its measured cost back
        k = step(p, 1, {"ngram": 0.2})[0]
        ks.append(k)
        p.observe_step(k + 1, costs[k + 1], 1)
    assert ks[:2] == [0, 0]  # first the plain baseline at this batch size is measured
    assert ks[2] > 0  # then the line alone thinks a verify is nearly free and tries one
    assert ks[-40:] == [0] * 40  # measured: speculation loses at 20% acceptance
    assert sum(k > 0 for k in ks) <= 3 * 8  # exploration is bounded: each K measured a few times
    q = make_policy({"name": "goodput", "probe_interval_steps": 0})
    for x in (64, 128, 256):
        for _ in range(3):
            q.observe_step(x, 0.03 + 0.0016 * x)
    ks = []
    for _ in range(80):  # same costs, copy-heavy acceptance: speculation wins and stays
        ks.append(step(q, 1, {"ngram": 0.9})[0])
        q.observe_step(ks[-1] + 1, costs[ks[-1] + 1], 1)
    assert min(ks[-40:]) > 0


def test_goodput_probes_a_held_proposer() -> None:
    p = make_policy({"name": "goodput", "probe_interval_steps": 10, "probe_k": 2})
    ks = [step(p, 1, {"ngram": 0.01})[0] for _ in range(30)]  # below min_acceptance: held at 0
    assert ks == ([0] * 9 + [2]) * 3  # one probing step every 10, with probe_k drafts
    assert p.state()["probes"] == 3
    off = make_policy({"name": "goodput", "probe_interval_steps": 0})
    assert [step(off, 1, {"ngram": 0.01})[0] for _ in range(30)] == [0] * 30


def test_goodput_probes_with_one_request_not_the_whole_batch() -> None:
    """A probe refreshes one proposer's acceptance: one request's drafts do that, and a whole batch of
    32 drafting would triple that step's tokens. The probed request is the first that can draft."""
    p = make_policy({"name": "goodput", "probe_interval_steps": 10, "probe_k": 2})
    steps = [step(p, 32, {"ngram": 0.01}) for _ in range(30)]
    probes = [ks for ks in steps if any(ks)]
    assert len(probes) == 3 == p.num_probes
    assert all(ks == [2] + [0] * 31 for ks in probes)
    batch = cands(4, k_max=0)[:2] + cands(2, speculation="off") + cands(3)  # ended, opted out, can draft
    for _ in range(9):
        p.decide(snap(7, {"ngram": 0.01}), batch)
    assert p.decide(snap(7, {"ngram": 0.01}), batch) == [0, 0, 0, 0, 2, 0, 0]


def test_goodput_step_detail_says_why() -> None:
    """policy_trace keeps this per step: the batch, K, and the predicted goodput of every K."""
    p = make_policy({"name": "goodput", "probe_interval_steps": 3, "probe_k": 2})
    feed(p, lambda x: 0.05 + 0.001 * x)
    ks = step(p, 2, {"ngram": 0.9}, k_max=4)
    d = p.step_detail()["ngram"]
    assert d["batch"] == 2 and d["k"] == ks[0] > 0 and len(d["goodput"]) == 5  # K = 0..4
    assert max(d["goodput"]) == d["goodput"][d["k"]]
    details = []
    for _ in range(3):  # held at 0 by the floor: no prediction, and the third decision is a probe
        step(p, 2, {"ngram": 0.01}, k_max=4)
        details.append(p.step_detail())
    assert details == [{}, {}, {"ngram": {"probe_k": 2}}]
    assert make_policy({"name": "never"}).step_detail() == {}


def test_goodput_state_and_describe() -> None:
    p = make_policy({"name": "goodput", "switch_margin": 0.1})
    step(p, 1, {"ngram": 0.7})
    d = p.describe()
    assert d["name"] == "goodput" and d["parameters"]["switch_margin"] == 0.1
    assert "ngram" in p.state()["k"]


# ----------------------------------------------------------------------------- registry / config


@pytest.mark.parametrize(
    "config",
    [
        {"name": "never"},
        {"name": "always", "num_speculative_tokens": 2},
        {"name": "threshold", "t": 3},
        {"name": "threshold", "t_low": 1, "t_high": 6, "min_dwell_s": 0.5},
        {"name": "k_table", "table": {4: 4, 8: 2}, "default_k": 1},
        {"name": "goodput", "switch_margin": 0.1, "allow_request_override": False},
    ],
)
def test_config_dump_round_trips(config: dict) -> None:
    """The router ships model_dump(mode="json") to the target replicas, which rebuild the policy from it."""
    p = make_policy(config)
    again = make_policy(p.config.model_dump(mode="json"))
    assert type(again) is type(p) and again.config == p.config


def test_unknown_key_and_name() -> None:
    with pytest.raises(ValidationError, match="t_lo"):
        make_policy({"name": "threshold", "t_lo": 2})
    with pytest.raises(ValidationError, match="switch_margn"):
        make_policy({"name": "goodput", "switch_margn": 0.1})
    with pytest.raises(ValueError, match="known policies: always, goodput, k_table, never, threshold"):
        make_policy({"name": "sometimes"})


def test_policy_config_embeds_in_app_config() -> None:
    class App(BaseModel):
        policy: PolicyConfig

    app = App.model_validate({"policy": {"name": "threshold", "t_low": 2, "t_high": 4}})
    p = make_policy(app.policy)
    assert isinstance(p, ThresholdPolicy) and p.describe()["parameters"]["t_high"] == 4
    with pytest.raises(ValidationError, match="sometimes"):
        App.model_validate({"policy": {"name": "sometimes"}})


def test_policies_never_import_ray() -> None:
    code = "import sys, policies, policies.registry; assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).resolve().parents[1])


def test_goodput_shares_a_cost_model_across_policy_swaps() -> None:
    """The target worker owns the step-cost model; a goodput policy deployed later predicts from it."""
    shared = StepCostModel()
    for _ in range(5):  # measured while another policy (never) was live
        for x in (1, 2, 5, 64):
            shared.observe(x, 0.04 + 0.002 * x)
    p = make_policy({"name": "goodput", "prior_base_s": 0.2, "cost_decay": 0.9})
    p.use_cost_model(shared)
    assert p.cost_model is shared and shared.prior_base_s == 0.2 and shared.decay == 0.9
    assert p.cost_model.measured(2) == pytest.approx(0.044)
    n = shared.num_samples
    p.observe_step(3, 0.05)  # the owner feeds a shared model; the policy must not count a step twice
    assert shared.num_samples == n
    own = make_policy({"name": "goodput"})
    own.observe_step(3, 0.05)
    assert own.cost_model.num_samples == 1


def test_goodput_baseline_measurement_is_bounded_when_prefill_rides_along() -> None:
    """Under steady arrivals every plain step may carry a prefill chunk (a bigger token count), so
    the plain cost at this batch size may never be measured: a few tries, then trust the line.
    And the tries are spent only on a close call: a clear win speculates from the first step."""
    from policies.goodput import BASELINE_TRIES

    def run(acceptance: float) -> list[int]:
        p = make_policy({"name": "goodput", "probe_interval_steps": 0})
        for x in (64, 128, 256):
            for _ in range(3):
                p.observe_step(x, 0.03 + 0.0016 * x)
        ks = []
        for _ in range(20):
            k = step(p, 8, {"ngram": acceptance})[0]
            ks.append(k)
            p.observe_step(8 * (k + 1) + 32, 0.05 + 0.002 * (8 * (k + 1) + 32))  # always with a 32-token chunk
        return ks

    close = run(0.5)  # the line says K=1 beats plain by ~15%: worth measuring plain first
    assert close[:BASELINE_TRIES] == [0] * BASELINE_TRIES and min(close[BASELINE_TRIES:]) > 0
    assert min(run(0.9)) > 0  # ~2x by the line: no error in the plain estimate could flip it


@pytest.mark.parametrize("name", known_policies())
def test_every_policy_drafts_the_grammar_forced_tokens(name):
    """Grammar-forced drafts cost no proposer work and are nearly always accepted: every policy takes at
    least them, with or without a proposer and at any load, unless the request is held plain."""
    p = make_policy({"name": name})
    at_load = snap(64, {"ngram": 0.0})  # where no policy speculates on its own
    forced = [
        SpecCandidate("a", "ngram", "auto", 4, forced=3),
        SpecCandidate("b", None, "auto", 0, forced=5),
        SpecCandidate("c", "ngram", "off", 4, forced=3),
        SpecCandidate("d", "ngram", "auto", 4),
    ]
    ks = p.decide(at_load, forced)
    assert ks[0] >= 3 and ks[1] == 5 and ks[2] == 0
    assert ks[3] == p.decide(at_load, [forced[3]])[0]  # a request without forced tokens is decided as before
