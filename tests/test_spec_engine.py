"""The speculative engine keeps the promise: speculation never changes what the model writes.

Every proposer (ngram, suffix, a draft model that is the target itself, a bad random draft),
at batch 1, 8 and 32, with K in {1, 2, 4, 8}, with K changed mid-request and switched
between 0 and K > 0, gives exactly the plain engine's greedy tokens; the acceptance stats
are consistent (acceptance rate in [0, 1], bonus not counted, no division by zero); and
max_tokens, the context and stop strings are never overshot when K reaches past them.
"""

from __future__ import annotations

import random
from typing import Any, Sequence

import pytest
from pydantic import ValidationError

from tests.test_engine import rand_prompts
from workers.config import EngineConfig
from workers.decision import SpecCandidate
from workers.engine import LLMEngine
from workers.proposers.base import Proposer
from workers.proposers.draft_model import DraftModelProposer
from workers.proposers.ngram import NgramProposer
from workers.proposers.suffix import SuffixProposer
from workers.stats import LoadSnapshot

MAX_LEN = 256
GREEDY = {"max_tokens": 24, "ignore_eos": True}
# proposers under test: draft_self = the target as its own draft, draft_bad = a different random model
KINDS = ("ngram", "suffix", "draft_self", "draft_bad")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def draft_loaded(tiny_draft_dir):
    from workers.model_loader import load_model

    return load_model(tiny_draft_dir)


