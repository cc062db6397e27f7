"""The load benchmark's arithmetic: its goals from hand-written numbers, and the client-CPU burners it runs
the in-process engine beside."""

from __future__ import annotations

import time

import psutil
import pytest

from benchmarks.guidellm_load import burn_cores, goals


def _lvl(ttft_p99_ms: float, itl_p50_ms: float, tok_s: float) -> dict:
    return {"ttft_p99_ms": ttft_p99_ms, "itl_p50_ms": itl_p50_ms, "tok_s": tok_s}


def test_goals_from_hand_written_numbers():
    http = {1: _lvl(200, 40, 25), 16: _lvl(1400, 90, 120)}
    engine = {1: _lvl(100, 30, 35), 16: _lvl(800, 60, 200)}
    g = goals(http, engine)
    assert g["ttft_p99_16_s<=1.5"] == {"value": 1.4, "met": True}
    assert g["itl_p50_16/itl_p50_1<=2.5"] == {"value": 2.25, "met": True}
    assert g["tok_s_16/tok_s_1>=4.5"] == {"value": 4.8, "met": True}
    assert g["tok_s_16_http/engine>=0.8"] == {"value": 0.6, "met": False}
    assert g["tpot_1_http/engine<=1.1"] == {"value": 1.333, "met": False}
    assert goals({1: http[1]}, engine) == {"tpot_1_http/engine<=1.1": {"value": 1.333, "met": False}}


@pytest.mark.parametrize("cores,procs", [(0.0, 0), (0.4, 1), (1.5, 2)])
def test_burners_use_about_the_cores_asked(cores, procs):
    burners = burn_cores(cores)
    try:
        assert len(burners) == procs
        if procs:
            ps = [psutil.Process(b.pid) for b in burners]
            time.sleep(0.5)  # interpreter start-up
            t0 = sum(sum(p.cpu_times()[:2]) for p in ps)
            time.sleep(2.0)
            used = (sum(sum(p.cpu_times()[:2]) for p in ps) - t0) / 2.0
            assert 0.5 * cores < used < 1.3 * cores + 0.1
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert all(b.poll() is not None for b in burners)
