"""Batch-invariant kernels: a position's numbers do not depend on what else is in the step.

Why: speculation, batching, chunked prefill and the prefix cache all change *how many rows* a
forward computes and *which keys* an attention call spans. A GEMM library picks its kernel, its
tiling and sometimes a split of the reduction axis by shape, so the same row summed inside a
1-row and a 5-row call can round differently; an attention whose key axis is padded to the
longest request in the step adds the real terms in another order. Then a verify step (K+1 rows)
and a plain step (1 row) can disagree on a logit, and greedy output depends on load. Thinking
Machines, "Defeating Nondeterminism in LLM Inference" (2025), and vLLM's ``batch_invariant.py``
fix the kernels on GPU; this module does it on top of the kernels torch ships, two ways:

* **Weight GEMMs run on fixed row counts.** For a fixed ``(M, N, K)``, dtype and thread count a
  library runs one fixed kernel, so a row's result can depend only on M (and its position in the
  call, checked too). :func:`probe_row_blocking` finds, once per weight shape, a smallest row count
  ``m0`` and a block ``B`` such that every ``M`` in ``[m0, B]`` gives bit-identical rows; a call then
  runs in blocks of ``B`` rows and pads a short tail block up to ``m0``. Which ``M`` agree is a
  property of the library and CPU, not of the data, so the probe is run where the model runs.
* **Attention reduces in fixed blocks aligned at key 0.** Scores are one matmul over the head
  dimension (its reduction length is always ``head_dim``; query rows in probed row blocks, as above); the key axis is padded to a multiple of
  :data:`KEY_BLOCK` (masked keys add exact zeros to lanes fixed from key 0); ``P @ V`` is computed
  per block of :data:`KEY_BLOCK` keys (a GEMM whose reduction length is always the block) and the
  blocks are summed left to right, so extra masked blocks after a request's own keys
  add ``+0`` at the end instead of changing a GEMM's reduction length. Computed in fp32 whatever
  the model dtype.

Everything else on the path is row-wise (RMSNorm's mean over ``hidden``, softmax over the vocab) or
elementwise on rows whose widths are multiples of the vector width, which does not depend on the
batch. ``tests/test_batch_invariance.py`` checks the whole forward with ``torch.equal``.

A CUDA port keeps the same interface: :func:`blocked` wraps any linear (cuBLAS with a
deterministic workspace, ``CUBLAS_WORKSPACE_CONFIG``) and the probe holds there too, and the
attention needs the same fixed key blocking (a split-KV decode kernel with a split size chosen by
shape is exactly what must not happen).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

KEY_BLOCK = 64  # keys per attention reduction block; a multiple of every CPU's vector width
MAX_ROW_BLOCK = 64  # largest GEMM row block probed

LinearFn = Callable[[torch.Tensor], torch.Tensor]  # [M, in] -> [M, out]


@dataclass(frozen=True)
class RowBlocking:
    """How one GEMM is called so every row sees the same kernel: blocks of at most ``block`` rows; a
    block's row count is rounded up to a multiple of ``granule`` and to at least ``min_rows`` (zero rows
    pad it). E.g. an AVX2 sgemm computes rows in tiles of 6 and a tile's tail of 1-3 rows another way:
    granule 6 makes every row a full-tile row."""

    min_rows: int
    block: int
    granule: int = 1

    def sizes(self, num_rows: int) -> list[tuple[int, int]]:
        """``[(rows in the block, rows the kernel is called with)]`` covering ``num_rows`` rows."""
        out = []
        left = num_rows
        while left > 0:
            n = min(left, self.block)
            out.append((n, max(-(-n // self.granule) * self.granule, self.min_rows)))
            left -= n
        return out

    def direct(self, num_rows: int) -> bool:
        """Whether ``num_rows`` rows can be one call as they are (no split, no padding)."""
        return self.min_rows <= num_rows <= self.block and num_rows % self.granule == 0


# (min_rows, granule) candidates, in order of preference: no padding first
_CANDIDATES = ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (2, 2), (4, 4), (6, 6), (8, 8), (12, 12), (16, 16))


def probe_row_blocking(
    fn: LinearFn,
    in_features: int,
    dtype: torch.dtype,
    device: torch.device,
    max_block: int = MAX_ROW_BLOCK,
    draws: int = 2,
) -> RowBlocking:
    """Find the row counts on which ``fn`` gives bit-identical rows (see the module docstring).

    For each candidate (``m0``, granule ``g``): every row of a random input is computed alone (in an
    ``m0``-row call, at its first place), then ``fn`` is called with ``m0``, ``m0 + g``, ... rows and all
    of them must match; the run stops at the first count that does not. Every row is compared because a
    kernel change can hide behind the output rounding (in bf16 a different reduction order changes
    roughly one row in ten). The first candidate whose calls may hold 32 rows (or ``max_block``) wins,
    else the one with the largest calls. A run of one size still gives a valid, slow blocking: always
    ``m0`` rows.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    xs = [
        torch.randn(max_block + 16, in_features, generator=gen).to(device=device, dtype=dtype) for _ in range(draws)
    ]  # [max_block + 16, in] each
    best = RowBlocking(1, 1)
    for m0, g in _CANDIDATES:
        if m0 > max_block:
            break
        pad = xs[0].new_zeros(m0 - 1, in_features)
        refs = [torch.stack([fn(torch.cat([x[i : i + 1], pad]))[0] for i in range(max_block)]) for x in xs]
        end = m0 - 1
        for m in range(m0, max_block + 1, g):
            if not all(torch.equal(fn(x[:m].contiguous()), ref[:m]) for x, ref in zip(xs, refs)):
                break
            end = m
        if end < m0:
            continue  # even m0 rows depend on their place in the call
        if end > best.block:
            best = RowBlocking(m0, end, g)
        if end >= min(32, max_block):
            break
    return best


