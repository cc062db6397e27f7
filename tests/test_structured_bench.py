"""The structured-output benchmark's arithmetic and report helpers, on hand-written numbers: arm order, the
request plan, validity, per-round ratios and their spread, engine-stat deltas, acceptance, grammar cost, the
token-for-token check, paired TPOT ratios and the goals."""

from __future__ import annotations

import math

import pytest

from benchmarks.common import RequestRecord, RunResult
from benchmarks.structured.structured_bench import (
    Item,
    Run,
    acceptance,
    add_counts,
    arm_order,
    best_speed,
    check_valid,
    compare_outputs,
    concat_runs,
    cores,
    finish_counts,
    first_mismatch,
    goals,
    grammar_cost,
    paired_ratio,
    rotated,
    round_ratios,
    spread,
    stats_delta,
    user_turn,
    work_plan,
)

SCHEMA = {
    "type": "object",
    "properties": {"age": {"type": "integer", "maximum": 150}},
    "required": ["age"],
    "additionalProperties": False,
}


def test_arm_order_reverses_every_other_round():
    arms = ("plain", "default", "grammar_only")
    assert arm_order(arms, 0) == ["plain", "default", "grammar_only"]
    assert arm_order(arms, 1) == ["grammar_only", "default", "plain"]
    assert arm_order(arms, 2) == arm_order(arms, 0)


def test_rotated_starts_each_arm_first_in_turn():
    arms = ["plain", "default", "grammar_only"]
    assert [rotated(arms, j)[0] for j in range(4)] == ["plain", "default", "grammar_only", "plain"]
    assert rotated(arms, 1) == ["default", "grammar_only", "plain"]


def test_work_plan_cycles_the_suite_and_marks_repeats():
    assert work_plan(3, 7) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]
    assert user_turn("Give JSON.", 0) == "Give JSON."
    assert user_turn("Give JSON.", 2) == "Request 3: Give JSON."


@pytest.mark.parametrize(
    "text,ok,why",
    [
        ('{"age": 30}', True, None),
        ('{"age": 300}', False, "schema"),
        ('{"age": 3', False, "JSON"),  # cut at max_tokens
        ('{"age": 30, "x": 1}', False, "schema"),
    ],
)
def test_check_valid(text, ok, why):
    got, reason = check_valid(text, SCHEMA)
    assert got is ok
    assert (reason is None) if ok else reason.startswith(why)


def test_round_ratios_divide_by_the_same_rounds_baseline_and_spread_is_median_and_range():
    rounds = [
        {"plain": 50.0, "default": 100.0, "ngram_only": 45.0},
        {"plain": 40.0, "default": 60.0, "ngram_only": 40.0},
        {"plain": 20.0, "default": 36.0, "ngram_only": 21.0},
    ]
    r = round_ratios(rounds)
    assert set(r) == {"default", "ngram_only"}
    assert r["default"] == [2.0, 1.5, 1.8]
    assert r["ngram_only"] == [0.9, 1.0, 1.05]
    assert spread(r["default"]) == {"median": 1.8, "min": 1.5, "max": 2.0, "values": [2.0, 1.5, 1.8]}
    s = spread([float("nan"), 1.2, None])
    assert (s["median"], s["min"], s["max"]) == (1.2, 1.2, 1.2)
    assert spread([])["median"] is None


def test_stats_delta_keeps_what_the_run_added():
    before = {
        "ngram": {
            "num_drafts": 10,
            "num_draft_tokens": 40,
            "num_accepted_tokens": 12,
            "spec_steps": 10,
            "plain_steps": 5,
            "acceptance_rate": 0.3,
        }
    }
    after = {
        "ngram": {
            "num_drafts": 14,
            "num_draft_tokens": 52,
            "num_accepted_tokens": 20,
            "spec_steps": 14,
            "plain_steps": 9,
            "acceptance_rate": 0.38,
        },
        "grammar": {
            "num_drafts": 6,
            "num_draft_tokens": 30,
            "num_accepted_tokens": 29,
            "spec_steps": 6,
            "plain_steps": 0,
        },
        "suffix": {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "spec_steps": 0, "plain_steps": 0},
    }
    d = stats_delta(before, after)
    assert d == {
        "ngram": {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 8, "spec_steps": 4, "plain_steps": 4},
        "grammar": {
            "num_drafts": 6,
            "num_draft_tokens": 30,
            "num_accepted_tokens": 29,
            "spec_steps": 6,
            "plain_steps": 0,
        },
    }  # a bucket with nothing new is left out; rates are not subtracted
    two = add_counts(d, {"grammar": {"num_drafts": 4, "num_draft_tokens": 10, "num_accepted_tokens": 10}})
    assert two["grammar"]["num_drafts"] == 10 and two["grammar"]["num_accepted_tokens"] == 39
    assert d["grammar"]["num_drafts"] == 6  # add_counts copies


def test_acceptance_rate_and_length():
    a = acceptance({"num_drafts": 6, "num_draft_tokens": 30, "num_accepted_tokens": 27})
    assert a["acceptance_rate"] == pytest.approx(0.9)
    assert a["mean_acceptance_length"] == pytest.approx(1 + 27 / 6)
    none = acceptance(None)
    assert none["draft_tokens"] == 0 and none["acceptance_rate"] is None and none["mean_acceptance_length"] is None


