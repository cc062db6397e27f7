"""The step split (benchmarks/engine/step_split.py) on the served fused path: the fused native call clocks
its own phases, and the split reports them without unfusing the layers."""

from __future__ import annotations

import pytest
import torch

from benchmarks.engine.step_split import StepSplit
from workers import native_attention
from workers.runner import ModelRunner, StepBatch


def test_the_fused_layers_report_their_phases(tiny_loaded):
    r = ModelRunner(tiny_loaded.model, 2, 64, dtype=torch.bfloat16, cpu_gemm="native", batch_invariant=True)
    if r.native_layers is None:
        pytest.skip("the native kernels do not build here")
    r.forward(StepBatch([0], [0], [[5, 6, 7]], [[2]]))
    steps = 4
    with StepSplit(runner=r) as sp:
        assert r.fused_layers  # measured as served
        for i in range(steps):
            r.forward(StepBatch([0], [3 + i], [[8]], [[0]]))
    rows = {row["phase"]: row for row in sp.table(steps)}
    for phase in ("gemm qkv", "gemm o", "gemm gate_up", "gemm down", "attention", "row-wise ops"):
        assert rows[phase]["ms"] > 0, phase
    assert all(rows[f"gemm {g}"]["gb_s"] > 0 for g in ("qkv", "o", "gate_up", "down"))
    inside = sum(rows[p]["ms"] for p in rows if p not in ("forward", "forward, other"))
    assert inside <= rows["forward"]["ms"]  # the phases lie inside the forward
    # the profile is off once the split ends: a later forward adds nothing
    before = dict(sp.totals)
    r.forward(StepBatch([0], [3 + steps], [[9]], [[0]]))
    assert dict(sp.totals) == before


def test_the_profile_takes_only_its_own_layout():
    fused = native_attention.load_layers()
    if fused is None:
        pytest.skip("the native kernels do not build here")
    with pytest.raises(ValueError, match="float64"):
        fused.profile(torch.zeros(len(native_attention.PHASES)))
    fused.profile(None)
