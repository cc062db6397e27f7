"""Structured output benchmark: what grammar drafts and proposers buy constrained requests, and what they cost.

    python -m benchmarks.structured.structured_bench [--quick] [--rounds 2] [--levels 1,4,16]
        [--max-tokens 320] [--sampled]

In process, the real SmolLM2-135M-Instruct, the shipped engine config (ray_config.yaml: dtype "auto", K_max 4,
ngram min_n 1 / max_n 4, max_forced_tokens 16) and the shipped goodput policy on the engine's own cost model,
as the target replica wires it (deployments/target.py). Requests are the shared schema suite's chats
(benchmarks/structured/schema_suite.py: the schema in the system turn, the ask in the user turn, chat template applied)
with ``response_format`` = the case's JSON schema. Closed loop of c = 1, 4, 16 clients over the suite; a cell
that needs more requests than the suite has cases repeats them, the repeats prefixed "Request n:" so no two
requests of a cell are the same text (a whole repeated prompt would flatter the prefix and suffix caches).

Arms (on three engines: plain + grammar_only, default, ngram_only + suffix_only; the engines' comment says why
no state of one arm can steer another), interleaved within every round, the order reversed each round (at c = 1
request by request, the order rotating from one request to the next); every arm gets the same requests:
  plain         constrained, speculation "off": masked plain decoding, the baseline
  default       constrained, grammar drafts + the ngram proposer, speculation "auto" (what ships)
  grammar_only  grammar drafts, no proposer
  ngram_only    max_forced_tokens = 0, ngram, "auto"
  suffix_only   max_forced_tokens = 0, suffix, "auto" (a fresh proposer per cell: its global cache learns from
                the cell's earlier requests, never from an earlier run of the same ones)

Per arm and level: validity (json.loads + jsonschema.validate of every output; finish reasons), output tok/s
(median over rounds, and the ratio to plain per round with its min-max; and best-of-rounds: each arm's fastest
round, each request's fastest at c = 1, since a burst from the other jobs on the 2 shared cores slows a 2-thread
step 10-100x; "cores" = CPU s per wall s of the worst round, ~2 uncontended), TPOT p50, tokens per target pass, mean
acceptance length (every verify; grammar drafts and the proposer's apart, from the engine's stats), grammar
draft tokens and their acceptance, grammar time (``GrammarRuntime.seconds``: masks, forced tokens, draft cuts,
advancing) per step and as a share of step time, and mask time (fill + apply) per output token. Every arm's
output is checked token for token against plain's for the same request in the same round (speculation never
changes output); a difference prints a loud MISMATCH.

Neighbours (on the default arm's engine, after the arms' passes): 8 unconstrained chat clients (the measured
lane, speculation "auto") beside 8 other clients at c = 16 that send the suite's chats, either without
response_format (the baseline: 16 unconstrained requests, with the same prompts, so the same prefill load),
constrained with the default arm's settings, or constrained and held plain (masks, no grammar drafts); the
measured requests' TPOT ratio, paired request by request.

Greedy by default; ``--sampled`` adds a pass at T = 0.7 with a seed per request (coupled verification: the
same promise, output identical on every arm). Goals are reported, not asserted: 100% valid; default >= 1.5x
plain at c = 1 on the schema-heavy cases; default >= 0.97x plain at c = 16; grammar work <= 5% of the step at
c = 16; unconstrained neighbours slowed <= 2%.

Writes benchmarks/results/structured_bench.{json,png}; prints the tables.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable, Sequence

from benchmarks.common import (
    RESULTS_DIR,
    RequestRecord,
    RunResult,
    bar_panel,
    env_info,
    figure,
    format_table,
    loadavg,
    percentile,
    progress,
    ratio,
    save_figure,
    set_threads,
    write_json,
)

ARMS = ("plain", "default", "grammar_only", "ngram_only", "suffix_only")
BASE = "plain"
THREADS = 2
# (requests per level, rounds, max_tokens); a level missing here gets max(11, 2 * c) requests
FULL = dict(
    levels=[1, 4, 16],
    requests={1: 11, 4: 12, 16: 32},
    rounds=2,
    max_tokens=320,
    sampled_rounds=1,
    neighbour_requests=16,
    neighbour_tokens=96,
)
QUICK = dict(
    levels=[1, 4],
    requests={1: 3, 4: 4},
    rounds=1,
    max_tokens=40,
    sampled_rounds=1,
    neighbour_requests=8,
    neighbour_tokens=24,
)
# what the 8 other clients send: the suite's chats without response_format (the baseline: 16 unconstrained), with
# it and the default arm's settings, or with it held plain (masks only, no grammar drafts)
NEIGHBOUR_VARIANTS = ("unconstrained", "constrained", "constrained_plain")
SCHEMA_HEAVY = "schema-heavy"  # the suite's feature tag of the cases the 1.5x goal is about


# ----------------------------------------------------------------------------- pure helpers (tested)


def arm_order(arms: Sequence[str], rnd: int) -> list[str]:
    """The arms' order in round ``rnd``: as given in even rounds, reversed in odd ones, so load drift on the
    shared cores favours no arm."""
    return list(arms) if rnd % 2 == 0 else list(reversed(arms))


def rotated(arms: Sequence[str], j: int) -> list[str]:
    """``arms`` starting at position ``j`` (mod len): request j of a c = 1 cell runs its arms in this order, so
    every arm runs first, second, ... equally often."""
    j %= max(1, len(arms))
    return list(arms[j:]) + list(arms[:j])


def work_plan(num_cases: int, num_requests: int) -> list[tuple[int, int]]:
    """(case index, repeat) of each request of a cell: the suite in order, again and again."""
    return [(i % num_cases, i // num_cases) for i in range(num_requests)]


def user_turn(prompt: str, repeat: int) -> str:
    """The suite's own prompt the first time; "Request n: ..." on a repeat, so no two requests are the same."""
    return prompt if repeat == 0 else f"Request {repeat + 1}: {prompt}"


