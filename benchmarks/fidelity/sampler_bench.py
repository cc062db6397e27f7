"""What a decode step's sampling costs: the shipped sampler's pieces vs their definitions, side by side.

    python -m benchmarks.fidelity.sampler_bench [--rounds 7] [--rows 1,4,16,32,64] [--vocab 49152]

Two pairs, on the same rows (SmolLM2's vocabulary by default) and position keys, interleaved round by round
(the order alternating), each pair checked equal before it is timed (the run stops if not):
- the race: ``keyed_sample`` (an approximate race, the exact fp64 noise only for the entries near each row's
  best; natively where the kernels are built) vs its definition ``argmax(p / keyed_exponentials(keys))``, the
  fp64 log of every draw;
- truncation: ``process_logits`` at temperature 0.8, top-p 0.95 (the leading candidates of each row only) vs
  the definition ``truncated_by_sort`` (a stable sort of the whole vocabulary per row);
- a step's sampled rows from their logits, at temperature 1 and at temperature 0.8 top-p 0.95: ``sample_rows``
  (the race on the logits, no probabilities formed) vs ``keyed_sample(process_params(...))``, what it replaced.
Reports the median ms per call of each and the median speed-up with its min..max over rounds; writes
benchmarks/results/sampler_bench.{json,png}.
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
from workers.model_loader import load_model
from workers.sampler import (
    keyed_exponentials,
    keyed_sample,
    position_key,
    process_logits,
    process_params,
    sample_rows,
    truncated_by_sort,
)
from workers.sampling_params import SamplingParams

TEMPERATURE, TOP_P = 0.8, 0.95
T1, TOPP = SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=TEMPERATURE, top_p=TOP_P, seed=1)
VOCAB = 49152  # SmolLM2's
TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He had done so for thirty years, "
    "and in all that time the lamp had never failed. But tonight, as the fog rolled in from the sea, he noticed "
    "something strange on the rocks below: a small glass bottle, its cork sealed with red wax, caught between "
    "two stones where the tide had left it. He hurried down to see what it held."
)


def model_logits(n: int) -> torch.Tensor:  # [n, VOCAB] float32
    """The real model's logits at n positions of a text: the spread a served row has (a few likely tokens, a
    long tail), where random logits would give far flatter nuclei."""
    loaded = load_model("smollm2")
    ids = loaded.tokenizer(TEXT, return_tensors="pt").input_ids  # [1, T]
    while ids.shape[1] < n:
        ids = torch.cat([ids, ids], dim=1)
    with torch.no_grad():
        return loaded.model(ids[:, :n]).logits[0].float().contiguous()


def definition(p: torch.Tensor, keys: list[int]) -> torch.Tensor:  # [n, vocab] -> [n]
    return (p / keyed_exponentials(keys, p.shape[1], "cpu")).argmax(dim=-1)


def truncation(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n, vocab]
    n = logits.shape[0]
    return process_logits(
        logits, torch.full((n,), TEMPERATURE), torch.zeros(n, dtype=torch.long), torch.full((n,), TOP_P)
    )


def truncation_definition(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n, vocab]
    vocab = logits.shape[1]
    return torch.stack([truncated_by_sort(row.float() / TEMPERATURE, vocab, TOP_P) for row in logits])


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
    pool = model_logits(max(rows)) if args.vocab == VOCAB else None
    gen = torch.Generator().manual_seed(0)
    # a sampled LM's rows: SmolLM2's own logits along a text (another vocabulary: random logits of a like spread)
    logits = {n: pool[:n] if pool is not None else torch.randn(n, args.vocab, generator=gen) * 3.0 for n in rows}
    keys = {n: [position_key(1234 + i, i) for i in range(n)] for n in rows}
    pairs: dict[str, dict[str, Callable[[int], Any]]] = {
        "race": {
            "shipped": lambda n: keyed_sample(probs[n], keys[n]),
            "definition": lambda n: definition(probs[n], keys[n]),
        },
        "truncation": {
            "shipped": lambda n: truncation(logits[n]),
            "definition": lambda n: truncation_definition(logits[n]),
        },
    }
    for kind, params in (("from logits, T 1", T1), (f"from logits, T {TEMPERATURE} top-p {TOP_P}", TOPP)):
        pairs[kind] = {
            "shipped": lambda n, p=params: torch.tensor(sample_rows(logits[n], list(range(n)), [p] * n, keys[n])),
            "definition": lambda n, p=params: keyed_sample(process_params(logits[n], [p] * n), keys[n]),
        }
    probs = {n: torch.softmax(logits[n], dim=-1) for n in rows}
    for kind, fns in pairs.items():
        for n in rows:
            if not torch.equal(fns["shipped"](n), fns["definition"](n)):
                raise SystemExit(f"{kind}: the shipped sampler and its definition disagree at {n} rows")
    cells: dict[str, dict[int, dict[str, list[float]]]] = {
        kind: {n: {"shipped": [], "definition": []} for n in rows} for kind in pairs
    }
    for r in range(args.rounds):
        for kind, fns in pairs.items():
            for n in rows:
                order = ["shipped", "definition"]
                for name in order if r % 2 == 0 else order[::-1]:
                    cells[kind][n][name].append(time_call(functools.partial(fns[name], n), args.calls))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    tables: dict[str, list[dict[str, Any]]] = {}
    for kind in pairs:
        table = []
        for n in rows:
            s, d = cells[kind][n]["shipped"], cells[kind][n]["definition"]
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
        tables[kind] = table
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
                title=f"{kind}, vocab {args.vocab}, {args.threads} threads",
            )
        )
    out = Path(args.out)
    fig, axes = figure(ncols=len(tables), width=3.5 * len(tables))
    labels = {
        "race": ("keyed_sample (shipped)", "argmax(p / keyed_exponentials) (definition)"),
        "truncation": (f"process_logits, top-p {TOP_P} (shipped)", "truncated_by_sort (definition)"),
    }
    for kind in tables:
        labels.setdefault(kind, ("sample_rows (shipped)", "keyed_sample(process_params) (before)"))
    for ax, (kind, table) in zip(axes, tables.items()):
        line_panel(
            ax,
            rows,
            {labels[kind][0]: [t["shipped_ms"] for t in table], labels[kind][1]: [t["definition_ms"] for t in table]},
            title=f"{kind}: ms per call (median over rounds)",
            xlabel="rows (requests sampled in the step)",
            ylabel="ms",
        )
    save_result(out, {"env": env_info(), "args": vars(args), "tables": tables, "cells_s": cells}, fig)
    return 0


if __name__ == "__main__":
    sys.exit(main())
