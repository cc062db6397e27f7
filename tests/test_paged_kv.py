"""The paged KV cache: the block pool's bookkeeping on hand-made requests, pool sizing from
kv_cache_memory_gb, and preemption by recompute leaving every output token unchanged."""

from __future__ import annotations

import pytest

from tests.test_engine import rand_prompts
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.kv_blocks import KVCacheManager
from workers.request import Request
from workers.sampling_params import SamplingParams

# the tiny test model: 2 layers x (k, v) x 2 kv heads x 16 head_dim x fp32 = 512 bytes per token
TINY_TOKEN_BYTES = 512


def _req(rid: str, ids: list[int]) -> Request:
    return Request(
        request_id=rid,
        prompt_ids=list(ids),
        params=SamplingParams(max_tokens=8),
        proposer=None,
        speculation="auto",
        detok=None,
        generator=None,
        eos_token_ids=frozenset(),
    )


def test_blocks_are_shared_by_hash_refcounted_and_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=6, block_size=16)
    a = _req("a", list(range(40)))  # 2 full blocks + 8
    assert kv.admit(a, 40, use_cache=True) and a.num_computed == 0 and len(a.block_table) == 3
    a.num_computed = 40
    kv.cache_full_blocks(a)
    assert len(a.block_hashes) == 2  # the partial third block is never cached
    # same first 16 tokens, then different: one block shared
    b = _req("b", list(range(16)) + [99] * 20)
    assert kv.admit(b, 36, use_cache=True)
    assert b.num_cached_tokens == 16 and b.block_table[0] == a.block_table[0] and kv.pool.ref[a.block_table[0]] == 2
    assert kv.num_free == 6 - 3 - 2
    shared = a.block_table[0]
    kv.free(a)
    assert kv.pool.ref[shared] == 1 and kv.num_free == 3
    # a's second block is free but still cached: a repeat of a hits both its full blocks
    c = _req("c", list(range(40)))
    assert kv.admit(c, 40, use_cache=True) and c.num_cached_tokens == 32
    kv.free(b)
    kv.free(c)
    assert kv.num_free == 6
    # allocation evicts from the front: what was freed longest ago goes first, the shared prefix last
    d = _req("d", [7] * 80)
    assert kv.admit(d, 80, use_cache=True) and d.num_cached_tokens == 0
    e = _req("e", list(range(40)))
    assert kv.admit(e, 16, use_cache=True) is True  # room for one block: the hit needs no new one
    assert kv.prefix_cache_hits == 16 + 32 + 16


def test_a_request_the_pool_cannot_hold_now_waits_and_takes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    a, b = _req("a", list(range(50))), _req("b", list(range(100, 150)))
    assert kv.admit(a, 50, use_cache=True)
    free = kv.num_free
    assert not kv.admit(b, 50, use_cache=True) and b.block_table == [] and kv.num_free == free
    assert not kv.grow(a, 80) and len(a.block_table) == 4
    assert kv.room(a) == 64


def _engine(loaded, kv_tokens: int | None, **kw) -> LLMEngine:
    gb = 4.0 if kv_tokens is None else kv_tokens * TINY_TOKEN_BYTES / 2**30
    cfg = EngineConfig(
        dtype="float32", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=64, kv_cache_memory_gb=gb, **kw
    )
    return LLMEngine(cfg, loaded)


