"""Two cluster environments, paired: serving_profile under arm A and arm B, interleaved, as ratios.

    python -m benchmarks.serving.env_ab [--a "VAR=VALUE ..."] [--b "VAR=VALUE ..."]
                                [--rounds 4] [--streams 1,4,16] [--seconds 15] [--out PATH]

Each arm is the launchers' own environment (cluster/serve_env.py) with the listed variables set on
top (a variable the user sets wins there, so this sets it for that arm's cluster only); either
defaults to no change, i.e. what ships. Every round starts a fresh local cluster per arm and runs
``benchmarks.serving.serving_profile`` (streaming chat clients, closed loop, output tok/s and CPU per token
by process) in that arm; the order alternates per round, so a machine that drifts between minutes
(5-40% here) tilts both arms alike. Prints B / A per round and the median with its range, per
concurrency; writes ``--out``.{json,png} with every round's numbers and the exact command.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, env_info, figure, line_panel, save_result

ROLES_PATH = ("ingress", "HTTP proxy", "Router")  # the serving path's own processes, besides the target


def parse_env(spec: str) -> dict[str, str]:
    """``"A=1 B=x"`` -> ``{"A": "1", "B": "x"}``; anything that is not VAR=VALUE is an error naming it."""
    out = {}
    for word in shlex.split(spec):
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise SystemExit(f"not VAR=VALUE: {word!r}")
        out[key] = value
    return out


def order(round_index: int) -> tuple[str, str]:
    """Arm order of a round: A first in odd rounds, B first in even ones (1-based)."""
    return ("a", "b") if round_index % 2 == 1 else ("b", "a")


def paired(rounds: list[dict[str, Any]], streams: int) -> dict[str, Any]:
    """B / A output tok/s at one concurrency, per round, with the median and range over rounds."""
    ratios = []
    for r in rounds:
        a, b = (next(x for x in r[arm]["rows"] if x["streams"] == streams) for arm in ("a", "b"))
        ratios.append(b["tok_s"] / a["tok_s"])
    return {
        "ratios": ratios,
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "b_faster": sum(q > 1 for q in ratios),
    }


def path_cpu_ms(profile: dict[str, Any], streams: int) -> float:
    """CPU ms per output token in the ingress, the HTTP proxy and the Router at one concurrency."""
    row = next(x for x in profile["rows"] if x["streams"] == streams)
    return sum(row["cpu_ms_per_token"].get(k, 0.0) for k in ROLES_PATH)


def run_arm(env: dict[str, str], streams: str, seconds: float, out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.serving.serving_profile",
        "--streams",
        streams,
        "--seconds",
        str(seconds),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, env={**os.environ, **env}, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.with_suffix(".json").read_text())


def report(
    rounds: list[dict[str, Any]], levels: list[int], envs: dict[str, dict[str, str]], command: str, out: Path
) -> dict[str, Any]:
    """Print the paired ratios, write ``out``.{json,png}; ``rounds``: ``[{"order", "a", "b"}]`` with
    each arm's serving_profile result."""
    summary = {str(c): paired(rounds, c) for c in levels}
    for c in levels:
        s = summary[str(c)]
        print(
            f"c={c}: B / A tok/s median {s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f}), "
            f"B faster in {s['b_faster']} of {len(rounds)} rounds"
        )
    result = {
        "env": env_info(),
        "command": command,
        "arms": envs,
        "summary": summary,
        "rounds": [
            {
                "order": r["order"],
                **{
                    arm: {
                        "tok_s": {x["streams"]: x["tok_s"] for x in r[arm]["rows"]},
                        "path_cpu_ms_per_token": {c: path_cpu_ms(r[arm], c) for c in levels},
                        "rows": r[arm]["rows"],
                    }
                    for arm in ("a", "b")
                },
            }
            for r in rounds
        ],
    }
    fig, axes = figure(ncols=2)
    ratios = {f"round {i + 1}": [summary[str(c)]["ratios"][i] for c in levels] for i in range(len(rounds))}
    line_panel(
        axes[0],
        levels,
        {**ratios, "median": [summary[str(c)]["median"] for c in levels]},
        title="B / A output tok/s, per round",
        xlabel="streams",
        ylabel="ratio",
    )
    axes[0].axhline(1.0, color="gray", linestyle="--", linewidth=1)
    line_panel(
        axes[1],
        levels,
        {
            arm.upper(): [
                statistics.median(r[arm]["path_cpu_ms_per_token"][c] for r in result["rounds"]) for c in levels
            ]
            for arm in ("a", "b")
        },
        title="ingress + proxy + Router CPU ms per token (median)",
        xlabel="streams",
        ylabel="ms",
    )
    label = {arm: " ".join(f"{k}={v}" for k, v in envs[arm].items()) or "shipped" for arm in ("a", "b")}
    save_result(out, result, fig, title=textwrap.fill(f"A: {label['a']}; B: {label['b']}", 150))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", default="", help="arm A: VAR=VALUE ... on top of the shipped environment (default: none)")
    ap.add_argument("--b", default="", help="arm B: VAR=VALUE ... (default: the shipped environment)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--out", default=str(RESULTS_DIR / "env_ab"))
    args = ap.parse_args(argv)
    envs = {"a": parse_env(args.a), "b": parse_env(args.b)}
    levels = [int(s) for s in args.streams.split(",")]
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(1, args.rounds + 1):
            r: dict[str, Any] = {"order": "".join(order(i))}
            for arm in order(i):
                print(f"[env_ab] round {i}/{args.rounds}, arm {arm.upper()} ...", flush=True)
                r[arm] = run_arm(envs[arm], args.streams, args.seconds, Path(tmp, f"{arm}_{i}"))
            rounds.append(r)
            print(
                "[env_ab]   B / A tok/s: " + ", ".join(f"c={c} {paired([r], c)['median']:.3f}" for c in levels),
                flush=True,
            )
    command = " ".join(
        ["python -m benchmarks.serving.env_ab", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]
    )
    report(rounds, levels, envs, command, Path(args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
