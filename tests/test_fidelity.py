"""Output is a pure function of the request: the same tokens alone or in any batch, plain or speculative.

Greedy and seeded sampled requests (temperature, top-p), in fp32 and bf16: each prompt decoded alone
and plainly is the reference; every proposer (n-gram, suffix, the target as its own draft, a bad
random draft), with K switched between 0 and 1..8 every step, in a batch with neighbours of other
sampling params, must write exactly those tokens. Plus the sampler's pieces: position-keyed noise
and coupled verification, which must sample exactly the target's distribution (chi-square).
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.test_spec_engine import KINDS, MAX_LEN, Switcher, copy_prompts, make_proposer
from workers import native_attention, sampler
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.rejection_sampler import verify_coupled
from workers.sampler import (
    _exponentials_of,
    keyed_exponentials,
    keyed_sample,
    keyed_uniforms,
    position_key,
    process_logits,
)
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = {"max_tokens": 24, "ignore_eos": True}
# a hot temperature: the tiny random model's logits are peaky, and sampling must matter for the test to bite
SAMPLED = {"max_tokens": 24, "ignore_eos": True, "temperature": 1.6, "top_p": 0.95, "seed": 1234}


@pytest.fixture(scope="module")
def draft_loaded(tiny_draft_dir):
    from workers.model_loader import load_model

    return load_model(tiny_draft_dir)


def alone(loaded, dtype: str, prompts: list[list[int]], params: dict) -> list[list[int]]:
    """Each prompt decoded alone (its own engine step after step), plainly: the reference."""
    eng = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=1, max_model_len=MAX_LEN, proposers=[]), loaded)
    return [eng.generate([p], params)[0] for p in prompts]


def neighbours(n: int, seed: int) -> tuple[list[list[int]], list[dict]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(2, 30))] for _ in range(n)]
    params = [
        {
            "max_tokens": rng.randint(4, 30),
            "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.7, 1.3]),
            "seed": rng.randrange(1 << 30),
        }
        for _ in range(n)
    ]
    return prompts, params


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "seeded"])
def test_every_path_writes_the_alone_plain_tokens(tiny_loaded, draft_loaded, dtype, params):
    prompts = copy_prompts(5, seed=31)
    ref = alone(tiny_loaded, dtype, prompts, params)
    if params is SAMPLED:  # the seed must matter, or this proves nothing about sampled requests
        other = alone(tiny_loaded, dtype, prompts, {**params, "seed": 99})
        assert sum(a != b for a, b in zip(ref, other)) >= 3
    extra, extra_params = neighbours(10, seed=5)
    for kind in KINDS:
        name, prop = make_proposer(kind, tiny_loaded, draft_loaded, num_slots=16)
        sw = Switcher()
        eng = LLMEngine(
            EngineConfig(
                dtype=dtype,
                max_num_seqs=16,
                max_model_len=MAX_LEN,
                num_speculative_tokens=8,
                proposers=[{"name": name}],
            ),
            tiny_loaded,
            proposers={name: prop},
            decide=sw,
        )
        for j, (p, sp) in enumerate(zip(extra, extra_params)):  # neighbours first: ours join a busy batch
            eng.add_request(f"n{j}", p, sp, speculation="on", proposer=name)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params, speculation="on", proposer=name)
        tokens: dict[str, list[int]] = {}
        while eng.has_work():
            for o in eng.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
        got = [tokens[f"r{i}"] for i in range(len(prompts))]
        assert got == ref, f"{kind}: speculative/batched output differs from the request decoded alone"
        if params is GREEDY or kind.startswith("draft"):  # hot samples rarely repeat: lookups find nothing
            assert eng.stats[name].num_draft_tokens > 0, f"{kind}: nothing was drafted"
        if kind == "draft_self" and dtype == "float32":  # same model, same keyed noise: drafts agree
            assert eng.stats[name].acceptance_rate > 0.9


def test_unseeded_requests_draw_their_own_seed(tiny_loaded):
    """No seed: a seed is drawn at admission, so two identical requests write different samples."""
    params = {**SAMPLED, "seed": None}
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN), tiny_loaded)
    prompts = copy_prompts(3, seed=8)
    a, b = eng.generate(prompts, params), eng.generate(prompts, params)
    assert a != b


def test_rejection_verification_still_selectable(tiny_loaded):
    """``verification: rejection``: greedy stays plain's, a seeded request reproduces at a fixed K."""
    prompts = copy_prompts(4, seed=12)
    ref = alone(tiny_loaded, "float32", prompts, GREEDY)
    cfg = dict(
        dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN, num_speculative_tokens=4, verification="rejection"
    )
    from workers.proposers.ngram import NgramProposer

    eng = LLMEngine(EngineConfig(**cfg), tiny_loaded, proposers={"ngram": NgramProposer()})
    assert eng.generate(prompts, GREEDY, speculation="on", proposer="ngram") == ref
    s1 = eng.generate(prompts, SAMPLED, speculation="on", proposer="ngram")
    s2 = eng.generate(prompts, SAMPLED, speculation="on", proposer="ngram")
    assert s1 == s2


