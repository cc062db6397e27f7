"""The goodput policy's online step-cost model (workers/cost_model.py): pure Python, no model."""

from __future__ import annotations

import pytest

from policies import StepCostModel, make_policy
from workers.decision import SpecCandidate
from workers.stats import LoadSnapshot


def test_cost_model_priors_then_fit() -> None:
    m = StepCostModel(prior_base_s=0.05, prior_per_token_s=0.003, min_samples=4, decay=1.0)
    assert m.predict(10) == pytest.approx(0.08)
    for x in (1, 8, 16, 32, 64):
        m.observe(x, 0.01 + 0.002 * x)
    c0, c1 = m.coefficients()
    assert c0 == pytest.approx(0.01, rel=1e-2) and c1 == pytest.approx(0.002, rel=1e-2)


def test_cost_model_forgets_and_handles_one_token_count() -> None:
    m = StepCostModel(min_samples=4, decay=0.5)
    for _ in range(10):
        for x in (1, 32):
            m.observe(x, 0.05)  # flat
    for _ in range(20):
        for x in (1, 32):
            m.observe(x, 0.01 * x)  # steep: the old regime must fade
    assert m.coefficients()[1] == pytest.approx(0.01, rel=1e-2)  # the flat fit had slope 0
    same = StepCostModel(prior_per_token_s=0.004, min_samples=2)
    for _ in range(10):
        same.observe(8, 0.1)  # slope unidentifiable: the prior slope is used, the level is fitted
    c0, c1 = same.coefficients()
    assert c1 == pytest.approx(0.004) and c0 + 8 * c1 == pytest.approx(0.1)


def test_cost_model_table_overrides_the_line_where_measured() -> None:
    m = StepCostModel(min_samples=2, decay=1.0, bucket_min_samples=2)
    for _ in range(5):  # a CPU whose 2-token step costs 1.4x its 1-token step, then linear
        m.observe(1, 0.043)
        m.observe(2, 0.061)
        for x in (64, 128, 256):
            m.observe(x, 0.03 + 0.0016 * x)
    assert m.predict(1) == pytest.approx(0.043) and m.predict(2) == pytest.approx(0.061)
    c0, c1 = m.coefficients()
    assert m.predict(3) == pytest.approx(c0 + 3 * c1)  # unmeasured: the line
    assert m.predict(40) == pytest.approx(c0 + 40 * c1)
    assert m.predict(128) == pytest.approx(0.03 + 0.0016 * 128)  # its bucket
    assert m.as_dict()["measured_s_by_bucket"]["2"] == pytest.approx(0.061)
    line_only = StepCostModel(min_samples=2, decay=1.0, bucket_min_samples=0)
    for _ in range(5):
        line_only.observe(1, 0.043)
        line_only.observe(2, 0.061)
    assert line_only.measured(2) is None


def test_cost_model_buckets() -> None:
    from workers.cost_model import bucket

    assert [bucket(t) for t in (1, 2, 31, 32)] == [1, 2, 31, 32]
    assert bucket(33) == bucket(38) != bucket(39)  # quarter octaves above 32
    assert bucket(256) > bucket(128) > bucket(64) > bucket(33)


def test_cost_model_prices_equal_token_counts_per_batch_size() -> None:
    """35 tokens as 7 requests x (K=4 + 1) is not 35 tokens as 2 requests plus a prefill chunk.

    Measured on the copy mix at c=16: the token-keyed bucket priced B=7, K=4 at 165 ms (steps
    with prefill and other batch sizes in it) against 124 ms for B=7 decode-only steps, so goodput
    drafted K=3 where K=4 was better. Asked per batch size, it must read only B=7 measurements.
    """
    m = StepCostModel(min_samples=4, decay=1.0)
    for _ in range(3):
        m.observe(7, 0.080, requests=7)  # plain step of 7 requests
        m.observe(28, 0.104, requests=7)  # K=3
        m.observe(35, 0.124, requests=7)  # K=4
        for x in (64, 128, 256):
            m.observe(x, 0.03 + 0.0016 * x)  # prefill chunks: the line
    for _ in range(6):
        m.observe(35, 0.200)  # 35-token steps with prefill riding along: the token-keyed bucket
    assert m.predict(35, requests=7) == pytest.approx(0.124)
    assert m.predict(35) > 0.18  # the token-keyed table mixes compositions
    c0, c1 = m.coefficients()
    assert m.predict(35, requests=5) == pytest.approx(c0 + 35 * c1)  # unmeasured at this batch size: the line
    assert m.as_dict()["measured_s_by_batch_bucket"]["7x28"] == pytest.approx(0.104)

    p = make_policy({"name": "goodput", "probe_interval_steps": 0})
    p.use_cost_model(m)
    s = LoadSnapshot(
        running=7, decoding=7, acceptance_ema={"ngram": 0.99}, acceptance_pos_ema={"ngram": [1.0, 1.0, 0.99, 0.99]}
    )
    batch = [SpecCandidate(f"r{i}", "ngram", "auto", 4) for i in range(7)]
    assert p.decide(s, batch) == [4] * 7  # by the token-keyed table it would be 3 (0.104 s vs 0.2 s)
    assert 7 * 4.9 / 0.124 > 7 * 3.94 / 0.104 > 7 * 4.9 / 0.2  # why: K=4 wins only at its own batch size's cost