def copy_prompts(n: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    """Prompts that end in a repeated random segment, so n-gram / suffix lookup has matches."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        seg = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        head = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]
        out.append(head + seg * rng.randint(2, 4))
    return out


def num_lookup_hits(prompt: Sequence[int], out: Sequence[int]) -> int:
    """Decode steps at which the last committed token occurred before: an n-gram proposer drafts there."""
    seq = list(prompt)
    hits = 0
    for t in out[:-1]:
        hits += t in seq
        seq.append(t)
    return hits


def lookup_prompts(loaded, n: int, seed: int, params: dict[str, Any] | None = None) -> list[list[int]]:
    """The ``n`` of ``max(2n, 16)`` copy prompts whose plain output gives the n-gram proposer the most matches.

    A random tiny model rarely repeats itself, so only some prompts let lookup proposers draft;
    picking those (from the plain output, deterministically) keeps every case able to fail.
    """
    pool = copy_prompts(max(2 * n, 16), seed)
    outs = plain(loaded, pool, params or GREEDY)
    hits = [num_lookup_hits(p, o) for p, o in zip(pool, outs)]
    best = sorted(sorted(range(len(pool)), key=lambda i: -hits[i])[:n])
    assert max(hits[i] for i in best) > 0, "no prompt gives the lookup proposers a match: pick another seed"
    return [pool[i] for i in best]


def make_proposer(kind: str, target, draft, num_slots: int = 32) -> tuple[str, Proposer]:
    """(engine name, proposer) for one proposer kind."""
    if kind == "ngram":
        return "ngram", NgramProposer()
    if kind == "suffix":
        return "suffix", SuffixProposer()
    model = {"draft_self": target, "draft_bad": draft}[kind].model
    p = DraftModelProposer(
        model=model, num_slots=num_slots, max_model_len=MAX_LEN, target_vocab_size=target.model.config.vocab_size
    )
    return "draft_model", p


def spec_engine(loaded, draft_loaded, kind: str, k: int, batch: int = 32, decide=None, **cfg: Any):
    name, prop = make_proposer(kind, loaded, draft_loaded, num_slots=batch)
    conf = EngineConfig(dtype="float32", max_num_seqs=batch, max_model_len=MAX_LEN, num_speculative_tokens=k, **cfg)
    return name, LLMEngine(conf, loaded, proposers={name: prop}, decide=decide)


_PLAIN: dict[tuple, list[list[int]]] = {}


def plain(loaded, prompts: Sequence[Sequence[int]], params: dict[str, Any]) -> list[list[int]]:
    """Plain greedy reference (an engine with no proposer at all), cached per prompt set."""
    key = (tuple(map(tuple, prompts)), tuple(sorted(params.items())))
    if key not in _PLAIN:
        eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=max(len(prompts), 1), max_model_len=MAX_LEN), loaded)
        _PLAIN[key] = eng.generate(prompts, params)
    return _PLAIN[key]


def run(eng: LLMEngine, prompts, params, **kw) -> dict[str, dict[str, Any]]:
    """Step to completion, keeping every request's tokens, text, finish reason and final spec stats."""
    res: dict[str, dict[str, Any]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params, **kw)
        res[f"r{i}"] = {"tokens": [], "text": "", "reason": None, "spec": None, "n_out": 0}
    while eng.has_work():
        for o in eng.step():
            r = res[o.request_id]
            r["tokens"] += o.token_ids
            r["text"] += o.text
            r["spec"], r["n_out"] = o.spec, o.num_output_tokens
            if o.finished:
                r["reason"] = o.finish_reason
    return res


# ------------------------------------------------------------------ greedy equality


CASES = (
    [(8, k, kind) for kind in KINDS for k in (1, 2, 4, 8)]
    + [(1, k, kind) for kind in KINDS for k in (4,)]
    + [(32, k, kind) for kind in KINDS for k in (2, 8)]  # 32 x (8 + 1) > 256: the token budget clips K
)


@pytest.mark.parametrize("batch,k,kind", CASES, ids=[f"b{b}-k{k}-{kind}" for b, k, kind in CASES])
def test_greedy_identical_to_plain(tiny_loaded, draft_loaded, batch, k, kind):
    prompts = lookup_prompts(tiny_loaded, batch, seed=100 + batch)
    ref = plain(tiny_loaded, prompts, GREEDY)
    name, eng = spec_engine(tiny_loaded, draft_loaded, kind, k, batch=batch)
    outs = eng.generate(prompts, GREEDY, speculation="on", proposer=name)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o == r, f"request {i}: speculative output drifted from plain"
    st = eng.stats[name]
    assert st.num_draft_tokens > 0, "no drafts were proposed: the test proved nothing"
    assert 0 <= st.num_accepted_tokens <= st.num_draft_tokens
    assert st.num_draft_tokens <= st.num_drafts * k
    if kind == "draft_self":  # the target as its own draft: every greedy draft is accepted
        assert st.acceptance_rate == 1.0
    # "off" on the same engine is plain too (and counts no drafts)
    eng.stats.clear()
    assert eng.generate(prompts, GREEDY, speculation="off", proposer=name) == ref
    assert eng.stats[name].num_draft_tokens == 0


@pytest.mark.parametrize("kind", ["ngram", "draft_self"])
def test_native_gemm_greedy_identical_to_plain(tiny_loaded, draft_loaded, kind):
    """With the native linears (cpu_gemm="native", invariant with no row blocking) speculation keeps output too."""
    prompts = lookup_prompts(tiny_loaded, 8, seed=108)
    conf = EngineConfig(dtype="float32", max_num_seqs=8, max_model_len=MAX_LEN, cpu_gemm="native")
    ref = LLMEngine(conf, tiny_loaded).generate(prompts, GREEDY)
    name, eng = spec_engine(tiny_loaded, draft_loaded, kind, 4, batch=8, cpu_gemm="native")
    assert eng.snapshot().gemm_kernel == "native"  # what /v1/speculation/stats reports per replica
    assert eng.generate(prompts, GREEDY, speculation="on", proposer=name) == ref
    assert eng.stats[name].num_draft_tokens > 0


def test_k_zero_engine_is_plain(tiny_loaded, draft_loaded):
    prompts = copy_prompts(4, seed=7)
    name, eng = spec_engine(tiny_loaded, draft_loaded, "ngram", 0, batch=4)
    assert eng.generate(prompts, GREEDY, speculation="on", proposer=name) == plain(tiny_loaded, prompts, GREEDY)
    assert eng.stats[name].num_draft_tokens == 0 and eng.stats[name].plain_steps > 0


@pytest.mark.parametrize("k", [2, 8])
def test_suffix_cache_drafts_accepted_output_identical(tiny_loaded, draft_loaded, k):
    """Repeated traffic: the second time, the suffix cache drafts the true continuation (accepted path)."""
    prompts = copy_prompts(8, seed=9)
    ref = plain(tiny_loaded, prompts, GREEDY)
    name, eng = spec_engine(tiny_loaded, draft_loaded, "suffix", k, batch=8)
    assert eng.generate(prompts, GREEDY, speculation="on", proposer=name) == ref
    eng.stats.clear()
    assert eng.generate(prompts, GREEDY, speculation="on", proposer=name) == ref
    st = eng.stats[name]
    assert st.num_draft_tokens > 0 and st.acceptance_rate > 0.9
    assert st.mean_acceptance_length > 1 + 0.5 * k


# ------------------------------------------------------------------ K changed mid-request

PATTERN = [0, 3, 0, 1, 8, 0, 2, 5, 0, 4]


class Switcher:
    """A decide function whose K per request changes every step and often goes to 0 and back."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}

    def __call__(self, snap: LoadSnapshot, cands: Sequence[SpecCandidate]) -> list[int]:
        ks = []
        for j, c in enumerate(cands):
            k = PATTERN[(snap.num_steps + j) % len(PATTERN)]
            ks.append(k)
            self.seen.setdefault(c.request_id, []).append(min(k, c.k_max))
        return ks


@pytest.mark.parametrize("kind", KINDS)
def test_k_switched_mid_request_identical_to_plain(tiny_loaded, draft_loaded, kind):
    params = {"max_tokens": 40, "ignore_eos": True}
    prompts = lookup_prompts(tiny_loaded, 6, seed=11, params=params)
    sw = Switcher()
    name, eng = spec_engine(tiny_loaded, draft_loaded, kind, 8, batch=8, decide=sw)
    outs = eng.generate(prompts, params, speculation="on", proposer=name)
    assert outs == plain(tiny_loaded, prompts, params)
    assert eng.stats[name].num_draft_tokens > 0
    # each request really went plain -> speculative -> plain ... several times, with different K
    for rid, ks in sw.seen.items():
        flips = sum((a == 0) != (b == 0) for a, b in zip(ks, ks[1:]))
        assert flips >= 3, (rid, ks)
        assert len({k for k in ks if k > 0}) >= 2, (rid, ks)


# ------------------------------------------------------------------ acceptance with a draft model


def test_draft_equals_target_accepts_everything(tiny_loaded, draft_loaded):
    """Draft = target, greedy: acceptance rate 1.0 and every verify commits K + 1 tokens."""
    k = 4
    params = {"max_tokens": 1 + 6 * (k + 1), "ignore_eos": True}  # prefill token + 6 full verify steps
    prompts = rand_prompts(3, seed=21)
    name, eng = spec_engine(tiny_loaded, draft_loaded, "draft_self", k, batch=4)
    res = run(eng, prompts, params, speculation="on", proposer=name)
    st = eng.stats[name]
    assert st.num_drafts == 6 * len(prompts) and st.num_draft_tokens == 6 * k * len(prompts)
    assert st.acceptance_rate == 1.0
    assert st.mean_acceptance_length == k + 1
    assert st.accepted_per_pos == [6 * len(prompts)] * k
    snap = eng.snapshot()  # what the goodput policy reads: every position accepts, every request drafts
    assert len(snap.acceptance_pos_ema[name]) == k and min(snap.acceptance_pos_ema[name]) > 0.95
    assert snap.proposal_rate_ema[name] == 1.0 and snap.acceptance_ema[name] > 0.95
    assert [r["tokens"] for r in res.values()] == plain(tiny_loaded, prompts, params)
    for r in res.values():
        assert r["spec"].acceptance_rate == 1.0 and r["spec"].mean_acceptance_length == k + 1


def test_draft_with_restricted_vocabulary_keeps_greedy_output(tiny_loaded):
    """The target as its own draft, drafting among half the vocabulary (a trained draft's
    draft_vocab.json): drafts that would leave it are replaced, and output is still plain's."""
    prompts = rand_prompts(4, seed=27)
    params = {"max_tokens": 16, "ignore_eos": True}
    V = tiny_loaded.model.config.vocab_size
    prop = DraftModelProposer(
        model=tiny_loaded.model, num_slots=4, max_model_len=MAX_LEN, target_vocab_size=V, vocab_ids=list(range(0, V, 2))
    )
    eng = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_num_seqs=4,
            max_model_len=MAX_LEN,
            num_speculative_tokens=4,
            proposers=[{"name": "draft_model"}],
        ),
        tiny_loaded,
        proposers={"draft_model": prop},
    )
    res = run(eng, prompts, params, speculation="on", proposer="draft_model")
    assert [r["tokens"] for r in res.values()] == plain(tiny_loaded, prompts, params)
    st = eng.stats["draft_model"]
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens  # even-id target tokens accepted, odd ones not