# ----------------------------------------------------------------------------- the sampler's pieces


def test_keyed_noise_is_a_function_of_seed_and_position():
    keys = [position_key(7, t) for t in range(4)]
    a = keyed_exponentials(keys, 1000, "cpu")
    b = keyed_exponentials(list(reversed(keys)), 1000, "cpu").flip(0)
    assert torch.equal(a, b)  # no stream: order and batch do not matter
    assert not torch.equal(a[0], a[1])  # positions get different numbers
    assert position_key(7, 0) != position_key(8, 0)
    e = keyed_exponentials([position_key(s, 0) for s in range(50)], 1000, "cpu")
    assert bool((e > 0).all()) and abs(float(e.mean()) - 1.0) < 0.02 and abs(float(e.var()) - 1.0) < 0.05


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("shape", ["peaky", "flat", "top_k", "bf16_ties", "uniform", "one_hot", "zero_row", "near_tie"])
def test_keyed_sample_is_exactly_the_race_on_the_exact_noise(shape, native, monkeypatch):
    """keyed_sample's cheap race picks exactly ``argmax(p / keyed_exponentials)``, first index on ties, on a
    real vocabulary: sharp and flat rows, top-k zeros, bf16-coarse and uniform probabilities (many exact ties,
    since 49152 draws from 2^24 values collide), a one-hot row, an all-zero row, and rows whose two best exact
    scores are a few ulps apart or tied (where an approximate race alone errs); the native race and torch's."""
    if not native:
        monkeypatch.setattr(native_attention, "load_layer_ops", lambda: None)
    elif native_attention.load_layer_ops() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    n, vocab = 64, 49152
    scale = {"peaky": 12.0, "flat": 0.05}.get(shape, 2.0)
    p = torch.softmax(torch.randn(n, vocab, generator=gen) * scale, dim=-1)  # [n, vocab]
    if shape == "top_k":
        p = torch.where(p >= p.topk(40, dim=-1).values[:, -1:], p, torch.zeros_like(p))
    elif shape == "bf16_ties":
        p = p.bfloat16().float()
    elif shape == "uniform":
        p = torch.full((n, vocab), 1.0 / vocab)
    elif shape == "one_hot":
        p = torch.zeros(n, vocab).scatter_(1, torch.randint(0, vocab, (n, 1), generator=gen), 1.0)
    elif shape == "zero_row":
        p[::3] = 0.0
    keys = [position_key(17, t) for t in range(n)]
    if shape == "near_tie":  # entry b's exact score is entry a's times (1 + j ulp), j = -3..3
        e = keyed_exponentials(keys, vocab, "cpu")
        p = torch.full((n, vocab), 1e-9)
        for i in range(n):
            a, b = torch.randperm(vocab, generator=gen)[:2].tolist()
            p[i, a] = 1.0
            p[i, b] = float(e[i, b] / e[i, a]) * (1.0 + (i % 7 - 3) * 2.0**-23)
    definition = (p / keyed_exponentials(keys, vocab, "cpu")).argmax(dim=-1)
    assert torch.equal(keyed_sample(p, keys), definition)


