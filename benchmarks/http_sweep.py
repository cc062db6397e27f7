"""HTTP load sweep: routing policies `never`, `always` and the default (`goodput`) side by side.

    python -m benchmarks.http_sweep [--quick]

Starts a local two-node Ray cluster (cluster/local_cluster.py), switches the routing policy for each
mode by calling the Router's ``reconfigure`` through a Serve handle (what `serve deploy` with a new
user_config does, without the CLI's ~5 s per switch), and drives it over real HTTP with a
closed-loop load generator: N concurrent streaming clients, a bounded number of requests per
cell, loopback only. For copy-heavy and chat prompt mixes at concurrency 1..32 it reports
aggregate output tok/s, P50/P99 time per output token (TPOT), P50/P99 inter-chunk latency
(ITL: the stalls a streaming client sees) and time to first token; prints a table, writes
benchmarks/results/http_sweep.json and a PNG (throughput and P99 ITL vs concurrency).

One short cell per mode swings by +-15% on 2 shared cores; ``--rounds N`` repeats every cell N
times with the mode order rotated per round and reports each cell over all its rounds, and
``--min-requests`` lengthens the short low-concurrency cells (the 0.97x bar needs both).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import RESULTS_DIR, env_info, figure, format_table, line_panel, percentile, progress, save_figure, write_json
from benchmarks.spec_bench import CHAT_PROMPTS, COPY_PROMPTS
from cluster.local_cluster import LocalCluster, Probe

MODEL = "SmolLM2-135M-Instruct"
MODES = {
    "never": {"name": "never"},
    "always": {"name": "always", "num_speculative_tokens": 4},
    "goodput": {"name": "goodput"},
}
MIN_REQUESTS = 4  # per cell, by default
FULL = dict(concurrency=[1, 2, 4, 8, 16, 32], max_tokens=48, requests=lambda c: max(MIN_REQUESTS, 2 * c))
QUICK = dict(concurrency=[1, 4], max_tokens=12, requests=lambda c: c)


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    chunks: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": r.status_code}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                usage = ev["usage"]
            elif ev["choices"] and ev["choices"][0]["delta"].get("content"):
                chunks.append(time.perf_counter())
    t1 = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    return {"ttft": chunks[0] - t0 if chunks else t1 - t0, "e2e": t1 - t0, "tokens": n,
            "tpot": (t1 - chunks[0]) / (n - 1) if chunks and n > 1 else None,
            "gaps": [b - a for a, b in zip(chunks, chunks[1:])], "spec": usage.get("speculation", {})}


async def closed_loop(url: str, prompts: list[str], concurrency: int, total: int, max_tokens: int) -> dict[str, Any]:
    queue = list(range(total))
    results: list[dict[str, Any]] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while queue:
            i = queue.pop()
            results.append(await one_request(client, url, prompts[i % len(prompts)], max_tokens))

    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    gaps = [g for r in ok for g in r["gaps"]]
    tpots = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {
        "requests": len(results), "errors": len(results) - len(ok), "wall_s": wall,
        "tok_s": sum(r["tokens"] for r in ok) / wall,
        "tpot_p50_ms": 1e3 * percentile(tpots, 50), "tpot_p99_ms": 1e3 * percentile(tpots, 99),
        "itl_p50_ms": 1e3 * percentile(gaps, 50), "itl_p99_ms": 1e3 * percentile(gaps, 99),
        "ttft_p50_ms": 1e3 * percentile([r["ttft"] for r in ok], 50),
        "draft_tokens": sum(r["spec"].get("draft_tokens", 0) for r in ok),
        "accepted_tokens": sum(r["spec"].get("accepted_tokens", 0) for r in ok),
        "spec_steps": sum(r["spec"].get("spec_steps", 0) for r in ok),
        "plain_steps": sum(r["spec"].get("plain_steps", 0) for r in ok),
    }


class ViewAgeSampler:
    """Polls the Router's view every ``period_s`` during a cell and keeps the age of each replica's last
    load report as the Router saw it (issue 5: never older than ~100 ms).

    It asks the Router directly through the sweep's :class:`Probe` (a Serve handle call), not
    ``/v1/speculation/stats``: that endpoint also gathers every replica's metric samples, which runs
    in the target's engine thread between steps, so polling it would load the system being measured.
    """

    def __init__(self, probe: Probe, period_s: float = 0.5) -> None:
        self.probe, self.period_s, self.ages = probe, period_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                reps = self.probe.call("Router", "stats", timeout_s=5).get("replicas", {})
                self.ages.extend(float(r["age_s"]) for r in reps.values() if "age_s" in r)
            except Exception:
                pass

    def __enter__(self) -> "ViewAgeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def pool_rounds(rs: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell over all its rounds: throughput = all tokens / all wall time (every request counts;
    the mean, which is a tighter estimate than the median round when rounds are few), step and
    draft-token counts summed; latency percentiles from the median-throughput round (rounds keep no raw samples)."""
    mid = sorted(rs, key=lambda r: r["tok_s"])[(len(rs) - 1) // 2]
    wall = sum(r["wall_s"] for r in rs)
    summed = {k: sum(r.get(k, 0) for r in rs)
              for k in ("requests", "errors", "spec_steps", "plain_steps", "draft_tokens", "accepted_tokens")}
    ages = [r["view_age_max_ms"] for r in rs if r.get("view_age_max_ms") is not None]
    return {**mid, **summed, "wall_s": wall, "tok_s": sum(r["tok_s"] * r["wall_s"] for r in rs) / wall,
            "tok_s_rounds": [r["tok_s"] for r in rs], "view_age_max_ms": max(ages) if ages else None}


def paired_ratio(rounds: list[dict[str, Any]], mix: str, c: int) -> float | None:
    """Median over rounds of goodput / max(never, always) *within* each round.

    Each round runs the three modes back to back, so a ratio inside one round shares that minute's
    machine state; the pooled ``vs_best`` mixes minutes. Measured here: two back-to-back rounds of
    one mode at copy c=8 gave 52 and 70 tok/s, while policy traces showed goodput making always's
    K = 4 decisions on every step. Both statistics are reported; neither is chosen after the fact."""
    by_round: dict[int, dict[str, float]] = {}
    for r in rounds:
        if r["mix"] == mix and r["concurrency"] == c:
            by_round.setdefault(r["round"], {})[r["mode"]] = r["tok_s"]
    ratios = [m["goodput"] / max(m["never"], m["always"]) for m in by_round.values()
              if {"goodput", "never", "always"} <= m.keys()]
    return statistics.median(ratios) if ratios else None


def wait_policy(cluster: LocalCluster, name: str) -> None:
    for _ in range(200):
        if cluster.stats()["policy"]["name"] == name:
            time.sleep(0.5)
            return
        time.sleep(0.3)
    raise TimeoutError(name)


def render(rounds: list[dict[str, Any]], plan: dict[str, Any], info: dict[str, Any], name: str,
           mixes: list[str], num_rounds: int) -> None:
    """Table, JSON and PNG from the per-round cells (also rebuilds them from a partial run: --render)."""
    rows = [pool_rounds([r for r in rounds if (r["mode"], r["mix"], r["concurrency"]) == key])
            for key in dict.fromkeys((r["mode"], r["mix"], r["concurrency"]) for r in rounds)]
    # the acceptance bar: default policy vs the better of never / always, same mix and concurrency
    for r in rows:
        if r["mode"] == "goodput":
            peers = [x["tok_s"] for x in rows if x["mix"] == r["mix"] and x["concurrency"] == r["concurrency"]
                     and x["mode"] in ("never", "always")]
            r["vs_best"] = r["tok_s"] / max(peers) if peers else None
            r["vs_best_paired"] = paired_ratio(rounds, r["mix"], r["concurrency"])
    for r in rows:
        r["steps"] = f"{r['spec_steps']}/{r['plain_steps']}"
        r["per_round"] = "/".join(f"{x:.1f}" for x in r["tok_s_rounds"])
    cols = [("mix", "mix", "s"), ("concurrency", "c", "d"), ("mode", "mode", "s"), ("tok_s", "tok/s", ".1f"),
            ("per_round", "tok/s per round", "s"), ("vs_best", "vs best", ".2f"), ("vs_best_paired", "paired", ".2f"), ("tpot_p50_ms", "TPOT p50", ".0f"), ("tpot_p99_ms", "TPOT p99", ".0f"),
            ("itl_p50_ms", "ITL p50", ".0f"), ("itl_p99_ms", "ITL p99", ".0f"), ("ttft_p50_ms", "TTFT p50", ".0f"),
            ("steps", "spec/plain steps", "s"), ("view_age_max_ms", "view age max", ".0f"), ("errors", "errors", "d")]
    table = format_table(rows, cols, title="HTTP sweep (tok/s over all rounds; ms; vs best = goodput / max(never, always) pooled; paired = median over rounds of the same ratio within a round)")
    print(table)
    write_json(RESULTS_DIR / f"{name}.json", {"env": info, "plan": {**{k: v for k, v in plan.items() if k != "requests"},
                                                                      "rounds": num_rounds}, "rows": rows, "rounds": rounds})
    fig, axes = figure(ncols=4, width=4.5)
    for j, mix in enumerate(mixes):
        xs = sorted({r["concurrency"] for r in rows if r["mix"] == mix})
        pick = lambda m, key: [next(r[key] for r in rows if r["mode"] == m and r["mix"] == mix and r["concurrency"] == c) for c in xs]
        line_panel(axes[2 * j], xs, {m: pick(m, "tok_s") for m in MODES}, title=f"{mix}: throughput",
                   xlabel="concurrency", ylabel="output tok/s")
        line_panel(axes[2 * j + 1], xs, {m: pick(m, "itl_p99_ms") for m in MODES}, title=f"{mix}: P99 ITL",
                   xlabel="concurrency", ylabel="ms")
    save_figure(fig, RESULTS_DIR / f"{name}.png", suptitle=f"HTTP sweep, {info.get('cpu', '')}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", help="comma-separated subset, e.g. 1,4,16 (default: the full 1..32)")
    ap.add_argument("--max-tokens", type=int, help="output tokens per request")
    ap.add_argument("--requests-per-client", type=int,
                    help="requests per client in each cell (default 2); more = less noise")
    ap.add_argument("--min-requests", type=int, default=MIN_REQUESTS, help="at least this many requests in every cell")
    ap.add_argument("--mixes", default="copy,chat", help="comma-separated prompt mixes to run (copy, chat)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat every cell this many times, the mode order rotated each round; report all rounds pooled")
    ap.add_argument("--tag", help="write http_sweep_<tag>.{json,png} (a partial rerun keeps the full sweep's files)")
    ap.add_argument("--render", metavar="JSON", help="only rebuild the table / JSON / PNG from a (partial) run's file")
    a = ap.parse_args()
    plan = dict(QUICK if a.quick else FULL)
    if a.concurrency:
        plan["concurrency"] = [int(c) for c in a.concurrency.split(",")]
    if a.max_tokens:
        plan["max_tokens"] = a.max_tokens
    if a.requests_per_client or a.min_requests != MIN_REQUESTS:
        n, lo = a.requests_per_client or 2, a.min_requests
        plan["requests"] = lambda c: max(lo, n * c)
        plan["requests_per_client"], plan["min_requests"] = n, lo
    name = f"http_sweep_{a.tag}" if a.tag else "http_sweep"
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        plan.update(saved.get("plan", {}))  # a finished run's file records its plan; a partial one does not
        done = saved["rounds"]
        keys = {(r["mix"], r["concurrency"]) for r in done}
        full = [k for k in keys if {r["mode"] for r in done if (r["mix"], r["concurrency"]) == k} == set(MODES)]
        done = [r for r in done if (r["mix"], r["concurrency"]) in full]  # cells every mode finished
        render(done, plan, saved["env"], name, list(dict.fromkeys(r["mix"] for r in done)),
               max(r["round"] for r in done) + 1)
        return
    mixes = {"copy": [p for _, _, p in COPY_PROMPTS], "chat": [p for _, _, p in CHAT_PROMPTS]}
    mixes = {m: mixes[m] for m in a.mixes.split(",")}
    info = env_info()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp), policy=MODES["never"], args_patch={
            "engine": {"max_num_seqs": 32, "max_model_len": 1024, "num_threads": 2},
            "draft": {"enabled": False},
        })
        probe = None
        try:
            cluster.start()
            probe = Probe(cluster)
            # Each round runs the three modes back to back, in an order rotated per round, so that
            # drift and the position after a redeploy favour no mode (one short cell each swings
            # by +-15% on 2 shared cores, far more than the 0.97x bar).
            modes = list(MODES)
            cells = [(mode, mix, c, rnd) for mix in mixes for c in plan["concurrency"] for rnd in range(a.rounds)
                     for mode in modes[rnd % len(modes):] + modes[: rnd % len(modes)]]
            current = None
            for mode, mix, c, rnd in progress(cells, desc="http sweep", unit="cell"):
                if mode != current:
                    probe.call("Router", "reconfigure", {"policy": MODES[mode]})
                    wait_policy(cluster, MODES[mode]["name"])
                    asyncio.run(closed_loop(cluster.base_url, mixes[mix], 2, 4, 8))  # warm-up (cost model)
                    current = mode
                with ViewAgeSampler(probe) as ages:
                    res = asyncio.run(closed_loop(cluster.base_url, mixes[mix], c, plan["requests"](c),
                                                  plan["max_tokens"]))
                res["view_age_p50_ms"] = 1e3 * percentile(ages.ages, 50) if ages.ages else None
                res["view_age_max_ms"] = 1e3 * max(ages.ages) if ages.ages else None
                rounds.append({"mode": mode, "mix": mix, "concurrency": c, "round": rnd, **res})
                # written after every cell, so a run cut short still leaves its measurements
                write_json(RESULTS_DIR / f"{name}.partial.json", {"env": info, "rounds": rounds})
        finally:
            if probe is not None:
                probe.close()
            cluster.stop()
    render(rounds, plan, info, name, list(mixes), a.rounds)


if __name__ == "__main__":
    main()