def blocked(fn: LinearFn, x: torch.Tensor, blocking: RowBlocking) -> torch.Tensor:
    """``fn(x)`` with every row computed in a call of one of ``blocking``'s row counts."""
    # x: [M, in] -> [M, out]
    if x.shape[0] == 0 or blocking.direct(x.shape[0]):
        return fn(x.contiguous())
    parts = []
    start = 0
    for n, call_rows in blocking.sizes(x.shape[0]):
        xb = x[start : start + n]
        if call_rows > n:
            xb = torch.cat([xb, xb.new_zeros(call_rows - n, x.shape[1])])  # [call_rows, in]
        parts.append(fn(xb.contiguous())[:n])
        start += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def padded_keys(num_keys: int) -> int:
    """Key-axis length of an invariant attention call: the next multiple of :data:`KEY_BLOCK`."""
    return -(-num_keys // KEY_BLOCK) * KEY_BLOCK


@dataclass(frozen=True)
class AttentionBlocking:
    """Row blockings of attention's two GEMMs: scores ``[M, D] @ [D, L]`` and ``P @ V`` per key block
    ``[M, KEY_BLOCK] @ [KEY_BLOCK, D]``, where M = query rows per (request, kv head)."""

    scores: RowBlocking
    pv: RowBlocking


def probe_attention_blocking(head_dim: int, device: torch.device) -> AttentionBlocking:
    """Like :func:`probe_row_blocking`, for attention's batched GEMMs: which query-row counts give
    bit-identical rows. Called batched (distinct memory per batch entry), as the forward calls them;
    the key count L only sets the number of output columns, which every kernel computes alike."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    kt = torch.randn(4, head_dim, 2 * KEY_BLOCK, generator=gen).to(device)  # [4, D, L]
    vb = torch.randn(4, KEY_BLOCK, head_dim, generator=gen).to(device)  # [4, KB, D]

    def batched(w: torch.Tensor) -> LinearFn:
        return lambda x: (x.unsqueeze(0).repeat(4, 1, 1) @ w)[2]  # [M, in] -> [M, out] via a batch-4 bmm

    return AttentionBlocking(
        scores=probe_row_blocking(batched(kt), head_dim, torch.float32, device),
        pv=probe_row_blocking(batched(vb), KEY_BLOCK, torch.float32, device),
    )


def blocked_matmul(a: torch.Tensor, b: torch.Tensor, blocking: RowBlocking) -> torch.Tensor:
    """``a @ b`` for batched ``a: [..., M, K]``, every GEMM run on one of ``blocking``'s row counts."""
    m = a.shape[-2]
    if blocking.direct(m):
        return a @ b
    parts, start = [], 0
    for n, call_rows in blocking.sizes(m):
        ab = a[..., start : start + n, :]
        if call_rows > n:
            ab = torch.cat([ab, ab.new_zeros(*ab.shape[:-2], call_rows - n, ab.shape[-1])], dim=-2)
        parts.append((ab @ b)[..., :n, :])
        start += n
    return torch.cat(parts, dim=-2)


def attention(
    q: torch.Tensor,  # [S, n, H, D] queries of S requests with n new tokens each
    k: torch.Tensor,  # [S, Hkv, L, D] keys, L a multiple of KEY_BLOCK
    v: torch.Tensor,  # [S, Hkv, L, D] values
    masked_out: torch.Tensor,  # [S, 1, 1, n, L] bool, True = hidden; every query row sees at least one key
    scale: float,
    blocking: AttentionBlocking,
) -> torch.Tensor:  # [S, n, H, D] in q's dtype
    """Causal GQA attention whose result for a query row depends only on that row's visible keys."""
    S, n, H, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    if L % KEY_BLOCK:
        raise ValueError(f"key axis {L} is not a multiple of {KEY_BLOCK}")
    nb = L // KEY_BLOCK
    qg = (q.float() * scale).view(S, n, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(S, Hkv, G * n, D)  # [S, Hkv, G*n, D]
    scores = blocked_matmul(qg, k.float().transpose(-1, -2), blocking.scores)  # [S, Hkv, G*n, L]: reduction over D
    scores = scores.view(S, Hkv, G, n, L).masked_fill_(masked_out, float("-inf"))
    probs = scores.softmax(-1).view(S, Hkv, G * n, L)
    v = v.float()
    # P @ V one KEY_BLOCK at a time (each GEMM a KEY_BLOCK-long reduction), blocks added left to right:
    # masked blocks past a request's keys add exact zeros at the end. Slicing keys keeps every operand a
    # strided view of the cache, so no block is copied.
    out = blocked_matmul(probs[..., :KEY_BLOCK], v[:, :, :KEY_BLOCK], blocking.pv)  # [S, Hkv, G*n, D]
    for b in range(1, nb):
        out = out + blocked_matmul(
            probs[..., b * KEY_BLOCK : (b + 1) * KEY_BLOCK], v[:, :, b * KEY_BLOCK : (b + 1) * KEY_BLOCK], blocking.pv
        )
    return out.view(S, Hkv, G, n, D).permute(0, 3, 1, 2, 4).reshape(S, n, H, D).to(q.dtype)