@pytest.mark.parametrize(
    "shape", ["normal", "peaky", "flat", "bf16_ties", "masked", "one_finite", "near_tie", "nan", "subset", "mixed"]
)
def test_the_race_from_logits_is_the_definition(shape):
    """``sample_rows`` races a temperature-only row on its logits (no softmax formed) and must give exactly
    ``keyed_sample(process_params(...))``: on a real vocabulary, at temperatures whose division rounds (and one
    clamped), coarse bf16 logits, a grammar-masked row, a single finite logit, a NaN row, rows picked out of a
    batch, top-k / top-p rows beside them, and rows whose two leaders' scores are a few ulps apart, where only
    the fallback to the definition can say (the race must hand those over, not guess)."""
    from workers.sampler import plain_temperature, process_params, sample_rows

    gen = torch.Generator().manual_seed(sum(map(ord, shape)))
    n, vocab = 12, 49152
    x = torch.randn(n, vocab, generator=gen) * {"peaky": 9.0, "flat": 0.2}.get(shape, 3.0)
    temps = [1.0, 0.7, 1.3, 0.37, 2.0, 0.1, 1e-7, 5.0, 0.9, 1.1, 0.61, 1.7]
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate(temps)]
    keys = [position_key(31, t) for t in range(n)]
    if shape == "bf16_ties":
        x = x.bfloat16().float()
    elif shape == "masked":
        x[torch.rand(n, vocab, generator=gen) < 0.99] = -torch.inf
    elif shape == "one_finite":
        x[:] = -torch.inf
        x[torch.arange(n), torch.randint(0, vocab, (n,), generator=gen)] = 2.0
    elif shape == "nan":
        x[3, 77] = float("nan")
    elif shape == "mixed":  # truncated rows beside plain ones take the definition's own path
        params[2] = SamplingParams(temperature=0.8, top_p=0.9, seed=2)
        params[5] = SamplingParams(temperature=0.8, top_k=40, seed=5)
    elif shape == "near_tie":  # two leaders whose scores exp(x) / E differ by j ulps of x near 0.5, j = -3..3
        n = 42
        x = torch.randn(n, vocab, generator=gen) - 30.0
        params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
        keys = [position_key(31, t) for t in range(n)]
        e = keyed_exponentials(keys, vocab, "cpu")
        for i in range(n):
            a, b = torch.randperm(vocab, generator=gen)[:2].tolist()
            x[i, a] = 0.5
            x[i, b] = float(0.5 + torch.log(e[i, b].double() / e[i, a].double())) + (i % 7 - 3) * 2.0**-24
    rows = list(range(n)) if shape != "subset" else [9, 2, 2, 7]
    row_params = [params[r] for r in rows]
    row_keys = [keys[r] for r in rows]
    want = keyed_sample(process_params(x[rows], row_params), row_keys).tolist()
    assert sample_rows(x, rows, row_params, row_keys) == want
    for r, p, k, w in zip(rows, row_params, row_keys, want):  # alone: the same token as in its batch
        assert sample_rows(x, [r], [p], [k]) == [w]
    ops = native_attention.load_layer_ops()
    if ops is not None and shape in ("normal", "near_tie"):
        plain = [j for j, p in enumerate(row_params) if plain_temperature(p, vocab)]
        raw = ops.scaled_race(x, [rows[j] for j in plain], [max(row_params[j].temperature, 1e-6) for j in plain],
                              [row_keys[j] for j in plain], 1e-4, 1e-5, 64)  # fmt: skip
        decided = sum(t >= 0 for t in raw)
        # ordinary rows are decided natively; rows whose leaders tie within ~1e-6 are left to the definition
        assert decided == len(plain) if shape == "normal" else decided < len(plain)


