"""Verify draft tokens against the target in one pass: coupled verification or rejection sampling.

**Coupled verification** (:func:`verify_coupled`, the default; Daliri et al. 2024, "Coupling without
communication and drafter-invariant speculative decoding"): the target's token at output position
``t`` is its own sample from its processed ``p_t`` with position-keyed noise (workers/sampler.py,
``keyed_sample``; greedy is the zero-noise case, the argmax). A draft token is accepted iff it equals
that sample; at the first mismatch the target's sample is committed, and if all pass the sample one
past the last draft is the bonus. Every committed token is therefore exactly the token plain
decoding writes at that position, whatever K, proposer or path: the output is a function of the
request alone, and follows ``p`` exactly. A model draft that samples its ``q`` with the same keyed
noise agrees with the target as often as the Gumbel-max coupling allows; it sends no ``q``.

**Rejection sampling** (:func:`verify`, ``verification: rejection``):

The algorithm is speculative sampling (Leviathan et al. 2023, arXiv 2211.17192,
Algorithm 1; Chen et al. 2023, arXiv 2302.01318, Algorithm 2). For each draft
token ``x_j`` drawn from the proposer's ``q_j``, accept with probability
``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection emit a *recovered* token
from ``normalize(max(0, p_j - q_j))`` and stop; if all pass emit a *bonus* token
from ``p_k``. Every emitted token then follows the target's processed
distribution ``p`` exactly, which is the promise the whole system rests on:
speculation never changes what the model writes. Greedy requests use the
deterministic limit of the same rule: accept while the draft equals the argmax.

Random draws per sampled request, in this order, from its own generator: one
uniform per draft token, then one exponential per vocabulary entry for the
emitted token (``workers.sampler.sample``). The count depends only on that
request, so a seeded request gives the same tokens in any batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers import native_attention
from workers.sampler import process_logits, sample, sample_rows, sampling_tensors
from workers.sampling_params import SamplingParams


@dataclass
class VerifyOutput:
    """What one verify pass commits, per request."""

    # per request: accepted drafts then one recovered or bonus token; len = num_accepted + 1
    output_token_ids: list[list[int]]
    num_accepted: list[int]  # per request, 0 <= num_accepted_i <= num_draft_i


def verify(
    target_logits: torch.Tensor,  # [sum_i (num_draft_i + 1), vocab] float32 raw target logits, see below
    draft_token_ids: list[list[int]],  # per request [num_draft_i], may be empty (a plain step)
    draft_probs: list[torch.Tensor | None],  # per request [num_draft_i, vocab] processed draft probs, None = one-hot q
    params: list[SamplingParams],  # per request
    generators: list[torch.Generator | None],  # per request, None = global RNG
) -> VerifyOutput:
    """Accept a prefix of each request's drafts and add one recovered or bonus token.

    Greedy requests give exactly the tokens plain greedy decoding gives; sampled
    requests give tokens distributed exactly as plain sampling from
    ``process_logits(target_logits)``. With no drafts this is one plain decode step.

    Request ``i`` owns ``num_draft_i + 1`` consecutive rows of ``target_logits``, in
    request order; its row ``j`` is the target's distribution for the token after
    draft ``j - 1`` (row 0: after the last committed token, the last row: the bonus).
    """
    num_reqs = len(draft_token_ids)
    if not (len(draft_probs) == len(params) == len(generators) == num_reqs):
        raise ValueError("draft_token_ids, draft_probs, params and generators must have one entry per request")
    num_draft = [len(d) for d in draft_token_ids]
    row_start = list(itertools.accumulate((n + 1 for n in num_draft), initial=0))
    if target_logits.shape[0] != row_start[-1]:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, drafts need {row_start[-1]}")

    num_accepted = [0] * num_reqs
    final_token = [0] * num_reqs
    greedy = [i for i in range(num_reqs) if params[i].greedy]
    sampled = [i for i in range(num_reqs) if not params[i].greedy]
    if greedy:
        acc, tok = _verify_greedy(target_logits, [draft_token_ids[i] for i in greedy], [row_start[i] for i in greedy])
        for i, a, t in zip(greedy, acc, tok):
            num_accepted[i], final_token[i] = a, t
    if sampled:
        acc, tok = _verify_sampled(
            target_logits,
            [draft_token_ids[i] for i in sampled],
            [draft_probs[i] for i in sampled],
            [params[i] for i in sampled],
            [generators[i] for i in sampled],
            [row_start[i] for i in sampled],
        )
        for i, a, t in zip(sampled, acc, tok):
            num_accepted[i], final_token[i] = a, t
    outputs = [draft_token_ids[i][: num_accepted[i]] + [final_token[i]] for i in range(num_reqs)]
    return VerifyOutput(output_token_ids=outputs, num_accepted=num_accepted)


def verify_coupled(
    target_logits: torch.Tensor,  # [sum_i (num_draft_i + 1), vocab] float32 raw target logits, as in verify
    draft_token_ids: list[list[int]],  # per request [num_draft_i], may be empty (a plain step)
    params: list[SamplingParams],  # per request
    row_keys: list[list[int]],  # per request [num_draft_i + 1] position keys of its rows (ignored if greedy)
    target_argmax: Sequence[int] | None = None,  # [sum_i (num_draft_i + 1)] target_logits.argmax(dim=-1), if known
) -> VerifyOutput:
    """Accept the drafts that equal the target's own position-keyed samples, then one more sample. A caller
    that has the logits' argmax (the forward finds it beside them) passes it: the greedy rows' tokens. A step
    of greedy rows without drafts then runs no torch op (each costs tens of microseconds in a decode step,
    whose streamed weights have evicted torch's code)."""
    num_reqs = len(draft_token_ids)
    if not (len(params) == len(row_keys) == num_reqs):
        raise ValueError("draft_token_ids, params and row_keys must have one entry per request")
    num_draft = [len(d) for d in draft_token_ids]
    row_start = list(itertools.accumulate((n + 1 for n in num_draft), initial=0))
    if target_logits.shape[0] != row_start[-1]:
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, drafts need {row_start[-1]}")
    if target_argmax is not None and len(target_argmax) != target_logits.shape[0]:
        raise ValueError(f"target_argmax has {len(target_argmax)} rows, the logits {target_logits.shape[0]}")
    sampled = [i for i in range(num_reqs) if not params[i].greedy]
    for i in sampled:
        if len(row_keys[i]) != num_draft[i] + 1:
            raise ValueError(f"request {i}: {len(row_keys[i])} row keys for {num_draft[i] + 1} rows")
    if not any(num_draft):  # a plain step: row i is request i's only row; the sampled rows are drawn, the rest argmax
        if target_argmax is not None:
            tokens = list(target_argmax)
        else:
            tokens = argmax(target_logits).tolist() if len(sampled) < num_reqs else [0] * num_reqs
        if sampled:
            keys = [row_keys[i][0] for i in sampled]
            picked = sample_rows(target_logits, sampled, [params[i] for i in sampled], keys)
            for i, t in zip(sampled, picked):
                tokens[i] = t
        return VerifyOutput(output_token_ids=[[t] for t in tokens], num_accepted=[0] * num_reqs)
    device = target_logits.device
    target_ids = (  # [R]: the greedy rows' tokens (a tensor of its own: the sampled rows are written below)
        argmax(target_logits) if target_argmax is None else torch.tensor(target_argmax, dtype=torch.long, device=device)
    )
    if sampled:  # each sampled row's token: the race on the target's processed probabilities p
        rows = [r for i in sampled for r in range(row_start[i], row_start[i + 1])]
        row_params = [params[i] for i in sampled for _ in range(num_draft[i] + 1)]
        picked = sample_rows(target_logits, rows, row_params, [k for i in sampled for k in row_keys[i]])
        target_ids[torch.tensor(rows, device=device)] = torch.tensor(picked, dtype=torch.long, device=device)
    drafts, lengths = _padded(draft_token_ids, device)  # [B, K], [B]
    pos = torch.arange(drafts.shape[1] + 1, device=device)  # [K + 1]
    starts = torch.tensor(row_start[:-1], dtype=torch.long, device=device)  # [B]
    per_row = target_ids[starts.unsqueeze(1) + torch.minimum(pos.unsqueeze(0), lengths.unsqueeze(1))]  # [B, K + 1]
    valid = pos[:-1].unsqueeze(0) < lengths.unsqueeze(1)  # [B, K]
    accepted = _num_leading(valid & (drafts == per_row[:, :-1]))  # [B]
    final = per_row.gather(1, accepted.unsqueeze(1)).squeeze(1)  # [B]
    acc = accepted.tolist()
    outputs = [draft_token_ids[i][: acc[i]] + [t] for i, t in enumerate(final.tolist())]
    return VerifyOutput(output_token_ids=outputs, num_accepted=acc)


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R] long
    """``logits.argmax(dim=-1)``: on the CPU through the native kernel (the same indices, a few times faster over
    a vocabulary), else torch's."""
    ops = native_attention.load_layer_ops() if logits.device.type == "cpu" else None
    native = logits.dtype == torch.float32 and logits.dim() == 2 and logits.is_contiguous() and logits.numel() > 0
    return ops.argmax(logits) if ops is not None and native else logits.argmax(dim=-1)