def test_random_draft_rejects_but_output_identical(tiny_loaded, draft_loaded):
    prompts = rand_prompts(6, seed=22)
    params = {"max_tokens": 32, "ignore_eos": True}
    name, eng = spec_engine(tiny_loaded, draft_loaded, "draft_bad", 4, batch=8)
    assert eng.generate(prompts, params, speculation="on", proposer=name) == plain(tiny_loaded, prompts, params)
    st = eng.stats[name]
    assert st.num_draft_tokens > 0
    assert st.acceptance_rate < 1.0
    assert 1.0 <= st.mean_acceptance_length < 5.0


# ------------------------------------------------------------------ sampled requests and usage stats


def check_usage(res: dict[str, dict[str, Any]], engine_stats) -> None:
    """Per-request usage stats add up to the engine's and to the tokens each request got."""
    tot_draft = tot_acc = tot_drafts = 0
    for rid, r in res.items():
        s = r["spec"]
        assert 0 <= s.num_accepted_tokens <= s.num_draft_tokens, rid
        assert 0.0 <= s.acceptance_rate <= 1.0 and 1.0 <= s.mean_acceptance_length, rid
        assert s.num_drafts == s.spec_steps
        assert sum(s.accepted_per_pos) == s.num_accepted_tokens
        assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:]))  # accepted is a prefix
        # every verify commits accepted + 1 tokens (the bonus / recovered one is not "accepted")
        assert len(r["tokens"]) == r["n_out"] == s.spec_steps + s.plain_steps + s.num_accepted_tokens, rid
        d = s.as_dict()
        assert d["acceptance_rate"] == s.acceptance_rate and d["num_draft_tokens"] == s.num_draft_tokens
        tot_draft += s.num_draft_tokens
        tot_acc += s.num_accepted_tokens
        tot_drafts += s.num_drafts
    assert (engine_stats.num_draft_tokens, engine_stats.num_accepted_tokens, engine_stats.num_drafts) == (
        tot_draft,
        tot_acc,
        tot_drafts,
    )


