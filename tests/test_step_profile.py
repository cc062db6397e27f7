"""The load benchmark's step profile: served steps and in-process steps read the same way."""

from __future__ import annotations

import pytest

from benchmarks.serving.step_profile import Step, StepRecorder, compare, from_trace, since, summarize
from workers.config import EngineConfig
from workers.engine import LLMEngine


def test_trace_entries_become_steps_with_their_prompt_tokens():
    entries = [
        {"ks": [0, 0, 3], "tokens": 40, "seconds": 0.05, "requests": None},  # 3 decoding, 3 drafts, 34 prompt
        {"ks": [], "tokens": 128, "seconds": 0.2, "requests": None},  # a lone prefill
        {"ks": [0, 0], "tokens": 2, "seconds": 0.02, "requests": 2},
    ]
    steps = from_trace(entries)
    assert steps == [Step(40, 0.05, 3, 3), Step(128, 0.2, 0, 0), Step(2, 0.02, 2, 0)]
    assert [s.prompt for s in steps] == [34, 128, 0]


def test_since_takes_the_last_steps_and_says_when_the_trace_dropped_some():
    trace = [{"i": i} for i in range(10)]  # the replica keeps its last 10 steps
    assert since(trace, 100, 104) == ([{"i": 6}, {"i": 7}, {"i": 8}, {"i": 9}], False)
    assert since(trace, 100, 100) == ([], False)
    entries, truncated = since(trace, 100, 125)
    assert entries == trace and truncated


def test_summary_from_hand_written_steps():
    steps = [
        Step(16, 0.030, 16, 0),
        Step(16, 0.034, 16, 0),
        Step(48, 0.060, 16, 0),  # two decode-only, one mixed
        Step(20, 0.040, 4, 16),
        Step(128, 0.100, 0, 0),
    ]  # a verify step, a lone prefill
    s = summarize(steps)
    assert s["num_steps"] == 5
    assert s["step_ms_mean"] == pytest.approx(1e3 * (0.030 + 0.034 + 0.060 + 0.040 + 0.100) / 5)
    assert s["decode_rows_mean"] == pytest.approx((16 + 16 + 16 + 4) / 5)
    assert s["prompt_tokens_mean"] == pytest.approx((32 + 128) / 5)
    assert s["drafts_mean"] == pytest.approx(16 / 5)
    assert s["decode_only_steps"] == 2
    assert s["decode_only_step_ms_p50"] == pytest.approx(32.0)
    assert s["decode_only_rows_mean"] == 16
    assert summarize([]) == {"num_steps": 0}
    line = compare(summarize([Step(16, 0.045, 16, 0)]), summarize([Step(16, 0.030, 16, 0)]))
    assert "1.50x the time" in line and "decode-only step p50 45.0 ms at 16.0 rows vs 30.0 ms at 16.0 (1.50x)" in line
    assert compare({}, s) == "steps: not recorded"


def test_recorder_sees_every_token_the_engine_fed(tiny_loaded):
    """On a real (tiny) engine: the prompt tokens and decode rows the recorder saw add up to the
    requests' prompts and outputs, whatever the chunking."""
    eng = LLMEngine(
        EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=256, proposers=[], max_num_batched_tokens=16),
        tiny_loaded,
    )
    rec = StepRecorder(eng)
    eng.on_step = rec
    prompts = {"a": list(range(5, 45)), "b": list(range(7, 30))}  # 40 and 23 tokens: several 16-token chunks
    for rid, p in prompts.items():
        eng.add_request(rid, p, params={"max_tokens": 6, "temperature": 0, "ignore_eos": True})
    while eng.has_work():
        eng.step()
    assert len(rec.steps) == eng.num_steps and all(s.seconds > 0 for s in rec.steps)
    assert sum(s.prompt for s in rec.steps) == 40 + 23
    # every output token but each request's first (sampled at its prompt's end) is a decode row's
    assert sum(s.decode for s in rec.steps) == 2 * (6 - 1)
    assert all(s.drafts == 0 for s in rec.steps)
