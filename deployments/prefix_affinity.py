"""Which target replica holds a prompt's leading KV blocks: the Router's prefix-affinity index.

The Router never sees a replica's cache; it remembers where it sent each prompt block (as Ray
Serve LLM's PrefixCacheAffinityRouter and SGLang's router remember where they sent each prompt's
text), keyed by the chained block hashes the ingress computes (``workers.kv_blocks.block_hashes``,
the keys the replica's prefix cache uses). A chained hash names a whole prefix, so the deepest
block a replica was sent is the length of the prefix it likely holds.

Affinity follows *continuations*: a prompt whose deepest block on record was the last full block of
a prompt sent before (the next turn of a conversation, a repeat, another choice of the same
prompt). A match that ends inside an earlier prompt is a shared head, such as the chat template's
system prompt that every request starts with: following it would send every new conversation to
whichever replica took the first one, so those requests are placed by load alone. The index is an LRU over
blocks, bounded by ``max_blocks``: the blocks of a conversation that went quiet fall out first, as
they do from the replicas' own pools.

Affinity only re-orders choices the load balance allows (``affine``): a replica that holds more of
the prompt wins only while it has at most ``max_imbalance`` requests more than the least busy
replica, so a popular prompt cannot pile requests onto one replica while another idles. Placement
only changes speed: every replica computes the same output for a request, cached or not.
"""

from __future__ import annotations

import collections
from typing import Collection, Mapping, Sequence


class PrefixIndex:
    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        # block hash -> {replica it was sent to: whether a prompt sent there ended with this block},
        # least recently routed first
        self.blocks: collections.OrderedDict[int, dict[str, bool]] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, hashes: Sequence[int], replicas: Collection[str]) -> tuple[int, set[str], set[str]]:
        """The most leading blocks of ``hashes`` that any of ``replicas`` was sent, the replicas that
        were, and those of them whose earlier prompt ended there: ``(0, set(), set())`` when none was.
        Deepest first: one lookup for a continued conversation."""
        for depth in range(len(hashes), 0, -1):
            held = self.blocks.get(hashes[depth - 1])
            if held:
                holders = {r for r in held if r in replicas}
                if holders:
                    return depth, holders, {r for r in holders if held[r]}
        return 0, set(), set()

    def add(self, hashes: Sequence[int], replica: str) -> None:
        """Record that ``replica`` was sent these blocks (now the most recently used), the last one as a
        prompt's end, evicting the least recently used blocks beyond ``max_blocks``."""
        if self.max_blocks <= 0 or not hashes:
            return
        for h in hashes[-self.max_blocks :]:
            held = self.blocks.get(h)
            if held is None:
                self.blocks[h] = {replica: False}
            else:
                held.setdefault(replica, False)
                self.blocks.move_to_end(h)
        if hashes[-1] in self.blocks:
            self.blocks[hashes[-1]][replica] = True
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)


def affine(
    requests: Mapping[str, float], index: PrefixIndex, hashes: Sequence[int], max_imbalance: float
) -> tuple[set[str], int]:
    """The replicas a request may go to for its prefix, and how many of its blocks they hold.

    ``requests``: each fresh replica's requests (in its engine and routed to it since its report).
    Only replicas with at most ``max_imbalance`` more than the least busy one are considered; among
    them, the ones sent the most of the prompt's leading blocks, if the request continues a prompt
    sent there. ``(every replica, 0)`` when affinity is off, the prompt has no full block, no allowed
    replica holds any of it, the match is only a shared head, or every allowed replica holds as much:
    the plain load balance then decides."""
    if max_imbalance <= 0 or not hashes or not requests:
        return set(requests), 0
    best = min(requests.values())
    allowed = {r for r, v in requests.items() if v <= best + max_imbalance}
    depth, holders, ended = index.match(hashes, allowed)
    if not ended or holders == allowed:
        return set(requests), 0
    return holders, depth
