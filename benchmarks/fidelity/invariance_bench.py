"""What batch invariance costs: invariant vs fastest kernels, fp32 and bf16, at 1, 4, 16, 32 streams.

    python -m benchmarks.fidelity.invariance_bench [--rounds 5] [--steps 24]

In process, the real SmolLM2, plain greedy decode. For each cell (dtype, kernels, concurrency c) the
engine holds c requests past their prompts and times ``--steps`` decode steps; tok/s = c / step time.
Cells are interleaved round by round (every round runs every cell once, the kernel order alternating)
so the machine's drift hits both sides alike, and each round gives its own invariant/fast ratio: the
table reports the median ratio and its min..max over rounds. HF transformers ``generate`` at batch 1
(fp32 and bf16) runs in the same rounds as the outside reference. Each round also times one prefill
of a ``--prefill-tokens`` prompt per dtype and kernel set (time to first token, prefix cache off).

Writes benchmarks/results/invariance_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    bar_panel,
    env_info,
    figure,
    format_table,
    hf_generate,
    progress,
    save_result,
    set_threads,
)
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model

CONCURRENCY = (1, 4, 16, 32)
DTYPES = ("float32", "bfloat16")
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def start_decoding(eng: LLMEngine, prompt: list[int], c: int, steps: int) -> None:
    """``c`` plain requests of ``prompt`` (room for ``steps`` tokens and a few more), prefilled and one step in:
    every request decoding."""
    for i in range(c):
        eng.add_request(
            f"b{i}-{time.monotonic_ns()}", prompt, {"max_tokens": steps + 8, "ignore_eos": True}, speculation="off"
        )
    while any(r.in_prefill for r in eng.running) or eng.waiting:
        eng.step()
    eng.step()  # first step after prefill: every request decoding


def decode_step_s(eng: LLMEngine, prompt: list[int], c: int, steps: int) -> float:
    """Median seconds of one plain decode step with ``c`` requests decoding."""
    start_decoding(eng, prompt, c, steps)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    while eng.has_work():
        eng.step()
    return statistics.median(times)


def prefill_s(eng: LLMEngine, prompt: list[int]) -> float:
    """Seconds to prefill ``prompt`` (one step, prefix caching off) and sample its first token."""
    eng.add_request(f"p-{time.monotonic_ns()}", prompt, {"max_tokens": 1, "ignore_eos": True}, speculation="off")
    t0 = time.perf_counter()
    while eng.has_work():
        eng.step()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--hf-tokens", type=int, default=32)
    ap.add_argument("--prefill-tokens", type=int, default=480, help="prompt length of the prefill cell")
    args = ap.parse_args(argv)
    set_threads(2)
    loaded = load_model("smollm2")
    engines = {
        (dt, inv): LLMEngine(
            EngineConfig(
                dtype=dt,
                batch_invariant=inv,
                max_num_seqs=max(CONCURRENCY),
                enable_prefix_caching=False,
                max_model_len=512,
                max_num_batched_tokens=512,
                proposers=[],
            ),
            loaded,
        )
        for dt in DTYPES
        for inv in (True, False)
    }
    hf_models = {"float32": loaded.model, "bfloat16": copy.deepcopy(loaded.model).to(torch.bfloat16)}
    prompt = engines[("float32", True)].tokenize_chat([{"role": "user", "content": PROMPT}])
    long_prompt = (prompt * (args.prefill_tokens // len(prompt) + 1))[: args.prefill_tokens]
    for eng in engines.values():  # warm-up: first calls pay oneDNN's kernel generation
        decode_step_s(eng, prompt, 4, 4)
    step_s: dict[tuple[str, bool, int], list[float]] = {}
    hf: dict[str, list[float]] = {dt: [] for dt in DTYPES}
    pre_s: dict[tuple[str, bool], list[float]] = {}
    cells = [(dt, c) for dt in DTYPES for c in CONCURRENCY]
    for rnd in progress(range(args.rounds), desc="rounds"):
        for dt, c in cells:
            order = (True, False) if (rnd + c) % 2 == 0 else (False, True)
            for inv in order:
                step_s.setdefault((dt, inv, c), []).append(decode_step_s(engines[(dt, inv)], prompt, c, args.steps))
        for dt in DTYPES:
            for inv in (True, False) if rnd % 2 == 0 else (False, True):
                pre_s.setdefault((dt, inv), []).append(prefill_s(engines[(dt, inv)], long_prompt))
        for dt in DTYPES:
            run = hf_generate(hf_models[dt], prompt, args.hf_tokens, ignore_eos=True)
            hf[dt].append(args.hf_tokens / run.wall_s)

    rows: list[dict[str, Any]] = []
    for dt, c in cells:
        inv, fast = step_s[(dt, True, c)], step_s[(dt, False, c)]
        ratios = [f / i for i, f in zip(inv, fast)]  # invariant throughput / fast throughput, per round
        rows.append(
            {
                "dtype": dt,
                "c": c,
                "inv_tok_s": c / statistics.median(inv),
                "fast_tok_s": c / statistics.median(fast),
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "cost_pct": 100 * (1 - statistics.median(ratios)),
            }
        )
    prefill = {
        dt: {
            "inv_s": statistics.median(pre_s[(dt, True)]),
            "fast_s": statistics.median(pre_s[(dt, False)]),
            "ratio": statistics.median(f / i for i, f in zip(pre_s[(dt, True)], pre_s[(dt, False)])),
        }
        for dt in DTYPES
    }
    hf_med = {dt: statistics.median(v) for dt, v in hf.items()}
    inv_bf16_c1 = next(r["inv_tok_s"] for r in rows if r["dtype"] == "bfloat16" and r["c"] == 1)
    inv_f32_c1 = next(r["inv_tok_s"] for r in rows if r["dtype"] == "float32" and r["c"] == 1)
    table = format_table(
        rows,
        [
            ("dtype", "dtype", "s"),
            ("c", "c", "d"),
            ("inv_tok_s", "invariant tok/s", ".1f"),
            ("fast_tok_s", "fast tok/s", ".1f"),
            ("ratio", "inv/fast (median)", ".3f"),
            ("ratio_min", "min", ".3f"),
            ("ratio_max", "max", ".3f"),
            ("cost_pct", "cost %", ".1f"),
        ],
        title=f"Batch-invariant vs fastest kernels, plain greedy decode, {args.rounds} interleaved rounds",
    )
    env = env_info()
    summary = (
        f"HF generate batch 1: fp32 {hf_med['float32']:.1f} tok/s, bf16 {hf_med['bfloat16']:.1f}; "
        f"engine invariant c=1: bf16 {inv_bf16_c1:.1f} ({inv_bf16_c1 / hf_med['float32']:.2f}x HF fp32), "
        f"fp32 {inv_f32_c1:.1f} ({inv_f32_c1 / hf_med['float32']:.2f}x HF fp32). CPU: {env['cpu']}"
    )
    summary += "; prefill of a {}-token prompt, invariant/fast throughput: {}".format(
        args.prefill_tokens,
        ", ".join(
            f"{dt} {p['ratio']:.3f} ({p['inv_s'] * 1e3:.0f} vs {p['fast_s'] * 1e3:.0f} ms)" for dt, p in prefill.items()
        ),
    )
    print(table)
    print(summary)
    result = {
        "env": env,
        "args": vars(args),
        "rows": rows,
        "hf_generate_tok_s": hf_med,
        "prefill": prefill,
        "attention_kernel": engines[("float32", True)].runner.attention_kernel,
        "summary": summary,
        "raw_step_s": {f"{dt}/{'inv' if inv else 'fast'}/c{c}": v for (dt, inv, c), v in step_s.items()},
        "raw_hf_tok_s": hf,
        "raw_prefill_s": {f"{dt}/{'inv' if inv else 'fast'}": v for (dt, inv), v in pre_s.items()},
    }
    fig, axes = figure(ncols=2, width=6)
    for ax, dt in zip(axes, DTYPES):
        sel = [r for r in rows if r["dtype"] == dt]
        bar_panel(
            ax,
            [f"c={r['c']}" for r in sel],
            {"invariant": [r["inv_tok_s"] for r in sel], "fastest": [r["fast_tok_s"] for r in sel]},
            title=f"{dt}: output tok/s",
            ylabel="tok/s",
            fmt="{:.0f}",
        )
    save_result(RESULTS_DIR / "invariance_bench", result, fig, title="Batch-invariant kernels: cost")
    return 0


if __name__ == "__main__":
    sys.exit(main())
