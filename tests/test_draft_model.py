"""Draft-model proposer on tiny random Llama models: greedy drafts, LCP rollback, sampling, slots."""

from __future__ import annotations

import random
from typing import Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workers.proposers.base import ProposalRequest
from workers.proposers.draft_model import DraftModelProposer, common_prefix_len
from workers.proposers.registry import make_proposer
from workers.sampler import process_logits
from workers.sampling_params import SamplingParams

VOCAB = 256
MAX_LEN = 64

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_llama(vocab_size: int = VOCAB, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama()


def proposer(
    model: LlamaForCausalLM,
    num_slots: int = 4,
    max_model_len: int = MAX_LEN,
    native: bool = False,
    cpu_gemm: str = "onednn",
) -> DraftModelProposer:
    return DraftModelProposer(
        model,
        num_slots=num_slots,
        max_model_len=max_model_len,
        device="cpu",
        native_kernels=native,
        cpu_gemm=cpu_gemm,
    )


def req(
    tokens: Sequence[int],
    k: int,
    rid: str = "r",
    eos: Sequence[int] = (),
    sampling: SamplingParams | None = None,
) -> ProposalRequest:
    return ProposalRequest(
        request_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        k=k,
        eos_token_ids=frozenset(eos),
        sampling=sampling or SamplingParams(),
    )


@torch.inference_mode()
def hf_logits(model: LlamaForCausalLM, tokens: Sequence[int]) -> torch.Tensor:  # [V] next-token logits
    return model(torch.tensor([list(tokens)])).logits[0, -1].float()


def greedy_reference(model: LlamaForCausalLM, tokens: Sequence[int], n: int) -> list[int]:
    """Plain greedy decoding with the HF forward, no cache: the slow obvious way."""
    seq = list(tokens)
    for _ in range(n):
        seq.append(int(hf_logits(model, seq).argmax()))
    return seq[len(tokens) :]


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4], hint=3) == 3
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([9, 2, 3], [1, 2, 3], hint=2) == 0  # a wrong hint falls back to a full scan
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 5], hint=10) == 2


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_self_draft_is_greedy_decoding(model: LlamaForCausalLM, k: int) -> None:
    lengths = [5, 9, 3, 12]
    prompts = [prompt(n, seed) for seed, n in enumerate(lengths)]
    refs = [greedy_reference(model, p, k) for p in prompts]

    single = proposer(model).propose([req(prompts[0], k)])
    assert single.draft_token_ids == [refs[0]]
    assert single.draft_probs == [None]

    batched = proposer(model).propose([req(p, k, rid=f"r{i}") for i, p in enumerate(prompts)])
    assert batched.draft_token_ids == refs
    assert batched.draft_probs == [None] * 4


def test_mixed_k_in_one_batch(model: LlamaForCausalLM) -> None:
    prompts = [prompt(n, 10 + n) for n in (4, 7, 11)]
    ks = [1, 5, 3]
    out = proposer(model).propose([req(p, k, rid=str(i)) for i, (p, k) in enumerate(zip(prompts, ks))])
    assert out.draft_token_ids == [greedy_reference(model, p, k) for p, k in zip(prompts, ks)]


def test_rollback_after_partial_accept(model: LlamaForCausalLM) -> None:
    p = prompt(8, 1)
    prop = proposer(model)
    first = prop.propose([req(p, 4)]).draft_token_ids[0]
    assert len(first) == 4
    assert prop.kv_tokens_in_use == len(p) + 3  # prompt + every draft but the last
    # The target accepted only the first draft and then recovered a different token.
    other = (first[1] + 1) % VOCAB
    tokens = p + [first[0], other]
    again = prop.propose([req(tokens, 4)]).draft_token_ids[0]
    fresh = proposer(model).propose([req(tokens, 4)]).draft_token_ids[0]
    assert again == fresh == greedy_reference(model, tokens, 4)