@pytest.mark.parametrize("shape", ["peaky", "normal", "flat", "bf16_ties", "masked", "few_finite", "nucleus_edge"])
def test_the_truncated_race_from_logits_is_the_definition(shape):
    """Top-k and top-p rows race on their logits too (``truncated_race``: the candidates and top-k exact, the
    nucleus's masses in fp64) and must give exactly the definition's tokens: peaky, flat and coarse rows, a
    masked vocabulary, fewer finite logits than k, and rows whose first token's mass is top-p itself to a
    float's rounding, where only handing the row over is right (with the mass guard at 0 this test fails)."""
    from workers.sampler import process_params, sample_rows

    gen = torch.Generator().manual_seed(sum(map(ord, shape)) + 1)
    vocab = 49152
    settings = [(0, 0.9), (0, 0.5), (0, 0.999), (50, 1.0), (1, 1.0), (40, 0.8), (3000, 0.95), (0, 1e-6), (7, 0.6)]
    temps = [0.7, 1.0, 1.3, 0.8, 1.0, 0.9, 1.1, 0.5, 2.0]
    n = len(settings)
    x = torch.randn(n, vocab, generator=gen) * {"peaky": 8.0, "flat": 0.3}.get(shape, 3.0)
    if shape == "bf16_ties":
        x = x.bfloat16().float().round()
    elif shape == "masked":
        x[torch.rand(n, vocab, generator=gen) < 0.999] = -torch.inf
    elif shape == "few_finite":
        x[:, 5:] = -torch.inf
    elif shape == "nucleus_edge":  # tokens 0 and 1 lead, each of mass top-p = 1/4 but for its logit's rounding
        n = 24
        x = torch.randn(n, vocab, generator=gen)
        settings, temps = [(0, 0.25)] * n, [1.0] * n
        rest = x[:, 2:].double().exp().sum(dim=-1)  # [n]
        x[:, 0] = x[:, 1] = torch.log(rest / 2).float()  # 2 e^L + rest = 4 e^L: keep 1 token, or race 2
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p, seed=i) for i, ((k, p), t) in enumerate(zip(settings, temps))
    ]
    keys = [position_key(77, t) for t in range(n)]
    rows = list(range(n))
    want = keyed_sample(process_params(x, params), keys).tolist()
    assert sample_rows(x, rows, params, keys) == want
    for r in rows:
        assert sample_rows(x, [r], [params[r]], [keys[r]]) == [want[r]]


def test_the_race_calls_refuse_what_they_cannot_read():
    ops = native_attention.load_layer_ops()
    if ops is None:
        pytest.skip("no C compiler: the native kernels are not built")
    x = torch.randn(2, 100)
    with pytest.raises(ValueError, match="each row one of x"):
        ops.scaled_race(x, [2], [1.0], [7], 1e-4, 1e-5, 64)  # no row 2
    with pytest.raises(ValueError, match="one value of each parameter per row"):
        ops.truncated_race(x, [0, 1], [1.0, 1.0], [5], [0.9, 0.9], [7, 8], 1e-5, 1e-4)  # one top-k for two rows
    with pytest.raises(ValueError, match="float32"):
        ops.scaled_race(x.bfloat16(), [0], [1.0], [7], 1e-4, 1e-5, 64)
    assert ops.scaled_race(x, [1, 0], [1.0, 0.5], [7, 8], 1e-4, 1e-5, 64) == [
        ops.scaled_race(x, [1], [1.0], [7], 1e-4, 1e-5, 64)[0],
        ops.scaled_race(x, [0], [0.5], [8], 1e-4, 1e-5, 64)[0],
    ]  # each listed row raced alone


def test_torch_softmax_stays_far_inside_the_races_guard():
    """The race from logits trusts torch's softmax to order a row's entries as exp(y - max) does, within a few
    ulps of each other (its guard is 1e-5 relative; the sum's rounding scales the whole row alike and cannot
    reorder it), and a top-p row's nucleus to sum to within 1e-4 of fp64's masses: a torch whose softmax strays
    further must fail here, not change a sampled token."""
    from workers.sampler import _MASS_GUARD, _SCALED_GUARD

    for scale in (0.3, 1.0, 4.0, 9.0):
        x = torch.randn(16, 49152, generator=torch.Generator().manual_seed(5)) * scale / 0.7
        p = torch.softmax(x, dim=-1).double()  # [16, V]
        d = (x - x.max(dim=-1, keepdim=True).values).double()  # y - max rounded in float, as torch rounds it
        ratio = p / d.exp()  # [16, V] 1 / sum, times each entry's own error
        big = d > -60  # normal floats: the race's candidates are never smaller
        hi = torch.where(big, ratio, 0.0).max(dim=-1).values
        lo = torch.where(big, ratio, torch.inf).min(dim=-1).values
        spread = (hi / lo - 1).max().item()
        assert spread < _SCALED_GUARD / 10, (scale, spread)
        # a top-p row's nucleus sums masses: torch's, its sum's rounding included, against fp64's
        mass_error = (p - d.exp() / d.exp().sum(dim=-1, keepdim=True)).abs().cumsum(dim=-1).max().item()
        assert mass_error < _MASS_GUARD / 10, (scale, mass_error)


