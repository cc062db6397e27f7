"""The proposer interface: the one thing every speculation method implements.

A proposer guesses up to ``k`` draft tokens per request; the target then verifies
them all in one forward pass (workers/rejection_sampler.py). Proposers that have
a distribution over their guesses (a draft model) return it so the rejection
sampler can use ``min(1, p/q)``; the others (n-gram, suffix) return ``None`` and
are treated as one-hot ``q``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from workers.sampler import position_key, process_params, sample, sample_rows
from workers.sampling_params import SamplingParams


@dataclass
class ProposalRequest:
    """What a proposer sees of one running request in one engine step."""

    request_id: str
    token_ids: Sequence[int]  # [num_prompt_tokens + num_output_tokens] every committed token so far
    num_prompt_tokens: int
    k: int  # number of draft tokens wanted this step, >= 1
    eos_token_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Only for proposers with ``needs_hidden_states`` (EAGLE): the target's final-norm hidden state at
    # positions 0 .. len(token_ids) - 2 (every committed token but the last, which the target has not
    # read yet). A read-only view of the engine's buffer: copy what you keep. None for other proposers.
    hidden_states: torch.Tensor | None = None  # [len(token_ids) - 1, hidden]
    # Coupled verification: a sampled draft is the keyed sample of q at its output position, with the
    # noise the target uses there (``sampling.seed`` is the request's resolved seed), and no q is sent.
    coupled: bool = False


@dataclass
class Proposals:
    """Draft tokens for a batch of requests, in the order they were asked for."""

    draft_token_ids: list[list[int]]  # per request: [num_draft_i], 0 <= num_draft_i <= k_i
    # per request: [num_draft_i, vocab] processed draft probabilities (same temperature /
    # top-k / top-p as the target), or None when the method has no distribution (one-hot q)
    draft_probs: list[torch.Tensor | None]


class Proposer(ABC):
    """One speculation method. Implementations hold no Ray and no target model."""

    name: str = "base"
    # True: the engine keeps the target's hidden states of this proposer's requests and passes them in
    # ProposalRequest.hidden_states (costs a norm over every fed row); False: the engine does no such work.
    needs_hidden_states: bool = False

    @abstractmethod
    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        """Propose up to ``r.k`` draft tokens for every request ``r`` in one batched call."""

    # Optional hooks: a no-op unless a proposer keeps per-request state or learns from feedback.
    def observe(self, request_id: str, num_draft_tokens: int, num_accepted: int) -> None:  # noqa: B027
        """Feedback after verification: how many of the proposed drafts the target accepted."""

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:  # noqa: B027
        """The request left the engine (finished or cancelled): free its state."""


def coupled_key(r: ProposalRequest, num_drafted: int) -> int | None:
    """The noise key of ``r``'s next draft (after ``num_drafted`` drafts this call) under coupled
    verification: that of the output position it would fill. None: not coupled, or greedy."""
    if not r.coupled or r.sampling.greedy:
        return None
    assert r.sampling.seed is not None, "the engine resolves every request's seed"
    return position_key(r.sampling.seed, len(r.token_ids) - r.num_prompt_tokens + num_drafted)


def draw_drafts(
    logits: torch.Tensor,  # [N, V] raw draft logits over the target vocabulary (-inf off the draft's own)
    rows: list[int],  # [S] the sampled rows
    params: list[SamplingParams],  # [S] their requests' sampling parameters
    keys: list[int | None],  # [S] coupled_key of each row (None: the draft's own stream)
    generator_of: Callable[[int], torch.Generator | None],  # a (0..S-1) -> that request's draft generator
) -> tuple[list[int], dict[int, torch.Tensor]]:  # [S] drafted token ids; a -> q [V] for the rows that must send it
    """Sample one draft token per row from its processed probabilities ``q``. Coupled rows take the keyed
    sample of the position they would fill (the target's own noise there) and send no q, so theirs is never
    formed where the race can run on the logits; the others draw from the draft's stream and send q for
    rejection sampling."""
    picked = [0] * len(rows)
    tied = [a for a, k in enumerate(keys) if k is not None]
    own = [a for a, k in enumerate(keys) if k is None]
    if tied:
        tied_keys = [k for k in keys if k is not None]
        for a, token in zip(tied, sample_rows(logits, [rows[a] for a in tied], [params[a] for a in tied], tied_keys)):
            picked[a] = token
    sent: dict[int, torch.Tensor] = {}
    if own:
        q = process_params(logits[[rows[a] for a in own]], [params[a] for a in own])  # [O, V]
        for j, (a, token) in enumerate(zip(own, sample(q, [generator_of(a) for a in own]).tolist())):
            picked[a], sent[a] = token, q[j]
    return picked, sent


def stack_draft_probs(
    requests: Sequence[ProposalRequest], q_rows: list[list[torch.Tensor]], vocab_size: int, device: torch.device
) -> list[torch.Tensor | None]:
    """Per request: None for greedy (one-hot q), else its q rows stacked ``[num_draft_i, vocab]``
    (an empty ``[0, vocab]`` when it drafted nothing). Shared by the proposers that have a q."""
    out: list[torch.Tensor | None] = []
    for r, rows in zip(requests, q_rows):
        if r.sampling.greedy or r.coupled:
            out.append(None)
        elif rows:
            out.append(torch.stack(rows))  # [num_draft_i, V]
        else:
            out.append(torch.zeros(0, vocab_size, device=device))
    return out
