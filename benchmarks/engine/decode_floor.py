"""The decode step against the memory floor: a step must read every weight once, nothing more.

    python -m benchmarks.engine.decode_floor [--rounds 5] [--steps 16] [--http]

In one run, with the thread count the engine uses:
1. the machine's read bandwidth: a torch sum over a buffer far larger than the last-level cache,
   best of several (``--buffer-mb``);
2. the served weights' bytes: every linear weight plus the LM head rows a step computes, per dtype;
   floor = bytes / bandwidth (the KV cache read at the measured context is listed beside it);
3. the engine's plain decode step (batch-invariant, as served) at c = 1, 2, 4 in bf16 and fp32, and
   the draft model's (models/smollm2-draft) step at c = 1, 2, 4, each as a ratio to its own floor, as
   the draft worker runs it ("draft": native attention and row-wise ops, ``draft.native_kernels``, and the
   GEMMs ``draft.cpu_gemm`` picks, so on a CPU where that is the native kernel the forward is one native
   call), with oneDNN's GEMMs ("draft-onednn") and with torch's ops ("draft-torch-ops").
   Cells are interleaved round by round; the table gives the median and min..max over rounds, against
   the run's best bandwidth ("x floor") and against the bandwidth read just before and after each cell
   ("x window floor": the host's bandwidth can swing 2x within seconds when other tenants read memory);
4. the step split: one batch-1 step of each dtype (and the draft's) timed phase by phase
   (benchmarks/engine/step_split.py): each weight GEMM with its achieved GB/s, attention, row-wise ops,
   sampling, the engine's Python;
5. ``--http``: c=1 TPOT over HTTP from a local cluster (the served config: bf16 where the CPU has
   native bf16), its ratio to the floor (the run's and each rep's own window), and the replica path: TPOT
   less the in-process step, each rep paired with a step and a bandwidth read taken just before it;
6. ``--decode-steps N`` (default 8; 1: none): the engine with ``decode_steps: N`` ("engine-steps": N greedy
   steps per iteration in one native call, the Python between them gone) as cells beside the others, its time
   per token; with ``--http``, also c=1 over HTTP from a cluster serving with it.

``--march x86-64-v3`` builds the native kernels for an older instruction set than the host's: an AVX2-only
CPU's code path, measured against this host's memory (a proxy, not that CPU).

Writes benchmarks/results/decode_floor.{json,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, format_table, loadavg, progress, save_result
from benchmarks.engine.step_split import StepSplit, weight_bytes
from benchmarks.fidelity.invariance_bench import PROMPT, decode_step_s, start_decoding
from cluster.config import DraftConfig
from workers import native_attention
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.hardware import resolve_dtype
from workers.model_loader import load_model
from workers.runner import ModelRunner, StepBatch

CONCURRENCY = (1, 2, 4)
DTYPES = ("bfloat16", "float32")
DRAFT = "models/smollm2-draft"
# as shipped (native ops, draft.cpu_gemm), native ops with oneDNN's GEMMs, torch's ops and oneDNN's GEMMs
DRAFT_KINDS = ("draft", "draft-onednn", "draft-torch-ops")
MAX_LEN = 512


def decode_token_s(eng: LLMEngine, prompt: list[int], c: int, steps: int) -> float:
    """Seconds per token of each of ``c`` requests decoding ``steps`` tokens: for an engine that runs several
    steps per iteration (decode_steps) the iterations' time over the tokens they wrote, one step's otherwise."""
    start_decoding(eng, prompt, c, steps)
    reqs = list(eng.running)  # (a request that reaches max_tokens leaves eng.running)
    done = [len(r.output_ids) for r in reqs]
    t0 = time.perf_counter()
    while eng.has_work() and min(len(r.output_ids) - d for r, d in zip(reqs, done)) < steps:
        eng.step()
    s = time.perf_counter() - t0
    tokens = sum(len(r.output_ids) - d for r, d in zip(reqs, done))
    while eng.has_work():
        eng.step()
    return s * c / tokens


class ReadBandwidth:
    """GB/s of ``buf.sum()`` over one fp32 buffer far larger than the last-level cache (a pure read), at
    torch's thread count. The buffer is made once: a sample costs only its reads, so one can be taken
    beside every timed cell."""

    def __init__(self, buffer_mb: int) -> None:
        self.buf = torch.ones(buffer_mb * (1 << 20) // 4, dtype=torch.float32)  # [N]
        self.buf.sum()  # first touch

    def sample(self, reps: int = 7) -> dict[str, float]:
        """Best and median GB/s of ``reps`` sums."""
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            self.buf.sum()
            times.append(time.perf_counter() - t0)
        nbytes = self.buf.numel() * 4
        return {"best_gb_s": nbytes / min(times) / 1e9, "median_gb_s": nbytes / statistics.median(times) / 1e9}


def read_bandwidth_gbs(buffer_mb: int, reps: int = 7) -> dict[str, float]:
    """Best and median GB/s of ``reps`` sums over a fresh ``buffer_mb`` buffer (see :class:`ReadBandwidth`)."""
    return ReadBandwidth(buffer_mb).sample(reps)


def kv_bytes_per_step(runner: ModelRunner, context: int) -> int:
    """Keys and values one request's decode step reads at ``context`` positions (all layers)."""
    esize = runner.k_cache[0].element_size()
    return 2 * runner.num_layers * runner.num_kv_heads * runner.head_dim * context * esize


