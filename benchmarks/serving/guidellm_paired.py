"""The serving goals, paired in time: guidellm over HTTP and the engine in process, round by round.

    python -m benchmarks.serving.guidellm_paired [--rounds 3] [--streams 1,16] [--seconds 20] [--nodes 1]
                                         [--guidellm-workers 10] [--no-bound] [--out PATH]

``benchmarks/serving/guidellm_load.py`` measures every pass once, and its engine-alone pass before the service
starts, so a goal that divides an HTTP figure by an in-process one also divides two minutes of a
machine whose speed drifts 5-40% between minutes. Here one service runs (as ``make serve`` runs it: one
node, the shipped config; ``--nodes 2`` for the test clusters' shape) and every round measures, per
level, four passes back to back, in the order http, bound, alone, beside in odd rounds and beside,
alone, http, bound in even ones:

- **http**: ``guidellm run`` over HTTP (closed loop, synthetic prompts of the served tokenizer).
- **alone**: the same workload on the engine in this process, every process of the service stopped
  (SIGSTOP: memory held, no CPU, no wake-ups): what the engine does on these cores.
- **beside**: the same, with the service up and idle beside it (Ray's daemons, the Serve controller,
  the proxy, the ingress, the Router, the idle replicas).
- **bound**: beside, plus processes burning the cores guidellm used in this round's http pass. A
  serving path that cost nothing could read this; a goal missed here is missed by what must run beside
  the engine on these cores, whatever the serving path does.

Each goal is computed per round from that round's passes only (HTTP against the same round's alone
pass; guidellm's own latencies, and the steady state: requests sent after its warm-up window, the
in-process rule), then reported as the median with its range over rounds. The engine's steps are
recorded in every pass (benchmarks/serving/step_profile.py): the served decode-only step over the in-process
one of the same round says how much of a gap is steps run slower rather than smaller batches.
Writes ``--out``.{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, env_info, figure, progress, save_result
from benchmarks.serving.guidellm_load import (
    burn_cores,
    goals,
    in_process_engine,
    replica_step_count,
    replica_steps_since,
    run_engine,
    run_guidellm,
    served,
    stopped,
    warm_up_service,
)
from benchmarks.serving.guidellm_report import steady_view
from benchmarks.serving.guidellm_workload import service_config
from workers.model_loader import load_model

PASSES = ("http", "bound", "alone", "beside")
# what each goal set divides: an HTTP pass, or an in-process pass standing in for a serving path
VIEWS = {
    "http": "guidellm over HTTP",
    "http_steady": "guidellm over HTTP, steady state",
    "beside": "in process beside the idle service",
    "bound": "beside the idle service and the client's CPU",
    "alone": "the engine alone",
}


def pass_order(round_index: int, bound: bool) -> list[str]:
    """The passes of a level in round ``round_index`` (1-based); bound always right after http, whose
    client CPU it burns."""
    order = ["http", "bound", "alone", "beside"] if round_index % 2 == 1 else ["beside", "alone", "http", "bound"]
    return [p for p in order if bound or p != "bound"]


def round_goals(passes: dict[str, dict[int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One round's goals per view, each against the same round's engine-alone pass."""
    alone = passes["alone"]
    out = {"http": goals(passes["http"], alone), "http_steady": goals(steady_view(passes["http"]), alone)}
    for view in ("beside", "bound"):
        if passes.get(view):
            out[view] = goals(passes[view], alone)
    # the engine's own scaling (16 against 1 stream, TTFT): the goals that do not divide by the engine
    out["alone"] = {k: v for k, v in goals(alone, alone).items() if "/engine" not in k}
    return out