def test_cost_model_curve_per_batch_is_monotone_and_interpolates() -> None:
    """At a fixed batch size a token more never costs less: gaps between measured counts are
    interpolated, counts beyond them extrapolated from the last one with the line's slope."""
    m = StepCostModel(min_samples=4, decay=1.0)
    for _ in range(3):
        for x in (64, 128, 256):
            m.observe(x, 0.05 + 0.001 * x)  # prefill chunks: a line far below this batch's steps
        for t, s in ((8, 0.150), (10, 0.190), (12, 0.170)):  # 12 measured below 10: noise
            m.observe(t, s, requests=8)
    c0, c1 = m.coefficients()
    curve = [m.predict(t, requests=8) for t in range(8, 41)]
    assert all(b >= a for a, b in zip(curve, curve[1:]))
    assert m.predict(8, requests=8) == pytest.approx(0.150)
    assert m.predict(9, requests=8) == pytest.approx(0.170)  # between 8 and 10
    assert m.predict(12, requests=8) == pytest.approx(0.190)  # never below 10's cost
    slope = m.draft_token_s  # verify steps over the plain step: (0.19 - 0.15) / 2 and (0.17 - 0.15) / 4
    assert 0.005 < slope < 0.02 and slope > c1
    assert m.predict(20, requests=8) == pytest.approx(0.190 + 8 * slope)  # beyond: from the last count's cost
    assert c0 + 20 * c1 < 0.170  # which the line alone prices below the measured 9-12 token steps
    assert m.predict(4, requests=2) == pytest.approx(c0 + 4 * c1)  # nothing measured at this batch: the line
    m.observe(9, 0.3, requests=8)
    m.observe(9, 0.3, requests=8)
    assert m.predict(9, requests=8) == pytest.approx(0.3)  # a new observation rebuilds the cached curve


def test_goodput_does_not_price_unmeasured_verifies_below_the_batchs_plain_step() -> None:
    """Measured over HTTP, chat mix, c=8: plain B=8 steps cost ~157 ms and verifies with 1-5
    drafted tokens 173-232 ms, while the line, fitted over prefill chunks too, said ~186 ms for
    14 tokens. Pricing the unmeasured counts by the line made K=4 look best at 32% n-gram
    acceptance, and every such step lost. From the batch's own curve, plain wins."""
    m = StepCostModel(min_samples=4, decay=1.0)
    for _ in range(3):
        for x in (64, 128, 256):
            m.observe(x, 0.09 + 0.0024 * x)
        for t, s in ((8, 0.157), (9, 0.187), (10, 0.194), (12, 0.173), (13, 0.232)):
            m.observe(t, s, requests=8)
    p = make_policy({"name": "goodput", "probe_interval_steps": 0})
    p.use_cost_model(m)
    s = LoadSnapshot(
        running=8,
        decoding=8,
        acceptance_ema={"ngram": 0.325},
        proposal_rate_ema={"ngram": 0.32},
        acceptance_pos_ema={"ngram": [0.325, 0.6, 0.8, 0.8]},
    )
    batch = [SpecCandidate(f"r{i}", "ngram", "auto", 4) for i in range(8)]
    assert p.decide(s, batch) == [0] * 8  # by the line for 14+ tokens it was [4] * 8
    c0, c1 = m.coefficients()
    assert c0 + c1 * 16 < 0.2  # the line's price of 16 tokens, below the measured 13-token step


def test_a_batch_size_seen_only_in_plain_steps_is_priced_with_the_draft_token_slope() -> None:
    """The line over prefill chunks is nearly flat, so by the line drafted tokens would be free and
    every new batch size would explore speculation. The slope measured on verify steps of other
    batch sizes prices them at once: at 30% acceptance goodput stays plain without trying."""
    m = StepCostModel(min_samples=4, decay=1.0)
    for _ in range(3):
        for x in (64, 128, 256):
            m.observe(x, 0.15 + 0.0001 * x)  # prefill chunks: flat
        m.observe(6, 0.120, requests=6)
        m.observe(10, 0.140, requests=6)  # 4 drafted tokens: +5 ms each
        m.observe(9, 0.140, requests=9)  # batch 9: plain steps only
    assert m.draft_token_s == pytest.approx(0.005)
    assert m.predict(13, requests=9) == pytest.approx(0.140 + 4 * 0.005)
    c0, c1 = m.coefficients()
    assert c1 < 0.001 and c0 + c1 * 13 < 0.16  # the line: 4 more tokens nearly free
    p = make_policy({"name": "goodput", "probe_interval_steps": 0})
    p.use_cost_model(m)
    s = LoadSnapshot(running=9, decoding=9, acceptance_ema={"ngram": 0.3})
    assert p.decide(s, [SpecCandidate(f"r{i}", "ngram", "auto", 4) for i in range(9)]) == [0] * 9
    s = LoadSnapshot(running=9, decoding=9, acceptance_ema={"ngram": 0.95})
    assert p.decide(s, [SpecCandidate(f"r{i}", "ngram", "auto", 4) for i in range(9)]) == [4] * 9  # and still wins


