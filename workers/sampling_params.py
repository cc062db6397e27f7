"""Per-request sampling parameters, validated once at submission.

Field names follow the OpenAI API so the ingress can pass them straight through.
Validation errors are pydantic ``ValidationError``s whose messages name the field,
which the engine re-raises as ``InvalidRequestError`` (see ``workers/errors.py``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator


class StructuredOutput(BaseModel):
    """A constraint on what the request may write (workers/grammar.py compiles it).

    ``kind``: ``json`` (``value`` is a JSON schema as canonical JSON text), ``json_object`` (any JSON
    object, no value), ``regex``, ``choice`` (``value`` is the tuple of allowed strings), ``grammar``
    (Lark or GBNF text, told apart by llguidance) or ``lark`` (Lark only: what the server writes itself, e.g.
    for tool calls). ``param`` is the request field it came from, which errors name.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json", "json_object", "regex", "choice", "grammar", "lark"]
    value: str | tuple[str, ...] | None = None
    param: str = Field("structured_outputs", description="The request field this came from (named in errors).")

    @model_validator(mode="after")
    def _value_fits_kind(self) -> StructuredOutput:
        if self.kind == "json_object":
            if self.value is not None:
                raise ValueError("json_object takes no value")
        elif self.kind == "choice":
            if not isinstance(self.value, tuple) or not self.value or not all(self.value):
                raise ValueError("choice needs a non-empty list of non-empty strings")
        elif not isinstance(self.value, str) or not self.value:
            raise ValueError(f"{self.kind} needs a non-empty string")
        return self


class SamplingParams(BaseModel):
    """How one request turns target logits into tokens.

    ``temperature == 0`` means greedy (argmax); speculation is then checked by exact
    match. For ``temperature > 0`` the same temperature / top-k / top-p transform is
    applied to the target's and the draft's logits before rejection sampling, so the
    accepted tokens follow the target's *processed* distribution exactly.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
        description="Return each prompt token's log probability given the tokens before it (the first has none) and "
        "this many alternatives: what eval harnesses score with. The request then prefills without the prefix cache.",
    )
    max_tokens: int = Field(
        16, ge=0, description="Maximum number of tokens to generate; 0 only scores the prompt (with prompt_logprobs)."
    )
    temperature: float = Field(0.0, ge=0.0, le=100.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus mass kept, in (0, 1].")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    seed: int | None = Field(None, description="Per-request RNG seed; same seed + same request = same output.")
    stop: tuple[str, ...] = Field((), description="Stop strings; the matched string is not emitted.")
    ignore_eos: bool = Field(False, description="Keep generating past EOS (benchmarks).")
    presence_penalty: float = Field(
        0.0,
        ge=-2.0,
        le=2.0,
        description="Subtracted once from a token's logit if it appears in the output so far (OpenAI semantics).",
    )
    frequency_penalty: float = Field(
        0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence of a token in the output so far."
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=10.0,
        description="vLLM's: a token in the prompt or output "
        "so far has a positive logit divided by it, a negative one multiplied; 1 = off.",
    )
    structured: StructuredOutput | None = Field(
        None, description="Constrain the output to a JSON schema, a regex, a choice or a grammar (workers/grammar.py)."
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=20,
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

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_only_to_score(cls, v: int, info: ValidationInfo) -> int:
        # prompt_logprobs is declared first, so it is validated (and in info.data) by now
        if v == 0 and info.data.get("prompt_logprobs") is None:
            raise ValueError("max_tokens must be at least 1 (0 only with prompt_logprobs)")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
