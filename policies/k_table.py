"""``k_table``: K looked up from the decode batch size in a fixed schedule.

Like TensorRT-LLM's ``draft_len_schedule`` ({4: 4, 8: 2, 32: 1}) and vLLM's
``num_speculative_tokens_per_batch_size``: rows ``{max_batch_size, k}`` sorted by strictly
ascending ``max_batch_size``; the first row with ``batch <= max_batch_size`` gives K (so a
batch exactly at a row's bound uses that row), and a batch above the last row gets
``default_k`` (0: plain). The table may also be written as a mapping
``{max_batch_size: k}`` in YAML.
"""

from __future__ import annotations

import bisect
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from policies.base import Policy, PolicyConfigBase, batch_size
from workers.config import MAX_SPECULATIVE_TOKENS
from workers.decision import SpecCandidate
from workers.stats import LoadSnapshot


class KTableEntry(BaseModel):
    """One row of the schedule: batches up to ``max_batch_size`` use ``k`` drafts."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch_size: int = Field(ge=0, description="Largest decode batch (inclusive) this row applies to.")
    k: int = Field(ge=0, le=MAX_SPECULATIVE_TOKENS, description="Draft tokens per request for such batches.")


def _default_table() -> list[KTableEntry]:
    return [KTableEntry(max_batch_size=1, k=4), KTableEntry(max_batch_size=4, k=2), KTableEntry(max_batch_size=8, k=1)]


class KTableConfig(PolicyConfigBase):
    """K per decode-batch-size range."""

    name: Literal["k_table"] = Field("k_table", description="Policy name.")
    table: list[KTableEntry] = Field(
        default_factory=_default_table,
        min_length=1,
        description="Rows {max_batch_size, k}, max_batch_size strictly ascending; a mapping "
        "{max_batch_size: k} is accepted too.",
    )
    default_k: int = Field(
        0, ge=0, le=MAX_SPECULATIVE_TOKENS, description="K for a batch larger than the last row's max_batch_size."
    )

    @field_validator("table", mode="before")
    @classmethod
    def _mapping_to_rows(cls, v: Any) -> Any:
        if isinstance(v, dict):
            return [{"max_batch_size": b, "k": k} for b, k in v.items()]
        return v

    @field_validator("table")
    @classmethod
    def _ascending(cls, rows: list[KTableEntry]) -> list[KTableEntry]:
        for prev, row in zip(rows, rows[1:]):
            if row.max_batch_size <= prev.max_batch_size:
                raise ValueError(
                    f"max_batch_size must be strictly ascending: {row.max_batch_size} follows {prev.max_batch_size}"
                )
        return rows


class KTablePolicy(Policy[KTableConfig]):
    name = "k_table"
    config_cls = KTableConfig

    def lookup(self, batch: int) -> int:
        """K for a decode batch of ``batch`` requests."""
        bounds = [r.max_batch_size for r in self.config.table]
        i = bisect.bisect_left(bounds, batch)  # first row with max_batch_size >= batch
        return self.config.table[i].k if i < len(bounds) else self.config.default_k

    def choose_k(self, snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        return [self.lookup(batch_size(snapshot, candidates))] * len(candidates)