def test_rollback_after_plain_steps(model: LlamaForCausalLM) -> None:
    """The request went down the plain path for a few steps (no propose, no feedback):
    its first new token differs from the stale draft 0 and more tokens follow it."""
    p = prompt(8, 16)
    prop = proposer(model)
    first = prop.propose([req(p, 4)]).draft_token_ids[0]
    tokens = p + [(first[0] + 1) % VOCAB, first[1], first[2]]  # only position len(p) disagrees
    again = prop.propose([req(tokens, 3)]).draft_token_ids[0]
    assert again == greedy_reference(model, tokens, 3)


@pytest.mark.parametrize(
    "native,cpu_gemm",
    [(False, "onednn"), (True, "onednn"), (True, "native")],
    ids=["torch-ops", "native-kernels", "native-forward"],
)
def test_incremental_equals_fresh_over_many_steps(model: LlamaForCausalLM, native: bool, cpu_gemm: str) -> None:
    """A proposer that follows requests step by step (random accept lengths, random
    recovered tokens, varying k, one request taking plain steps) drafts what a fresh one does."""
    rng = random.Random(7)
    seqs = {"a": prompt(6, 2), "b": prompt(3, 3), "c": prompt(10, 4)}
    prop = proposer(model, native=native, cpu_gemm=cpu_gemm)
    for step in range(6):
        if step == 2:  # "b" takes two plain decode steps: no propose, two new tokens
            seqs["b"] = seqs["b"] + [rng.randrange(VOCAB), rng.randrange(VOCAB)]
        rids = [rid for rid in seqs if not (rid == "b" and step == 2)]
        ks = {rid: rng.choice([1, 3, 4]) for rid in rids}
        out = prop.propose([req(seqs[rid], ks[rid], rid=rid) for rid in rids])
        fresh = proposer(model, native=native, cpu_gemm=cpu_gemm).propose(
            [req(seqs[rid], ks[rid], rid=rid) for rid in rids]
        )
        assert out.draft_token_ids == fresh.draft_token_ids
        for rid, d in zip(rids, out.draft_token_ids):
            accepted = rng.randint(0, len(d))
            seqs[rid] = seqs[rid] + d[:accepted] + [rng.randrange(VOCAB)]
    assert prop.num_active == 3


def test_sampled_draft_probs(model: LlamaForCausalLM) -> None:
    p = prompt(7, 5)
    sp = SamplingParams(temperature=0.8, seed=123)
    requests = [
        req(p, 4, rid="s", sampling=sp),
        req(prompt(4, 6), 2, rid="g"),  # greedy neighbour: no q
        req(prompt(5, 8), 3, rid="u", sampling=SamplingParams(temperature=1.3)),  # unseeded
    ]
    out = proposer(model).propose(requests)
    assert out.draft_probs[1] is None
    for i in (0, 2):
        d, q = out.draft_token_ids[i], out.draft_probs[i]
        assert q is not None and q.shape == (len(d), VOCAB) == (requests[i].k, VOCAB)
        assert torch.allclose(q.sum(-1), torch.ones(len(d)), atol=1e-5)
        assert bool((q[torch.arange(len(d)), torch.tensor(d)] > 0).all())  # each draft was drawn from its q

    # q_0 is the request's temperature applied to the draft's logits after the prompt.
    expected = process_logits(hf_logits(model, p)[None], torch.tensor([0.8]), torch.tensor([0]), torch.tensor([1.0]))[0]
    assert torch.allclose(out.draft_probs[0][0], expected, atol=1e-5)

    # Seeded: the same calls on a fresh proposer give the same drafts and q.
    again = proposer(model).propose(requests[:1])
    assert again.draft_token_ids[0] == out.draft_token_ids[0]
    assert torch.allclose(again.draft_probs[0], out.draft_probs[0])


def test_top_k_one_is_one_hot_at_argmax(model: LlamaForCausalLM) -> None:
    p = prompt(9, 9)
    out = proposer(model).propose([req(p, 4, sampling=SamplingParams(temperature=1.0, top_k=1))])
    d, q = out.draft_token_ids[0], out.draft_probs[0]
    assert d == greedy_reference(model, p, 4)
    assert q is not None
    assert torch.equal(q, torch.nn.functional.one_hot(torch.tensor(d), VOCAB).float())