def test_native_uniforms_are_the_keyed_generators_draws():
    """The native race draws its noise from a Mersenne twister of its own; it must be torch's CPU generator's,
    number for number, for any key (the high 32 bits too) and any vocabulary (across the twister's 624-draw
    blocks)."""
    ops = native_attention.load_layer_ops()
    if ops is None:
        pytest.skip("no C compiler: the native kernels are not built")
    keys = [0, 1, 2**32 - 1, 2**32, 2**64 - 1] + [position_key(s, t) for s in range(3) for t in range(5)]
    for vocab in (1, 623, 624, 625, 1249, 49152):
        assert torch.equal(ops.keyed_uniforms(keys, vocab), keyed_uniforms(keys, vocab)), vocab


def test_native_race_noise_is_the_definitions_for_every_uniform():
    """Every one of the 2^24 values uniform_ can draw: the native race's approximate noise is within a relative
    1e-6 of the definition's, far inside _RACE_MARGIN (which is what makes the candidates hold the winner), and
    its exact noise is the definition's."""
    ops = native_attention.load_layer_ops()
    if ops is None:
        pytest.skip("no C compiler: the native kernels are not built")
    u = torch.arange(2**24, dtype=torch.float32) * 2.0**-24  # [2^24]
    exact = _exponentials_of(u)
    rel = (ops.race_noise(u).double() / exact.double() - 1.0).abs()
    assert float(rel.max()) < 1e-6 < sampler._RACE_MARGIN / 50
    # and the exact noise the native race decides with is the definition's, number for number, with none so near
    # a rounding flip that it would leave the number to torch: a proof by exhaustion over the domain
    assert torch.equal(ops.race_exact_noise(u), exact)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("coupled_draft", [True, False], ids=["draft-with-same-noise", "draft-independent"])
def test_coupled_verification_samples_the_target_distribution(coupled_draft):
    """Over many seeds, the first committed token follows the target's processed p exactly (chi-square
    against p at 99.9%), whatever the draft; a draft that uses the same keyed noise is accepted far more
    often than an independent one (Gumbel-max coupling)."""
    gen = torch.Generator().manual_seed(0)
    V, N = 12, 6000
    target_logits = torch.randn(3, V, generator=gen) * 1.5  # rows: after draft 0, after draft 1, bonus
    draft_logits = target_logits + torch.randn(3, V, generator=gen) * 0.8  # a decent but imperfect draft
    sp = SamplingParams(temperature=1.0, max_tokens=4)
    ones = torch.ones(3)
    p = process_logits(target_logits, ones, torch.zeros(3, dtype=torch.long), ones)  # [3, V]
    q = process_logits(draft_logits, ones, torch.zeros(3, dtype=torch.long), ones)
    counts = torch.zeros(V)
    accepted_first = 0
    for seed in range(N):
        keys = [position_key(seed, t) for t in range(3)]
        dkeys = keys if coupled_draft else [position_key(seed + 10**9, t) for t in range(3)]
        drafts = keyed_sample(q[:2], dkeys[:2]).tolist()
        out = verify_coupled(target_logits, [drafts], [sp], [keys])
        counts[out.output_token_ids[0][0]] += 1
        accepted_first += out.num_accepted[0] >= 1
    # 11 degrees of freedom: the 99.9% quantile is 31.3
    assert _chi_square(counts, p[0]) < 31.3
    overlap = float(torch.minimum(p[0], q[0]).sum())  # the best any coupling can do: 1 - TV
    rate = accepted_first / N
    if coupled_draft:
        assert rate > 0.8 * overlap
    else:
        assert abs(rate - float((p[0] * q[0]).sum())) < 0.03  # independent draws agree with prob sum p q


