"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, each request's block table, and a
prefix cache over hashed full blocks.

As vLLM v1 (``KVCacheManager`` / ``BlockPool``) and nano-vllm's ``BlockManager`` do it:
- a request holds ``Request.block_table`` (position p in block ``block_table[p // block_size]``);
- a block is reference-counted; a block nobody holds sits in a free queue in LRU order, and keeps
  its KV (and its hash, if it was cached) until it is handed out again: allocation evicts from the
  front, so a cached prefix survives as long as the pool has older free blocks;
- only *full* blocks of *committed* positions (below ``num_computed``) are hashed, by
  ``hash((parent block's hash, the block's token ids))``, so a hit means the same tokens at the same
  positions after the same prefix; drafts sit past ``num_computed`` and are never entered;
- a request whose prompt starts with cached blocks shares them (reference +1) instead of prefilling
  them again; the KV at a position depends only on the tokens up to it, and the batch-invariant
  kernels make a shared block's KV exactly what the request would have computed.

Nothing here imports torch: the runner (workers/runner.py) owns the tensors, this owns the numbers.
"""

from __future__ import annotations

import collections
import heapq
from typing import Sequence

from workers.request import Request

BlockKey = tuple[int, tuple[int, ...]]  # (parent block's hash, 0 for the first; the block's token ids)


def block_hashes(ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block of ``ids``, as the prefix cache keys them. Python hashes
    tuples of ints the same in every process, so the ingress computes the keys a replica will cache
    a prompt under (the Router places requests by them) without asking the replica."""
    out: list[int] = []
    parent = 0
    for i in range(len(ids) // block_size):
        parent = hash((parent, tuple(ids[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out


class BlockPool:
    """``num_blocks`` blocks: reference counts, the LRU free queue and the hash -> block map."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free_q: collections.OrderedDict[int, None] = collections.OrderedDict((b, None) for b in range(num_blocks))
        self.key_of: list[BlockKey | None] = [None] * num_blocks  # set while the block is in the cache
        self.cached: dict[int, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        return len(self.free_q)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the front of the free queue (least recently freed), evicted from the cache."""
        if n > len(self.free_q):
            raise RuntimeError(f"{n} blocks asked, {len(self.free_q)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_q.popitem(last=False)
            key = self.key_of[b]
            if key is not None:
                del self.cached[hash(key)]
                self.key_of[b] = None
            self.ref[b] = 1
            out.append(b)
        return out

    def take(self, b: int) -> None:
        """One more holder of a cached block (a prefix hit); out of the free queue if nobody held it."""
        if self.ref[b] == 0:
            del self.free_q[b]
        self.ref[b] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one holder of each block. A request's last block goes to the free queue first, so it is
        evicted before the prefix blocks other requests are likelier to share (vLLM's order)."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free_q[b] = None

    def lookup(self, key: BlockKey) -> int | None:
        b = self.cached.get(hash(key))
        return b if b is not None and self.key_of[b] == key else None  # the tokens checked: no hash collision

    def register(self, b: int, key: BlockKey) -> None:
        """Enter a full block into the cache, unless an equal block is there already."""
        h = hash(key)
        if h not in self.cached and self.key_of[b] is None:
            self.cached[h] = b
            self.key_of[b] = key


class KVCacheManager:
    """Hands out blocks to requests, shares cached prefixes, and counts what the prefix cache saved."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        # prompt tokens admitted that may read the cache, and of those, the ones read from cached blocks
        # instead of prefilled; a request counts once, at its first admission (as vLLM counts them)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    @property
    def num_used(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _key(self, parent: int, ids: Sequence[int], i: int) -> BlockKey:
        return parent, tuple(ids[i * self.block_size : (i + 1) * self.block_size])

    def admit(self, r: Request, num_tokens: int, use_cache: bool, keep_free: int = 0) -> bool:
        """Give ``r`` blocks for its first ``num_tokens`` positions, the cached prefix of its prefill
        shared; ``False`` (nothing taken) if the pool cannot hold them now with ``keep_free`` blocks to spare.
        Sets ``num_computed`` and ``num_cached_tokens`` to the positions the hit covers. The last prefill token
        is always fed (its logits make the first output token), so at most ``prefill_len - 1`` positions are hit."""
        ids = r.all_ids()
        hits: list[int] = []
        hashes: list[int] = []
        if use_cache and self.enable_caching:
            parent = 0
            for i in range((r.prefill_len - 1) // self.block_size):
                key = self._key(parent, ids, i)
                b = self.pool.lookup(key)
                if b is None:
                    break
                hits.append(b)
                parent = hash(key)
                hashes.append(parent)
        new = self.blocks_for(num_tokens) - len(hits)
        if new + sum(1 for b in hits if self.pool.ref[b] == 0) > self.pool.num_free - keep_free:
            return False
        for b in hits:
            self.pool.take(b)
        r.block_table = hits + self.pool.allocate(max(0, new))
        r.block_hashes = hashes
        r.num_computed = r.num_cached_tokens = len(hits) * self.block_size
        if use_cache and self.enable_caching and r.num_preemptions == 0:  # a readmission is no new query
            self.prefix_cache_queries += len(r.prompt_ids)
            self.prefix_cache_hits += r.num_cached_tokens
        return True

    def room(self, r: Request) -> int:
        """Positions ``r`` could hold now: its blocks and every free one."""
        return (len(r.block_table) + self.pool.num_free) * self.block_size

    def grow(self, r: Request, num_tokens: int) -> bool:
        """Extend ``r``'s table to ``num_tokens`` positions; ``False`` (nothing taken) if too few are free."""
        need = self.blocks_for(num_tokens) - len(r.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        r.block_table += self.pool.allocate(need)
        return True

    def cache_full_blocks(self, r: Request) -> None:
        """Enter ``r``'s newly full blocks of committed positions (below ``num_computed``) into the cache."""
        if not self.enable_caching:
            return
        full = min(r.num_computed // self.block_size, len(r.block_table))
        if len(r.block_hashes) >= full:
            return
        ids = r.all_ids()
        parent = r.block_hashes[-1] if r.block_hashes else 0
        for i in range(len(r.block_hashes), full):
            key = self._key(parent, ids, i)
            self.pool.register(r.block_table[i], key)
            parent = hash(key)
            r.block_hashes.append(parent)

    def free(self, r: Request) -> None:
        """Take ``r``'s blocks back (its committed full blocks stay cached until evicted)."""
        self.cache_full_blocks(r)
        self.pool.release(r.block_table)
        r.block_table = []
        r.block_hashes = []


class DraftBlocks:
    """Block tables for a proposer's own KV cache (a draft model, an EAGLE head).

    A draft cache holds every committed position of a request plus lookahead for the drafts it feeds; it
    never shares blocks (no prefix cache: a draft's KV is cheap to recompute), so this is only allocation,
    lowest free block first.
    When the pool runs short, requests are served oldest first (the order they first got blocks): a
    request that cannot get blocks for its committed positions gets no drafts this step, and one already
    holding blocks gives them all back (it re-prefills when it is served again). That is vLLM's scheduler
    rule, admit while blocks last and preempt the youngest by recompute: a draft never evicts the state of
    an older request it cannot tell is idle (the other target replicas' requests are called in other
    steps, and evicting them would thrash), and a request left without drafts still decodes, with the
    same output, only without the speedup. Orphans are the owner's job (the draft worker's TTL sweep).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # min-heap of free block ids
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}  # request id -> its blocks, position p in table[p // block_size]
        self._order: dict[str, int] = {}  # request id -> when it first got blocks (oldest served first)
        self._next = 0

    @property
    def num_used(self) -> int:
        """Blocks held by requests: committed tokens plus the lookahead of their drafts."""
        return self.num_blocks - len(self._free)

    @property
    def tokens_capacity(self) -> int:
        """Positions the pool holds, over all requests."""
        return self.num_blocks * self.block_size

    @property
    def usage(self) -> float:
        """Fraction of the blocks held by requests (vLLM's kv_cache_usage_perc)."""
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserve(self, asks: Sequence[tuple[str, int, int]]) -> list[int]:
        """For each ``(request id, need, want)``: grow its table to cover ``want`` positions if the pool
        allows, else as many as it can above ``need``; the positions covered, or 0 where even ``need``
        does not fit (that request then holds no blocks). Requests holding blocks are served first,
        oldest first, then new ones in the order given."""
        order = sorted(range(len(asks)), key=lambda i: self._order.get(asks[i][0], self._next + i))
        out = [0] * len(asks)
        for i in order:
            rid, need, want = asks[i]
            table = self.tables.get(rid, [])
            room = (len(table) + len(self._free)) * self.block_size
            if room < need:
                self.free(rid)
                continue
            more = self.blocks_for(min(want, room)) - len(table)
            if more > 0:
                table = table + [heapq.heappop(self._free) for _ in range(more)]
            if rid not in self.tables:
                self._order[rid] = self._next
                self._next += 1
            self.tables[rid] = table
            out[i] = len(table) * self.block_size
        return out

    def free(self, request_id: str) -> None:
        """Give back the request's blocks (unknown ids are ignored)."""
        for b in self.tables.pop(request_id, []):
            heapq.heappush(self._free, b)
        self._order.pop(request_id, None)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    """Bytes of KV cache one token takes: each layer keeps a key and a value (x 2) of ``head_dim`` per KV
    head, so ``num_layers x num_kv_heads x head_dim x 2 x element_size``. The budget check before a start
    and the pools the replicas allocate count with this one function, so they agree on what fits."""
    return num_layers * num_kv_heads * head_dim * 2 * element_size


def pool_blocks(
    budget_gb: float, bytes_per_token: int, block_size: int, max_model_len: int, max_seqs: int, key: str
) -> int:
    """Blocks of a KV pool of ``budget_gb`` GiB, capped at what ``max_seqs`` requests of ``max_model_len`` can
    use. A budget under one request of ``max_model_len`` is an error naming ``key``: that request could never
    run (the engine) or never draft (the draft worker), so the deploy must fail rather than the request."""
    per_seq = -(-max_model_len // block_size)
    block_bytes = bytes_per_token * block_size
    fit = int(budget_gb * 2**30 // block_bytes)
    if fit < per_seq:
        raise ValueError(
            f"{key}={budget_gb} holds {fit * block_size} tokens ({fit} blocks of {block_size}); one request of "
            f"engine.max_model_len={max_model_len} needs {per_seq} blocks ({per_seq * block_bytes / 2**30:.3f} GiB): "
            f"raise {key} or lower engine.max_model_len"
        )
    return min(fit, max_seqs * per_seq)
