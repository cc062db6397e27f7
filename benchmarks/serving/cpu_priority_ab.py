"""Engine first on the CPU vs Ray's own process priorities, on one running service, interleaved.

    python -m benchmarks.serving.cpu_priority_ab [--rounds 3] [--streams 1,4,16] [--tokens 64]

Starts the default service on a local cluster (cluster/local_cluster.py, so engine first as
shipped, cluster/cpu_priority.py), then switches every thread of the cluster between two settings
live, round by round (the order alternating), and drives it with streaming chat clients at each
stream count:

- ``ray default``: what Ray does without us: workers (the engine included) SCHED_OTHER at nice 15,
  Ray's daemons SCHED_OTHER at nice 0;
- ``engine first``: the engine's loop thread and its OpenMP pool SCHED_OTHER at nice 0, every other
  thread of the cluster SCHED_BATCH at nice 0, the background daemons demoted as the launchers do.

Switching back to a higher priority needs CAP_SYS_NICE (root in a container); the shipped path
only ever lowers priorities. Reports tok/s, TTFT and TPOT p50 per cell and the paired ratio
(engine first / ray default within one round) with its spread; writes
benchmarks/results/cpu_priority_ab.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, progress, save_figure, write_json
from benchmarks.engine.engine_bench import CHAT_PROMPTS
from benchmarks.serving.loadgen import closed_loop
from cluster import cpu_priority
from cluster.local_cluster import LocalCluster, Probe

OTHER, BATCH = (getattr(os, n, None) for n in ("SCHED_OTHER", "SCHED_BATCH"))
MODES = ("ray default", "engine first")


def set_thread(tid: int, nice: int, policy: int) -> None:
    try:
        os.sched_setscheduler(tid, OTHER, os.sched_param(0))  # out of SCHED_IDLE first
        os.setpriority(os.PRIO_PROCESS, tid, nice)
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except OSError:  # the thread ended
        pass


def apply(mode: str, procs: list[psutil.Process], engine_tids: set[int]) -> None:
    for p in procs:
        try:
            tids = [t.id for t in p.threads()]
            kind = cpu_priority.daemon_kind(p)
            worker = p.cmdline()[0].startswith("ray::") and kind is None
        except (psutil.Error, IndexError):
            continue
        for tid in tids:
            if mode == "ray default":
                set_thread(tid, 15 if worker else 0, OTHER)
            elif tid in engine_tids:
                set_thread(tid, 0, OTHER)
            else:
                set_thread(tid, 0, BATCH)
                if kind is not None:
                    cpu_priority.demote(tid, kind)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default=str(RESULTS_DIR / "cpu_priority_ab"))
    args = ap.parse_args(argv)
    if OTHER is None:
        sys.exit("needs Linux scheduling policies")
    levels = [int(s) for s in args.streams.split(",")]
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(
            Path(tmp),
            args_patch={
                "engine": {"num_threads": 2, "max_num_seqs": 32, "max_model_len": 2048},
                "target": {"num_cpus": 1},
            },
        )
        try:
            print("starting the service ...", flush=True)
            cluster.start()
            with Probe(cluster) as probe:
                place = probe.call("TargetWorker", "placement")
            replica = psutil.Process(place["pid"])
            # the threads that claimed SCHED_OTHER under the shipped launch: the loop thread and its pool
            engine_tids = {t.id for t in replica.threads() if os.sched_getscheduler(t.id) == OTHER}
            assert place["engine_thread"] in engine_tids, (place, engine_tids)
            procs = cluster.processes()
            asyncio.run(closed_loop(cluster.base_url, CHAT_PROMPTS, 2, 4, 16))  # warm-up
            for rnd in progress(range(args.rounds), desc="rounds"):
                for mode in MODES if rnd % 2 == 0 else MODES[::-1]:
                    apply(mode, procs, engine_tids)
                    for c in levels:
                        total = max(2 * c, 6)
                        r = asyncio.run(closed_loop(cluster.base_url, CHAT_PROMPTS, c, total, args.tokens))
                        cells.setdefault((mode, c), []).append(r)
                        print(
                            f"round {rnd} {mode:>12} c={c:<2} {r['tok_s']:6.1f} tok/s  TTFT p50 "
                            f"{r['ttft_p50_ms']:5.0f} ms  TPOT p50 {r['tpot_p50_ms']:5.1f} ms",
                            flush=True,
                        )
            apply("engine first", procs, engine_tids)
        finally:
            cluster.stop()
    rows = []
    for c in levels:
        base, first = cells[("ray default", c)], cells[("engine first", c)]
        paired = [f["tok_s"] / b["tok_s"] for f, b in zip(first, base)]
        row = {
            "streams": c,
            "paired_tok_s_ratio": statistics.median(paired),
            "paired_min": min(paired),
            "paired_max": max(paired),
        }
        for mode, rs in (("ray_default", base), ("engine_first", first)):
            for k in ("tok_s", "ttft_p50_ms", "tpot_p50_ms"):
                row[f"{mode}_{k}"] = statistics.median(r[k] for r in rs)
        rows.append(row)
        print(
            f"c={c}: engine first / ray default tok/s {row['paired_tok_s_ratio']:.3f} "
            f"({row['paired_min']:.3f}-{row['paired_max']:.3f}); TPOT p50 {row['ray_default_tpot_p50_ms']:.1f} -> "
            f"{row['engine_first_tpot_p50_ms']:.1f} ms; TTFT p50 {row['ray_default_ttft_p50_ms']:.0f} -> "
            f"{row['engine_first_ttft_p50_ms']:.0f} ms"
        )
    out = Path(args.out)
    write_json(
        out.with_suffix(".json"),
        {
            "env": env_info(),
            "args": vars(args),
            "rows": rows,
            "cells": {f"{m} c={c}": v for (m, c), v in cells.items()},
        },
    )
    fig, axes = figure(ncols=2, width=11)
    names = [f"c={r['streams']}" for r in rows]
    bar_panel(
        axes[0],
        names,
        {m: [r[f"{m.replace(' ', '_')}_tok_s"] for r in rows] for m in MODES},
        title="output tok/s over HTTP (median of rounds)",
        ylabel="tok/s",
    )
    bar_panel(
        axes[1],
        names,
        {m: [r[f"{m.replace(' ', '_')}_tpot_p50_ms"] for r in rows] for m in MODES},
        title="TPOT p50",
        ylabel="ms",
    )
    save_figure(fig, out.with_suffix(".png"), suptitle=env_info().get("cpu", ""))
    print(f"wrote {out.with_suffix('.json')} and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
