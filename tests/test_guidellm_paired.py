"""The paired goal benchmark's arithmetic: which passes run in which order, each round's goals against its
own engine-alone pass, and the median and range over rounds, from hand-written numbers."""

from __future__ import annotations

import pytest

from benchmarks.serving.guidellm_paired import pass_order, round_goals, step_ratio, summarize_goals


def _lvl(ttft_p99_ms: float, itl_p50_ms: float, tok_s: float, **extra) -> dict:
    return {"ttft_p99_ms": ttft_p99_ms, "itl_p50_ms": itl_p50_ms, "tok_s": tok_s, **extra}


def test_pass_order_alternates_and_bound_follows_http():
    assert pass_order(1, bound=True) == ["http", "bound", "alone", "beside"]
    assert pass_order(2, bound=True) == ["beside", "alone", "http", "bound"]
    assert pass_order(3, bound=True) == pass_order(1, bound=True)
    for r in (1, 2):
        order = pass_order(r, bound=True)
        assert order.index("bound") == order.index("http") + 1  # it burns the client CPU http just measured
        assert "bound" not in pass_order(r, bound=False) and len(pass_order(r, bound=False)) == 3


def _round(http_itl_1: float, alone_itl_1: float) -> dict:
    steady = {
        "steady_num_requests": 5,
        "steady_ttft_p50_ms": 100,
        "steady_ttft_p99_ms": 1000,
        "steady_itl_p50_ms": 2 * http_itl_1,
        "steady_itl_p99_ms": 99,
    }
    return {
        "http": {1: _lvl(200, http_itl_1, 30, **steady), 16: _lvl(3000, 90, 120, **steady)},
        "alone": {1: _lvl(100, alone_itl_1, 50), 16: _lvl(800, 55, 250)},
        "beside": {1: _lvl(120, 24, 40), 16: _lvl(900, 70, 200)},
        "bound": {},
    }


def test_each_round_divides_by_its_own_alone_pass():
    g = round_goals(_round(http_itl_1=30, alone_itl_1=20))
    assert g["http"]["tpot_1_http/engine<=1.1"] == {"value": 1.5, "met": False}
    assert g["http"]["tok_s_16_http/engine>=0.8"] == {"value": 0.48, "met": False}
    assert g["http"]["ttft_p99_16_s<=1.5"] == {"value": 3.0, "met": False}
    # the steady view swaps in the latencies of requests sent after the warm-up, tok/s stays guidellm's
    assert g["http_steady"]["ttft_p99_16_s<=1.5"] == {"value": 1.0, "met": True}
    assert g["http_steady"]["tpot_1_http/engine<=1.1"] == {"value": 3.0, "met": False}
    assert g["beside"]["tpot_1_http/engine<=1.1"] == {"value": 1.2, "met": False}
    assert "bound" not in g  # not run
    # the engine's own scaling, without the ratios to itself
    assert g["alone"] == {
        "ttft_p99_16_s<=1.5": {"value": 0.8, "met": True},
        "itl_p50_16/itl_p50_1<=2.5": {"value": 2.75, "met": False},
        "tok_s_16/tok_s_1>=4.5": {"value": 5.0, "met": True},
    }


def test_summary_is_the_median_and_range_over_rounds():
    rounds = [round_goals(_round(http_itl_1=h, alone_itl_1=20)) for h in (21, 30, 22)]
    s = summarize_goals(rounds)["http"]["tpot_1_http/engine<=1.1"]
    assert s["values"] == [1.05, 1.5, 1.1]
    assert (s["median"], s["min"], s["max"]) == (1.1, 1.05, 1.5)
    assert (s["met_rounds"], s["rounds"]) == (2, 3)


@pytest.mark.parametrize(
    "served,alone,want",
    [
        ({"decode_only_step_ms_p50": 30.0}, {"decode_only_step_ms_p50": 20.0}, 1.5),
        ({}, {"decode_only_step_ms_p50": 20.0}, None),
        ({"decode_only_step_ms_p50": 30.0}, {"decode_only_step_ms_p50": None}, None),
    ],
)
def test_step_ratio(served, alone, want):
    assert step_ratio(served, alone) == want
