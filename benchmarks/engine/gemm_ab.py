"""Paired A/B of the CPU weight GEMMs: ``cpu_gemm="onednn"`` (prepacked, row-blocked) against ``"native"``
(workers/kernels/invariant_linear.c on the tiled weights), on the SmolLM2 engine, in one process; or
(``--backends native-plain,native``) the native GEMMs on plain ``[N, K]`` weights against tiled ones.

    python -m benchmarks.engine.gemm_ab [--rounds 5] [--steps 16] [--threads 2] [--dtypes bfloat16,float32]
        [--backends onednn,native] [--concurrency 1,16,32] [--march x86-64-v3]

Cells, per dtype, each run on both backends back to back, in alternating order round by round (each
round gives its own B/A ratio; the table has the median and min..max):
- decode step with c = 1, 16, 32 requests decoding (the engine's plain step, batch-invariant, as served);
- verify-shaped step: one request feeding 5 rows (K = 4 drafts + 1) at the end of its prompt (runner forward);
- prefill: a 512-token prompt in chunks of ``max_num_batched_tokens`` (256), its last row's logits: the
  forward part of time to first token (runner forward).
Then timers around the runner's two GEMM entry points give, over batch-1 steps of each backend, each
weight GEMM's time and GB/s at M=1 (weight bytes from benchmarks/engine/step_split.py). The machine's read
bandwidth (a torch sum over 256 MiB) is measured at the start and the end, to show how loaded it was.

Writes benchmarks/results/<--out>.{json,png}.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Any, Callable

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
from benchmarks.engine.decode_floor import read_bandwidth_gbs
from benchmarks.engine.step_ab import step_times
from benchmarks.engine.step_split import GEMMS, StepSplit, weight_bytes
from benchmarks.fidelity.invariance_bench import PROMPT
from workers import native_attention
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model
from workers.runner import StepBatch

# native-plain: the native GEMMs on the plain weights (SPECSERVE_TILED_WEIGHTS=0 while the engine is built)
BACKENDS = ("onednn", "native", "native-plain")
PREFILL_TOKENS = 512
VERIFY_ROWS = 5


def verify_step_s(eng: LLMEngine, prompt: list[int], reps: int, clock: Callable[[], float]) -> float:
    """Median seconds of a runner forward of ``VERIFY_ROWS`` rows of one request at the end of ``prompt``
    (the shape of a verify step with 4 drafts)."""
    r = eng.runner
    r.forward(StepBatch([0], [0], [prompt], [[len(prompt) - 1]]))
    rows = list(range(VERIFY_ROWS))
    times = []
    for _ in range(reps):
        t0 = clock()
        r.forward(StepBatch([0], [len(prompt)], [prompt[:VERIFY_ROWS]], [rows]))
        times.append(clock() - t0)
    return statistics.median(times)


def prefill_s(eng: LLMEngine, ids: list[int], chunk: int, clock: Callable[[], float]) -> float:
    """Seconds of the forwards that prefill ``ids`` in chunks of ``chunk`` tokens, logits at the last row."""
    r = eng.runner
    t0 = clock()
    for s in range(0, len(ids), chunk):
        part = ids[s : s + chunk]
        last = [len(part) - 1] if s + chunk >= len(ids) else []
        r.forward(StepBatch([0], [s], [part], [last]))
    return clock() - t0


def gemm_times(eng: LLMEngine, steps: int, clock: Callable[[], float]) -> dict[str, float]:
    """Seconds in each weight GEMM (and in the whole step) over ``steps`` engine steps, from the step split
    (benchmarks/engine/step_split.py: timers on the runner's GEMM entry points, or the fused layers' own
    phase clocks where the layers run as one native call)."""
    with StepSplit(engine=eng, clock=clock) as sp:
        for _ in range(steps):
            eng.step()
    return {g: sp.totals.get(g, 0.0) for g in (*GEMMS, "step")}


def build_engine(dtype: str, backend: str, max_seqs: int, loaded: Any) -> LLMEngine:
    """The engine of one arm: ``backend`` is a ``cpu_gemm``, or ``native-plain`` (native GEMMs on plain weights)."""
    plain = backend == "native-plain"
    before = os.environ.get(native_attention.ENV_TILED)
    if plain:
        os.environ[native_attention.ENV_TILED] = "0"
    try:
        return LLMEngine(
            EngineConfig(
                dtype=dtype,
                cpu_gemm="native" if plain else backend,
                batch_invariant=True,
                max_num_seqs=max_seqs,
                max_model_len=1024,
                kv_cache_memory_gb=0.5,
                enable_prefix_caching=False,
                proposers=[],
            ),
            loaded,
        )
    finally:
        if plain:
            os.environ.pop(native_attention.ENV_TILED, None)
            if before is not None:
                os.environ[native_attention.ENV_TILED] = before


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time (use with --threads 1): leaves out the time other processes held the core",
    )
    ap.add_argument("--concurrency", default="1,16,32")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--backends", default="onednn,native", help=f"two of {', '.join(BACKENDS)}: A, then B")
    ap.add_argument("--out", default="gemm_ab")
    ap.add_argument(
        "--march",
        help="build the native kernels for this -march instead of the host's (x86-64-v3: an AVX2-only CPU's code "
        "path, run on this host's memory)",
    )
    args = ap.parse_args(argv)
    if args.march:
        native_attention.build_for(args.march)
    backends = tuple(args.backends.split(","))
    if len(backends) != 2 or not set(backends) <= set(BACKENDS):
        ap.error(f"--backends: two of {', '.join(BACKENDS)}")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    env = env_info()
    env["native_march"] = args.march or "native"
    bw_start = read_bandwidth_gbs(256)
    loaded = load_model("smollm2")
    dtypes, cs = args.dtypes.split(","), [int(c) for c in args.concurrency.split(",")]
    engines = {(dt, be): build_engine(dt, be, max(cs), loaded) for dt in dtypes for be in backends}
    assert all(e.runner.cpu_gemm == be.split("-")[0] for (_, be), e in engines.items()), "no native library"
    eng0 = engines[(dtypes[0], backends[0])]
    prompt = eng0.tokenize_chat([{"role": "user", "content": PROMPT}])
    long_ids = [random.Random(0).randrange(3, eng0.vocab_size) for _ in range(PREFILL_TOKENS)]
    chunk = eng0.config.max_num_batched_tokens
    outs = {k: e.generate([prompt], {"max_tokens": 24}) for k, e in engines.items()}  # warm-up
    same = {dt: outs[(dt, backends[0])] == outs[(dt, backends[1])] for dt in dtypes}
    cells: list[tuple[str, Any]] = [(f"decode c={c}", c) for c in cs]
    cells += [("verify M=5", "verify"), ("prefill 512", "pf")]
    times: dict[tuple[str, str, str], list[float]] = {}
    for rnd in progress(range(args.rounds), desc="rounds"):
        for dt in dtypes:
            for i, (name, what) in enumerate(cells):
                for be in backends if (rnd + i) % 2 == 0 else backends[::-1]:
                    eng = engines[(dt, be)]
                    if what == "verify":
                        t = verify_step_s(eng, prompt, args.steps, clock)
                    elif what == "pf":
                        t = prefill_s(eng, long_ids, chunk, clock)
                    else:
                        t = step_times(eng, prompt, what, args.steps, clock)
                    times.setdefault((dt, name, be), []).append(t)
    rows = []
    a_, b_ = backends
    for dt in dtypes:
        for name, _ in cells:
            p = paired(times[(dt, name, backends[0])], times[(dt, name, backends[1])])
            rows.append({"dtype": dt, "cell": name, f"{a_}_ms": p.pop("a_ms"), f"{b_}_ms": p.pop("b_ms"), **p})
    print(
        format_table(
            rows,
            [
                ("dtype", "dtype", "s"),
                ("cell", "cell", "s"),
                (f"{a_}_ms", f"{a_} ms", ".2f"),
                (f"{b_}_ms", f"{b_} ms", ".2f"),
                ("ratio", f"{b_}/{a_}", ".3f"),
                ("ratio_min", "min", ".3f"),
                ("ratio_max", "max", ".3f"),
            ],
            title=f"{args.clock} clock, {args.threads} threads, {args.rounds} paired rounds (< 1: {b_} faster)",
        )
    )
    # per-GEMM time and GB/s at M=1: one request decoding, both backends, the split summed over the steps
    split_rows = []
    for dt in dtypes:
        for be in backends:
            eng = engines[(dt, be)]
            eng.add_request(f"split-{be}", prompt, {"max_tokens": args.steps + 4, "ignore_eos": True})
            while any(r.in_prefill for r in eng.running) or eng.waiting:
                eng.step()
            eng.step()
            totals = gemm_times(eng, args.steps, clock)
            while eng.has_work():
                eng.step()
            wb = weight_bytes(eng.runner)
            for g in (*GEMMS, "step"):
                t = totals[g] / args.steps
                gbs = wb[g] / t / 1e9 if g in wb and t else None
                split_rows.append({"dtype": dt, "backend": be, "phase": g, "ms": 1e3 * t, "gb_s": gbs})
    print(
        format_table(
            split_rows,
            [
                ("dtype", "dtype", "s"),
                ("backend", "backend", "s"),
                ("phase", "phase", "s"),
                ("ms", "ms", ".3f"),
                ("gb_s", "GB/s", ".1f"),
            ],
            title=f"batch-1 step split (mean of {args.steps} steps)",
        )
    )
    bw_end = read_bandwidth_gbs(256)
    print(f"read bandwidth (sum over 256 MiB): start {bw_start}, end {bw_end}")
    print(f"same 24 greedy tokens on both backends: {same}")
    env["loadavg_end"] = loadavg()
    fig, axes = figure(ncols=2, width=12)
    bar_panel(
        axes[0],
        [f"{r['dtype'][:4]}/{r['cell']}" for r in rows],
        {f"{b_} / {a_}": [r["ratio"] for r in rows]},
        title=f"step time, {b_} / {a_} (< 1 = {b_} faster)",
        ylabel="ratio",
        fmt="{:.2f}",
    )
    gemm_rows = [r for r in split_rows if r["phase"] != "step"]
    labels = sorted({f"{r['dtype'][:4]}/{r['phase']}" for r in gemm_rows})
    by = {(f"{r['dtype'][:4]}/{r['phase']}", r["backend"]): r["gb_s"] for r in gemm_rows}
    bar_panel(
        axes[1],
        labels,
        {be: [by.get((lab, be)) or 0.0 for lab in labels] for be in backends},
        title="weight GEMMs at M=1: GB/s read",
        ylabel="GB/s",
        fmt="{:.0f}",
    )
    save_result(
        RESULTS_DIR / args.out,
        {
            "env": env,
            "contended": True,
            "args": vars(args),
            "rows": rows,
            "split_m1": split_rows,
            "read_bandwidth_gb_s": {"start": bw_start, "end": bw_end},
            "same_tokens": same,
            "raw_s": {f"{dt}/{name}/{be}": v for (dt, name, be), v in times.items()},
        },
        fig,
        title=f"cpu_gemm {a_} vs {b_} (SmolLM2)",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
