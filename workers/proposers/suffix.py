"""Suffix proposer: SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975).

Like the n-gram proposer it copies continuations of the current suffix, but it
searches two token stores and keeps frequencies, so it also pays on repetitive
*traffic* (agent loops, templated answers), not only on copy-heavy prompts:

* the request's own tokens (prompt + output, extended with only the new tokens
  each call), and
* a global cache of the last ``max_cached_requests`` finished requests' token
  sequences (added in :meth:`finish`, oldest evicted first).

Algorithm, following the paper and ArcticInference's ``_speculate_path``:

1. Match: the longest suffix of the current tokens, at most ``max_depth`` long,
   that occurs in a store (in the own store an occurrence must end before the
   current end, so the suffix never matches itself).
2. Choose: the own store when its match is at least as long as the global one
   (it knows this request's context); otherwise the global cache. If the chosen
   store yields no draft the other one is tried.
3. Grow: from the matched node, repeatedly follow the most frequent child (the
   next token seen most often after the occurrences still matching; ties go to
   the most recent occurrence). The draft's estimated probability is the product
   of the children's frequency shares ``count(child) / count(node)``; extension
   stops when it falls below ``min_token_prob``, at EOS (never included), or at
   ``min(k, ceil(max_spec_factor * match_len))`` tokens: longer matches are more
   trustworthy, so they earn longer drafts.

Representation: the paper's suffix tree is kept *implicit*. A trie node is the
set of positions where its string occurs; its count is the size of that set and
its children are the tokens that follow those positions. Storing the token
arrays (plus, for the global cache, a sorted index to find a token's positions)
answers exactly the same queries as a depth-limited suffix trie, with memory
O(tokens) instead of O(tokens * depth) Python nodes, and it makes eviction a
plain array drop. ``max_depth`` caps the pattern length, as the trie depth does.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from workers.proposers.base import ProposalRequest, Proposals, Proposer
from workers.proposers.ngram import TOKEN_DTYPE, TokenBuffer, suffix_match_lengths

_NO_TOKEN = -1  # separates cached sequences and ends the last one: "no continuation"


class SuffixConfig(BaseModel):
    """SuffixDecoding knobs; defaults follow vLLM's ``suffix`` method."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_depth: int = Field(24, ge=1, description="Longest suffix pattern matched.")
    max_cached_requests: int = Field(
        64, ge=0, description="Finished requests kept in the global cache; 0 = own tokens only."
    )
    max_spec_factor: float = Field(1.0, gt=0.0, description="Draft length <= ceil(max_spec_factor * match_len).")
    min_token_prob: float = Field(
        0.1, ge=0.0, le=1.0, description="Stop when the draft's estimated probability drops below this."
    )


class GlobalSuffixCache:
    """Token sequences of recently finished requests, searchable by suffix.

    The sequences are concatenated with ``-1`` separators (a match can never
    cross one, and a continuation reading ``-1`` has ended). The sorted index is
    rebuilt lazily at the next lookup after a change, so many requests finishing
    between two engine steps cost one rebuild.
    """

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._seqs: deque[np.ndarray] = deque()  # each [len_i] int32
        self._dirty = False
        self._tokens = np.full(1, _NO_TOKEN, dtype=TOKEN_DTYPE)  # [H] concat + separators
        self._order = np.zeros(0, dtype=np.int64)  # [H'] positions of real tokens, by token id
        self._sorted = np.zeros(0, dtype=TOKEN_DTYPE)  # [H'] tokens[_order]

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, token_ids: Sequence[int]) -> None:
        """Cache one finished sequence, evicting the oldest beyond ``max_requests``."""
        if self.max_requests == 0 or len(token_ids) == 0:
            return
        self._seqs.append(np.asarray(token_ids, dtype=TOKEN_DTYPE).copy())
        while len(self._seqs) > self.max_requests:
            self._seqs.popleft()
        self._dirty = True

    @property
    def tokens(self) -> np.ndarray:  # [H] int32 cached sequences, each followed by -1
        """All cached tokens, concatenated; positions index :meth:`occurrences`."""
        if self._dirty:
            self._rebuild()
        return self._tokens

    def occurrences(self, token: int) -> np.ndarray:  # [C] int64 ascending positions
        """Every position in :attr:`tokens` holding ``token``."""
        if self._dirty:
            self._rebuild()
        lo, hi = np.searchsorted(self._sorted, [token, token + 1])
        return self._order[lo:hi]

    def _rebuild(self) -> None:
        parts: list[np.ndarray] = []
        sep = np.full(1, _NO_TOKEN, dtype=TOKEN_DTYPE)
        for seq in self._seqs:
            parts += [seq, sep]
        self._tokens = np.concatenate(parts) if parts else sep  # [H]
        order = np.argsort(self._tokens, kind="stable")  # [H] stable: positions ascend per token
        self._order = order[self._tokens[order] != _NO_TOKEN]
        self._sorted = self._tokens[self._order]
        self._dirty = False


