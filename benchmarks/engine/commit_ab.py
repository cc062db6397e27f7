"""Paired A/B of the engine's decode step between two commits: what a change to the runner, the kernels or the
engine's Python did, on one host, measured as the change, not as two runs minutes apart.

    python -m benchmarks.engine.commit_ab --base <rev> [--new <rev>] [--rounds 3] [--concurrency 1,4,16,32]
        [--dtypes bfloat16,float32] [--steps 16] [--sampling '{"temperature": 0.8, "top_p": 0.95}']
        [--decode-steps 1] [--out commit_ab]

Where ``step_ab`` swaps only runner.py in one process, this compares whole trees (kernels, native bindings,
engine): two trees cannot share one process (both are ``workers``), so each side is a child process, loaded once
and kept waiting, and every cell runs on both sides back to back, the order alternating cell by cell (A B, B A,
...): seconds apart, where the host's bandwidth swings over minutes. ``--base`` is checked out into a temporary
worktree, and so is ``--new`` when given (default: this working tree, uncommitted changes included). A side loads
SmolLM2 once per dtype (batch-invariant, as served); a cell is the median plain decode step of ``--steps`` steps
with c requests decoding, between two samples of the read bandwidth (a torch sum over 256 MiB, the best of 5),
so every cell also has its ratio to the floor of its own window (weights' bytes / the higher of the two
samples). Per cell: B/A of the step over the rounds (median, min..max), and each side's median window ratio.
``--sampling``: the requests' sampling parameters (default greedy), each request seeded with its own seed, so that
a change to the sampler is measured where it runs, inside the step. ``--decode-steps N``: both sides' engines run up
to N steps an iteration (EngineConfig.decode_steps), and a cell is then the iterations' time per token written.

Writes benchmarks/results/<--out>.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, format_table, paired, progress, save_result

REPO = Path(__file__).resolve().parents[2]
MARK = "COMMIT_AB "  # the child's result line


# One side, run as `python -c` from the tree at the side's root (its cwd), so that `workers` and `benchmarks` are
# that tree's: it loads an engine per dtype, says READY, then times one cell per line it reads ("dtype c steps"),
# answering each with MARK + JSON, until its stdin closes.
CHILD = r"""
import json, statistics, sys, time
import torch
torch.set_num_threads(2)
from benchmarks.engine.decode_floor import ReadBandwidth
from benchmarks.engine.step_split import weight_bytes
from benchmarks.fidelity.invariance_bench import PROMPT
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.model_loader import load_model
a = json.loads(sys.argv[1])
loaded = load_model("smollm2")
rb = ReadBandwidth(256)
engines = {}
for dt in a["dtypes"]:
    steps_kw = {"decode_steps": a["decode_steps"]} if a["decode_steps"] > 1 else {}
    cfg = EngineConfig(dtype=dt, max_num_seqs=a["max_c"], enable_prefix_caching=False, max_model_len=512,
                       proposers=[], **steps_kw)
    eng = LLMEngine(cfg, loaded)
    wbytes = sum(weight_bytes(eng.runner).values())  # the floor's bytes, as decode_floor counts them
    prompt = eng.tokenize_chat([{"role": "user", "content": PROMPT}])
    engines[dt] = (eng, prompt, wbytes)


def decode_step_s(eng, prompt, c, steps):
    # invariance_bench's, with the sampling parameters: written here so that it runs on a side's older tree
    for i in range(c):
        params = {"max_tokens": steps + 8, "ignore_eos": True, **a["sampling"]}
        if "temperature" in a["sampling"] and "seed" not in a["sampling"]:
            params["seed"] = 1000 + i  # each its own: the position-keyed noise of c different requests
        eng.add_request(f"b{i}-{time.monotonic_ns()}", prompt, params, speculation="off")
    while any(r.in_prefill for r in eng.running) or eng.waiting:
        eng.step()
    eng.step()  # first step after prefill: every request decoding
    if a["decode_steps"] > 1:  # iterations of several steps: their time over the tokens they wrote (a mean)
        reqs = list(eng.running)
        done = [len(r.output_ids) for r in reqs]
        t0 = time.perf_counter()
        while eng.has_work() and min(len(r.output_ids) - d for r, d in zip(reqs, done)) < steps:
            eng.step()
        s = time.perf_counter() - t0
        tokens = sum(len(r.output_ids) - d for r, d in zip(reqs, done))
        while eng.has_work():
            eng.step()
        return s * c / tokens
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    while eng.has_work():
        eng.step()
    return statistics.median(times)


for eng, prompt, _ in engines.values():
    decode_step_s(eng, prompt, 1, 4)  # warm: kernels built, buffers made
print("READY", flush=True)
for line in sys.stdin:
    dt, c, steps = line.split()
    eng, prompt, wbytes = engines[dt]
    bw0 = rb.sample(5)["best_gb_s"]
    step = decode_step_s(eng, prompt, int(c), int(steps))
    bw = max(bw0, rb.sample(5)["best_gb_s"])
    print(MARK + json.dumps({"step_s": step, "gb_s": bw, "window_ratio": step / (wbytes / (bw * 1e9))}), flush=True)