class DraftStepper:
    """The draft model's runner stepped as its proposer does: ``c`` slots, one token each per step."""

    def __init__(self, runner: ModelRunner, prompt: list[int]) -> None:
        self.runner, self.prompt = runner, prompt

    def step_s(self, c: int, steps: int) -> float:
        """Median seconds of one ``c``-slot decode forward after a prefill of the prompt."""
        r, n = self.runner, len(self.prompt)
        for s in range(c):
            r.forward(StepBatch([s], [0], [self.prompt], [[n - 1]]))
        times = []
        for i in range(steps + 1):
            batch = StepBatch(list(range(c)), [n + i] * c, [[self.prompt[i % n]]] * c, [[0]] * c)
            t0 = time.perf_counter()
            r.forward(batch)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])


def split_engine(eng: LLMEngine, prompt: list[int], steps: int) -> list[dict[str, Any]]:
    """The step split of ``steps`` batch-1 plain decode steps."""
    eng.add_request(f"split-{time.monotonic_ns()}", prompt, {"max_tokens": steps + 4, "ignore_eos": True})
    while any(r.in_prefill for r in eng.running) or eng.waiting:
        eng.step()
    eng.step()
    with StepSplit(engine=eng) as sp:
        for _ in range(steps):
            eng.step()
    while eng.has_work():
        eng.step()
    return sp.table(steps)


def split_draft(d: DraftStepper, steps: int) -> list[dict[str, Any]]:
    r, n = d.runner, len(d.prompt)
    r.forward(StepBatch([0], [0], [d.prompt], [[n - 1]]))
    with StepSplit(runner=r) as sp:
        for i in range(steps):
            r.forward(StepBatch([0], [n + i], [[d.prompt[i % n]]], [[0]]))
    return sp.table(steps)


