"""What the machine can do, detected at run time (the CPU changes between machines of one fleet)."""

from __future__ import annotations

import functools
import os
import platform
import threading

import torch

_NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux); empty where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 dot products in hardware, so bf16 GEMMs beat fp32 at every row count."""
    return any(f in cpu_flags() for f in _NATIVE_BF16_FLAGS)


def resolve_cpu_gemm(name: str, dtype: torch.dtype) -> str:
    """``"auto"``: the native linear kernel where it measured fastest (docs/benchmarks.md, ``gemm_ab``), oneDNN
    elsewhere. Native: a CPU with AVX-512 and no AMX (with AVX512-BF16 for a bf16 model), where its fused forward
    decodes faster at every batch size measured, and a CPU with AVX2 and FMA, where it reads the weights at
    close to the memory's bandwidth for a few rows and keeps up with oneDNN at 16 and 32 rows and in prefill
    (bf16 there widens each block of weights to fp32 once for all rows). oneDNN: with AMX, whose kernels win
    prefill and large batches, and for bf16 on AVX-512 without AVX512-BF16 (not measured). Any other name is
    kept."""
    if name != "auto":
        return name
    flags = cpu_flags()
    if any(f.startswith("amx") for f in flags):
        return "onednn"
    if "avx512f" in flags:
        native = dtype == torch.float32 or (dtype == torch.bfloat16 and "avx512_bf16" in flags)
    else:
        native = "avx2" in flags and "fma" in flags
    return "native" if native else "onednn"


@functools.cache
def last_level_cache_bytes(base: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The largest data or unified cache one CPU sees (Linux sysfs: cpu0's deepest level), in bytes; None
    where it cannot be read. Weights larger than it are read from memory every step whatever is done."""
    best: int | None = None
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for e in entries:
        if not e.startswith("index"):
            continue
        try:
            with open(f"{base}/{e}/type") as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(f"{base}/{e}/size") as f:
                size = f.read().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        n = int(size[:-1]) * units[size[-1]] if size and size[-1] in units else int(size) if size.isdigit() else 0
        best = n if best is None or n > best else best
    return best


def cpu_name() -> str:
    """The CPU's model name, with its family and model numbers where the name alone does not tell the generation
    apart (e.g. "AMD EPYC, family 25 model 17"), for benchmark results: timings mean little without it."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:  # the first processor's block is enough
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    return name


def resolve_dtype(name: str, device: torch.device, cpu_gemm: str = "auto") -> torch.dtype:
    """``"auto"``: bf16 where its GEMMs run at least as fast as fp32's: CUDA with bf16 support; a CPU with AMX or
    AVX512-BF16; a CPU whose GEMMs run on the native kernel in bf16 (``cpu_gemm``, see :func:`resolve_cpu_gemm`:
    AVX2 + FMA), which reads half fp32's bytes and widens them exactly, faster than fp32 up to 16 rows and even
    at 32 (docs/benchmarks.md#decode_floor). Else fp32: bf16 through oneDNN without bf16 instructions multiplies
    fp32 copies. Explicit names are taken as they are."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        fast = cpu_has_native_bf16() or resolve_cpu_gemm(cpu_gemm, torch.bfloat16) == "native"
        return torch.bfloat16 if fast else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def claim_cpu() -> str:
    """Run the calling thread, and the threads it starts afterwards (its OpenMP pool), as ordinary
    time-sharing threads at nice 0 (``SCHED_OTHER``); returns what it runs at, e.g. ``"other/0"``.

    Why: a step's ~400 parallel ops each wait for their slowest thread, so when every core runs an
    engine thread, any other process that wakes up (Ray's daemons, the HTTP proxy) preempts one and
    stalls the whole op. The launchers start Ray under ``SCHED_BATCH`` (woken tasks do not preempt)
    with Ray's background daemons further back (cluster/cpu_priority.py); this puts the engine
    back in front. Leaving ``SCHED_BATCH`` for ``SCHED_OTHER`` needs no privilege. Lowering the nice
    value below what the thread inherited does (Ray starts workers at 15 unless
    ``RAY_worker_niceness`` says otherwise); without it the nice value is left as it was.
    """
    if not hasattr(os, "sched_setscheduler"):  # not Linux
        return "inherit"
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    except OSError:
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 0)
    except OSError:
        pass
    return thread_priority(tid)


def thread_priority(tid: int) -> str:
    """``"<policy>/<nice>"`` of a thread (Linux), e.g. ``"batch/0"``; ``"unknown"`` elsewhere."""
    try:
        policy = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle"}.get(
            os.sched_getscheduler(tid), "realtime"
        )
        return f"{policy}/{os.getpriority(os.PRIO_PROCESS, tid)}"
    except (OSError, AttributeError):
        return "unknown"
