"""``threshold``: speculate while the decode batch is small, with hysteresis against flapping.

A step at a small batch is memory bound and speculation fills the idle compute; at a large
batch it is compute bound and rejected drafts cost real work. A single threshold makes the
path flip every step when the load sits at it (vLLM #49548), which collapses throughput, so
this policy is a two-state machine with two guards:

* a band: leave SPEC only when the batch exceeds ``t_high``; return to SPEC only when it is
  at most ``t_low`` (``t_low <= t_high``);
* a dwell: a state is held for at least ``min_dwell_s`` (measured with the injected clock)
  before it may change again, so there is at most one path change per dwell window even
  when ``t_low == t_high`` (the ``t`` shorthand).

The policy starts in SPEC with no dwell pending, so the first decision follows the load.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, Sequence

from pydantic import Field, model_validator

from policies.base import Clock, Policy, PolicyConfigBase, batch_size
from workers.config import MAX_SPECULATIVE_TOKENS
from workers.decision import SpecCandidate
from workers.stats import LoadSnapshot


class ThresholdConfig(PolicyConfigBase):
    """Speculate while the decode batch is at most a threshold, with a hysteresis band and a dwell time."""

    name: Literal["threshold"] = Field("threshold", description="Policy name.")
    t: int | None = Field(
        None,
        ge=0,
        description="Shorthand for t_low = t_high = t (hysteresis then comes from min_dwell_s only). "
        "Mutually exclusive with t_low / t_high.",
    )
    t_low: int = Field(4, ge=0, description="Return to speculation when the decode batch is <= t_low.")
    t_high: int = Field(8, ge=0, description="Leave speculation when the decode batch is > t_high.")
    min_dwell_s: float = Field(
        1.0, ge=0.0, description="Seconds a path is held before it may change again (0 disables the dwell)."
    )
    num_speculative_tokens: int = Field(4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="K used while speculating.")

    @model_validator(mode="after")
    def _band(self) -> ThresholdConfig:
        if self.t is not None:
            # t_low / t_high equal to t are allowed, so a dumped config validates again
            both = sorted(f for f in ("t_low", "t_high") if f in self.model_fields_set and getattr(self, f) != self.t)
            if both:
                raise ValueError(f"give either t or t_low/t_high, not both (got t and {', '.join(both)})")
            object.__setattr__(self, "t_low", self.t)
            object.__setattr__(self, "t_high", self.t)
        if self.t_low > self.t_high:
            raise ValueError(f"t_low ({self.t_low}) must be <= t_high ({self.t_high})")
        return self


class ThresholdPolicy(Policy[ThresholdConfig]):
    name = "threshold"
    config_cls = ThresholdConfig

    def __init__(self, config: ThresholdConfig | None = None, clock: Clock = time.monotonic) -> None:
        super().__init__(config, clock)
        self.speculating = True
        self.since = -math.inf  # when the current state was entered; -inf: no dwell pending
        self.num_switches = 0

    def _update(self, batch: int) -> None:
        cfg = self.config
        now = self.clock()
        if now - self.since < cfg.min_dwell_s:
            return
        if self.speculating and batch > cfg.t_high:
            self.speculating, self.since = False, now
            self.num_switches += 1
        elif not self.speculating and batch <= cfg.t_low:
            self.speculating, self.since = True, now
            self.num_switches += 1

    def choose_k(self, snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        self._update(batch_size(snapshot, candidates))
        k = self.config.num_speculative_tokens if self.speculating else 0
        return [k] * len(candidates)

    def state(self) -> dict[str, Any]:
        return {"path": "spec" if self.speculating else "plain", "num_switches": self.num_switches}
