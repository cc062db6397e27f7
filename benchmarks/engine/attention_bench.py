"""One layer's attention, three ways: the native invariant kernel, the torch-op invariant attention
(the fallback where no C compiler is found) and SDPA (the fast, not invariant, path).

    python -m benchmarks.engine.attention_bench [--rounds 3]

SmolLM2's shape (9 query heads over 3 kv heads, head_dim 64), fp32 (the invariant attention always
computes in fp32), 2 threads, random data. Cases: decode (one query row per request) against 40,
200 and 1000 keys at c=1 and 300 keys at c=32, and one request's causal prefill of 64, 256 and 480
tokens. The three run interleaved in every round; the table reports each one's best round in us.

Writes benchmarks/results/attention_bench.{json,png}.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks.common import (
    RESULTS_DIR,
    bar_panel,
    env_info,
    figure,
    format_table,
    save_result,
    set_threads,
)
from workers import batch_invariant as bi
from workers import native_attention

H, HKV, D = 9, 3, 64
# (name, query rows per request, requests, visible keys of the last row): decode rows see all keys,
# prefill rows are causal (row i sees i + 1 keys)
CASES = (
    ("decode c=1, 40 keys", 1, 1, 40),
    ("decode c=1, 200 keys", 1, 1, 200),
    ("decode c=1, 1000 keys", 1, 1, 1000),
    ("decode c=32, 300 keys", 1, 32, 300),
    ("prefill 64", 64, 1, 64),
    ("prefill 256", 256, 1, 256),
    ("prefill 480", 480, 1, 480),
)


def time_us(fn: Callable[[], Any], budget_s: float = 0.3) -> float:
    """Mean microseconds per call over about ``budget_s`` of calls, after a warm-up."""
    for _ in range(3):
        fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < budget_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e6


def case_fns(
    n_rows: int, n_req: int, keys: int, native: native_attention.NativeAttention, blocking: bi.AttentionBlocking
) -> dict[str, Callable[[], Any]]:
    gen = torch.Generator().manual_seed(0)
    L = bi.padded_keys(max(keys, 1024))
    k = torch.randn(n_req, HKV, L, D, generator=gen)  # [S, Hkv, L, D]
    v = torch.randn(n_req, HKV, L, D, generator=gen)
    kt = k.transpose(2, 3).contiguous()  # [S, Hkv, D, L]: the native kernel's key layout
    q = torch.randn(n_req, n_rows, H, D, generator=gen)  # [S, n, H, D]
    first = keys - n_rows  # keys before the first new row
    slots = torch.arange(n_req).repeat_interleave(n_rows)  # [T]
    nvis = (first + 1 + torch.arange(n_rows)).repeat(n_req)  # [T]
    lp = bi.padded_keys(keys)
    qpos = first + torch.arange(n_rows)  # [n]
    masked = ~(torch.arange(lp)[None, :] <= qpos[:, None])[None, None, None].expand(n_req, 1, 1, n_rows, lp)
    sdpa_mask = (torch.arange(keys)[None, :] <= qpos[:, None])[None, None]  # [1, 1, n, keys]
    flat = q.reshape(n_req * n_rows, H, D)
    return {
        "native": lambda: native(flat, kt, v, slots, nvis, keys, D**-0.5),
        "torch ops": lambda: bi.attention(q, k[:, :, :lp], v[:, :, :lp], masked, D**-0.5, blocking),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k[:, :, :keys],
            v[:, :, :keys],
            attn_mask=None if n_rows == 1 else sdpa_mask,
            enable_gqa=True,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    set_threads(2)
    native = native_attention.load()
    if native is None:
        print("no C compiler here: nothing to compare the torch-op attention with")
        return 1
    blocking = bi.probe_attention_blocking(D, torch.device("cpu"))
    fns = {name: case_fns(n, s, keys, native, blocking) for name, n, s, keys in CASES}
    us: dict[str, dict[str, list[float]]] = {name: {} for name in fns}
    for rnd in range(args.rounds):
        for name, cell in fns.items():
            order = list(cell) if rnd % 2 == 0 else list(reversed(cell))
            for impl in order:
                us[name].setdefault(impl, []).append(time_us(cell[impl]))
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    rows = [
        {
            "case": name,
            **{impl: min(v) for impl, v in us[name].items()},
            "torch_over_native": min(us[name]["torch ops"]) / min(us[name]["native"]),
            "sdpa_over_native": min(us[name]["sdpa"]) / min(us[name]["native"]),
        }
        for name in fns
    ]
    env = env_info()
    print(
        format_table(
            rows,
            [
                ("case", "case", "s"),
                ("native", "native us", ".1f"),
                ("torch ops", "torch ops us", ".1f"),
                ("sdpa", "sdpa us", ".1f"),
                ("torch_over_native", "torch/native", ".2f"),
                ("sdpa_over_native", "sdpa/native", ".2f"),
            ],
            title=f"One layer's attention, best of {args.rounds} interleaved rounds ({env['cpu']})",
        )
    )
    fig, axes = figure(ncols=1, width=10)
    bar_panel(
        axes[0],
        [r["case"] for r in rows],
        {impl: [r[impl] for r in rows] for impl in ("native", "torch ops", "sdpa")},
        title="one layer's attention (lower is better)",
        ylabel="us",
        fmt="{:.0f}",
    )
    result = {"env": env, "args": vars(args), "rows": rows, "raw_us": us}
    save_result(RESULTS_DIR / "attention_bench", result, fig, title="Invariant attention kernels")
    return 0


if __name__ == "__main__":
    sys.exit(main())