def check_valid(text: str, schema: dict[str, Any]) -> tuple[bool, str | None]:
    """(valid, why not): the output parses as JSON and validates against the schema."""
    import jsonschema

    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return False, f"JSON: {e.msg} at char {e.pos} of {len(text)}"
    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError as e:
        return False, f"schema: {e.message[:160]}"
    return True, None


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median and min-max of per-round values (NaN-free; None when there are none)."""
    xs = [v for v in values if v is not None and v == v]
    if not xs:
        return {"median": None, "min": None, "max": None, "values": list(values)}
    return {"median": median(xs), "min": min(xs), "max": max(xs), "values": list(values)}


def round_ratios(per_round: Sequence[dict[str, float]], base: str = BASE) -> dict[str, list[float]]:
    """``per_round[r][arm]`` (e.g. tok/s) -> ``{arm: [value / base's value in the same round, ...]}``: each round
    divides by its own baseline run, so a load change between rounds cancels."""
    arms = [a for a in (per_round[0] if per_round else {}) if a != base]
    return {a: [ratio(r[a], r[base]) for r in per_round] for a in arms}


def stats_delta(before: dict[str, dict[str, Any]], after: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """What one run added to the engine's cumulative ``stats`` (bucket -> SpecDecodeStats.as_dict()), counts only."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "spec_steps", "plain_steps")
    out = {}
    for name, a in after.items():
        b = before.get(name, {})
        d = {k: a.get(k, 0) - b.get(k, 0) for k in keys}
        if any(d.values()):
            out[name] = d
    return out


def acceptance(bucket: dict[str, int] | None) -> dict[str, Any]:
    """Draft tokens, accepted, acceptance rate and mean acceptance length (1 + accepted / drafts) of one bucket."""
    b = bucket or {}
    drafts, tokens, acc = b.get("num_drafts", 0), b.get("num_draft_tokens", 0), b.get("num_accepted_tokens", 0)
    return {
        "drafts": drafts,
        "draft_tokens": tokens,
        "accepted_tokens": acc,
        "acceptance_rate": acc / tokens if tokens else None,
        "mean_acceptance_length": 1 + acc / drafts if drafts else None,
    }


def add_counts(a: dict[str, dict[str, int]], b: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Sum two ``stats_delta`` results."""
    out = {k: dict(v) for k, v in a.items()}
    for name, d in b.items():
        tgt = out.setdefault(name, {})
        for k, v in d.items():
            tgt[k] = tgt.get(k, 0) + v
    return out


def cores(run: Any) -> float:
    """CPU seconds per wall second the run got: ~2 with both cores to itself. Near 1 when the other jobs on the
    shared cores took one: each of the engine's 2-thread parallel ops then waits (spinning) for its descheduled
    thread, and a step measured 10-100x its uncontended time (CPU time grows as much, so it is no cure)."""
    return ratio(run.cpu_s, run.wall_s)


def best_speed(rounds: Sequence[Sequence[tuple[int, float]]]) -> float:
    """Best-of-rounds speed of a cell run request by request: ``rounds[r][i]`` = (output tokens, latency) of
    request i in round r; each request keeps its fastest round (the one least disturbed by the other jobs), and
    the speed is all tokens over the sum of those latencies. One round: plain tokens / latency."""
    if not rounds or not rounds[0]:
        return float("nan")
    n = len(rounds[0])
    tokens = sum(t for t, _ in rounds[0])
    return ratio(tokens, sum(min(r[i][1] for r in rounds) for i in range(n)))


def grammar_cost(grammar_s: float, mask_s: float, step_s: float, steps: int, out_tokens: int) -> dict[str, Any]:
    """Grammar work per step and as a share of step time; mask time per output token."""
    return {
        "grammar_ms_per_step": 1e3 * grammar_s / steps if steps else None,
        "grammar_share": grammar_s / step_s if step_s else None,
        "mask_us_per_token": 1e6 * mask_s / out_tokens if out_tokens else None,
    }


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first token where two outputs differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_outputs(outs: dict[str, list[int]], ref: dict[str, list[int]]) -> tuple[int, list[str]]:
    """How many requests (by key) wrote exactly the reference's tokens, and a line per one that did not."""
    same, bad = 0, []
    for key, ids in outs.items():
        n = first_mismatch(ids, ref.get(key, []))
        if n is None:
            same += 1
        else:
            bad.append(f"{key}: differs at token {n} ({len(ids)} vs {len(ref.get(key, []))} tokens)")
    return same, bad


def paired_ratio(a: dict[str, float], b: dict[str, float]) -> float | None:
    """Mean of ``a`` over mean of ``b`` on the keys both have (a request's TPOT in two runs)."""
    keys = [k for k in a if k in b and a[k] == a[k] and b[k] == b[k]]
    if not keys:
        return None
    return ratio(sum(a[k] for k in keys) / len(keys), sum(b[k] for k in keys) / len(keys))


def finish_counts(reasons: Sequence[str | None]) -> str:
    """ "stop 30, length 2": finish reasons, most common first."""
    return ", ".join(f"{r} {n}" for r, n in collections.Counter(str(r) for r in reasons).most_common())


def goals(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The goals this benchmark reports against, each with its measured value and whether it holds (None: not
    measured in this run). ``summary``: {"valid_rate": {arm: rate}, "heavy_c1": ratio, "c16": ratio or None,
    "grammar_share_c16": share or None, "neighbours": ratio or None}; optional "heavy_c1_best" / "c16_best", the
    same ratios best-of-rounds, go into the notes."""
    rows = []
    worst = min(summary["valid_rate"].items(), key=lambda kv: kv[1]) if summary["valid_rate"] else (None, None)
    rows.append(
        {
            "goal": "valid outputs = 100% (worst arm)",
            "value": worst[1],
            "target": ">= 1.0",
            "met": None if worst[1] is None else worst[1] >= 1.0,
            "note": worst[0],
        }
    )

    def row(goal: str, value: float | None, target: str, ok: Callable[[float], bool], note: str = "") -> None:
        rows.append(
            {"goal": goal, "value": value, "target": target, "met": None if value is None else ok(value), "note": note}
        )

    def best_note(key: str) -> str:
        v = summary.get(key)
        return "" if v is None or v != v else f"best of rounds {v:.2f}"

    row(
        "default / plain at c=1, schema-heavy",
        summary.get("heavy_c1"),
        ">= 1.5",
        lambda v: v >= 1.5,
        best_note("heavy_c1_best"),
    )
    row("default / plain at c=16", summary.get("c16"), ">= 0.97", lambda v: v >= 0.97, best_note("c16_best"))
    row("grammar work / step at c=16 (default)", summary.get("grammar_share_c16"), "<= 0.05", lambda v: v <= 0.05)
    row(
        "unconstrained neighbours' TPOT ratio",
        summary.get("neighbours"),
        "<= 1.02",
        lambda v: v <= 1.02,
        "beside constrained default vs beside unconstrained",
    )
    return rows


def cpu_pressure() -> float | None:
    """Share of the last 10 s in which some runnable task waited for a CPU (Linux PSI): the other engineers' load
    on the shared cores, which loadavg shows only as a count."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("avg10=")[1].split()[0]) / 100
    except (OSError, IndexError, ValueError):
        return None


class QuietGate:
    """Waits, before a run, until this process has both cores again: a fixed 2-thread matmul is timed against
    its best time at start, and while it takes more than ``slack`` x that, the gate sleeps (at most ``max_wait_s``
    per run). Runs are interleaved anyway; this keeps a burst of the other jobs on the shared cores from landing
    in a run that would start inside it. A burst that starts mid-run still lands (best-of-rounds is for that)."""

    def __init__(self, max_wait_s: float, slack: float = 1.5) -> None:
        import torch

        self.max_wait_s, self.slack = max_wait_s, slack
        self._a = torch.randn(384, 384)
        self.baseline = min(self._probe() for _ in range(7))
        self.waited_s = 0.0
        self.waits = 0

    def _probe(self) -> float:
        t0 = time.perf_counter()
        for _ in range(8):
            self._a @ self._a
        return time.perf_counter() - t0

    def wait(self) -> None:
        if self.max_wait_s <= 0:
            return
        t0 = time.perf_counter()
        first = True
        while self._probe() > self.slack * self.baseline and time.perf_counter() - t0 < self.max_wait_s:
            if first:
                self.waits, first = self.waits + 1, False
            time.sleep(2.0)
        self.waited_s += time.perf_counter() - t0


def rss_gb() -> float:
    """This process's resident memory (six engines' KV caches add up on a shared machine)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 2**20
    except (OSError, StopIteration, ValueError):
        return float("nan")


# ----------------------------------------------------------------------------- the driver


@dataclass
class Item:
    key: str  # stable across arms and rounds: outputs are compared by it
    prompt: list[int]
    params: dict[str, Any]
    case: str | None = None  # schema case name; None for an unconstrained request


@dataclass
class Lane:
    """Clients that send ``items`` in a closed loop. A measured lane runs its items once and the run ends when every
    measured lane is done; an unmeasured one (neighbours) cycles through its items until then."""

    name: str
    clients: int
    items: list[Item]
    speculation: str = "auto"
    measured: bool = True
    proposer: str | None = None  # the proposer the requests name; None: the engine's default (its first)


@dataclass
class Run:
    name: str
    wall_s: float
    step_s: float  # sum of engine.step() times
    steps: int
    cpu_s: float  # this process's CPU time (all threads) over the run
    fed_tokens: int  # tokens fed to the target over the run's steps (pending + drafts + prompt chunks)
    grammar_s: float  # GrammarRuntime.seconds added by the run
    mask_s: float  # fill_masks + apply_masks
    fill_s: float  # of which fill_masks (llguidance); the rest is apply_masks (torch)
    stats: dict[str, dict[str, int]]  # stats_delta of the engine's buckets
    lanes: dict[str, RunResult]  # measured lanes' records (RequestRecord.index = item index)
    items: dict[str, list[Item]] = field(default_factory=dict)
    submitted: dict[str, int] = field(default_factory=dict)  # requests each lane sent
    cpu_pressure: float | None = None  # PSI cpu "some" avg10 when the run ended: how contended the cores were


class MaskTimer:
    """Times the engine's mask calls on one GrammarRuntime, by wrapping them on the instance: ``fill_masks``
    (llguidance computes the bitmask rows) and ``apply_masks`` (torch unpacks them over the vocabulary and sets
    refused logits to -inf)."""

    def __init__(self, runtime: Any) -> None:
        self.by_call = {"fill_masks": 0.0, "apply_masks": 0.0}
        for name in self.by_call:
            setattr(runtime, name, self._timed(name, getattr(runtime, name)))

    @property
    def seconds(self) -> float:
        return sum(self.by_call.values())

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.by_call[name] += time.perf_counter() - t0

        return call


def drive(
    engine: Any, lanes: Sequence[Lane], name: str, mask: MaskTimer, bar: Any = None, gate: QuietGate | None = None
) -> Run:
    """Run the lanes' clients against ``engine`` until every measured lane is done; abort the neighbours then."""
    if gate is not None:
        gate.wait()
    total_clients = sum(ln.clients for ln in lanes)
    if total_clients > engine.config.max_num_seqs:
        raise ValueError(f"{total_clients} clients > engine max_num_seqs {engine.config.max_num_seqs}")
    prefix = f"{name}-{time.monotonic_ns():x}"
    nxt = {ln.name: 0 for ln in lanes}
    inflight: dict[str, tuple[Lane, RequestRecord]] = {}
    done: dict[str, list[RequestRecord]] = {ln.name: [] for ln in lanes if ln.measured}
    stats0 = {k: v.as_dict() for k, v in engine.stats.items()}
    g0, m0, f0 = engine.grammars.seconds, mask.seconds, mask.by_call["fill_masks"]
    fed = [0]
    hook = engine.on_step

    def on_step(tokens: int, seconds: float, requests: int | None) -> None:
        fed[0] += tokens
        if hook is not None:
            hook(tokens, seconds, requests)

    engine.on_step = on_step
    cpu0 = time.process_time()
    t0 = time.perf_counter()

    def submit(ln: Lane, now: float) -> bool:
        i = nxt[ln.name]
        if ln.measured and i >= len(ln.items):
            return False
        item = ln.items[i % len(ln.items)]
        rid = f"{prefix}-{ln.name}-{i}"
        engine.add_request(rid, item.prompt, item.params, proposer=ln.proposer, speculation=ln.speculation)
        inflight[rid] = (ln, RequestRecord(index=i % len(ln.items), prompt_len=len(item.prompt), submit_s=now - t0))
        nxt[ln.name] = i + 1
        return True

    for ln in lanes:
        for _ in range(ln.clients):
            submit(ln, t0)
    step_s, steps = 0.0, 0

    # a measured lane submits its next item when one finishes, so none in flight means it is done
    while any(owner.measured for owner, _ in inflight.values()):
        ts = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        step_s += now - ts
        steps += 1
        if not outs and not engine.has_work():
            raise RuntimeError(f"engine idle with {len(inflight)} requests in flight")
        for o in outs:
            got = inflight.get(o.request_id)
            if got is None:
                continue
            ln, rec = got
            if o.token_ids:
                if rec.first_token_s is None:
                    rec.first_token_s = now - t0
                rec.token_ids.extend(o.token_ids)
                rec.num_steps += 1
                if bar is not None and ln.measured:
                    bar.update(len(o.token_ids))
            if o.finished:
                rec.finish_s, rec.finish_reason = now - t0, o.finish_reason
                rec.spec = o.spec.as_dict() if o.spec is not None else None
                del inflight[o.request_id]
                if ln.measured:
                    done[ln.name].append(rec)
                submit(ln, now)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    for rid in list(inflight):  # neighbours still running: the measured lanes are done
        engine.abort(rid)
    engine.on_step = hook
    stats1 = {k: v.as_dict() for k, v in engine.stats.items()}
    return Run(
        name,
        wall,
        step_s,
        steps,
        cpu,
        fed[0],
        engine.grammars.seconds - g0,
        mask.seconds - m0,
        mask.by_call["fill_masks"] - f0,
        stats_delta(stats0, stats1),
        {ln.name: RunResult(ln.name, ln.clients, wall, done[ln.name]) for ln in lanes if ln.measured},
        {ln.name: ln.items for ln in lanes},
        dict(nxt),
        cpu_pressure(),
    )


def concat_runs(name: str, parts: Sequence[Run], items: list[Item], lane: str = "cell") -> Run:
    """Single-request runs of one arm (a c = 1 cell run request by request, interleaved with the other arms) as
    one run of the cell: times and counts summed, record i = item i."""
    records = []
    for i, p in enumerate(parts):
        for r in p.lanes[lane].records:
            records.append(RequestRecord(**{**r.__dict__, "index": i}))
    counts: dict[str, dict[str, int]] = {}
    for p in parts:
        counts = add_counts(counts, p.stats)
    wall = sum(p.wall_s for p in parts)
    pressures = [p.cpu_pressure for p in parts if p.cpu_pressure is not None]
    return Run(
        name,
        wall,
        sum(p.step_s for p in parts),
        sum(p.steps for p in parts),
        sum(p.cpu_s for p in parts),
        sum(p.fed_tokens for p in parts),
        sum(p.grammar_s for p in parts),
        sum(p.mask_s for p in parts),
        sum(p.fill_s for p in parts),
        counts,
        {lane: RunResult(lane, 1, wall, records)},
        {lane: items},
        {lane: len(items)},
        max(pressures) if pressures else None,
    )


# ----------------------------------------------------------------------------- one pass


def summarize_cell(
    runs: list[Run], lane: str, texts: Callable[[list[int]], str], schemas: dict[str, Any], proposer: str | None
) -> dict[str, Any]:
    """One arm at one level over all rounds: validity, speed, acceptance, grammar cost."""
    recs = [(run, rec) for run in runs for rec in run.lanes[lane].records]
    valid, invalid = 0, []
    for run, rec in recs:
        item = run.items[lane][rec.index]
        ok, why = check_valid(texts(rec.token_ids), schemas[item.case])
        valid += ok
        if not ok:
            invalid.append(
                {
                    "key": item.key,
                    "case": item.case,
                    "finish_reason": rec.finish_reason,
                    "tokens": len(rec.token_ids),
                    "why": why,
                }
            )
    counts: dict[str, dict[str, int]] = {}
    for run in runs:
        counts = add_counts(counts, run.stats)
    out_tokens = sum(run.lanes[lane].output_tokens for run in runs)
    passes = sum(rec.num_steps for _, rec in recs)
    verify: collections.Counter[str] = collections.Counter()  # every verify: grammar and proposer drafts together
    for _, rec in recs:
        for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            verify[k] += (rec.spec or {}).get(k, 0)
    tpots = [rec.tpot for _, rec in recs]
    cost = grammar_cost(
        sum(r.grammar_s for r in runs),
        sum(r.mask_s for r in runs),
        sum(r.step_s for r in runs),
        sum(r.steps for r in runs),
        out_tokens,
    )
    return {
        "requests": len(recs),
        "valid": valid,
        "valid_rate": valid / len(recs) if recs else None,
        "finish_reasons": finish_counts([rec.finish_reason for _, rec in recs]),
        "invalid": invalid,
        "output_tokens": out_tokens,
        "tok_s_rounds": [run.lanes[lane].tok_s for run in runs],
        "cpu_pressure_rounds": [run.cpu_pressure for run in runs],
        "tok_s": median([run.lanes[lane].tok_s for run in runs]),
        "cores_rounds": [cores(run) for run in runs],
        "cores_min": min(cores(run) for run in runs),
        "tpot_p50_ms": 1e3 * percentile(tpots, 50),
        "tpot_p99_ms": 1e3 * percentile(tpots, 99),
        "tokens_per_pass": ratio(out_tokens, passes),
        "all": acceptance(dict(verify)),
        "grammar": acceptance(counts.get("grammar")),
        "proposer": acceptance(counts.get(proposer)) if proposer else acceptance(None),
        "grammar_s": sum(r.grammar_s for r in runs),
        "mask_s": sum(r.mask_s for r in runs),
        "fill_s": sum(r.fill_s for r in runs),
        "mask_fill_apply_ms_per_step": "{:.2f}/{:.2f}".format(
            *(
                1e3 * ratio(x, sum(r.steps for r in runs))
                for x in (sum(r.fill_s for r in runs), sum(r.mask_s - r.fill_s for r in runs))
            )
        ),
        "step_s": sum(r.step_s for r in runs),
        "steps": sum(r.steps for r in runs),
        "tokens_per_step": ratio(sum(r.fed_tokens for r in runs), sum(r.steps for r in runs)),
        "step_ms": 1e3 * ratio(sum(r.step_s for r in runs), sum(r.steps for r in runs)),
        **cost,
    }


def per_case_c1(runs_by_arm: dict[str, list[Run]], lane: str, cases: list[Any]) -> list[dict[str, Any]]:
    """c = 1: each request ran alone, so each case's own speed (output tokens / request latency) per arm, and
    default / plain per case (median over rounds)."""
    rows = []
    first = next(iter(runs_by_arm.values()))[0]
    for case in [cs for cs in cases if any(it.case == cs.name for it in first.items[lane])]:
        row: dict[str, Any] = {"case": case.name, "heavy": SCHEMA_HEAVY in " ".join(case.features)}
        speed: dict[str, list[float]] = {}
        for arm, runs in runs_by_arm.items():
            speed[arm] = []
            for run in runs:
                recs = [r for r in run.lanes[lane].records if run.items[lane][r.index].case == case.name]
                toks = sum(len(r.token_ids) for r in recs)
                secs = sum((r.finish_s or 0) - r.submit_s for r in recs)
                speed[arm].append(ratio(toks, secs))
                row["tokens"] = toks
        for arm in runs_by_arm:
            if arm != BASE:
                row[arm] = spread([ratio(a, b) for a, b in zip(speed[arm], speed[BASE])])["median"]
        row["plain_tok_s"] = median(speed[BASE])
        rows.append(row)
    return rows


def heavy_ratio(runs_by_arm: dict[str, list[Run]], lane: str, heavy: set[str], arm: str = "default") -> dict[str, Any]:
    """default / plain speed on the schema-heavy cases at c = 1, per round (tokens / summed request latency)."""

    def speed(run: Run) -> float:
        recs = [r for r in run.lanes[lane].records if run.items[lane][r.index].case in heavy]
        return ratio(sum(len(r.token_ids) for r in recs), sum((r.finish_s or 0) - r.submit_s for r in recs))

    return spread([ratio(speed(a), speed(b)) for a, b in zip(runs_by_arm[arm], runs_by_arm[BASE])])


def cell_best(c: int, runs: list[Run], cases: set[str] | None = None, lane: str = "cell") -> float:
    """Best-of-rounds tok/s of one arm's cell: at c = 1 each request's fastest round (``best_speed``; ``cases``
    keeps only those cases' requests), above it the fastest round's whole run."""
    if c > 1:
        return max(run.lanes[lane].tok_s for run in runs)
    per_round = []
    for run in runs:
        recs = sorted(run.lanes[lane].records, key=lambda r: r.index)
        per_round.append(
            [
                (len(r.token_ids), (r.finish_s or 0) - r.submit_s)
                for r in recs
                if cases is None or run.items[lane][r.index].case in cases
            ]
        )
    return best_speed(per_round)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3-4 requests, c=1 and 4, 40 tokens, one round (~3 min)")
    ap.add_argument("--rounds", type=int, help="rounds of the greedy pass (default 2; quick 1)")
    ap.add_argument("--levels", help="comma-separated concurrency levels (default 1,4,16; quick 1,4)")
    ap.add_argument("--max-tokens", type=int, help="max_tokens of every constrained request (default 320)")
    ap.add_argument("--requests", help="requests per level, e.g. 1:11,4:12,16:32 (default: that)")
    ap.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)} (plain always)")
    ap.add_argument("--sampled", action="store_true", help="add a pass at T=--temperature, a seed per request")
    ap.add_argument("--sampled-rounds", type=int, help="rounds of the sampled pass (default 1)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--no-neighbours", action="store_true", help="skip the unconstrained-neighbours test")
    ap.add_argument(
        "--max-wait",
        type=float,
        default=30.0,
        help="seconds a run may wait for the other jobs on the shared cores to let go (0 = never wait)",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR), help="directory for structured_bench.json / .png")
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    if args.rounds:
        cfg["rounds"] = args.rounds
    if args.levels:
        cfg["levels"] = [int(x) for x in args.levels.split(",")]
    if args.max_tokens:
        cfg["max_tokens"] = args.max_tokens
    if args.requests:
        cfg["requests"] = {int(k): int(v) for k, v in (p.split(":") for p in args.requests.split(","))}
    if args.sampled_rounds:
        cfg["sampled_rounds"] = args.sampled_rounds
    cfg["requests"] = {c: cfg["requests"].get(c, max(11, 2 * c)) for c in cfg["levels"]}
    arms = [BASE] + [a for a in args.arms.split(",") if a in ARMS and a != BASE]
    out_dir = Path(args.out)

    set_threads(THREADS)
    import transformers

    transformers.logging.set_verbosity_error()
    from benchmarks.engine.engine_bench import CHAT_PROMPTS
    from benchmarks.serving.guidellm_workload import service_config
    from benchmarks.structured.schema_suite import SCHEMAS, chat_messages
    from policies import make_policy
    from workers.config import ProposerConfig
    from workers.engine import LLMEngine
    from workers.model_loader import load_model
    from workers.proposers.registry import make_proposer
    from workers.sampling_params import StructuredOutput

    t_start = time.perf_counter()
    env = env_info()
    env["cpu_pressure_start"] = cpu_pressure()
    mode = "QUICK" if args.quick else "FULL"
    print(
        f"[structured_bench] {mode} run; {env['cpu']} ({env['cpu_capability']}, native bf16: "
        f"{env['cpu_native_bf16'] or 'no'}), torch {env['torch']}, {THREADS} threads, levels {cfg['levels']}, "
        f"rounds {cfg['rounds']}, max_tokens {cfg['max_tokens']}, arms {arms}, loadavg {env['loadavg_start']}",
        flush=True,
    )
    loaded = load_model("smollm2")
    shipped = service_config().engine
    ngram_cfg = next(p for p in shipped.proposers if p.name == "ngram")
    max_c = max(cfg["levels"] + ([16] if not args.no_neighbours else []))

    tokenizer = loaded.tokenizer
    cases = list(SCHEMAS)
    schemas = {c.name: c.schema for c in cases}
    specs = {c.name: {"kind": "json", "value": json.dumps(c.schema), "param": "response_format"} for c in cases}

    engines: dict[str, tuple[Any, MaskTimer]] = {}

    def tokenize_chat(messages: list[dict[str, str]]) -> list[int]:
        if engines:
            return next(iter(engines.values()))[0].tokenize_chat(messages)
        # before the engines exist (to size their KV cache): the same template, the same tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)

    def cell_items(n: int, sampled: bool) -> list[Item]:
        items = []
        for i, (ci, rep) in enumerate(work_plan(len(cases), n)):
            case = cases[ci]
            msgs = chat_messages(case)
            msgs[-1] = {**msgs[-1], "content": user_turn(case.prompt, rep)}
            params: dict[str, Any] = {
                "max_tokens": cfg["max_tokens"],
                "temperature": 0.0,
                "structured": specs[case.name],
            }
            if sampled:
                params.update(temperature=args.temperature, seed=1000 + i)
            items.append(Item(f"{case.name}#{rep}", tokenize_chat(msgs), params, case.name))
        return items

    def chat_items(tag: str, prompts: Sequence[str], n: int, offset: int = 0) -> list[Item]:
        return [
            Item(
                f"{tag}{i}",
                tokenize_chat(
                    [{"role": "user", "content": f"Request {tag}{i}: {prompts[(i + offset) % len(prompts)]}"}]
                ),
                {"max_tokens": cfg["neighbour_tokens"], "temperature": 0.0},
            )
            for i in range(n)
        ]

    # every case, and the repeats' longer user turns up to the largest cell (warm-up and neighbours run 16)
    longest = max(len(it.prompt) for it in cell_items(max(len(cases), max_c, *cfg["requests"].values()), False))
    max_model_len = longest + cfg["max_tokens"] + 64

    # ---------------------------------------------------------------- engines: three, shared where no state leaks
    # Six engines' KV caches (fp32 under batch invariance) held ~7.8 GB on a shared 23 GB machine, and a run died
    # twice unexplained; so arms share an engine where nothing of one can steer the other: "plain" never drafts and
    # "grammar_only" has no proposer (goodput keeps no state without one: it returns the forced count); ngram_only
    # and suffix_only keep acceptance estimates and policy state under their own proposer's name. The step-cost
    # model is the hardware's, shared as in a replica. "default" has its own engine: its ngram drafts follow the
    # forced tokens, so their acceptance differs from ngram_only's, which would share the "ngram" estimates.
    forced = shipped.structured_outputs.max_forced_tokens
    engine_setup = {  # engine -> (proposers, max_forced_tokens)
        "no_proposer": ([], forced),
        "shipped": ([ngram_cfg], forced),
        "proposers_only": ([ngram_cfg, ProposerConfig(name="suffix")], 0),
    }
    arm_setup = {  # arm -> (engine, the proposer its requests name or None, speculation)
        "plain": ("no_proposer", None, "off"),
        "grammar_only": ("no_proposer", None, "auto"),
        "default": ("shipped", "ngram", "auto"),
        "ngram_only": ("proposers_only", "ngram", "auto"),
        "suffix_only": ("proposers_only", "suffix", "auto"),
    }

    def build(pcfg: list[Any], max_forced: int) -> tuple[Any, MaskTimer]:
        ecfg = shipped.model_copy(
            update={
                "max_num_seqs": max_c,
                "max_model_len": max_model_len,
                "num_threads": THREADS,
                "proposers": pcfg,
                "structured_outputs": shipped.structured_outputs.model_copy(update={"max_forced_tokens": max_forced}),
            }
        )
        policy = make_policy({"name": "goodput"})  # as deployments/target.py: the policy on the engine's cost model
        eng = LLMEngine(
            ecfg, loaded, proposers={p.name: make_proposer(p.name, **p.options) for p in pcfg}, decide=policy
        )
        policy.use_cost_model(eng.cost_model)
        for case in cases:  # compile every schema once (the replica compiles off the step loop; not timed here)
            eng.grammars.compile(StructuredOutput(**specs[case.name]))
        return eng, MaskTimer(eng.grammars)

    wanted = {arm_setup[a][0] for a in arms} | (set() if args.no_neighbours else {"shipped"})
    for name in [e for e in engine_setup if e in wanted]:
        engines[name] = build(*engine_setup[name])
        print(f"  engine {name} ready at {time.perf_counter() - t_start:.0f} s, rss {rss_gb():.1f} GB", flush=True)
    # the requests, tokenized by engine.tokenize_chat (the chat template, then the tokenizer)
    all_items = {c: {s: cell_items(cfg["requests"][c], s) for s in (False, True)} for c in cfg["levels"]}
    warm_items = cell_items(max_c, False)
    for arm in progress(arms, desc="warm-up", unit="arm"):
        # untimed: first-call allocations, each batch size's first kernels, the cost model's first samples
        eng, mask = engines[arm_setup[arm][0]]
        for c in sorted(set(cfg["levels"] + [max_c])):
            wi = [Item(it.key, it.prompt, {**it.params, "max_tokens": 6}, it.case) for it in warm_items[:c]]
            drive(eng, [Lane("w", c, wi, arm_setup[arm][2], proposer=arm_setup[arm][1])], f"warm-{arm}", mask)

    def lane(arm: str, c: int, items: list[Item]) -> Lane:
        return Lane("cell", c, items, arm_setup[arm][2], proposer=arm_setup[arm][1])

    suffix_cache: dict[str, Any] = {}  # the suffix_only arm's proposer, kept across a cell

    def run_arm(arm: str, lanes: list[Lane], name: str, bar: Any, fresh_suffix: bool = True) -> Run:
        eng, mask = engines[arm_setup[arm][0]]
        if "suffix" in eng.proposers:
            # Every finished request feeds every proposer's finish(), so the suffix cache would learn ngram_only's
            # outputs of the very requests suffix_only runs next (greedy: the answer). It sees only its own arm's:
            # a throwaway proposer stands in while another arm runs on the engine.
            if arm_setup[arm][1] == "suffix":
                if fresh_suffix or "p" not in suffix_cache:  # cold global cache: no earlier cell's outputs
                    suffix_cache["p"] = make_proposer("suffix")
                eng.proposers["suffix"] = suffix_cache["p"]
            else:
                eng.proposers["suffix"] = make_proposer("suffix")
        return drive(eng, lanes, name, mask, bar, gate)

    def run_cell(order: list[str], c: int, items: list[Item], name: str, bar: Any) -> dict[str, Run]:
        """Every arm on the cell's requests. At c = 1 request by request, the arms' order rotating from one request
        to the next: a load burst from the other jobs on the shared cores then hits one request of every arm,
        not one arm's whole cell. Above c = 1 the cell is one closed loop per arm, in ``order``."""
        if c > 1:
            return {a: run_arm(a, [lane(a, c, items)], f"{name}-{a}", bar) for a in order}
        parts: dict[str, list[Run]] = {a: [] for a in order}
        for j, item in enumerate(items):
            for a in rotated(order, j):
                parts[a].append(
                    run_arm(a, [lane(a, 1, [item])], f"{name}-{a}-{j}", bar, fresh_suffix=j == 0)
                )  # the suffix cache learns across the cell
        return {a: concat_runs(f"{name}-{a}", parts[a], items) for a in order}

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    gate = QuietGate(args.max_wait)
    print(
        f"  quiet gate: 2-thread probe {1e3 * gate.baseline:.1f} ms, waits up to {args.max_wait:.0f} s per run",
        flush=True,
    )
    mismatches: list[str] = []
    passes: dict[str, Any] = {}
    pass_list = [("greedy", False, cfg["rounds"])]
    if args.sampled:
        pass_list.append(("sampled", True, cfg["sampled_rounds"]))
    neighbours: list[dict[str, Any]] = []
    for pname, sampled, rounds in pass_list:
        runs: dict[int, dict[str, list[Run]]] = {c: {a: [] for a in arms} for c in cfg["levels"]}
        for rnd in range(rounds):
            for li, c in enumerate(cfg["levels"]):
                items = all_items[c][sampled]
                order = arm_order(arms, rnd + li)  # reversed every round, and from one level to the next
                total = sum(it.params["max_tokens"] for it in items) * len(order)
                bar = progress(total=total, desc=f"{pname} r{rnd} c={c}", unit="tok")
                for arm, run in run_cell(order, c, items, f"{pname}-r{rnd}-c{c}", bar).items():
                    runs[c][arm].append(run)
                bar.close()
                ref = {items[r.index].key: r.token_ids for r in runs[c][BASE][-1].lanes["cell"].records}
                line = []
                for arm in arms:
                    run = runs[c][arm][-1]
                    outs = {items[r.index].key: r.token_ids for r in run.lanes["cell"].records}
                    same, bad = compare_outputs(outs, ref)
                    for b in bad:
                        mismatches.append(f"{pname} r{rnd} c={c} {arm}: {b}")
                        print(f"\n!!!!!!!! MISMATCH: {mismatches[-1]} !!!!!!!!\n", flush=True)
                    valid = sum(
                        check_valid(decode(r.token_ids), schemas[items[r.index].case])[0]
                        for r in run.lanes["cell"].records
                    )
                    line.append(
                        f"{arm} {run.lanes['cell'].tok_s:.1f} tok/s "
                        f"({ratio(run.lanes['cell'].tok_s, runs[c][BASE][-1].lanes['cell'].tok_s):.2f}x), "
                        f"valid {valid}/{len(items)}"
                    )
                print(
                    f"  [{pname} r{rnd} c={c:>2}, {time.perf_counter() - t_start:.0f} s, load {loadavg()}, "
                    f"cpu pressure {cpu_pressure()}, waited {gate.waited_s:.0f} s] " + "; ".join(line),
                    flush=True,
                )
        passes[pname] = summarize_pass(pname, runs, arms, arm_setup, decode, schemas, cases, cfg)
        for c in cfg["levels"]:  # plain wrote the same tokens in every round (a pure function of the request)
            ref0 = {all_items[c][sampled][r.index].key: r.token_ids for r in runs[c][BASE][0].lanes["cell"].records}
            for later in runs[c][BASE][1:]:
                _, bad = compare_outputs(
                    {all_items[c][sampled][r.index].key: r.token_ids for r in later.lanes["cell"].records}, ref0
                )
                mismatches += [f"{pname} c={c} plain, round vs round 0: {b}" for b in bad]
    # last: the neighbours' chat feeds the default engine's ngram estimates, which no cell may see afterwards
    for rnd in range(0 if args.no_neighbours else cfg["rounds"]):
        neighbours.append(neighbour_round(rnd, engines, cases, cell_items, chat_items, CHAT_PROMPTS, cfg, gate))

    # ---------------------------------------------------------------- reports
    tables: list[str] = []
    for pname, p in passes.items():
        tables.append(
            format_table(
                p["rows"],
                ROW_COLUMNS,
                title=(
                    f"{pname}: {len(cases)} schema cases, closed loop, max_tokens {cfg['max_tokens']}, "
                    f"{p['rounds']} round(s); tok/s median over rounds, "
                    "'vs plain' = median [min-max] of per-round ratios; "
                    f"acc = acceptance rate, len = mean acceptance length; {env['cpu']}"
                ),
            )
        )
        tables.append(
            format_table(
                p["per_case_c1"],
                per_case_columns(arms),
                title=(
                    f"{pname}, c=1 per case: tok/s of each request alone, arm / plain (median over rounds); "
                    f"* = schema-heavy"
                ),
            )
        )
        if p["invalid"]:
            tables.append(
                format_table(
                    p["invalid"],
                    [
                        ("arm", "arm", "s"),
                        ("c", "c", "d"),
                        ("case", "case", "s"),
                        ("finish_reason", "finish", "s"),
                        ("tokens", "tokens", "d"),
                        ("n", "times", "d"),
                        ("why", "why", "s"),
                    ],
                    title=f"{pname}: invalid outputs (by arm, level and case)",
                )
            )
    nb_summary = summarize_neighbours(neighbours) if neighbours else None
    if nb_summary:
        tables.append(
            format_table(
                nb_summary["rows"],
                [
                    ("variant", "8 neighbours send", "s"),
                    ("tpot_ratio", "measured TPOT / beside unconstrained", ".3f"),
                    ("range", "per round", "s"),
                    ("best", "best of rounds", ".3f"),
                    ("tpot_ms", "measured TPOT mean ms", ".1f"),
                    ("neighbour_grammar_len", "neighbour grammar len", ".2f"),
                    ("tokens_per_step", "fed/step", ".1f"),
                    ("step_ms", "step ms", ".1f"),
                    ("grammar_share", "grammar share", ".3f"),
                    ("neighbours_started", "neighbour requests", ".0f"),
                ],
                title=(
                    f"neighbours at c=16: {cfg['neighbour_requests']} unconstrained chat requests (8 clients, "
                    f"max_tokens {cfg['neighbour_tokens']}, greedy, auto) beside 8 clients sending the suite's chats; "
                    f"TPOT paired per request, median [min-max] over rounds"
                ),
            )
        )
    g = passes["greedy"]
    c16 = g["by_level"].get(16, {})
    goal_rows = goals(
        {
            "valid_rate": {
                f"{pn}/{r['arm']}/c={r['c']}": r["valid_rate"] for pn, p in passes.items() for r in p["rows"]
            },
            "heavy_c1": g.get("heavy_c1", {}).get("median"),
            "heavy_c1_best": g.get("heavy_c1_best"),
            "c16": c16.get("default", {}).get("vs_plain", {}).get("median") if "default" in c16 else None,
            "c16_best": c16.get("default", {}).get("vs_plain_best") if "default" in c16 else None,
            "grammar_share_c16": c16.get("default", {}).get("grammar_share") if "default" in c16 else None,
            "neighbours": nb_summary["by_variant"]["constrained"]["median"] if nb_summary else None,
        }
    )
    tables.append(
        format_table(
            goal_rows,
            [
                ("goal", "goal", "s"),
                ("value", "value", ".3f"),
                ("target", "target", "s"),
                ("met", "met", lambda v: "-" if v is None else "yes" if v else "NO"),
                ("note", "note", "s"),
            ],
            title="goals (reported, not asserted)",
        )
    )
    for t in tables:
        print("\n" + t, flush=True)
    verdict = "ALL ARMS WROTE PLAIN'S TOKENS" if not mismatches else f"{len(mismatches)} MISMATCHES"
    print(f"\n  {verdict} (every arm vs plain, same request, same round; plain vs itself across rounds)\n", flush=True)

    env["loadavg_end"] = loadavg()
    env["cpu_pressure_end"] = cpu_pressure()
    env["quiet_gate"] = {
        "probe_ms": 1e3 * gate.baseline,
        "max_wait_s": args.max_wait,
        "runs_that_waited": gate.waits,
        "waited_s": gate.waited_s,
    }
    env["elapsed_s"] = time.perf_counter() - t_start
    samples = passes["greedy"]["plain_records"]  # what plain wrote at the first level, first round
    json_path = write_json(
        out_dir / "structured_bench.json",
        {
            "benchmark": "structured_bench",
            "mode": mode.lower(),
            "env": env,
            "command": "python -m benchmarks.structured.structured_bench "
            + " ".join(argv if argv is not None else sys.argv[1:]),
            "config": {
                **cfg,
                "arms": arms,
                "arm_setup": {a: arm_setup[a] for a in arms},
                "threads": THREADS,
                "engine_setup": {
                    e: {"proposers": [p.name for p in ps], "max_forced_tokens": f}
                    for e, (ps, f) in engine_setup.items()
                    if e in engines
                },
                "model": "SmolLM2-135M-Instruct",
                "dtype": str(next(iter(engines.values()))[0].dtype).removeprefix("torch."),
                "max_model_len": max_model_len,
                "engine": shipped.model_dump(),
                "temperature_sampled": args.temperature,
                "policy": "goodput (make_policy, engine cost model)",
            },
            "passes": {pn: {k: v for k, v in p.items() if k != "plain_records"} for pn, p in passes.items()},
            "plain_outputs": samples,
            "neighbours": {"rounds": neighbours, "summary": nb_summary},
            "goals": goal_rows,
            "mismatches": mismatches,
            "tables": tables,
        },
    )
    png_path = plot(out_dir / "structured_bench.png", passes, arms, cfg, env, nb_summary)
    print(f"[structured_bench] done in {env['elapsed_s']:.0f} s; wrote {json_path} and {png_path}", flush=True)
    return 1 if mismatches else 0


ROW_COLUMNS = [
    ("c", "c", "d"),
    ("arm", "arm", "s"),
    ("valid", "valid", "s"),
    ("finish", "finish", "s"),
    ("tok_s", "tok/s", ".1f"),
    ("vs_plain_s", "vs plain", "s"),
    ("vs_plain_best", "best of rounds", ".2f"),
    ("cores_min", "cores", ".2f"),
    ("tpot_p50_ms", "TPOT p50 ms", ".1f"),
    ("tokens_per_pass", "tok/pass", ".2f"),
    ("len_all", "len", ".2f"),
    ("tokens_per_step", "fed/step", ".1f"),
    ("step_ms", "step ms", ".1f"),
    ("g_tokens", "grammar drafts", "d"),
    ("g_acc", "g acc", ".3f"),
    ("g_len", "g len", ".2f"),
    ("p_tokens", "proposer drafts", "d"),
    ("p_acc", "p acc", ".3f"),
    ("grammar_ms_per_step", "grammar ms/step", ".2f"),
    ("grammar_share", "grammar share", ".3f"),
    ("mask_us_per_token", "mask us/tok", ".0f"),
    ("fill_apply", "fill/apply ms/step", "s"),
    ("identical", "= plain", "s"),
]


def per_case_columns(arms: Sequence[str]) -> list[tuple[str, str, Any]]:
    return [("case_label", "case", "s"), ("tokens", "tokens", "d"), ("plain_tok_s", "plain tok/s", ".1f")] + [
        (a, a, ".2f") for a in arms if a != BASE
    ]


def summarize_pass(
    pname: str,
    runs: dict[int, dict[str, list[Run]]],
    arms: list[str],
    arm_setup: dict[str, Any],
    decode: Callable[[list[int]], str],
    schemas: dict[str, Any],
    cases: list[Any],
    cfg: dict[str, Any],
) -> dict[str, Any]:
    rows, by_level, invalid = [], {}, []
    for c, per_arm in runs.items():
        ratios = round_ratios([{a: per_arm[a][r].lanes["cell"].tok_s for a in arms} for r in range(len(per_arm[BASE]))])
        best = {a: cell_best(c, per_arm[a]) for a in arms}
        by_level[c] = {}
        ref = [
            {run.items["cell"][r.index].key: r.token_ids for r in run.lanes["cell"].records} for run in per_arm[BASE]
        ]
        for arm in arms:
            s = summarize_cell(per_arm[arm], "cell", decode, schemas, arm_setup[arm][1])
            s["vs_plain"] = spread(ratios[arm]) if arm != BASE else spread([1.0])
            s["tok_s_best"] = best[arm]
            s["vs_plain_best"] = ratio(best[arm], best[BASE])
            same = n = 0
            for run, rf in zip(per_arm[arm], ref):
                k, _ = compare_outputs(
                    {run.items["cell"][r.index].key: r.token_ids for r in run.lanes["cell"].records}, rf
                )
                same, n = same + k, n + len(run.lanes["cell"].records)
            s["identical"] = f"{same}/{n}"
            by_level[c][arm] = s
            vp = s["vs_plain"]
            rows.append(
                {
                    "c": c,
                    "arm": arm,
                    "valid": f"{s['valid']}/{s['requests']}",
                    "valid_rate": s["valid_rate"],
                    "finish": s["finish_reasons"],
                    "tok_s": s["tok_s"],
                    "vs_plain_s": "-" if arm == BASE else f"{vp['median']:.2f} [{vp['min']:.2f}-{vp['max']:.2f}]",
                    "vs_plain_best": None if arm == BASE else s["vs_plain_best"],
                    "cores_min": s["cores_min"],
                    "tpot_p50_ms": s["tpot_p50_ms"],
                    "tokens_per_pass": s["tokens_per_pass"],
                    "tokens_per_step": s["tokens_per_step"],
                    "step_ms": s["step_ms"],
                    "len_all": s["all"]["mean_acceptance_length"],
                    "g_tokens": s["grammar"]["draft_tokens"],
                    "g_acc": s["grammar"]["acceptance_rate"],
                    "g_len": s["grammar"]["mean_acceptance_length"],
                    "p_tokens": s["proposer"]["draft_tokens"],
                    "p_acc": s["proposer"]["acceptance_rate"],
                    "grammar_ms_per_step": s["grammar_ms_per_step"],
                    "grammar_share": s["grammar_share"],
                    "mask_us_per_token": s["mask_us_per_token"],
                    "identical": s["identical"],
                    "fill_apply": s["mask_fill_apply_ms_per_step"],
                }
            )
            agg: dict[tuple[str, str, str], list[dict[str, Any]]] = collections.defaultdict(list)
            for bad in s["invalid"]:
                agg[(bad["case"], bad["finish_reason"], bad["why"].split(" at char")[0])].append(bad)
            for (case, fin, why), lst in agg.items():
                invalid.append(
                    {
                        "arm": arm,
                        "c": c,
                        "case": case,
                        "finish_reason": fin,
                        "n": len(lst),
                        "tokens": max(b["tokens"] for b in lst),
                        "why": why,
                    }
                )
    heavy = {cs.name for cs in cases if SCHEMA_HEAVY in " ".join(cs.features)}
    out: dict[str, Any] = {
        "rounds": len(next(iter(runs.values()))[BASE]),
        "rows": rows,
        "by_level": by_level,
        "invalid": invalid,
    }
    if 1 in runs:
        out["per_case_c1"] = per_case_c1(runs[1], "cell", cases)
        for row in out["per_case_c1"]:
            row["case_label"] = row["case"] + (" *" if row["heavy"] else "")
        out["heavy_c1"] = heavy_ratio(runs[1], "cell", heavy) if "default" in arms else {}
        out["heavy_c1_best"] = (
            ratio(cell_best(1, runs[1]["default"], heavy), cell_best(1, runs[1][BASE], heavy))
            if "default" in arms
            else None
        )
    else:
        out["per_case_c1"], out["heavy_c1"], out["heavy_c1_best"] = [], {}, None
    first = runs[min(runs)][BASE][0]
    out["plain_records"] = [
        {
            "key": first.items["cell"][r.index].key,
            "finish_reason": r.finish_reason,
            "tokens": len(r.token_ids),
            "text": decode(r.token_ids),
        }
        for r in sorted(first.lanes["cell"].records, key=lambda r: r.index)
    ]
    return out


def neighbour_round(
    rnd: int,
    engines: dict[str, Any],
    cases: list[Any],
    cell_items: Callable[..., list[Item]],
    chat_items: Callable[..., list[Item]],
    chat_prompts: Sequence[str],
    cfg: dict[str, Any],
    gate: QuietGate | None = None,
) -> dict[str, Any]:
    """One round of the neighbours test: the same measured chat lane beside each kind of neighbour."""
    eng, mask = engines["shipped"]
    measured = chat_items("m", chat_prompts, cfg["neighbour_requests"])
    # The suite's own chats, cycled: the prefix cache holds each whole prompt after the first time, so a neighbour
    # that finishes and comes back costs ~no prefill. (Measured with distinct prompts: constrained neighbours finish
    # 3x as often as unconstrained ones, whose answers run longer, and their prefill steps then dominated the ratio.)
    constrained = cell_items(len(cases), False)
    # the same chats and length cap without the constraint
    free = [Item(it.key, it.prompt, {k: v for k, v in it.params.items() if k != "structured"}) for it in constrained]
    lanes_for = {
        "unconstrained": Lane("nb", 8, free, "auto", measured=False),
        "constrained": Lane("nb", 8, constrained, "auto", measured=False),
        "constrained_plain": Lane("nb", 8, constrained, "off", measured=False),
    }
    out: dict[str, Any] = {"round": rnd}
    for variant in arm_order(NEIGHBOUR_VARIANTS, rnd):
        bar = progress(
            total=sum(it.params["max_tokens"] for it in measured), desc=f"neighbours r{rnd} {variant}", unit="tok"
        )
        run = drive(eng, [Lane("m", 8, measured, "auto"), lanes_for[variant]], f"nb-r{rnd}-{variant}", mask, bar, gate)
        bar.close()
        recs = run.lanes["m"].records
        out[variant] = {
            "tpot_s": {measured[r.index].key: r.tpot for r in recs},
            "tokens": {measured[r.index].key: r.token_ids for r in recs},
            "tok_s": run.lanes["m"].tok_s,
            "wall_s": run.wall_s,
            "steps": run.steps,
            "tokens_per_step": ratio(run.fed_tokens, run.steps),
            "step_ms": 1e3 * ratio(run.step_s, run.steps),
            "grammar_share": ratio(run.grammar_s, run.step_s),
            "stats": run.stats,
            "neighbour_grammar": acceptance(run.stats.get("grammar")),
            "neighbours_started": run.submitted.get("nb", 0),
        }
    base = out[NEIGHBOUR_VARIANTS[0]]
    for variant in NEIGHBOUR_VARIANTS:
        out[variant]["tpot_ratio"] = paired_ratio(out[variant]["tpot_s"], base["tpot_s"])
        same, bad = compare_outputs(out[variant]["tokens"], base["tokens"])
        out[variant]["identical"] = f"{same}/{len(out[variant]['tokens'])}"
        if bad:
            print(f"\n!!!!!!!! MISMATCH: neighbours r{rnd} {variant}: {bad[:3]} !!!!!!!!\n", flush=True)
    print(
        f"  [neighbours r{rnd}] measured chat TPOT beside constrained / beside unconstrained: "
        f"{out['constrained']['tpot_ratio']:.3f}; beside constrained-plain: "
        f"{out['constrained_plain']['tpot_ratio']:.3f}",
        flush=True,
    )
    return out


def summarize_neighbours(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    by_variant, rows = {}, []
    fastest = {
        v: {k: min(r[v]["tpot_s"].get(k, float("inf")) for r in rounds) for k in rounds[0][v]["tpot_s"]}
        for v in NEIGHBOUR_VARIANTS
    }  # each request's best round
    for v in NEIGHBOUR_VARIANTS:
        sp = spread([r[v]["tpot_ratio"] for r in rounds])
        by_variant[v] = sp
        tp = [1e3 * x for r in rounds for x in r[v]["tpot_s"].values() if x == x]
        g = [r[v]["neighbour_grammar"] for r in rounds]
        n_tok = sum(x["draft_tokens"] for x in g)
        sp["best_of_rounds"] = paired_ratio(fastest[v], fastest[NEIGHBOUR_VARIANTS[0]])
        rows.append(
            {
                "variant": v,
                "tpot_ratio": sp["median"],
                "range": f"{sp['min']:.3f}-{sp['max']:.3f}",
                "best": sp["best_of_rounds"],
                "tpot_ms": sum(tp) / len(tp) if tp else None,
                "neighbour_grammar_len": None
                if not n_tok
                else 1 + sum(x["accepted_tokens"] for x in g) / max(1, sum(x["drafts"] for x in g)),
                "grammar_share": median([r[v]["grammar_share"] for r in rounds]),
                "tokens_per_step": median([r[v]["tokens_per_step"] for r in rounds]),
                "step_ms": median([r[v]["step_ms"] for r in rounds]),
                "neighbours_started": median([r[v]["neighbours_started"] for r in rounds]),
            }
        )
    return {"by_variant": by_variant, "rows": rows}


def plot(
    path: Path,
    passes: dict[str, Any],
    arms: list[str],
    cfg: dict[str, Any],
    env: dict[str, Any],
    nb: dict[str, Any] | None,
) -> Path:
    """Speedup vs plain per pass (plain's bar is 1.0, so every panel gives an arm the same colour; black lines:
    min-max over rounds), validity, and grammar time as a share of the step."""
    import matplotlib

    matplotlib.use("Agg")
    ncols = len(passes) + 2
    fig, axes = figure(ncols, width=5.2)
    levels = [f"c={c}" for c in cfg["levels"]]
    n = len(arms)
    for ax, (pname, p) in zip(axes, passes.items()):
        series = {a: [p["by_level"][c][a]["vs_plain"]["median"] for c in cfg["levels"]] for a in arms}
        bar_panel(
            ax,
            levels,
            series,
            title=f"{pname}: output tok/s vs constrained plain (median of rounds)",
            ylabel="x plain",
            hline=1.0,
        )
        for i, a in enumerate(arms):
            for g, c in enumerate(cfg["levels"]):
                vp = p["by_level"][c][a]["vs_plain"]
                x = g + (i - (n - 1) / 2) * 0.8 / n
                ax.plot([x, x], [vp["min"], vp["max"]], color="black", linewidth=0.8)
    ax = axes[len(passes)]
    groups = [f"{pn[0]} c={c}" for pn in passes for c in cfg["levels"]]
    bar_panel(
        ax,
        groups,
        {a: [100 * passes[pn]["by_level"][c][a]["valid_rate"] for pn in passes for c in cfg["levels"]] for a in arms},
        title="valid outputs (json + jsonschema), %; g = greedy, s = sampled",
        ylabel="%",
        hline=100.0,
        fmt="{:.0f}",
    )
    ax.set_ylim(0, 130)
    ax.legend(fontsize=6, loc="upper center", ncol=3)
    ax = axes[-1]
    g = passes["greedy"]["by_level"]
    bar_panel(
        ax,
        levels,
        {a: [100 * (g[c][a]["grammar_share"] or 0) for c in cfg["levels"]] for a in arms},
        title="grammar work, % of step time (greedy; goal 5%)",
        ylabel="%",
        hline=5.0,
        fmt="{:.1f}",
    )
    if nb:
        ax.set_xlabel(
            "neighbours' TPOT at c=16 vs beside unconstrained: "
            + ", ".join(
                f"{v.replace('constrained_', '')} {nb['by_variant'][v]['median']:.2f}x" for v in NEIGHBOUR_VARIANTS[1:]
            ),
            fontsize=8,
        )
    return save_figure(
        fig,
        path,
        suptitle=(
            f"SmolLM2-135M structured output (schema suite, max_tokens "
            f"{cfg['max_tokens']}), {env['cpu']}, {THREADS} threads, {env['time']} (loadavg {env['loadavg_start']} -> "
            f"{env.get('loadavg_end')})"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