def summarize_goals(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per view and goal: the value in every round, its median and range, and in how many rounds it was met."""
    out: dict[str, dict[str, Any]] = {}
    for view in rounds[0]:
        for key in rounds[0][view]:
            vals = [r[view][key]["value"] for r in rounds if key in r.get(view, {})]
            met = [r[view][key]["met"] for r in rounds if key in r.get(view, {})]
            out.setdefault(view, {})[key] = {
                "values": vals,
                "median": statistics.median(vals),
                "min": min(vals),
                "max": max(vals),
                "met_rounds": sum(met),
                "rounds": len(met),
            }
    return out


def step_ratio(served: dict[str, Any], alone: dict[str, Any]) -> float | None:
    """Served decode-only step p50 over the in-process one (same round, same level)."""
    a, b = served.get("decode_only_step_ms_p50"), alone.get("decode_only_step_ms_p50")
    return a / b if a and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", default="1,16", help="levels; the goals need 1 and 16")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--warmup", type=float, default=0.2)
    ap.add_argument("--guidellm-workers", type=int, default=10, help="guidellm's worker processes (its default: 10)")
    ap.add_argument(
        "--nodes",
        type=int,
        default=1,
        choices=(1, 2),
        help="1: one Ray node, as `make serve` runs it; 2: the test clusters' two nodes",
    )
    ap.add_argument("--no-bound", action="store_true", help="skip the pass that burns the client's CPU")
    ap.add_argument("--out", default=str(RESULTS_DIR / "guidellm_paired"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    levels = [int(s) for s in args.streams.split(",")]
    cfg = service_config()
    loaded = load_model(cfg.engine.model)
    eng = in_process_engine(cfg, loaded, args.prompt_tokens)
    rounds: list[dict[str, Any]] = []

    def engine_level(c: int, seed: int) -> dict[str, Any]:  # one level of the closed loop in process
        return run_engine(eng, c, args.seconds, args.prompt_tokens, args.output_tokens, seed, args.warmup)

    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp) / "tokenizer"
        loaded.tokenizer.save_pretrained(tok_dir)
        cluster = served(Path(tmp), cfg, args.nodes)
        try:
            print(f"starting the service ({args.nodes} node{'s' if args.nodes > 1 else ''}) ...", flush=True)
            cluster.start()
            warm_up_service(cluster, cfg, args.prompt_tokens)
            procs = cluster.processes()
            for r in progress(range(1, args.rounds + 1), desc="paired rounds", unit="round"):
                passes: dict[str, dict[int, dict[str, Any]]] = {p: {} for p in PASSES}
                order = pass_order(r, not args.no_bound)
                for c in levels:
                    for p in order:
                        seed = 1000 * r + c
                        if p == "http":
                            before = replica_step_count(cluster)
                            res = run_guidellm(
                                cluster.base_url,
                                cfg.engine.served_model_name,
                                str(tok_dir),
                                c,
                                args.seconds,
                                args.prompt_tokens,
                                args.output_tokens,
                                Path(tmp) / f"guidellm_{r}_{c}.json",
                                args.warmup,
                                workers=args.guidellm_workers,
                                service=procs,
                            )
                            res["steps"] = replica_steps_since(cluster, before)
                        elif p == "alone":
                            with stopped(procs):
                                res = engine_level(c, seed)
                        elif p == "beside":
                            res = engine_level(c, seed)
                        else:
                            cores = passes["http"][c]["client_cpu_cores"]
                            burners = burn_cores(cores)
                            try:
                                res = engine_level(c, seed)
                            finally:
                                for b in burners:
                                    b.kill()
                                    b.wait()
                            res["client_cpu_cores"] = cores
                        passes[p][c] = res
                        print(
                            f"  round {r}, c={c}, {p}: {res['tok_s']:.1f} tok/s, TTFT p99 {res['ttft_p99_ms']:.0f} ms, "
                            f"ITL p50 {res['itl_p50_ms']:.1f} ms, decode-only step p50 "
                            f"{res['steps'].get('decode_only_step_ms_p50') or float('nan'):.1f} ms",
                            flush=True,
                        )
                rounds.append(
                    {
                        "round": r,
                        "order": order,
                        "passes": passes,
                        "goals": round_goals(passes),
                        "served_step/alone_step": {
                            c: step_ratio(passes["http"][c]["steps"], passes["alone"][c]["steps"]) for c in levels
                        },
                    }
                )
        finally:
            cluster.stop()
    summary = summarize_goals([r["goals"] for r in rounds])
    step_ratios = {
        c: [r["served_step/alone_step"][c] for r in rounds if r["served_step/alone_step"][c]] for c in levels
    }
    result = {
        "env": env_info(),
        "args": vars(args),
        "service": cfg.model_dump(mode="json"),
        "rounds": rounds,
        "goals": summary,
        "served_step/alone_step": step_ratios,
    }
    print(f"\n{args.rounds} paired rounds, {env_info().get('cpu', '')}; goal: median (min-max), rounds met")
    for view, gs in summary.items():
        print(f"{VIEWS[view]}:")
        for k, s in gs.items():
            print(
                f"    {k:<28} {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}), met in {s['met_rounds']}/{s['rounds']}"
            )
    for c, v in step_ratios.items():
        if v:
            print(
                f"c={c}: served decode-only step / in-process (alone), paired: median {statistics.median(v):.2f} "
                f"({min(v):.2f}-{max(v):.2f})"
            )
    keys = list(summary["http"])
    fig, axes = figure(ncols=len(keys), width=4.0)
    for ax, key in zip(axes, keys):
        views = [v for v in summary if key in summary[v]]
        for i, v in enumerate(views):
            ax.plot([i] * len(summary[v][key]["values"]), summary[v][key]["values"], "o", alpha=0.7)
        limit = float(key.split("=")[-1])
        ax.axhline(limit, color="k", ls="--", lw=1)
        ax.set_xticks(range(len(views)), [v.replace("_", "\n") for v in views], fontsize=7)
        ax.set_title(key, fontsize=8)
    title = f"serving goals per paired round (dashed: the goal), {args.prompt_tokens} in / {args.output_tokens} out"
    save_result(Path(args.out), result, fig, title=title)
    return 0


if __name__ == "__main__":
    sys.exit(main())
