"""Paired A/B, in process: the paged native attention (block tables) against the slot kernel it replaced.

Both kernels compute the same numbers (only the address of a key changes), so this measures only the
cost of reading keys through a block table. The slot kernel is built from ``git show <ref>:`` of its
sources. SmolLM2's attention shape (9 heads, 3 kv heads, head_dim 64), 30 layers' worth of calls per
"step" (each layer its own cache, as in the model), decode rows (1 query row per request), c requests
of ``ctx`` keys each. Paged: contiguous blocks, and blocks scattered at random over the pool. The
three variants run interleaved, round by round; reported: median per step and the spread (min-max) of
the per-round ratio to the slot kernel.

    python -m benchmarks.paged_attention_ab --ref main --ctx 512 --rounds 15
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from workers import native_attention as na

H, HKV, D, BS = 9, 3, 64, 16


def build_slot_kernel(ref: str) -> ctypes.CDLL:
    tmp = Path(tempfile.mkdtemp())
    for name in ("invariant_attention.c", "vec_math.h"):
        src = subprocess.run(
            ["git", "show", f"{ref}:workers/kernels/{name}"], capture_output=True, text=True, check=True
        ).stdout
        (tmp / name).write_text(src)
    out = tmp / "slot.so"
    subprocess.run(["cc", *na.FLAGS, str(tmp / "invariant_attention.c"), "-o", str(out), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        "?",
    )
    flags = set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split())
    print(
        f"CPU: {cpu}; avx512f={'avx512f' in flags} avx512_bf16={'avx512_bf16' in flags} "
        f"amx={'amx_tile' in flags}; torch {torch.get_num_threads()} threads; ctx {args.ctx}, {args.layers} layers"
    )

    lib = build_slot_kernel(args.ref)
    slot_fn = lib.invariant_attention
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    slot_fn.argtypes = [p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, p, i64, ctypes.c_int]
    paged = na.load()
    assert paged is not None
    gen = torch.Generator().manual_seed(0)
    L = args.ctx
    for c in (1, 16):
        nb = L // BS
        # slot layout: [c, Hkv, D, L] keys transposed, [c, Hkv, L, D] values, per layer
        kt_slot = [torch.randn(c, HKV, D, L, generator=gen) for _ in range(args.layers)]
        v_slot = [torch.randn(c, HKV, L, D, generator=gen) for _ in range(args.layers)]
        # the same KV in a block pool, contiguous tables and scattered tables
        contig = torch.arange(c * nb).view(c, nb)
        scat = torch.randperm(c * nb, generator=gen).view(c, nb)
        pools = {}
        for name, tab in (("contig", contig), ("scatter", scat)):
            kp, vp = [], []
            for kt, v in zip(kt_slot, v_slot):
                k = torch.empty(c * nb, HKV, D, BS)
                vv = torch.empty(c * nb, HKV, BS, D)
                k[tab.reshape(-1)] = kt.view(c, HKV, D, nb, BS).permute(0, 3, 1, 2, 4).reshape(-1, HKV, D, BS)
                vv[tab.reshape(-1)] = v.view(c, HKV, nb, BS, D).transpose(1, 2).reshape(-1, HKV, BS, D)
                kp.append(k.contiguous())
                vp.append(vv.contiguous())
            pools[name] = (tab.contiguous(), kp, vp)
        q = torch.randn(c, H, D, generator=gen)
        req = torch.arange(c)
        nvis = torch.full((c,), L)
        n_pad = -(-L // 16) * 16 + 32
        scratch = torch.empty(args.threads * 4 * (H // HKV) * n_pad)
        out = torch.empty(c, H, D)

        def run_slot() -> torch.Tensor:
            for kt, v in zip(kt_slot, v_slot):
                slot_fn(
                    q.data_ptr(),
                    q.stride(0),
                    kt.data_ptr(),
                    v.data_ptr(),
                    req.data_ptr(),
                    nvis.data_ptr(),
                    out.data_ptr(),
                    c,
                    H,
                    HKV,
                    D,
                    L,
                    D**-0.5,
                    scratch.data_ptr(),
                    n_pad,
                    args.threads,
                )
            return out.clone()

        def run_paged(name: str) -> torch.Tensor:  # the raw ctypes call, as for the slot kernel (no Python checks)
            tab, kp, vp = pools[name]
            for k, v in zip(kp, vp):
                paged._fn(
                    q.data_ptr(),
                    q.stride(0),
                    k.data_ptr(),
                    v.data_ptr(),
                    tab.data_ptr(),
                    tab.shape[1],
                    req.data_ptr(),
                    nvis.data_ptr(),
                    out.data_ptr(),
                    c,
                    H,
                    HKV,
                    D,
                    BS,
                    c * nb,
                    D**-0.5,
                    scratch.data_ptr(),
                    n_pad,
                    args.threads,
                )
            return out.clone()

        ref = run_slot()
        assert torch.equal(run_paged("contig"), ref) and torch.equal(run_paged("scatter"), ref), "not bit-identical"
        times: dict[str, list[float]] = {"slot": [], "contig": [], "scatter": []}
        for _ in range(args.rounds):
            for name in ("slot", "contig", "scatter"):
                t0 = time.perf_counter()
                run_slot() if name == "slot" else run_paged(name)
                times[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        best = {k: min(v) * 1e3 for k, v in times.items()}
        for name in ("contig", "scatter"):
            ratios = sorted(a / b for a, b in zip(times[name], times["slot"]))
            q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
            print(
                f"c={c:2d} {name:8s}: median {med[name]:7.3f} ms/step (slot {med['slot']:7.3f}), best "
                f"{best[name]:7.3f} (slot {best['slot']:7.3f}); paired ratio median {statistics.median(ratios):.3f}, "
                f"IQR {q1:.3f}-{q3:.3f}, range {ratios[0]:.3f}-{ratios[-1]:.3f} ({args.rounds} rounds)"
            )


if __name__ == "__main__":
    main()
