"""workers/sampler.py on hand-written arrays, plus goodness of fit for ``sample``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from workers.sampler import (
    make_generator,
    probs_for,
    process_logits,
    process_params,
    sample,
    sampling_tensors,
    truncated_by_sort,
)
from workers.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def assert_follows(
    tokens: torch.Tensor,  # [n] long sampled token ids
    probs: torch.Tensor,  # [vocab] the distribution they should follow
) -> None:
    """Chi-square goodness of fit (p > 0.001); zero-probability tokens must never appear."""
    counts = np.bincount(tokens.cpu().numpy(), minlength=probs.numel())
    want = probs.double().cpu().numpy()
    support = want > 0
    assert counts[~support].sum() == 0, f"sampled tokens outside the support: {counts}"
    if support.sum() == 1:
        return
    expected = want[support] / want[support].sum() * counts.sum()
    assert expected.min() >= 5, "test design: expected counts too small for chi-square"
    result = chisquare(counts[support], expected)
    assert result.pvalue > 0.001, f"counts {counts} vs expected {expected}: p = {result.pvalue}"


def _process(logits: list[list[float]], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    x = torch.tensor(logits, dtype=torch.float32)
    n = x.shape[0]
    return process_logits(
        x, torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.long), torch.full((n,), top_p)
    )


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.randn(4, 10)
    for t in (0.25, 1.0, 3.0):
        got = _process(logits.tolist(), temperature=t)
        torch.testing.assert_close(got, torch.softmax(logits / t, dim=-1))
    # Temperature applies before truncation too (the slow path).
    got = _process(logits.tolist(), temperature=0.5, top_k=3)
    scaled = torch.softmax(logits / 0.5, dim=-1)
    top = scaled.topk(3, dim=-1)
    want = torch.zeros_like(scaled).scatter_(1, top.indices, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(got, want)


def test_rows_sum_to_one_and_tiny_temperature_stays_finite() -> None:
    logits = torch.randn(6, 50) * 10
    probs = _process(logits.tolist(), temperature=1e-9, top_p=0.9)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(6))
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("k", [1, 2, 5, 9])
def test_top_k_keeps_exactly_k_most_likely(k: int) -> None:
    logits = torch.randn(5, 9)
    probs = _process(logits.tolist(), top_k=k)
    assert ((probs > 0).sum(-1) == k).all()
    kept_min = torch.where(probs > 0, logits, torch.inf).amin(-1)
    dropped_max = torch.where(probs > 0, -torch.inf, logits).amax(-1)
    assert (kept_min > dropped_max).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))


def test_top_k_ties_keep_exactly_k_lowest_ids() -> None:
    probs = _process([[1.0, 3.0, 3.0, 3.0, 0.0]], top_k=2)
    assert probs[0].tolist() == [0.0, 0.5, 0.5, 0.0, 0.0]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(1e-6, 1), (0.49, 1), (0.51, 2), (0.79, 2), (0.81, 3), (0.94, 3), (0.96, 4), (1.0, 4)],
)
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p: float, kept: int) -> None:
    # Shuffled order: the token ids of 0.5, 0.3, 0.15, 0.05 are 2, 0, 3, 1.
    base = [0.3, 0.05, 0.5, 0.15]
    probs = _process([_log(base)], top_p=top_p)[0]
    order = [2, 0, 3, 1]
    assert (probs > 0).tolist() == [i in order[:kept] for i in range(4)]
    mass = sum(base[i] for i in order[:kept])
    want = [b / mass if i in order[:kept] else 0.0 for i, b in enumerate(base)]
    torch.testing.assert_close(probs, torch.tensor(want))


def test_top_p_is_measured_after_top_k() -> None:
    logits = [_log([0.4, 0.3, 0.2, 0.1])]
    # top-k 2 renormalizes to [4/7, 3/7]; 4/7 > 0.55 so top-p keeps one token.
    assert (_process(logits, top_k=2, top_p=0.55)[0] > 0).sum() == 1
    # Without top-k, 0.4 < 0.55 so top-p needs two.
    assert (_process(logits, top_p=0.55)[0] > 0).sum() == 2
    torch.testing.assert_close(_process(logits, top_k=2, top_p=0.6)[0], torch.tensor([4 / 7, 3 / 7, 0.0, 0.0]))


def test_rows_are_independent() -> None:
    logits = torch.randn(4, 12)
    temperature = torch.tensor([0.5, 1.0, 2.0, 1.0])
    top_k = torch.tensor([0, 3, 0, 12], dtype=torch.long)
    top_p = torch.tensor([1.0, 1.0, 0.7, 1.0])
    batched = process_logits(logits, temperature, top_k, top_p)
    for i in range(4):
        alone = process_logits(logits[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        torch.testing.assert_close(batched[i : i + 1], alone)
    # Rows with nothing to truncate match the fast path exactly (top_k >= vocab is off).
    torch.testing.assert_close(batched[3], torch.softmax(logits[3], -1))
    torch.testing.assert_close(batched[0], torch.softmax(logits[0] / 0.5, -1))


def test_probs_for_greedy_rows_are_one_hot() -> None:
    logits = torch.randn(3, 7)
    params = [SamplingParams(), SamplingParams(temperature=0.8, top_k=4), SamplingParams(temperature=1.5, top_p=0.5)]
    probs = probs_for(logits, params)
    assert probs[0].tolist() == torch.nn.functional.one_hot(logits[0].argmax(), 7).float().tolist()
    torch.testing.assert_close(probs[1:2], _process(logits[1:2].tolist(), temperature=0.8, top_k=4))
    torch.testing.assert_close(probs[2:3], _process(logits[2:3].tolist(), temperature=1.5, top_p=0.5))
    with pytest.raises(ValueError):
        probs_for(logits, params[:2])


def test_sample_follows_probs_chi_square() -> None:
    probs = torch.tensor([0.3, 0.0, 0.2, 0.25, 0.05, 0.0, 0.15, 0.05])
    n = 50_000
    # Unnormalized rows are fine: the exponential race only needs relative mass.
    tokens = sample((probs * 3).expand(n, -1).contiguous(), [None] * n)
    assert_follows(tokens, probs)


def test_sample_seeded_row_ignores_batch() -> None:
    probs = torch.softmax(torch.randn(5, 100), -1)
    alone = sample(probs[2:3], [make_generator(42, "cpu")])
    gens = [None, make_generator(7, "cpu"), make_generator(42, "cpu"), None, make_generator(9, "cpu")]
    batched = sample(probs, gens)
    assert batched[2] == alone[0]
    rerun = sample(probs, [None, make_generator(7, "cpu"), make_generator(42, "cpu"), None, make_generator(9, "cpu")])
    assert rerun[[1, 2, 4]].tolist() == batched[[1, 2, 4]].tolist()


def test_make_generator() -> None:
    assert make_generator(None, "cpu") is None
    a, b = make_generator(-3, "cpu"), make_generator(-3, "cpu")
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    c = make_generator(2**70 + 5, "cpu")
    assert c is not None


# ----------------------------------------------------------------------------- truncation on a real vocabulary


def _rows(shape: str, n: int, vocab: int, gen: torch.Generator) -> torch.Tensor:  # [n, vocab] float32 logits
    x = torch.randn(n, vocab, generator=gen) * {"peaky": 8.0, "flat": 0.3}.get(shape, 3.0)
    if shape == "bf16_ties":  # coarse logits: many exact ties, at the k-th place too
        x = x.bfloat16().float().round()
    elif shape == "masked":  # a grammar's mask: most of the vocabulary -inf
        x[torch.rand(n, vocab, generator=gen) < 0.999] = -torch.inf
    elif shape == "few_finite":  # fewer finite logits than top-k or the first candidates
        x[:, 5:] = -torch.inf
    return x


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("shape", ["peaky", "normal", "flat", "bf16_ties", "masked", "few_finite"])
def test_truncation_is_the_definition_on_a_real_vocabulary(shape: str, native: bool, monkeypatch) -> None:
    """top-k and top-p pick their tokens from the leading candidates only (no sort of the vocabulary); the
    probabilities are exactly (torch.equal) those of the definition's full sort, whatever the row needs: a
    nucleus of a few tokens or thousands (the candidates grow), ties at the k-th logit, a masked vocabulary,
    fewer finite logits than asked for; with the native candidate search and with torch's."""
    from workers import native_attention

    if not native:
        monkeypatch.setattr(native_attention, "load_layer_ops", lambda: None)
    elif native_attention.load_layer_ops() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    gen = torch.Generator().manual_seed(sum(map(ord, shape)))
    vocab = 49152
    settings = [(0, 0.9), (0, 0.5), (0, 0.999), (50, 1.0), (1, 1.0), (40, 0.8), (3000, 0.95), (0, 1e-6)]
    x = _rows(shape, len(settings), vocab, gen)
    temperature = torch.full((len(settings),), 0.7)
    top_k = torch.tensor([k for k, _ in settings])
    top_p = torch.tensor([p for _, p in settings])
    got = process_logits(x, temperature, top_k, top_p)
    scaled = x / 0.7
    for i, (k, p) in enumerate(settings):
        want = truncated_by_sort(scaled[i], k if k > 0 else vocab, float(top_p[i]))
        assert torch.equal(got[i], want), (shape, k, p)
        alone = process_logits(x[i : i + 1], temperature[i : i + 1], top_k[i : i + 1], top_p[i : i + 1])
        assert torch.equal(alone[0], got[i])  # a row is computed alone: its batch does not matter


def test_process_params_is_process_logits_of_the_params_tensors() -> None:
    """The decode step's path (one tensor built, the rest as Python numbers) gives exactly what process_logits
    gives on sampling_tensors' three tensors: top-p rounded to float32 as the tensor holds it, greedy rows at
    temperature 1."""
    logits = torch.randn(5, 49152) * 3
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=40),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
        SamplingParams(temperature=1.0),
    ]
    want = process_logits(logits, *sampling_tensors(params, "cpu"))
    assert torch.equal(process_params(logits, params), want)
    with pytest.raises(ValueError):
        process_params(logits, params[:2])
