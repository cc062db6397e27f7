"""What sampling costs a decoded token: sampled requests against greedy ones in one engine, interleaved.

Why: the served default is temperature 1 and many clients send a top-p, so the greedy cells of ``decode_floor`` and
``commit_ab`` miss what most requests pay. Each round times every cell back to back (the order alternating round
by round) on one bf16 engine as served (``decode_steps`` as in ray_config.yaml unless given), a request at a time
(or ``--concurrency`` of them), each seeded; a cell is the time per token of the iterations after the first
decode step. Every round gives each setting's ratio to greedy, whose median and spread the table prints, with the
read bandwidth beside the round (the host's mode: see docs/benchmarks.md, "Several steps a call").

    python -m benchmarks.engine.sampling_cost [--rounds 10] [--tokens 48] [--decode-steps 4] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, format_table, progress, save_result
from benchmarks.engine.decode_floor import ReadBandwidth

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SETTINGS = {
    "greedy": {},
    "temperature 1": {"temperature": 1.0},
    "T 0.8, top-p 0.95": {"temperature": 0.8, "top_p": 0.95},
    "T 0.7, top-k 50": {"temperature": 0.7, "top_k": 50},
}


def per_token_s(eng: Any, prompt: list[int], params: dict[str, Any], c: int, tokens: int) -> float:
    """Seconds per token of ``c`` requests decoding ``tokens`` tokens each (after their prefill and first step)."""
    for i in range(c):
        p = {"max_tokens": tokens + 16, "ignore_eos": True, **params}
        if params:
            p["seed"] = 7 + i
        eng.add_request(f"s{i}-{time.monotonic_ns()}", prompt, p, speculation="off")
    while any(r.in_prefill for r in eng.running) or eng.waiting:
        eng.step()
    eng.step()
    reqs = list(eng.running)
    done = [len(r.output_ids) for r in reqs]
    t0 = time.perf_counter()
    while eng.has_work() and min(len(r.output_ids) - d for r, d in zip(reqs, done)) < tokens:
        eng.step()
    s = time.perf_counter() - t0
    n = sum(len(r.output_ids) - d for r, d in zip(reqs, done))
    while eng.has_work():
        eng.step()
    return s / n * c


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=48, help="tokens timed per request and cell")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--decode-steps", type=int, default=None, help="EngineConfig.decode_steps (default: the served)")
    ap.add_argument("--settings", default=None, help="JSON {name: sampling params} to use instead of the defaults")
    ap.add_argument("--out", default="sampling_cost", help="result name under benchmarks/results")
    args = ap.parse_args(argv)
    import yaml

    from cluster.config import AppConfig
    from workers.config import EngineConfig
    from workers.engine import LLMEngine
    from workers.model_loader import load_model

    settings = {"greedy": {}, **json.loads(args.settings)} if args.settings else SETTINGS
    shipped = yaml.safe_load((RESULTS_DIR.parents[1] / "ray_config.yaml").read_text())["applications"][0]["args"]
    served = AppConfig.model_validate(shipped).engine.decode_steps
    steps = served if args.decode_steps is None else args.decode_steps
    cfg = EngineConfig(dtype="bfloat16", max_num_seqs=max(4, args.concurrency), enable_prefix_caching=False,
                       max_model_len=512, proposers=[], decode_steps=steps)  # fmt: skip
    eng = LLMEngine(cfg, load_model("smollm2"))
    prompt = eng.tokenize_chat([{"role": "user", "content": PROMPT}])
    for p in settings.values():
        per_token_s(eng, prompt, p, args.concurrency, 8)  # warm: kernels built, buffers made
    reader = ReadBandwidth(256)
    runs: dict[str, list[float]] = {k: [] for k in settings}
    bandwidth: list[float] = []
    for r in progress(range(args.rounds), desc="rounds"):
        bw = reader.sample(3)["best_gb_s"]
        for k in list(settings) if r % 2 == 0 else list(settings)[::-1]:
            runs[k].append(per_token_s(eng, prompt, settings[k], args.concurrency, args.tokens))
        bandwidth.append(max(bw, reader.sample(3)["best_gb_s"]))
    rows = []
    for k, ts in runs.items():
        ratios = sorted(t / g for t, g in zip(ts, runs["greedy"]))
        rows.append({"setting": k, "ms": statistics.median(ts) * 1e3, "ratio": statistics.median(ratios),
                     "ratio_min": ratios[0], "ratio_max": ratios[-1]})  # fmt: skip
    print(
        format_table(
            rows,
            [
                ("setting", "sampling", ""),
                ("ms", "ms a token", ".2f"),
                ("ratio", "x greedy", ".3f"),
                ("ratio_min", "min", ".3f"),
                ("ratio_max", "max", ".3f"),
            ],  # fmt: skip
            title=f"bf16, c={args.concurrency}, decode_steps {steps}, {args.rounds} interleaved rounds, "
            f"read {min(bandwidth):.0f}-{max(bandwidth):.0f} GB/s",
        )
    )
    fig, axes = figure(ncols=1, width=6)
    bar_panel(axes[0], [r["setting"] for r in rows], {"x greedy": [r["ratio"] for r in rows]},
              title="time a token / greedy's (median of rounds)", ylabel="ratio", hline=1.0, fmt="{:.3f}")  # fmt: skip
    result = {"env": env_info(), "args": vars(args), "decode_steps": steps, "rows": rows, "runs": runs,
              "bandwidth_gb_s": bandwidth}  # fmt: skip
    save_result(RESULTS_DIR / args.out, result, fig, title="sampling's cost a token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
