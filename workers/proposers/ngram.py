"""N-gram (prompt lookup) proposer: copy what followed the last n tokens earlier on.

Prompt lookup decoding (Saxena 2023; HF ``prompt_lookup_num_tokens``; vLLM's
``ngram`` method): copy-heavy work (edits, quotes, code changes, extraction)
repeats spans of the prompt, so the tokens that followed an earlier occurrence of
the last few tokens are a good, free guess of what comes next. It needs no
weights and costs only CPU time, but it must run every engine step for every
request, so the search is a vectorized numpy scan over a per-request token
buffer that is extended with only the new tokens each call.

Match rule (documented because implementations differ):

* Longest match wins: for ``n`` from ``max_n`` down to ``min_n``, the first ``n``
  whose suffix n-gram ``tokens[L-n:L]`` occurs earlier is used.
* Among occurrences of that n-gram, the **most recent** one wins (the one ending
  closest to, but strictly before, the end; the suffix itself is excluded). HF
  prompt lookup and vLLM v1 take the *earliest* occurrence. We take the most
  recent because in edit / rewrite tasks the nearest copy is the one the model is
  currently following (it already carries the edits made so far), and in
  repetition loops the most recent period is the one that repeats.
* Overlapping copy (as in LZ77): if the occurrence ends ``d < k`` tokens before
  the end, its continuation runs into the suffix and then repeats with period
  ``d``, so a periodic tail (``a b a b a``) still yields ``k`` draft tokens
  instead of stopping at the end of the sequence as HF and vLLM do.
* Never across EOS: the draft stops before the first token in ``eos_token_ids``.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from workers.proposers.base import ProposalRequest, Proposals, Proposer

# Token ids are stored as int32 (vocabularies are far below 2**31); -1 is never a
# token, so it can mark "no token here" (sequence separators in the suffix cache).
TOKEN_DTYPE = np.int32


class NgramConfig(BaseModel):
    """How long an n-gram the proposer tries to match."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_n: int = Field(1, ge=1, description="Shortest suffix n-gram that may be matched.")
    max_n: int = Field(4, ge=1, description="Longest suffix n-gram tried first.")

    @model_validator(mode="after")
    def _min_le_max(self) -> NgramConfig:
        if self.min_n > self.max_n:
            raise ValueError(f"max_n ({self.max_n}) must be >= min_n ({self.min_n})")
        return self


class TokenBuffer:
    """A request's committed tokens as a growable numpy array.

    ``ProposalRequest.token_ids`` holds every token so far; converting all of it
    each step would cost O(L) Python work per request per step. The buffer keeps
    what it has seen and copies only the new tail (amortized O(1) per token via
    capacity doubling). If the tokens it holds no longer match (a request id
    reused, or a shorter sequence), it rebuilds from scratch.
    """

    __slots__ = ("_data", "_len")

    def __init__(self, capacity: int = 256) -> None:
        self._data = np.empty(max(capacity, 16), dtype=TOKEN_DTYPE)  # [capacity]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def sync(self, token_ids: Sequence[int]) -> np.ndarray:  # [L] int32 view, do not keep
        """Bring the buffer up to date with ``token_ids`` and return a view of it."""
        total = len(token_ids)
        seen = self._len
        # Committed tokens never change, so one O(1) check catches a reused id.
        if total < seen or (seen > 0 and int(token_ids[seen - 1]) != int(self._data[seen - 1])):
            seen = self._len = 0
        if total > seen:
            new = np.asarray(token_ids[seen:], dtype=TOKEN_DTYPE)  # [total - seen]
            if total > self._data.shape[0]:
                grown = np.empty(max(total, 2 * self._data.shape[0]), dtype=TOKEN_DTYPE)
                grown[:seen] = self._data[:seen]
                self._data = grown
            self._data[seen:total] = new
            self._len = total
        return self._data[: self._len]


def suffix_match_lengths(
    haystack: np.ndarray,  # [H] int32 token ids; -1 never matches a token
    ends: np.ndarray,  # [C] int64 candidate end positions, haystack[ends] == query[-1]
    query: np.ndarray,  # [Q] int32 token ids; its suffix is the pattern
    max_len: int,
) -> np.ndarray:  # [C] int64, 1 <= length <= max_len
    """For each candidate, how far ``haystack[..end]`` agrees with the tail of ``query``.

    Candidates are filtered as they fail, so the work is O(C) for the first
    compare and shrinks after; with ``max_len`` in the tens this is a few numpy
    calls per request.
    """
    lengths = np.ones(ends.shape[0], dtype=np.int64)  # [C]
    alive = np.arange(ends.shape[0])  # [A] indices into ends still matching
    limit = min(max_len, query.shape[0])
    for j in range(1, limit):
        pos = ends[alive] - j  # [A]
        ok = pos >= 0
        ok[ok] = haystack[pos[ok]] == query[-1 - j]
        alive = alive[ok]
        if alive.shape[0] == 0:
            break
        lengths[alive] += 1
    return lengths


def stop_at_eos(draft: np.ndarray, eos_token_ids: frozenset[int]) -> list[int]:
    """Cut the draft before its first EOS: nothing after EOS is ever verified."""
    tokens = draft.tolist()
    if eos_token_ids:
        for i, tok in enumerate(tokens):
            if tok in eos_token_ids:
                return tokens[:i]
    return tokens


class NgramProposer(Proposer):
    """Prompt-lookup proposer; see the module docstring for the match rule.

    Per-request state is only a :class:`TokenBuffer`, keyed by request id and
    freed in :meth:`finish`.
    """

    name = "ngram"

    def __init__(self, config: NgramConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("pass either an NgramConfig or keyword options, not both")
        # NgramConfig raises pydantic's ValidationError (a ValueError) naming the field.
        self.config = config if config is not None else NgramConfig(**options)
        self._buffers: dict[str, TokenBuffer] = {}

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        drafts: list[list[int]] = []
        for r in requests:
            buf = self._buffers.get(r.request_id)
            if buf is None:
                buf = self._buffers[r.request_id] = TokenBuffer(2 * len(r.token_ids))
            tokens = buf.sync(r.token_ids)  # [L]
            drafts.append(self.propose_one(tokens, r.k, r.eos_token_ids))
        return Proposals(draft_token_ids=drafts, draft_probs=[None] * len(requests))

    def propose_one(
        self,
        tokens: np.ndarray,  # [L] int32 every committed token
        k: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> list[int]:  # [<= k] draft token ids
        """The draft for one token sequence (pure function of its arguments)."""
        length = tokens.shape[0]
        min_n, max_n = self.config.min_n, self.config.max_n
        # An earlier occurrence must end at <= L-2 so that it has a continuation.
        if k <= 0 or length < min_n + 1:
            return []
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # [C] ascending
        if ends.shape[0] == 0:
            return []
        lengths = suffix_match_lengths(tokens, ends, tokens, max_n)  # [C]
        best = int(lengths.max())
        if best < min_n:
            return []
        end = int(ends[np.flatnonzero(lengths == best)[-1]])  # most recent occurrence
        period = length - 1 - end  # >= 1: distance between the occurrence and the suffix
        draft = tokens[end + 1 + np.arange(k) % period]  # [k] overlapping copy
        return stop_at_eos(draft, eos_token_ids)

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._buffers.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        """How many requests hold state (for tests and leak checks)."""
        return len(self._buffers)
