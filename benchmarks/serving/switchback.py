"""Switchback throughput: the routing modes take turns, seconds apart, on one unbroken load.

Why this design. Issue 5's bar (the default policy >= 0.97x the better of `never` and `always`
at every concurrency) is a 3% comparison, and on 2 shared cores one count-based cell per mode
swings by +-10-15%. Two causes, both measured: the machine drifts over tens of seconds (the same
plain batch-4 step cost 50-69 ms from one 10 s cell to the next), and every cell has its own
ramp-up and drain. A switchback experiment (the A/B design for a shared system that cannot be
split in two) removes both. One closed loop of c clients streams without pause; the Router's
policy changes every few seconds, each round in a different order; each mode's window starts
after a washout and is measured from the engine's cumulative counters (output tokens,
request-steps by path) in two load snapshots, over the snapshots' own timestamps. The modes
compared within a round are seconds apart, so they share the machine's state. Each span restarts
the clients' prompt sequence, so every mode is fed the same prompts in the same order. The orders
balance carry-over (each mode follows each other mode about equally often: :func:`rotation`),
and no window holds a ramp or a tail.

What it measures: steady-state committed tokens/s with c busy clients, which a count-based
cell's tokens / wall time approximates (with its ramp and tail). Client-side inter-chunk gaps
and TTFT are attributed to windows by arrival time.

What it found on the 2-core CI machine (session 10, copy mix, c=4, 6 s windows after 2 s
washouts): windows of one mode swung by 10-15%, more than bounded cells of ~9 s (5-10%), and
pairing within a round did not narrow the ratio. The noise there is fast and is the machine's
own: an in-process engine (no Ray, no HTTP) running identical cells with identical prefix-cache
hits gave 50-58 tok/s in one minute and 67-70 in another. So http_sweep keeps bounded cells as
its default measure; this design pays where drift is slow next to a window (a GPU host's
clocks and thermals) and where a cell's ramp and tail are a large part of it (long requests).
"""

from __future__ import annotations

import collections
import functools
import itertools
import statistics
import time
from typing import Any, Callable

from benchmarks.common import percentile
from benchmarks.serving.loadgen import ContinuousLoad


def read_counters(probe: Any) -> tuple[dict[str, dict[str, Any]], list[float]]:
    """Every target replica's last load snapshot as the Router holds it, and each one's age (s)."""
    reps = probe.call("Router", "stats", timeout_s=10).get("replicas", {})
    return reps, [float(r["age_s"]) for r in reps.values() if "age_s" in r]


