"""The native row-wise layer ops (workers/kernels/invariant_layer.c): every output row is a function of its
input row alone (bit for bit, whatever else the call holds and however many threads run it), and the
values are those of the torch ops they replace, up to rounding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from workers import native_attention
from workers.runner import ModelRunner, StepBatch

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    o = native_attention.load_layer_ops()
    if o is None:
        pytest.skip("no C compiler: the runner uses the torch ops")
    return o


def _rms_ref(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    hf = h.float()
    return w * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [576, 40, 7])
def test_add_rms_norm_rows_are_invariant_and_match_torch(ops, dtype, n):
    gen = torch.Generator().manual_seed(n)
    h0 = torch.randn(200, n, generator=gen).to(dtype)  # 200 x 576 rows: the threaded path
    delta = torch.randn(200, n, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    h, out = h0.clone(), torch.empty_like(h0)
    ops.add_rms_norm(h, delta, w, out, 1e-5)
    assert torch.equal(h, h0 + delta)  # the residual add rounds as torch's does
    for t in (0, 37, 199):
        h1, out1 = h0[t : t + 1].clone(), torch.empty(1, n, dtype=dtype)
        ops.add_rms_norm(h1, delta[t : t + 1].clone(), w, out1, 1e-5)
        assert torch.equal(out1[0], out[t]) and torch.equal(h1[0], h[t])
    ref = _rms_ref(h0 + delta, w, 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    plain = torch.empty_like(h0)
    ops.add_rms_norm(h0.clone(), None, w, plain, 1e-5)  # no delta: h is only read
    torch.testing.assert_close(plain.float(), _rms_ref(h0, w, 1e-5).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_inter", [1536, 20])
def test_silu_mul_rows_are_invariant_and_match_torch(ops, dtype, n_inter):
    gen = torch.Generator().manual_seed(3)
    gu = (4 * torch.randn(100, 2 * n_inter, generator=gen)).to(dtype)
    gu[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # saturated and zero gates
    out = ops.silu_mul(gu)
    for t in (0, 50, 99):
        assert torch.equal(ops.silu_mul(gu[t : t + 1].clone())[0], out[t])
    gate, up = gu.chunk(2, dim=-1)
    ref = F.silu(gate.double()) * up.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    assert out[0, 0] == 0 and torch.isfinite(out).all()
    padded = torch.zeros(3, n_inter, dtype=dtype)  # the runner's zero-padded GEMM input: rows 1..2 stay zero
    ops.silu_mul(gu[50:51].clone(), out=padded[:1])
    assert torch.equal(padded[0], out[50]) and not padded[1:].any()
    with pytest.raises(ValueError, match="out must be"):
        ops.silu_mul(gu[:2].clone(), out=padded[:1])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_kv_rounds_as_the_torch_ops_and_writes_the_caches(ops, dtype, kv_dtype):
    """Keys and values land in the paged cache through each row's block table (blocks out of order), in the
    cache's dtype: a bf16 cache holds the value rounded to bf16 (for a bf16 model, the value itself)."""
    H, Hkv, D, L, BS, NB = 6, 2, 20, 48, 16, 9
    gen = torch.Generator().manual_seed(1)
    T = 9
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)
    pos = torch.tensor([0, 5, 6, 7, 40, 1, 2, 3, 47])
    seq = torch.tensor([0, 1, 1, 1, 2, 0, 0, 0, 2])
    tables = torch.tensor([[4, 0, 8], [7, 1, 2], [3, 6, 5]])  # [3 sequences, L / BS] block ids
    blk, off = tables[seq, pos // BS], pos % BS
    ang = torch.outer(torch.arange(L, dtype=torch.float32), torch.rand(D // 2, generator=gen))
    cos, sin = torch.cat([ang, ang], -1).cos().to(dtype), torch.cat([ang, ang], -1).sin().to(dtype)
    kt = torch.zeros(NB, Hkv, D, BS, dtype=kv_dtype)
    v = torch.zeros(NB, Hkv, BS, D, dtype=kv_dtype)
    q = ops.rope_kv(qkv, pos, blk * BS + off, cos, sin, kt, v, H)

    qk = qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D)
    rot = torch.cat((-qk[..., D // 2 :], qk[..., : D // 2]), -1)
    ref = qk * cos[pos].unsqueeze(1) + rot * sin[pos].unsqueeze(1)  # the runner's torch RoPE, [T, H + Hkv, D]
    assert torch.equal(q, ref[:, :H].float())
    assert torch.equal(kt.transpose(2, 3)[blk, :, off], ref[:, H:].to(kv_dtype))
    assert torch.equal(v[blk, :, off], qkv[:, (H + Hkv) * D :].view(T, Hkv, D).to(kv_dtype))
    written = torch.zeros(NB, BS, dtype=torch.bool)
    written[blk, off] = True
    assert (kt.permute(0, 3, 1, 2)[~written] == 0).all() and (v.transpose(1, 2)[~written] == 0).all()

    with pytest.raises(ValueError, match="position"):
        ops.rope_kv(qkv[:1], torch.tensor([L]), blk[:1] * BS, cos, sin, kt, v, H)
    with pytest.raises(ValueError, match="pool"):
        ops.rope_kv(qkv[:1], pos[:1], torch.tensor([NB * BS]), cos, sin, kt, v, H)
    with pytest.raises(ValueError, match="fp32 or all bf16"):
        ops.rope_kv(qkv.double(), pos, blk * BS + off, cos, sin, kt, v, H)


def test_rows_do_not_depend_on_the_thread_count(ops):
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(256, 576, generator=gen).to(torch.bfloat16)
    w = torch.randn(576, generator=gen).to(torch.bfloat16)
    outs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = torch.empty_like(h)
            ops.add_rms_norm(h.clone(), h.clone(), w, out, 1e-5)
            outs.append((out, ops.silu_mul(torch.cat([h, h], -1))))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, outs[0][0]) and torch.equal(b, outs[0][1]) for a, b in outs)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_runner_with_native_ops_stays_close_to_the_torch_ops(tiny_loaded, dtype):
    """The native ops round differently from torch's only in RMSNorm's sum and SiLU's exp."""
    r = ModelRunner(tiny_loaded.model, 2, 64, dtype=dtype, batch_invariant=True)
    if r.native_ops is None:
        pytest.skip("no C compiler")
    batch = StepBatch([0], [0], [list(range(3, 20))], [list(range(17))])
    fast = r.forward(batch).logits
    r.native_ops = None
    slow = r.forward(batch).logits
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(fast, slow, atol=tol, rtol=tol)


@pytest.mark.parametrize("vocab", [1, 17, 63, 64, 65, 49152, 49155])
def test_argmax_gives_torchs_indices_on_ties_nans_infinities_and_signed_zeros(ops, vocab):
    """Greedy tokens come from the native argmax: it must return exactly what ``torch.argmax`` does, the first
    maximal index, the first NaN where a row has one, and -0.0 equal to 0.0, whatever the row's length."""
    from workers.rejection_sampler import argmax

    gen = torch.Generator().manual_seed(vocab)
    rows = [
        torch.randn(vocab, generator=gen),
        torch.randint(-3, 3, (vocab,), generator=gen).float(),  # many ties at the maximum
        torch.full((vocab,), float("-inf")),
        torch.zeros(vocab).index_fill_(0, torch.arange(0, vocab, 2), -0.0),
        torch.randn(vocab, generator=gen).index_fill_(0, torch.randint(0, vocab, (2,), generator=gen), float("nan")),
        torch.randn(vocab, generator=gen).index_fill_(0, torch.randint(0, vocab, (2,), generator=gen), float("inf")),
        torch.full((vocab,), 7.0).index_fill_(0, torch.tensor([vocab - 1]), 8.0),  # the maximum in the tail
    ]
    x = torch.stack(rows)  # [7, vocab]
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    for r in range(x.shape[0]):  # a row alone: the same answer
        assert torch.equal(ops.argmax(x[r : r + 1].contiguous()), x[r : r + 1].argmax(dim=-1))
    with pytest.raises(ValueError, match="float32"):
        ops.argmax(x.bfloat16())
