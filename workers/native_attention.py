"""The batch-invariant attention as one native call per layer (workers/kernels/invariant_attention.c),
and the layer's row-wise ops as three more (workers/kernels/invariant_layer.c).

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

The same library holds the residual add + RMSNorm, RoPE + cache write and SiLU * up of a layer
(:class:`NativeLayerOps`): as torch ops they are ~35 dispatches per layer, which at one row cost
about as much as the layer's GEMMs. Every output row is a function of its input row alone.

And a linear layer, ``x @ W^T`` on the ``[out, in]`` weight, plain or tiled (:class:`NativeLinear`,
workers/kernels/invariant_linear.c): every output is one fixed-order sum over ``in`` whatever the
row count, so it needs none of the row-count probing and padding a GEMM library needs
(workers/batch_invariant.py), and at a few rows it streams tiled weights like a plain read.
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
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from workers import hardware
from workers.step_index import StepIndex

log = logging.getLogger(__name__)

_T = TypeVar("_T")

_KERNELS = Path(__file__).parent / "kernels"
SOURCES = (
    _KERNELS / "invariant_attention.c",
    _KERNELS / "invariant_layer.c",
    _KERNELS / "invariant_linear.c",
    _KERNELS / "keyed_race.c",
)
# included by the sources: part of the cache key, not of the command
HEADERS = (_KERNELS / "vec_math.h", _KERNELS / "kernels.h")
# No -ffast-math: the compiler must neither reassociate a sum nor contract a multiply-add anywhere.
FLAGS: tuple[str, ...] = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp", "-fPIC", "-shared")
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
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, or ``None`` where they cannot be built (no compiler) or are turned off."""
    if os.environ.get(ENV_DISABLE, "1") == "0":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: batch-invariant attention and row-wise ops run as torch ops (slower)")
        return None
    src = b"".join(p.read_bytes() for p in SOURCES + HEADERS)
    key = hashlib.sha256(src + " ".join(FLAGS).encode() + cc.encode() + _cpu_key().encode()).hexdigest()[:16]
    lib = _cache_dir() / f"invariant_kernels-{key}.so"
    try:
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                out = Path(tmp) / lib.name
                proc = subprocess.run(
                    [cc, *FLAGS, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True
                )
                if proc.returncode != 0:
                    log.warning("native kernels did not compile, using torch ops:\n%s", proc.stderr[-2000:])
                    return None
                os.replace(out, lib)  # atomic: replicas starting together never load a half-written file
        return ctypes.CDLL(str(lib))
    except OSError as e:  # an unwritable cache, a library that does not load: the torch ops still work
        log.warning("native kernels unavailable (%s), using torch ops", e)
        return None


def _from_library(cls: Callable[[ctypes.CDLL], _T]) -> _T | None:
    """``cls`` over the compiled library, or ``None`` where it cannot be built or is turned off."""
    dll = _library()
    return cls(dll) if dll is not None else None


@functools.lru_cache(maxsize=1)
def load() -> NativeAttention | None:
    """The attention kernel, or ``None`` where the library cannot be built or is turned off."""
    return _from_library(NativeAttention)


@functools.lru_cache(maxsize=1)
def load_layer_ops() -> NativeLayerOps | None:
    """The layer's row-wise ops, from the same library as :func:`load` (``None`` exactly when it is)."""
    return _from_library(NativeLayerOps)


@functools.lru_cache(maxsize=1)
def load_linear() -> NativeLinear | None:
    """The batch-invariant linear, from the same library as :func:`load` (``None`` exactly when it is)."""
    return _from_library(NativeLinear)


@functools.lru_cache(maxsize=1)
def load_layers() -> NativeLayers | None:
    """Every decoder layer in one call, from the same library as :func:`load` (``None`` exactly when it is)."""
    return _from_library(NativeLayers)


def team_takeovers() -> int:
    """How many times, in this process, a kernel thread waiting on units that a preempted thread held has
    computed them again itself (the team's takeover: workers/kernels/kernels.h); 0 without the library."""
    dll = _library()
    if dll is None:
        return 0
    dll.team_takeovers.restype = ctypes.c_uint64
    return int(dll.team_takeovers())


def stall_kernel_thread(thread: int, phase: int, seconds: float) -> None:
    """For tests: kernel thread ``thread`` sleeps ``seconds`` while it holds its first claim of phase
    ``phase`` (from 1) of every parallel call, as a preemption there would; ``seconds`` 0 ends it."""
    dll = _library()
    if dll is None:
        raise RuntimeError("the native kernels are not loaded")
    dll.team_stall_at.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_double]
    dll.team_stall_at(thread, phase, seconds)


def build_for(march: str) -> None:
    """Build the kernels for ``-march=march`` instead of the host's (benchmarks: an older CPU's code path on this
    host's memory), from the next load on."""
    global FLAGS
    FLAGS = tuple(f"-march={march}" if f == "-march=native" else f for f in FLAGS)
    clear_cache()


def clear_cache() -> None:
    """Forget the loaded library, so the next :func:`load` looks again (tests toggle the environment)."""
    for f in (_library, load, load_layer_ops, load_linear, load_layers):
        f.cache_clear()


KV_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels store keys and values in


