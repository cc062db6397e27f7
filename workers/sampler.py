"""Turn logits into probabilities and probabilities into tokens.

One transform, ``process_logits`` (temperature, then top-k, then top-p), is applied
to the target's logits *and* to the draft's logits. Rejection sampling (Leviathan et
al. 2023, arXiv 2211.17192; Chen et al. 2023, arXiv 2302.01318) reproduces the
distribution it is given as ``p``; if the draft's ``q`` were processed differently
the output would still follow ``p``, but acceptance would drop. Sampling the wrong
``p`` (e.g. the raw softmax) would silently change what the model writes.

Every random draw is made with the request's own ``torch.Generator`` when it has a
seed, so a seeded request writes the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from array import array

import torch

from workers import native_attention
from workers.sampling_params import SamplingParams

# Temperatures below this are clamped so that logits / temperature stays finite
# (inf - inf inside softmax would give NaN). At 1e-6 the result is already argmax.
_MIN_TEMPERATURE = 1e-6


# A truncated row's first candidates (then four times as many while top-p needs more): a nucleus is usually a few
# dozen tokens, and finding the leading c of a vocabulary costs far less than ordering all of it.
_FIRST_CANDIDATES = 64


def process_logits(
    logits: torch.Tensor,  # [num_rows, vocab] float32 raw logits
    temperature: torch.Tensor,  # [num_rows] float, every entry > 0
    top_k: torch.Tensor,  # [num_rows] long, 0 = off
    top_p: torch.Tensor,  # [num_rows] float in (0, 1], 1.0 = off
) -> torch.Tensor:  # [num_rows, vocab] float32 probabilities, rows sum to 1
    """Temperature, then top-k, then top-p (nucleus), then renormalize.

    The candidates are the tokens with a finite logit, in order of logit, ties by the lower token id, so
    the same logits always give the same set, on the target and on the draft. Top-k keeps the first ``k``.
    Top-p keeps the candidates (the first always) before which the mass of the ones before them, summed in
    float64 in order, is still below ``top_p``: the smallest prefix reaching it. The mass of a token is its
    probability under the top-k set's softmax, or the whole vocabulary's when top-k is off. The kept tokens
    get the softmax of their logits, in candidate order; every other token 0. Each row is computed alone,
    from its own logits and parameters.
    """
    return _process(logits, temperature, top_k.tolist(), top_p.tolist())


def process_params(
    logits: torch.Tensor,  # [num_rows, vocab] float32 raw logits, row i belongs to params[i]
    params: list[SamplingParams],
) -> torch.Tensor:  # [num_rows, vocab] float32
    """``process_logits`` with the parameters read from ``params`` (greedy rows at temperature 1, as
    :func:`sampling_tensors` sets them): one tensor built where that builds three, since at a decode step's few
    rows the torch ops, not the arithmetic, are the cost. top-p is rounded to float32 as the tensor would hold it."""
    if logits.shape[0] != len(params):
        raise ValueError(f"{logits.shape[0]} logit rows but {len(params)} sampling params")
    temperature = torch.tensor(
        [1.0 if sp.greedy else sp.temperature for sp in params], dtype=torch.float32, device=logits.device
    )
    return _process(logits, temperature, [sp.top_k for sp in params], array("f", [sp.top_p for sp in params]).tolist())


def _process(
    logits: torch.Tensor,  # [num_rows, vocab] raw logits
    temperature: torch.Tensor,  # [num_rows] float
    top_k: list[int],  # [num_rows]
    top_p: list[float],  # [num_rows] float32 values
) -> torch.Tensor:  # [num_rows, vocab] float32
    logits = logits.float() / temperature.float().clamp_min(_MIN_TEMPERATURE).unsqueeze(1)
    vocab = logits.shape[1]
    probs = logits.softmax(dim=-1)  # [num_rows, vocab] the rows with nothing to truncate (and the masses below)
    # per row as Python numbers: a decode step has a few rows, and each torch op on them costs more than the loop
    for i, (k, p) in enumerate(zip(top_k, top_p)):
        k = k if 0 < k < vocab else vocab
        if k < vocab or p < 1.0:
            probs[i] = _truncated(logits[i], k, float(p), probs[i])
    return probs


def _candidates(
    x: torch.Tensor,  # [vocab] float32 scaled logits
    c: int,  # how many leading candidates at least
) -> tuple[torch.Tensor, bool]:  # ids [>= c, or every candidate] in candidate order, whether that is every one
    """The leading candidates of a row: every token whose finite logit is at least the c-th largest finite one
    (ties included), ordered by logit then id."""
    ops = native_attention.load_layer_ops() if x.device.type == "cpu" else None
    if ops is not None:
        ids, every, _ = ops.leading_candidates(x.contiguous(), c)
        return ids, every
    if c < x.numel():
        threshold = x.topk(c).values[-1]
        if bool(threshold > -torch.inf):
            ids = (x >= threshold).nonzero().flatten()  # ascending ids
            return ids[x[ids].sort(descending=True, stable=True).indices], False
    ids = (x > -torch.inf).nonzero().flatten()
    return ids[x[ids].sort(descending=True, stable=True).indices], True


def _truncated(
    x: torch.Tensor,  # [vocab] float32 scaled logits
    k: int,  # top-k, vocab = off
    top_p: float,  # 1.0 = off
    full: torch.Tensor,  # [vocab] float32 x.softmax(-1): the masses when top-k is off
) -> torch.Tensor:  # [vocab] float32 probabilities
    """One row of process_logits with top-k or top-p on."""
    vocab = x.numel()
    c = k if k < vocab else _FIRST_CANDIDATES
    ops = native_attention.load_layer_ops() if x.device.type == "cpu" else None
    while True:
        if ops is not None and k == vocab:  # top-p alone: the native search sums the nucleus's mass too
            ids, _, keep = ops.leading_candidates(x.contiguous(), c, full.contiguous(), top_p)
            if ids.numel() == 0:
                return full
            if keep >= 0:
                break
            c = min(4 * c, vocab)
            continue
        ids, every = _candidates(x, c)
        if ids.numel() == 0:  # no finite logit: nothing to keep, the untruncated softmax's answer
            return full
        if k < vocab:
            ids = ids[:k]
            if top_p >= 1.0:
                keep = ids.numel()
                break
            mass = x[ids].softmax(dim=0)  # [k] the top-k distribution, in candidate order
        else:
            mass = full[ids]  # [n] the whole vocabulary's
        cum = torch.cumsum(mass.double(), dim=0)  # [n] in order, in float64
        if k < vocab or every or bool(cum[-1] >= top_p):
            keep = 1 + int((cum[:-1] < top_p).sum())  # the next token's mass-before is cum[j]: a prefix
            break
        c = min(4 * c, vocab)
    kept = ids[:keep]
    out = torch.zeros_like(x)
    out[kept] = x[kept].softmax(dim=0)
    return out


def truncated_by_sort(
    x: torch.Tensor,  # [vocab] float32 scaled logits (logits / temperature)
    k: int,  # top-k, vocab = off
    top_p: float,  # 1.0 = off
) -> torch.Tensor:  # [vocab] float32 probabilities
    """process_logits' definition for one truncated row, written the slow way: every candidate ordered by a full
    stable sort of the vocabulary, the mass before each one summed in a Python loop. Tests and
    benchmarks/fidelity/sampler_bench.py hold the shipped row (the leading candidates only) to it."""
    vocab = x.numel()
    order = x.sort(descending=True, stable=True).indices  # [vocab] logit descending, ties by the lower id
    order = order[x[order] > -torch.inf]  # the candidates: finite logits
    if order.numel() == 0:
        return x.softmax(dim=0)
    if k < vocab:
        order = order[:k]
        mass = x[order].softmax(dim=0)
    else:
        mass = x.softmax(dim=0)[order]
    keep = order.numel()
    if top_p < 1.0:
        before = 0.0  # the mass of the candidates before this one, summed in float64 in order
        for j, m in enumerate(mass.double().tolist()):
            if j > 0 and not before < top_p:
                keep = j
                break
            before += m
    out = torch.zeros_like(x)
    out[order[:keep]] = x[order[:keep]].softmax(dim=0)
    return out


def sampling_tensors(
    params: list[SamplingParams],
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # temperature [n] float32, top_k [n] long, top_p [n] float32
    """Per-row tensors for ``process_logits``; greedy rows get temperature 1 (their
    probabilities are not used for sampling, but must stay finite)."""
    temperature = torch.tensor(
        [1.0 if sp.greedy else sp.temperature for sp in params], dtype=torch.float32, device=device
    )
    top_k = torch.tensor([sp.top_k for sp in params], dtype=torch.long, device=device)
    top_p = torch.tensor([sp.top_p for sp in params], dtype=torch.float32, device=device)
    return temperature, top_k, top_p


def probs_for(
    logits: torch.Tensor,  # [num_rows, vocab] float32 raw logits, row i belongs to params[i]
    params: list[SamplingParams],
) -> torch.Tensor:  # [num_rows, vocab] float32
    """``process_logits`` with the tensors built from ``params``.

    Greedy rows (temperature 0) become a one-hot of the argmax, so a draft model can
    hand the rejection sampler a ``q`` for every request without special cases.
    """
    probs = process_params(logits, params)
    greedy_rows = [i for i, sp in enumerate(params) if sp.greedy]
    if greedy_rows:
        rows = torch.tensor(greedy_rows, device=logits.device)
        one_hot = torch.zeros(len(greedy_rows), logits.shape[1], dtype=probs.dtype, device=probs.device)
        one_hot.scatter_(1, logits[rows].argmax(dim=-1, keepdim=True), 1.0)
        probs[rows] = one_hot
    return probs


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator for one seeded request; ``None`` (the global RNG) when unseeded.

    Seeds are taken modulo 2**64 so any Python int (negative ones too) is accepted.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed % (1 << 64))
    return generator


def sample(
    probs: torch.Tensor,  # [num_rows, vocab] float32, rows need not be normalized
    generators: list[torch.Generator | None],  # [num_rows], None = global RNG
) -> torch.Tensor:  # [num_rows] long token ids
    """Draw one token per row with that row's generator.

    Uses the exponential race: ``argmax_v p_v / E_v`` with ``E_v ~ Exp(1)`` picks
    ``v`` with probability ``p_v / sum(p)``, because ``E_v / p_v ~ Exp(p_v)`` and the
    smallest of independent exponentials is ``v`` with that probability. It needs
    no normalization (handy for the residual ``max(0, p - q)``), never picks a
    zero-probability token, and draws exactly ``vocab`` numbers per row, so a
    seeded row's stream does not depend on the batch around it.
    """
    num_rows, vocab = probs.shape
    if len(generators) != num_rows:
        raise ValueError(f"{num_rows} rows but {len(generators)} generators")
    exponentials = torch.empty_like(probs, dtype=torch.float32)  # [num_rows, vocab]
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == num_rows:
        exponentials.exponential_()
    else:
        if unseeded:
            rows = torch.tensor(unseeded, device=probs.device)
            exponentials[rows] = torch.empty(len(unseeded), vocab, device=probs.device).exponential_()
        for i, generator in enumerate(generators):
            if generator is not None:
                exponentials[i].exponential_(generator=generator)
    # A 0 draw would make 0 / 0 = NaN for zero-probability tokens, and argmax picks NaN.
    exponentials.clamp_min_(torch.finfo(torch.float32).tiny)
    return (probs.float() / exponentials).argmax(dim=-1)


# ----------------------------------------------------------------------------- position-keyed noise
#
# The noise that picks the token at output position t is a function of (seed, t) only: a generator
# freshly seeded with key(seed, t) (splitmix64, Steele et al. 2014) draws that position's numbers.
# Nothing is consumed from a per-request stream, so how many rows a verify step feeds (K) cannot
# shift which numbers a later position sees: plain decoding's output is a deterministic function
# of (prompt, params, seed), and a draft that samples with the same noise agrees with the target
# as often as the two distributions allow (coupled verification, workers/rejection_sampler.py).

_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def position_key(seed: int, position: int) -> int:
    """The 64-bit key of output position ``position`` of a request seeded ``seed``."""
    return _splitmix64((seed & _M64) ^ _splitmix64(position & _M64))


def keyed_uniforms(
    keys: list[int],  # [n] position keys (position_key)
    vocab: int,
) -> torch.Tensor:  # [n, vocab] float32 multiples of 2^-24 in [0, 1), row i a pure function of keys[i]
    """Uniforms from a CPU generator seeded with the row's key (so the numbers are the same whatever
    the device the logits live on)."""
    u = torch.empty(len(keys), vocab, dtype=torch.float32)  # [n, vocab]
    g = torch.Generator(device="cpu")
    for i, key in enumerate(keys):
        g.manual_seed(key)
        u[i].uniform_(generator=g)
    return u


def _exponentials_of(u: torch.Tensor) -> torch.Tensor:  # [..] float32 -> [..] float32
    # uniform_ gives multiples of 2^-24 in [0, 1); the midpoints of that grid (exact in fp64) are in (0, 1),
    # so every draw is finite and positive and no token is excluded
    return (-torch.log(u.double() + 2.0**-25)).float()


def keyed_exponentials(
    keys: list[int],  # [n] position keys (position_key)
    vocab: int,
    device: torch.device | str,
) -> torch.Tensor:  # [n, vocab] float32 Exp(1) draws, row i a pure function of keys[i]
    """``-log(u)`` of :func:`keyed_uniforms`: the noise of the exponential race, by definition."""
    return _exponentials_of(keyed_uniforms(keys, vocab)).to(device)


# A candidate's float32 race score may be off by a few ulps (~1e-6 relative); the margin is 100x that.
_RACE_MARGIN = 1e-4
# Below this many rows the extra passes of the float32 race in torch cost more than the fp64 logs they save
# (benchmarks/fidelity/sampler_bench.py); the native race has no such passes.
_RACE_MIN_ROWS = 8
# Candidates a row's native race may name before the definition decides the row instead (a row of many exact ties).
_RACE_CAP = 64


def keyed_sample(
    probs: torch.Tensor,  # [n, vocab] float32 processed probabilities (rows need not be normalized)
    keys: list[int],  # [n] position keys
) -> torch.Tensor:  # [n] long
    """The exponential race ``argmax_v p_v / E_v`` with position-keyed ``E`` (see :func:`sample`):
    distributed exactly as ``p``; the same (p, key) always gives the same token.

    The winner is exactly ``(p / keyed_exponentials(keys)).argmax(-1)``, computed cheaper on the CPU: the
    race first runs with an approximate ``E`` (a few ulps from the exact one), and only the entries within
    ``_RACE_MARGIN`` of each row's best get the exact ``E``; the exact scores decide, first index on ties, as
    ``argmax`` does. The true winner is always among those entries. Where the native kernels are built the
    whole race, the generator's draws and the exact noise included, is one pass in C
    (workers/kernels/keyed_race.c); else float32 torch ops over batches of rows."""
    if probs.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=probs.device)
    ops = native_attention.load_layer_ops() if probs.device.type == "cpu" else None
    if ops is not None:
        return _native_race(ops, probs.float().contiguous(), keys)
    if probs.device.type != "cpu" or probs.shape[0] < _RACE_MIN_ROWS:
        e = keyed_exponentials(keys, probs.shape[1], probs.device)
        return (probs.float() / e).argmax(dim=-1)
    p = probs.float()  # [n, vocab]
    u = keyed_uniforms(keys, probs.shape[1])  # [n, vocab]
    # In place, one [n, vocab] buffer: E' = -log1p((u - 1) + 2^-25), where u - 1 is exact (Sterbenz for
    # u >= 1/2, an integer multiple of 2^-24 below) and + 2^-25 rounds at most once; then the scores p / E'.
    race = torch.sub(u, 1.0).add_(2.0**-25).log1p_().neg_()  # [n, vocab] float32 E', ~1e-6 relative off
    torch.div(p, race, out=race)  # [n, vocab] float32 race scores
    best = race.max(dim=-1, keepdim=True).values  # [n, 1]
    if not bool(torch.isfinite(best).all()):  # a non-finite probability: the plain definition decides
        return (p / _exponentials_of(u)).argmax(dim=-1)
    rows, cols = (race >= best * (1.0 - _RACE_MARGIN)).nonzero(as_tuple=True)  # [m] candidates
    exact = p[rows, cols] / _exponentials_of(u[rows, cols])  # [m] the definition's scores
    race.fill_(-float("inf"))  # -inf loses to every candidate (scores >= 0)
    race[rows, cols] = exact
    return race.argmax(dim=-1)


# A row's race from its logits decides only where its winner leads every other candidate by this much (relative):
# torch's softmax and the two roundings after it move a score by a few ulps (tests bound them far below it).
_SCALED_GUARD = 1e-5
# A top-p row's race from its logits decides only where no sum of masses it compares with top_p lies this close to it:
# its masses (fp64 from the logits) and the definition's (torch's float32 softmax) differ by a few parts in a million.
_MASS_GUARD = 1e-4


def _race_params(sp: SamplingParams, vocab: int) -> tuple[float, int, float]:
    """A row's temperature, top-k (0: off) and top-p (1: off) as ``process_params`` applies them: the temperature
    clamped (1 for a greedy row), top-p rounded to float32."""
    t = 1.0 if sp.greedy else max(sp.temperature, _MIN_TEMPERATURE)
    return t, sp.top_k if 0 < sp.top_k < vocab else 0, array("f", [sp.top_p])[0]


def plain_temperature(sp: SamplingParams, vocab: int) -> bool:
    """Whether ``process_logits`` only divides this sampled request's logits by its temperature (top-k and top-p
    off): its race can then run on the logits themselves (:func:`sample_rows`)."""
    _, k, p = _race_params(sp, vocab)
    return k == 0 and p >= 1.0


def sample_rows(
    logits: torch.Tensor,  # [N, vocab] raw logits
    rows: list[int],  # [R] the rows to sample
    params: list[SamplingParams],  # [R] each row's (sampled) request's parameters
    keys: list[int],  # [R] each row's position key
) -> list[int]:  # [R] token ids
    """``keyed_sample(process_params(logits[rows], params), keys)``, row by row the same tokens. Rows whose
    processing is a division by the temperature race on the logits where the native kernels are built
    (``scaled_race``: no probabilities formed, no torch op); a row it cannot decide, and every other row, take
    the definition."""
    if not (len(rows) == len(params) == len(keys)):
        raise ValueError("sample_rows: one params and one key per row")
    out = [-1] * len(rows)
    vocab = logits.shape[1]
    ops = native_attention.load_layer_ops() if logits.device.type == "cpu" else None
    if ops is not None and logits.dtype == torch.float32 and logits.is_contiguous():
        race = [_race_params(sp, vocab) for sp in params]  # temperature (rounded to float32 in the call), k, p
        plain = [j for j, (_, k, p) in enumerate(race) if k == 0 and p >= 1.0]
        if plain:
            plain_rows, plain_keys = [rows[j] for j in plain], [keys[j] for j in plain]
            temps = [race[j][0] for j in plain]
            won = ops.scaled_race(logits, plain_rows, temps, plain_keys, _RACE_MARGIN, _SCALED_GUARD, _RACE_CAP)
            for j, token in zip(plain, won):
                out[j] = token
        cut = [j for j, (_, k, p) in enumerate(race) if not params[j].greedy and (k > 0 or p < 1.0)]
        if cut:
            won = ops.truncated_race(
                logits,
                [rows[j] for j in cut],
                [race[j][0] for j in cut],
                [race[j][1] for j in cut],
                [race[j][2] for j in cut],
                [keys[j] for j in cut],
                _SCALED_GUARD,
                _MASS_GUARD,
            )
            for j, token in zip(cut, won):
                out[j] = token
    rest = [j for j, token in enumerate(out) if token < 0]
    if rest:
        x = logits[[rows[j] for j in rest]]  # [len(rest), vocab]
        p = process_params(x, [params[j] for j in rest])
        for j, token in zip(rest, keyed_sample(p, [keys[j] for j in rest]).tolist()):
            out[j] = token
    return out


def row_races(
    params: list[SamplingParams],  # [M] each row's request's parameters
    seeds: list[int],  # [M] each request's resolved seed (ignored for greedy rows)
    first_positions: list[int],  # [M] the output position of each row's next token
    vocab: int,
) -> native_attention.RowRaces:
    """What native decode steps need to pick each row's token as a plain step's ``verify_coupled`` does: greedy
    rows their argmax, sampled rows :func:`sample_rows`' races (temperature only, or truncated by top-k / top-p)."""
    race = [(0.0, 0, 1.0) if sp.greedy else _race_params(sp, vocab) for sp in params]  # greedy: temperature 0
    return native_attention.RowRaces(
        temps=[t for t, _, _ in race],
        top_k=[k for _, k, _ in race],
        top_p=[p for _, _, p in race],
        seeds=[0 if sp.greedy else seed for sp, seed in zip(params, seeds)],
        first_positions=list(first_positions),
        margin=_RACE_MARGIN,
        guard=_SCALED_GUARD,
        mass_guard=_MASS_GUARD,
        cap=_RACE_CAP,
    )


def _native_race(
    ops: native_attention.NativeLayerOps,
    p: torch.Tensor,  # [n, vocab] float32 contiguous
    keys: list[int],  # [n]
) -> torch.Tensor:  # [n] long
    """keyed_sample through the native race; a row it cannot decide (-1) gets the definition."""
    out = ops.keyed_race(p, keys, _RACE_MARGIN, _RACE_CAP)  # [n]
    undecided = [r for r, token in enumerate(out) if token < 0]
    if undecided:
        e = keyed_exponentials([keys[r] for r in undecided], p.shape[1], p.device)
        for r, token in zip(undecided, (p[undecided] / e).argmax(dim=-1).tolist()):
            out[r] = token
    return torch.tensor(out, dtype=torch.long)