"""


class Side:
    """One side's child process, loaded and waiting for cells."""

    def __init__(
        self, root: Path, dtypes: list[str], max_c: int, sampling: dict[str, object], decode_steps: int
    ) -> None:
        spec = json.dumps({"dtypes": dtypes, "max_c": max_c, "sampling": sampling, "decode_steps": decode_steps})
        self.root = root
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"MARK = {MARK!r}\n" + CHILD, spec],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :]
        raise SystemExit(f"the side at {self.root} exited ({self.proc.wait()}) before {prefix.strip()!r}")

    def cell(self, dtype: str, c: int, steps: int) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{dtype} {c} {steps}\n")
        self.proc.stdin.flush()
        return json.loads(self._expect(MARK))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait()


def worktree(rev: str, into: Path) -> Path:
    """``rev`` checked out (detached) at ``into``: a worktree of this repository."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(into), rev], check=True,
                   capture_output=True)  # fmt: skip
    return into


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="side A: a git revision")
    ap.add_argument("--new", default=None, help="side B: a git revision (default: this working tree)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per cell (their median)")
    ap.add_argument("--sampling", default="{}", help="the requests' sampling parameters, JSON (default: greedy)")
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=1,
        help="EngineConfig.decode_steps on both sides; above 1 a cell is the time per token of the iterations",
    )
    ap.add_argument("--out", default="commit_ab", help="result name under benchmarks/results")
    args = ap.parse_args(argv)
    sampling = json.loads(args.sampling)
    if not isinstance(sampling, dict):
        ap.error("--sampling: a JSON object of sampling parameters")
    env = env_info()
    dtypes, concurrency = args.dtypes.split(","), [int(c) for c in args.concurrency.split(",")]
    cells = [(dt, c) for dt in dtypes for c in concurrency]
    runs: dict[str, dict[str, list[dict[str, float]]]] = {"A": {}, "B": {}}
    with tempfile.TemporaryDirectory(prefix="commit_ab_") as tmp:
        roots = {"A": worktree(args.base, Path(tmp) / "a")}
        roots["B"] = worktree(args.new, Path(tmp) / "b") if args.new else REPO
        sides: dict[str, Side] = {}
        try:
            for name, root in roots.items():
                sides[name] = Side(root, dtypes, max(concurrency), sampling, args.decode_steps)
            for r in progress(range(args.rounds), desc="rounds"):
                for i, (dt, c) in enumerate(cells):  # each cell on both sides back to back, the order alternating
                    for name in ("A", "B") if (r + i) % 2 == 0 else ("B", "A"):
                        runs[name].setdefault(f"{dt}/c{c}", []).append(sides[name].cell(dt, c, args.steps))
        finally:
            for side in sides.values():
                side.close()
            for root in roots.values():
                if root != REPO:
                    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(root)],
                                   capture_output=True, check=False)  # fmt: skip
    rows = []
    for cell, a_runs in runs["A"].items():
        b_runs = runs["B"][cell]
        row = {"cell": cell, **paired([x["step_s"] for x in a_runs], [x["step_s"] for x in b_runs])}
        row["a_window"] = statistics.median(x["window_ratio"] for x in a_runs)
        row["b_window"] = statistics.median(x["window_ratio"] for x in b_runs)
        row["gb_s"] = statistics.median(x["gb_s"] for x in a_runs + b_runs)
        rows.append(row)
    print(
        format_table(
            rows,
            [
                ("cell", "cell", ""),
                ("a_ms", "A ms", ".2f"),
                ("b_ms", "B ms", ".2f"),
                ("ratio", "B/A", ".3f"),
                ("ratio_min", "min", ".3f"),
                ("ratio_max", "max", ".3f"),
                ("a_window", "A x window floor", ".2f"),
                ("b_window", "B x window floor", ".2f"),
                ("gb_s", "GB/s", ".1f"),
            ],
            title=f"decode step, B ({args.new or 'working tree'}) / A ({args.base}), {args.rounds} paired rounds"
            + (f", sampling {args.sampling}" if sampling else ""),
        )
    )
    fig, axes = figure(ncols=2, width=7)
    names = [r["cell"] for r in rows]
    bar_panel(axes[0], names, {"B/A": [r["ratio"] for r in rows]}, title="step B / A (median of rounds)",
              ylabel="ratio", hline=1.0, fmt="{:.3f}")  # fmt: skip
    bar_panel(axes[1], names, {"A": [r["a_window"] for r in rows], "B": [r["b_window"] for r in rows]},
              title="step / floor of its bandwidth window", ylabel="x floor", hline=1.0)  # fmt: skip
    result = {"env": env, "args": vars(args), "rows": rows, "runs": runs}
    save_result(RESULTS_DIR / args.out, result, fig, title=f"commit A/B: {args.new or 'working tree'} vs {args.base}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
