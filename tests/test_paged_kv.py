"""The paged KV cache: the block pool's bookkeeping on hand-made requests, pool sizing from
kv_cache_memory_gb, and preemption by recompute leaving every logit and output token unchanged, with
EAGLE, prompt_logprobs and structured output too."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tests.test_engine import rand_prompts
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.kv_blocks import KVCacheManager, block_hashes, kv_bytes_per_token
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


def test_block_hashes_are_the_cache_keys_and_a_readmission_is_no_new_query():
    """The ingress's ``block_hashes`` (what the Router places by) are the keys the pool caches under;
    a preempted request admitted again counts its prompt as a prefix-cache query once, as vLLM does."""
    kv = KVCacheManager(num_blocks=8, block_size=16)
    a = _req("a", list(range(40)))
    assert kv.admit(a, 40, use_cache=True)
    a.num_computed = 40
    kv.cache_full_blocks(a)
    assert a.block_hashes == block_hashes(list(range(40)), 16) and len(a.block_hashes) == 2
    assert kv.prefix_cache_queries == 40 and kv.prefix_cache_hits == 0
    kv.free(a)  # as a preemption does, then admitted again: its cached blocks are hit, nothing counted
    a.num_preemptions, a.num_computed = 1, 0
    assert kv.admit(a, 40, use_cache=True) and a.num_cached_tokens == 32
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (40, 0)
    b = _req("b", list(range(40)))  # a new request with the same prompt is a query and a hit
    assert kv.admit(b, 40, use_cache=True)
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (80, 32)


def test_kv_bytes_per_token_of_smollm2():
    # SmolLM2-135M: 30 layers x 3 KV heads x head_dim 64 x 2 (K and V) = 11520 values per token
    assert kv_bytes_per_token(30, 3, 64, torch.tensor([], dtype=torch.bfloat16).element_size()) == 11520 * 2
    assert kv_bytes_per_token(30, 3, 64, torch.tensor([], dtype=torch.float32).element_size()) == 11520 * 4


def test_a_request_the_pool_cannot_hold_now_waits_and_takes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    a, b = _req("a", list(range(50))), _req("b", list(range(100, 150)))
    assert kv.admit(a, 50, use_cache=True)
    free = kv.num_free
    assert not kv.admit(b, 50, use_cache=True) and b.block_table == [] and kv.num_free == free
    assert not kv.grow(a, 80) and len(a.block_table) == 4
    assert kv.room(a) == 64


def _engine(loaded, kv_tokens: int | None, proposer_objs: dict | None = None, **kw) -> LLMEngine:
    gb = 4.0 if kv_tokens is None else kv_tokens * TINY_TOKEN_BYTES / 2**30
    kw = {"dtype": "float32", "max_num_seqs": 8, "max_model_len": 128, "max_num_batched_tokens": 64, **kw}
    return LLMEngine(EngineConfig(kv_cache_memory_gb=gb, **kw), loaded, proposers=proposer_objs)


def _run(eng: LLMEngine, prompts: list[list[int]], params: list[dict], **kw: Any) -> dict[str, list]:
    """Every request to the end under fixed ids (r0, r1, ...): each one's outputs, in order."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp, **kw)
    outs: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id].append(o)
    return outs


def _tokens(outs: dict[str, list]) -> dict[str, list[int]]:
    return {rid: [t for o in os for t in o.token_ids] for rid, os in outs.items()}


def _spy_logits(eng: LLMEngine) -> dict[tuple[str, int, tuple[int, ...]], list[torch.Tensor]]:
    """Every logits row the engine decides output from (before any grammar mask), keyed by (request, position
    of the token it follows, the drafts between the committed tokens and it)."""
    seen: dict[tuple[str, int, tuple[int, ...]], list[torch.Tensor]] = {}
    process = eng.processor.process

    def spy(rows, logits, *rest):  # logits: [sum_i (len(drafts_i) + 1), vocab]
        off = 0
        for f in rows:
            r = f.request
            first = r.num_computed + len(f.fed) - 1 - len(f.drafts)  # the pending (or last prompt) token
            for j in range(len(f.drafts) + 1):
                seen.setdefault((r.request_id, first + j, tuple(f.drafts[:j])), []).append(logits[off + j].clone())
            off += len(f.drafts) + 1
        return process(rows, logits, *rest)

    eng.processor.process = spy
    return seen


