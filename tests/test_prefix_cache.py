"""Prefix caching over hashed full blocks: a prompt prefix whose KV blocks are cached is not
prefilled again, and the output never changes (greedy token-identical to an engine with caching off)."""

from __future__ import annotations

import pytest

from tests.test_eagle import make_engine as make_eagle_engine
from tests.test_eagle import tiny_head
from tests.test_engine import rand_prompts
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.proposers.draft_model import DraftModelProposer

SYSTEM = rand_prompts(1, 11, 20, 20)[0]  # a shared 20-token "system prompt"
GREEDY = {"max_tokens": 14, "ignore_eos": True}
BS = 16  # the engine's default block_size: only full blocks are cached


def full(n: int) -> int:
    """Tokens in the full blocks of the first n."""
    return n // BS * BS


def engine(loaded, caching: bool = True, max_num_seqs: int = 4, **kw) -> LLMEngine:
    cfg = EngineConfig(
        model="x",
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        max_num_batched_tokens=32,
        enable_prefix_caching=caching,
        **kw,
    )
    return LLMEngine(cfg, loaded)


def run_one(eng: LLMEngine, prompt: list[int], params=GREEDY, **kw) -> tuple[list[int], int]:
    """(output ids, prompt tokens reused from cache) of one request run to completion."""
    rid = f"r{eng.num_steps}-{len(eng.requests)}-{eng.prefix_cache_queries}"
    eng.add_request(rid, prompt, params, **kw)
    out, cached = [], -1
    while eng.has_work():
        for o in eng.step():
            if o.request_id == rid:
                out += o.token_ids
                cached = o.num_cached_tokens
    return out, cached


@pytest.fixture(scope="module")
def prompts():
    tails = rand_prompts(3, 12, 5, 12)
    return [SYSTEM + t for t in tails]


def test_shared_prefix_reused_from_a_finished_request(tiny_loaded, one_thread, prompts):
    ref = engine(tiny_loaded, caching=False)
    want = [run_one(ref, p)[0] for p in prompts] + [run_one(ref, prompts[2])[0]]
    assert ref.prefix_cache_hits == 0

    eng = engine(tiny_loaded)
    got = [run_one(eng, p) for p in prompts] + [run_one(eng, prompts[2])]
    assert [g[0] for g in got] == want
    # the first request computes everything; the others reuse the system prompt's full blocks, freed
    # but still cached, and the repeat of prompt 2 reuses every full block of it but the last token's
    # (whose logits make the first output token)
    assert [g[1] for g in got] == [0, full(len(SYSTEM)), full(len(SYSTEM)), full(len(prompts[2]) - 1)]
    assert eng.prefix_cache_hits == 2 * full(len(SYSTEM)) + full(len(prompts[2]) - 1)
    assert eng.prefix_cache_queries == sum(map(len, prompts)) + len(prompts[2])


def test_prefix_copied_from_a_running_request(tiny_loaded, one_thread, prompts):
    """B arrives while A decodes: B's table shares A's system-prompt blocks (no copy)."""
    ref = engine(tiny_loaded, caching=False)
    want = ref.generate(prompts[:2], {"max_tokens": 20, "ignore_eos": True})

    eng = engine(tiny_loaded)
    eng.add_request("a", prompts[0], {"max_tokens": 20, "ignore_eos": True})
    outs: dict[str, list[int]] = {"a": [], "b": []}
    cached: dict[str, int] = {}
    for _ in range(3):  # A prefills (one chunk) and decodes two tokens
        for o in eng.step():
            outs[o.request_id] += o.token_ids
    eng.add_request("b", prompts[1], {"max_tokens": 20, "ignore_eos": True})
    while eng.has_work():
        for o in eng.step():
            outs[o.request_id] += o.token_ids
            cached[o.request_id] = o.num_cached_tokens
    assert [outs["a"], outs["b"]] == want
    assert cached == {"a": 0, "b": full(len(SYSTEM))}


def test_rejected_drafts_are_never_reused(tiny_loaded, tiny_draft_dir, one_thread, prompts):
    """A bad draft model makes most drafts rejected; their stale KV sits past the finished request's
    length. A follow-up turn (prompt = the first turn's prompt + output + more) must reuse only
    committed positions and decode exactly what an uncached engine does."""
    from workers.model_loader import load_model

    draft = load_model(tiny_draft_dir).model

    def spec_engine(caching: bool) -> LLMEngine:
        cfg = EngineConfig(
            model="x",
            max_num_seqs=2,
            max_model_len=256,
            max_num_batched_tokens=32,
            num_speculative_tokens=4,
            proposers=[{"name": "draft_model"}],
            enable_prefix_caching=caching,
        )
        prop = DraftModelProposer(
            model=draft, num_slots=2, max_model_len=256, target_vocab_size=tiny_loaded.model.config.vocab_size
        )
        return LLMEngine(cfg, tiny_loaded, proposers={"draft_model": prop})

    results = []
    for caching in (False, True):
        eng = spec_engine(caching)
        first, _ = run_one(eng, prompts[0])
        follow = prompts[0] + first + [5, 6, 7]
        second, cached = run_one(eng, follow)
        results.append((first, second, cached))
        if caching:
            assert eng.stats["draft_model"].num_draft_tokens > eng.stats["draft_model"].num_accepted_tokens
    (f0, s0, c0), (f1, s1, c1) = results
    assert (f1, s1) == (f0, s0)
    assert c0 == 0
    # the full blocks of turn 1 but its last output token (committed, never fed, so it has no KV)
    assert c1 == full(len(prompts[0]) + len(f0) - 1)


def test_caching_off_and_eagle_requests_prefill_in_full(tiny_loaded, one_thread, prompts):
    eng = engine(tiny_loaded, caching=False)
    for p in prompts[:2]:
        assert run_one(eng, p)[1] == 0
    # EAGLE reads the target's hidden state at every prompt position, which a reused prefix lacks
    eagle = make_eagle_engine(tiny_loaded, tiny_head(tiny_loaded.model, draft_vocab=4096), 2)
    assert eagle.config.enable_prefix_caching
    for p in prompts[:2]:
        assert run_one(eagle, p, proposer="eagle")[1] == 0
    assert eagle.prefix_cache_hits == 0 and eagle.prefix_cache_queries == 0