def test_pool_size_follows_kv_cache_memory_gb_and_too_little_names_the_key(tiny_loaded):
    eng = _engine(tiny_loaded, kv_tokens=160, proposers=[])
    assert eng.kv.num_blocks == 10 and eng.runner.num_blocks == 10
    snap = eng.snapshot()
    assert snap.kv_tokens_capacity == 160 and snap.kv_tokens_in_use == 0
    eng.add_request("a", rand_prompts(1, 1, 20, 20)[0], {"max_tokens": 8, "ignore_eos": True})
    eng.step()
    assert eng.snapshot().kv_tokens_in_use == 32  # 2 blocks of 16 held
    # plenty of memory: capped at max_num_seqs full-length requests
    assert _engine(tiny_loaded, None, proposers=[]).kv.num_blocks == 8 * 128 // 16
    with pytest.raises(ValueError, match="kv_cache_memory_gb"):
        _engine(tiny_loaded, kv_tokens=100, proposers=[])  # under one request of max_model_len (128)


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 40, "ignore_eos": True},
        {"max_tokens": 40, "ignore_eos": True, "temperature": 0.9, "top_p": 0.95, "seed": 7},
    ],
    ids=["greedy", "seeded"],
)
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_preempted_requests_are_recomputed_with_identical_output(tiny_loaded, one_thread, params, spec):
    """Six requests that need ~4 blocks each in a pool of 10: the youngest are preempted and recomputed
    (some more than once), and every output token equals a run with blocks to spare."""
    prompts = rand_prompts(6, 21, 10, 24)
    kw = {} if spec else {"proposers": []}
    want = _engine(tiny_loaded, None, **kw).generate(prompts, params)
    eng = _engine(tiny_loaded, kv_tokens=160, **kw)
    got = eng.generate(prompts, params)
    assert eng.num_preemptions > 0
    assert got == want
    assert eng.kv.num_free == eng.kv.num_blocks and not eng.running


def test_a_preempted_stream_sends_each_token_and_its_text_once(tiny_loaded, one_thread):
    prompts = rand_prompts(4, 22, 10, 24)
    params = {"max_tokens": 40, "ignore_eos": True, "logprobs": 1}
    eng = _engine(tiny_loaded, kv_tokens=160, proposers=[])
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    toks: dict[str, list[int]] = {}
    text: dict[str, str] = {}
    lps: dict[str, int] = {}
    while eng.has_work():
        for o in eng.step():
            toks.setdefault(o.request_id, []).extend(o.token_ids)
            text[o.request_id] = text.get(o.request_id, "") + o.text
            lps[o.request_id] = lps.get(o.request_id, 0) + len(o.logprobs or [])
    assert eng.num_preemptions > 0
    for rid, t in toks.items():
        assert len(t) == 40 and lps[rid] == 40
        assert text[rid] == eng.tokenizer.decode(t, skip_special_tokens=True)


def test_memory_follows_the_pool_not_max_num_seqs_times_max_model_len(tiny_loaded):
    """128 requests of the model's whole context (1024) cost the pool's bytes, not 128 x 1024 tokens' worth."""
    cfg = EngineConfig(
        dtype="float32",
        max_num_seqs=128,
        max_model_len=1024,
        proposers=[],
        kv_cache_memory_gb=4096 * TINY_TOKEN_BYTES / 2**30,
    )
    eng = LLMEngine(cfg, tiny_loaded)
    assert eng.kv.num_blocks == 256 and eng.runner.kv_bytes == 4096 * TINY_TOKEN_BYTES
    out = eng.generate(rand_prompts(3, 23, 5, 10), {"max_tokens": 6, "ignore_eos": True})
    assert [len(o) for o in out] == [6, 6, 6]


def test_with_a_pool_of_one_full_request_every_admissible_request_completes_and_longer_ones_are_refused(tiny_loaded):
    """The pool holds exactly one request of max_model_len: a full-length request beside others completes
    (it waits or preempts, never hangs), and one that could never fit is refused naming max_tokens."""
    from workers.errors import InvalidRequestError

    eng = _engine(tiny_loaded, kv_tokens=128, proposers=[])
    assert eng.kv.num_blocks * eng.kv.block_size == 128 == eng.max_model_len
    full, short = rand_prompts(2, 5, 100, 100)[0], rand_prompts(2, 6, 20, 20)[0]
    outs = eng.generate([short, full, short], {"max_tokens": 28, "ignore_eos": True})
    assert [len(o) for o in outs] == [28, 28, 28]
    with pytest.raises(InvalidRequestError, match="max_tokens") as e:
        eng.add_request("over", full, {"max_tokens": 29})
    assert e.value.param == "max_tokens" and not eng.has_work()
