"""workers/rejection_sampler.py: greedy exactness, distribution (chi-square), seeding.

Distribution tests verify a batch of many identical requests at once: each request
draws its own drafts from ``q``, so the emitted tokens are independent samples.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_sampler import assert_follows
from workers.rejection_sampler import _residual, verify
from workers.sampler import make_generator, probs_for, process_logits, sampling_tensors
from workers.sampling_params import SamplingParams

V = 8
N = 50_000
GREEDY = SamplingParams()


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)


def _processed(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:  # [rows, V]
    return process_logits(logits, *(t.expand(logits.shape[0]) for t in sampling_tensors([sp], "cpu")))


def _verify_many(
    target: torch.Tensor,  # [k + 1, V] raw target logits, shared by every request
    q: torch.Tensor | None,  # [k, V] draft probs shared by every request, None = one-hot
    sp: SamplingParams,
    drafts: torch.Tensor,  # [n, k] draft tokens, one row per request (drawn from q by the caller)
):
    n = drafts.shape[0]
    return verify(
        target.repeat(n, 1),
        drafts.tolist(),
        [q] * n if q is not None else [None] * n,
        [sp] * n,
        [None] * n,
    )


def _draw(q: torch.Tensor, n: int) -> torch.Tensor:  # q [k, V] -> [n, k] tokens x_j ~ q_j
    return torch.multinomial(q, n, replacement=True).T.contiguous()


def _first(out) -> torch.Tensor:  # [n] first emitted token of each request
    return torch.tensor([o[0] for o in out.output_token_ids])


SAMPLED = SamplingParams(temperature=1.0)
TRUNCATED = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)


@pytest.mark.parametrize("sp", [SAMPLED, TRUNCATED], ids=["plain", "temp-topk-topp"])
def test_p_equals_q(sp: SamplingParams) -> None:
    target = torch.randn(3, V)
    p = _processed(target, sp)
    out = _verify_many(target, p[:2], sp, _draw(p[:2], N))
    assert_follows(_first(out), p[0])
    assert all(a == 2 for a in out.num_accepted)  # ratio is exactly 1: never rejected


def test_disjoint_supports_always_recover_from_p() -> None:
    target = torch.randn(3, V)
    target[:, 4:] = float("-inf")  # p lives on tokens 0-3
    q = torch.zeros(2, V)
    q[:, 4:] = torch.softmax(torch.randn(2, 4), -1)  # q on tokens 4-7
    out = _verify_many(target, q, SAMPLED, _draw(q, N))
    assert max(out.num_accepted) == 0
    assert_follows(_first(out), _processed(target, SAMPLED)[0])


def test_one_hot_p() -> None:
    target = torch.randn(3, V)
    sp = SamplingParams(temperature=1.3, top_k=1)  # p is one-hot at the argmax
    q = _processed(torch.randn(2, V), sp.model_copy(update={"top_k": 0}))
    out = _verify_many(target, q, sp, _draw(q, N))
    assert (_first(out) == target[0].argmax()).all()


@pytest.mark.parametrize("sp", [SAMPLED, TRUNCATED], ids=["plain", "temp-topk-topp"])
def test_one_hot_q(sp: SamplingParams) -> None:
    # n-gram style: drafts are not sampled from any q; any draft token must still work.
    target = torch.randn(3, V)
    drafts = torch.randint(0, V, (N, 2))
    out = _verify_many(target, None, sp, drafts)
    assert_follows(_first(out), _processed(target, sp)[0])


@pytest.mark.parametrize("sp", [SAMPLED, TRUNCATED, SamplingParams(temperature=2.0, top_p=0.6)])
def test_random_p_and_q(sp: SamplingParams) -> None:
    target = torch.randn(3, V)
    q = _processed(torch.randn(2, V), sp)  # the draft gets the same transform
    out = _verify_many(target, q, sp, _draw(q, N))
    assert_follows(_first(out), _processed(target, sp)[0])


def test_plain_step_samples_row_zero() -> None:
    target = torch.randn(1, V)
    out = _verify_many(target, None, TRUNCATED, torch.empty(N, 0, dtype=torch.long))
    assert set(out.num_accepted) == {0}
    assert_follows(_first(out), _processed(target, TRUNCATED)[0])


def test_second_token_given_first_accepted() -> None:
    target = torch.randn(3, V) * 0.5
    q = _processed(torch.randn(2, V) * 0.5, SAMPLED)
    drafts = _draw(q, 60_000)
    out = _verify_many(target, q, SAMPLED, drafts)
    second = torch.tensor([o[1] for o, a in zip(out.output_token_ids, out.num_accepted) if a >= 1])
    assert len(second) > 20_000
    assert_follows(second, _processed(target, SAMPLED)[1])
    assert_follows(_first(out), _processed(target, SAMPLED)[0])


def test_residual() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0], [0.4, 0.1, 0.5]])
    torch.testing.assert_close(_residual(p, q), torch.tensor([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0], [0.0, 1.0, 0.0]]))


def test_token_target_cannot_emit_is_never_accepted() -> None:
    target = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2)
    sp = SamplingParams(temperature=1.0, top_k=2)  # p(3) == 0
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])  # q(3) == 0 too: a broken proposer
    out = verify(target.repeat(500, 1), [[3]] * 500, [q] * 500, [sp] * 500, [None] * 500)
    assert set(out.num_accepted) == {0}
    assert {o[0] for o in out.output_token_ids} <= {0, 1}


# Greedy: rows' argmax are 2, 4, 1.
GREEDY_LOGITS = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.0], [1.0, 0.0, 0.0, 2.0, 3.0], [0.0, 9.0, 1.0, 1.0, 1.0]])


@pytest.mark.parametrize(
    ("drafts", "accepted", "output"),
    [([2, 4], 2, [2, 4, 1]), ([2, 3], 1, [2, 4]), ([0, 4], 0, [2]), ([3, 3], 0, [2])],
)
def test_greedy_hand_written(drafts: list[int], accepted: int, output: list[int]) -> None:
    # draft_probs are ignored for greedy requests.
    out = verify(GREEDY_LOGITS, [drafts], [torch.full((2, 5), 0.2)], [GREEDY], [None])
    assert out.num_accepted == [accepted]
    assert out.output_token_ids == [output]


def test_greedy_empty_drafts_is_argmax() -> None:
    out = verify(GREEDY_LOGITS, [[], [], []], [None] * 3, [GREEDY] * 3, [None] * 3)
    assert out.output_token_ids == [[2], [4], [1]]
    assert out.num_accepted == [0, 0, 0]


def test_greedy_speculation_matches_plain_greedy_decoding() -> None:
    vocab = 16
    bigram = torch.randn(vocab, vocab)  # toy target: next logits depend on the last token

    plain = [3]
    while len(plain) < 40:
        plain.append(int(bigram[plain[-1]].argmax()))

    seq = [3]
    while len(seq) < 40:
        k = int(torch.randint(0, 5, ()))
        # A proposer that is right about half the time.
        drafts, last = [], seq[-1]
        for _ in range(k):
            guess = int(bigram[last].argmax()) if torch.rand(()) < 0.6 else int(torch.randint(0, vocab, ()))
            drafts.append(guess)
            last = guess
        logits = bigram[torch.tensor([seq[-1]] + drafts)]  # [k + 1, vocab]
        out = verify(logits, [drafts], [None], [GREEDY], [None])
        seq.extend(out.output_token_ids[0])
    assert seq[:40] == plain


def _mixed_batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    params = [GREEDY, SAMPLED, TRUNCATED, SamplingParams(temperature=0.5, top_p=0.8), SAMPLED, TRUNCATED] * 3
    ks = [int(k) for k in torch.randint(0, 5, (len(params),), generator=g)]
    logits = torch.randn(sum(k + 1 for k in ks), V, generator=g) * 2
    drafts, probs = [], []
    for i, (sp, k) in enumerate(zip(params, ks)):
        if i % 4 == 1 or sp.greedy:  # n-gram style proposer
            drafts.append([int(t) for t in torch.randint(0, V, (k,), generator=g)])
            probs.append(None)
        else:
            q = probs_for(torch.randn(k, V, generator=g) * 2, [sp] * k)
            drafts.append([int(torch.multinomial(row, 1, generator=g)) for row in q])
            probs.append(q)
    return logits, drafts, probs, params, ks


def _seeded(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [make_generator(100 + i, "cpu") for i in range(len(params))]


def test_seeded_rerun_identical_and_batch_equals_per_request() -> None:
    logits, drafts, probs, params, ks = _mixed_batch(0)
    batched = verify(logits, drafts, probs, params, _seeded(params))
    again = verify(logits, drafts, probs, params, _seeded(params))
    assert batched == again

    start, gens = 0, _seeded(params)
    for i, k in enumerate(ks):
        alone = verify(logits[start : start + k + 1], [drafts[i]], [probs[i]], [params[i]], [gens[i]])
        start += k + 1
        assert alone.output_token_ids[0] == batched.output_token_ids[i]
        assert alone.num_accepted[0] == batched.num_accepted[i]


@pytest.mark.parametrize("seed", range(10))
def test_invariants_random_batches(seed: int) -> None:
    logits, drafts, probs, params, ks = _mixed_batch(seed)
    gens = [make_generator(seed, "cpu") if i % 2 else None for i in range(len(params))]
    out = verify(logits, drafts, probs, params, gens)
    start = 0
    for i, k in enumerate(ks):
        a, toks = out.num_accepted[i], out.output_token_ids[i]
        assert 0 <= a <= k
        assert len(toks) == a + 1
        assert toks[:a] == drafts[i][:a]
        # The emitted token is one the target could emit at that position.
        p = probs_for(logits[start + a : start + a + 1], [params[i]])[0]
        assert p[toks[-1]] > 0
        start += k + 1


def test_rejects_inconsistent_inputs() -> None:
    with pytest.raises(ValueError):
        verify(torch.randn(2, V), [[1, 2]], [None], [SAMPLED], [None])  # needs 3 rows
    with pytest.raises(ValueError):
        verify(torch.randn(3, V), [[1, 2]], [torch.rand(3, V)], [SAMPLED], [None])  # q has 3 rows
    with pytest.raises(ValueError):
        verify(torch.randn(3, V), [[1, 2]], [None], [SAMPLED, SAMPLED], [None])
