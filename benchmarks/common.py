"""Shared benchmark helpers: timing, a closed-loop in-process driver, HF reference timing, reports.

Timings on the shared 2-core dev machine are noisy, so every benchmark runs its peers side
by side in one process and one run (interleaved where it can) and reports ratios; the
absolute numbers are only comparable within one run. ``env_info()`` records the load
average before and after so a reader can see how busy the machine was.

Metrics (the usual serving definitions):
- aggregate output tok/s: output tokens of all requests / wall time of the whole run;
- TTFT: submission -> first output token of a request (includes its prefill);
- TPOT: (finish - first token) / (output tokens - 1), per request; reported as P50 / P99
  over requests (a speculative step commits several tokens at once; TPOT is the mean
  over the request, so it still measures the per-token cost the client sees).
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from workers.stats import SpecDecodeStats

RESULTS_DIR = Path(__file__).resolve().parent / "results"

Work = Sequence[tuple[list[int], dict[str, Any]]]  # [(prompt token ids, sampling params dict)]


# ----------------------------------------------------------------------------- environment


def set_threads(n: int = 2) -> None:
    torch.set_num_threads(n)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def env_info() -> dict[str, Any]:
    import transformers

    from workers.hardware import cpu_flags, cpu_name

    return {
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_native_bf16": sorted(f for f in cpu_flags() if f in ("amx_bf16", "avx512_bf16")),
        "nproc": os.cpu_count(),
        "loadavg_start": loadavg(),
    }


# ----------------------------------------------------------------------------- progress, stats


def progress(iterable: Iterable | None = None, **kwargs: Any):
    """tqdm on stderr; in a log file (not a tty) it refreshes rarely so the log stays readable."""
    from tqdm import tqdm

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    kwargs.setdefault("leave", False)
    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 15.0)
    return tqdm(iterable, **kwargs)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return float("nan")
    pos = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def paired(a: Sequence[float], b: Sequence[float]) -> dict[str, float]:
    """Side B against side A over paired rounds (``a[i]`` and ``b[i]`` timed back to back): each round's own
    B/A ratio, so minutes of host noise cancel; medians of both sides in ms beside them."""
    r = [y / x for x, y in zip(a, b)]
    return {
        "a_ms": 1e3 * statistics.median(a),
        "b_ms": 1e3 * statistics.median(b),
        "ratio": statistics.median(r),
        "ratio_min": min(r),
        "ratio_max": max(r),
    }


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


@dataclass
class SpecTotals(SpecDecodeStats):
    """Summed per-request SpecDecodeStats; the acceptance rate and length come from the engine's own
    definitions (workers/stats.py), so a benchmark can never compute them differently."""

    def add(self, spec: dict[str, Any] | None) -> None:
        if spec:
            self.num_drafts += spec.get("num_drafts", 0)
            self.num_draft_tokens += spec.get("num_draft_tokens", 0)
            self.num_accepted_tokens += spec.get("num_accepted_tokens", 0)
            per_pos = spec.get("accepted_per_pos") or []
            if len(self.accepted_per_pos) < len(per_pos):
                self.accepted_per_pos.extend([0] * (len(per_pos) - len(self.accepted_per_pos)))
            for i, n in enumerate(per_pos):
                self.accepted_per_pos[i] += n


@dataclass
class RequestRecord:
    index: int  # position in the work list
    prompt_len: int
    submit_s: float  # seconds since the run started
    first_token_s: float | None = None
    finish_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    num_steps: int = 0  # target passes that committed tokens to this request (HF: streamer puts)
    finish_reason: str | None = None
    spec: dict[str, Any] | None = None  # the request's SpecDecodeStats.as_dict()

    @property
    def ttft(self) -> float:
        return (self.first_token_s - self.submit_s) if self.first_token_s is not None else float("nan")

    @property
    def tpot(self) -> float:
        n = len(self.token_ids)
        if n < 2 or self.first_token_s is None or self.finish_s is None:
            return float("nan")
        return (self.finish_s - self.first_token_s) / (n - 1)


@dataclass
class RunResult:
    """One measured run: a closed-loop engine run, or a sequence of HF ``generate`` calls."""

    name: str
    concurrency: int
    wall_s: float
    records: list[RequestRecord]
    # Closed loop only: the steps that began with all ``concurrency`` clients' requests in the engine.
    # A finite closed loop ends in a ramp-down tail (clients run out of work one by one) that runs
    # below its concurrency; these give the rate *at* the concurrency, beside the whole run's rate.
    steady_tokens: int = 0
    steady_s: float = 0.0

    @property
    def output_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.records)

    @property
    def tok_s(self) -> float:
        return ratio(self.output_tokens, self.wall_s)

    @property
    def steady_tok_s(self) -> float:
        return ratio(self.steady_tokens, self.steady_s)

    def spec_totals(self) -> SpecTotals:
        tot = SpecTotals()
        for r in self.records:
            tot.add(r.spec)
        return tot

    def summary(self) -> dict[str, Any]:
        tpots = [r.tpot for r in self.records]
        ttfts = [r.ttft for r in self.records]
        return {
            "name": self.name,
            "concurrency": self.concurrency,
            "num_requests": len(self.records),
            "output_tokens": self.output_tokens,
            "wall_s": self.wall_s,
            "tok_s": self.tok_s,
            "steady_tok_s": self.steady_tok_s,
            "tpot_p50_ms": 1e3 * percentile(tpots, 50),
            "tpot_p99_ms": 1e3 * percentile(tpots, 99),
            "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
            "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
            "spec": self.spec_totals().as_dict(),
            # tokens committed per target pass (engine and HF alike; 1.0 for plain decoding)
            "tokens_per_pass": ratio(self.output_tokens, sum(r.num_steps for r in self.records)),
        }

    def outputs(self) -> list[list[int]]:
        """Output token ids in work-list order."""
        return [r.token_ids for r in sorted(self.records, key=lambda r: r.index)]


def merge_runs(name: str, runs: Sequence[RunResult]) -> RunResult:
    """Back-to-back runs as one (sums wall time; records keep their per-run timing)."""
    records: list[RequestRecord] = []
    for run in runs:
        for r in run.records:
            records.append(RequestRecord(**{**r.__dict__, "index": len(records)}))
    return RunResult(name, max((r.concurrency for r in runs), default=1), sum(r.wall_s for r in runs), records)


# ----------------------------------------------------------------------------- the engine driver


def run_closed_loop(
    engine: Any,  # workers.engine.LLMEngine
    work: Work,
    concurrency: int,
    *,
    proposer: str | None = None,
    speculation: str = "off",
    name: str = "",
    show_progress: bool = True,
) -> RunResult:
    """Closed loop: ``concurrency`` clients, each submits its next request when its last one finishes.

    The engine holds at most ``concurrency`` requests (``max_num_seqs`` must be >= it so none
    waits for a slot); the run ends when all of ``work`` is done. Timing is taken after each
    ``step()``, which is when a streaming client would see the tokens.
    """
    if concurrency > engine.config.max_num_seqs:
        raise ValueError(f"concurrency {concurrency} > engine max_num_seqs {engine.config.max_num_seqs}")
    prefix = f"{name or 'run'}-{uuid.uuid4().hex[:8]}"
    inflight: dict[str, RequestRecord] = {}
    done: list[RequestRecord] = []
    next_i = 0
    total_tokens = sum(int(p.get("max_tokens", 16)) for _, p in work)
    bar = progress(total=total_tokens, desc=f"{name} c={concurrency}", unit="tok", disable=not show_progress)
    t0 = time.perf_counter()

    def submit(now: float) -> None:
        nonlocal next_i
        prompt, params = work[next_i]
        rid = f"{prefix}-{next_i}"
        engine.add_request(rid, prompt, params, proposer=proposer, speculation=speculation)
        inflight[rid] = RequestRecord(index=next_i, prompt_len=len(prompt), submit_s=now - t0)
        next_i += 1

    while next_i < len(work) and len(inflight) < concurrency:
        submit(t0)
    steady_tokens, steady_s, prev = 0, 0.0, t0
    while inflight:
        full = len(inflight) == concurrency
        outs = engine.step()
        now = time.perf_counter()
        if not outs and not engine.has_work():
            raise RuntimeError(f"engine idle with {len(inflight)} requests in flight")
        if full:
            steady_s += now - prev
            steady_tokens += sum(len(o.token_ids) for o in outs if o.request_id in inflight)
        prev = now
        for o in outs:
            rec = inflight.get(o.request_id)
            if rec is None:
                continue
            if o.token_ids:
                if rec.first_token_s is None:
                    rec.first_token_s = now - t0
                rec.token_ids.extend(o.token_ids)
                rec.num_steps += 1
                bar.update(len(o.token_ids))
            if o.finished:
                rec.finish_s = now - t0
                rec.finish_reason = o.finish_reason
                rec.spec = o.spec.as_dict() if o.spec is not None else None
                done.append(inflight.pop(o.request_id))
                if next_i < len(work):
                    submit(now)
    wall = time.perf_counter() - t0
    bar.close()
    return RunResult(name, concurrency, wall, done, steady_tokens, steady_s)


def warmup_engine(engine: Any, prompt: list[int], n_tokens: int = 8, **kwargs: Any) -> None:
    """A short untimed request so first-call allocations are not timed."""
    engine.generate([prompt], {"max_tokens": n_tokens, "temperature": 0, "ignore_eos": True}, **kwargs)


# ----------------------------------------------------------------------------- HF reference


class _TimingStreamer:
    """A ``generate`` streamer that records when tokens arrive (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate(
    model: Any,  # transformers PreTrainedModel
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    ignore_eos: bool,
    eos_token_id: int | list[int] | None = None,
    name: str = "hf",
    **gen_kwargs: Any,
) -> RunResult:
    """HF transformers greedy ``generate`` at batch 1, timed like one closed-loop request.

    ``ignore_eos`` uses ``min_new_tokens = max_new_tokens`` (EOS is masked, so the length is
    exact; the engine's ``ignore_eos`` instead keeps decoding past an emitted EOS: same cost).
    """
    from transformers.generation.streamers import BaseStreamer

    class Streamer(_TimingStreamer, BaseStreamer):
        pass

    inp = torch.tensor([prompt_ids])
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id)
    if eos_token_id is not None:
        kw["eos_token_id"] = eos_token_id
    if ignore_eos:
        kw["min_new_tokens"] = max_new_tokens
    kw.update(gen_kwargs)
    streamer = Streamer()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inp, streamer=streamer, **kw)
    t1 = time.perf_counter()
    toks = out[0, len(prompt_ids) :].tolist()
    first = streamer.times[1] - t0 if len(streamer.times) > 1 else None
    rec = RequestRecord(
        0,
        len(prompt_ids),
        0.0,
        first,
        t1 - t0,
        toks,
        max(len(streamer.times) - 1, 0),
        "length" if len(toks) == max_new_tokens else "stop",
    )
    return RunResult(name, 1, t1 - t0, [rec])


