"""Presence, frequency (OpenAI) and repetition (vLLM) penalties on the target's logits.

Applied to a verify step's rows before the token is chosen, each row seeing exactly the tokens
before its own position: the committed output, then the drafts ahead of that row. A verify row is
thus penalized as the plain step at that position would be, so speculation leaves penalized output
unchanged too. Every operation is elementwise within a row, so batch invariance is kept.
"""

from __future__ import annotations

from typing import Sequence

import torch

from workers.sampling_params import SamplingParams


def penalize_rows(
    logits: torch.Tensor,  # [n + 1, V] float32 raw logits of one request's verify rows
    prompt_ids: Sequence[int],  # [P]
    output_ids: Sequence[int],  # [O] committed output so far
    drafts: Sequence[int],  # [n] the drafts this step verifies; row j sees drafts[:j]
    sp: SamplingParams,
) -> torch.Tensor:  # [n + 1, V] penalized logits
    """vLLM's order: repetition (prompt and output) first, then frequency and presence (output only)."""
    rows, vocab = logits.shape
    dev = logits.device
    counts = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)  # [n + 1, V] output counts before each row
    if output_ids:
        counts += torch.bincount(torch.tensor(list(output_ids), device=dev), minlength=vocab).float()
    if drafts:
        step = torch.zeros(rows, vocab, dtype=torch.float32, device=dev)  # [n + 1, V]
        step[torch.arange(1, rows, device=dev), torch.tensor(list(drafts), device=dev)] = 1.0
        counts += step.cumsum(0)  # row j: drafts[:j] counted
    out = logits.float().clone()
    if sp.repetition_penalty != 1.0:
        seen = counts > 0  # [n + 1, V]
        if prompt_ids:
            seen[:, torch.tensor(list(prompt_ids), device=dev)] = True
        rp = sp.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / rp, out * rp), out)
    if sp.frequency_penalty != 0.0:
        out = out - sp.frequency_penalty * counts
    if sp.presence_penalty != 0.0:
        out = out - sp.presence_penalty * (counts > 0).float()
    return out
