"""Where the HTTP path spends the machine: CPU seconds per output token in every process of the
local cluster, and the engine's own step time inside the target replica, at a few concurrencies.

    python -m benchmarks.serving.serving_profile [--streams 1,16] [--seconds 20]

Starts the default service (ray_config.yaml as shipped, on the local two-node cluster), drives it
with closed-loop streaming chat clients (benchmarks/serving/loadgen.py) for ``--seconds`` per level, and
reads each process's CPU time (psutil) before and after: the target replica, the ingress, the HTTP
proxy, the Router, the draft worker, Ray's own daemons (GCS, raylets, dashboard), and this client.
The engine's step time in the replica comes from its load snapshot (EMA of seconds per step) next
to the client-side time per output token. Writes benchmarks/results/serving_profile.{json,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, save_result
from benchmarks.engine.engine_bench import CHAT_PROMPTS
from benchmarks.serving.loadgen import closed_loop
from cluster.local_cluster import LocalCluster


def role(p: psutil.Process) -> str:
    """A short name for a cluster process, from its command line."""
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "gone"
    for key, name in [
        ("TargetWorker", "target replica"),
        ("Ingress", "ingress"),
        ("ProxyActor", "HTTP proxy"),
        ("ServeReplica:specserve:Router", "Router"),
        ("DraftWorker", "draft worker"),
        ("ServeController", "Serve controller"),
        ("gcs_server", "GCS"),
        ("raylet", "raylet"),
        ("dashboard", "dashboard"),
        ("log_monitor", "Ray daemons"),
        ("monitor", "Ray daemons"),
    ]:
        if key in cmd:
            return name
    return "other Ray" if "ray" in cmd else "other"


def cpu_by_role(procs: list[psutil.Process]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        r = role(p)
        out[r] = out.get(r, 0.0) + t.user + t.system
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        choices=(1, 2),
        help="1: one Ray node, as `make serve` runs it; 2: the test clusters' two nodes",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "serving_profile"))
    args = ap.parse_args(argv)
    levels = [int(s) for s in args.streams.split(",")]
    rows: list[dict[str, Any]] = []
    me = psutil.Process()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(
            Path(tmp),
            args_patch={
                "engine": {"num_threads": 2, "max_num_seqs": 32, "max_model_len": 2048},
                "target": {"num_cpus": 1},
            },
            nodes=args.nodes,
        )
        try:
            print("starting the service ...", flush=True)
            cluster.start()
            asyncio.run(closed_loop(cluster.base_url, CHAT_PROMPTS, 2, 4, 16))  # warm-up
            for c in levels:
                procs = [p for p in cluster.processes()] + [me]
                total = max(c, int(args.seconds * 25 * min(c, 8) / args.tokens))  # ~args.seconds of work
                cpu0, t0 = cpu_by_role(procs), time.perf_counter()
                cell = asyncio.run(closed_loop(cluster.base_url, CHAT_PROMPTS, c, total, args.tokens))
                wall = time.perf_counter() - t0
                cpu1 = cpu_by_role(procs)
                snap = cluster.stats()["replicas"]
                step_ms = [1e3 * v.get("step_time_ema_s", 0.0) for v in snap.values()]
                tokens = round(cell["tok_s"] * cell["wall_s"])
                cpu = {k: cpu1.get(k, 0.0) - cpu0.get(k, 0.0) for k in cpu1}
                cpu["this client"] = cpu.pop("other", 0.0)
                row = {
                    "streams": c,
                    "wall_s": wall,
                    "output_tokens": tokens,
                    "tok_s": tokens / wall,
                    "cpu_s": cpu,
                    "cpu_ms_per_token": {k: 1e3 * v / tokens for k, v in cpu.items()},
                    "cpu_utilisation": sum(cpu.values()) / wall,
                    "engine_step_ms_in_replica": step_ms,
                    "client_tpot_p50_ms": cell.get("tpot_p50_ms"),
                }
                rows.append(row)
                print(
                    f"c={c}: {tokens / wall:.1f} tok/s, step in replica {step_ms} ms, client TPOT p50 "
                    f"{cell.get('tpot_p50_ms')} ms; CPU ms per output token:",
                    flush=True,
                )
                for k, v in sorted(row["cpu_ms_per_token"].items(), key=lambda kv: -kv[1]):
                    print(f"    {k:>18}: {v:7.2f}")
        finally:
            cluster.stop()
    result = {"env": env_info(), "args": vars(args), "rows": rows}
    out = Path(args.out)
    roles = sorted({k for r in rows for k in r["cpu_ms_per_token"]})
    fig, axes = figure(ncols=1, width=10)
    bar_panel(
        axes[0],
        roles,
        {f"c={r['streams']}": [r["cpu_ms_per_token"].get(k, 0.0) for k in roles] for r in rows},
        title="CPU ms per output token, by process",
        ylabel="ms",
    )
    save_result(out, result, fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
