"""Loading the generated shards, the reduced draft vocabulary, and length-bucketed batches.

A record (training/datagen.py) holds ``token_ids`` t_0..t_n, ``hidden`` f_0..f_{n-1} (fp16, the
target's final-norm hidden state at each position; f_p predicts t_{p+1}) and
``num_prompt_tokens``. Losses are taken where the *predicted* token is a response token:
positions ``p >= num_prompt_tokens - 1``.
"""

from __future__ import annotations

import collections
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from training.common import data_dir


@dataclass
class Seq:
    token_ids: torch.Tensor  # [n + 1] long
    hidden: torch.Tensor  # [n, hidden] fp16
    num_prompt_tokens: int

    @property
    def n(self) -> int:
        return self.hidden.shape[0]


def load_shards(path: Path | None = None, max_len: int = 512) -> list[Seq]:
    """Every record of every shard, in shard order (sequences cut to ``max_len`` features)."""
    d = path or data_dir()
    seqs: list[Seq] = []
    for f in sorted(d.glob("shard_*.pt")):
        for r in torch.load(f, weights_only=False):
            n = min(r["hidden"].shape[0], max_len)
            if n <= r["num_prompt_tokens"]:  # no response position to learn from
                continue
            seqs.append(Seq(torch.tensor(r["token_ids"][: n + 1]), r["hidden"][:n], r["num_prompt_tokens"]))
    return seqs


def split(seqs: list[Seq], val_frac: float = 0.04, seed: int = 0) -> tuple[list[Seq], list[Seq]]:
    """A fixed validation slice of the *training prompts'* responses (held-out prompts are for the benchmark)."""
    idx = list(range(len(seqs)))
    random.Random(seed).shuffle(idx)
    nv = max(1, int(len(seqs) * val_frac))
    return [seqs[i] for i in idx[nv:]], [seqs[i] for i in idx[:nv]]


def draft_vocab(seqs: list[Seq], size: int, always: list[int]) -> torch.Tensor:
    """The ``size`` most frequent response tokens (plus ``always``, e.g. EOS), sorted: the ``d2t`` map."""
    counts: collections.Counter[int] = collections.Counter()
    for s in seqs:
        counts.update(s.token_ids[s.num_prompt_tokens :].tolist())
        counts.update(s.token_ids[: s.num_prompt_tokens].tolist())  # prompt words get echoed in answers
    chosen = [t for t in always]
    for t, _ in counts.most_common():
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(seqs: list[Seq], d2t: torch.Tensor) -> float:
    """Share of response tokens inside the draft vocabulary."""
    inside = torch.zeros(int(d2t.max()) + 1 + 1, dtype=torch.bool)
    inside[d2t] = True
    tot = hit = 0
    for s in seqs:
        r = s.token_ids[s.num_prompt_tokens :]
        tot += r.numel()
        hit += int(inside[r.clamp(max=inside.numel() - 1)].sum()) if r.numel() else 0
    return hit / max(tot, 1)


def make_batches(seqs: list[Seq], batch_tokens: int, seed: int) -> list[list[int]]:
    """Indices grouped by similar length, about ``batch_tokens`` padded tokens per batch, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].n)
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and (len(cur) + 1) * seqs[i].n > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    random.Random(seed).shuffle(batches)
    return batches


def collate(seqs: list[Seq], idxs: list[int]) -> dict[str, torch.Tensor]:
    """Right-padded tensors for one batch.

    Returns ``ids`` [B, T] (t_0..t_{T-1}), ``next_ids`` [B, T] (t_1..t_T), ``feats`` [B, T, hidden]
    float32 (f_0..f_{T-1}), ``valid`` [B, T] (a real position), ``loss_mask`` [B, T] (position p
    predicts a response token t_{p+1}).
    """
    T = max(seqs[i].n for i in idxs)
    B = len(idxs)
    H = seqs[idxs[0]].hidden.shape[1]
    ids = torch.zeros(B, T, dtype=torch.long)
    nxt = torch.zeros(B, T, dtype=torch.long)
    feats = torch.zeros(B, T, H)
    valid = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, i in enumerate(idxs):
        s = seqs[i]
        ids[b, : s.n] = s.token_ids[: s.n]
        nxt[b, : s.n] = s.token_ids[1 : s.n + 1]
        feats[b, : s.n] = s.hidden.float()
        valid[b, : s.n] = True
        loss_mask[b, max(0, s.num_prompt_tokens - 1) : s.n] = True
    return {"ids": ids, "next_ids": nxt, "feats": feats, "valid": valid, "loss_mask": loss_mask}
