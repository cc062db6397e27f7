"""Huge-page buffers (workers/hugepages.py): same values as ordinary tensors, laid out as promised, and
actually backed by huge pages where the kernel offers them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from workers import hugepages
from workers.runner import ModelRunner, StepBatch


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unavailable"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "unavailable"


def _anon_huge_kb(addr: int, nbytes: int) -> int:
    """AnonHugePages (kB) of the mappings overlapping ``[addr, addr + nbytes)`` in this process."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + nbytes and addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1])
    return total


def test_arena_copies_values_in_order_on_cache_lines() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(s, generator=g).to(dt)
        for s, dt in [
            ((1000, 576), torch.bfloat16),
            ((7,), torch.float32),
            ((576, 1536), torch.bfloat16),
            ((3, 5), torch.bfloat16),
        ]
    ]
    placed = hugepages.arena(ts)
    if not hugepages.enabled():
        assert all(a is b for a, b in zip(placed, ts))
        return
    assert all(torch.equal(a, b) and a.dtype == b.dtype and a.is_contiguous() for a, b in zip(placed, ts))
    ptrs = [t.data_ptr() for t in placed]
    assert ptrs == sorted(ptrs) and all(p % hugepages.ALIGN == 0 for p in ptrs)
    assert ptrs[0] % hugepages.HUGE_PAGE == 0  # the run starts on a huge page
    assert len({t.untyped_storage().data_ptr() for t in placed}) == 1  # one buffer
    for a, b in zip(placed, placed[1:]):  # packed: the next tensor starts at the first cache line after
        end = a.data_ptr() + a.numel() * a.element_size()
        assert b.data_ptr() == -(-end // hugepages.ALIGN) * hugepages.ALIGN


def test_arena_is_a_no_op_when_disabled_or_small(monkeypatch: pytest.MonkeyPatch) -> None:
    ts = [torch.ones(4, 4)]
    assert hugepages.arena(ts)[0] is ts[0]  # under one huge page: an ordinary tensor is as good
    monkeypatch.setenv(hugepages.ENV_DISABLE, "0")
    big = [torch.ones(1024, 1024)]
    assert hugepages.arena(big)[0] is big[0]
    z = hugepages.zeros((1024, 1024), torch.float32, torch.device("cpu"))
    assert torch.equal(z, torch.zeros(1024, 1024))


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off on this host")
def test_the_kernel_backs_an_arena_with_huge_pages() -> None:
    if not hugepages.enabled():
        pytest.skip("huge pages disabled in this environment")
    placed = hugepages.arena([torch.ones(8 << 20, dtype=torch.uint8)])  # 8 MiB: four huge pages
    assert _anon_huge_kb(placed[0].data_ptr(), placed[0].numel()) >= 2048


def test_a_native_runner_streams_its_weights_from_one_arena_with_the_same_logits(
    monkeypatch: pytest.MonkeyPatch, tiny_loaded
) -> None:
    """The placement changes addresses, never values: logits are bit-identical to ordinary pages."""
    loaded = tiny_loaded
    kw = dict(dtype=torch.bfloat16, cpu_gemm="native", batch_invariant=True)
    runner = ModelRunner(loaded.model, 2, 64, **kw)
    if runner.native_gemm is None:
        pytest.skip("the native kernels do not build here")
    monkeypatch.setenv(hugepages.ENV_DISABLE, "0")
    plain = ModelRunner(loaded.model, 2, 64, **kw)
    monkeypatch.delenv(hugepages.ENV_DISABLE)
    if hugepages.enabled():
        storages = {t.untyped_storage().data_ptr() for L in runner.layers for t in L.values()}
        assert len(storages | {runner.lm_head.untyped_storage().data_ptr()}) == 1
    batch = StepBatch([0], [0], [[1, 5, 9, 2, 7]], [[0, 1, 2, 3, 4]])
    assert torch.equal(runner.forward(batch).logits, plain.forward(batch).logits)
