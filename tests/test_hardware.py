"""``dtype: auto`` and ``cpu_gemm: auto`` follow the CPU's flags: bf16 only where the hardware multiplies it
natively, the native GEMMs where they measured faster."""

from __future__ import annotations

import pytest
import torch

from workers import hardware


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"avx2", "fma"}, torch.bfloat16),  # the native kernel widens bf16 weights exactly: half the bytes read
        ({"avx2"}, torch.float32),  # no FMA: oneDNN, which would multiply bf16 through fp32 copies
        ({"avx512f"}, torch.float32),  # AVX-512 without its bf16 instructions: oneDNN, as above
        ({"avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
        (set(), torch.float32),  # flags unreadable
    ],
)
def test_auto_dtype_follows_the_cpu_flags(monkeypatch, flags, expected):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    assert hardware.resolve_dtype("auto", torch.device("cpu")) == expected
    # GEMMs through oneDNN (chosen, or no C compiler for the native kernel): bf16 only with bf16 instructions
    onednn = torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32
    assert hardware.resolve_dtype("auto", torch.device("cpu"), "onednn") == onednn


def test_explicit_dtypes_are_taken_as_they_are(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset())
    assert hardware.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert hardware.resolve_dtype("float32", torch.device("cpu")) == torch.float32


@pytest.mark.parametrize(
    "flags,dtype,expected",
    [
        ({"avx512f", "avx512_bf16"}, torch.bfloat16, "native"),
        ({"avx512f", "avx512_bf16"}, torch.float32, "native"),
        ({"avx512f"}, torch.float32, "native"),
        ({"avx512f"}, torch.bfloat16, "onednn"),  # bf16 without the dot-product instructions: emulated
        ({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}, torch.bfloat16, "onednn"),  # AMX wins prefill
        ({"avx512f", "amx_tile"}, torch.float32, "onednn"),  # unmeasured there: the library's
        ({"avx2", "fma"}, torch.float32, "native"),  # close to the bandwidth at a few rows, even at 16 and 32
        ({"avx2", "fma"}, torch.bfloat16, "native"),  # each weight block widened once for all rows
        ({"avx2"}, torch.bfloat16, "onednn"),
        ({"avx2"}, torch.float32, "onednn"),  # no FMA: the portable C path
        (set(), torch.float32, "onednn"),
    ],
)
def test_auto_gemm_is_native_where_it_measured_faster(monkeypatch, flags, dtype, expected):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    assert hardware.resolve_cpu_gemm("auto", dtype) == expected
    assert hardware.resolve_cpu_gemm("onednn", dtype) == "onednn"  # an explicit choice is kept


def test_the_last_level_cache_is_the_largest_data_cache_sysfs_lists(tmp_path):
    """Sizes as sysfs writes them ("32K", "32768K"); the instruction cache does not count; no sysfs: None."""
    listed = (("Data", "48K"), ("Instruction", "64M"), ("Unified", "1024K"), ("Unified", "32M"))
    for i, (kind, size) in enumerate(listed):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    assert hardware.last_level_cache_bytes(str(tmp_path)) == 32 << 20
    assert hardware.last_level_cache_bytes(str(tmp_path / "missing")) is None