# ----------------------------------------------------------------------------- reports


def _fmt(v: Any, spec: str | Callable[[Any], str]) -> str:
    if callable(spec):
        return spec(v)
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, str):
        return v
    return format(v, spec)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str, Any]], title: str = "") -> str:
    """``columns``: (key, header, format spec or callable). Numbers right-aligned, text left."""
    cells = [[_fmt(r.get(k), f) for k, _, f in columns] for r in rows]
    headers = [h for _, h, _ in columns]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(headers)]
    numeric = [all(isinstance(r.get(k), (int, float)) or r.get(k) is None for r in rows) for k, _, _ in columns]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    return "\n".join(out)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and (math.isnan(obj) or math.isinf(obj)):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(path: Path, obj: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(obj), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def figure(ncols: int = 1, width: float = 6.0, height: float = 4.2):
    """A matplotlib figure (Agg backend: no display needed) with ``ncols`` axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def line_panel(
    ax: Any,
    xs: Sequence[float],
    series: dict[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = True,
) -> None:
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label)
        for x, y in zip(xs, ys):
            if y is not None and not (isinstance(y, float) and math.isnan(y)):
                ax.annotate(f"{y:.3g}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    if logx:
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([str(x) for x in xs])
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def bar_panel(
    ax: Any,
    groups: Sequence[str],
    series: dict[str, Sequence[float]],
    *,
    title: str,
    ylabel: str,
    hline: float | None = None,
    fmt: str = "{:.2f}",
) -> None:
    n = max(len(series), 1)
    width = 0.8 / n
    for i, (label, vals) in enumerate(series.items()):
        xs = [g + (i - (n - 1) / 2) * width for g in range(len(groups))]
        vals = [0.0 if (v is None or (isinstance(v, float) and math.isnan(v))) else v for v in vals]
        bars = ax.bar(xs, vals, width, label=label)
        for b, v in zip(bars, vals):
            ax.annotate(
                fmt.format(v),
                (b.get_x() + b.get_width() / 2, v),
                textcoords="offset points",
                xytext=(0, 2),
                ha="center",
                fontsize=6,
            )
    if hline is not None:
        ax.axhline(hline, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def save_result(path: Path, result: dict[str, Any], fig: Any = None, title: str = "") -> Path:
    """Every benchmark's epilogue: writes ``path`` + ``.json`` and, given a figure, ``path`` + ``.png``.

    ``path`` has no suffix (``RESULTS_DIR / "<benchmark>"`` unless ``--out`` says otherwise). The
    result records its machine: ``env`` (``env_info()`` unless the benchmark took it at its start)
    gains the load average at the end; the figure's title names the CPU; the paths go to stderr, so
    that a benchmark whose stdout is its report (``soak``) stays parseable.
    """
    env = result.setdefault("env", env_info())
    env.setdefault("loadavg_end", loadavg())
    json_path = write_json(path.with_suffix(".json"), result)
    written = [json_path]
    if fig is not None:
        cpu = str(env.get("cpu", ""))
        suptitle = title if cpu in title else ", ".join(x for x in (title, cpu) if x)
        written.append(save_figure(fig, path.with_suffix(".png"), suptitle=suptitle))
    print(f"[{path.name}] wrote " + " and ".join(map(str, written)), file=sys.stderr, flush=True)
    return json_path


def save_figure(fig: Any, path: Path, suptitle: str = "") -> Path:
    import matplotlib.pyplot as plt

    if suptitle:
        fig.suptitle(suptitle, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
