"""The two fixed policies: ``never`` (always plain) and ``always`` (always K drafts).

They are baselines for benchmarks and the explicit way to pin a deployment to one path.
Request overrides still apply (see policies/base.py): with ``allow_request_override`` a
request can opt in under ``never`` and opt out under ``always``.
"""

from __future__ import annotations

from typing import Literal, Sequence

from pydantic import Field

from policies.base import Policy, PolicyConfigBase
from workers.config import MAX_SPECULATIVE_TOKENS
from workers.decision import SpecCandidate
from workers.stats import LoadSnapshot


class NeverConfig(PolicyConfigBase):
    """Plain decoding for every request that does not ask for speculation itself."""

    name: Literal["never"] = Field("never", description="Policy name.")


class AlwaysConfig(PolicyConfigBase):
    """Speculate with a fixed K regardless of load."""

    name: Literal["always"] = Field("always", description="Policy name.")
    num_speculative_tokens: int = Field(
        4, ge=1, le=MAX_SPECULATIVE_TOKENS, description="K: draft tokens per request per step."
    )


class NeverPolicy(Policy[NeverConfig]):
    name = "never"
    config_cls = NeverConfig

    def choose_k(self, snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        return [0] * len(candidates)


class AlwaysPolicy(Policy[AlwaysConfig]):
    name = "always"
    config_cls = AlwaysConfig

    def choose_k(self, snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        return [self.config.num_speculative_tokens] * len(candidates)
