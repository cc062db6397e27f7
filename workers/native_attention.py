"""The batch-invariant attention as one native call per layer (workers/kernels/invariant_attention.c).

Why: built from torch ops, an invariant attention pads every request's key axis to whole blocks,
masks, and adds ``P @ V`` block by block: about a dozen small ops per layer where SDPA makes one,
and work that grows with the longest request in the step. A decode step of one stream then pays
for dispatch, not arithmetic. The C kernel walks each query row's own visible keys once, in a
fixed order, so it is invariant by construction and does no masked work.

The kernel is compiled on first use with the machine's C compiler for the machine's own CPU
(``-march=native``: vector width is found at run time, never assumed) and cached under
``$XDG_CACHE_HOME/specserve`` keyed by the source, the flags and the CPU. Where no compiler is found,
:func:`load` returns ``None`` and the runner keeps the torch implementation
(workers/batch_invariant.py): also invariant, with other rounding, so every replica of one
deployment must make the same choice (``/v1/speculation/stats`` reports it as ``attention_kernel``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "invariant_attention.c"
# No -ffast-math: the compiler must neither reassociate a sum nor contract a multiply-add anywhere.
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared")
ENV_DISABLE = "SPECSERVE_NATIVE_ATTENTION"  # "0": always the torch implementation


def _cpu_key() -> str:
    """What ``-march=native`` compiles for: the CPU's model name and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specserve"


@functools.lru_cache(maxsize=1)
def load() -> "NativeAttention | None":
    """The compiled kernel, or ``None`` where it cannot be built (no compiler) or is turned off."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: batch-invariant attention runs as torch ops (slower)")
        return None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + cc.encode() + _cpu_key().encode()).hexdigest()[:16]
    lib = _cache_dir() / f"invariant_attention-{key}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                proc = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", str(out), "-lm"], capture_output=True, text=True)
                if proc.returncode != 0:
                    log.warning("invariant attention kernel did not compile, using torch ops:\n%s", proc.stderr[-2000:])
                    return None
                os.replace(out, lib)  # atomic: replicas starting together never load a half-written file
        return NativeAttention(ctypes.CDLL(str(lib)))
    except OSError as e:  # an unwritable cache, a library that does not load: the torch ops still work
        log.warning("invariant attention kernel unavailable (%s), using torch ops", e)
        return None


LANES = 16  # the kernel's key block (LANES in the C source): the key axis is a multiple of it
ROWS = 4  # query rows of one slot per tile (ROWS in the C source)


class NativeAttention:
    """``attention(q, kt_cache, v_cache, slots, nvis, max_nvis, scale)`` over the compiled kernel. Keys
    are cached transposed (``[slots, Hkv, D, L]``): see the C source for why."""

    def __init__(self, dll: ctypes.CDLL) -> None:
        fn = dll.invariant_attention
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [p, i64, p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_float, p, i64, ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._local = threading.local()  # scratch per thread: engines in one process may step concurrently

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D] fp32, each row's heads contiguous (any row stride)
        kt_cache: torch.Tensor,  # [slots, Hkv, D, L] fp32, contiguous: keys transposed
        v_cache: torch.Tensor,  # [slots, Hkv, L, D] fp32, contiguous
        slots: torch.Tensor,  # [T] int64: each query row's slot
        nvis: torch.Tensor,  # [T] int64: each query row's visible keys (its position + 1)
        max_nvis: int,  # max(nvis), known to the caller without reading the tensor
        scale: float,
    ) -> torch.Tensor:  # [T, H, D] fp32
        T, H, D = q.shape
        _, Hkv, _, L = kt_cache.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != D:
            raise ValueError("q must be fp32 with each row's heads contiguous")
        if not (kt_cache.is_contiguous() and v_cache.is_contiguous()
                and kt_cache.dtype == v_cache.dtype == torch.float32):
            raise ValueError("the key and value caches must be contiguous fp32")
        if slots.dtype != torch.int64 or nvis.dtype != torch.int64 or not (slots.is_contiguous() and nvis.is_contiguous()):
            raise ValueError("slots and nvis must be contiguous int64")
        threads = torch.get_num_threads()
        n_pad = -(-max_nvis // LANES) * LANES + 2 * LANES
        need = threads * ROWS * (H // Hkv) * n_pad
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < need:
            scratch = self._local.scratch = torch.empty(need, dtype=torch.float32)
        out = torch.empty(T, H, D, dtype=torch.float32)
        rc = self._fn(q.data_ptr(), q.stride(0), kt_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                      nvis.data_ptr(), out.data_ptr(), T, H, Hkv, D, L, scale, scratch.data_ptr(), n_pad,
                      threads)
        if rc != 0:
            raise ValueError(f"attention shapes outside the kernel: T={T} H={H} Hkv={Hkv} D={D} L={L} "
                             f"max visible keys {max_nvis}")
        return out
