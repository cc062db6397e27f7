"""One layer's attention, three ways: the native invariant kernel, the torch-op invariant attention
(the fallback where no C compiler is found) and SDPA (the fast, not invariant, path); or, with
``--kv-dtype-ab``, each invariant attention reading an fp32 KV cache against a bf16 one.

    python -m benchmarks.engine.attention_bench [--rounds 3]
    python -m benchmarks.engine.attention_bench --kv-dtype-ab [--rounds 31 --budget-s 0.02 --native-only --cpu-time]

SmolLM2's shape (9 query heads over 3 kv heads, head_dim 64), 2 threads, random data rounded to bf16
(a bf16 model's keys and values), scattered over a paged cache of 16-token blocks as the runner holds
it; the invariant attention computes in fp32 whatever the cache stores. Cases: decode (one query row
per request) against 40, 200 and 1000 keys at c=1 and 300 keys at c=32, and one request's causal
prefill of 64, 256 and 480 tokens. The arms run interleaved in every round (order reversed every
other round); the table reports each one's best round in us and, for the A/B, the median over rounds
of the paired ratio (robust to a busy machine: both arms of a round see about the same load). The
torch arms include the gather of a request's blocks into one key axis, as the runner does. The A/B
also checks that both caches give bit-identical outputs.

Writes benchmarks/results/attention_bench.{json,png}, or attention_kv_dtype.{json,png} for the A/B.
"""

from __future__ import annotations

import argparse
import functools
import statistics
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
BS = 16  # tokens per cache block (engine.block_size's default)
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


def time_us(fn: Callable[[], Any], budget_s: float = 0.3, clock: Callable[[], float] = time.perf_counter) -> float:
    """Mean microseconds per call over about ``budget_s`` of calls, after a warm-up, read on ``clock``."""
    for _ in range(3):
        fn()
    n, t0 = 0, clock()
    while clock() - t0 < budget_s:
        fn()
        n += 1
    return (clock() - t0) / n * 1e6