def _padded(
    draft_token_ids: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:  # drafts [num_reqs, max_k] long (0-padded), lengths [num_reqs] long
    max_k = max(len(d) for d in draft_token_ids)
    drafts = torch.tensor([d + [0] * (max_k - len(d)) for d in draft_token_ids], dtype=torch.long, device=device)
    lengths = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.long, device=device)
    return drafts.view(len(draft_token_ids), max_k), lengths


def _num_leading(
    ok: torch.Tensor,  # [num_reqs, max_k] bool, False past each request's drafts
) -> torch.Tensor:  # [num_reqs] long: how many leading entries are True
    return ok.long().cumprod(dim=1).sum(dim=1)


def _verify_greedy(
    target_logits: torch.Tensor,  # [num_rows, vocab]
    draft_token_ids: list[list[int]],  # per greedy request [num_draft_i]
    row_start: list[int],  # per greedy request: its first row in target_logits
) -> tuple[list[int], list[int]]:  # num_accepted, final (recovered or bonus) token per request
    """Accept while the draft equals the target's argmax; then emit that argmax.

    Row ``num_accepted`` is exactly the row plain decoding would have computed next,
    so its argmax is the recovered token at a mismatch and the bonus if all match.
    """
    device = target_logits.device
    drafts, lengths = _padded(draft_token_ids, device)  # [B, K], [B]
    starts = torch.tensor(row_start, dtype=torch.long, device=device)  # [B]
    pos = torch.arange(drafts.shape[1] + 1, device=device)  # [K + 1]
    rows = starts.unsqueeze(1) + torch.minimum(pos.unsqueeze(0), lengths.unsqueeze(1))  # [B, K + 1]
    target_ids = argmax(target_logits[rows.flatten()]).view(rows.shape)  # [B, K + 1]
    valid = pos[:-1].unsqueeze(0) < lengths.unsqueeze(1)  # [B, K]
    accepted = _num_leading(valid & (drafts == target_ids[:, :-1]))  # [B]
    final = target_ids.gather(1, accepted.unsqueeze(1)).squeeze(1)  # [B]
    return accepted.tolist(), final.tolist()