def test_vocabulary_mismatch_is_rejected() -> None:
    with pytest.raises(ValueError, match="draft vocabulary 300 != target vocabulary 256"):
        DraftModelProposer(tiny_llama(vocab_size=300), num_slots=1, max_model_len=16, target_vocab_size=256)


def test_slots_are_freed_and_reused(model: LlamaForCausalLM) -> None:
    prop = proposer(model, num_slots=2)
    prop.propose([req(prompt(4, 0), 2, rid="a"), req(prompt(5, 1), 2, rid="b")])
    assert prop.num_active == 2
    assert prop.kv_tokens_in_use == 4 + 1 + 5 + 1
    # beyond num_slots a request gets no drafts this step (it runs plain) and no state
    assert prop.propose([req(prompt(4, 2), 2, rid="c")]).draft_token_ids == [[]]
    assert not prop.has("c")
    prop.finish("a", [])
    assert prop.num_active == 1
    p = prompt(6, 3)
    assert prop.propose([req(p, 3, rid="c")]).draft_token_ids == [greedy_reference(model, p, 3)]
    assert prop.blocks.tables["c"] == [0]  # the lowest free block, given back by "a"
    prop.finish("b", [])
    prop.finish("c", [])
    prop.finish("never-seen", [])
    assert prop.num_active == 0 and prop.kv_tokens_in_use == 0


def test_reset_forgets_the_cache(model: LlamaForCausalLM) -> None:
    p = prompt(6, 11)
    prop = proposer(model)
    first = prop.propose([req(p, 3)]).draft_token_ids[0]
    prop.reset("r")
    assert prop.kv_tokens_in_use == 0
    assert prop.propose([req(p, 3)]).draft_token_ids[0] == first


def test_eos_stops_the_draft(model: LlamaForCausalLM) -> None:
    p = prompt(8, 12)
    ref = greedy_reference(model, p, 6)
    j = next(i for i in range(1, 6) if ref[i] not in ref[:i])  # first occurrence of a token after draft 0
    out = proposer(model).propose([req(p, 6, eos=[ref[j]])])
    assert out.draft_token_ids == [ref[:j]]
    out = proposer(model).propose([req(p, 6, eos=[ref[0]], sampling=SamplingParams(temperature=1.0, top_k=1))])
    assert out.draft_token_ids == [[]]
    assert out.draft_probs[0] is not None and out.draft_probs[0].shape == (0, VOCAB)


def test_drafts_fit_max_model_len(model: LlamaForCausalLM) -> None:
    prop = proposer(model, max_model_len=12)
    p = prompt(10, 13)
    assert prop.propose([req(p, 5)]).draft_token_ids == [greedy_reference(model, p, 2)]
    assert prop.propose([req(prompt(12, 14), 4, rid="full")]).draft_token_ids == [[]]


def test_registry_builds_draft_model(model: LlamaForCausalLM) -> None:
    prop = make_proposer("draft_model", model=model, num_slots=2, max_model_len=32, dtype=torch.float32, device="cpu")
    assert isinstance(prop, DraftModelProposer)
    p = prompt(5, 15)
    assert prop.propose([req(p, 2)]).draft_token_ids == [greedy_reference(model, p, 2)]