def http_paired(
    eng: LLMEngine, prompt: list[int], reader: ReadBandwidth, steps: int, reps: int, decode_steps: int = 1
) -> list[dict[str, float]]:
    """c=1 over HTTP from a fresh local cluster with the served defaults (and ``decode_steps``), each rep paired
    with the in-process step (per token) of ``eng`` and the read bandwidth, taken just before it: on a host whose
    bandwidth swings, a TPOT is only comparable with what was measured in the same minute. Returns per rep
    ``tpot_ms``, ``inproc_ms`` and ``gb_s``."""
    import tempfile
    from pathlib import Path

    from benchmarks.serving.http_overhead import over_http
    from cluster.local_cluster import LocalCluster

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        patch = {"engine": {"max_model_len": MAX_LEN, "num_threads": 2, "decode_steps": decode_steps}}
        cluster = LocalCluster(Path(tmp), args_patch=patch)
        try:
            cluster.start()
            over_http(cluster.base_url, PROMPT, 4, speculation="off")
            for _ in progress(range(reps), desc="http"):
                gb_s = reader.sample(3)["best_gb_s"]
                inproc = (decode_step_s if decode_steps == 1 else decode_token_s)(eng, prompt, 1, steps)
                s, k, _ = over_http(cluster.base_url, PROMPT, steps, speculation="off")
                out.append({"tpot_ms": 1e3 * s / (k - 1), "inproc_ms": 1e3 * inproc, "gb_s": gb_s})
        finally:
            cluster.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per cell and round")
    ap.add_argument("--split-steps", type=int, default=32)
    ap.add_argument("--buffer-mb", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2, help="torch threads: the engine's num_threads")
    ap.add_argument("--http", action="store_true", help="also c=1 TPOT over HTTP (starts a local cluster)")
    ap.add_argument("--http-reps", type=int, default=5)
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=8,
        help="also the engine with this decode_steps (greedy steps per iteration in one native call); 1: not",
    )
    ap.add_argument("--out", default="decode_floor", help="result name under benchmarks/results")
    ap.add_argument(
        "--march",
        help="build the native kernels for this -march instead of the host's (x86-64-v3: an AVX2-only CPU's code "
        "path, run on this host's memory); in process only",
    )
    args = ap.parse_args(argv)
    if args.march:
        if args.http:
            ap.error("--march applies in process only: a cluster's replicas build their own kernels")
        native_attention.build_for(args.march)
    torch.set_num_threads(args.threads)
    env = env_info()
    env["native_march"] = args.march or "native"

    loaded = load_model("smollm2")
    draft_loaded = load_model(DRAFT)

    def engine(dt: str, decode_steps: int = 1) -> LLMEngine:
        cfg = EngineConfig(
            dtype=dt,
            batch_invariant=True,
            max_num_seqs=max(CONCURRENCY),
            enable_prefix_caching=False,
            max_model_len=MAX_LEN,
            proposers=[],
            decode_steps=decode_steps,
        )
        return LLMEngine(cfg, loaded)

    engines = {dt: engine(dt) for dt in DTYPES}
    # the engine with decode_steps (its steps' Python once per iteration), where its runner runs them
    engines_steps = {dt: engine(dt, args.decode_steps) for dt in DTYPES if args.decode_steps > 1}
    if not all(e.runner.runs_decode_steps for e in engines_steps.values()):
        print("decode_steps: no fused native forward here; the engine-steps cells are left out")
        engines_steps = {}
    engine_kinds = ("engine", "engine-steps") if engines_steps else ("engine",)
    prompt = engines["float32"].tokenize_chat([{"role": "user", "content": PROMPT}])
    # the draft as the draft worker runs it (DraftConfig's defaults), and the two paths it replaced
    shipped = DraftConfig()
    drafts = {
        (m, dt): DraftStepper(
            ModelRunner(
                draft_loaded.model,
                max(CONCURRENCY),
                MAX_LEN,
                dtype=getattr(torch, dt),
                head_rows=draft_loaded.draft_vocab,
                native_kernels=shipped.native_kernels if m == "draft" else m == "draft-onednn",
                cpu_gemm=shipped.cpu_gemm if m == "draft" else "onednn",
            ),
            prompt,
        )
        for m in DRAFT_KINDS
        for dt in DTYPES
    }
    for dt in DTYPES:  # warm-up: oneDNN generates its kernels on first use
        decode_step_s(engines[dt], prompt, max(CONCURRENCY), 2)
        for m in DRAFT_KINDS:
            drafts[(m, dt)].step_s(max(CONCURRENCY), 2)

    reader = ReadBandwidth(args.buffer_mb)
    bw_samples = [reader.sample()]
    step_s: dict[tuple[str, str, int], list[float]] = {}
    # The host's bandwidth can swing by 2x within seconds (other tenants): each cell is also compared with
    # the bandwidth read just before and just after it (the higher of the two: the stricter floor).
    cell_bw: dict[tuple[str, str, int], list[float]] = {}
    for rnd in progress(range(args.rounds), desc="rounds"):
        cells = [(m, dt, c) for m in (*engine_kinds, *DRAFT_KINDS) for dt in DTYPES for c in CONCURRENCY]
        for m, dt, c in cells if rnd % 2 == 0 else reversed(cells):
            before = reader.sample(3)["best_gb_s"]
            if m == "engine":
                s = decode_step_s(engines[dt], prompt, c, args.steps)
            elif m == "engine-steps":
                s = decode_token_s(engines_steps[dt], prompt, c, args.steps)
            else:
                s = drafts[(m, dt)].step_s(c, args.steps)
            cell_bw.setdefault((m, dt, c), []).append(max(before, reader.sample(3)["best_gb_s"]))
            step_s.setdefault((m, dt, c), []).append(s)
        bw_samples.append(reader.sample())
    bw = max(b["best_gb_s"] for b in bw_samples)

    runners = {("engine", dt): engines[dt].runner for dt in DTYPES} | {k: d.runner for k, d in drafts.items()}
    runners |= {("engine-steps", dt): e.runner for dt, e in engines_steps.items()}
    context = len(prompt) + args.steps // 2  # the middle of a timed cell
    weights = {
        f"{m}/{dt}": {
            **weight_bytes(r),
            "total": sum(weight_bytes(r).values()),
            "kv_at_context": kv_bytes_per_step(r, context),
        }
        for (m, dt), r in runners.items()
    }
    rows: list[dict[str, Any]] = []
    for (m, dt, c), v in step_s.items():
        floor_s = weights[f"{m}/{dt}"]["total"] / (bw * 1e9)
        # each cell against the floor of its own window
        near = [s * b * 1e9 / weights[f"{m}/{dt}"]["total"] for s, b in zip(v, cell_bw[(m, dt, c)])]
        rows.append(
            {
                "model": m,
                "dtype": dt,
                "c": c,
                "step_ms": 1e3 * statistics.median(v),
                "floor_ms": 1e3 * floor_s,
                "ratio": statistics.median(v) / floor_s,
                "ratio_min": min(v) / floor_s,
                "ratio_max": max(v) / floor_s,
                "ratio_window": statistics.median(near),
                "ratio_window_min": min(near),
                "ratio_window_max": max(near),
                "window_gb_s": cell_bw[(m, dt, c)],
                "weights_mb": weights[f"{m}/{dt}"]["total"] / 1e6,
            }
        )
    rows.sort(key=lambda r: (r["model"], r["dtype"], r["c"]))

    splits = {f"engine/{dt}": split_engine(engines[dt], prompt, args.split_steps) for dt in DTYPES}
    splits |= {f"{m}/{dt}": split_draft(drafts[(m, dt)], args.split_steps) for m in DRAFT_KINDS for dt in DTYPES}

    http: dict[str, Any] | None = None
    http_steps: dict[str, Any] | None = None
    if args.http:
        served = "bfloat16" if resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16 else "float32"
        wbytes = weights[f"engine/{served}"]["total"]
        floor_ms = next(r["floor_ms"] for r in rows if r["model"] == "engine" and r["dtype"] == served)

        def over_http_cell(eng: LLMEngine, decode_steps: int) -> dict[str, Any]:
            reps = http_paired(eng, prompt, reader, args.steps * 3, args.http_reps, decode_steps)
            tp = [r["tpot_ms"] for r in reps]
            window = [r["tpot_ms"] * r["gb_s"] * 1e6 / wbytes for r in reps]  # each rep against its minute's floor
            return {
                "dtype": served,
                "decode_steps": decode_steps,
                "tpot_ms": statistics.median(tp),
                "tpot_samples_ms": tp,
                "ratio": statistics.median(tp) / floor_ms,
                "ratio_window": statistics.median(window),
                "ratio_window_samples": window,
                "replica_path_ms": statistics.median(r["tpot_ms"] - r["inproc_ms"] for r in reps),
                "paired": reps,
            }

        http = over_http_cell(engines[served], 1)
        if engines_steps:
            http_steps = over_http_cell(engines_steps[served], args.decode_steps)

    table = format_table(
        rows,
        [
            ("model", "model", "s"),
            ("dtype", "dtype", "s"),
            ("c", "c", "d"),
            ("weights_mb", "weights MB", ".1f"),
            ("floor_ms", "floor ms", ".2f"),
            ("step_ms", "step ms", ".2f"),
            ("ratio", "x floor", ".2f"),
            ("ratio_min", "min", ".2f"),
            ("ratio_max", "max", ".2f"),
            ("ratio_window", "x window floor", ".2f"),
            ("ratio_window_min", "min", ".2f"),
            ("ratio_window_max", "max", ".2f"),
        ],
        title=f"Decode step vs memory floor ({bw:.1f} GB/s read, {args.threads} threads), {args.rounds} rounds",
    )
    print(table)
    for name, split in splits.items():
        print(
            format_table(
                split,
                [("phase", "phase", "s"), ("ms", "ms/step", ".3f"), ("gb_s", "GB/s", ".1f")],
                title=f"step split: {name}, batch 1",
            )
        )
    for h in (http, http_steps):
        if h:
            print(
                f"HTTP c=1 TPOT (decode_steps {h['decode_steps']}) {h['tpot_ms']:.2f} ms = {h['ratio']:.2f}x the "
                f"{h['dtype']} floor ({h['ratio_window']:.2f}x each rep's own window); replica path "
                f"{h['replica_path_ms']:.2f} ms beyond the in-process step measured just before each rep"
            )
    env["loadavg_end"] = loadavg()
    result = {
        "env": env,
        "contended": True,
        "args": vars(args),
        "bandwidth": {"gb_s": bw, "samples": bw_samples, "buffer_mb": args.buffer_mb},
        "weights_bytes": weights,
        "rows": rows,
        "split": splits,
        "http": http,
        "http_decode_steps": http_steps,
        "raw_step_s": {f"{m}/{dt}/c{c}": v for (m, dt, c), v in step_s.items()},
    }
    fig, axes = figure(ncols=2, width=6.5)
    short = {"engine": "eng", "engine-steps": f"eng{args.decode_steps}", "draft": "drf"}
    short |= {"draft-onednn": "drf-dnn", "draft-torch-ops": "drf-ops"}
    https = [h for h in (http, http_steps) if h]
    bar_panel(
        axes[0],
        [f"{short[r['model']]}/{r['dtype'][:4]}/c{r['c']}" for r in rows]
        + [f"http{'' if h['decode_steps'] == 1 else h['decode_steps']}/c1" for h in https],
        {"x floor": [r["ratio"] for r in rows] + [h["ratio"] for h in https]},
        title="step / memory floor (1.0 = every weight read once at peak)",
        ylabel="x floor",
        fmt="{:.2f}",
    )
    _split_panel(axes[1], splits)
    save_result(
        RESULTS_DIR / args.out,
        result,
        fig,
        title=f"Decode at the memory floor ({env['cpu']}, kernels -march={env['native_march']}, contended)",
    )
    return 0


def _split_panel(ax: Any, splits: dict[str, list[dict[str, Any]]]) -> None:
    """Stacked bars: each phase's ms per batch-1 step."""
    names = list(splits)
    phases: list[str] = []
    for s in splits.values():
        phases += [r["phase"] for r in s if r["phase"] not in ("step", "forward") and r["phase"] not in phases]
    bottom = [0.0] * len(names)
    for ph in phases:
        vals = [max(next((r["ms"] for r in splits[n] if r["phase"] == ph), 0.0), 0.0) for n in names]
        ax.bar(names, vals, bottom=bottom, label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_title("batch-1 step split (ms)")
    ax.set_ylabel("ms")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=6)


if __name__ == "__main__":
    sys.exit(main())
