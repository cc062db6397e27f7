"""What paging costs a decode step: KV in contiguous blocks against KV scattered over the pool, paired.

    python -m benchmarks.engine.gather_ab [--rounds 5] [--prompt-tokens 256] [--steps 24] [--dtype bfloat16]

One engine (SmolLM2, batch-invariant, as served). Before each cell the pool's free queue is put in order
(each request's blocks come out as a run, the layout a slot cache had) or shuffled (every block of every
request lands anywhere in the pool, the worst case for the block-table gather); then c requests of
``--prompt-tokens`` are prefilled and ``--steps`` decode steps are timed. Cells alternate order every
round; the table gives each round's scattered / contiguous ratio (median and min..max). Prefix caching
is off so no cell reads another's blocks. The same tokens come out of both layouts (checked).

Writes benchmarks/results/gather_ab.json and .png.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from typing import Any

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, format_table, progress, save_result
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model


def layout(engine: LLMEngine, scattered: bool, rng: random.Random) -> None:
    """Reorder the free queue: ascending block ids (runs) or a random permutation."""
    pool = engine.kv.pool
    ids = sorted(pool.free_q)
    if scattered:
        rng.shuffle(ids)
    pool.free_q = collections.OrderedDict((b, None) for b in ids)


def cell(engine: LLMEngine, c: int, prompt_tokens: int, steps: int, scattered: bool, seed: int) -> tuple[float, list]:
    """Median decode step (s) of c requests after their prefill, and the tokens they wrote."""
    layout(engine, scattered, random.Random(seed))
    rng = random.Random(1234)
    for i in range(c):
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_tokens)]
        engine.add_request(f"r{i}", prompt, {"max_tokens": steps + 4, "ignore_eos": True})
    out: dict[str, list[int]] = collections.defaultdict(list)
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        plan = engine.last_plan
        if plan is not None and not plan.prefill and len(plan.decode) == c:
            times.append(dt)
        for o in outs:
            out[o.request_id] += o.token_ids
    return statistics.median(times), [out[f"r{i}"] for i in range(c)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default="gather_ab")
    args = ap.parse_args()
    env = env_info()
    cs = [int(x) for x in args.concurrency.split(",")]
    engine = LLMEngine(
        EngineConfig(dtype=args.dtype, proposers=[], enable_prefix_caching=False, max_model_len=2048),
        load_model("smollm2"),
    )
    ratios: dict[int, list[float]] = {c: [] for c in cs}
    steps_ms: dict[str, list[float]] = collections.defaultdict(list)
    for r in progress(range(args.rounds), desc="rounds"):
        for c in cs:
            order = [False, True] if r % 2 == 0 else [True, False]
            got = {}
            for scattered in order:
                t, toks = cell(engine, c, args.prompt_tokens, args.steps, scattered, seed=r)
                got[scattered] = (t, toks)
                steps_ms[f"c={c} {'scattered' if scattered else 'contiguous'}"].append(t * 1e3)
            assert got[True][1] == got[False][1], "the layout changed the tokens"
            ratios[c].append(got[True][0] / got[False][0])
    rows = [
        {
            "c": c,
            "contig": statistics.median(steps_ms[f"c={c} contiguous"]),
            "scat": statistics.median(steps_ms[f"c={c} scattered"]),
            "ratio": statistics.median(ratios[c]),
            "range": f"{min(ratios[c]):.3f}..{max(ratios[c]):.3f}",
        }
        for c in cs
    ]
    title = f"Decode step, {args.dtype}, {args.prompt_tokens}-token prompts, {args.rounds} rounds (ms, median)"
    cols = [
        ("c", "c", "d"),
        ("contig", "contiguous", ".2f"),
        ("scat", "scattered", ".2f"),
        ("ratio", "scattered/contig", ".3f"),
        ("range", "min..max", ""),
    ]
    print(format_table(rows, cols, title=title), flush=True)
    result: dict[str, Any] = {
        "env": env,
        "args": vars(args),
        "ratios": {str(c): ratios[c] for c in cs},
        "step_ms": dict(steps_ms),
        "median_ratio": {str(c): statistics.median(ratios[c]) for c in cs},
    }
    fig, axes = figure(1)
    bar_panel(
        axes[0],
        [f"c={c}" for c in cs],
        {"scattered / contiguous": [statistics.median(ratios[c]) for c in cs]},
        title="decode step, KV scattered over the pool vs in runs",
        ylabel="step time ratio",
        hline=1.0,
        fmt="{:.3f}",
    )
    save_result(RESULTS_DIR / args.out, result, fig, title=f"gather_ab {args.dtype}")


if __name__ == "__main__":
    main()
