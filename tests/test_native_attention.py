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


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (10, 2, 20), (4, 4, 16), (6, 1, 32)])
def test_a_row_depends_only_on_its_visible_keys(kernel, heads, kv_heads, head_dim):
    """The same query against the same keys: identical alone, among neighbour rows of other slots and
    lengths, in another slot and with other rows' keys beyond it; and close to fp64 attention.
    Shapes cover a head_dim that is not a multiple of the kernel's 16 lanes and uncommon group sizes."""
    gen = torch.Generator().manual_seed(0)
    slots, L = 6, 320
    for nvis in (1, 15, 16, 17, 100, 320):
        q0 = torch.randn(heads, head_dim, generator=gen)
        keys = torch.randn(kv_heads, nvis, head_dim, generator=gen)
        vals = torch.randn(kv_heads, nvis, head_dim, generator=gen)
        outs = []
        for rows, at, slot in ((1, 0, 0), (7, 3, 2), (33, 32, 5)):
            kc = torch.randn(slots, kv_heads, L, head_dim, generator=gen)  # other rows' keys, and junk past nvis
            vc = torch.randn(slots, kv_heads, L, head_dim, generator=gen)
            kc[slot, :, :nvis], vc[slot, :, :nvis] = keys, vals
            q = torch.randn(rows, heads, head_dim, generator=gen)
            q[at] = q0
            slot_of = torch.randint(0, slots, (rows,), generator=gen)
            slot_of[at] = slot
            n = torch.randint(1, L + 1, (rows,), generator=gen)
            n[at] = nvis
            out = kernel(q, kc.transpose(2, 3).contiguous(), vc, slot_of, n, int(n.max()), head_dim**-0.5)
            outs.append(out[at])
        for o in outs[1:]:
            assert torch.equal(o, outs[0]), nvis
        torch.testing.assert_close(outs[0].double(), reference(q0, keys, vals, nvis), atol=2e-6, rtol=1e-5)


def test_bad_shapes_are_refused_not_read_out_of_bounds(kernel):
    kt = torch.zeros(2, 1, 16, 32)
    v = torch.zeros(2, 1, 32, 16)
    q = torch.zeros(1, 2, 16)
    with pytest.raises(ValueError, match="visible keys"):
        kernel(q, kt, v, torch.tensor([0]), torch.tensor([33]), 33, 0.25)
    with pytest.raises(ValueError, match="fp32"):
        kernel(q.double(), kt, v, torch.tensor([0]), torch.tensor([3]), 3, 0.25)


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
    kt = torch.randn(4, 3, 64, 512, generator=gen)  # [slots, Hkv, D, L]
    v = torch.randn(4, 3, 512, 64, generator=gen)
    calls = [
        (torch.randn(6, 9, 64, generator=gen), torch.tensor([i % 4] * 6), torch.randint(300, 513, (6,), generator=gen))
        for i in range(8)
    ]
    alone = [kernel(q, kt, v, s, n, int(n.max()), 0.125) for q, s, n in calls]
    with ThreadPoolExecutor(4) as pool:
        together = list(
            pool.map(lambda c: [kernel(c[0], kt, v, c[1], c[2], int(c[2].max()), 0.125) for _ in range(20)], calls)
        )
    for a, outs in zip(alone, together):
        assert all(torch.equal(a, o) for o in outs)
