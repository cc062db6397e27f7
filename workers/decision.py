"""The per-step speculation decision the engine asks for: K for every running request.

The engine calls ``decide(snapshot, candidates)`` once per step for all requests that are
past their prompt. K = 0 means a plain step for that request, in the same batch as the
others' verify steps. The routing policies (policies/) implement this signature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from workers.stats import LoadSnapshot

Speculation = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class SpecCandidate:
    request_id: str
    proposer: str | None  # None: no proposer configured/chosen -> always plain
    speculation: Speculation  # the request's own wish; the policy decides whether to honour it
    k_max: int  # most drafts this request can take this step (max_tokens / context left)
    # grammar-forced tokens available as drafts this step (structured output; already within max_tokens and the
    # context). They cost no proposer work and are nearly always accepted, so every policy drafts at least these
    # unless the request is held plain ("off").
    forced: int = 0


DecideFn = Callable[[LoadSnapshot, Sequence[SpecCandidate]], list[int]]


def fixed_k(k: int) -> DecideFn:
    """The default before a routing policy is plugged in: K drafts unless the request said off."""

    def decide(snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        return [
            0 if c.speculation == "off" else c.forced if c.proposer is None else max(c.forced, min(k, c.k_max))
            for c in candidates
        ]

    return decide