def window_delta(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Counters between two reads: tokens/s is the sum over replicas of each one's rate over its own
    snapshot timestamps (a replica missing from either read, or restarted between them, is left out)."""
    out = {"tokens": 0, "seconds": 0.0, "tok_s": 0.0, "spec_request_steps": 0, "plain_request_steps": 0}
    spans = []
    for rid in a.keys() & b.keys():
        sa, sb = a[rid], b[rid]
        dt, dn = sb["timestamp"] - sa["timestamp"], sb["output_tokens"] - sa["output_tokens"]
        if dt <= 0 or dn < 0:
            continue
        spans.append(dt)
        out["tokens"] += dn
        out["tok_s"] += dn / dt
        for k in ("spec_request_steps", "plain_request_steps"):
            out[k] += sb[k] - sa[k]
    out["seconds"] = statistics.mean(spans) if spans else 0.0
    return out


def rotation(modes: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in run order, balanced for carry-over: a window's washout starts from the state
    the previous mode left (its batch, its requests' progress), so every mode should follow every
    other equally often. A cyclic rotation (ABC, BCA, CAB) does not: B follows A in every round.
    Each round here takes the permutation not yet used in this cycle of n! that keeps the counts
    of (previous, next) pairs, round boundaries included, most even, and never repeats a mode
    across a boundary. For 3 modes over 6 rounds: every ordered pair 2-3 times, each mode first twice."""
    perms = list(itertools.permutations(modes))
    pairs: collections.Counter[tuple[str, str]] = collections.Counter()
    unused: list[tuple[str, ...]] = []
    order: list[tuple[int, str]] = []

    def steps(prev: list[str], p: tuple[str, ...]) -> list[tuple[str, str]]:
        seq = prev + list(p)
        return list(zip(seq, seq[1:]))

    def cost(prev: list[str], p: tuple[str, ...]) -> int:
        c = pairs + collections.Counter(steps(prev, p))
        return sum(v * v if a != b else 1000 * v for (a, b), v in c.items())

    for rnd in range(rounds):
        unused = unused or list(perms)
        prev = [order[-1][1]] if order else []
        best = min(unused, key=functools.partial(cost, prev))  # the first minimum: deterministic
        unused.remove(best)
        pairs.update(steps(prev, best))
        order += [(rnd, m) for m in best]
    return order


def run_switchback(
    probe: Any,
    url: str,
    prompts: list[str],
    concurrency: int,
    max_tokens: int,
    modes: dict[str, dict[str, Any]],
    rounds: int,
    window_s: float,
    washout_s: float,
    warmup_s: float,
    poll_s: float = 0.5,
    on_window: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Drive ``concurrency`` clients without pause and give each mode ``rounds`` windows.

    ``modes`` maps a mode name to its Router policy (what ``serve deploy`` would set in
    user_config). Returns the windows (mode, round, perf_counter bounds, counter deltas, the
    Router's view ages seen) and every request's client-side record."""
    load = ContinuousLoad(url, prompts, concurrency, max_tokens).start()
    windows: list[dict[str, Any]] = []
    try:
        time.sleep(warmup_s)  # every client busy; the engine's cost model and acceptance warm
        for rnd, mode in rotation(list(modes), rounds):
            probe.call("Router", "reconfigure", {"policy": modes[mode]})
            load.restart()  # every mode's span is fed the same prompts in the same order
            t_switch = time.perf_counter()
            time.sleep(washout_s)  # the replicas pick the policy up within one report (50 ms); the batch settles
            a, ages = read_counters(probe)
            t_a = time.perf_counter()
            while time.perf_counter() < t_a + window_s - poll_s / 2:
                time.sleep(poll_s)
                ages += read_counters(probe)[1]
            b, more = read_counters(probe)
            w = {
                "mode": mode,
                "round": rnd,
                "t_switch": t_switch,
                "t_a": t_a,
                "t_b": time.perf_counter(),
                **window_delta(a, b),
                "view_age_max_ms": 1e3 * max(ages + more) if ages + more else None,
            }
            windows.append(w)
            if on_window is not None:
                on_window(w)
    finally:
        records = load.stop()
    return windows, records


def client_metrics(windows: list[dict[str, Any]], records: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Client-side latencies of ``mode``'s windows: inter-chunk gaps that end inside a window, and
    the TTFT of requests sent after the window's switch whose first chunk came inside it."""
    spans = [(w["t_switch"], w["t_a"], w["t_b"]) for w in windows if w["mode"] == mode]
    gaps: list[float] = []
    ttfts: list[float] = []
    for r in records:
        if "error" in r or not r["chunks"]:
            continue
        ch = r["chunks"]
        for s, a, b in spans:
            gaps += [y - x for x, y in zip(ch, ch[1:]) if a <= y <= b]
            if r["t0"] >= s and a <= ch[0] <= b:
                ttfts.append(ch[0] - r["t0"])
    return {
        "itl_p50_ms": 1e3 * percentile(gaps, 50),
        "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "gaps": len(gaps),
    }


def summarize(windows: list[dict[str, Any]], records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode: tok/s over all its windows (all tokens / all seconds), each round's tok/s, the
    request-steps by path, the Router's view age, and the client-side latencies."""
    out = {}
    for mode in dict.fromkeys(w["mode"] for w in windows):
        ws = sorted((w for w in windows if w["mode"] == mode), key=lambda w: w["round"])
        secs = sum(w["seconds"] for w in ws)
        ages = [w["view_age_max_ms"] for w in ws if w["view_age_max_ms"] is not None]
        out[mode] = {
            "tok_s": sum(w["tok_s"] * w["seconds"] for w in ws) / secs if secs else float("nan"),
            "tok_s_rounds": [w["tok_s"] for w in ws],
            "seconds": secs,
            "spec_request_steps": sum(w["spec_request_steps"] for w in ws),
            "plain_request_steps": sum(w["plain_request_steps"] for w in ws),
            "view_age_max_ms": max(ages) if ages else None,
            **client_metrics(windows, records, mode),
        }
    return out


def versus_best(windows: list[dict[str, Any]], mode: str, peers: tuple[str, ...]) -> tuple[float | None, float | None]:
    """``mode``'s tok/s over the best peer's: pooled over all windows, and the median over rounds of
    the same ratio within one round (which shares that half-minute's machine state)."""
    summary = summarize(windows, [])
    if mode not in summary or not all(p in summary for p in peers):
        return None, None
    pooled = summary[mode]["tok_s"] / max(summary[p]["tok_s"] for p in peers)
    return pooled, paired_ratio(windows, mode, peers)


def paired_ratio(items: list[dict[str, Any]], mode: str, peers: tuple[str, ...]) -> float | None:
    """Median over rounds of ``mode``'s tok/s / the best peer's *within* each round, from items
    (switchback windows or bounded cells of one mix and concurrency) with ``round``, ``mode`` and
    ``tok_s``; rounds missing any of the modes are left out."""
    by_round: dict[int, dict[str, float]] = {}
    for it in items:
        by_round.setdefault(it["round"], {})[it["mode"]] = it["tok_s"]
    ratios = [r[mode] / max(r[p] for p in peers) for r in by_round.values() if {mode, *peers} <= r.keys()]
    return statistics.median(ratios) if ratios else None
