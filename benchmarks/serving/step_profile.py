"""The engine's steps during one load level, read the same way in process and in the Serve replica.

Why: a served level that delivers fewer tokens per second than the engine in process either runs
smaller batches (requests spend time outside the engine: routing, the client's round trips) or runs
the same batches slower (the serving path's processes take the engine's cores). The two look alike
in tok/s and are told apart by the steps: decode rows per step and seconds per step, side by side.

In the replica the steps come from ``TargetWorker.policy_trace`` (its last steps) and the engine's
step count (``TargetWorker.load()["num_steps"]``) before and after the level; in process from a
:class:`StepRecorder` on the engine's ``on_step`` hook. Nothing here imports Ray.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class Step:
    tokens: int  # tokens fed: every decoding request's pending token and drafts, plus prompt chunks
    seconds: float  # wall time of the step (schedule, propose, forward, verify, commit)
    decode: int  # decoding requests (one frontier row each, plus their drafts)
    drafts: int  # draft tokens verified this step

    @property
    def prompt(self) -> int:
        """Prompt tokens fed this step (chunked prefill)."""
        return self.tokens - self.decode - self.drafts


def from_trace(entries: Sequence[dict[str, Any]]) -> list[Step]:
    """Steps from ``policy_trace()["steps"]``: ``ks`` holds the K asked of each decoding request."""
    return [Step(int(e["tokens"]), float(e["seconds"]), len(e["ks"]), int(sum(e["ks"]))) for e in entries]


def since(entries: Sequence[dict[str, Any]], steps_before: int, steps_after: int) -> tuple[list[dict[str, Any]], bool]:
    """The trace entries of the steps taken between two step counts, and whether the trace (a bounded
    deque of the last steps) had already dropped some of them."""
    n = max(steps_after - steps_before, 0)
    return list(entries[len(entries) - n :] if n else []), n > len(entries)


class StepRecorder:
    """``LLMEngine.on_step`` for an in-process engine: records each step as a :class:`Step`.

    The hook runs inside ``step()`` after the plan is made, so ``engine.last_plan`` is that step's.
    """

    def __init__(self, engine: Any) -> None:  # workers.engine.LLMEngine
        self.engine = engine
        self.steps: list[Step] = []

    def __call__(self, tokens: int, seconds: float, requests: int | None = None) -> None:
        plan = self.engine.last_plan
        self.steps.append(Step(tokens, seconds, len(plan.decode), sum(k for _, k in plan.decode)))


def summarize(steps: Sequence[Step]) -> dict[str, Any]:
    """Per level: the mean step and its mix, and the median decode-only step (no prompt chunk, no
    drafts: the same work in process and served, so its time compares the cores the engine got)."""
    if not steps:
        return {"num_steps": 0}
    pure = [s for s in steps if s.prompt == 0 and s.drafts == 0 and s.decode]
    return {
        "num_steps": len(steps),
        "step_ms_mean": 1e3 * statistics.fmean(s.seconds for s in steps),
        "decode_rows_mean": statistics.fmean(s.decode for s in steps),
        "prompt_tokens_mean": statistics.fmean(s.prompt for s in steps),
        "drafts_mean": statistics.fmean(s.drafts for s in steps),
        "decode_only_steps": len(pure),
        "decode_only_step_ms_p50": 1e3 * statistics.median(s.seconds for s in pure) if pure else None,
        "decode_only_rows_mean": statistics.fmean(s.decode for s in pure) if pure else None,
    }


def compare(http: dict[str, Any], engine: dict[str, Any]) -> str:
    """One line: the served steps against the in-process ones at a level."""
    if not http.get("num_steps") or not engine.get("num_steps"):
        return "steps: not recorded"

    def mix(d: dict[str, Any]) -> str:
        return (
            f"{d['step_ms_mean']:.1f} ms at {d['decode_rows_mean']:.1f} decode rows + {d['prompt_tokens_mean']:.1f} "
            f"prompt tokens"
        )

    line = (
        f"steps over HTTP {mix(http)}, in process {mix(engine)} "
        f"({http['step_ms_mean'] / engine['step_ms_mean']:.2f}x the time)"
    )
    a, b = http.get("decode_only_step_ms_p50"), engine.get("decode_only_step_ms_p50")
    if a and b:
        line += (
            f"; decode-only step p50 {a:.1f} ms at {http['decode_only_rows_mean']:.1f} rows vs {b:.1f} ms at "
            f"{engine['decode_only_rows_mean']:.1f} ({a / b:.2f}x)"
        )
    return line
