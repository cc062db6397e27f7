"""Plain-decode engine benchmark: this engine vs HF transformers, then throughput vs concurrency.

    python -m benchmarks.engine.engine_bench [--quick]

Same machine, same model (SmolLM2-135M-Instruct), same dtype, one run, side by side:

1. HF ``model.generate`` greedy at batch 1 (the HF model cast to the dtype) vs the engine's
   plain decode at concurrency 1, in fp32 and in bf16. Prompts are interleaved
   (HF fp32, engine fp32, HF bf16, engine bf16 for each prompt) so machine-load drift hits
   all four alike. Every request makes exactly ``--tokens`` tokens (EOS ignored / masked).
2. The engine's plain decode in fp32 under a closed loop of 1, 4, 16, 32 clients
   (aggregate output tok/s, per-request TPOT P50/P99, TTFT). Output lengths vary per request
   (0.5x-1.5x of the mean, fixed seed) so clients finish at different steps, as real ones do.
   Every request has its own user message, so prefix caching shares only the system prompt.
   Two rates: the whole run, and the steps during which all c clients had a request in the
   engine (a finite closed loop ends in a tail that runs below c; that rate is the one *at* c).

Writes benchmarks/results/engine_bench.{json,png}; prints the tables with ratios.
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import time
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    RunResult,
    bar_panel,
    env_info,
    figure,
    format_table,
    hf_generate,
    line_panel,
    loadavg,
    merge_runs,
    progress,
    ratio,
    run_closed_loop,
    save_result,
    set_threads,
    warmup_engine,
)

CHAT_PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how vaccines train the immune system. Use simple language.",
    "What are the main differences between Python and C++? Give a few examples.",
    "Give me five tips for preparing for a job interview, with a sentence on each.",
    "Describe the water cycle step by step.",
    "Write a polite email asking my landlord to repair the heating in my apartment.",
    "Why is the sky blue? Explain it to a curious ten-year-old.",
    "Summarize the plot of a heist movie you would like to see, in one paragraph.",
]

# Sized for <= ~12 min on 2 shared, busy cores.
# Three requests per client at c >= 4, so the closed loop spends most of its time at its
# concurrency rather than in the ramp-down tail (with 1.5 per client, the last third of a c=16 run
# had fewer than 16 running).
FULL = dict(
    tokens=64,
    num_prompts=3,
    concurrency=[1, 4, 16, 32],
    sweep_tokens=64,
    sweep_requests={1: 3, 4: 12, 16: 48, 32: 96},
    rounds=3,
)
QUICK = dict(tokens=16, num_prompts=1, concurrency=[1, 4], sweep_tokens=16, sweep_requests={1: 2, 4: 4}, rounds=1)

MAX_MODEL_LEN = 512
THREADS = 2


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def sweep_work(tokenize: Any, n: int, mean_tokens: int, seed: int = 0) -> list[tuple[list[int], dict]]:
    """``n`` chat requests, each with its own user message ("Request i: <one of CHAT_PROMPTS>").

    Every prompt differs right after the chat template's system prompt, so prefix caching
    (on by default) can reuse only that shared system prompt, as with real users; it never
    sees a whole repeated prompt, which would flatter it.
    """
    rng = random.Random(seed)
    work = []
    for i in range(n):
        toks = max(2, round(mean_tokens * rng.uniform(0.5, 1.5)))
        prompt = tokenize([{"role": "user", "content": f"Request {seed}-{i}: {CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}"}])
        work.append((prompt, {"max_tokens": toks, "temperature": 0, "ignore_eos": True}))
    return work


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few tokens, 1 prompt, concurrency 1 and 4 (< 3 min)")
    ap.add_argument("--out", default=str(RESULTS_DIR), help="directory for engine_bench.json / .png")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    from pathlib import Path

    out_dir = Path(args.out)

    set_threads(THREADS)
    import transformers

    transformers.logging.set_verbosity_error()
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.model_loader import load_model

    t_start = time.perf_counter()
    env = env_info()
    print(
        f"[engine_bench] {'QUICK' if args.quick else 'FULL'} run; {env['cpu']}, torch {env['torch']}, "
        f"transformers {env['transformers']}, {THREADS} threads, loadavg {env['loadavg_start']}",
        flush=True,
    )
    loaded = load_model("smollm2")
    hf = {"float32": loaded.model, "bfloat16": copy.deepcopy(loaded.model).to(torch.bfloat16).eval()}
    max_seqs = max(cfg["concurrency"])
    engines = {
        "float32": LLMEngine(
            EngineConfig(
                dtype="float32",
                max_num_seqs=max_seqs,
                max_model_len=MAX_MODEL_LEN,
                num_speculative_tokens=0,
                num_threads=THREADS,
            ),
            loaded,
        ),
        "bfloat16": LLMEngine(
            EngineConfig(
                dtype="bfloat16",
                max_num_seqs=4,
                max_model_len=MAX_MODEL_LEN,
                num_speculative_tokens=0,
                num_threads=THREADS,
            ),
            loaded,
        ),
    }
    eng0 = engines["float32"]
    eos = sorted(eng0.eos_token_ids)
    prompts = [eng0.tokenize_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    n_tok = cfg["tokens"]
    params = {"max_tokens": n_tok, "temperature": 0, "ignore_eos": True}

    # Warm-up: one short untimed call of every peer.
    for dt in ("float32", "bfloat16"):
        hf_generate(hf[dt], prompts[0], 4, ignore_eos=True, eos_token_id=eos)
        warmup_engine(engines[dt], prompts[0], 4)

    # ---------------------------------------------------------------- 1. HF vs engine at batch 1
    # HF generate keeps nothing across calls, so here the engines prefill every prompt in full too
    # (prefix caching is switched back on for the concurrency sweep, where it is part of the engine).
    for e in engines.values():
        e.config.enable_prefix_caching = False
    runs: dict[str, list[RunResult]] = {f"{who}/{dt}": [] for who in ("hf", "engine") for dt in ("float32", "bfloat16")}
    for i in progress(range(cfg["num_prompts"]), desc="HF vs engine, batch 1", unit="prompt"):
        p = prompts[i]
        peers = [(who, dt) for dt in ("float32", "bfloat16") for who in ("hf", "engine")]
        j = i % len(peers)  # rotate the order per prompt so load drift favours no peer
        for who, dt in peers[j:] + peers[:j]:
            if who == "hf":
                run = hf_generate(hf[dt], p, n_tok, ignore_eos=True, eos_token_id=eos, name=f"hf/{dt}")
            else:
                run = run_closed_loop(engines[dt], [(p, params)], 1, name=f"engine/{dt}", show_progress=False)
            runs[f"{who}/{dt}"].append(run)
    merged = {k: merge_runs(k, v) for k, v in runs.items()}
    batch1_rows = []
    for dt in ("float32", "bfloat16"):
        h, e = merged[f"hf/{dt}"].summary(), merged[f"engine/{dt}"].summary()
        hf_out, eng_out = merged[f"hf/{dt}"].outputs(), merged[f"engine/{dt}"].outputs()
        batch1_rows.append(
            {
                "dtype": dt,
                "prompts": len(hf_out),
                "tokens": e["output_tokens"],
                "hf_tok_s": h["tok_s"],
                "engine_tok_s": e["tok_s"],
                "engine_over_hf": ratio(e["tok_s"], h["tok_s"]),
                "hf_tpot_p50_ms": h["tpot_p50_ms"],
                "engine_tpot_p50_ms": e["tpot_p50_ms"],
                "hf_ttft_p50_ms": h["ttft_p50_ms"],
                "engine_ttft_p50_ms": e["ttft_p50_ms"],
                # greedy agreement: tokens until engine and HF first differ (HF masks EOS; the engine emits it)
                "same_output": sum(a == b for a, b in zip(hf_out, eng_out)),
                "min_common_prefix": min(common_prefix(a, b) for a, b in zip(hf_out, eng_out)),
                "hf": h,
                "engine": e,
            }
        )
    for who in ("hf", "engine"):
        batch1_rows.append(
            {
                "dtype": f"bf16/fp32 ({who})",
                "ratio_only": True,
                f"{who}_tok_s": ratio(merged[f"{who}/bfloat16"].tok_s, merged[f"{who}/float32"].tok_s),
            }
        )
    table1 = format_table(
        batch1_rows,
        [
            ("dtype", "dtype", "s"),
            ("tokens", "tokens", "d"),
            ("hf_tok_s", "HF tok/s", ".2f"),
            ("engine_tok_s", "engine tok/s", ".2f"),
            ("engine_over_hf", "engine/HF", ".2f"),
            ("hf_tpot_p50_ms", "HF TPOT p50 ms", ".1f"),
            ("engine_tpot_p50_ms", "eng TPOT p50 ms", ".1f"),
            ("hf_ttft_p50_ms", "HF TTFT p50 ms", ".0f"),
            ("engine_ttft_p50_ms", "eng TTFT p50 ms", ".0f"),
            ("same_output", "same out", "d"),
            ("min_common_prefix", "min agree", "d"),
        ],
        title=f"HF generate (batch 1) vs engine plain decode (concurrency 1): {cfg['num_prompts']} chat prompts x "
        f"{n_tok} tokens, greedy, interleaved. Rows 'bf16/fp32' give the dtype speedup.",
    )
    print("\n" + table1 + "\n", flush=True)

    # ---------------------------------------------------------------- 2. engine plain vs concurrency (fp32)
    del engines["bfloat16"], hf["bfloat16"]
    eng0.config.enable_prefix_caching = True
    # Rounds go up and down the concurrency list (1..32, 32..1, ...) and each c reports the median round,
    # so a load spike on the shared cores moves one round of one c, not the curve.
    per_c: dict[int, list[RunResult]] = {c: [] for c in cfg["concurrency"]}
    for rnd in range(cfg["rounds"]):
        for c in cfg["concurrency"] if rnd % 2 == 0 else cfg["concurrency"][::-1]:
            work = sweep_work(eng0.tokenize_chat, cfg["sweep_requests"][c], cfg["sweep_tokens"], seed=100 * rnd + c)
            warmup_engine(eng0, prompts[0], 2)
            q0, h0 = eng0.prefix_cache_queries, eng0.prefix_cache_hits
            res = run_closed_loop(eng0, work, c, name=f"engine/fp32 plain r{rnd}")
            res.prefix_hit = ratio(eng0.prefix_cache_hits - h0, eng0.prefix_cache_queries - q0)  # type: ignore[attr-defined]
            per_c[c].append(res)
            print(
                f"  round {rnd} c={c:>2}: {res.tok_s:.1f} tok/s, {res.steady_tok_s:.1f} with all {c} clients busy "
                f"({len(res.records)} requests, "
                f"{res.output_tokens} tokens, {res.wall_s:.1f} s, prefix cache hits "
                f"{100 * res.prefix_hit:.0f}% of prompt tokens)",
                flush=True,
            )
    sweep: list[dict[str, Any]] = []
    for c in cfg["concurrency"]:
        rs = sorted(per_c[c], key=lambda r: r.tok_s)
        mid = rs[(len(rs) - 1) // 2]  # the median round (lower median for an even count)
        s = mid.summary()
        s["rounds_tok_s"] = [r.tok_s for r in per_c[c]]
        s["rounds"] = "/".join(f"{r.tok_s:.1f}" for r in per_c[c])
        s["prefix_hit_pct"] = 100 * mid.prefix_hit
        s["steady_tok_s"] = sorted(r.steady_tok_s for r in per_c[c])[(len(rs) - 1) // 2]  # its own median round
        sweep.append(s)
    base, steady_base = sweep[0]["tok_s"], sweep[0]["steady_tok_s"]
    for s in sweep:
        s["vs_c1"] = ratio(s["tok_s"], base)
        s["steady_vs_c1"] = ratio(s["steady_tok_s"], steady_base)
    table2 = format_table(
        sweep,
        [
            ("concurrency", "c", "d"),
            ("num_requests", "requests", "d"),
            ("output_tokens", "out tokens", "d"),
            ("tok_s", "tok/s", ".1f"),
            ("vs_c1", "vs c=1", ".2f"),
            ("steady_tok_s", "steady tok/s", ".1f"),
            ("steady_vs_c1", "steady vs c=1", ".2f"),
            ("rounds", "tok/s per round", "s"),
            ("prefix_hit_pct", "prefix hit %", ".0f"),
            ("tpot_p50_ms", "TPOT p50 ms", ".1f"),
            ("tpot_p99_ms", "TPOT p99 ms", ".1f"),
            ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
            ("ttft_p99_ms", "TTFT p99 ms", ".0f"),
        ],
        title=f"Engine plain decode, fp32, closed loop: aggregate output tok/s vs concurrency "
        f"(mean {cfg['sweep_tokens']} tokens/request, 0.5x-1.5x); each row is the median of "
        f"{cfg['rounds']} rounds",
    )
    by_c = {s["concurrency"]: s for s in sweep}
    ratios = {f"c={c} / c=1": ratio(by_c[c]["tok_s"], base) for c in by_c if c != 1}
    steady = {f"c={c} / c=1": by_c[c]["steady_vs_c1"] for c in by_c if c != 1}
    print("\n" + table2)
    print("  whole run:       " + ", ".join(f"{k}: {v:.2f}x" for k, v in ratios.items()))
    print("  all clients busy: " + ", ".join(f"{k}: {v:.2f}x" for k, v in steady.items()) + "\n", flush=True)

    # ---------------------------------------------------------------- reports
    env["loadavg_end"] = loadavg()
    env["elapsed_s"] = time.perf_counter() - t_start
    result = {
        "benchmark": "engine_bench",
        "mode": "quick" if args.quick else "full",
        "env": env,
        "config": {**cfg, "max_model_len": MAX_MODEL_LEN, "threads": THREADS, "model": "SmolLM2-135M-Instruct"},
        "batch1": batch1_rows,
        "sweep_fp32": sweep,
        "sweep_ratios": ratios,
        "sweep_ratios_steady": steady,
        "tables": [table1, table2],
    }
    fig, (a1, a2, a3) = figure(3, width=5.2)
    cs = [s["concurrency"] for s in sweep]
    line_panel(
        a1,
        cs,
        {
            "engine plain fp32 (whole run)": [s["tok_s"] for s in sweep],
            "all clients busy": [s["steady_tok_s"] for s in sweep],
        },
        title="Aggregate output tok/s vs concurrency",
        xlabel="concurrent clients",
        ylabel="tok/s",
    )
    line_panel(
        a2,
        cs,
        {"TPOT p50": [s["tpot_p50_ms"] for s in sweep], "TPOT p99": [s["tpot_p99_ms"] for s in sweep]},
        title="Per-request TPOT vs concurrency",
        xlabel="concurrent clients",
        ylabel="ms / token",
    )
    dts = [r for r in batch1_rows if not r.get("ratio_only")]
    bar_panel(
        a3,
        [r["dtype"] for r in dts],
        {"HF generate": [r["hf_tok_s"] for r in dts], "engine plain": [r["engine_tok_s"] for r in dts]},
        title="Batch 1: HF vs engine",
        ylabel="tok/s",
        fmt="{:.1f}",
    )
    title = f"SmolLM2-135M, {env['cpu']}, {THREADS} threads, {env['time']} "
    title += f"(loadavg {env['loadavg_start']} -> {env['loadavg_end']})"
    save_result(out_dir / "engine_bench", result, fig, title=title)
    print(f"[engine_bench] done in {env['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