def _spy_preemptions(eng: LLMEngine) -> list[tuple[str, bool, int]]:
    """(request, in prefill, prompt logprobs scored so far) of every preemption."""
    got: list[tuple[str, bool, int]] = []
    preempt = eng.scheduler.preempt

    def spy(r: Request) -> None:
        got.append((r.request_id, r.in_prefill, len(r.prompt_logprobs or [])))
        preempt(r)

    eng.scheduler.preempt = spy  # type: ignore[method-assign]
    return got


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


GREEDY = {"max_tokens": 40, "ignore_eos": True}
SEEDED = {"max_tokens": 40, "ignore_eos": True, "temperature": 0.9, "top_p": 0.95, "seed": 7}


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "ngram"])
def test_a_preempted_requests_logits_are_bit_identical_at_every_position(tiny_loaded, one_thread, params, spec):
    """torch.equal on every logits row: a request recomputed after preemption decides each output token from
    the logits an unpreempted run decides it from. Plain: both runs have a row at every output position and the
    same rows; with drafts, every row the two runs share (same position, same drafts before it) is equal."""
    prompts = rand_prompts(6, 21, 10, 24)
    kw = {"num_speculative_tokens": 3} if spec else {"proposers": []}
    ref_eng = _engine(tiny_loaded, None, **kw)
    ref = _spy_logits(ref_eng)
    want = _tokens(_run(ref_eng, prompts, [params] * 6))
    eng = _engine(tiny_loaded, kv_tokens=160, **kw)
    got = _spy_logits(eng)
    preemptions = _spy_preemptions(eng)
    assert _tokens(_run(eng, prompts, [params] * 6)) == want
    preempted = {rid for rid, _, _ in preemptions}
    assert preempted
    common = set(got) & set(ref)
    for key in common:
        for row in got[key] + ref[key][1:]:
            assert torch.equal(row, ref[key][0]), key
    if not spec:  # a row at every output position of every request, in both runs
        assert set(got) == set(ref)
        for rid in preempted:
            first = len(prompts[int(rid[1:])]) - 1
            assert {k[1] for k in got if k[0] == rid} == set(range(first, first + 40))
    else:
        assert {k[0] for k in common} >= preempted


def _eagle_engine(loaded, kv_tokens: int | None) -> LLMEngine:
    from tests.test_eagle import tiny_head
    from workers.proposers.eagle import EagleProposer

    head = tiny_head(loaded.model, draft_vocab=4096)
    eagle = EagleProposer(head, loaded.model, num_slots=4, max_model_len=128, device="cpu")
    return _engine(
        loaded,
        kv_tokens,
        {"eagle": eagle},
        max_num_seqs=4,
        num_speculative_tokens=3,
        proposers=[{"name": "eagle"}],
    )


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preempted_eagle_requests_write_the_same_tokens(tiny_loaded, one_thread, params):
    """EAGLE reads the target's hidden state at every position: a recomputed request hands it the same states.
    A preempted request keeps its EAGLE slot while it waits; it waits at the head of the queue, so no newer
    request is admitted before it and max_num_seqs slots (8 requests through 4 here) always suffice."""
    prompts = rand_prompts(8, 24, 10, 24)
    want = _tokens(_run(_eagle_engine(tiny_loaded, None), prompts, [params] * 8))
    eng = _eagle_engine(tiny_loaded, kv_tokens=160)
    got = _tokens(_run(eng, prompts, [params] * 8))
    assert eng.num_preemptions > 0 and eng.stats["eagle"].num_draft_tokens > 0
    assert got == want
    assert eng.proposers["eagle"].num_active == 0  # type: ignore[attr-defined]


