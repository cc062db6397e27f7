"""What the machine can do, detected at run time (the CPU changes between machines of one fleet)."""

from __future__ import annotations

import functools
import platform

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


def cpu_name() -> str:
    """The CPU's model name, for benchmark results (timings mean little without it)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"``: bf16 where matmuls run natively in it (CUDA with bf16 support, a CPU with AMX or
    AVX512-BF16), else fp32. Explicit names are taken as they are."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
