"""The native batch-invariant attention (workers/kernels/invariant_attention.c): a query row's output
depends only on its own visible keys, bit for bit, and it is attention (close to an fp64 reference).
The whole forward's invariance with it, and with the torch fallback, is in test_batch_invariance.py."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.test_batch_invariance import check_forward_invariance
from workers import native_attention
from workers.runner import ModelRunner


@pytest.fixture(scope="module")
def kernel() -> native_attention.NativeAttention:
    k = native_attention.load()
    if k is None:
        assert shutil.which("cc") is None and shutil.which("gcc") is None, "a compiler is here, the kernel must build"
        pytest.skip("no C compiler: the runner uses the torch implementation")
    return k


def reference(q, k, v, nvis):  # fp64 softmax(q k^T / sqrt(D)) v over the visible keys, GQA
    H, D = q.shape
    G = H // k.shape[0]
    kk = k[:, :nvis].double().repeat_interleave(G, 0)  # [H, n, D]
    vv = v[:, :nvis].double().repeat_interleave(G, 0)
    probs = ((kk @ q.double()[:, :, None])[..., 0] * D**-0.5).softmax(-1)  # [H, n]
    return (probs[:, None, :] @ vv)[:, 0]  # [H, D]


def to_pool(kc: torch.Tensor, vc: torch.Tensor, block_size: int, gen: torch.Generator):
    """Per-slot caches ``[S, Hkv, L, D]`` scattered over a block pool in a random order:
    (keys ``[S * L / BS, Hkv, D, BS]`` transposed per block, values ``[.., Hkv, BS, D]``, tables ``[S, L / BS]``)."""
    S, Hkv, L, D = kc.shape
    nb = L // block_size
    tables = torch.randperm(S * nb, generator=gen).view(S, nb)
    kpool, vpool = torch.empty(S * nb, Hkv, block_size, D), torch.empty(S * nb, Hkv, block_size, D)
    kpool[tables.reshape(-1)] = kc.view(S, Hkv, nb, block_size, D).transpose(1, 2).reshape(-1, Hkv, block_size, D)
    vpool[tables.reshape(-1)] = vc.view(S, Hkv, nb, block_size, D).transpose(1, 2).reshape(-1, Hkv, block_size, D)
    return kpool.transpose(2, 3).contiguous(), vpool, tables


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 20), (4, 4, 16), (6, 1, 32)])
def test_a_row_depends_only_on_its_visible_keys(kernel, heads, kv_heads, head_dim):
    """The same query against the same keys: identical alone, among neighbour rows of other requests and
    lengths, with its keys in other (scattered) blocks of other sizes and other rows' keys beyond them; and
    close to fp64 attention. Shapes cover a head_dim that is not a multiple of the kernel's 16 lanes and
    uncommon group sizes."""
    gen = torch.Generator().manual_seed(0)
    slots, L = 6, 320
    for nvis in (1, 15, 16, 17, 100, 320):
        q0 = torch.randn(heads, head_dim, generator=gen)
        keys = torch.randn(kv_heads, nvis, head_dim, generator=gen)
        vals = torch.randn(kv_heads, nvis, head_dim, generator=gen)
        outs = []
        for rows, at, slot, bs in ((1, 0, 0, 16), (7, 3, 2, 32), (33, 32, 5, 64), (5, 4, 1, 16)):
            kc = torch.randn(slots, kv_heads, L, head_dim, generator=gen)  # other rows' keys, and junk past nvis
            vc = torch.randn(slots, kv_heads, L, head_dim, generator=gen)
            kc[slot, :, :nvis], vc[slot, :, :nvis] = keys, vals
            q = torch.randn(rows, heads, head_dim, generator=gen)
            q[at] = q0
            slot_of = torch.randint(0, slots, (rows,), generator=gen)
            slot_of[at] = slot
            n = torch.randint(1, L + 1, (rows,), generator=gen)
            n[at] = nvis
            kt, vp, tables = to_pool(kc, vc, bs, gen)
            out = kernel(q, kt, vp, tables, slot_of, n, int(n.max()), head_dim**-0.5)
            outs.append(out[at])
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), nvis
        torch.testing.assert_close(outs[0].double(), reference(q0, keys, vals, nvis), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim,bs", [(9, 3, 64, 16), (10, 2, 20, 32), (6, 1, 32, 16)])
def test_a_bf16_cache_reads_as_the_fp32_cache_of_the_same_values(kernel, heads, kv_heads, head_dim, bs):
    """Keys and values that are bf16 values (a bf16 model's): the kernel widens a bf16 cache exactly and sums in
    the same order, so every output is bit-identical to the fp32 cache's, decode and prefill rows alike."""
    gen = torch.Generator().manual_seed(7)
    slots, L = 5, 192
    kc = torch.randn(slots, kv_heads, L, head_dim, generator=gen).bfloat16().float()
    vc = torch.randn(slots, kv_heads, L, head_dim, generator=gen).bfloat16().float()
    kt, vp, tables = to_pool(kc, vc, bs, gen)
    rows = 23
    q = torch.randn(rows, heads, head_dim, generator=gen)
    req = torch.tensor([0] * 8 + [1, 2, 3] + [4] * 12)  # a prefill chunk, decode rows, another chunk
    n = torch.cat([torch.arange(100, 108), torch.tensor([1, 77, 192]), torch.arange(30, 42)])
    a = kernel(q, kt, vp, tables, req, n, int(n.max()), head_dim**-0.5)
    b = kernel(q, kt.bfloat16(), vp.bfloat16(), tables, req, n, int(n.max()), head_dim**-0.5)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="both fp32 or both bf16"):
        kernel(q, kt, vp.bfloat16(), tables, req, n, int(n.max()), head_dim**-0.5)