def test_sampled_draft_equals_target_stats_consistent(tiny_loaded, draft_loaded):
    params = {"max_tokens": 24, "ignore_eos": True, "temperature": 0.8, "seed": 1234}
    prompts = rand_prompts(5, seed=23)
    name, eng = spec_engine(tiny_loaded, draft_loaded, "draft_self", 4, batch=8)
    res = run(eng, prompts, params, speculation="on", proposer=name)
    st = eng.stats[name]
    assert st.num_draft_tokens > 0
    assert st.num_accepted_tokens <= st.num_draft_tokens
    assert 0.0 <= st.acceptance_rate <= 1.0
    # q = p (same model, same temperature): min(1, p/q) accepts (almost) always
    assert st.acceptance_rate > 0.9
    assert all(len(r["tokens"]) == 24 and r["reason"] == "length" for r in res.values())
    check_usage(res, st)
    # seeded: the same requests give the same tokens again
    name2, eng2 = spec_engine(tiny_loaded, draft_loaded, "draft_self", 4, batch=8)
    again = run(eng2, prompts, params, speculation="on", proposer=name2)
    assert [r["tokens"] for r in again.values()] == [r["tokens"] for r in res.values()]


def test_sampled_random_draft_stats_consistent(tiny_loaded, draft_loaded):
    params = {"max_tokens": 20, "ignore_eos": True, "temperature": 0.8, "seed": 7}
    prompts = copy_prompts(4, seed=24)
    name, eng = spec_engine(tiny_loaded, draft_loaded, "draft_bad", 3, batch=4)
    res = run(eng, prompts, params, speculation="on", proposer=name)
    assert eng.stats[name].num_draft_tokens > 0 and eng.stats[name].acceptance_rate < 1.0
    check_usage(res, eng.stats[name])


def test_zero_drafts_stats_do_not_divide_by_zero(tiny_loaded, draft_loaded):
    params = {"max_tokens": 8, "ignore_eos": True, "temperature": 0.8, "seed": 3}
    prompts = copy_prompts(3, seed=25)
    name, eng = spec_engine(tiny_loaded, draft_loaded, "ngram", 4, batch=4)
    res = run(eng, prompts, params, speculation="off", proposer=name)
    for r in res.values():
        s = r["spec"]
        assert s.num_draft_tokens == 0 and s.plain_steps == 8
        assert s.acceptance_rate == 0.0 and s.mean_acceptance_length == 1.0
        assert s.as_dict()["acceptance_rate"] == 0.0
    st = eng.stats[name]
    assert st.num_draft_tokens == 0 and st.acceptance_rate == 0.0 and st.mean_acceptance_length == 1.0
    check_usage(res, st)
    assert name not in eng.snapshot().proposal_rate_ema  # never asked: no rate yet (the policy assumes 1)
    # asked to draft on prompts with no repeats: n-gram finds nothing on most steps, and the rate says so
    run(eng, rand_prompts(3, seed=26), {"max_tokens": 8, "ignore_eos": True}, speculation="on", proposer=name)
    assert eng.snapshot().proposal_rate_ema[name] < 0.5


