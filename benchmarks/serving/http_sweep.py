"""HTTP load sweep: routing policies `never`, `always` and the default (`goodput`) side by side.

    python -m benchmarks.serving.http_sweep [--quick]

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

``--switchback-rounds N`` adds a second measure of throughput at each concurrency: the modes
take turns on one unbroken load (benchmarks/serving/switchback.py says why and what it measured). Off
by default: on this machine its 6 s windows swung more than the bounded cells do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    RESULTS_DIR,
    env_info,
    figure,
    format_table,
    line_panel,
    percentile,
    progress,
    save_result,
    write_json,
)
from benchmarks.serving import switchback
from benchmarks.serving.loadgen import closed_loop
from benchmarks.serving.switchback import run_switchback, summarize, versus_best
from benchmarks.speculation.spec_bench import CHAT_PROMPTS, COPY_PROMPTS
from cluster.local_cluster import LocalCluster, Probe

MODES = {
    "never": {"name": "never"},
    "always": {"name": "always", "num_speculative_tokens": 4},
    "goodput": {"name": "goodput"},
}
MIN_REQUESTS = 4  # per cell, by default
FULL = dict(concurrency=[1, 2, 4, 8, 16, 32], max_tokens=48, requests=lambda c: max(MIN_REQUESTS, 2 * c))
QUICK = dict(concurrency=[1, 4], max_tokens=12, requests=lambda c: c)
# switchback (benchmarks/serving/switchback.py): windows per mode, seconds measured per window, seconds
# after each switch before measuring (the batch settles), seconds of load before the first window
SWITCHBACK = dict(rounds=0, window_s=6.0, washout_s=2.0, warmup_s=4.0)


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

    def __enter__(self) -> ViewAgeSampler:
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
    summed = {
        k: sum(r.get(k, 0) for r in rs)
        for k in (
            "requests",
            "errors",
            "spec_steps",
            "plain_steps",
            "draft_tokens",
            "accepted_tokens",
            "prompt_tokens",
            "cached_tokens",
        )
    }
    ages = [r["view_age_max_ms"] for r in rs if r.get("view_age_max_ms") is not None]
    return {
        **mid,
        **summed,
        "wall_s": wall,
        "tok_s": sum(r["tok_s"] * r["wall_s"] for r in rs) / wall,
        "tok_s_rounds": [r["tok_s"] for r in rs],
        "view_age_max_ms": max(ages) if ages else None,
    }


def paired_ratio(rounds: list[dict[str, Any]], mix: str, c: int) -> float | None:
    """Median over rounds of goodput / max(never, always) *within* each round.

    Each round runs the three modes back to back, so a ratio inside one round shares that minute's
    machine state; the pooled ``vs_best`` mixes minutes. Measured here: two back-to-back rounds of
    one mode at copy c=8 gave 52 and 70 tok/s, while policy traces showed goodput making always's
    K = 4 decisions on every step. Both statistics are reported; neither is chosen after the fact."""
    cell = [r for r in rounds if r["mix"] == mix and r["concurrency"] == c]
    return switchback.paired_ratio(cell, "goodput", ("never", "always"))


def wait_policy(cluster: LocalCluster, name: str) -> None:
    for _ in range(200):
        if cluster.stats()["policy"]["name"] == name:
            time.sleep(0.5)
            return
        time.sleep(0.3)
    raise TimeoutError(name)


def switchback_rows(windows: list[dict[str, Any]], client: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """(mode, mix, c) -> the switchback columns: tok/s over all windows, per round, request-steps
    by path, view age; the client latencies kept per cell (``client``); and for the default policy
    the ratio to the better of never / always, pooled and paired by round."""
    out: dict[tuple, dict[str, Any]] = {}
    for mix, c in dict.fromkeys((w["mix"], w["concurrency"]) for w in windows):
        ws = [w for w in windows if (w["mix"], w["concurrency"]) == (mix, c)]
        pooled, paired = versus_best(ws, "goodput", ("never", "always"))
        for mode, s in summarize(ws, []).items():
            lat = next((x for x in client if (x["mode"], x["mix"], x["concurrency"]) == (mode, mix, c)), {})
            out[(mode, mix, c)] = {
                "sb_tok_s": s["tok_s"],
                "sb_per_round": "/".join(f"{x:.1f}" for x in s["tok_s_rounds"]),
                "sb_req_steps": f"{s['spec_request_steps']}/{s['plain_request_steps']}",
                "sb_spec_share": s["spec_request_steps"] / max(1, s["spec_request_steps"] + s["plain_request_steps"]),
                "sb_itl_p50_ms": lat.get("itl_p50_ms"),
                "sb_itl_p99_ms": lat.get("itl_p99_ms"),
                "sb_ttft_p50_ms": lat.get("ttft_p50_ms"),
                "sb_view_age_max_ms": s["view_age_max_ms"],
                **({"sb_vs_best": pooled, "sb_vs_best_paired": paired} if mode == "goodput" else {}),
            }
    return out


def render(
    rounds: list[dict[str, Any]],
    windows: list[dict[str, Any]],
    client: list[dict[str, Any]],
    plan: dict[str, Any],
    info: dict[str, Any],
    name: str,
    mixes: list[str],
) -> None:
    """Tables, JSON and PNG from the per-round cells and the switchback windows (also rebuilds them
    from a partial run: --render)."""
    sb = switchback_rows(windows, client)
    keys = list(dict.fromkeys([(r["mode"], r["mix"], r["concurrency"]) for r in rounds] + list(sb)))
    rows = []
    for key in keys:
        rs = [r for r in rounds if (r["mode"], r["mix"], r["concurrency"]) == key]
        row = pool_rounds(rs) if rs else {"mode": key[0], "mix": key[1], "concurrency": key[2]}
        rows.append({**row, **sb.get(key, {})})
    # the acceptance bar: default policy vs the better of never / always, same mix and concurrency
    for r in rows:
        if r["mode"] == "goodput" and "tok_s" in r:
            peers = [
                x["tok_s"]
                for x in rows
                if x["mix"] == r["mix"]
                and x["concurrency"] == r["concurrency"]
                and x["mode"] in ("never", "always")
                and "tok_s" in x
            ]
            r["vs_best"] = r["tok_s"] / max(peers) if peers else None
            r["vs_best_paired"] = paired_ratio(rounds, r["mix"], r["concurrency"])
        if "tok_s" in r:
            r["steps"] = f"{r['spec_steps']}/{r['plain_steps']}"
            r["per_round"] = "/".join(f"{x:.1f}" for x in r["tok_s_rounds"])
            r["cached_share"] = r["cached_tokens"] / r["prompt_tokens"] if r.get("prompt_tokens") else None
    key_cols = [("mix", "mix", "s"), ("concurrency", "c", "d"), ("mode", "mode", "s")]
    if rounds:
        cols = key_cols + [
            ("tok_s", "tok/s", ".1f"),
            ("per_round", "tok/s per round", "s"),
            ("vs_best", "vs best", ".2f"),
            ("vs_best_paired", "paired", ".2f"),
            ("tpot_p50_ms", "TPOT p50", ".0f"),
            ("tpot_p99_ms", "TPOT p99", ".0f"),
            ("itl_p50_ms", "ITL p50", ".0f"),
            ("itl_p99_ms", "ITL p99", ".0f"),
            ("ttft_p50_ms", "TTFT p50", ".0f"),
            ("ttft_max_ms", "TTFT max", ".0f"),
            ("steps", "spec/plain steps", "s"),
            ("cached_share", "cached", ".2f"),
            ("view_age_max_ms", "view age max", ".0f"),
            ("errors", "errors", "d"),
        ]
        print(
            format_table(
                [r for r in rows if "tok_s" in r],
                cols,
                title=(
                    "Cells: a bounded closed loop per mode (tok/s over all rounds; ms; vs best = goodput / max(never, "
                    "always) pooled; paired = median over rounds of the same ratio within a round)"
                ),
            )
        )
    if windows:
        cols = key_cols + [
            ("sb_tok_s", "tok/s", ".1f"),
            ("sb_per_round", "tok/s per window", "s"),
            ("sb_vs_best", "vs best", ".3f"),
            ("sb_vs_best_paired", "paired", ".3f"),
            ("sb_spec_share", "spec share", ".2f"),
            ("sb_req_steps", "spec/plain req-steps", "s"),
            ("sb_itl_p50_ms", "ITL p50", ".0f"),
            ("sb_itl_p99_ms", "ITL p99", ".0f"),
            ("sb_ttft_p50_ms", "TTFT p50", ".0f"),
            ("sb_view_age_max_ms", "view age max", ".0f"),
        ]
        print(
            format_table(
                [r for r in rows if "sb_tok_s" in r],
                cols,
                title=(
                    "Switchback: the modes take turns on one unbroken closed loop (engine-counted tok/s over all "
                    "windows; vs best = goodput / max(never, always) over all windows; paired = median over rounds "
                    "of the ratio within a round; spec share = request-steps that verified drafts)"
                ),
            )
        )
    result = {
        "env": info,
        "plan": {k: v for k, v in plan.items() if k != "requests"},
        "rows": rows,
        "rounds": rounds,
        "switchback": windows,
        "switchback_client": client,
    }
    fig, axes = figure(ncols=2 * len(mixes), width=4.5)
    tput, tput_label = ("sb_tok_s", "switchback") if windows else ("tok_s", "cells")
    itl, itl_label = ("itl_p99_ms", "cells") if rounds else ("sb_itl_p99_ms", "switchback")

    def pick(mix: str, xs: list[int], m: str, key: str) -> list[Any]:
        return [
            next(r.get(key) for r in rows if r["mode"] == m and r["mix"] == mix and r["concurrency"] == c) for c in xs
        ]

    for j, mix in enumerate(mixes):
        xs = sorted({r["concurrency"] for r in rows if r["mix"] == mix})
        line_panel(
            axes[2 * j],
            xs,
            {m: pick(mix, xs, m, tput) for m in MODES},
            title=f"{mix}: throughput ({tput_label})",
            xlabel="concurrency",
            ylabel="output tok/s",
        )
        line_panel(
            axes[2 * j + 1],
            xs,
            {m: pick(mix, xs, m, itl) for m in MODES},
            title=f"{mix}: P99 ITL ({itl_label})",
            xlabel="concurrency",
            ylabel="ms",
        )
    save_result(RESULTS_DIR / name, result, fig, title="HTTP sweep")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--concurrency", help="comma-separated subset, e.g. 1,4,16 (default: the full 1..32)")
    ap.add_argument("--max-tokens", type=int, help="output tokens per request")
    ap.add_argument(
        "--requests-per-client", type=int, help="requests per client in each cell (default 2); more = less noise"
    )
    ap.add_argument("--min-requests", type=int, default=MIN_REQUESTS, help="at least this many requests in every cell")
    ap.add_argument("--mixes", default="copy,chat", help="comma-separated prompt mixes to run (copy, chat)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="bounded cells: repeat every cell this many times, the mode order rotated each round (0: none)",
    )
    ap.add_argument(
        "--switchback-rounds",
        type=int,
        default=SWITCHBACK["rounds"],
        help="switchback windows per mode at each concurrency (default 0: none); see benchmarks/serving/switchback.py",
    )
    ap.add_argument(
        "--window-s", type=float, default=SWITCHBACK["window_s"], help="measured seconds per switchback window"
    )
    ap.add_argument(
        "--washout-s",
        type=float,
        default=SWITCHBACK["washout_s"],
        help="seconds after each policy switch before its window is measured",
    )
    ap.add_argument(
        "--num-threads",
        type=int,
        default=2,
        help="the target engine's torch threads (ray_config.yaml serves with 2; 1 leaves a core to HTTP)",
    )
    ap.add_argument(
        "--prefix-caching",
        choices=["on", "off"],
        default="on",
        help="the engine's prefix caching (ray_config.yaml: on); off makes every request prefill in full",
    )
    ap.add_argument("--tag", help="write http_sweep_<tag>.{json,png} (a partial rerun keeps the full sweep's files)")
    ap.add_argument("--render", metavar="JSON", help="only rebuild the tables / JSON / PNG from a (partial) run's file")
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
    sbk = dict(rounds=a.switchback_rounds, window_s=a.window_s, washout_s=a.washout_s, warmup_s=SWITCHBACK["warmup_s"])
    if a.quick:
        sbk.update(window_s=min(a.window_s, 2.0), washout_s=min(a.washout_s, 1.0))
    plan.update(rounds=a.rounds, switchback=sbk, num_threads=a.num_threads, prefix_caching=a.prefix_caching)
    name = f"http_sweep_{a.tag}" if a.tag else "http_sweep"
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        plan.update(saved.get("plan", {}))  # a finished run's file records its plan; a partial one does not
        done = saved["rounds"]
        keys = {(r["mix"], r["concurrency"]) for r in done}
        full = [k for k in keys if {r["mode"] for r in done if (r["mix"], r["concurrency"]) == k} == set(MODES)]
        done = [r for r in done if (r["mix"], r["concurrency"]) in full]  # cells every mode finished
        windows = saved.get("switchback", [])
        render(
            done,
            windows,
            saved.get("switchback_client", []),
            plan,
            saved["env"],
            name,
            list(dict.fromkeys([r["mix"] for r in done] + [w["mix"] for w in windows])),
        )
        return
    mixes = {"copy": [p for _, _, p in COPY_PROMPTS], "chat": [p for _, _, p in CHAT_PROMPTS]}
    mixes = {m: mixes[m] for m in a.mixes.split(",")}
    info = env_info()
    rounds: list[dict[str, Any]] = []
    windows: list[dict[str, Any]] = []
    client: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(
            Path(tmp),
            policy=MODES["never"],
            args_patch={
                "engine": {
                    "max_num_seqs": 32,
                    "max_model_len": 1024,
                    "num_threads": a.num_threads,
                    "enable_prefix_caching": a.prefix_caching == "on",
                },
                "draft": {"enabled": False},
            },
        )
        with contextlib.ExitStack() as stack:
            stack.callback(cluster.stop)
            cluster.start()
            probe = stack.enter_context(Probe(cluster))

            def save() -> None:  # after every cell and window, so a cut-short run keeps them
                write_json(
                    RESULTS_DIR / f"{name}.partial.json",
                    {"env": info, "rounds": rounds, "switchback": windows, "switchback_client": client},
                )

            modes = list(MODES)
            cells = len(mixes) * len(plan["concurrency"])
            bar = progress(total=cells * len(modes) * (a.rounds + sbk["rounds"]), desc="http sweep", unit="window")
            current = None
            for mix in mixes:
                for c in plan["concurrency"]:
                    # Bounded cells (latency per request: TPOT, TTFT): each round runs the three modes
                    # back to back, in an order rotated per round, so that drift and the position after
                    # a redeploy favour no mode.
                    for rnd in range(a.rounds):
                        for mode in modes[rnd % len(modes) :] + modes[: rnd % len(modes)]:
                            if mode != current:
                                probe.call("Router", "reconfigure", {"policy": MODES[mode]})
                                wait_policy(cluster, MODES[mode]["name"])
                                asyncio.run(closed_loop(cluster.base_url, mixes[mix], 2, 4, 8))  # warm-up
                                current = mode
                            with ViewAgeSampler(probe) as ages:
                                res = asyncio.run(
                                    closed_loop(
                                        cluster.base_url, mixes[mix], c, plan["requests"](c), plan["max_tokens"]
                                    )
                                )
                            res["view_age_p50_ms"] = 1e3 * percentile(ages.ages, 50) if ages.ages else None
                            res["view_age_max_ms"] = 1e3 * max(ages.ages) if ages.ages else None
                            rounds.append({"mode": mode, "mix": mix, "concurrency": c, "round": rnd, **res})
                            save()
                            bar.update()
                    # Switchback (throughput, the issue-5 bar): the modes take turns on one unbroken load.
                    if sbk["rounds"]:

                        def on_window(w: dict[str, Any], mix: str = mix, c: int = c) -> None:
                            windows.append({"mix": mix, "concurrency": c, **w})
                            save()
                            bar.update()

                        ws, records = run_switchback(
                            probe,
                            cluster.base_url,
                            mixes[mix],
                            c,
                            plan["max_tokens"],
                            MODES,
                            on_window=on_window,
                            **sbk,
                        )
                        current = ws[-1]["mode"]
                        for mode, s in summarize(ws, records).items():
                            client.append(
                                {
                                    "mode": mode,
                                    "mix": mix,
                                    "concurrency": c,
                                    "requests": len(records),
                                    **{k: s[k] for k in ("itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "gaps")},
                                }
                            )
                        save()
            bar.close()
    render(rounds, windows, client, plan, info, name, list(mixes))


if __name__ == "__main__":
    main()
