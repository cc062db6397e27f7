"""The goodput policy's online step-cost model (policies/cost_model.py): pure Python, no model."""

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
    from policies.cost_model import bucket

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
    s = LoadSnapshot(running=7, decoding=7, acceptance_ema={"ngram": 0.99},
                     acceptance_pos_ema={"ngram": [1.0, 1.0, 0.99, 0.99]})
    batch = [SpecCandidate(f"r{i}", "ngram", "auto", 4) for i in range(7)]
    assert p.decide(s, batch) == [4] * 7  # by the token-keyed table it would be 3 (0.104 s vs 0.2 s)
    assert 7 * 4.9 / 0.124 > 7 * 3.94 / 0.104 > 7 * 4.9 / 0.2  # why: K=4 wins only at its own batch size's cost