# ------------------------------------------------------------------ limits never overshot


def warm(eng: LLMEngine, name: str, prompts, params) -> None:
    """Run the prompts plainly once: the suffix proposer caches them, so it drafts the true continuation."""
    eng.generate(prompts, params, speculation="off", proposer=name)
    eng.stats.clear()


@pytest.mark.parametrize("kind", KINDS)
def test_max_tokens_never_overshot(tiny_loaded, draft_loaded, kind):
    prompts = copy_prompts(4, seed=31)
    params = {"max_tokens": 5, "ignore_eos": True}
    name, eng = spec_engine(tiny_loaded, draft_loaded, kind, 8, batch=4)
    warm(eng, name, prompts, params)
    res = run(eng, prompts, params, speculation="on", proposer=name)
    ref = plain(tiny_loaded, prompts, params)
    for r, p in zip(res.values(), ref):
        assert len(r["tokens"]) == 5 and r["n_out"] == 5 and r["reason"] == "length"
        assert r["tokens"] == p
        assert r["spec"].num_draft_tokens <= 3 * r["spec"].num_drafts  # k_max = 5 - 1 committed - 1 bonus
    if kind != "ngram":  # the random model never repeats itself within 5 tokens: no lookup match
        assert eng.stats[name].num_draft_tokens > 0
    if kind in ("suffix", "draft_self"):  # perfect drafts: the first verify takes 3 + 1 and must stop there
        assert eng.stats[name].num_accepted_tokens == 3 * len(prompts)


def test_context_end_never_overshot(tiny_loaded, draft_loaded):
    """prompt + max_tokens == max_model_len: K = 8 must shrink near the end of the context."""
    max_len = 64
    prompt = copy_prompts(1, seed=32)[0]
    params = {"max_tokens": max_len - len(prompt), "ignore_eos": True}
    name, p = make_proposer("draft_self", tiny_loaded, draft_loaded, num_slots=2)
    eng = LLMEngine(
        EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=max_len, num_speculative_tokens=8),
        tiny_loaded,
        proposers={name: p},
    )
    res = run(eng, [prompt], params, speculation="on", proposer=name)["r0"]
    assert res["tokens"] == plain(tiny_loaded, [prompt], params)[0]
    assert len(res["tokens"]) == params["max_tokens"] and res["reason"] == "length"
    assert eng.stats[name].num_draft_tokens > 0


@pytest.mark.parametrize("kind", KINDS)
def test_stop_string_never_overshot(tiny_loaded, draft_loaded, kind):
    params = {"max_tokens": 30, "ignore_eos": True}
    prompt = lookup_prompts(tiny_loaded, 1, seed=33, params=params)[0]
    full = plain(tiny_loaded, [prompt], params)[0]
    text = tiny_loaded.tokenizer.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and stop in text
    sparams = {**params, "stop": [stop]}
    ref_eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN), tiny_loaded)
    ref = run(ref_eng, [prompt], sparams)["r0"]
    assert ref["reason"] == "stop" and ref["text"] == text[: text.index(stop)]
    name, eng = spec_engine(tiny_loaded, draft_loaded, kind, 8, batch=2)
    warm(eng, name, [prompt], params)  # suffix: drafts the true text, straight across the stop string
    got = run(eng, [prompt], sparams, speculation="on", proposer=name)["r0"]
    assert got["reason"] == "stop"
    assert got["text"] == ref["text"] == text[: text.index(stop)]
    assert got["tokens"] == ref["tokens"]
    assert eng.stats[name].num_draft_tokens > 0


# ------------------------------------------------------------------ bad configuration


@pytest.mark.parametrize("bad", [{"num_speculative_tokens": -1}, {"num_speculative_tokens": 1000}, {"bogus": 1}])
def test_bad_engine_config_names_the_field(bad):
    with pytest.raises(ValidationError) as ei:
        EngineConfig(**bad)
    field = next(iter(bad))
    assert field in str(ei.value)
    assert any(field in map(str, e["loc"]) for e in ei.value.errors())


def test_draft_with_other_vocabulary_rejected(tiny_loaded):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    small = LlamaForCausalLM(cfg).eval()
    target_vocab = tiny_loaded.model.config.vocab_size
    with pytest.raises(ValueError, match="vocab"):
        DraftModelProposer(model=small, num_slots=2, max_model_len=MAX_LEN, target_vocab_size=target_vocab)
    # and the engine refuses a draft proposer built without the check
    unchecked = DraftModelProposer(model=small, num_slots=2, max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match="vocab"):
        LLMEngine(
            EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN),
            tiny_loaded,
            proposers={"draft_model": unchecked},
        )