def grow_draft(
    haystack: np.ndarray,  # [H] int32; -1 = no continuation
    ends: np.ndarray,  # [C] int64 end positions of the matched pattern (the trie node)
    max_tokens: int,
    min_token_prob: float,
    eos_token_ids: frozenset[int],
) -> list[int]:  # [<= max_tokens]
    """Follow the most frequent child from a trie node (path speculation)."""
    draft: list[int] = []
    prob = 1.0
    while len(draft) < max_tokens and ends.shape[0] > 0:
        nxt_pos = ends + 1  # [C]
        inside = nxt_pos < haystack.shape[0]
        nxt = np.full(ends.shape[0], _NO_TOKEN, dtype=TOKEN_DTYPE)  # [C]
        nxt[inside] = haystack[nxt_pos[inside]]
        has_child = nxt != _NO_TOKEN
        if not has_child.any():
            break
        # Children counts; reversed so return_index finds each token's most recent position.
        rev = nxt[has_child][::-1]
        tokens, first_rev, counts = np.unique(rev, return_index=True, return_counts=True)
        top = np.flatnonzero(counts == counts.max())
        best = int(top[np.argmin(first_rev[top])])  # tie: most recent occurrence
        # The node count includes occurrences that end here (no child): count(node) = C.
        prob *= float(counts[best]) / ends.shape[0]
        token = int(tokens[best])
        if prob < min_token_prob or token in eos_token_ids:
            break
        draft.append(token)
        ends = nxt_pos[has_child & (nxt == token)]
    return draft


class _Match:
    """The longest suffix match in one store: the trie node it lands on."""

    __slots__ = ("haystack", "ends", "length")

    def __init__(self, haystack: np.ndarray, ends: np.ndarray, length: int) -> None:
        self.haystack = haystack  # [H] int32
        self.ends = ends  # [C] int64 positions where the matched pattern ends
        self.length = length  # match_len, 0 = no match


def longest_match(
    haystack: np.ndarray,  # [H] int32
    candidates: np.ndarray,  # [C] int64 positions holding query[-1]
    query: np.ndarray,  # [Q] int32
    max_depth: int,
) -> _Match:
    """Longest suffix of ``query`` (<= ``max_depth``) ending at one of ``candidates``."""
    if candidates.shape[0] == 0:
        return _Match(haystack, candidates, 0)
    lengths = suffix_match_lengths(haystack, candidates, query, max_depth)  # [C]
    best = int(lengths.max())
    return _Match(haystack, candidates[lengths == best], best)


class SuffixProposer(Proposer):
    """SuffixDecoding proposer; see the module docstring for the algorithm."""

    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None, **options: Any) -> None:
        if config is not None and options:
            raise TypeError("pass either a SuffixConfig or keyword options, not both")
        # SuffixConfig raises pydantic's ValidationError (a ValueError) naming the field.
        self.config = config if config is not None else SuffixConfig(**options)
        self._buffers: dict[str, TokenBuffer] = {}
        self.global_cache = GlobalSuffixCache(self.config.max_cached_requests)

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
        tokens: np.ndarray,  # [L] int32 every committed token of the request
        k: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> list[int]:  # [<= k]
        """The draft for one request given its tokens and the current global cache."""
        length = tokens.shape[0]
        if k <= 0 or length == 0:
            return []
        cfg = self.config
        last = tokens[length - 1]
        # Own store: occurrences must end at <= L-2, the suffix itself is excluded.
        own = longest_match(tokens, np.flatnonzero(tokens[: length - 1] == last), tokens, cfg.max_depth)
        cache = self.global_cache
        glob = longest_match(cache.tokens, cache.occurrences(int(last)), tokens, cfg.max_depth)
        order = (own, glob) if own.length >= glob.length else (glob, own)
        for match in order:
            if match.length == 0:
                continue
            max_tokens = min(k, math.ceil(round(cfg.max_spec_factor * match.length, 9)))
            draft = grow_draft(match.haystack, match.ends, max_tokens, cfg.min_token_prob, eos_token_ids)
            if draft:
                return draft
        return []

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Free the request's state and add its tokens to the global cache."""
        self._buffers.pop(request_id, None)
        self.global_cache.add(token_ids)

    @property
    def num_tracked_requests(self) -> int:
        """How many running requests hold state (for tests and leak checks)."""
        return len(self._buffers)
