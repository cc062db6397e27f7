"""Where a decode step's time goes: timers wrapped around one engine's (or runner's) phases.

Why wrappers and not a flag in the runner: the hot path stays exactly as served (nothing to test,
nothing to pay when off). :class:`StepSplit` replaces a few bound methods on *one* instance with
timed ones and puts them back on exit; each timer costs ~0.3 us, a few hundred per step.

Phases of an engine step (``LLMEngine.step``):
- weight GEMMs, one entry per weight (``qkv``, ``o``, ``gate_up``, ``down``, ``lm_head``), with the
  bytes each reads, so each gets its achieved GB/s;
- attention and the row-wise ops (residual + RMSNorm, RoPE + KV write, SiLU * up) where the native
  kernels run; on a runner without them (the draft model) they are inside ``forward, other``. Where the
  layers run as one fused native call (the served bf16 path on a CPU with the native GEMMs), the call
  clocks its own phases from phase end to phase end (``NativeLayers.profile``), wall time whatever ``clock``;
- ``forward, other``: the rest of ``ModelRunner.forward`` (index tensors, embedding, row blocking);
- schedule, propose, build (the step's own Python around the forward), sampling (verify) and output
  (commit, detokenize, stop checks: ``OutputProcessor.process`` less verify).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

import torch

from workers import native_attention, output_processor
from workers.runner import ModelRunner

GEMMS = ("qkv", "o", "gate_up", "down", "lm_head")
ROW_OPS = ("add_rms_norm", "rope_kv", "silu_mul")


def weight_bytes(runner: ModelRunner) -> dict[str, int]:
    """Bytes of each weight kind that one step reads (every layer's, and the LM head rows it computes),
    in the dtype the step multiplies in (a batch-invariant bf16 runner without native bf16 GEMMs
    multiplies through its fp32 copies)."""
    esize = 4 if (runner.batch_invariant and runner._wide_f32) else torch.empty(0, dtype=runner.dtype).element_size()
    hd, h, hkv, d, inter = (
        runner.hidden_size,
        runner.num_heads,
        runner.num_kv_heads,
        runner.head_dim,
        runner.intermediate_size,
    )
    per_layer = {"qkv": (h + 2 * hkv) * d * hd, "o": hd * h * d, "gate_up": 2 * inter * hd, "down": hd * inter}
    out = {k: v * runner.num_layers * esize for k, v in per_layer.items()}
    out["lm_head"] = native_attention.linear_shape(runner.lm_head)[0] * hd * esize
    return out


class StepSplit:
    """``with StepSplit(engine=eng) as s: eng.step()`` (or ``runner=``): ``s.totals`` holds seconds per
    phase, ``s.calls`` the calls; :meth:`table` gives per-step means and GB/s."""

    def __init__(
        self, engine: Any = None, runner: ModelRunner | None = None, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        """``clock``: wall time by default; ``time.thread_time`` counts only this thread's CPU time, which on a
        contended machine with one torch thread leaves out the time other processes held the core."""
        self.engine = engine
        self.clock = clock
        self.runner = runner if runner is not None else engine.runner
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._undo: list[Callable[[], None]] = []

    def timer(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        totals, calls, clock = self.totals, self.calls, self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += clock() - t0
                calls[name] += 1

        return timed

    def _patch(self, obj: Any, attr: str, value: Any) -> None:
        had = attr in vars(obj)
        old = vars(obj).get(attr)
        setattr(obj, attr, value)
        self._undo.append(lambda: setattr(obj, attr, old) if had else delattr(obj, attr))

    def __enter__(self) -> StepSplit:
        r = self.runner
        kernel = r._linear_kernel

        def linear_kernel(x: torch.Tensor, L: dict[str, torch.Tensor], name: str) -> torch.Tensor:
            t0 = self.clock()
            try:
                return kernel(x, L, name)
            finally:
                self.totals[name] += self.clock() - t0
                self.calls[name] += 1

        self._patch(r, "_linear_kernel", linear_kernel)
        self._patch(r, "_lm_head_kernel", self.timer("lm_head", r._lm_head_kernel))
        self._patch(r, "forward", self.timer("forward", r.forward))
        fused = native_attention.load_layers() if getattr(r, "native_layers", None) is not None else None
        if fused is not None and r.fused_layers:
            # the layers as served, one fused C call: it clocks its own phases (wall time, phase end to phase end)
            acc = torch.zeros(len(native_attention.PHASES), dtype=torch.float64)
            fused.profile(acc)
            self._undo.append(lambda: (fused.profile(None), self._add_phases(acc)))
        elif r.native_ops is not None:  # a forward makes its native calls through one NativeStep
            step = native_attention.NativeStep
            for name in ("attention", *ROW_OPS):
                self._patch(step, name, self.timer(name, getattr(step, name)))
        if self.engine is not None:
            e = self.engine
            self._patch(e, "step", self.timer("step", e.step))
            self._patch(e.scheduler, "schedule", self.timer("schedule", e.scheduler.schedule))
            self._patch(e, "_propose", self.timer("propose", e._propose))
            self._patch(e.processor, "process", self.timer("process", e.processor.process))
            for fn in ("verify", "verify_coupled"):  # the sampler: called from the processor's module
                self._patch(output_processor, fn, self.timer("sampling", getattr(output_processor, fn)))
        return self

    def _add_phases(self, acc: torch.Tensor) -> None:
        """The fused forward's phase clocks, under the names the per-call timers use."""
        for phase, secs in zip(native_attention.PHASES, acc.tolist()):
            name = phase.removeprefix("gemm ") if phase.startswith("gemm ") else phase
            self.totals["add_rms_norm" if name.startswith("rms_norm") else name] += secs

    def __exit__(self, *exc: object) -> None:
        while self._undo:
            self._undo.pop()()

    def table(self, steps: int) -> list[dict[str, Any]]:
        """Per-step mean milliseconds of each phase (they add up to the step), GEMMs with GB/s."""
        t = {k: v / steps for k, v in self.totals.items()}
        wb = weight_bytes(self.runner)
        rows: list[dict[str, Any]] = []

        def row(phase: str, s: float, gbs: float | None = None) -> None:
            rows.append({"phase": phase, "ms": 1e3 * s, "gb_s": gbs})

        for g in GEMMS:
            if g in t:
                row(f"gemm {g}", t[g], wb[g] / t[g] / 1e9 if t[g] else None)
        row("attention", t.get("attention", 0.0))
        row("row-wise ops", sum(t.get(k, 0.0) for k in ROW_OPS))
        inside = sum(t.get(k, 0.0) for k in (*GEMMS, "attention", *ROW_OPS))
        row("forward, other", t["forward"] - inside)
        if self.engine is not None:
            row("sampling (verify)", t.get("sampling", 0.0))
            row("schedule", t.get("schedule", 0.0))
            row("propose", t.get("propose", 0.0))
            row("output (process less verify)", t.get("process", 0.0) - t.get("sampling", 0.0))
            outer = sum(t.get(k, 0.0) for k in ("forward", "schedule", "propose", "process"))
            row("build + step Python", t["step"] - outer)
            row("step", t["step"])
        else:
            row("forward", t["forward"])
        return rows