def paged(n_req: int, L: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Keys and values of ``n_req`` requests of ``L`` positions in a pool of 16-token blocks, in random order:
    (keys ``[NB, Hkv, D, BS]`` transposed per block, values ``[NB, Hkv, BS, D]``, tables ``[n_req, L / BS]``)."""
    nb = L // BS
    tables = torch.randperm(n_req * nb, generator=gen).view(n_req, nb)
    kt = torch.randn(n_req * nb, HKV, D, BS, generator=gen).bfloat16().to(dtype)
    v = torch.randn(n_req * nb, HKV, BS, D, generator=gen).bfloat16().to(dtype)
    return kt, v, tables


def gather(pool: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """``[NB, Hkv, BS, D]`` -> ``[S, Hkv, length, D]``: the runner's gather for the torch attention."""
    S, nb = tables.shape
    return pool[tables].transpose(1, 2).reshape(S, HKV, nb * BS, D)[:, :, :length]


def case_fns(
    n_rows: int,
    n_req: int,
    keys: int,
    native: native_attention.NativeAttention,
    blocking: bi.AttentionBlocking,
    kv_dtypes: tuple[torch.dtype, ...],
    sdpa: bool,
) -> dict[str, Callable[[], Any]]:
    gen = torch.Generator().manual_seed(0)
    L = bi.padded_keys(keys)
    kt32, v32, tables = paged(n_req, L, torch.float32, gen)
    q = torch.randn(n_req, n_rows, H, D, generator=gen)  # [S, n, H, D]
    first = keys - n_rows  # keys before the first new row
    req = torch.arange(n_req).repeat_interleave(n_rows)  # [T]
    nvis = (first + 1 + torch.arange(n_rows)).repeat(n_req)  # [T]
    qpos = first + torch.arange(n_rows)  # [n]
    masked = ~(torch.arange(L)[None, :] <= qpos[:, None])[None, None, None].expand(n_req, 1, 1, n_rows, L)
    flat = q.reshape(n_req * n_rows, H, D)
    fns: dict[str, Callable[[], Any]] = {}
    for dt in kv_dtypes:
        kt, v = kt32.to(dt), v32.to(dt)
        k = kt.transpose(2, 3)  # [NB, Hkv, BS, D] view, as the runner reads keys for the torch attention
        tag = "" if len(kv_dtypes) == 1 else f", {str(dt).removeprefix('torch.')} KV"
        fns["native" + tag] = functools.partial(native, flat, kt, v, tables, req, nvis, keys, D**-0.5)
        fns["torch ops" + tag] = functools.partial(
            lambda k, v: bi.attention(q, gather(k, tables, L), gather(v, tables, L), masked, D**-0.5, blocking), k, v
        )
    if sdpa:
        kc, vc = gather(kt32.transpose(2, 3), tables, keys), gather(v32, tables, keys)  # contiguous per request
        sdpa_mask = (torch.arange(keys)[None, :] <= qpos[:, None])[None, None]  # [1, 1, n, keys]
        fns["sdpa"] = lambda: F.scaled_dot_product_attention(
            q.transpose(1, 2), kc, vc, attn_mask=None if n_rows == 1 else sdpa_mask, enable_gqa=True
        )
    return fns


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-dtype-ab", action="store_true", help="fp32 KV against bf16 KV, native and torch ops")
    ap.add_argument("--budget-s", type=float, default=0.3, help="seconds of calls per arm per round")
    ap.add_argument("--native-only", action="store_true", help="A/B: time the native kernel's arms only")
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="one thread, timed on its own CPU clock (time.thread_time): on a busy machine the time the thread was "
        "descheduled does not count (caches and memory are still shared)",
    )
    args = ap.parse_args(argv)
    set_threads(1 if args.cpu_time else 2)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    native = native_attention.load()
    if native is None:
        print("no C compiler here: nothing to compare the torch-op attention with")
        return 1
    blocking = bi.probe_attention_blocking(D, torch.device("cpu"))
    kv_dtypes = (torch.float32, torch.bfloat16) if args.kv_dtype_ab else (torch.float32,)
    fns = {name: case_fns(n, s, keys, native, blocking, kv_dtypes, not args.kv_dtype_ab) for name, n, s, keys in CASES}
    arms = ("native",) if args.native_only else ("native", "torch ops")
    identical = {}
    if args.kv_dtype_ab:  # the promise first: a bf16 cache of bf16 values gives the fp32 cache's outputs
        for name, cell in fns.items():
            identical[name] = all(
                torch.equal(cell[f"{impl}, float32 KV"](), cell[f"{impl}, bfloat16 KV"]())
                for impl in ("native", "torch ops")
            )
            if args.native_only:
                fns[name] = {k: f for k, f in cell.items() if k.startswith("native")}
        print("bit-identical outputs, fp32 KV vs bf16 KV:", identical, flush=True)
    us: dict[str, dict[str, list[float]]] = {name: {} for name in fns}
    for rnd in range(args.rounds):
        for name, cell in fns.items():
            order = list(cell) if rnd % 2 == 0 else list(reversed(cell))
            for impl in order:
                us[name].setdefault(impl, []).append(time_us(cell[impl], args.budget_s, clock))
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    env = env_info()
    if args.kv_dtype_ab:
        impls = [f"{i}, {d} KV" for i in arms for d in ("float32", "bfloat16")]
        tag = {"native": "native", "torch ops": "torch"}
        rows = [
            {
                "case": name,
                **{impl: min(v) for impl, v in us[name].items()},
                # paired per round: bf16 KV time over fp32 KV time, the median of the rounds
                **{
                    f"{tag[i]}_bf16_over_fp32": statistics.median(
                        b / a for a, b in zip(us[name][f"{i}, float32 KV"], us[name][f"{i}, bfloat16 KV"])
                    )
                    for i in arms
                },
                "identical": identical[name],
            }
            for name in fns
        ]
        columns = [
            ("case", "case", "s"),
            *((impl, impl + " us (best)", ".1f") for impl in impls),
            *((f"{tag[i]}_bf16_over_fp32", f"{tag[i]} bf16/fp32 (paired median)", ".3f") for i in arms),
            ("identical", "identical", lambda b: "yes" if b else "NO"),
        ]
        title = f"One layer's attention, fp32 vs bf16 KV cache, best of {args.rounds} interleaved rounds"
        out, name = RESULTS_DIR / "attention_kv_dtype", "Attention over an fp32 vs a bf16 KV cache"
    else:
        impls = ["native", "torch ops", "sdpa"]
        rows = [
            {
                "case": name,
                **{impl: min(v) for impl, v in us[name].items()},
                "torch_over_native": min(us[name]["torch ops"]) / min(us[name]["native"]),
                "sdpa_over_native": min(us[name]["sdpa"]) / min(us[name]["native"]),
            }
            for name in fns
        ]
        columns = [
            ("case", "case", "s"),
            ("native", "native us", ".1f"),
            ("torch ops", "torch ops us", ".1f"),
            ("sdpa", "sdpa us", ".1f"),
            ("torch_over_native", "torch/native", ".2f"),
            ("sdpa_over_native", "sdpa/native", ".2f"),
        ]
        title = f"One layer's attention, best of {args.rounds} interleaved rounds"
        out, name = RESULTS_DIR / "attention_bench", "Invariant attention kernels"
    print(format_table(rows, columns, title=f"{title} ({env['cpu']})"))
    fig, axes = figure(ncols=1, width=12 if args.kv_dtype_ab else 10)
    bar_panel(
        axes[0],
        [r["case"] for r in rows],
        {impl: [r[impl] for r in rows] for impl in impls},
        title="one layer's attention (lower is better)",
        ylabel="us",
        fmt="{:.0f}",
    )
    result = {"env": env, "args": vars(args), "rows": rows, "raw_us": us}
    save_result(out, result, fig, title=name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
