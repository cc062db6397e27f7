"""The routing-policy interface: a load snapshot in, K per candidate out (0 = plain step).

A policy is a :data:`workers.decision.DecideFn`: the engine calls it every step with all
decoding requests, and the router calls it once per incoming request (one candidate, the
snapshot of the replica it may join) to pick the path and K. It holds no model and never
imports Ray.

Subclasses implement :meth:`Policy.choose_k`, the load-driven choice for requests that said
``speculation="auto"``. :meth:`Policy.decide` then applies the rules every policy shares, so
no policy can get them wrong:

* a candidate without a proposer, or with ``k_max == 0``, is always plain (K = 0), except for its
  grammar-forced drafts (``SpecCandidate.forced``), which every path that is not held "off" takes:
  they cost no proposer work, and a verify row that commits a forced token is a row the plain
  path would spend on it a step later;
* with ``allow_request_override`` (the default) a request's own wish wins: ``"off"`` forces
  K = 0, ``"on"`` forces K > 0 (the policy's K if it chose one, else ``override_k``); with the
  override disallowed the wish is ignored and the policy's choice stands;
* K is clipped to the candidate's ``k_max``;
* every final decision is counted in :attr:`Policy.decisions` as ``(path, k)``, path
  ``"spec"`` or ``"plain"``, for the metrics exporter.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, Callable, ClassVar, Generic, Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from workers.config import MAX_SPECULATIVE_TOKENS
from workers.decision import SpecCandidate
from workers.stats import LoadSnapshot

Path = Literal["spec", "plain"]
Clock = Callable[[], float]


class PolicyConfigBase(BaseModel):
    """Fields every policy has. Subclasses add ``name: Literal[...]`` and their own knobs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allow_request_override: bool = Field(
        True,
        description="Honour a request's own speculation wish: 'on' forces K > 0, 'off' forces K = 0. "
        "When false the wish is ignored and the policy alone decides.",
    )
    override_k: int = Field(
        4,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="K given to a request that asked for speculation='on' when the policy itself chose 0 "
        "(clipped to the request's k_max).",
    )


C = TypeVar("C", bound=PolicyConfigBase)


def batch_size(snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> int:
    """The decode batch the decision is for: the snapshot's ``decoding`` count.

    The engine's snapshot already counts every candidate; the router's may not count the
    request being placed, so the batch is never taken to be smaller than the candidates.
    """
    return max(snapshot.decoding, len(candidates))


class Policy(ABC, Generic[C]):
    """A routing policy. Call it (or :meth:`decide`) with a snapshot and the candidates."""

    name: ClassVar[str] = "base"
    config_cls: ClassVar[type[PolicyConfigBase]] = PolicyConfigBase

    def __init__(self, config: C | None = None, clock: Clock = time.monotonic) -> None:
        self.config: C = config if config is not None else self.config_cls()  # type: ignore[assignment]
        self.clock = clock  # injectable: dwell times are measured with it
        self.decisions: Counter[tuple[Path, int]] = Counter()

    # ------------------------------------------------------------------ subclass API

    @abstractmethod
    def choose_k(self, snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        """The policy's own K per candidate (before overrides and the k_max clip)."""

    def observe_step(self, tokens: int, seconds: float, requests: int | None = None) -> None:
        """Feedback from the engine loop after each step: tokens fed, wall time, and the decoding
        requests when the step carried no prefill chunk (else None). No-op by default."""

    def state(self) -> dict[str, Any]:
        """Internal state worth showing on a stats endpoint (e.g. hysteresis state). Empty by default."""
        return {}

    def step_detail(self) -> dict[str, Any]:
        """Why the last :meth:`decide` chose what it chose, small enough to keep per engine step
        (the target's ``policy_trace``). Empty by default."""
        return {}

    # ------------------------------------------------------------------ shared rules

    def decide(self, snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        if not candidates:
            return []
        proposed = self.choose_k(snapshot, candidates)
        if len(proposed) != len(candidates):
            raise RuntimeError(f"policy {self.name!r} returned {len(proposed)} K for {len(candidates)} candidates")
        out: list[int] = []
        for c, k in zip(candidates, proposed):
            k = self._final_k(c, int(k))
            self.decisions[("spec" if k > 0 else "plain", k)] += 1
            out.append(k)
        return out

    __call__ = decide  # a Policy is a DecideFn

    def _final_k(self, c: SpecCandidate, k: int) -> int:
        if self.config.allow_request_override and c.speculation == "off":
            return 0
        if c.proposer is None or c.k_max <= 0:
            return c.forced
        if self.config.allow_request_override and c.speculation == "on" and k <= 0:
            k = self.config.override_k
        return max(c.forced, min(k, c.k_max))

    # ------------------------------------------------------------------ reporting

    def describe(self) -> dict[str, Any]:
        """Name and parameters, for a stats endpoint."""
        params = self.config.model_dump()
        params.pop("name", None)
        return {"name": self.name, "parameters": params}

    def decisions_as_dict(self) -> dict[str, int]:
        """``decisions`` with string keys (``"spec/4"``, ``"plain/0"``), JSON-friendly."""
        return {f"{path}/{k}": n for (path, k), n in sorted(self.decisions.items())}