def test_coupled_verification_takes_the_forwards_argmax_as_its_own():
    """The argmax a forward found beside its logits gives the tokens verify finds itself, for greedy and sampled
    requests with and without drafts, and for a step of greedy rows without drafts (which reads it alone); the
    caller's list is left as it was, and an argmax of another row count is refused."""
    gen = torch.Generator().manual_seed(1)
    V = 50
    drafts = [[], [3, 7], [], [1]]
    params = [SamplingParams(temperature=t, max_tokens=4) for t in (0.0, 0.0, 0.9, 0.9)]
    keys = [
        [] if sp.greedy else [position_key(5 + i, j) for j in range(len(d) + 1)]
        for i, (sp, d) in enumerate(zip(params, drafts))
    ]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), V, generator=gen)  # [7, V]
    logits[1, 3] = logits[2, 7] = 50.0  # the greedy request's drafts are its argmax tokens: accepted
    argmax = logits.argmax(dim=-1).tolist()
    given = list(argmax)
    want = verify_coupled(logits, drafts, params, keys)
    got = verify_coupled(logits, drafts, params, keys, given)
    assert got == want and want.num_accepted[1] == 2 and given == argmax
    other = list(argmax)
    other[0] = (argmax[0] + 1) % V  # read, not found again: a greedy row's token is the argmax given
    assert verify_coupled(logits, drafts, params, keys, other).output_token_ids[0] == [other[0]]
    plain, greedy = logits[[0, 1]], [SamplingParams(temperature=0.0, max_tokens=4)] * 2  # two greedy rows, no drafts
    assert verify_coupled(plain, [[], []], greedy, [[], []]).output_token_ids == [[argmax[0]], [argmax[1]]]
    assert verify_coupled(plain, [[], []], greedy, [[], []], other[:2]).output_token_ids == [[other[0]], [argmax[1]]]
    with pytest.raises(ValueError, match="target_argmax"):
        verify_coupled(logits, drafts, params, keys, argmax[:-1])
    with pytest.raises(ValueError, match="target_argmax"):
        verify_coupled(plain, [[], []], greedy, [[], []], other[:1])


# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smollm2_every_proposer_writes_the_alone_plain_tokens(smollm2_loaded, dtype):
    """SmolLM2 with the shipped draft model and EAGLE head, the n-gram and suffix proposers: greedy and
    seeded (T=0.8, top-p 0.95) chat requests, K switched every step, 8 neighbours sharing the batch and
    the chat template's cached prefix: every token equals the request decoded alone and plainly."""
    from cluster.config import DraftConfig
    from training.common import DRAFT_DIR, EAGLE_DIR
    from workers.model_loader import load_model
    from workers.proposers.draft_model import DraftModelProposer
    from workers.proposers.eagle import EagleProposer
    from workers.proposers.ngram import NgramProposer
    from workers.proposers.suffix import SuffixProposer

    if not (DRAFT_DIR / "config.json").exists() or not (EAGLE_DIR / "model.safetensors").exists():
        pytest.skip("trained drafts not present")
    target = smollm2_loaded.model
    draft = load_model("models/smollm2-draft")
    n = 12
    proposers = {
        "ngram": NgramProposer(),
        "suffix": SuffixProposer(),
        "draft_model": DraftModelProposer(  # as the draft worker runs it (its shipped kernels)
            draft.model,
            num_slots=n,
            max_model_len=512,
            target_vocab_size=target.config.vocab_size,
            vocab_ids=draft.draft_vocab,
            native_kernels=DraftConfig().native_kernels,
            cpu_gemm=DraftConfig().cpu_gemm,
        ),
        "eagle": EagleProposer("models/smollm2-eagle", target, num_slots=n, max_model_len=512),
    }
    sw = Switcher()
    eng = LLMEngine(
        EngineConfig(
            dtype=dtype,
            max_num_seqs=n,
            max_model_len=512,
            num_speculative_tokens=8,
            proposers=[{"name": k} for k in proposers],
        ),
        smollm2_loaded,
        proposers=proposers,
        decide=sw,
    )
    chat = lambda m: eng.tokenize_chat([{"role": "user", "content": m}])  # noqa: E731
    ours = [chat("Repeat exactly: the quick brown fox jumps over the lazy dog, twice."), chat("Name three rivers.")]
    others = [
        chat(m)
        for m in (
            "What is 7 times 8?",
            "Write a haiku about snow.",
            "Say hello in French.",
            "List the planets.",
            "What is a prime number?",
            "Spell 'banana' backwards.",
            "Give me a color.",
            "Count to five.",
        )
    ]
    cases = [{"max_tokens": 32}, {"max_tokens": 32, "temperature": 0.8, "top_p": 0.95, "seed": 7}]
    refs = [alone(smollm2_loaded, dtype, ours, sp) for sp in cases]
    assert refs[0] != refs[1]
    for name in proposers:
        for j, p in enumerate(others):
            eng.add_request(
                f"{name}-n{j}",
                p,
                {"max_tokens": 24, "temperature": 0.7 * (j % 2), "seed": j},
                speculation="on",
                proposer=name,
            )
        for c, sp in enumerate(cases):
            for i, p in enumerate(ours):
                eng.add_request(f"{name}-{c}-{i}", p, sp, speculation="on", proposer=name)
        tokens: dict[str, list[int]] = {}
        while eng.has_work():
            for o in eng.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
        for c in range(len(cases)):
            assert [tokens[f"{name}-{c}-{i}"] for i in range(len(ours))] == refs[c], (name, cases[c])
        assert eng.stats[name].num_draft_tokens > 0, name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logprobs_identical_with_speculation_on_and_off(tiny_loaded, draft_loaded, dtype):
    """Logprobs come from the rows that decided each token (verify rows under speculation): with
    invariant kernels they equal plain decoding's bit for bit, top alternatives included."""
    prompts = copy_prompts(4, seed=41)

    def collect(kind: str | None, params: dict) -> dict[str, list]:
        if kind is None:
            eng = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=1, max_model_len=MAX_LEN, proposers=[]), tiny_loaded)
            name = None
        else:
            name, prop = make_proposer(kind, tiny_loaded, draft_loaded, num_slots=8)
            eng = LLMEngine(
                EngineConfig(
                    dtype=dtype,
                    max_num_seqs=8,
                    max_model_len=MAX_LEN,
                    num_speculative_tokens=4,
                    proposers=[{"name": name}],
                ),
                tiny_loaded,
                proposers={name: prop},
                decide=Switcher(),
            )
        got: dict[str, list] = {}
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", p, params, speculation="on" if name else "off", proposer=name)
            if kind is None:  # alone: one request at a time
                while eng.has_work():
                    for o in eng.step():
                        got.setdefault(o.request_id, []).extend(o.logprobs or [])
        while eng.has_work():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.logprobs or [])
        if name and (kind.startswith("draft") or "temperature" not in params):  # hot samples: lookups find nothing
            assert eng.stats[name].num_draft_tokens > 0
        return got

    for params in ({**GREEDY, "logprobs": 5}, {**SAMPLED, "logprobs": 3}):
        ref = collect(None, params)
        assert all(len(v) == params["max_tokens"] for v in ref.values())
        for entry in ref["r0"]:
            assert len(entry.top) == params["logprobs"] and entry.logprob <= 0
            if "temperature" not in params:  # greedy: the chosen token is the most likely one
                assert entry.top[0] == (entry.token_id, entry.logprob)
        for kind in ("ngram", "draft_self"):
            assert collect(kind, params) == ref, kind


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logprobs_independent_of_chunking_and_batch(tiny_loaded, dtype):
    """Scoring a prompt (prompt_logprobs, max_tokens 0: what eval harnesses send) gives the same numbers
    prefilled in one step or in chunks beside other requests, and equal to the logits of one
    forward over the whole prompt."""
    from workers.runner import ModelRunner, StepBatch

    prompt = copy_prompts(1, seed=61)[0] + copy_prompts(1, seed=62)[0]
    one = LLMEngine(
        EngineConfig(dtype=dtype, max_num_seqs=1, max_model_len=MAX_LEN, max_num_batched_tokens=256, proposers=[]),
        tiny_loaded,
    )
    [o] = [x for x in _run_all(one, [("s", prompt, {"max_tokens": 0, "prompt_logprobs": 3})])]
    assert o.finish_reason == "length" and o.token_ids == [] and o.prompt_logprobs[0] is None
    assert len(o.prompt_logprobs) == len(prompt) and [e.token_id for e in o.prompt_logprobs[1:]] == prompt[1:]
    chunked = LLMEngine(
        EngineConfig(dtype=dtype, max_num_seqs=8, max_model_len=MAX_LEN, max_num_batched_tokens=16, proposers=[]),
        tiny_loaded,
    )
    others = [(f"n{i}", p, {"max_tokens": 12, "ignore_eos": True}) for i, p in enumerate(copy_prompts(4, seed=63))]
    outs = _run_all(chunked, others + [("s", prompt, {"max_tokens": 2, "prompt_logprobs": 3})])
    got = next(x for x in outs if x.request_id == "s" and x.prompt_logprobs is not None)
    assert got.prompt_logprobs == o.prompt_logprobs
    # the engine's own GEMM backend (cpu_gemm: auto picks it by CPU): each backend rounds its own way
    r = ModelRunner(
        tiny_loaded.model, 1, MAX_LEN, getattr(torch, dtype), batch_invariant=True, cpu_gemm=one.runner.cpu_gemm
    )
    lp = r.forward(StepBatch([0], [0], [prompt], [list(range(len(prompt)))])).logits.log_softmax(-1)
    assert [e.logprob for e in o.prompt_logprobs[1:]] == [float(lp[j, prompt[j + 1]]) for j in range(len(prompt) - 1)]


