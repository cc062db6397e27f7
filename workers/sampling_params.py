"""Per-request sampling parameters, validated once at submission.

Field names follow the OpenAI API so the ingress can pass them straight through.
Validation errors are pydantic ``ValidationError``s whose messages name the field,
which the engine re-raises as ``InvalidRequestError`` (see ``workers/errors.py``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How one request turns target logits into tokens.

    ``temperature == 0`` means greedy (argmax); speculation is then checked by exact
    match. For ``temperature > 0`` the same temperature / top-k / top-p transform is
    applied to the target's and the draft's logits before rejection sampling, so the
    accepted tokens follow the target's *processed* distribution exactly.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, ge=1, description="Maximum number of tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept, in (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    seed: int | None = Field(None, description="Per-request RNG seed; same seed + same request = same output.")
    stop: tuple[str, ...] = Field((), description="Stop strings; the matched string is not emitted.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")
    logprobs: int | None = Field(
        None, ge=0, le=20,
        description="Return each output token's log probability under the target (raw logits, before temperature "
        "/ top-k / top-p) and this many most likely alternatives; None = off.",
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_tuple(cls, v: object) -> object:
        if v is None:
            return ()
        if isinstance(v, str):
            return (v,)
        if isinstance(v, list):
            return tuple(v)
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
