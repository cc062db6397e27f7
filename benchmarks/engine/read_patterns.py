"""How fast a core reads weights in the order a one-row GEMM reads them, against a plain sequential read.

    python -m benchmarks.engine.read_patterns [--rounds 11] [--mb 192] [--row-bytes 1152]

A one-row GEMM over a tile of four weight rows loads chunk j of each of the four rows, then chunk j + 1: in
the plain ``[N, K]`` layout four streams a row apart, in the tiled layout (NativeLinear.tile) one stream in
address order. This benchmark reads one huge-page buffer (past the caches) in those orders with the same
loads and adds, so the only difference is the order: a plain sequential read; four rows side by side (plain
layout); the same with a software prefetch of the tile two ahead into L2 (what the kernel did for plain
weights); and four rows side by side in the tiled layout (the chunks in address order). At 1 and 2 threads,
each arm's time per round paired with the sequential read's (``--rounds``, alternating order). A row is
``--row-bytes`` (1152: SmolLM2's 576 bf16). Compiles a small C file with the C compiler the kernels use.

Writes benchmarks/results/<--out>.{json,png}.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, bar_panel, env_info, figure, format_table, paired, progress, save_result
from workers import hugepages

SOURCE = r"""
#include <stdint.h>
#include <omp.h>
typedef float v16 __attribute__((vector_size(64)));
/* Reads tiles [0, tiles) of 4 rows of rb bytes, split between nt threads in contiguous halves; pattern 0: in
 * address order; 1: chunk j of the four rows side by side (plain layout); 2: 1 with a prefetch of the tile
 * two ahead into L2; 3: the four chunks j of the tiled layout (address order within the tile). */
float read_tiles(const char *p, int64_t tiles, int64_t rb, int pattern, int nt) {
    float out = 0;
#pragma omp parallel num_threads(nt) reduction(+ : out)
    {
        const int id = omp_get_thread_num(), n = omp_get_num_threads();
        v16 acc[4] = {{0}, {0}, {0}, {0}};
        for (int64_t t = tiles * id / n; t < tiles * (id + 1) / n; t++) {
            const char *b = p + t * 4 * rb;
            for (int64_t j = 0; j < rb; j += 64) {
                if (pattern == 2)
                    for (int c = 0; c < 4; c++) __builtin_prefetch(b + 8 * rb + 4 * j + 64 * c, 0, 2);
                for (int c = 0; c < 4; c++) {
                    const char *q = pattern == 1 || pattern == 2 ? b + c * rb + j : b + 4 * j + 64 * c;
                    acc[c] += *(const v16 *)q;
                }
            }
        }
        v16 s = acc[0] + acc[1] + acc[2] + acc[3];
        for (int l = 0; l < 16; l++) out += s[l];
    }
    return out;
}
"""
ARMS = {
    "sequential": 0,
    "4 rows side by side (plain)": 1,
    "plain + L2 prefetch 2 tiles ahead": 2,
    "4 rows side by side (tiled)": 3,
}


def build(tmp: Path) -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("read_patterns needs a C compiler")
    src, lib = tmp / "read_patterns.c", tmp / "read_patterns.so"
    src.write_text(SOURCE)
    subprocess.run([cc, "-O2", "-march=native", "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.read_tiles.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    dll.read_tiles.restype = ctypes.c_float
    return dll


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--mb", type=int, default=192, help="buffer size: past the last-level cache")
    ap.add_argument("--row-bytes", type=int, default=1152)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--out", default="read_patterns")
    args = ap.parse_args(argv)
    if args.row_bytes % 64:
        ap.error("--row-bytes: a multiple of 64")
    env = env_info()
    tiles = (args.mb << 20) // (4 * args.row_bytes)
    buf = hugepages.zeros((tiles * 4 * args.row_bytes + 16 * args.row_bytes,), torch.uint8, torch.device("cpu"))
    buf.fill_(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dll = build(Path(tmp))
        for nt in [int(t) for t in args.threads.split(",")]:
            times: dict[str, list[float]] = {a: [] for a in ARMS}
            for r in progress(range(args.rounds), desc=f"{nt} thread(s)"):
                for arm in ARMS if r % 2 == 0 else list(ARMS)[::-1]:
                    t0 = time.perf_counter()
                    dll.read_tiles(buf.data_ptr(), tiles, args.row_bytes, ARMS[arm], nt)
                    times[arm].append(time.perf_counter() - t0)
            nbytes = tiles * 4 * args.row_bytes
            for arm, v in times.items():
                p = paired(times["sequential"], v)
                rows.append(
                    {
                        "threads": nt,
                        "pattern": arm,
                        "gb_s": nbytes / statistics.median(v) / 1e9,
                        "time_x_sequential": p["ratio"],
                        "min": p["ratio_min"],
                        "max": p["ratio_max"],
                    }
                )
    print(
        format_table(
            rows,
            [
                ("threads", "threads", "d"),
                ("pattern", "pattern", "s"),
                ("gb_s", "GB/s", ".1f"),
                ("time_x_sequential", "time x sequential", ".3f"),
                ("min", "min", ".3f"),
                ("max", "max", ".3f"),
            ],
            title=f"{args.rounds} paired rounds over {args.mb} MB, rows of {args.row_bytes} bytes, tiles of 4 rows",
        )
    )
    fig, axes = figure(ncols=1, width=9)
    threads = sorted({r["threads"] for r in rows})
    bar_panel(
        axes[0],
        [f"{t} thread(s)" for t in threads],
        {
            arm: [next(r["gb_s"] for r in rows if r["threads"] == t and r["pattern"] == arm) for t in threads]
            for arm in ARMS
        },
        title="reading weights in a one-row GEMM's order",
        ylabel="GB/s",
        fmt="{:.1f}",
    )
    save_result(RESULTS_DIR / args.out, {"env": env, "args": vars(args), "rows": rows}, fig, title="read patterns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