def _residual(
    p: torch.Tensor,  # [n, vocab] target probs at the rejected position
    q: torch.Tensor,  # [n, vocab] draft probs at the rejected position
) -> torch.Tensor:  # [n, vocab] normalize(max(0, p - q)), or p where that is all zero
    """The recovered-token distribution (Leviathan et al. 2023, Theorem 1's ``p'``).

    ``max(0, p - q)`` sums to zero only when ``p == q``, where rejection has
    probability zero; falling back to ``p`` keeps the output valid if rounding
    makes it happen anyway.
    """
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(residual.dtype).tiny), p)


def _verify_sampled(
    target_logits: torch.Tensor,  # [num_rows, vocab]
    draft_token_ids: list[list[int]],  # per sampled request [num_draft_i]
    draft_probs: list[torch.Tensor | None],  # per sampled request [num_draft_i, vocab] or None (one-hot)
    params: list[SamplingParams],  # per sampled request
    generators: list[torch.Generator | None],  # per sampled request
    row_start: list[int],  # per sampled request: its first row in target_logits
) -> tuple[list[int], list[int]]:  # num_accepted, final (recovered or bonus) token per request
    """Rejection sampling, vectorized over the batch; only the uniform draws loop."""
    device, vocab = target_logits.device, target_logits.shape[1]
    num_draft = [len(d) for d in draft_token_ids]
    # p for every row the sampled requests own, with each request's own transform.
    rows = [r for start, n in zip(row_start, num_draft) for r in range(start, start + n + 1)]
    counts = torch.tensor([n + 1 for n in num_draft], device=device)  # [B]
    row_params = (t.repeat_interleave(counts) for t in sampling_tensors(params, device))
    p = process_logits(target_logits[torch.tensor(rows, device=device)], *row_params)  # [R, vocab]
    p_start = torch.tensor(list(itertools.accumulate(num_draft[:-1], lambda a, n: a + n + 1, initial=0)), device=device)
    drafts, lengths = _padded(draft_token_ids, device)  # [B, K], [B]
    num_total = sum(num_draft)
    if num_total == 0:  # plain decode step for every request
        return [0] * len(num_draft), sample(p[p_start], generators).tolist()

    # q for every draft position, flat [D, vocab]: given rows, or one-hot at the draft token.
    d_start = list(itertools.accumulate(num_draft, initial=0))
    q = torch.zeros(num_total, vocab, dtype=torch.float32, device=device)  # [D, vocab]
    tokens = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=device)  # [D]
    given = {b: q_b for b, q_b in enumerate(draft_probs) if num_draft[b] and q_b is not None}  # b -> [n_b, vocab]
    one_hot = [b for b, n in enumerate(num_draft) if n and draft_probs[b] is None]
    for b, q_b in given.items():
        if tuple(q_b.shape) != (num_draft[b], vocab):
            raise ValueError(f"draft_probs[{b}] has shape {tuple(q_b.shape)}, want {(num_draft[b], vocab)}")
    if given:
        idx = torch.tensor([d for b in given for d in range(d_start[b], d_start[b + 1])], device=device)
        q[idx] = torch.cat([q_b.to(device=device, dtype=torch.float32) for q_b in given.values()])
    if one_hot:
        idx = torch.tensor([d for b in one_hot for d in range(d_start[b], d_start[b + 1])], device=device)
        q[idx, tokens[idx]] = 1.0

    # One uniform per draft token, in request order, from the request's generator.
    u_flat = torch.empty(num_total, dtype=torch.float32, device=device)  # [D]
    unseeded = [d for b, g in enumerate(generators) if g is None for d in range(d_start[b], d_start[b + 1])]
    if unseeded:
        u_flat[torch.tensor(unseeded, device=device)] = torch.rand(len(unseeded), device=device)
    for b, g in enumerate(generators):
        if g is not None and num_draft[b]:
            u_flat[d_start[b] : d_start[b + 1]] = torch.rand(num_draft[b], generator=g, device=device)

    valid = torch.arange(drafts.shape[1], device=device).unsqueeze(0) < lengths.unsqueeze(1)  # [B, K]
    p_rows = (p_start.unsqueeze(1) + torch.arange(drafts.shape[1], device=device))[valid]  # [D]
    p_x = p[p_rows, tokens]  # [D] p_j(x_j): target prob of each draft token
    q_x = q[torch.arange(num_total, device=device), tokens]  # [D] q_j(x_j): draft prob of each draft token
    # Accept iff u <= min(1, p/q), written u * q <= p to avoid dividing by q. A token
    # the target cannot emit (p == 0) is never accepted, even if q == 0 too.
    accept_flat = (p_x > 0) & (u_flat * q_x <= p_x)  # [D]
    accept = torch.zeros_like(valid)  # [B, K]
    accept[valid] = accept_flat
    accepted = _num_leading(accept)  # [B]

    # Bonus from p at row num_accepted when all passed, else recovered from the residual there.
    final = p[p_start + accepted]  # [B, vocab]
    rejected = (accepted < lengths).nonzero().squeeze(1)  # [num_rejected]
    if rejected.numel():
        q_rows = torch.tensor(d_start[:-1], device=device)[rejected] + accepted[rejected]
        final[rejected] = _residual(final[rejected], q[q_rows])
    return accepted.tolist(), sample(final, generators).tolist()
