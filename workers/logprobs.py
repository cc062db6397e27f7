"""Log probabilities of chosen tokens, from the raw logits rows that decided them.

One helper for output tokens (the verify rows) and prompt tokens (the prefill rows that predict
them): log-softmax over the raw logits (before temperature and penalties, as vLLM's default
``raw_logprobs``), the chosen token's value and the ``top_k`` most likely alternatives.
"""

from __future__ import annotations

from typing import Sequence

import torch

from workers.request import TokenLogprob


def token_logprobs(
    logits: torch.Tensor,  # [n, vocab] raw logits, row i decided token_ids[i]
    token_ids: Sequence[int],  # [n]
    top_k: int,
) -> list[TokenLogprob]:
    if len(token_ids) == 0:
        return []
    lp = logits.float().log_softmax(dim=-1)  # [n, vocab]
    ids = torch.tensor(list(token_ids), device=logits.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if top_k:
        vals, idx = lp.topk(top_k, dim=-1)  # [n, top_k]
        tops = [tuple(zip(i, v)) for i, v in zip(idx.tolist(), vals.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, c, top) for t, c, top in zip(token_ids, chosen, tops)]