def _run_all(eng: LLMEngine, reqs: list) -> list:
    for rid, p, sp in reqs:
        eng.add_request(rid, p, sp)
    outs = []
    while eng.has_work():
        outs.extend(eng.step())
    return [o for o in outs if o.finished or o.prompt_logprobs is not None]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.0},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 0.7, "seed": 3, "stop": []},
    ],
    ids=["greedy", "seeded", "unseeded", "stop"],
)
def test_a_resumed_stream_continues_bit_identically(tiny_loaded, dtype, params):
    """A stream cut after any chunk and resubmitted with the prompt, the tokens already sent and the
    request's seed (what the ingress does when a replica dies) writes exactly the rest of the
    uninterrupted stream: the same tokens, text and logprobs (bit for bit: the target's logits at each
    position are the same), on another engine, beside other requests, with speculation."""
    prompt = copy_prompts(1, seed=71)[0]
    sp = {"max_tokens": 40, "ignore_eos": True, "logprobs": 3, **params}

    def logprobs(outs) -> torch.Tensor:  # [tokens, 1 + top] the chosen token's logprob and the top ones
        return torch.tensor(
            [[e.logprob, *(v for _, v in e.top)] for o in outs for e in o.logprobs], dtype=torch.float64
        )

    first = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=2, max_model_len=MAX_LEN, proposers=[]), tiny_loaded)
    if "stop" in params:  # a stop string from the stream's own text, first met past its first third
        first.add_request("probe", prompt, sp)
        text = ""
        while first.has_work():
            text += "".join(o.text for o in first.step())
        stop = next(
            text[i : i + 3]
            for i in range(len(text) * 2 // 3, len(text) - 3)
            if text.find(text[i : i + 3]) > len(text) // 3
        )
        sp = {**sp, "stop": [stop]}
    first.add_request("r", prompt, sp)
    chunks = []
    while first.has_work():
        chunks += [o for o in first.step() if o.request_id == "r"]
    assert len(chunks) > 5 and chunks[-1].finished
    assert chunks[-1].finish_reason == ("stop" if "stop" in params else "length")
    seed = chunks[0].seed
    other = LLMEngine(
        EngineConfig(
            dtype=dtype, max_num_seqs=4, max_model_len=MAX_LEN, num_speculative_tokens=4, proposers=[{"name": "ngram"}]
        ),
        tiny_loaded,
    )
    for cut in (1, 3, len(chunks) // 2, len(chunks) - 1):
        sent = [t for o in chunks[:cut] for t in o.token_ids]
        for i, p in enumerate(copy_prompts(2, seed=72 + cut)):  # neighbours
            other.add_request(f"n{cut}-{i}", p, {"max_tokens": 12, "ignore_eos": True})
        other.add_request(f"r{cut}", prompt, {**sp, "seed": seed}, speculation="on", resume_output_ids=sent)
        rest = []
        while other.has_work():
            rest += [o for o in other.step() if o.request_id == f"r{cut}"]
        assert [t for o in rest for t in o.token_ids] == [t for o in chunks[cut:] for t in o.token_ids]
        assert "".join(o.text for o in rest) == "".join(o.text for o in chunks[cut:])
        assert torch.equal(logprobs(rest), logprobs(chunks[cut:]))
        assert rest[-1].num_output_tokens == chunks[-1].num_output_tokens
        assert rest[-1].finish_reason == chunks[-1].finish_reason


def test_resumed_output_is_validated(tiny_loaded):
    from workers.errors import InvalidRequestError

    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=1, max_model_len=MAX_LEN, proposers=[]), tiny_loaded)
    with pytest.raises(InvalidRequestError, match="outside"):
        eng.add_request("a", [1, 2, 3], {"max_tokens": 8}, resume_output_ids=[-1])
    with pytest.raises(InvalidRequestError, match="nothing of max_tokens"):
        eng.add_request("b", [1, 2, 3], {"max_tokens": 2}, resume_output_ids=[5, 6])
