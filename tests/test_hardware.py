"""``dtype: auto`` follows the CPU's flags: bf16 only where the hardware multiplies it natively."""

from __future__ import annotations

import pytest
import torch

from workers import hardware


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"avx2", "fma"}, torch.float32),  # AVX2 only: bf16 GEMMs are emulated
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
        (set(), torch.float32),  # flags unreadable
    ],
)
def test_auto_dtype_follows_the_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    assert hardware.resolve_dtype("auto", torch.device("cpu")) == expected


def test_explicit_dtypes_are_taken_as_they_are(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset())
    assert hardware.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert hardware.resolve_dtype("float32", torch.device("cpu")) == torch.float32