def test_a_slow_spell_seen_on_plain_steps_rescales_the_verify_steps() -> None:
    """Measured over HTTP, chat mix, c=4: the same plain B=4 step cost 54 ms in one 10 s cell and
    68 ms in the next (2 shared cores). The verify entries measured in the fast cell kept their
    values, the plain entry took the slow one, and by the monotone curve a verify of up to 4
    drafted tokens looked free: goodput drafted on half the steps and lost 4% to ``never``. Verify
    steps are priced relative to the plain step now, so the choice of K is the one made before."""
    m = StepCostModel(min_samples=4, decay=0.98)
    for _ in range(20):  # a fast spell with verify steps of every size: +3.2 ms per drafted token
        for t in range(4, 21):
            m.observe(t, 0.054 + 0.0032 * (t - 4), requests=4)
        m.observe(200, 0.3)  # a prefill chunk
    p = make_policy({"name": "goodput", "probe_interval_steps": 0, "switch_margin": 0.0})
    p.use_cost_model(m)
    s = LoadSnapshot(
        running=4,
        decoding=4,
        acceptance_ema={"ngram": 0.1},
        proposal_rate_ema={"ngram": 0.37},
        acceptance_pos_ema={"ngram": [0.15, 0.6, 0.7, 0.8]},
    )
    batch = [SpecCandidate(f"r{i}", "ngram", "auto", 4) for i in range(4)]
    assert p.decide(s, batch) == [0] * 4  # K = 1: 5.5% more tokens for 9% more time: plain
    for _ in range(30):
        m.observe(4, 0.068, requests=4)  # a slow spell: plain steps only, 26% slower
    assert m.predict(8, requests=4) == pytest.approx((0.054 + 4 * 0.0032) * 0.068 / 0.054, rel=0.01)
    assert m.as_dict()["verify_over_plain_by_batch_bucket"]["4x8"] == pytest.approx(1 + 4 * 0.0032 / 0.054, rel=0.01)
    p.current.clear()
    assert p.decide(s, batch) == [0] * 4  # by the stale verify entries, K = 2 was 7% better than plain


def test_noise_does_not_move_a_rare_verify_price_against_the_plain_one() -> None:
    """Noisy steps (15% jitter, a 2x stall now and then, the machine 25% slower every other 500
    steps), the plain step seen on 90% of steps and a verify on 10%: the verify's price next to
    the plain one stays its true 1.3x (a design that split each drift between a machine-wide speed
    factor and still-learning entries let the two wander apart: 1.08x here)."""
    import random

    rng = random.Random(0)
    m = StepCostModel(min_samples=4)
    seen = []  # the priced ratio every 50 steps over the second half (one reading is a ~5-sample EMA)
    for i in range(4000):
        spell = 1.25 if (i // 500) % 2 else 1.0
        tokens = 8 if rng.random() < 0.1 else 4
        stall = 2.0 if rng.random() < 0.02 else 1.0
        m.observe(tokens, spell * stall * (0.05 if tokens == 4 else 0.065) * rng.lognormvariate(0, 0.15), requests=4)
        if i >= 2000 and i % 50 == 0:
            seen.append(m.predict(8, requests=4) / m.predict(4, requests=4))
    assert sum(seen) / len(seen) == pytest.approx(1.3, rel=0.03)


def test_prompt_tokens_are_priced_on_top_of_the_decode_part_of_the_step():
    """Mixed steps teach the per-prompt-token cost once the batch's plain step is known; prefill-only
    steps teach it over the fixed cost of a step. predict_step adds it to the decode part."""
    m = StepCostModel(min_samples=4, decay=1.0)
    for _ in range(3):
        m.observe(1, 0.020, requests=1)  # plain step of one request: the fixed cost
        m.observe(4, 0.030, requests=4)  # plain step of four
    m.observe(4 + 100, 0.080, requests=4, prefill_tokens=100)  # 50 ms over the plain step: 0.5 ms per prompt token
    assert m.prefill_token_s == pytest.approx(0.0005)
    for _ in range(50):
        m.observe(200, 0.020 + 0.0005 * 200, requests=0, prefill_tokens=200)  # prompts alone
    assert m.prefill_per_token_s() == pytest.approx(0.0005)
    assert m.predict_step(4, 4, 60) == pytest.approx(0.030 + 0.030)
    assert m.predict_step(0, 0, 60) == pytest.approx(0.020 + 0.030)
    assert "4x4" in m.as_dict()["measured_s_by_batch_bucket"]  # mixed steps never enter the per-batch table
    m.observe(8 + 10, 0.5, requests=8, prefill_tokens=10)  # batch 8 never ran plain: the decode part is unknown
    assert m.prefill_token_s == pytest.approx(0.0005)
