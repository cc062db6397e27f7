"""Paired A/B of the decode step: ``workers/runner.py`` at a git ref against the working tree, in one process.

    python -m benchmarks.engine.step_ab --ref main [--rounds 9] [--steps 16] [--threads 2] [--clock wall]

Why in one process: on a shared machine two runs minutes apart see different load. Here one engine per
dtype runs both versions, swapping the runner's class between cells (``ModelRunner`` keeps its state
layout, so the ref's methods run on the same weights, caches and row blockings); cells alternate order
every round and each round gives its own B/A ratio: the table reports the median and min..max.
``--clock cpu`` times each step with this thread's CPU time (use with ``--threads 1``): it leaves out
the time other processes held the core, so a change in per-step work shows through heavy contention.
Only runner.py comes from the ref; everything it imports is the working tree's.

Writes benchmarks/results/<--out>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    bar_panel,
    env_info,
    figure,
    format_table,
    loadavg,
    paired,
    progress,
    save_result,
)
from benchmarks.fidelity.invariance_bench import PROMPT
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model

ROOT = Path(__file__).resolve().parents[2]


def runner_at(ref: str) -> type:
    """``ModelRunner`` as ``workers/runner.py`` defines it at git ``ref``."""
    src = subprocess.run(
        ["git", "show", f"{ref}:workers/runner.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "runner_ref.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("runner_ref", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["runner_ref"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod.ModelRunner


def step_times(eng: LLMEngine, prompt: list[int], c: int, steps: int, clock: Any) -> float:
    """Median ``clock`` seconds of one plain decode step with ``c`` requests decoding."""
    for i in range(c):
        eng.add_request(f"ab{i}-{time.monotonic_ns()}", prompt, {"max_tokens": steps + 4, "ignore_eos": True})
    while any(r.in_prefill for r in eng.running) or eng.waiting:
        eng.step()
    eng.step()
    times = []
    for _ in range(steps):
        t0 = clock()
        eng.step()
        times.append(clock() - t0)
    while eng.has_work():
        eng.step()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ref", default="main", help="git ref whose workers/runner.py is side A")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--out", default="step_ab")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    env = env_info()
    loaded = load_model("smollm2")
    dtypes, cs = args.dtypes.split(","), [int(c) for c in args.concurrency.split(",")]
    engines = {
        dt: LLMEngine(
            EngineConfig(
                dtype=dt, batch_invariant=True, max_num_seqs=max(cs), enable_prefix_caching=False, proposers=[]
            ),
            loaded,
        )
        for dt in dtypes
    }
    sides = {"A": runner_at(args.ref), "B": type(engines[dtypes[0]].runner)}
    prompt = engines[dtypes[0]].tokenize_chat([{"role": "user", "content": PROMPT}])
    times: dict[tuple[str, str, int], list[float]] = {}
    outs: dict[str, list[list[int]]] = {}
    for dt, eng in engines.items():  # warm-up, and both sides must produce the same tokens
        for side, cls in sides.items():
            eng.runner.__class__ = cls
            outs[f"{dt}/{side}"] = eng.generate([prompt], {"max_tokens": 12})
    same = all(outs[f"{dt}/A"] == outs[f"{dt}/B"] for dt in dtypes)
    for rnd in progress(range(args.rounds), desc="rounds"):
        for dt in dtypes:
            for c in cs:
                for side in ("A", "B") if (rnd + c) % 2 == 0 else ("B", "A"):
                    engines[dt].runner.__class__ = sides[side]
                    times.setdefault((dt, side, c), []).append(step_times(engines[dt], prompt, c, args.steps, clock))
    rows = []
    for dt in dtypes:
        for c in cs:
            a, b = times[(dt, "A", c)], times[(dt, "B", c)]
            rows.append({"dtype": dt, "c": c, **paired(a, b)})
    print(
        format_table(
            rows,
            [
                ("dtype", "dtype", "s"),
                ("c", "c", "d"),
                ("a_ms", f"A={args.ref} ms", ".2f"),
                ("b_ms", "B=tree ms", ".2f"),
                ("ratio", "B/A median", ".3f"),
                ("ratio_min", "min", ".3f"),
                ("ratio_max", "max", ".3f"),
            ],
            title=f"decode step, {args.clock} clock, {args.threads} threads, {args.rounds} paired rounds",
        )
    )
    print(f"same greedy tokens on both sides: {same}")
    env["loadavg_end"] = loadavg()
    fig, axes = figure(ncols=1, width=6)
    bar_panel(
        axes[0],
        [f"{r['dtype'][:4]}/c{r['c']}" for r in rows],
        {"B/A step time": [r["ratio"] for r in rows]},
        title=f"tree / {args.ref}: decode step ({args.clock} clock, {args.threads} threads; < 1 = faster)",
        ylabel="B/A",
        fmt="{:.3f}",
    )
    save_result(
        RESULTS_DIR / args.out,
        {
            "env": env,
            "contended": True,
            "args": vars(args),
            "rows": rows,
            "same_tokens": same,
            "raw_s": {f"{dt}/{s}/c{c}": v for (dt, s, c), v in times.items()},
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