def test_shared_blocks_read_alike(kernel):
    """Two requests whose tables share their first blocks (a prefix-cache hit) and differ after: each row
    equals the same row with the request's keys copied into blocks of its own."""
    gen = torch.Generator().manual_seed(3)
    H, Hkv, D, BS = 9, 3, 64, 16
    kt = torch.randn(12, Hkv, D, BS, generator=gen)
    v = torch.randn(12, Hkv, BS, D, generator=gen)
    shared = torch.tensor([[5, 2, 9, 0], [5, 2, 7, 1]])  # both read blocks 5 and 2 first
    own = torch.tensor([[5, 2, 9, 0], [3, 4, 7, 1]])
    kt[3], kt[4], v[3], v[4] = kt[5], kt[2], v[5], v[2]  # request 1's own copy of the shared prefix
    q = torch.randn(6, H, D, generator=gen)
    req = torch.tensor([0, 0, 1, 1, 1, 1])
    n = torch.tensor([33, 40, 20, 61, 62, 64])
    a = kernel(q, kt, v, shared, req, n, 64, D**-0.5)
    b = kernel(q, kt, v, own, req, n, 64, D**-0.5)
    assert torch.equal(a, b)


def test_bad_shapes_are_refused_not_read_out_of_bounds(kernel):
    kt = torch.zeros(4, 1, 16, 16)
    v = torch.zeros(4, 1, 16, 16)
    q = torch.zeros(1, 2, 16)
    tables = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="visible keys"):
        kernel(q, kt, v, tables, torch.tensor([0]), torch.tensor([33]), 33, 0.25)
    with pytest.raises(ValueError, match="outside the pool"):
        kernel(q, kt, v, torch.tensor([[0, 4]]), torch.tensor([0]), torch.tensor([17]), 17, 0.25)
    with pytest.raises(ValueError, match="fp32"):
        kernel(q.double(), kt, v, tables, torch.tensor([0]), torch.tensor([3]), 3, 0.25)


def test_runner_reports_its_attention_kernel(tiny_loaded, kernel, monkeypatch):
    assert ModelRunner(tiny_loaded.model, 2, 64, batch_invariant=True).attention_kernel == "native"
    assert ModelRunner(tiny_loaded.model, 2, 64, batch_invariant=False).attention_kernel == "sdpa"
    monkeypatch.setenv(native_attention.ENV_DISABLE, "0")
    native_attention.clear_cache()
    try:
        assert ModelRunner(tiny_loaded.model, 2, 64, batch_invariant=True).attention_kernel == "torch"
    finally:
        monkeypatch.undo()
        native_attention.clear_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_fallback_is_batch_invariant_too(tiny_loaded, dtype, monkeypatch):
    """Where no compiler is found the runner attends with torch ops: also invariant (other rounding)."""
    monkeypatch.setenv(native_attention.ENV_DISABLE, "0")
    native_attention.clear_cache()
    try:
        assert check_forward_invariance(tiny_loaded.model, dtype, length=40, seed=4, max_neighbours=16) > 300
    finally:
        monkeypatch.undo()
        native_attention.clear_cache()


def test_an_unwritable_cache_falls_back_to_the_torch_ops(tmp_path, monkeypatch):
    """A replica whose cache directory cannot be written still starts, on the torch-op attention."""
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    native_attention.clear_cache()
    try:
        assert native_attention.load() is None
    finally:
        monkeypatch.undo()
        native_attention.clear_cache()


