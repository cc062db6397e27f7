"""Two checkouts over HTTP, paired by the minute: c=1 TPOT and the replica path it adds to the engine's step.

    python -m benchmarks.serving.replica_path_ab --base REV [--rounds 4] [--reps 6] [--steps 64] [--out PATH]

Arm ``head`` is the working tree, arm ``base`` git revision REV, checked out into a temporary worktree (its
native kernels are built from its own sources on first use). Every round starts a fresh local cluster per
arm (the served defaults, bf16 here), each in a child process that imports from the arm's checkout; the
child also builds an in-process engine from the same checkout. Each rep reads the machine's bandwidth, times
that engine's batch-1 decode step, then streams one request over HTTP: the replica path is the TPOT less
the step measured just before it, so the host's bandwidth swings between minutes (2x here) cancel out. The
arm order alternates by round. Reports per arm the replica path and the TPOT as a ratio to each rep's own
floor (served weight bytes over the bandwidth read); writes ``--out``.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MARK = "REPLICA_PATH_AB "


def child(reps: int, steps: int) -> None:
    """One arm's cluster and engine, from the checkout in the working directory; prints one JSON line."""
    sys.path.insert(0, os.getcwd())
    import torch

    from benchmarks.engine.decode_floor import MAX_LEN, ReadBandwidth, http_paired
    from benchmarks.engine.step_split import weight_bytes
    from benchmarks.fidelity.invariance_bench import PROMPT
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.model_loader import load_model

    torch.set_num_threads(2)
    loaded = load_model("smollm2")
    cfg = EngineConfig(max_num_seqs=4, max_model_len=MAX_LEN, num_threads=2, proposers=[], enable_prefix_caching=False)
    eng = LLMEngine(cfg, loaded)
    prompt = eng.tokenize_chat([{"role": "user", "content": PROMPT}])
    weights = sum(weight_bytes(eng.runner).values())  # what a batch-1 step must read, in the served dtype
    out = http_paired(eng, prompt, ReadBandwidth(512), steps, reps)
    dtype = str(eng.runner.dtype).removeprefix("torch.")
    print(MARK + json.dumps({"reps": out, "dtype": dtype, "model_bytes": weights}), flush=True)


def arm(checkout: Path, reps: int, steps: int) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(reps), str(steps)],
        cwd=checkout,
        env={**os.environ, "PYTHONPATH": str(checkout)},
        capture_output=True,
        text=True,
    )
    lines = [x for x in p.stdout.splitlines() if x.startswith(MARK)]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"the {checkout} arm failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1][len(MARK) :])


def summary(reps: list[dict[str, Any]], dtype: str) -> dict[str, Any]:
    path = [r["tpot_ms"] - r["inproc_ms"] for r in reps]
    window = [r["tpot_ms"] / r["floor_ms"] for r in reps]
    return {
        "dtype": dtype,
        "replica_path_ms": statistics.median(path),
        "replica_path_range": [min(path), max(path)],
        "tpot_ms": statistics.median(r["tpot_ms"] for r in reps),
        "x_window_floor": statistics.median(window),
        "x_window_range": [min(window), max(window)],
        "n": len(reps),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base", help="git revision of the base arm")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=64, help="tokens per stream and in-process steps per rep")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs=2, type=int, metavar=("REPS", "STEPS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(*a.child)
        return 0
    if not a.base:
        ap.error("--base REV is required")
    from benchmarks.common import RESULTS_DIR, env_info, figure, progress, save_result

    env = env_info()
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base_dir), a.base], check=True)
        try:
            checkouts = {"base": base_dir, "head": REPO}
            reps: dict[str, list[dict[str, Any]]] = {"base": [], "head": []}
            dtype = ""
            for r in progress(range(a.rounds), desc="rounds"):
                for name in ("base", "head") if r % 2 == 0 else ("head", "base"):
                    got = arm(checkouts[name], a.reps, a.steps)
                    dtype = got["dtype"]
                    for x in got["reps"]:
                        x["floor_ms"] = 1e3 * got["model_bytes"] / (x["gb_s"] * 1e9)
                        x["round"] = r
                    reps[name] += got["reps"]
                    path = [round(x["tpot_ms"] - x["inproc_ms"], 2) for x in got["reps"]]
                    print(f"round {r} {name}: replica path ms {path}", flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_dir)], check=False)
    result = {
        "env": env,
        "args": {"base": a.base, "rounds": a.rounds, "reps": a.reps, "steps": a.steps},
        "arms": {name: summary(v, dtype) for name, v in reps.items()},
        "reps": reps,
    }
    for name, s in result["arms"].items():
        lo, hi = s["replica_path_range"]
        wlo, whi = s["x_window_range"]
        print(
            f"{name}: replica path {s['replica_path_ms']:.2f} ms ({lo:.2f}..{hi:.2f}); TPOT {s['tpot_ms']:.2f} ms, "
            f"{s['x_window_floor']:.2f}x each rep's own floor ({wlo:.2f}..{whi:.2f}); n={s['n']}"
        )
    fig, (ax1, ax2) = figure(2)
    for name, v in reps.items():
        ax1.scatter([x["gb_s"] for x in v], [x["tpot_ms"] - x["inproc_ms"] for x in v], label=name, s=14)
        ax2.scatter([x["gb_s"] for x in v], [x["tpot_ms"] / x["floor_ms"] for x in v], label=name, s=14)
    ax1.set(title="replica path (TPOT - in-process step)", xlabel="read GB/s (the rep's)", ylabel="ms / token")
    ax2.set(title="c=1 TPOT / the rep's floor", xlabel="read GB/s (the rep's)", ylabel="x floor")
    ax2.axhline(1.5, color="grey", linestyle=":")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    out = Path(a.out) if a.out else RESULTS_DIR / "replica_path_ab"
    save_result(out.with_suffix(""), result, fig, title=f"replica path, {a.base} vs the working tree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