def test_draft_vocabulary_restricts_drafts_and_q(model: LlamaForCausalLM) -> None:
    """With ``vocab_ids`` the draft is the argmax (or sample) over those ids only, and a sampled
    ``q`` is a full-width distribution that is 0 outside them (what the rejection sampler needs)."""
    ids = list(range(0, VOCAB, 3))  # every third token
    p = prompt(9, 7)
    restricted = DraftModelProposer(model, num_slots=2, max_model_len=MAX_LEN, device="cpu", vocab_ids=ids)
    got = restricted.propose([req(p, 4)]).draft_token_ids[0]
    seq, want = list(p), []  # the slow obvious way: HF logits, argmax among ids
    for _ in range(4):
        lg = hf_logits(model, seq)
        want.append(ids[int(lg[ids].argmax())])
        seq.append(want[-1])
    assert got == want and all(t in ids for t in got)
    assert want != greedy_reference(model, p, 4)  # the restriction did change something here

    sp = SamplingParams(temperature=0.8, seed=1)
    out = DraftModelProposer(model, num_slots=2, max_model_len=MAX_LEN, device="cpu", vocab_ids=ids).propose(
        [req(p, 3, sampling=sp)]
    )
    q = out.draft_probs[0]  # [3, V]
    assert q.shape == (3, VOCAB)
    mask = torch.ones(VOCAB, dtype=torch.bool)
    mask[ids] = False
    assert float(q[:, mask].abs().max()) == 0.0 and torch.allclose(q.sum(-1), torch.ones(3))
    assert all(t in ids for t in out.draft_token_ids[0])


def test_draft_vocab_file_is_validated(tmp_path) -> None:
    from workers.model_loader import read_draft_vocab

    assert read_draft_vocab(tmp_path, VOCAB) is None  # no file: the whole vocabulary
    (tmp_path / "draft_vocab.json").write_text('{"token_ids": [5, 3, 9]}')
    assert read_draft_vocab(tmp_path, VOCAB) == [3, 5, 9]
    for bad in ("[5, 5]", "[300]", "[-1]", "[]", '["a"]'):
        (tmp_path / "draft_vocab.json").write_text(f'{{"token_ids": {bad}}}')
        with pytest.raises(ValueError, match="token_ids"):
            read_draft_vocab(tmp_path, VOCAB)


def test_a_pool_too_small_for_all_still_drafts_exactly_for_those_holding_blocks(model: LlamaForCausalLM) -> None:
    """4 blocks of 16 for requests of 20-30 tokens: the oldest get their blocks and the same drafts as an
    unbounded proposer; the rest get none (they run plain, output unchanged) until blocks come back."""
    prompts = {rid: prompt(n, 40 + n) for rid, n in (("a", 20), ("b", 25), ("c", 28))}
    small = DraftModelProposer(model, num_slots=8, max_model_len=MAX_LEN, device="cpu", num_blocks=4, block_size=16)
    out = small.propose([req(p, 4, rid=rid) for rid, p in prompts.items()]).draft_token_ids
    assert out[:2] == [greedy_reference(model, prompts[r], 4) for r in "ab"] and out[2] == []
    assert small.blocks.num_used == 4 and not small.has("c")
    # "a" grows past its second block: the pool is full, so it gets the drafts its blocks still hold
    prompts["a"] = prompts["a"] + out[0] + [7, 8, 9, 10, 11, 12]  # 30 committed tokens, 2 blocks hold 32 positions
    again = small.propose([req(prompts["a"], 4, rid="a")]).draft_token_ids[0]
    assert again == greedy_reference(model, prompts["a"], 3)  # positions 30, 31 fed: 3 drafts
    small.finish("b")
    assert small.propose([req(prompts["c"], 4, rid="c")]).draft_token_ids == [greedy_reference(model, prompts["c"], 4)]


def test_a_request_that_cannot_hold_its_tokens_gives_its_blocks_back(model: LlamaForCausalLM) -> None:
    prop = DraftModelProposer(model, num_slots=4, max_model_len=MAX_LEN, device="cpu", num_blocks=3, block_size=16)
    a, b = prompt(20, 1), prompt(10, 2)
    prop.propose([req(a, 2, rid="a"), req(b, 2, rid="b")])  # a: 2 blocks, b: 1
    b = b + [3] * 20  # b now needs 2 blocks for its 30 committed tokens; none is free
    assert prop.propose([req(b, 2, rid="b")]).draft_token_ids == [[]]
    assert not prop.has("b") and prop.blocks.num_used == 2 and prop.kv_tokens_in_use == len(a) + 1
    prop.finish("a")
    assert prop.propose([req(b, 2, rid="b")]).draft_token_ids == [greedy_reference(model, b, 2)]  # re-prefilled