def test_preempted_prompt_logprobs_are_scored_once_and_unchanged(tiny_loaded, one_thread):
    """A request preempted while its prompt is being scored scores it again from the start; one preempted after
    it was scored is not scored twice: prompt logprobs, logprobs and tokens equal an unpreempted run's. The
    latency budget lets a prompt feed one token per step while another request decodes, so the second request
    is still scoring its prompt when the first one's growth takes its blocks."""
    prompts = rand_prompts(3, 25, 60, 60)
    params = [
        {**GREEDY, "max_tokens": n, "prompt_logprobs": 2, "logprobs": 1} for n in (60, 24, 24)
    ]  # 60 + 60 tokens: 8 of the pool's 10 blocks, 4 of them taken by the second prompt
    kw = {
        "proposers": [],
        "max_num_seqs": 2,
        "enable_prefix_caching": False,
        "scheduler": {"target_itl_ms": 0.001, "max_ttft_ms": 3_600_000},
    }
    want = _run(_engine(tiny_loaded, None, **kw), prompts, params)
    eng = _engine(tiny_loaded, kv_tokens=160, **kw)
    preemptions = _spy_preemptions(eng)
    got = _run(eng, prompts, params)
    assert any(in_prefill and scored > 1 for _, in_prefill, scored in preemptions), preemptions
    for rid, outs in got.items():
        assert [o.prompt_logprobs for o in outs] == [o.prompt_logprobs for o in want[rid]]
        assert outs[0].prompt_logprobs is not None and len(outs[0].prompt_logprobs) == len(prompts[int(rid[1:])])
        assert [lp for o in outs for lp in o.logprobs or []] == [lp for o in want[rid] for lp in o.logprobs or []]
    assert _tokens(got) == _tokens(want)


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "bb", "ccc"]}},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "tags", "age"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    "params,spec",
    [({"max_tokens": 60}, False), ({"max_tokens": 60, "temperature": 1.2, "top_p": 0.95, "seed": 5}, True)],
    ids=["greedy-plain", "seeded-ngram"],
)
def test_preempted_structured_requests_resume_their_grammar(tiny_loaded, one_thread, params, spec):
    """The grammar's state follows the committed tokens, which a preemption keeps: a recomputed request goes on
    from where its grammar was (neither rewound nor fed its output twice), forced drafts and masks included."""
    prompts = rand_prompts(6, 26, 10, 24)
    structured = {"kind": "json", "value": json.dumps(SCHEMA), "param": "response_format"}
    sps = [{**params, "structured": structured}] * 6
    kw = {"num_speculative_tokens": 3} if spec else {"proposers": [], "structured_outputs": {"max_forced_tokens": 0}}
    want = _tokens(_run(_engine(tiny_loaded, None, **kw), prompts, sps))
    eng = _engine(tiny_loaded, kv_tokens=160, **kw)
    preempted = _spy_preemptions(eng)
    got = _tokens(_run(eng, prompts, sps))
    assert any(not in_prefill for _, in_prefill, _ in preempted)  # some were preempted mid-output
    assert got == want
    for ids in got.values():
        json.loads(tiny_loaded.tokenizer.decode(ids, skip_special_tokens=True))


def test_admission_keeps_a_watermark_while_others_run(tiny_loaded, one_thread):
    """A request that would take the pool's last free blocks waits while another runs (it would be the first one
    preempted when that one grows, its prefill wasted), and is admitted once it would run alone: never a hang."""
    eng = _engine(tiny_loaded, kv_tokens=160, proposers=[])  # 10 blocks, a watermark of 1
    eng.add_request("a", rand_prompts(1, 27, 20, 20)[0], {"max_tokens": 8, "ignore_eos": True})  # 2 blocks
    eng.add_request("b", rand_prompts(1, 28, 120, 120)[0], {"max_tokens": 8, "ignore_eos": True})  # 8 blocks
    eng.step()
    assert [r.request_id for r in eng.running] == ["a"] and eng.kv.num_free == 8
    done: set[str] = set()
    while eng.has_work():
        done |= {o.request_id for o in eng.step() if o.finished}
    assert done == {"a", "b"} and eng.num_preemptions == 0
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert not kv.admit(_req("c", list(range(64))), 64, use_cache=False, keep_free=1)
    assert kv.admit(_req("c", list(range(48))), 48, use_cache=False, keep_free=1) and kv.num_free == 1


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
