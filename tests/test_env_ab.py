"""benchmarks/serving/env_ab.py's pure parts: the arm's environment, the alternating order, the paired ratios."""

from __future__ import annotations

import pytest

from benchmarks.serving.env_ab import order, paired, parse_env, path_cpu_ms


def test_parse_env_reads_var_value_words_and_names_a_bad_one():
    assert parse_env("A=1 B=x=y  C=") == {"A": "1", "B": "x=y", "C": ""}
    assert parse_env("") == {}
    with pytest.raises(SystemExit, match="'oops'"):
        parse_env("A=1 oops")


def test_rounds_alternate_which_arm_runs_first():
    assert [order(i) for i in (1, 2, 3, 4)] == [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")]


def _profile(tok_s: dict[int, float], cpu: dict[str, float] | None = None) -> dict:
    return {"rows": [{"streams": c, "tok_s": v, "cpu_ms_per_token": cpu or {}} for c, v in tok_s.items()]}


def test_paired_ratios_are_b_over_a_within_each_round():
    rounds = [
        {"a": _profile({1: 50.0, 16: 200.0}), "b": _profile({1: 60.0, 16: 180.0})},
        {"a": _profile({1: 40.0, 16: 100.0}), "b": _profile({1: 44.0, 16: 150.0})},
        {"a": _profile({1: 50.0, 16: 300.0}), "b": _profile({1: 45.0, 16: 330.0})},
    ]
    s1 = paired(rounds, 1)
    assert s1["ratios"] == pytest.approx([1.2, 1.1, 0.9])
    assert (s1["median"], s1["min"], s1["max"], s1["b_faster"]) == (
        pytest.approx(1.1),
        pytest.approx(0.9),
        pytest.approx(1.2),
        2,
    )
    assert paired(rounds, 16)["ratios"] == pytest.approx([0.9, 1.5, 1.1])


def test_path_cpu_adds_the_ingress_proxy_and_router_only():
    p = _profile({4: 1.0}, {"ingress": 0.5, "HTTP proxy": 0.25, "Router": 0.125, "target replica": 30.0})
    assert path_cpu_ms(p, 4) == pytest.approx(0.875)