def test_grammar_cost():
    c = grammar_cost(grammar_s=0.5, mask_s=0.2, step_s=10.0, steps=250, out_tokens=1000)
    assert c["grammar_ms_per_step"] == pytest.approx(2.0)
    assert c["grammar_share"] == pytest.approx(0.05)
    assert c["mask_us_per_token"] == pytest.approx(200.0)
    assert grammar_cost(0.0, 0.0, 0.0, 0, 0) == {
        "grammar_ms_per_step": None,
        "grammar_share": None,
        "mask_us_per_token": None,
    }


def test_outputs_compared_token_for_token():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2  # a shorter output differs where it ends
    same, bad = compare_outputs({"a#0": [1, 2], "b#0": [3, 4], "c#0": [5]}, {"a#0": [1, 2], "b#0": [3, 9], "c#0": [5]})
    assert same == 2
    assert bad == ["b#0: differs at token 1 (2 vs 2 tokens)"]


def test_paired_ratio_uses_the_requests_both_runs_have():
    beside = {"m0": 0.033, "m1": 0.036, "m2": float("nan"), "m3": 0.1}
    alone = {"m0": 0.030, "m1": 0.030, "m2": 0.030}
    assert paired_ratio(beside, alone) == pytest.approx((0.033 + 0.036) / 2 / 0.030)
    assert paired_ratio({}, alone) is None


def test_finish_counts():
    assert finish_counts(["stop", "length", "stop", None]) == "stop 2, length 1, None 1"


def test_goals_report_value_and_verdict():
    rows = goals(
        {
            "valid_rate": {"greedy/plain/c=1": 1.0, "greedy/default/c=16": 30 / 32},
            "heavy_c1": 1.62,
            "c16": 0.95,
            "grammar_share_c16": 0.031,
            "neighbours": None,
        }
    )
    by = {r["goal"].split(" (")[0].split(" at ")[0]: r for r in rows}
    valid = by["valid outputs = 100%"]
    assert valid["value"] == pytest.approx(30 / 32) and valid["met"] is False and valid["note"] == "greedy/default/c=16"
    assert [r["met"] for r in rows[1:]] == [True, False, True, None]
    assert rows[1]["note"] == "" and rows[4]["met"] is None
    with_best = goals({"valid_rate": {}, "heavy_c1": 1.4, "heavy_c1_best": 1.61, "c16": None, "c16_best": None})
    assert with_best[0]["value"] is None and with_best[0]["met"] is None
    assert with_best[1]["met"] is False and with_best[1]["note"] == "best of rounds 1.61"
    assert with_best[2]["met"] is None and with_best[2]["note"] == ""
    assert not any(isinstance(r["value"], float) and math.isnan(r["value"]) for r in rows)


def _one(tokens: int, wall: float, cpu: float, grammar: dict) -> Run:
    rec = RequestRecord(
        index=0,
        prompt_len=5,
        submit_s=0.0,
        first_token_s=0.1,
        finish_s=wall,
        token_ids=[7] * tokens,
        num_steps=tokens,
        finish_reason="stop",
    )
    return Run(
        "r",
        wall,
        step_s=wall - 0.05,
        steps=tokens,
        cpu_s=cpu,
        fed_tokens=2 * tokens,
        grammar_s=0.01,
        mask_s=0.004,
        fill_s=0.001,
        stats={"grammar": grammar},
        lanes={"cell": RunResult("cell", 1, wall, [rec])},
    )


def test_concat_runs_sums_a_c1_cell_run_request_by_request():
    items = [Item("a#0", [1, 2], {}), Item("b#0", [3], {})]
    g = {"num_drafts": 2, "num_draft_tokens": 8, "num_accepted_tokens": 8}
    run = concat_runs("cell", [_one(10, 0.5, 0.9, g), _one(30, 1.5, 2.1, g)], items)
    assert run.wall_s == 2.0 and run.steps == 40 and run.fed_tokens == 80
    assert run.grammar_s == pytest.approx(0.02) and run.mask_s == pytest.approx(0.008)
    assert run.fill_s == pytest.approx(0.002)
    assert run.stats == {"grammar": {"num_drafts": 4, "num_draft_tokens": 16, "num_accepted_tokens": 16}}
    assert [r.index for r in run.lanes["cell"].records] == [0, 1]  # record i is item i
    assert run.lanes["cell"].tok_s == pytest.approx(20.0)
    assert cores(run) == pytest.approx(3.0 / 2.0)  # CPU seconds per wall second: one core taken by other jobs


def test_best_speed_keeps_each_requests_fastest_round():
    r0 = [(10, 1.0), (30, 9.0)]  # request 1 hit a load burst in round 0
    r1 = [(10, 2.0), (30, 3.0)]
    assert best_speed([r0, r1]) == pytest.approx(40 / (1.0 + 3.0))
    assert best_speed([r0]) == pytest.approx(40 / 10.0)
    assert math.isnan(best_speed([]))
