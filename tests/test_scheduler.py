"""The scheduler: prompt chunks sized in time from the step-cost model, FCFS with a TTFT deadline.

Costs here are hand-written tables, and time is a simulated clock that advances by each step's
predicted cost, so the latency claims are checked exactly, not timed.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tests.test_engine import rand_prompts
from workers.config import EngineConfig
from workers.cost_model import StepCostModel
from workers.decision import fixed_k
from workers.engine import LLMEngine
from workers.kv_blocks import KVCacheManager
from workers.request import Request
from workers.sampling_params import SamplingParams
from workers.scheduler import PrefillDemand, Scheduler, SchedulerConfig, prefill_chunks


class TableCost(StepCostModel):
    """A step-cost model with fixed, hand-written costs: ``plain[B]`` seconds for a decode step of B
    requests (plus ``per_draft`` per draft token), ``fixed`` for a step of no decode rows, and
    ``per_prompt`` per prompt token on top. It learns nothing from the steps it is shown."""

    def __init__(self, plain: dict[int, float], per_prompt: float, fixed: float = 0.02, per_draft: float = 0.0):
        super().__init__()
        self.plain, self.per_prompt, self.fixed, self.per_draft = plain, per_prompt, fixed, per_draft

    def observe(self, *args, **kwargs) -> None:
        pass

    def prefill_per_token_s(self) -> float:
        return self.per_prompt

    def predict_step(self, decode_tokens: int, decoding: int, prefill_tokens: int = 0) -> float:
        base = self.plain[decoding] + self.per_draft * (decode_tokens - decoding) if decoding else self.fixed
        return base + self.per_prompt * prefill_tokens


# ------------------------------------------------------------------ the chunk choice, pure


def test_prompts_share_the_budget_first_come_first_served():
    step = lambda n: 0.05  # noqa: E731
    # 40 tokens of budget: the first prompt takes them all; the second only its deadline pace
    # (1 s / 50 ms = 20 steps left: ceil(30 / 20) = 2)
    assert prefill_chunks([PrefillDemand(100, 0.0), PrefillDemand(30, 0.0)], 40, 200, step, 1.0) == [40, 2]
    assert prefill_chunks([PrefillDemand(10, 0.0), PrefillDemand(100, 0.0)], 40, 200, step, 1.0) == [10, 30]
    assert prefill_chunks([PrefillDemand(100, 0.0)], 40, 25, step, 1.0) == [25]  # the step's hard token cap


def test_a_prompt_that_waited_takes_the_pace_of_its_deadline():
    step = lambda n: 0.05  # noqa: E731
    # no budget at all: 0.5 s left = 10 steps -> 100 tokens in chunks of 10
    assert prefill_chunks([PrefillDemand(100, 0.5)], 0, 200, step, 1.0) == [10]
    # past its deadline (or one step from it): the whole remainder at once, within the cap
    assert prefill_chunks([PrefillDemand(100, 0.97)], 0, 200, step, 1.0) == [100]
    assert prefill_chunks([PrefillDemand(100, 3.0)], 0, 60, step, 1.0) == [60]


def test_the_deadline_pace_accounts_for_the_slower_step_a_bigger_chunk_makes():
    # 30 ms decode + 0.1 ms per prompt token, 200 ms left: at 35 ms steps 5 steps (120 tokens each)
    # would be left, but a 120-token step takes 42 ms; the fixed point is 4 steps of 150 tokens (45 ms)
    step = lambda n: 0.030 + 0.0001 * n  # noqa: E731
    [c] = prefill_chunks([PrefillDemand(600, 0.0)], 50, 1000, step, 0.2)
    assert c == 150 and 4 * step(c) <= 0.2


def _req(rid: str, n_prompt: int, arrival: float) -> Request:
    return Request(
        request_id=rid,
        prompt_ids=list(range(1, n_prompt + 1)),
        params=SamplingParams(max_tokens=8),
        proposer=None,
        speculation="auto",
        detok=None,
        generator=None,
        eos_token_ids=frozenset(),
        arrival_time=arrival,
    )


def test_a_requests_positions_are_read_without_copying_its_context():
    """``token_at`` and ``ids_between`` give what indexing and slicing ``all_ids()`` give, across the prompt's end,
    with and without output, empty ranges and ranges past the end included."""
    for n_prompt, n_out in ((5, 0), (5, 3), (1, 4)):
        r = _req("r", n_prompt, 0.0)
        r.output_ids = [100 + j for j in range(n_out)]
        ids = r.all_ids()
        assert [r.token_at(i) for i in range(len(ids))] == ids
        for a in range(len(ids) + 2):
            for b in range(a, len(ids) + 3):
                assert r.ids_between(a, b) == ids[a:b], (n_prompt, n_out, a, b)


def _scheduler(cfg: SchedulerConfig, cost: StepCostModel, ks: int = 0, cap: int = 256) -> Scheduler:
    return Scheduler(
        cfg,
        max_num_seqs=8,
        max_num_batched_tokens=cap,
        cost_model=cost,
        decide_k=lambda reqs, budget: [ks] * len(reqs),
        kv=KVCacheManager(1000, 16),
        clock=lambda: 10.0,
    )


def _decoding(s: Scheduler, n: int) -> list[Request]:
    reqs = [_req(f"d{i}", 4, 0.0) for i in range(n)]
    for r in reqs:
        s.add(r)
    s.schedule()  # admits them
    for r in reqs:
        r.num_computed = len(r.prompt_ids)  # past their prompts: decoding
    return reqs


def test_schedule_prices_the_chunk_from_the_cost_table():
    cost = TableCost(plain={2: 0.030}, per_prompt=0.0005)
    s = _scheduler(SchedulerConfig(itl_ratio=2.0), cost)
    _decoding(s, 2)
    s.add(_req("long", 500, 10.0))
    plan = s.schedule()
    # budget 2 x 30 ms; the decode rows take 30 ms, 30 ms left at 0.5 ms per prompt token = 60 tokens
    assert plan.step_budget_s == pytest.approx(0.060) and [n for _, n in plan.prefill] == [60]
    assert [k for _, k in plan.decode] == [0, 0]

    s = _scheduler(SchedulerConfig(target_itl_ms=40), cost)
    _decoding(s, 2)
    s.add(_req("long", 500, 10.0))
    assert [n for _, n in s.schedule().prefill] == [20]  # 10 ms left = 20 tokens

    # drafts are priced by the same model and leave less for the prompt: 2 x 3 drafts at 2 ms each
    cost = TableCost(plain={2: 0.030}, per_prompt=0.0005, per_draft=0.002)
    s = _scheduler(SchedulerConfig(target_itl_ms=40), cost, ks=3)
    _decoding(s, 2)
    s.add(_req("long", 500, 10.0))
    # the decode rows alone take 42 ms: no budget left, so the prompt goes at its deadline's pace:
    # 1 s of 57 ms steps (42 + 30 x 0.5) is 17 steps, and ceil(500 / 17) = 30 tokens
    [(_, c)] = s.schedule().prefill
    assert c == 30 and -(-500 // c) * cost.predict_step(8, 2, c) <= 1.0


def test_with_nobody_decoding_prompts_take_the_whole_token_budget_in_arrival_order():
    s = _scheduler(SchedulerConfig(), TableCost(plain={}, per_prompt=0.0005), cap=256)
    s.add(_req("b", 200, 9.5))
    s.add(_req("a", 100, 9.0))  # arrived first, queued second
    plan = s.schedule()
    assert [(r.request_id, n) for r, n in plan.prefill] == [("a", 100), ("b", 156)] and plan.step_budget_s is None


def test_scheduler_keys_are_validated_with_a_clear_error():
    with pytest.raises(ValidationError, match="target_itl_ms"):
        SchedulerConfig(target_itl_ms=0)
    with pytest.raises(ValidationError, match="itl_ratio"):
        SchedulerConfig(itl_ratio=0.5)
    with pytest.raises(ValidationError, match="max_tff_ms"):
        EngineConfig(scheduler={"max_tff_ms": 100})  # a typo is named, not ignored
    with pytest.raises(ValidationError, match="max_ttft_ms"):
        EngineConfig(scheduler={"max_ttft_ms": -1})


# ------------------------------------------------------------------ the engine, tiny model, simulated clock


def _run_simulated(tiny_loaded, sched: SchedulerConfig, cost: TableCost, long_prompt: int):
    """Three streams decode; a long prompt arrives. Time advances by each step's predicted cost.
    Returns (time to the long prompt's first token, every step's predicted seconds while streams decode)."""
    eng = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_num_seqs=4,
            max_model_len=1024,
            max_num_batched_tokens=1024,
            proposers=[],
            scheduler=sched,
        ),
        tiny_loaded,
        decide=fixed_k(0),
        cost_model=cost,
    )
    now = [0.0]
    eng.scheduler.clock = lambda: now[0]
    for i, p in enumerate(rand_prompts(3, 3, 6, 6)):
        eng.add_request(f"s{i}", p, {"max_tokens": 200, "ignore_eos": True})
    while any(r.in_prefill for r in eng.running) or eng.waiting:
        eng.step()
    eng.add_request("long", rand_prompts(1, 4, long_prompt, long_prompt)[0], {"max_tokens": 2, "ignore_eos": True})
    eng.requests["long"].arrival_time = now[0]
    t_arrival, ttft, steps = now[0], None, []
    while ttft is None:
        outs = {o.request_id: o for o in eng.step()}
        plan = eng.last_plan
        dt = cost.predict_step(len(plan.decode), len(plan.decode), plan.prefill_tokens)
        now[0] += dt
        steps.append(dt)
        assert all(len(outs[f"s{i}"].token_ids) == 1 for i in range(3))  # no running stream skips a step
        if "long" in outs and outs["long"].token_ids:
            ttft = now[0] - t_arrival
    return ttft, steps


def test_a_long_prompt_into_a_busy_batch_meets_its_ttft_while_streams_keep_their_itl(tiny_loaded):
    cost = TableCost(plain={3: 0.030}, per_prompt=0.0001)
    ttft, steps = _run_simulated(tiny_loaded, SchedulerConfig(target_itl_ms=50, max_ttft_ms=1000), cost, 600)
    assert max(steps) <= 0.050 + 1e-9  # every step within the ITL target
    assert ttft <= 1.0 and len(steps) == 3  # 200 prompt tokens per step (20 ms of 50)


def test_a_prompt_that_would_miss_its_ttft_takes_more_of_the_step(tiny_loaded):
    cost = TableCost(plain={3: 0.030}, per_prompt=0.0001)
    # At the ITL target's pace (5 ms = 50 tokens per step) 600 tokens need 12 steps = 420 ms; the 200 ms
    # goal makes the chunks bigger and the steps longer than 35 ms, and the first token comes in time.
    ttft, steps = _run_simulated(tiny_loaded, SchedulerConfig(target_itl_ms=35, max_ttft_ms=200), cost, 600)
    assert ttft <= 0.200 and max(steps) > 0.035
    ttft_loose, steps_loose = _run_simulated(
        tiny_loaded, SchedulerConfig(target_itl_ms=35, max_ttft_ms=5000), cost, 600
    )
    assert max(steps_loose) <= 0.035 + 1e-9 and ttft_loose > 0.4  # a loose goal leaves the ITL target alone


def test_output_is_unchanged_by_any_scheduling_choice(tiny_loaded):
    """Greedy and seeded outputs are bit-identical whatever the chunking: different latency budgets,
    TTFT goals and token caps feed the prompts in different chunks next to different batches."""
    prompts = rand_prompts(6, 11, 20, 120)
    params = [
        {"max_tokens": 24, "ignore_eos": True},
        {"max_tokens": 24, "ignore_eos": True, "temperature": 0.9, "seed": 5},
    ]

    def run(sched: SchedulerConfig, cap: int) -> tuple[dict, list[int]]:
        eng = LLMEngine(
            EngineConfig(
                dtype="float32",
                max_num_seqs=4,
                max_model_len=512,
                max_num_batched_tokens=cap,
                proposers=[{"name": "ngram"}],
                scheduler=sched,
            ),
            tiny_loaded,
        )
        outs: dict[str, list[int]] = {}
        chunks: list[int] = []
        pending = [(f"r{i}", p, params[i % 2]) for i, p in enumerate(prompts)]
        while pending or eng.has_work():
            if pending:
                eng.add_request(*pending.pop(0))
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.token_ids)
            if eng.last_plan is not None:
                chunks += [n for _, n in eng.last_plan.prefill]
        return outs, chunks

    ref, ref_chunks = run(SchedulerConfig(target_itl_ms=60_000), 512)  # every prompt in one chunk
    seen = {tuple(ref_chunks)}
    for sched, cap in [
        (SchedulerConfig(target_itl_ms=0.001, max_ttft_ms=2000), 64),
        (SchedulerConfig(itl_ratio=1.0, max_ttft_ms=3_600_000), 32),  # a token per step
        (SchedulerConfig(), 256),
    ]:
        got, chunks = run(sched, cap)
        assert got == ref
        seen.add(tuple(chunks))
    assert len(seen) >= 3  # the prompts really were fed in other chunks
