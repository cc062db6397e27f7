"""The switchback benchmark's bookkeeping (benchmarks/serving/switchback.py): which mode a token, a gap or
a first token belongs to, and the ratio the issue-5 bar is judged on. Pure functions, no cluster."""

from __future__ import annotations

import collections

import pytest

from benchmarks.serving.switchback import client_metrics, rotation, summarize, versus_best, window_delta

MODES = ["never", "always", "goodput"]


def test_rotation_balances_position_and_carry_over():
    order = rotation(MODES, 6)
    assert [m for r, m in order if r == 0] == MODES
    for r in range(6):  # every round runs every mode once
        assert sorted(m for rr, m in order if rr == r) == sorted(MODES)
    firsts = collections.Counter(m for i, (r, m) in enumerate(order) if i == 0 or order[i - 1][0] != r)
    assert set(firsts.values()) == {2}  # each mode opens two rounds
    # every ordered pair (previous, next), round boundaries included, 2 or 3 times; never a mode twice in a row
    follows = collections.Counter((order[i - 1][1], m) for i, (_, m) in enumerate(order) if i)
    assert all(a != b for a, b in follows), follows
    assert len(follows) == 6 and set(follows.values()) <= {2, 3}, follows
    assert rotation(MODES, 3) == order[:9]  # a shorter run is a prefix: deterministic


def snap(tokens: int, ts: float, spec: int = 0, plain: int = 0) -> dict:
    return {"output_tokens": tokens, "timestamp": ts, "spec_request_steps": spec, "plain_request_steps": plain}


def test_window_rate_is_each_replicas_own_rate_over_its_snapshot_times():
    a = {"r1": snap(1000, 10.0, 5, 7), "r2": snap(500, 10.2), "gone": snap(9, 10.0), "restarted": snap(800, 10.0)}
    b = {"r1": snap(1600, 16.0, 25, 17), "r2": snap(800, 16.2), "new": snap(50, 16.0), "restarted": snap(30, 16.0)}
    d = window_delta(a, b)
    # r1: 600 tokens in 6.0 s of its own clock; r2: 300 in 6.0 s. A replica seen in one read only,
    # or whose counter went back (restarted), is left out rather than counted as a burst or a loss.
    assert d["tok_s"] == pytest.approx(100.0 + 50.0)
    assert d["tokens"] == 900 and d["seconds"] == pytest.approx(6.0)
    assert (d["spec_request_steps"], d["plain_request_steps"]) == (20, 10)


def window(mode: str, rnd: int, tok_s: float, t0: float, seconds: float = 6.0) -> dict:
    return {
        "mode": mode,
        "round": rnd,
        "t_switch": t0,
        "t_a": t0 + 2,
        "t_b": t0 + 2 + seconds,
        "tok_s": tok_s,
        "seconds": seconds,
        "spec_request_steps": 1,
        "plain_request_steps": 1,
        "view_age_max_ms": 60.0,
    }


def test_latencies_go_to_the_window_they_happen_in():
    ws = [window("never", 0, 10, 0.0), window("always", 0, 20, 8.0)]  # measured: [2, 8] and [10, 16]
    records = [
        # sent at 0.5 under never: first chunk at 2.5 (in never's window), chunks run on into always's
        {"t0": 0.5, "chunks": [2.5, 3.0, 9.0, 11.0, 11.5], "tokens": 5},
        # sent under never, first chunk in always's washout: no TTFT for anyone; its gap ending at 12 is always's
        {"t0": 7.0, "chunks": [9.5, 12.0], "tokens": 2},
        # sent after always's switch: its TTFT is always's
        {"t0": 8.5, "chunks": [10.25, 10.5], "tokens": 2},
        {"error": 500},
    ]
    never, always = client_metrics(ws, records, "never"), client_metrics(ws, records, "always")
    assert never["gaps"] == 1 and never["itl_p50_ms"] == pytest.approx(500)  # 2.5 -> 3.0; 3.0 -> 9.0 ends in a washout
    assert always["gaps"] == 4  # 9.0 -> 11.0, 11.0 -> 11.5, 9.5 -> 12.0, 10.25 -> 10.5
    assert never["ttft_p50_ms"] == pytest.approx(2000) and always["ttft_p50_ms"] == pytest.approx(1750)


def test_bar_pooled_over_all_windows_and_paired_within_rounds():
    ws = []
    t = 0.0
    # a machine that slows down by half in round 2: goodput level with always within every round
    for rnd, speed in enumerate([1.0, 1.0, 0.5]):
        for _, mode in rotation(MODES, 3)[3 * rnd : 3 * rnd + 3]:
            rate = {"never": 50.0, "always": 80.0, "goodput": 80.0}[mode] * speed
            ws.append(window(mode, rnd, rate, t, seconds=6.0 if mode != "goodput" else 3.0 + 3 * rnd))
            t += 8
    s = summarize(ws, [])
    assert s["always"]["tok_s_rounds"] == [80.0, 80.0, 40.0]
    # pooled = all tokens / all seconds, so a mode that spent more of its time in the slow round reads lower
    assert s["always"]["tok_s"] == pytest.approx((80 * 6 + 80 * 6 + 40 * 6) / 18)
    assert s["goodput"]["tok_s"] == pytest.approx((80 * 3 + 80 * 6 + 40 * 9) / 18)
    pooled, paired = versus_best(ws, "goodput", ("never", "always"))
    assert pooled == pytest.approx(s["goodput"]["tok_s"] / s["always"]["tok_s"])
    assert paired == pytest.approx(1.0)  # within each round goodput matched always
    assert versus_best([w for w in ws if w["mode"] != "never"], "goodput", ("never", "always")) == (None, None)