def _check_caches(kt_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Both kernels read and write the caches through raw pointers: contiguous, both fp32 or both bf16.
    Returns the kernels' ``kv_bf16`` flag."""
    if not (kt_cache.is_contiguous() and v_cache.is_contiguous() and kt_cache.dtype == v_cache.dtype in KV_DTYPES):
        raise ValueError("the key and value caches must be contiguous and both fp32 or both bf16")
    return int(kt_cache.dtype == torch.bfloat16)


LANES = 16  # the kernel's key block (LANES in the C source): a cache block holds a multiple of it
ROWS = 4  # query rows of one request per tile (ROWS in the C source)


def attention_scratch(threads: int, num_heads: int, num_kv_heads: int, max_nvis: int) -> tuple[int, int]:
    """``(n_pad, floats)``: the attention's score row length for ``max_nvis`` visible keys and the scratch
    its ``threads`` threads need (the C source's contract)."""
    n_pad = -(-max_nvis // LANES) * LANES + 2 * LANES
    return n_pad, threads * ROWS * (num_heads // num_kv_heads) * n_pad


@dataclass(frozen=True)
class BoundCaches:
    """Every layer's key and value cache, checked once: the kernels read them through raw pointers, and a
    runner's caches are fixed when it starts, so a step need not check them again."""

    ptrs: list[tuple[int, int]]  # per layer (kt_cache, v_cache) addresses
    num_blocks: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_bf16: int
    keep: list[torch.Tensor]  # the caches, alive while pointed to

    @classmethod
    def bind(cls, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> BoundCaches:
        """``kv_caches``: per layer ``(kt_cache [num_blocks, Hkv, D, BS], v_cache [num_blocks, Hkv, BS, D])``."""
        kt0, v0 = kv_caches[0]
        num_blocks, Hkv, D, BS = kt0.shape
        kv_bf16 = _check_caches(kt0, v0)
        for kt, v in kv_caches:
            if kt.shape != kt0.shape or v.shape != v0.shape or _check_caches(kt, v) != kv_bf16:
                raise ValueError("every layer's caches must have one shape and dtype")
        return cls(
            ptrs=[(kt.data_ptr(), v.data_ptr()) for kt, v in kv_caches],
            num_blocks=num_blocks,
            num_kv_heads=Hkv,
            head_dim=D,
            block_size=BS,
            kv_bf16=kv_bf16,
            keep=[t for pair in kv_caches for t in pair],
        )


class NativeAttention:
    """``attention(q, kt_cache, v_cache, block_table, req, nvis, max_nvis, scale)`` over the compiled kernel,
    reading a paged cache through each request's block table. Keys are cached transposed per block
    (``[num_blocks, Hkv, D, BS]``): see the C source for why."""

    def __init__(self, dll: ctypes.CDLL) -> None:
        fn = dll.invariant_attention
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        fn.argtypes = [
            p,
            i64,
            p,
            p,
            ctypes.c_int,
            p,
            i64,
            p,
            p,
            p,
            i64,
            i64,
            i64,
            i64,
            i64,
            i64,
            ctypes.c_float,
            p,
            i64,
            ctypes.c_int,
            p,
        ]
        fn.restype = ctypes.c_int
        self._fn = fn
        self._local = threading.local()  # scratch per thread: engines in one process may step concurrently

    def scratch(self, floats: int) -> torch.Tensor:
        """This thread's scratch of at least ``floats`` fp32 values (kept and grown, never shrunk)."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.numel() < floats:
            buf = self._local.scratch = torch.empty(floats, dtype=torch.float32)
            self._local.scratch_at = (floats, buf.data_ptr())
        return buf

    def scratch_at(self, floats: int) -> int:
        """The address of :meth:`scratch`'s buffer, found without a torch call while it is large enough."""
        kept = getattr(self._local, "scratch_at", None)
        if kept is None or kept[0] < floats:
            self.scratch(floats)
            kept = self._local.scratch_at
        return kept[1]

    def __call__(
        self,
        q: torch.Tensor,  # [T, H, D] fp32, each row's heads contiguous (any row stride)
        kt_cache: torch.Tensor,  # [num_blocks, Hkv, D, BS] fp32 or bf16, contiguous: keys transposed within a block
        v_cache: torch.Tensor,  # [num_blocks, Hkv, BS, D] kt_cache's dtype, contiguous
        block_table: torch.Tensor,  # [num_reqs, max_blocks] int64: block ids of each request's positions
        req: torch.Tensor,  # [T] int64: each query row's request (row of block_table)
        nvis: torch.Tensor,  # [T] int64: each query row's visible keys (its position + 1)
        max_nvis: int,  # max(nvis), known to the caller without reading the tensor
        scale: float,
    ) -> torch.Tensor:  # [T, H, D] fp32
        T, H, D = q.shape
        num_blocks, Hkv, _, BS = kt_cache.shape
        if q.dtype != torch.float32 or q.stride(2) != 1 or q.stride(1) != D:
            raise ValueError("q must be fp32 with each row's heads contiguous")
        kv_bf16 = _check_caches(kt_cache, v_cache)
        if not all(t.dtype == torch.int64 and t.is_contiguous() for t in (block_table, req, nvis)):
            raise ValueError("block_table, req and nvis must be contiguous int64")
        threads = torch.get_num_threads()
        n_pad, need = attention_scratch(threads, H, Hkv, max_nvis)
        scratch = self.scratch(need)
        out = torch.empty(T, H, D, dtype=torch.float32)
        rc = self._fn(
            q.data_ptr(),
            q.stride(0),
            kt_cache.data_ptr(),
            v_cache.data_ptr(),
            kv_bf16,
            block_table.data_ptr(),
            block_table.shape[1],
            req.data_ptr(),
            nvis.data_ptr(),
            out.data_ptr(),
            T,
            H,
            Hkv,
            D,
            BS,
            num_blocks,
            scale,
            scratch.data_ptr(),
            n_pad,
            threads,
            None,
        )
        if rc != 0:
            raise ValueError(
                f"attention shapes outside the kernel: T={T} H={H} Hkv={Hkv} D={D} block_size={BS} "
                f"max visible keys {max_nvis}, or a block id outside the pool of {num_blocks}"
            )
        return out


class NativeLayerOps:
    """A decoder layer's row-wise ops over the compiled kernels (workers/kernels/invariant_layer.c).
    Tensors are fp32 or bf16 (the model's dtype), contiguous unless said otherwise."""

    def __init__(self, dll: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._rms = dll.rms_norm
        self._rms.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, i32, i32]
        self._rope = dll.rope_kv
        self._rope.argtypes = [p, i64, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, i32, i32, i32]
        self._silu = dll.silu_mul
        self._silu.argtypes = [p, p, i64, i64, i32, i32]
        for fn in (self._rms, self._rope, self._silu):
            fn.restype = ctypes.c_int
        self._argmax = dll.argmax_rows
        self._argmax.argtypes = [p, i64, i64, p]
        self._argmax.restype = None
        self._uniforms = dll.keyed_uniforms_rows
        self._uniforms.argtypes = [p, i64, i64, p]
        self._uniforms.restype = None
        self._noise = dll.race_noise
        self._noise.argtypes = [p, p, i64]
        self._noise.restype = None
        self._exact_noise = dll.race_exact_noise
        self._exact_noise.argtypes = [p, p, i64]
        self._exact_noise.restype = None
        self._race = dll.keyed_race
        self._race.argtypes = [p, p, i64, i64, ctypes.c_float, i64, i32, p]
        self._race.restype = ctypes.c_int
        self._scaled_race = dll.scaled_race
        self._scaled_race.argtypes = [p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_double, i64, i32, p]
        self._scaled_race.restype = ctypes.c_int
        self._truncated_race = dll.truncated_race
        self._truncated_race.argtypes = [p, p, p, p, p, p, i64, i64, ctypes.c_double, ctypes.c_double, i32, p]
        self._truncated_race.restype = ctypes.c_int
        self._leading = dll.leading_candidates
        self._leading.argtypes = [p, i64, i64, p, p, i64, ctypes.POINTER(ctypes.c_int), p, ctypes.c_double,
                                  ctypes.POINTER(ctypes.c_int64)]  # fmt: skip
        self._leading.restype = i64

    def argmax(self, x: torch.Tensor) -> torch.Tensor:  # x: [R, V] float32 -> [R] int64
        """``x.argmax(dim=-1)``, the same indices (the first maximal one; the first NaN where a row has one)."""
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] == 0:
            raise ValueError("argmax: x must be a contiguous, non-empty [R, V] float32 tensor")
        out = torch.empty(x.shape[0], dtype=torch.long)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def keyed_uniforms(self, keys: list[int], vocab: int) -> torch.Tensor:  # -> [len(keys), vocab] float32
        """Row i: what a CPU ``torch.Generator`` seeded with ``keys[i]`` draws with ``uniform_`` (the same numbers)."""
        out = torch.empty(len(keys), vocab, dtype=torch.float32)
        k = _uint64s(keys)  # held until the call returns
        self._uniforms(ctypes.addressof(k), len(keys), vocab, out.data_ptr())
        return out

    def race_noise(self, u: torch.Tensor) -> torch.Tensor:  # [n] float32 -> [n] float32
        """The race's approximate noise ``-log(u + 2^-25)`` (within a relative 1e-6 of the exact one)."""
        return self._floats_map(self._noise, u, "race_noise")

    def race_exact_noise(self, u: torch.Tensor) -> torch.Tensor:  # [n] float32 -> [n] float32
        """The race's exact noise ``(float)-log((double)u + 2^-25)`` as the kernel computes it (-1 where it would
        leave the number to torch)."""
        return self._floats_map(self._exact_noise, u, "race_exact_noise")

    @staticmethod
    def _floats_map(fn: ctypes._CFuncPtr, u: torch.Tensor, name: str) -> torch.Tensor:  # type: ignore[name-defined]
        if u.dtype != torch.float32 or u.dim() != 1 or not u.is_contiguous():
            raise ValueError(f"{name}: u must be a contiguous 1-D float32 tensor")
        out = torch.empty_like(u)
        fn(u.data_ptr(), out.data_ptr(), u.numel())
        return out

    def keyed_race(
        self,
        p: torch.Tensor,  # [R, V] float32 contiguous processed probabilities
        keys: list[int],  # [R] position keys
        margin: float,
        cap: int,
    ) -> list[int]:  # [R] each row's token, -1 where the definition must decide
        """Each row's exponential race on its keyed noise (``keyed_race`` in workers/kernels/keyed_race.c)."""
        if p.dtype != torch.float32 or p.dim() != 2 or not p.is_contiguous() or len(keys) != p.shape[0]:
            raise ValueError("keyed_race: p must be a contiguous [R, V] float32 tensor with one key per row")
        rows, vocab = p.shape
        tokens = array("q", bytes(8 * rows))
        k = _uint64s(keys)  # held until the call returns
        threads = torch.get_num_threads()
        if self._race(p.data_ptr(), ctypes.addressof(k), rows, vocab, margin, cap, threads, tokens.buffer_info()[0]):
            raise MemoryError("keyed_race: no memory for its buffers")
        return tokens.tolist()

    @staticmethod
    def _raced_rows(name: str, x: torch.Tensor, rows: list[int], *per_row: list) -> array:
        """The rows a race call reads, checked: x a contiguous [N, V] float32 tensor, each row one of its, and one
        value of each per-row list per row."""
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous():
            raise ValueError(f"{name}: x must be a contiguous [N, V] float32 tensor")
        if any(len(v) != len(rows) for v in per_row) or any(not 0 <= r < x.shape[0] for r in rows):
            raise ValueError(f"{name}: one value of each parameter per row, each row one of x's")
        return array("q", rows)

    def scaled_race(
        self,
        x: torch.Tensor,  # [N, V] float32 contiguous raw logits
        rows: list[int],  # [R] the rows of x to race
        temps: list[float],  # [R] float32 values, each > 0: the divisors of the rows' logits
        keys: list[int],  # [R] position keys
        margin: float,
        guard: float,
        cap: int,
    ) -> list[int]:  # [R] each row's token, -1 where the definition must decide
        """Each listed row's exponential race on ``softmax(x / t)`` from its logits (``scaled_race`` in
        workers/kernels/keyed_race.c)."""
        row_ids = self._raced_rows("scaled_race", x, rows, temps, keys)
        n = len(rows)
        tokens = array("q", bytes(8 * n))
        t = array("f", temps)
        k = _uint64s(keys)  # held until the call returns
        threads = torch.get_num_threads()
        failed = self._scaled_race(
            x.data_ptr(), row_ids.buffer_info()[0], t.buffer_info()[0], ctypes.addressof(k), n, x.shape[1], margin,
            guard, cap, threads, tokens.buffer_info()[0],
        )  # fmt: skip
        if failed:
            raise MemoryError("scaled_race: no memory for its buffers")
        return tokens.tolist()

    def truncated_race(
        self,
        x: torch.Tensor,  # [N, V] float32 contiguous raw logits
        rows: list[int],  # [R] the rows of x to race
        temps: list[float],  # [R] float32 values, each > 0
        top_k: list[int],  # [R] 0: off
        top_p: list[float],  # [R] float32 values, 1: off
        keys: list[int],  # [R] position keys
        guard: float,
        mass_guard: float,
    ) -> list[int]:  # [R] each row's token, -1 where the definition must decide
        """Each listed row's race on ``process_logits``' truncated row, from its logits (``truncated_race`` in
        workers/kernels/keyed_race.c)."""
        row_ids = self._raced_rows("truncated_race", x, rows, temps, top_k, top_p, keys)
        n = len(rows)
        tokens = array("q", bytes(8 * n))
        t, k_, p_ = array("f", temps), array("q", top_k), array("d", top_p)
        k = _uint64s(keys)  # held until the call returns
        failed = self._truncated_race(
            x.data_ptr(), row_ids.buffer_info()[0], t.buffer_info()[0], k_.buffer_info()[0], p_.buffer_info()[0],
            ctypes.addressof(k), n, x.shape[1], guard, mass_guard, torch.get_num_threads(), tokens.buffer_info()[0],
        )  # fmt: skip
        if failed:
            raise MemoryError("truncated_race: no memory for its buffers")
        return tokens.tolist()

    def leading_candidates(
        self,
        x: torch.Tensor,  # [V] float32 scaled logits
        c: int,
        mass: torch.Tensor | None = None,  # [V] float32 each token's probability, for top-p
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, bool, int]:  # ids [n] int64, every, keep
        """The ids of every finite logit at least the ``c``-th largest finite one (ties included), ordered by logit
        descending then id; whether that is every finite logit (the row has at most ``c``); and with ``mass``, how
        many of them top-p keeps (-1: more candidates are needed to say)."""
        if x.dtype != torch.float32 or x.dim() != 1 or not x.is_contiguous() or c < 1:
            raise ValueError("leading_candidates: x must be a contiguous 1-D float32 tensor and c >= 1")
        vocab = x.numel()
        if mass is not None and (mass.dtype != torch.float32 or mass.shape != x.shape or not mass.is_contiguous()):
            raise ValueError("leading_candidates: mass must be a contiguous float32 tensor shaped as x")
        heap = torch.empty(min(c, vocab), dtype=torch.float32)
        cap = min(vocab, 4 * c)
        every, keep = ctypes.c_int(0), ctypes.c_int64(0)
        mass_at = mass.data_ptr() if mass is not None else None
        while True:
            ids = torch.empty(cap, dtype=torch.long)
            n = self._leading(
                x.data_ptr(), vocab, min(c, vocab), heap.data_ptr(), ids.data_ptr(), cap, every, mass_at, top_p, keep
            )
            if n >= 0:
                return ids[:n], bool(every.value), keep.value if mass is not None else n
            cap = vocab  # more ties at the threshold than room: every token fits

    @staticmethod
    def _bf16(*ts: torch.Tensor) -> int:
        dt = ts[0].dtype
        if dt not in (torch.float32, torch.bfloat16) or any(t.dtype != dt or not t.is_contiguous() for t in ts):
            raise ValueError("tensors must be contiguous and all fp32 or all bf16")
        return int(dt == torch.bfloat16)

    def add_rms_norm(
        self,
        h: torch.Tensor,  # [T, n] the residual stream, updated in place when delta is given
        delta: torch.Tensor | None,  # [T, n] added to h first, or None
        weight: torch.Tensor,  # [n]
        out: torch.Tensor,  # [T, n] the normalized rows
        eps: float,
    ) -> torch.Tensor:
        T, n = h.shape
        bf16 = self._bf16(h, weight, out, *(() if delta is None else (delta,)))
        if out.shape != h.shape or weight.shape != (n,) or (delta is not None and delta.shape != h.shape):
            raise ValueError("rms_norm shapes disagree")
        self._rms(
            h.data_ptr(),
            None if delta is None else delta.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            T,
            n,
            eps,
            bf16,
            torch.get_num_threads(),
        )
        return out

    def rope_kv(
        self,
        qkv: torch.Tensor,  # [T, (H + 2 Hkv) * D] the fused projection
        positions: torch.Tensor,  # [T] int64: RoPE positions
        kv_index: torch.Tensor,  # [T] int64: block * BS + offset where each row's key and value go
        cos: torch.Tensor,  # [max_len, D]
        sin: torch.Tensor,  # [max_len, D]
        kt_cache: torch.Tensor,  # [num_blocks, Hkv, D, BS] fp32 or bf16: keys at (block, :, :, offset), transposed
        v_cache: torch.Tensor,  # [num_blocks, Hkv, BS, D] kt_cache's dtype: values written at (block, :, offset)
        num_heads: int,
    ) -> torch.Tensor:  # [T, H, D] fp32: the rotated queries
        T = qkv.shape[0]
        num_blocks, Hkv, D, BS = kt_cache.shape
        bf16 = self._bf16(qkv, cos, sin)
        if qkv.shape[1] != (num_heads + 2 * Hkv) * D or cos.shape[1] != D or sin.shape != cos.shape:
            raise ValueError("rope_kv shapes disagree")
        kv_bf16 = _check_caches(kt_cache, v_cache)
        if not (
            positions.dtype == kv_index.dtype == torch.int64 and positions.is_contiguous() and kv_index.is_contiguous()
        ):
            raise ValueError("positions and kv_index must be contiguous int64")
        q = torch.empty(T, num_heads, D, dtype=torch.float32)
        rc = self._rope(
            qkv.data_ptr(),
            qkv.stride(0),
            positions.data_ptr(),
            kv_index.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            q.data_ptr(),
            kt_cache.data_ptr(),
            v_cache.data_ptr(),
            T,
            num_heads,
            Hkv,
            D,
            BS,
            num_blocks,
            cos.shape[0],
            bf16,
            kv_bf16,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(
                f"rope_kv: a position outside 0..{cos.shape[0] - 1}, a cache index outside the pool "
                f"of {num_blocks} blocks, or head_dim {D} unsupported"
            )
        return q

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, 2 I]`` (gate, up) -> ``[T, I]`` silu(gate) * up, into ``out`` when given (the first rows of a
        preallocated, zero-padded GEMM input)."""
        T, two_i = gu.shape
        if out is None:
            out = torch.empty(T, two_i // 2, dtype=gu.dtype)
        elif out.shape != (T, two_i // 2):
            raise ValueError("silu_mul: out must be [T, I]")
        bf16 = self._bf16(gu, out)
        self._silu(gu.data_ptr(), out.data_ptr(), T, two_i // 2, bf16, torch.get_num_threads())
        return out


def streams_past_caches(weight_bytes: int) -> bool:
    """Whether a step's weights, read once each, exceed the last-level cache: then every step reads them from
    memory whatever is done, and the GEMMs prefetch them into L2 (``stream``), where a core can have more misses
    in flight than into L1. False where the cache size is unknown."""
    llc = hardware.last_level_cache_bytes()
    return llc is not None and weight_bytes > llc


TILE_ROWS = 4  # NR in invariant_linear.c: the weight rows of one tile
CHUNK_BYTES = 64  # the bytes of one row a tiled weight keeps together (one cache line)
ENV_TILED = "SPECSERVE_TILED_WEIGHTS"  # "0": runners keep their weights plain (for paired measurements)


def linear_shape(w: torch.Tensor) -> tuple[int, int]:
    """``(N, K)`` of a linear weight, plain ``[N, K]`` or tiled ``[N / 4, K / ck, 4, ck]`` (NativeLinear.tile)."""
    if w.dim() == 4:
        return w.shape[0] * w.shape[2], w.shape[1] * w.shape[3]
    return w.shape[0], w.shape[1]


class NativeLinear:
    """``linear(x, w)``: ``x [M, K] @ w [N, K]^T -> [M, N]`` over the compiled kernel, fp32 or bf16 (fp32 sums,
    a bf16 result rounded to nearest even as torch rounds). A row's result is bit-identical whatever ``M``,
    the rows beside it, the thread count and ``w``'s layout, plain or tiled (workers/kernels/invariant_linear.c)."""

    def __init__(self, dll: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = dll.invariant_linear
        self._fn.argtypes = [p, p, p, i64, i64, i64, i32, i32, i32, i32]
        self._fn.restype = ctypes.c_int
        self._tile = dll.tile_weights
        self._tile.argtypes = [p, p, i64, i64, i32]
        self._tile.restype = ctypes.c_int
        wins = dll.tiled_layout_wins
        wins.argtypes, wins.restype = [i32], ctypes.c_int
        self._tiled_wins = {dt: bool(wins(int(dt == torch.bfloat16))) for dt in (torch.float32, torch.bfloat16)}

    @staticmethod
    def can_tile(w: torch.Tensor) -> bool:
        """Whether a plain ``[N, K]`` weight has a tiled layout: whole tiles of rows and whole 64-byte chunks."""
        ck = CHUNK_BYTES // w.element_size()
        return w.dim() == 2 and w.shape[0] % TILE_ROWS == 0 and w.shape[1] % ck == 0

    def tiles(self, w: torch.Tensor) -> bool:
        """Whether a runner should store ``w`` tiled: it can be, this build's GEMMs read its dtype faster tiled
        (``tiled_layout_wins`` in invariant_linear.c), and ``SPECSERVE_TILED_WEIGHTS=0`` does not keep it plain."""
        return os.environ.get(ENV_TILED, "1") != "0" and self._tiled_wins.get(w.dtype, False) and self.can_tile(w)

    def tile(self, w: torch.Tensor) -> torch.Tensor:
        """``w`` ([N, K] fp32 or bf16, :meth:`can_tile`) in the layout a GEMM reads in address order:
        ``[N / 4, K / ck, 4, ck]``, ck = 64 bytes of elements, tile t's four rows interleaved chunk by chunk.

        Why: a one-row GEMM reads the four rows of a tile side by side; in the plain layout those are four
        streams a row apart, which the hardware prefetchers follow poorly, and the kernel had to prefetch
        them itself. Tiled, the same loads are one stream in address order. The products and their order
        are unchanged: the same bits (docs/benchmarks.md#decode_floor)."""
        if not (self.can_tile(w) and w.is_contiguous() and w.dtype in (torch.float32, torch.bfloat16)):
            raise ValueError(
                f"tile: a contiguous fp32 or bf16 [N, K] weight, N a multiple of 4, rows of whole 64-byte chunks; "
                f"got {tuple(w.shape)}"
            )
        N, K = w.shape
        ck = CHUNK_BYTES // w.element_size()
        out = torch.empty(N // TILE_ROWS, K // ck, TILE_ROWS, ck, dtype=w.dtype)
        if self._tile(w.data_ptr(), out.data_ptr(), N, K, int(w.dtype == torch.bfloat16)) != 0:
            raise ValueError("tile: shape refused")
        return out

    def __call__(
        self,
        x: torch.Tensor,  # [M, K] fp32 or bf16 (made contiguous if it is not)
        w: torch.Tensor,  # [N, K] x's dtype, contiguous, or tiled (:meth:`tile`)
        out: torch.Tensor | None = None,  # [M, N] x's dtype, contiguous: written in place when given
        stream: bool = False,  # w is read from memory each call (larger than the caches): prefetch it into L2
    ) -> torch.Tensor:  # [M, N]
        # A decode step makes ~120 of these calls: every check here is one attribute read or comparison.
        xs, dt = x.shape, x.dtype
        ws: tuple[int, ...] = tuple(w.shape)
        tiled = len(ws) == 4
        if tiled:
            if ws[2] != TILE_ROWS or ws[3] * w.element_size() != CHUNK_BYTES:
                raise ValueError(f"linear: a 4-d weight must be tiled [N / 4, K / ck, 4, ck], got {ws}")
            ws = (ws[0] * ws[2], ws[1] * ws[3])
        if len(xs) != 2 or len(ws) != 2 or xs[1] != ws[1]:
            raise ValueError(f"linear: x {tuple(xs)} and weight {tuple(ws)} do not multiply")
        if dt is not w.dtype or (dt is not torch.bfloat16 and dt is not torch.float32) or not w.is_contiguous():
            raise ValueError("linear: x and a contiguous weight, both fp32 or both bf16")
        if not x.is_contiguous():
            x = x.contiguous()
        M, K = xs
        N = ws[0]
        if out is None:
            out = torch.empty((M, N), dtype=dt)
        elif out.shape != (M, N) or out.dtype is not dt or not out.is_contiguous():
            raise ValueError(f"linear: out must be a contiguous [{M}, {N}] {dt} tensor")
        if K == 0:
            out.zero_()
        elif M and N:
            bf16, threads = dt is torch.bfloat16, torch.get_num_threads()
            self._fn(x.data_ptr(), w.data_ptr(), out.data_ptr(), M, N, K, bf16, stream, tiled, threads)
        return out


class NativeStep:
    """One forward's native calls, their arguments checked and converted once for every layer.

    Why: a one-row decode step makes about five native calls per layer, and checking shapes, dtypes and
    contiguity and allocating each output in every call costs more than the call's arithmetic. Here
    the step's index tensors and the output buffers are checked and made once (the caches once per
    runner, :class:`BoundCaches`); each call then passes raw pointers. The tensors a call is given are the
    runner's own (its GEMM outputs, its caches, its weights), whose layout the runner guarantees.
    """

    def __init__(
        self,
        ops: NativeLayerOps,
        attn: NativeAttention,
        dtype: torch.dtype,  # the model's: the residual stream, norms, GEMM inputs and outputs
        caches: BoundCaches,
        num_heads: int,
        positions: torch.Tensor,  # [T] int64
        kv_index: torch.Tensor,  # [T] int64
        cos: torch.Tensor,  # [max_len, D] dtype
        sin: torch.Tensor,
        block_table: torch.Tensor,  # [num_reqs, max_blocks] int64
        req: torch.Tensor,  # [T] int64
        nvis: torch.Tensor,  # [T] int64
        max_nvis: int,
        scale: float,
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("the model's dtype must be fp32 or bf16")
        _check_index(positions, kv_index, block_table, req, nvis)
        D = caches.head_dim
        _check_rope_tables(cos, sin, dtype, D)
        T, H, Hkv = positions.shape[0], num_heads, caches.num_kv_heads
        self.T, self.H, self.Hkv, self.D, self.bf16 = T, H, Hkv, D, int(dtype == torch.bfloat16)
        self.threads = torch.get_num_threads()
        self._ops, self._attn, self._caches = ops, attn, caches
        self.q = torch.empty(T, H, D, dtype=torch.float32)  # the rotated queries
        self.o32 = torch.empty(T, H, D, dtype=torch.float32)  # attention's output
        self.o = self.o32.view(T, H * D) if dtype == torch.float32 else torch.empty(T, H * D, dtype=dtype)
        n_pad, need = attention_scratch(self.threads, H, Hkv, max_nvis)
        scratch = attn.scratch(need)
        self._keep = (positions, kv_index, cos, sin, block_table, req, nvis, scratch)  # alive while pointed to
        # the arguments of every call but the per-layer pointers, in the C functions' order
        BS, nb, o_bf16 = caches.block_size, caches.num_blocks, None if dtype == torch.float32 else self.o.data_ptr()
        self._rope_args = (positions.data_ptr(), kv_index.data_ptr(), cos.data_ptr(), sin.data_ptr(), self.q.data_ptr())
        self._rope_tail = (T, H, Hkv, D, BS, nb, cos.shape[0], self.bf16, caches.kv_bf16, self.threads)
        self._attn_args: tuple[int | float | None, ...] = (
            *(block_table.data_ptr(), block_table.shape[1], req.data_ptr(), nvis.data_ptr(), self.o32.data_ptr()),
            *(T, H, Hkv, D, BS, nb, scale, scratch.data_ptr(), n_pad, self.threads, o_bf16),
        )
        self._max_nvis = max_nvis

    def add_rms_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
    ) -> None:
        """As :meth:`NativeLayerOps.add_rms_norm`; ``h``, ``delta``, ``out``: [T, hidden], ``weight``: [hidden]."""
        n = h.shape[1]
        self._ops._rms(
            h.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(),
            self.T, n, eps, self.bf16, self.threads,
        )  # fmt: skip

    def rope_kv(self, qkv: torch.Tensor, layer: int) -> torch.Tensor:
        """As :meth:`NativeLayerOps.rope_kv` into layer ``layer``'s caches; returns :attr:`q`."""
        kt, v = self._caches.ptrs[layer]
        rc = self._ops._rope(qkv.data_ptr(), qkv.stride(0), *self._rope_args, kt, v, *self._rope_tail)
        if rc != 0:
            raise ValueError(
                f"rope_kv: a position or cache index outside the tables or the {self._caches.num_blocks}-block pool"
            )
        return self.q

    def attention(self, layer: int) -> torch.Tensor:
        """Attention of :attr:`q` over layer ``layer``'s caches: ``[T, H * D]`` in the model's dtype (:attr:`o`)."""
        kt, v = self._caches.ptrs[layer]
        rc = self._attn._fn(self.q.data_ptr(), self.q.stride(0), kt, v, self._caches.kv_bf16, *self._attn_args)
        if rc != 0:
            raise ValueError(
                f"attention shapes outside the kernel (max visible keys {self._max_nvis}), or a block id outside "
                f"the pool of {self._caches.num_blocks}"
            )
        return self.o

    def silu_mul(self, gu: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """As :meth:`NativeLayerOps.silu_mul` into ``out`` ([T, I], the model's dtype)."""
        self._ops._silu(gu.data_ptr(), out.data_ptr(), self.T, gu.shape[1] // 2, self.bf16, self.threads)
        return out


def _check_rope_tables(cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype, head_dim: int) -> None:
    if cos.dtype != dtype or sin.dtype != dtype or cos.shape != sin.shape or cos.shape[1] != head_dim:
        raise ValueError("cos and sin must be [max_len, head_dim] in the model's dtype")


def _check_index(*ts: torch.Tensor) -> None:
    if not all(t.dtype == torch.int64 and t.is_contiguous() for t in ts):
        raise ValueError("positions, kv_index, block_table, req and nvis must be contiguous int64")


# The phases of a layer in the fused forward, in order, then the head's: what NativeLayers.profile accumulates.
# In a step where every request has one row (a decode step), each attention item ropes its own heads: rope_kv's
# time is inside attention's then.
PHASES: tuple[str, ...] = ("rms_norm", "gemm qkv", "rope_kv", "attention", "gemm o", "rms_norm post")
PHASES += ("gemm gate_up", "silu_mul", "gemm down", "rms_norm final", "gemm lm_head")  # the last two: the head


_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class _LayersArgs(ctypes.Structure):
    """``invariant_layers``' parameters as one block (``layers_args`` in invariant_layer.c, the same order): a
    bound runner keeps one per row count, filled once, and sets the few that change before each call."""

    _fields_ = [
        *[(n, _P) for n in ("h", "w", "kt", "v")],
        ("L", _I64),
        *[(n, _P) for n in ("pos", "kv_index", "cos", "sin")],
        ("max_len", _I64),
        ("block_table", _P),
        ("bt_stride", _I64),
        ("req", _P),
        ("nvis", _P),
        ("scale", _F32),
        ("scratch", _P),
        ("n_pad", _I64),
        *[(n, _P) for n in ("x", "qkv", "q", "o32", "o", "delta", "gu", "act")],
        *[(n, _I64) for n in ("T", "hidden", "H", "Hkv", "D", "I", "BS", "num_blocks")],
        ("eps", _F32),
        *[(n, _I32) for n in ("bf16", "kv_bf16", "nthreads")],
        ("ws", _P),
        ("ws_bytes", _I64),
        ("stream", _I32),
        ("tiled", _I32),
        ("embed", _P),
        ("ids", _P),
        ("vocab", _I64),
        ("rows", _P),
        ("M", _I64),
        *[(n, _P) for n in ("norm_w", "W_head", "hs", "logits")],
        ("V", _I64),
        ("logits_f32", _P),
        ("argmax", _P),
    ]


class NativeLayers:
    """Every decoder layer of a forward as one native call (``invariant_layers`` in
    workers/kernels/invariant_layer.c), for a runner whose GEMMs are all the native linear kernel.

    Why: with every GEMM native, a layer is nine native calls; made from Python they cost a few
    microseconds each in argument handling, and opening a parallel region per call costs as much again at
    one row. The C function runs them in one parallel region with the same per-output computations, so the
    result is bit-identical to making them one by one. A runner binds its weights and caches once
    (:meth:`bind`); a step passes its packed index (:class:`~workers.step_index.StepIndex`).
    """

    def __init__(self, dll: ctypes.CDLL) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        dll.layers_args_bytes.argtypes, dll.layers_args_bytes.restype = [], i64
        if dll.layers_args_bytes() != ctypes.sizeof(_LayersArgs):
            raise RuntimeError("the library's layers_args and _LayersArgs disagree: rebuild both from one source")
        fn = dll.invariant_layers_packed
        fn.argtypes, fn.restype = [p], ctypes.c_int  # a _LayersArgs' address
        self._fn = fn
        self._steps = dll.invariant_layers_steps
        self._steps.argtypes, self._steps.restype = [p, i64, p], i64  # args, steps, [steps, M] int64 tokens
        self._advance = dll.invariant_layers_advance
        self._advance.argtypes, self._advance.restype = [p, p], ctypes.c_int  # args, [M] int64 tokens
        self._steps_sampled = dll.invariant_layers_steps_sampled
        self._steps_sampled.argtypes = [p, i64, p, p, p, p, p, p, ctypes.c_float, ctypes.c_double, ctypes.c_double,
                                        i64, p, ctypes.POINTER(ctypes.c_int)]  # fmt: skip
        self._steps_sampled.restype = i64
        self._workspace_bytes = dll.layers_workspace_bytes
        self._workspace_bytes.argtypes = [i64] * 7 + [i32, i32]
        self._workspace_bytes.restype = i64
        self._profile = dll.layers_profile
        self._profile.argtypes = [p]
        self._profile.restype = None

    def profile(self, acc: torch.Tensor | None) -> None:
        """Accumulate each phase's wall time (seconds, thread 0's clock from phase end to phase end) into ``acc``
        ([len(PHASES)] float64, kept alive by the caller) on every fused forward, or stop (None)."""
        if acc is not None and (acc.dtype != torch.float64 or acc.shape != (len(PHASES),) or not acc.is_contiguous()):
            raise ValueError(f"the profile takes a contiguous [{len(PHASES)}] float64 tensor")
        self._profile(None if acc is None else acc.data_ptr())

    def bind(
        self,
        layers: list[dict[str, torch.Tensor]],  # per layer in_norm, qkv, o, post_norm, gate_up, down: contiguous
        caches: BoundCaches,
        cos: torch.Tensor,  # [max_len, D] the model's dtype
        sin: torch.Tensor,
        num_heads: int,
        eps: float,
        attn: NativeAttention,  # whose scratch the attention phase uses
        norm_w: torch.Tensor,  # [hidden] the final norm's weight
        lm_head: torch.Tensor,  # [V, hidden] the LM head rows a step computes
        stream: bool | None = None,  # prefetch the weights into L2; None: when they exceed the last-level cache
        embed: torch.Tensor | None = None,  # [vocab, hidden] the token embeddings (BoundLayers.forward)
    ) -> BoundLayers:
        return BoundLayers(
            self._fn, self._workspace_bytes, layers, caches, cos, sin, num_heads, eps, attn,
            norm_w, lm_head, stream, embed, self._steps, self._advance, self._steps_sampled,
        )  # fmt: skip


@dataclass
class _Buffers:
    """The fused forward's intermediates for one row count (see invariant_layers)."""

    h: torch.Tensor  # [T, hidden] the residual stream of a forward that starts from token ids
    x: torch.Tensor  # [T, hidden] the normalized rows each GEMM reads
    qkv: torch.Tensor  # [T, (H + 2 Hkv) D]
    q: torch.Tensor  # [T, H D] fp32, the rotated queries
    o32: torch.Tensor  # [T, H D] fp32, attention's output
    o: torch.Tensor  # [T, H D] the model's dtype: the o projection's input (o32 itself in fp32)
    delta: torch.Tensor  # [T, hidden] the last GEMM's output
    gu: torch.Tensor  # [T, 2 I]
    act: torch.Tensor  # [T, I]
    ws: torch.Tensor | None  # [bytes] uint8: the layers' ring of intermediates (a few rows), or None
    args: _LayersArgs  # the fused call's arguments for this row count: every one that does not change per step
    args_at: int  # its address, the call's one argument
    h_at: int  # h's address


@dataclass
class _Head:
    """The head's outputs for M rows (see BoundLayers.forward), with the addresses the fused call writes them at."""

    hs: torch.Tensor  # [M, hidden] the model's dtype: the final norm at the logits rows
    logits: torch.Tensor  # [M, V] fp32
    staged: torch.Tensor  # [M, V] where the kernel writes the logits in the model's dtype (a bf16 model's; else logits)
    argmax: array  # [M] int64, read as Python ints without a torch op
    ptrs: tuple[int, int, int | None, int]  # hs, staged, logits (None: the staged ones are the logits), argmax

    @staticmethod
    def new(M: int, hidden: int, V: int, dtype: torch.dtype, staged: torch.Tensor | None = None) -> _Head:
        """Fresh outputs; a bf16 model's logits staged in ``staged`` where given ([M, V] bf16, reused)."""
        hs, logits, argmax = torch.empty(M, hidden, dtype=dtype), torch.empty(M, V), array("q", bytes(8 * M))
        if dtype == torch.float32:
            staged = logits
        elif staged is None:
            staged = torch.empty(M, V, dtype=dtype)
        f32 = None if staged is logits else logits.data_ptr()
        return _Head(hs, logits, staged, argmax, (hs.data_ptr(), staged.data_ptr(), f32, argmax.buffer_info()[0]))


def _uint64s(values: list[int]) -> ctypes.Array[ctypes.c_uint64]:
    """Python ints (keys, seeds: any sign or size) as the uint64s C reads: their low 64 bits."""
    return (ctypes.c_uint64 * len(values))(*(v & 0xFFFFFFFFFFFFFFFF for v in values))


@dataclass(frozen=True)
class RowRaces:
    """How a run of native decode steps picks each row's token (``BoundLayers.decode_steps``): a row with
    ``temps[r] > 0`` the exponential race on ``softmax(logits / temps[r])`` (truncated by its top-k and top-p)
    keyed by its output position ``first_positions[r] + step`` of seed ``seeds[r]``, the others their argmax
    (``sampler.row_races`` builds it)."""

    temps: list[float]  # [M] float32 values; 0: greedy
    top_k: list[int]  # [M] 0: off
    top_p: list[float]  # [M] float32 values; 1: off
    seeds: list[int]  # [M]
    first_positions: list[int]  # [M] the output position of the run's first token
    margin: float
    guard: float
    mass_guard: float
    cap: int


class BoundLayers:
    """One runner's layers bound to the fused call: weights, caches and tables as pointer arrays made once."""

    MAX_SHAPES = 16  # row counts whose buffers are kept (a decode step's few, a prefill chunk's)
    # The largest workspace for the layers' ring of intermediates (each layer writes its own slot): a decode
    # or verify step's few rows get one, so that a thread waiting on a preempted one can compute its units
    # again (see invariant_layers); a prefill chunk's many rows share one set of buffers.
    WORKSPACE_BYTES = 2 << 20  # the ring stays in a core's L2 beside the streamed weights

    def __init__(
        self,
        fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
        workspace_bytes: ctypes._CFuncPtr,  # type: ignore[name-defined]
        layers: list[dict[str, torch.Tensor]],
        caches: BoundCaches,
        cos: torch.Tensor,
        sin: torch.Tensor,
        num_heads: int,
        eps: float,
        attn: NativeAttention,
        norm_w: torch.Tensor,
        lm_head: torch.Tensor,
        stream: bool | None = None,
        embed: torch.Tensor | None = None,
        steps: ctypes._CFuncPtr | None = None,  # type: ignore[name-defined]
        advance: ctypes._CFuncPtr | None = None,  # type: ignore[name-defined]
        steps_sampled: ctypes._CFuncPtr | None = None,  # type: ignore[name-defined]
    ) -> None:
        names = ("in_norm", "qkv", "o", "post_norm", "gate_up", "down")
        weights = [L[n] for L in layers for n in names]
        dtype = weights[0].dtype
        if dtype not in (torch.float32, torch.bfloat16) or any(
            t.dtype != dtype or not t.is_contiguous() for t in weights
        ):
            raise ValueError("every layer weight must be contiguous and all fp32 or all bf16")
        _check_rope_tables(cos, sin, dtype, caches.head_dim)
        if norm_w.dtype != dtype or lm_head.dtype != dtype or not (norm_w.is_contiguous() and lm_head.is_contiguous()):
            raise ValueError("the final norm and the LM head must be contiguous in the model's dtype")
        gemms = [L[n] for L in layers for n in ("qkv", "o", "gate_up", "down")] + [lm_head]
        tiled = {t.dim() == 4 for t in gemms}
        if len(tiled) != 1:
            raise ValueError("the GEMM weights must be all plain or all tiled")
        self.tiled = tiled.pop()
        if norm_w.shape != layers[0]["in_norm"].shape or linear_shape(lm_head)[1] != norm_w.shape[0]:
            raise ValueError("the final norm and the LM head disagree with the layers' hidden size")
        if embed is not None and (
            embed.dtype != dtype or not embed.is_contiguous() or embed.dim() != 2 or embed.shape[1] != norm_w.shape[0]
        ):
            raise ValueError("the embedding table must be a contiguous [vocab, hidden] tensor in the model's dtype")
        self._embed = embed
        self._embed_ptr: int | None = None if embed is None else embed.data_ptr()
        self._vocab_in = 0 if embed is None else embed.shape[0]  # rows of the embedding table
        self._fn, self._steps, self._advance, self._attn, self._caches = fn, steps, advance, attn, caches
        self._steps_sampled = steps_sampled
        self._workspace_bytes = workspace_bytes
        self.dtype, self.num_heads, self.eps = dtype, num_heads, eps
        self.hidden = layers[0]["in_norm"].shape[0]
        self.intermediate = linear_shape(layers[0]["down"])[1]
        self._keep = (weights, cos, sin, norm_w, lm_head, embed)
        self._norm_w, self._lm_head, self.vocab = norm_w.data_ptr(), lm_head.data_ptr(), linear_shape(lm_head)[0]
        self._w = (ctypes.c_void_p * len(weights))(*(t.data_ptr() for t in weights))
        self._kt = (ctypes.c_void_p * len(caches.ptrs))(*(kt for kt, _ in caches.ptrs))
        self._v = (ctypes.c_void_p * len(caches.ptrs))(*(v for _, v in caches.ptrs))
        self._cos, self._sin, self._max_len = cos.data_ptr(), sin.data_ptr(), cos.shape[0]
        self._buffers: dict[tuple[int, int], _Buffers] = {}
        self._heads: dict[int, _Head] = {}  # per M: the head's outputs a caller lets the next call reuse
        if stream is None:
            stream = streams_past_caches(sum(t.numel() * t.element_size() for t in (*weights, lm_head)))
        # Whether the GEMMs prefetch the weights into L2 rather than L1 (a speed hint only: the bits are the
        # same either way).
        self.stream = bool(stream)

    def buffers(self, T: int, threads: int) -> _Buffers:
        b = self._buffers.get((T, threads))
        if b is None:
            if len(self._buffers) >= self.MAX_SHAPES:
                self._buffers.clear()
            H, Hkv, D, dt = self.num_heads, self._caches.num_kv_heads, self._caches.head_dim, self.dtype
            o32 = torch.empty(T, H * D, dtype=torch.float32)
            L, bf16 = len(self._caches.ptrs), int(dt == torch.bfloat16)
            ws_bytes = self._workspace_bytes(L, T, self.hidden, H, Hkv, D, self.intermediate, bf16, threads)
            bufs = {
                "x": torch.empty(T, self.hidden, dtype=dt),
                "qkv": torch.empty(T, (H + 2 * Hkv) * D, dtype=dt),
                "q": torch.empty(T, H * D, dtype=torch.float32),
                "o32": o32,
                "o": o32 if dt == torch.float32 else torch.empty(T, H * D, dtype=dt),
                "delta": torch.empty(T, self.hidden, dtype=dt),
                "gu": torch.empty(T, 2 * self.intermediate, dtype=dt),
                "act": torch.empty(T, self.intermediate, dtype=dt),
            }
            ws = torch.empty(ws_bytes, dtype=torch.uint8) if ws_bytes <= self.WORKSPACE_BYTES else None
            c = self._caches
            args = _LayersArgs(
                w=ctypes.addressof(self._w), kt=ctypes.addressof(self._kt), v=ctypes.addressof(self._v), L=L,
                cos=self._cos, sin=self._sin, max_len=self._max_len,
                **{name: t.data_ptr() for name, t in bufs.items()},
                T=T, hidden=self.hidden, H=H, Hkv=Hkv, D=D, I=self.intermediate, BS=c.block_size,
                num_blocks=c.num_blocks, eps=self.eps, bf16=bf16, kv_bf16=c.kv_bf16, nthreads=threads,
                ws=None if ws is None else ws.data_ptr(), ws_bytes=0 if ws is None else ws.numel(),
                stream=int(self.stream), tiled=int(self.tiled), embed=self._embed_ptr, vocab=self._vocab_in,
                norm_w=self._norm_w, W_head=self._lm_head, V=self.vocab,
            )  # fmt: skip
            h = torch.empty(T, self.hidden, dtype=dt)
            b = self._buffers[(T, threads)] = _Buffers(
                h=h, **bufs, ws=ws, args=args, args_at=ctypes.addressof(args), h_at=h.data_ptr()
            )
        return b

    def __call__(
        self,
        h: torch.Tensor,  # [T, hidden] the model's dtype, contiguous, updated in place
        index: StepIndex,  # the step's index vectors (its ids and logits rows unread)
        scale: float,
    ) -> torch.Tensor:  # [T, hidden]: the last layer's down projection (the output is h + it), a reused buffer
        T, hidden = h.shape
        if h.dtype != self.dtype or hidden != self.hidden or not h.is_contiguous() or T != index.T:
            raise ValueError("the residual stream must be a contiguous [T, hidden] tensor in the model's dtype")
        return self._run(h.data_ptr(), index, scale, self.buffers(T, torch.get_num_threads()), None)

    def forward(
        self, index: StepIndex, scale: float, reuse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
        """A step's whole forward in one native call: the layers on the embeddings of ``index``'s token ids (the
        table given to :meth:`NativeLayers.bind`; the call does the gather ``embed.index_select(0, ids)`` would),
        then the final RMSNorm of its logits rows of ``h + delta`` and their logits (the bound LM head): the
        values the norm and the linear kernel give one call at a time, the logits widened to fp32 in the call (a
        bf16 model's are bf16 values, as ``.float()`` of the kernel's output). Returns ``h`` and ``delta``
        ([T, hidden] each: reused buffers, valid until the next call with as many rows), the normed rows ``hs``
        ([M, hidden], the model's dtype), the logits ([M, V] fp32) and each row's argmax (M ints:
        ``logits.argmax(dim=-1).tolist()``, a greedy row's token, found while the logits are in cache).

        reuse: the caller is done with this call's ``hs``, logits and argmax before its next call, so they may be
        the buffers of the last call with as many rows (a steady decode step then makes no tensor; a torch op
        there costs tens of microseconds, its code evicted by the weights the step streamed). Else fresh."""
        if self._embed is None:
            raise ValueError("forward needs the embedding table: bind the layers with embed=")
        threads = torch.get_num_threads()
        b = self.buffers(index.T, threads)
        M = index.M
        kept = self._kept_head(M)
        head = kept if reuse else _Head.new(M, self.hidden, self.vocab, self.dtype, kept.staged)
        delta = self._run(b.h_at, index, scale, b, head)
        return b.h, delta, head.hs, head.logits, head.argmax.tolist()

    def decode_steps(
        self,
        index: StepIndex,
        scale: float,
        n: int,
        pick: Callable[[int, torch.Tensor, list[int]], list[int]] | None = None,
        races: RowRaces | None = None,
    ) -> list[list[int]]:
        """``n`` decode steps with no return to the engine between them: :meth:`forward` on ``index``, then each
        row's token fed back as its next, ``n`` times. Returns each step's tokens per row ([steps][M] ints).
        Without ``pick`` the tokens are the argmaxes and the whole run is one native call
        (``invariant_layers_steps``): the tokens ``n`` greedy steps one at a time would pick, bit for bit (each
        step is the same fused computation on the same inputs). With ``pick(step, logits [M, V] fp32, argmax [M])
        -> [M] tokens`` (a sampler) each step is one native call and ``pick`` chooses the tokens fed to the next;
        with ``races`` too (the same choices where the native race can make them) the run is one native call
        again (``invariant_layers_steps_sampled``), and ``pick`` chooses only at a step whose race could not
        decide, after which the run ends.
        ``index``: a decode step, one row per request, every row a logits row in order, each block table covering
        ``n`` positions from the row's (its vectors are advanced in place). Why: a step's Python around the
        forward (scheduling, output handling) runs on caches the weights have just flushed; here ``n - 1`` steps
        skip it."""
        if self._embed is None or self._steps is None or self._advance is None:
            raise ValueError("decode_steps needs the embedding table and a library with invariant_layers_steps")
        T, M = index.T, index.M
        if n < 1 or M != T or index.num_reqs != T or index.width * self._caches.block_size < index.max_nvis + n - 1:
            raise ValueError(
                f"decode_steps runs a decode step (one logits row per request, every row) whose block tables cover "
                f"its {n} positions; got {T} rows, {M} logits rows, {index.num_reqs} requests, "
                f"{index.width} blocks for {index.max_nvis + n - 1} positions"
            )
        b, head = self.buffers(T, torch.get_num_threads()), self._kept_head(M)
        self._set_args(b.h_at, index, scale, b, head, index.max_nvis + n - 1)
        refused = ValueError(
            "the fused layers refused the decode steps: a position past the tables, a block id outside the pool, "
            "a token id outside the vocabulary, or a step that is not one decode row per request"
        )
        if pick is None:
            tokens = array("q", bytes(8 * n * M))
            ran = self._steps(b.args_at, n, tokens.buffer_info()[0])
            if ran < 1:
                raise refused
            return [tokens[s * M : (s + 1) * M].tolist() for s in range(ran)]
        if races is not None and self._steps_sampled is not None:
            per_row = (races.temps, races.top_k, races.top_p, races.seeds, races.first_positions)
            if any(len(v) != M for v in per_row):
                raise ValueError(f"races: one temperature, top-k, top-p, seed and position per row ({M})")
            tokens = array("q", bytes(8 * n * M))
            temps, first = array("f", races.temps), array("q", races.first_positions)
            top_k, top_p = array("q", races.top_k), array("d", races.top_p)
            seeds = _uint64s(races.seeds)
            pending = ctypes.c_int(0)
            ran = self._steps_sampled(
                b.args_at, n, head.logits.data_ptr(), temps.buffer_info()[0], top_k.buffer_info()[0],
                top_p.buffer_info()[0], ctypes.addressof(seeds), first.buffer_info()[0], races.margin, races.guard,
                races.mass_guard, races.cap, tokens.buffer_info()[0], ctypes.byref(pending),
            )  # fmt: skip
            if ran < 0:
                raise refused
            raced = [tokens[s * M : (s + 1) * M].tolist() for s in range(ran)]
            if pending.value:  # step `ran` ran but a race could not say: the definition picks its tokens
                raced.append(pick(ran, head.logits, head.argmax.tolist()))
            return raced
        steps: list[list[int]] = []
        fed = array("q")  # the tokens fed to the next step: the last pick's
        for s in range(n):
            if s and self._advance(b.args_at, fed.buffer_info()[0]):
                break
            if self._fn(b.args_at):
                if s:
                    break
                raise refused
            steps.append(pick(s, head.logits, head.argmax.tolist()))
            fed = array("q", steps[-1])
        return steps

    def _kept_head(self, M: int) -> _Head:
        """The head's outputs for M rows that callers reading them at once share (see forward's ``reuse``)."""
        kept = self._heads.get(M)
        if kept is None:
            if len(self._heads) >= self.MAX_SHAPES:
                self._heads.clear()
            kept = self._heads[M] = _Head.new(M, self.hidden, self.vocab, self.dtype)
        return kept

    def _set_args(
        self, h_at: int, index: StepIndex, scale: float, b: _Buffers, head: _Head | None, max_nvis: int
    ) -> None:
        # the call's per-step arguments (see _run); max_nvis: the most keys a row sees in the call
        a = b.args
        n_pad, need = attention_scratch(a.nthreads, self.num_heads, self._caches.num_kv_heads, max_nvis)
        a.h, a.scratch, a.n_pad, a.scale = h_at, self._attn.scratch_at(need), n_pad, scale
        a.stream = self.stream  # a hint the caller may change between calls
        a.pos, a.kv_index, a.req, a.nvis = (index.at(n) for n in ("positions", "kv_index", "req", "nvis"))
        a.block_table, a.bt_stride = index.at("block_tables"), index.width
        if head is None:
            a.ids, a.rows, a.M = None, None, 0
        else:
            a.ids, a.rows, a.M = index.at("ids"), index.at("rows"), index.M
            a.hs, a.logits, a.logits_f32, a.argmax = head.ptrs

    def _run(self, h_at: int, index: StepIndex, scale: float, b: _Buffers, head: _Head | None) -> torch.Tensor:
        # h_at: the residual stream's address ([index.T, hidden]); b: the buffers for index.T rows at the threads
        # the call runs; head: where the head's outputs at index's rows go, with the embeddings gathered from its
        # ids into h; None: h given, no head
        self._set_args(h_at, index, scale, b, head, index.max_nvis)
        max_nvis = index.max_nvis
        if self._fn(b.args_at) != 0:
            raise ValueError(
                f"the fused layers refused the step: a position or cache index outside the tables or the "
                f"{self._caches.num_blocks}-block pool, a token id outside the vocabulary, a logits row outside the "
                f"step, or attention shapes outside the kernel (max visible keys {max_nvis})"
            )
        return b.delta
