"""What position-keyed sampling costs per step: the shipped ``keyed_sample`` vs its definition.

    python -m benchmarks.fidelity.sampler_bench [--rounds 7] [--rows 1,4,16,32,64] [--vocab 49152]

``keyed_sample`` runs the exponential race in float32 and gives the exact fp64 noise only to the
entries near each row's best; the definition, ``argmax(p / keyed_exponentials(keys))``, takes the
fp64 log of every draw. Both run on the same softmax rows (SmolLM2's vocabulary by default) and the
same position keys, interleaved round by round (the order alternating), and must pick the same
tokens (the run stops if not). Reports the median ms per call of each and the median speed-up with
its min..max over rounds; writes benchmarks/results/sampler_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.common import (
    RESULTS_DIR,
    env_info,
    figure,
    format_table,
    line_panel,
    save_result,
    set_threads,
)
from workers.sampler import keyed_exponentials, keyed_sample, position_key


def definition(p: torch.Tensor, keys: list[int]) -> torch.Tensor:  # [n, vocab] -> [n]
    return (p / keyed_exponentials(keys, p.shape[1], "cpu")).argmax(dim=-1)


def time_call(fn: Callable[[], Any], calls: int) -> float:
    """Median seconds of one call over ``calls`` calls (after one untimed call)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=10, help="timed calls per cell and round")
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS_DIR / "sampler_bench"))
    args = ap.parse_args(argv)
    set_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    # a sampled LM's rows: softmax of logits with a realistic spread
    inputs = {
        n: (
            torch.softmax(torch.randn(n, args.vocab, generator=gen) * 3.0, dim=-1),
            [position_key(1234 + i, i) for i in range(n)],
        )
        for n in rows
    }
    for n, (p, keys) in inputs.items():
        if not torch.equal(keyed_sample(p, keys), definition(p, keys)):
            raise SystemExit(f"keyed_sample and its definition disagree at {n} rows")
    cells: dict[int, dict[str, list[float]]] = {n: {"shipped": [], "definition": []} for n in rows}
    for r in range(args.rounds):
        for n in rows:
            p, keys = inputs[n]
            order = [("shipped", keyed_sample), ("definition", definition)]
            for name, fn in order if r % 2 == 0 else order[::-1]:
                cells[n][name].append(time_call(functools.partial(fn, p, keys), args.calls))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    table = []
    for n in rows:
        s, d = cells[n]["shipped"], cells[n]["definition"]
        speedups = [b / a for a, b in zip(s, d)]
        table.append(
            {
                "rows": n,
                "shipped_ms": 1e3 * statistics.median(s),
                "definition_ms": 1e3 * statistics.median(d),
                "speedup": statistics.median(speedups),
                "speedup_min": min(speedups),
                "speedup_max": max(speedups),
            }
        )
    print(
        format_table(
            table,
            [
                ("rows", "rows", "d"),
                ("shipped_ms", "shipped ms", ".2f"),
                ("definition_ms", "definition ms", ".2f"),
                ("speedup", "speed-up", ".2f"),
                ("speedup_min", "min", ".2f"),
                ("speedup_max", "max", ".2f"),
            ],
            title=f"keyed sampling, vocab {args.vocab}, {args.threads} threads",
        )
    )
    out = Path(args.out)
    fig, axes = figure(ncols=1, width=7)
    line_panel(
        axes[0],
        rows,
        {
            "keyed_sample (shipped)": [t["shipped_ms"] for t in table],
            "argmax(p / keyed_exponentials) (definition)": [t["definition_ms"] for t in table],
        },
        title="ms per call (median over rounds)",
        xlabel="rows (requests sampled in the step)",
        ylabel="ms",
    )
    save_result(out, {"env": env_info(), "args": vars(args), "rows": table, "cells_s": cells}, fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