def test_threads_calling_the_kernel_at_once_get_their_own_results(kernel):
    """One kernel object serves every runner in a process; engines stepping in two threads at once must
    not share its scratch."""
    gen = torch.Generator().manual_seed(5)
    kt, v, tables = to_pool(
        torch.randn(4, 3, 512, 64, generator=gen), torch.randn(4, 3, 512, 64, generator=gen), 16, gen
    )
    calls = [
        (torch.randn(6, 9, 64, generator=gen), torch.tensor([i % 4] * 6), torch.randint(300, 513, (6,), generator=gen))
        for i in range(8)
    ]
    alone = [kernel(q, kt, v, tables, s, n, int(n.max()), 0.125) for q, s, n in calls]
    with ThreadPoolExecutor(4) as pool:
        together = list(
            pool.map(
                lambda c: [kernel(c[0], kt, v, tables, c[1], c[2], int(c[2].max()), 0.125) for _ in range(20)], calls
            )
        )
    for a, outs in zip(alone, together):
        assert all(torch.equal(a, o) for o in outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_step_computes_what_the_checked_calls_do(kernel, dtype):
    """NativeStep (every argument checked once per forward) gives exactly the per-call wrappers' results:
    RoPE + cache write, attention with its output rounded to the model's dtype as torch rounds, RMSNorm
    with the residual add, SiLU * up; and it refuses what the wrappers refuse."""
    ops = native_attention.load_layer_ops()
    gen = torch.Generator().manual_seed(11)
    H, Hkv, D, BS, nblocks, T, hidden, inter = 9, 3, 64, 16, 12, 5, 48, 40
    pos = torch.tensor([0, 1, 2, 40, 7])
    kv_index = torch.tensor([3 * BS, 3 * BS + 1, 3 * BS + 2, 8 * BS + 8, 5 * BS + 7])
    bt = torch.tensor([[3, 0, 0], [1, 2, 8], [5, 0, 0]])
    req = torch.tensor([0, 0, 0, 1, 2])
    nvis = pos + 1
    cos, sin = torch.randn(64, D, generator=gen).to(dtype), torch.randn(64, D, generator=gen).to(dtype)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=gen).to(dtype)
    caches = [
        [
            torch.randn(nblocks, Hkv, D, BS, generator=gen).to(dtype),
            torch.randn(nblocks, Hkv, BS, D, generator=gen).to(dtype),
        ]
        for _ in range(2)
    ]
    copies = [[c.clone() for c in pair] for pair in caches]
    step = native_attention.NativeStep(
        ops,
        kernel,
        dtype,
        native_attention.BoundCaches.bind([tuple(p) for p in caches]),
        H,
        pos,
        kv_index,
        cos,
        sin,
        bt,
        req,
        nvis,
        int(nvis.max()),
        D**-0.5,
    )
    q_ref = ops.rope_kv(qkv, pos, kv_index, cos, sin, copies[1][0], copies[1][1], H)
    assert torch.equal(step.rope_kv(qkv, 1), q_ref)
    assert torch.equal(caches[1][0], copies[1][0]) and torch.equal(caches[1][1], copies[1][1])
    o_ref = kernel(q_ref, copies[1][0], copies[1][1], bt, req, nvis, int(nvis.max()), D**-0.5)
    assert torch.equal(step.attention(1), o_ref.view(T, H * D).to(dtype))
    h, delta = torch.randn(T, hidden, generator=gen).to(dtype), torch.randn(T, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    h2, out, out2 = h.clone(), torch.empty_like(h), torch.empty_like(h)
    step.add_rms_norm(h, delta, w, out, 1e-5)
    ops.add_rms_norm(h2, delta, w, out2, 1e-5)
    assert torch.equal(h, h2) and torch.equal(out, out2)
    gu = torch.randn(T, 2 * inter, generator=gen).to(dtype)
    assert torch.equal(step.silu_mul(gu, torch.empty(T, inter, dtype=dtype)), ops.silu_mul(gu))
    with pytest.raises(ValueError, match="contiguous int64"):
        native_attention.NativeStep(
            ops,
            kernel,
            dtype,
            native_attention.BoundCaches.bind([tuple(p) for p in caches]),
            H,
            pos.int(),
            kv_index,
            cos,
            sin,
            bt,
            req,
            nvis,
            41,
            D**-0.5,
        )
    with pytest.raises(ValueError, match="one shape and dtype"):
        native_attention.BoundCaches.bind(
            [tuple(caches[0]), (caches[1][0][:4].contiguous(), caches[1][1][:4].contiguous())]
        )