# ------------------------------------------------------------------ the real model


CHAT = [
    "What is the capital of France?",
    "Repeat exactly: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps.",
    "List three colors.",
    "Write a haiku about the sea.",
]


@pytest.mark.slow
def test_smollm2_speculative_identical_to_plain(smollm2_loaded):
    """The real model, chat prompts: ngram and suffix at K = 4, the target as its own draft at K = 2."""
    loaded = smollm2_loaded  # one intra-op thread (module fixture): on 2 shared cores a 2nd thread only spins
    k_of = {"suffix": 4, "ngram": 4, "draft_model": 2}  # suffix first: its cache starts cold
    draft = DraftModelProposer(
        model=loaded.model, num_slots=4, max_model_len=512, target_vocab_size=loaded.model.config.vocab_size
    )

    def decide(snap: LoadSnapshot, cands: Sequence[SpecCandidate]) -> list[int]:
        return [0 if c.speculation == "off" else min(k_of[c.proposer], c.k_max) for c in cands]

    # one engine (one copy of the weights) for the plain reference and all three proposers
    eng = LLMEngine(
        EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=512, num_speculative_tokens=4),
        loaded,
        proposers={"ngram": NgramProposer(), "suffix": SuffixProposer(), "draft_model": draft},
        decide=decide,
    )
    prompts = [eng.tokenize_chat([{"role": "user", "content": c}]) for c in CHAT]
    params = {"max_tokens": 32}
    # every finished request (any proposer, or plain) enters the suffix cache: plain runs last,
    # else the suffix run would just replay the cached answers
    outs = {name: eng.generate(prompts, params, speculation="on", proposer=name) for name in k_of}
    ref = eng.generate(prompts, params, speculation="off")
    assert max(map(len, ref)) == 32
    for name in k_of:
        for c, o, r in zip(CHAT, outs[name], ref):
            assert o == r, (name, c)
        st = eng.stats[name]
        assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0, (name, st)  # some drafts pay
    assert eng.stats["draft_model"].acceptance_rate > 0.9  # the target drafting for itself


COPY = [
    "Copy this list exactly: apples, pears, plums, cherries, grapes, melons, lemons, limes.",
    'Return this JSON with "city" set to "Oslo": {"name": "Ada", "city": "Paris", "age": 36}',
]


@pytest.mark.slow
def test_smollm2_greedy_identical_for_every_k_and_batch(smollm2_loaded):
    """SmolLM2, greedy: n-gram, suffix and the target as its own draft write what plain decoding writes
    in the same batch (chat and copy prompts mixed): K = 1, 2, 4, 8 at batch 8, 1 and 8 at batch 1, and
    8 at batch 32, where the 256-token budget clips K (32 x 9 > 256). Logits: test_batch_invariance."""
    loaded = smollm2_loaded
    k_now = {"k": 0}
    eng = LLMEngine(
        EngineConfig(dtype="float32", max_num_seqs=32, max_model_len=512, num_speculative_tokens=8),
        loaded,
        proposers={
            "ngram": NgramProposer(),
            "suffix": SuffixProposer(),
            "draft_model": DraftModelProposer(
                model=loaded.model, num_slots=32, max_model_len=512, target_vocab_size=loaded.model.config.vocab_size
            ),
        },
        decide=lambda snap, cands: [0 if c.speculation == "off" else min(k_now["k"], c.k_max) for c in cands],
    )
    texts = CHAT + COPY
    prompts = [eng.tokenize_chat([{"role": "user", "content": t}]) for t in texts]
    params = {"max_tokens": 16}
    for batch, ks in ((1, (1, 8)), (8, (1, 2, 4, 8)), (32, (8,))):
        ps = [prompts[i % len(prompts)] for i in range(batch)]
        ref = eng.generate(ps, params, speculation="off")
        for name in ("ngram", "suffix", "draft_model"):
            for k in ks:
                if name == "suffix":
                    eng.proposers["suffix"] = SuffixProposer()  # cold: earlier runs must not hand it the answer
                k_now["k"] = k
                assert eng.generate(ps, params, speculation="on", proposer=name) == ref, (batch, name, k)
    for name in ("ngram", "suffix", "draft_model"):
        assert eng.stats[name].num_accepted_tokens > 0, name
