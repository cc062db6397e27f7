"""One OpenAI request, many engine requests: ``n`` choices per prompt and batched prompts.

Each choice is its own engine request (its own seed, ``seed + i`` for the i-th choice of a seeded
request, so choices differ and each reproduces); this module holds the bookkeeping that turns their
chunks back into one response or one SSE stream: per-choice text and logprobs, and usage summed the
way OpenAI counts it (prompt tokens once per prompt, completion tokens over every choice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from deployments import protocol as P


@dataclass
class Choice:
    """What has arrived of one choice so far."""

    index: int
    prompt_index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[list] = field(default_factory=list)  # P.LogprobEntry per output token
    last: dict[str, Any] | None = None  # the latest chunk (usage, finish_reason once finished)
    prompt_logprobs: list[list] | None = None  # echo + logprobs: one entry per prompt token, first [id, None, None]
    observe: Callable[[dict[str, Any]], None] | None = field(default=None, repr=False)  # sees every chunk (telemetry)

    def add(self, chunk: dict[str, Any], prompt_ids: list[int] | None = None) -> None:
        if self.observe is not None:
            self.observe(chunk)
        if chunk.get("prompt_logprobs") is not None and prompt_ids is not None:
            self.prompt_logprobs = [[prompt_ids[0], None, None] if e is None else e for e in chunk["prompt_logprobs"]]
        self.parts.append(chunk["text"])
        self.logprobs.extend(chunk.get("logprobs") or [])
        self.last = chunk

    @property
    def text(self) -> str:
        return "".join(self.parts)


def seeded(params: dict[str, Any], i: int) -> dict[str, Any]:
    """The i-th choice's params: ``seed + i`` when seeded (choice 0 keeps the request's own seed)."""
    if params.get("seed") is None or i == 0:
        return params
    return {**params, "seed": params["seed"] + i}


def usage(choices: list[Choice]) -> dict[str, Any]:
    """OpenAI usage over all choices, plus our ``speculation`` block summed over them."""
    done = [c.last for c in choices if c.last is not None]
    if not done:
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    first_of_prompt: dict[int, dict] = {}
    for c in choices:
        if c.last is not None:
            first_of_prompt.setdefault(c.prompt_index, c.last)
    prompt = sum(x["num_prompt_tokens"] for x in first_of_prompt.values())
    cached = sum(x.get("num_cached_tokens", 0) for x in first_of_prompt.values())
    out = P.usage(done[0])
    spec = out["speculation"]
    for key, src in (
        ("spec_steps", "spec_steps"),
        ("plain_steps", "plain_steps"),
        ("draft_tokens", "num_draft_tokens"),
        ("accepted_tokens", "num_accepted_tokens"),
        ("grammar_draft_tokens", "num_grammar_draft_tokens"),
        ("grammar_accepted_tokens", "num_grammar_accepted_tokens"),
    ):
        spec[key] = sum(x["spec"].get(src, 0) for x in done)
    completion = sum(x["num_output_tokens"] for x in done)
    out.update(
        {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": 0},
        }
    )
    return out