def test_draft_kv_follows_the_tokens_in_use_not_slots_times_max_model_len(model: LlamaForCausalLM) -> None:
    """128 slots of 8192 positions would be 1M positions; the pool holds what it is given, and a request
    holds blocks for its tokens plus its drafts' lookahead only."""
    prop = DraftModelProposer(model, num_slots=128, max_model_len=8192, device="cpu", num_blocks=600, block_size=16)
    per_block = prop.runner.kv_bytes_per_block
    assert prop.runner.kv_bytes == 600 * per_block and prop.blocks.tokens_capacity == 9600
    prop.propose([req(prompt(40, 3), 4, rid="a"), req(prompt(3, 4), 2, rid="b")])
    assert prop.blocks.num_used == 3 + 1  # ceil((40 + 3) / 16) + ceil((3 + 1) / 16)
    assert prop.kv_tokens_in_use == 43 + 4
    long = prompt(8000, 5)  # a full-length request fits the pool beside the others, drafting as one slot would
    alone = DraftModelProposer(model, num_slots=1, max_model_len=8192, device="cpu")
    assert prop.propose([req(long, 4, rid="long")]).draft_token_ids == alone.propose([req(long, 4)]).draft_token_ids
    assert prop.blocks.num_used == 4 + 501
    for rid in ("a", "b", "long"):
        prop.finish(rid)
    assert prop.blocks.num_used == 0 and prop.kv_tokens_in_use == 0


def test_native_kernels_draft_from_the_same_distribution(model: LlamaForCausalLM) -> None:
    """The native attention and row-wise ops, and with the native GEMMs the whole forward as one native call (the
    draft worker's shipped path), compute what the torch ops do, up to rounding: close logits at every position
    of a batch, and the native runners really are native."""
    from workers import native_attention

    if native_attention.load() is None:
        pytest.skip("no C compiler: every runner uses the torch ops")
    a, b, c = proposer(model), proposer(model, native=True), proposer(model, native=True, cpu_gemm="native")
    assert a.runner.attention_kernel != "native" and b.runner.attention_kernel == "native"
    assert b.runner.native_layers is None and c.runner.native_layers is not None
    prompts = [prompt(n, 30 + n) for n in (5, 9, 14)]
    la = a.runner.forward_tokens(0, 0, prompts[2])  # [n, V]
    for p in (b, c):
        torch.testing.assert_close(p.runner.forward_tokens(0, 0, prompts[2]), la, rtol=1e-4, atol=1e-4)
    outs = [p.propose([req(q, 4, rid=str(i)) for i, q in enumerate(prompts)]) for p in (a, b, c)]
    assert [len(d) for d in outs[1].draft_token_ids] == [4, 4, 4]
    assert [len(d) for d in outs[2].draft_token_ids] == [4, 4, 4]


def test_the_drafts_gemm_choice_resolves_as_the_engines_and_a_bad_one_is_refused(model: LlamaForCausalLM) -> None:
    """``draft.cpu_gemm`` defaults to 'auto', which the draft runner resolves as the engine's runner does (oneDNN
    where the native library does not build); an unknown name is refused by the config and by the proposer."""
    from pydantic import ValidationError

    from cluster.config import DraftConfig
    from workers import native_attention
    from workers.hardware import resolve_cpu_gemm

    assert DraftConfig().cpu_gemm == "auto"
    with pytest.raises(ValidationError, match="cpu_gemm"):
        DraftConfig(cpu_gemm="blas")
    prop = proposer(model, native=True, cpu_gemm="auto")
    want = resolve_cpu_gemm("auto", torch.float32)
    if want == "native" and native_attention.load_linear() is None:
        want = "onednn"
    assert prop.runner.cpu_gemm == want
    with pytest.raises(ValueError, match="cpu_gemm"):
        proposer(model, cpu_gemm="blas")
