"""Batch invariance: a position's logits are bit-identical (``torch.equal``) whatever else the step holds.

The reference for every position is the request decoded alone, one token per step, its KV in one
contiguous run of cache blocks (slot mode). Against it: whole-prompt prefill, prefill in chunks of
every size, verify-shaped steps (K + 1 rows), 1-32 neighbours with random row counts in the same
step, all with the request's KV scattered over random blocks of the pool, and a prefix-cache hit
(the first blocks shared with another request's table). On the tiny model (fast) and the real
SmolLM2 (slow), in fp32 and bf16.
"""

from __future__ import annotations

import random

import pytest
import torch

from workers import batch_invariant as bi
from workers.runner import ModelRunner, StepBatch

DTYPES = [torch.float32, torch.bfloat16]


# ----------------------------------------------------------------------------- the pieces


def test_probe_finds_the_row_counts_a_kernel_agrees_on():
    """A linear that sums one way for 1 row and another way for more (like a GEMV/GEMM switch)
    gets min_rows 2; one that agrees everywhere gets no padding."""
    w = torch.randn(32, 48, dtype=torch.float64).float()  # [out, in]

    def gemv_switch(x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        if x.shape[0] == 1:
            return (x[:, None, :] * w[None]).flip(-1).sum(-1)  # reversed order: rounds differently
        return (x[:, None, :] * w[None]).sum(-1)

    got = bi.probe_row_blocking(gemv_switch, 48, torch.float32, torch.device("cpu"), max_block=24)
    assert got.min_rows == 2 and got.block == 24
    x = torch.randn(1, 48)
    assert torch.equal(bi.blocked(gemv_switch, x, got), gemv_switch(torch.cat([x, torch.zeros(1, 48)]))[:1])
    plain = bi.probe_row_blocking(
        lambda x: (x[:, None, :] * w[None]).sum(-1), 48, torch.float32, torch.device("cpu"), max_block=24
    )
    assert plain == bi.RowBlocking(1, 24)


def test_probe_finds_a_tile_granule():
    """An AVX2-like sgemm: rows in tiles of 6, a tile's tail of 1-3 rows summed another way. No
    contiguous range of row counts agrees, but every multiple of 6 does: granule 6."""
    w = torch.randn(16, 32, dtype=torch.float64).float()  # [out, in]

    def tiled(x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        out = (x[:, None, :] * w[None]).sum(-1)
        tail = x.shape[0] % 6
        if 1 <= tail <= 3:
            out[-tail:] = (x[-tail:, None, :] * w[None]).flip(-1).sum(-1)
        return out

    got = bi.probe_row_blocking(tiled, 32, torch.float32, torch.device("cpu"))
    assert got.granule == 6 and got.block >= 32 and got.min_rows % 6 == 0
    x = torch.randn(13, 32)
    assert torch.equal(bi.blocked(tiled, x, got)[:1], bi.blocked(tiled, x[:1], got))


def test_blocking_sizes_cover_rows_in_fixed_calls():
    b = bi.RowBlocking(min_rows=2, block=8)
    assert b.sizes(1) == [(1, 2)]
    assert b.sizes(8) == [(8, 8)]
    assert b.sizes(19) == [(8, 8), (8, 8), (3, 3)]
    assert b.sizes(17) == [(8, 8), (8, 8), (1, 2)]
    calls = []
    out = bi.blocked(lambda x: calls.append(x.shape[0]) or x * 2, torch.arange(17.0)[:, None], b)
    assert calls == [8, 8, 2] and torch.equal(out, torch.arange(17.0)[:, None] * 2)
    assert bi.RowBlocking(6, 60, 6).sizes(3) == [(3, 6)] and bi.RowBlocking(6, 60, 6).sizes(61) == [(60, 60), (1, 6)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_row_depends_only_on_its_visible_keys(dtype):
    """The same query row against the same visible keys: identical whatever the rows beside it,
    the requests beside it and how far the key axis is padded with masked keys."""
    gen = torch.Generator().manual_seed(0)
    H, Hkv, D, L = 6, 2, 16, 256
    keys = torch.randn(Hkv, L, D, generator=gen).to(dtype)
    vals = torch.randn(Hkv, L, D, generator=gen).to(dtype)
    q0 = torch.randn(H, D, generator=gen).to(dtype)
    blocking = bi.probe_attention_blocking(D, torch.device("cpu"))
    for visible in (1, 13, 64, 65, 150):
        outs = []
        for n, S, pos, pad in ((1, 1, 0, bi.padded_keys(visible)), (5, 1, 0, 256), (3, 4, 2, 192), (9, 7, 6, 256)):
            pad = max(pad, bi.padded_keys(visible))
            q = torch.randn(S, n, H, D, generator=gen).to(dtype)
            q[pos, 0] = q0
            k = torch.randn(S, Hkv, pad, D, generator=gen).to(dtype)
            v = torch.randn(S, Hkv, pad, D, generator=gen).to(dtype)
            k[pos], v[pos] = keys[:, :pad], vals[:, :pad]
            mask = torch.rand(S, n, pad, generator=gen) < 0.5
            mask[..., 0] = True
            mask[pos, 0] = torch.arange(pad) < visible
            outs.append(bi.attention(q, k, v, ~mask[:, None, None], D**-0.5, blocking)[pos, 0])
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), visible


# ----------------------------------------------------------------------------- the whole forward


def _alone(r: ModelRunner, ids: list[int], slot: int) -> list[torch.Tensor]:
    """Logits at every position, one token per step: the reference."""
    return [r.forward(StepBatch([slot], [i], [[t]], [[0]])).logits[0].clone() for i, t in enumerate(ids)]


def _neighbours(rng: random.Random, n: int, first_slot: int, vocab: int) -> tuple[list, list, list, list]:
    slots = list(range(first_slot, first_slot + n))
    starts = [rng.randrange(0, 40) for _ in slots]
    toks = [[rng.randrange(vocab) for _ in range(rng.choice([1, 1, 2, 5, 9]))] for _ in slots]
    rows = [[len(t) - 1] for t in toks]
    return slots, starts, toks, rows


def check_forward_invariance(
    model, dtype: torch.dtype, length: int, seed: int, max_neighbours: int, cpu_gemm: str = "onednn"
) -> int:
    """Feed one request's tokens in many schedules and compare every position with the reference.
    Returns the number of positions compared (all must be equal)."""
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    ids = [rng.randrange(3, vocab) for _ in range(length)]
    r = ModelRunner(
        model, num_slots=max_neighbours + 8, max_model_len=256, dtype=dtype, batch_invariant=True, cpu_gemm=cpu_gemm
    )
    ref = _alone(r, ids, slot=0)  # contiguous: slot 0's run of blocks
    compared = 0
    # blocks of slots 1..7 (neighbours use slots 8..): scattered tables are drawn from these
    spare = [b for s in range(1, 8) for b in r.slot_block_table(s)]

    def scattered(n: int = r.blocks_per_seq) -> list[int]:
        return rng.sample(spare, n)

    def expect(out: torch.Tensor, first_pos: int, what: str) -> None:
        nonlocal compared
        for j in range(out.shape[0]):
            assert torch.equal(out[j], ref[first_pos + j]), f"{what}: position {first_pos + j} differs"
            compared += 1

    # the whole prompt in one step, its KV scattered over the pool; its blocks stay out of later draws, since
    # the verify steps below read them (another table holding one at another index would overwrite it)
    whole = scattered()
    spare = [b for b in spare if b not in whole]
    expect(
        r.forward(StepBatch([0], [0], [ids], [list(range(length))], block_tables=[whole])).logits,
        0,
        "whole prefill, scattered blocks",
    )
    # chunked prefill (every chunk size 1..8 plus a long one) with neighbours of random sizes, in slots
    for chunk in (2, 3, 5, 7, 8, 17):
        pos, table = 0, scattered()
        while pos < length:
            part = ids[pos : pos + chunk]
            ns, nst, ntok, nrow = _neighbours(rng, rng.randrange(0, max_neighbours + 1), 8, vocab)
            out = r.forward(
                StepBatch(
                    [-1] + ns,
                    [pos] + nst,
                    [part] + ntok,
                    [list(range(len(part)))] + nrow,
                    block_tables=[table] + [r.slot_block_table(x) for x in ns],
                )
            ).logits
            expect(out[: len(part)], pos, f"chunk {chunk} with {len(ns)} neighbours")
            pos += len(part)
    # verify-shaped steps: a decoding request feeding K + 1 rows at a random point, neighbours around it
    for k in (1, 2, 4, 8):
        at = rng.randrange(1, length - k)
        ns, nst, ntok, nrow = _neighbours(rng, max_neighbours, 8, vocab)
        tables = [r.slot_block_table(x) for x in ns]
        batch = StepBatch(
            ns[:3] + [-1] + ns[3:],
            nst[:3] + [at] + nst[3:],
            ntok[:3] + [ids[at : at + k + 1]] + ntok[3:],
            nrow[:3] + [list(range(k + 1))] + nrow[3:],
            block_tables=tables[:3] + [whole] + tables[3:],
        )
        out = r.forward(batch).logits
        first = sum(len(x) for x in nrow[:3])
        expect(out[first : first + k + 1], at, f"verify K={k}")
    # a prefix-cache hit: the first full block shared with the whole-prefill table, the rest in other blocks
    bs = r.block_size
    hit = (length // 2) // bs * bs
    assert hit > 0
    table = whole[: hit // bs] + [b for b in scattered() if b not in whole][: r.blocks_per_seq - hit // bs]
    expect(
        r.forward(StepBatch([-1], [hit], [ids[hit:]], [list(range(length - hit))], block_tables=[table])).logits,
        hit,
        "prefix hit, shared blocks",
    )
    return compared


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cpu_gemm", ["onednn", "native"])
def test_tiny_forward_is_batch_invariant(tiny_loaded, dtype, cpu_gemm):
    """``native``: the linears are invariant by construction (no probed row blocking to lean on)."""
    n = check_forward_invariance(tiny_loaded.model, dtype, length=40, seed=1, max_neighbours=16, cpu_gemm=cpu_gemm)
    assert n > 300


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_forward_is_batch_invariant(smollm2_loaded, dtype):
    """The real model, neighbours up to 32 requests."""
    assert check_forward_invariance(smollm2_loaded.model, dtype, length=72, seed=2, max_neighbours=32) > 500


def test_fast_kernels_are_not_invariant_in_bf16_here_or_anywhere_else_it_shows(tiny_loaded):
    """The check above can fail: with ``batch_invariant=False`` and bf16 the same positions do
    differ on CPUs whose kernels switch by shape (if this CPU's do not, there is nothing to see)."""
    rng = random.Random(3)
    ids = [rng.randrange(3, 49152) for _ in range(48)]
    r = ModelRunner(tiny_loaded.model, num_slots=4, max_model_len=256, dtype=torch.bfloat16, batch_invariant=False)
    ref = torch.stack(_alone(r, ids, 0))
    whole = r.forward(StepBatch([1], [0], [ids], [list(range(48))])).logits
    if torch.equal(whole, ref):
        pytest.skip("this CPU's fast bf16 kernels happen to agree across these shapes")
    assert not torch.equal(whole, ref)
