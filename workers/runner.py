"""A lean Llama forward over a ragged batch with a preallocated, paged KV cache.

Why not call the HF model: HF's cache grows by concatenation and its batch is
rectangular. Here every request in a step contributes its own number of new
tokens (a prefill chunk, 1 token for a plain decode step, K+1 for a verify step),
the linear layers run on the flat ``[num_tokens, hidden]`` matrix with no
padding, and keys/values are written in place into the request's cache blocks.
Rolling back rejected draft tokens is only moving the request's length back:
the stale entries are overwritten by the next write (see ``ModelRunner.forward``).

KV layout: a pool of ``num_blocks`` blocks of ``block_size`` positions, per layer
``[num_blocks, num_kv_heads, block_size, head_dim]`` (keys transposed within a block,
``[.., head_dim, block_size]``, for the native kernel). A request's position p lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``; the engine's block
manager (workers/kv_blocks.py) hands out the blocks, shares cached prefix blocks between
requests and takes them back. The native attention reads keys through the block table in
place; the torch attention gathers each call's blocks into one key axis first.

Slot mode (``StepBatch.block_tables`` None): slot s owns the blocks
``[s * blocks_per_seq, (s + 1) * blocks_per_seq)``, so callers that think in slots (the draft
model proposer, benchmarks, tests) run on the same kernels.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from workers import batch_invariant as bi
from workers import hugepages, native_attention
from workers.hardware import resolve_cpu_gemm
from workers.step_index import StepIndex

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """One forward's worth of work, built by the engine."""

    slots: list[int]  # [num_requests] KV slot of each request (slot mode; ignored when block_tables is given)
    start_pos: list[int]  # [num_requests] tokens already in the request's KV = position of its first new token
    token_ids: list[list[int]]  # [num_requests][num_new_i] new tokens per request (num_new_i >= 1)
    logits_rows: list[list[int]]  # [num_requests][*] offsets within the request's new tokens that need logits
    # [num_requests][*] offsets whose final-norm hidden state is wanted without logits (EAGLE-style
    # proposers read the target's features at every committed position; the LM head on all prompt
    # rows would be expensive). None: no extra rows, no extra work.
    hidden_rows: list[list[int]] | None = None
    # [num_requests][*] cache block of each request's positions, position p in block_tables[i][p // block_size];
    # must cover start_pos + num_new positions. None: slot mode (each slot a fixed run of blocks).
    block_tables: list[list[int]] | None = None
    # The caller reads the outputs (logits, hidden) before its next forward: they may be buffers the runner
    # hands out again next time (the fused forward's), so that a steady decode step makes no tensor.
    reuse_outputs: bool = False


@dataclass
class StepOutput:
    logits: torch.Tensor  # [sum_i len(logits_rows_i), vocab] float32, in request order
    hidden: torch.Tensor  # [sum_i len(logits_rows_i), hidden] final-norm hidden states at the same rows
    extra_hidden: torch.Tensor | None = None  # [sum_i len(hidden_rows_i), hidden] final-norm, at batch.hidden_rows
    # [sum_i len(logits_rows_i)] logits.argmax(dim=-1).tolist(), where the forward found it beside the logits, else None
    argmax: list[int] | None = None


@dataclass
class _AttnGroup:
    """The requests of one step with the same number of new tokens, attended in one SDPA call."""

    reqs: torch.Tensor  # [S_g] the group's requests (rows of the step's block table), in step order
    n: int  # new tokens per request (query rows)
    max_kv: int  # key axis of the call: longest context in the group after this step (padded with pad_keys)
    mask: torch.Tensor  # [S_g, 1, n, max_kv] bool, True = visible; with pad_keys [S_g, 1, 1, n, max_kv], True = hidden
    tok: torch.Tensor  # [S_g * n] rows of the step's flat token matrix, request by request
    # The group's rows are rows [row0, row0 + S_g * n) of the flat matrix: queries and outputs are views.
    dense_row0: int | None = None


# bf16 runners on CPUs without native bf16 GEMMs switch to fp32 packed weights from this many rows:
# from there on the emulated bf16 GEMM is slower than the packed fp32 one (docs/benchmarks.md).
_WIDE_ROWS = 3
# oneDNN (and the ideep layer over it) cache a primitive per input shape, up to 1024 of each, and
# every entry holds its own buffers: a runner fed every row count from 1 to thousands (a draft's
# ragged prefill steps) grows its memory for as long as new counts appear, and past 1024 it evicts
# and rebuilds on every step. Non-invariant runners therefore multiply at most this many rows at a
# time, padded above 8 rows to a multiple of 8: 15 shapes per weight, all seen early under load, so
# memory reaches its plateau early (docs/operations.md#memory).
_ONEDNN_MAX_ROWS = 64


def _bounded_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` over ``x [T, in]`` in chunks of at most ``_ONEDNN_MAX_ROWS`` rows, each padded with zero rows
    to a multiple of 8 (above 8 rows); returns ``[T, out]``."""
    out = []
    for xb in x.split(_ONEDNN_MAX_ROWS):
        n = xb.shape[0]
        padded = n if n <= 8 else -(-n // 8) * 8
        if padded != n:
            xb = F.pad(xb, (0, 0, 0, padded - n))  # [padded, in]
        out.append(fn(xb)[:n])  # [n, out]
    return out[0] if len(out) == 1 else torch.cat(out)


def _pack(w: torch.Tensor) -> torch.Tensor:
    """A ``[out, in]`` weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, None)


def _packed_linear(x: torch.Tensor, w_packed: torch.Tensor) -> torch.Tensor:
    # x: [T, in] contiguous -> [T, out]; the same op torch.compile's CPU backend emits for linears
    return torch.ops.mkldnn._linear_pointwise(x, w_packed, None, "none", [], "")


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build run prepacked oneDNN linears in ``dtype``, checked by doing one."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(8, 8, dtype=dtype)
        y = _packed_linear(torch.ones(2, 8, dtype=dtype), _pack(w))
        return bool(torch.allclose(y.float(), torch.full((2, 8), 8.0)))
    except (RuntimeError, AttributeError):
        return False


def pick_device(device: str = "auto") -> torch.device:
    """CUDA when present (production), CPU otherwise."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class ModelRunner:
    """Owns the weights (cast to ``dtype``) and the KV cache of one model."""

    def __init__(
        self,
        hf_model: PreTrainedModel,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "auto",
        cpu_gemm: str = "onednn",
        head_rows: Sequence[int] | None = None,
        batch_invariant: bool = False,
        num_blocks: int | None = None,
        block_size: int = 16,
        kv_dtype: torch.dtype | None = None,
        native_kernels: bool | None = None,
    ) -> None:
        """``num_blocks`` x ``block_size``: the paged KV pool; None sizes it for ``num_slots`` requests of
        ``max_model_len`` (slot mode). ``block_size`` is a multiple of the native kernel's 16 lanes.
        ``head_rows``: compute logits only for these vocabulary rows (a draft model's trained
        vocabulary); ``StepOutput.logits`` then has ``len(head_rows)`` columns, in that order.
        ``batch_invariant``: every position's logits and hidden states are bit-identical whatever
        else the step holds (workers/batch_invariant.py); ``False`` runs the library's kernels as chosen by shape.
        ``cpu_gemm``: the CPU's weight GEMMs, "onednn" (prepacked), "mkl" (``F.linear``) or "native" (the
        invariant linear kernel on the plain weights; oneDNN where it does not build, see ``self.cpu_gemm``).
        ``kv_dtype``: what the KV cache stores, fp32 or bf16; None: ``dtype``. A bf16 model's keys and values
        are bf16 values, so either holds them exactly (the same logits); an fp32 model's would be rounded.
        ``native_kernels``: the native attention and row-wise ops (workers/native_attention.py) on the CPU; None:
        with ``batch_invariant``. A runner that need not be invariant (a draft model) may still take them for
        speed: they round differently from the torch ops, which changes its drafts, not the output."""
        if cpu_gemm not in ("auto", "onednn", "mkl", "native"):
            raise ValueError(f"cpu_gemm must be 'auto', 'onednn', 'mkl' or 'native', got {cpu_gemm!r}")
        cpu_gemm = resolve_cpu_gemm(cpu_gemm, dtype)
        cfg = hf_model.config
        self.device = pick_device(device) if isinstance(device, str) else device
        self.dtype = dtype
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        if block_size < native_attention.LANES or block_size % native_attention.LANES:
            raise ValueError(f"block_size must be a multiple of {native_attention.LANES}, got {block_size}")
        self.block_size = block_size
        self.blocks_per_seq = -(-max_model_len // block_size)  # blocks one full-length request holds
        self.num_blocks = num_blocks if num_blocks is not None else num_slots * self.blocks_per_seq
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.intermediate_size = cfg.intermediate_size
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported (default RoPE only)")
        if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
            raise ValueError("attention/mlp biases are not supported (Llama without biases only)")

        def w(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device=self.device, dtype=dtype).contiguous()

        m = hf_model.model
        self.embed = w(m.embed_tokens.weight)  # [vocab, hidden]
        self.final_norm = w(m.norm.weight)  # [hidden]
        self.lm_head = w(hf_model.lm_head.weight)  # [vocab, hidden]; shares storage semantics with embed when tied
        if head_rows is not None:
            self.lm_head = self.lm_head[
                torch.as_tensor(list(head_rows), device=self.device)
            ].contiguous()  # [V_head, hidden]
        self.layers: list[dict[str, torch.Tensor]] = []
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                {
                    "in_norm": w(layer.input_layernorm.weight),  # [hidden]
                    # fused q/k/v: one matmul instead of three
                    "qkv": w(
                        torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight], 0)
                    ),  # [(H + 2 Hkv) * D, hidden]
                    "o": w(a.o_proj.weight),  # [hidden, H * D]
                    "post_norm": w(layer.post_attention_layernorm.weight),  # [hidden]
                    "gate_up": w(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], 0)),  # [2 * inter, hidden]
                    "down": w(mlp.down_proj.weight),  # [hidden, inter]
                }
            )
        # On CPU, every weight matmul runs through oneDNN with the weight prepacked once into its
        # blocked layout, which is faster at every row count (docs/benchmarks.md): F.linear repacks
        # the weight on every call and runs small-M GEMMs on one thread. The packed copy replaces
        # the plain one, so weight memory is unchanged (the LM head keeps its plain copy: it is the
        # tied embedding table). Where oneDNN cannot pack (CUDA, or bf16 on a CPU without
        # AVX-512/AVX-NE-CONVERT), or with cpu_gemm="mkl", the plain F.linear path runs: it is what
        # HF's forward calls, so its fp32 logits are bit-identical to HF's; oneDNN sums in another
        # order (max |logit diff| ~1.1e-4 on SmolLM2, see EngineConfig).
        # cpu_gemm="native": every weight linear and the LM head run through the invariant linear kernel
        # (workers/kernels/invariant_linear.c) on the weights tiled for it (or plain [out, in] where a shape
        # cannot be tiled): invariant at every row count by construction, so nothing is probed, padded or
        # blocked. Where the library does not
        # build, oneDNN's path runs instead.
        on_cpu_native = cpu_gemm == "native" and self.device.type == "cpu"
        self.native_gemm = native_attention.load_linear() if on_cpu_native else None
        if on_cpu_native and self.native_gemm is None:
            log.warning("cpu_gemm='native': the native kernels are unavailable, using oneDNN for the linears")
            cpu_gemm = "onednn"
        self.cpu_gemm = "native" if self.native_gemm is not None else cpu_gemm
        if self.native_gemm is not None:
            # The GEMM weights tiled (NativeLinear.tile: a one-row GEMM reads them in address order) where
            # every shape allows it and the build reads them faster so, and all the weights, as a step streams
            # them, in one run of huge pages (workers/hugepages.py).
            lin, gemms = self.native_gemm, ("qkv", "o", "gate_up", "down")
            if all(lin.tiles(L[n]) for L in self.layers for n in gemms) and lin.tiles(self.lm_head):
                for L in self.layers:
                    L.update((n, lin.tile(L[n].contiguous())) for n in gemms)
                self.lm_head = lin.tile(self.lm_head.contiguous())
            names = ("in_norm", "qkv", "o", "post_norm", "gate_up", "down")
            placed = hugepages.arena([L[n] for L in self.layers for n in names] + [self.final_norm, self.lm_head])
            for i, L in enumerate(self.layers):
                L.update(zip(names, placed[6 * i : 6 * i + 6]))
            self.final_norm, self.lm_head = placed[-2:]
        self._packed = self.device.type == "cpu" and cpu_gemm == "onednn" and _onednn_packs(dtype)
        if self._packed:
            for L in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    L[name] = _pack(L[name])
            self.lm_head_packed = _pack(self.lm_head)
        # bf16 on a CPU without native bf16 matmuls (no AVX-512-BF16 / AMX): one-row steps stream
        # half the bytes and win, but a multi-row bf16 GEMM is emulated and several times slower
        # than fp32 (docs/benchmarks.md).
        # So steps with more than one row (prefill chunks, batches, verify) multiply by an fp32
        # packed copy of the same bf16-rounded weights and round the result back to bf16. Costs
        # 2x the bf16 weight memory again; the values a one-row step reads are unchanged.
        self._wide_f32 = (
            self.device.type == "cpu"
            and cpu_gemm == "onednn"
            and dtype == torch.bfloat16
            and not self._packed
            and _onednn_packs(torch.float32)
        )
        self.batch_invariant = batch_invariant
        if self._wide_f32:
            for L in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    L[name + "_f32"] = _pack(L[name].float())
            self.lm_head_f32 = _pack(self.lm_head.float())
        inv_freq = m.rotary_emb.inv_freq.detach().float().to(self.device)  # [D / 2]
        scale = float(getattr(m.rotary_emb, "attention_scaling", 1.0))
        pos = torch.arange(max_model_len, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [max_model_len, D / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [max_model_len, D]
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)

        # The invariant attention: one native call per layer where a C compiler is found (CPU), else torch
        # ops (workers/batch_invariant.py). The two round differently, so this is part of the fingerprint.
        native = batch_invariant if native_kernels is None else native_kernels
        self.native_attn = native_attention.load() if native and self.device.type == "cpu" else None
        # With it come the layer's row-wise ops (residual + RMSNorm, RoPE + cache write, SiLU * up) as
        # three native calls, where torch makes ~35 small ones (workers/kernels/invariant_layer.c).
        self.native_ops = native_attention.load_layer_ops() if self.native_attn else None
        kv_shape = (self.num_blocks, self.num_kv_heads, block_size, self.head_dim)
        # The attention computes in fp32 and widens bf16 keys and values as it reads them, exactly.
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in native_attention.KV_DTYPES:
            raise ValueError(f"kv_dtype must be float32 or bfloat16, got {kv_dtype}")
        self.kv_dtype = kv_dtype
        # Every path reads and writes keys as [blocks, Hkv, BS, D]; for the native kernel that is a view of
        # keys stored transposed within a block ([blocks, Hkv, D, BS], contiguous), the layout it reads.
        k_storage = (self.num_blocks, self.num_kv_heads, self.head_dim, block_size) if self.native_attn else kv_shape
        # On huge pages: a step reads each request's blocks wherever they lie in the pool (workers/hugepages.py).
        self._k_storage = [hugepages.zeros(k_storage, kv_dtype, self.device) for _ in range(self.num_layers)]
        self.k_cache = [kt.transpose(2, 3) for kt in self._k_storage] if self.native_attn else self._k_storage
        self.v_cache = [hugepages.zeros(kv_shape, kv_dtype, self.device) for _ in range(self.num_layers)]
        # The caches' addresses and layout, checked once for every step's native calls.
        self._caches = (
            native_attention.BoundCaches.bind(list(zip(self._k_storage, self.v_cache))) if self.native_attn else None
        )
        # A step reads each weight once: past the last-level cache, the native GEMMs prefetch them into L2.
        self.stream_weights = native_attention.streams_past_caches(
            sum(L[n].numel() * L[n].element_size() for L in self.layers for n in ("qkv", "o", "gate_up", "down"))
            + self.lm_head.numel() * self.lm_head.element_size()
        )
        # With every GEMM native too, a forward's layers are one native call (the same calls, made in C).
        fused = native_attention.load_layers() if self.native_gemm is not None and self.native_ops is not None else None
        self.native_layers = (
            fused.bind(
                self.layers,
                self._caches,
                self.cos,
                self.sin,
                self.num_heads,
                self.eps,
                self.native_attn,
                self.final_norm,
                self.lm_head,
                self.stream_weights,
                self.embed,
            )  # fmt: skip
            if fused is not None and self._caches is not None and self.native_attn is not None
            else None
        )
        self.fused_layers = True  # False: the layers' calls made one by one from Python (benchmarks time them)
        # One row blocking per weight shape (all layers share them), probed with the thread count the
        # steps run with (a library partitions work by thread count too): re-probed if that changes.
        self.row_blocking: dict[str, bi.RowBlocking] = {}
        self._probed_threads = 0
        if batch_invariant:
            self._probe()

    def _probe(self) -> None:
        L0 = self.layers[0]
        widths = {
            "qkv": self.hidden_size,
            "o": self.num_heads * self.head_dim,
            "gate_up": self.hidden_size,
            "down": self.intermediate_size,
        }
        if self.native_gemm is None:  # the native linear agrees at every row count: nothing to probe
            for name, width in widths.items():
                self.row_blocking[name] = bi.probe_row_blocking(
                    functools.partial(self._linear_kernel, L=L0, name=name), width, self.dtype, self.device
                )
            self.row_blocking["lm_head"] = bi.probe_row_blocking(
                self._lm_head_kernel, self.hidden_size, self.dtype, self.device
            )
        if not self.native_attn:
            self.attn_blocking = bi.probe_attention_blocking(self.head_dim, self.device)
        self._probed_threads = torch.get_num_threads()

    @property
    def attention_kernel(self) -> str:
        """Which attention this runner uses: ``native`` (invariant by construction) or ``torch`` (invariant, its
        own rounding), or ``sdpa`` (the library's, not invariant)."""
        if self.native_attn:
            return "native"
        return "torch" if self.batch_invariant else "sdpa"

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes // self.num_blocks

    def slot_block_table(self, slot: int) -> list[int]:
        """Slot mode: the fixed run of blocks slot ``slot`` owns."""
        if not 0 <= slot < self.num_blocks // self.blocks_per_seq:
            raise ValueError(f"slot {slot} outside the {self.num_blocks // self.blocks_per_seq} slots of the pool")
        return list(range(slot * self.blocks_per_seq, (slot + 1) * self.blocks_per_seq))

    def copy_kv(self, src: int, dst: int, n: int) -> None:
        """Slot mode: copy the blocks holding slot ``src``'s first ``n`` positions into slot ``dst``'s."""
        nb = -(-n // self.block_size)
        a, b = self.slot_block_table(src)[:nb], self.slot_block_table(dst)[:nb]
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[b] = kc[a]  # [nb, Hkv, BS, D]
            vc[b] = vc[a]

    def _gather(self, cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
        """``cache [num_blocks, Hkv, BS, D]``, ``tables [S, nb]`` -> ``[S, Hkv, length, D]``: each request's
        keys (or values) in position order, one copy (the torch attention's key axis)."""
        S, nb = tables.shape
        g = cache[tables]  # [S, nb, Hkv, BS, D]
        return g.transpose(1, 2).reshape(S, self.num_kv_heads, nb * self.block_size, self.head_dim)[:, :, :length]

    def _final_norm(self, h: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm of ``rows`` ([M] int64) of the residual stream: ``[T, hidden] -> [M, hidden]``.
        ``delta``: the last layer's output, which the native layers leave for this norm to add (one native
        call for the selected rows, where torch's ops cost several small calls), or None (already added)."""
        if delta is None:
            return self._rms_norm(h[rows], self.final_norm)
        assert self.native_ops is not None  # only the native layers leave a delta
        hr, out = h.index_select(0, rows), h.new_empty(rows.shape[0], h.shape[1])
        return self.native_ops.add_rms_norm(hr, delta.index_select(0, rows), self.final_norm, out, self.eps)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; computed in fp32 like HF's LlamaRMSNorm, then cast back
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * xf.to(x.dtype)

    def _linear(self, x: torch.Tensor, L: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        # x: [T, in] -> [T, out]
        if self.native_gemm is not None:  # invariant at every row count: no blocking, no padding
            return self._linear_kernel(x, L, name)
        if self.batch_invariant:
            return bi.blocked(lambda xb: self._linear_kernel(xb, L, name), x, self.row_blocking[name])
        if self._packed or self._wide_f32:
            return _bounded_rows(lambda xb: self._linear_kernel(xb, L, name), x)
        return self._linear_kernel(x, L, name)

    def _linear_kernel(self, x: torch.Tensor, L: dict[str, torch.Tensor], name: str) -> torch.Tensor:
        # x: [T, in] -> [T, out]. Batch-invariant runners use one kernel for every row count: a bf16
        # runner on a CPU without native bf16 GEMMs always multiplies through the fp32 packed copy.
        if self.native_gemm is not None:
            return self.native_gemm(x, L[name], stream=self.stream_weights)
        if self.batch_invariant and self._wide_f32:
            return _packed_linear(x.float(), L[name + "_f32"]).to(self.dtype)
        if self._packed:
            return _packed_linear(x, L[name])
        if self._wide_f32 and x.shape[0] >= _WIDE_ROWS:
            return _packed_linear(x.float(), L[name + "_f32"]).to(self.dtype)
        return F.linear(x, L[name])

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> StepOutput:
        if self.batch_invariant and torch.get_num_threads() != self._probed_threads:
            self._probe()
        index, num_new, offsets = self._step_index(batch)
        if self.native_layers is not None and self.fused_layers:
            # one native call: the embeddings, every layer and the head (h, delta: buffers reused next step)
            h, fused_delta, hs, logits, argmax = self.native_layers.forward(
                index, self.head_dim**-0.5, batch.reuse_outputs
            )
            return self._output(batch, h, fused_delta, hs, logits, offsets, argmax)
        return self._forward_unfused(batch, index, num_new, offsets)

    @property
    def runs_decode_steps(self) -> bool:
        """Whether :meth:`decode_steps` runs here: the fused native forward (every GEMM native, on the CPU)."""
        return self.native_layers is not None and self.fused_layers

    def decode_steps(
        self,
        batch: StepBatch,
        n: int,
        pick: Callable[[int, torch.Tensor, list[int]], list[int]] | None = None,
        races: native_attention.RowRaces | None = None,
    ) -> list[list[int]]:
        """``n`` decode steps with no return to the caller between them (``BoundLayers.decode_steps``): the step
        ``batch`` holds (one pending token per request, each request's block table covering ``n`` positions from
        its start), then each request's token fed back ``n - 1`` times: its argmax (one native call for all
        steps), or what ``pick(step, logits [R, V] fp32, argmax [R])`` returns (a sampler, between the steps'
        native calls; with ``races``, the same choices made in the one native call). Returns per step the token of
        each request ([steps][R] ints, steps <= n): the tokens ``n`` :meth:`forward` calls would give those
        choices, bit for bit. The logits go only to ``pick``: the caller
        wants none (no logprobs, penalties or grammar)."""
        if not self.runs_decode_steps:
            raise ValueError("decode_steps needs the fused native forward (cpu_gemm='native' on the CPU)")
        if self.batch_invariant and torch.get_num_threads() != self._probed_threads:
            self._probe()
        if any(len(t) != 1 for t in batch.token_ids) or any(rs != [0] for rs in batch.logits_rows):
            raise ValueError("decode_steps runs a decode step: one new token per request, its logits row")
        index, _, _ = self._step_index(batch, n - 1)
        assert self.native_layers is not None
        return self.native_layers.decode_steps(index, self.head_dim**-0.5, n, pick, races)

    def _step_index(self, batch: StepBatch, ahead: int = 0) -> tuple[StepIndex, list[int], list[int]]:
        """The step's index vectors (workers/step_index.py), its new tokens per request and each request's first
        row; ``ahead``: positions past the step its block tables are to cover as well (decode_steps)."""
        num_new = [len(t) for t in batch.token_ids]
        max_kv = max(s + n for s, n in zip(batch.start_pos, num_new))
        if max_kv > self.max_model_len:
            raise ValueError(f"sequence of {max_kv} tokens exceeds max_model_len={self.max_model_len}")
        BS = self.block_size
        tables = (
            batch.block_tables if batch.block_tables is not None else [self.slot_block_table(s) for s in batch.slots]
        )
        for t, s, n in zip(tables, batch.start_pos, num_new):
            if len(t) * BS < s + n + ahead:
                raise ValueError(f"a block table of {len(t)} blocks cannot hold {s + n + ahead} positions")
        # [num_requests, nb] block ids, padded with block 0 (finite, never visible) to the step's key axis
        width = -(-(bi.padded_keys(max_kv + ahead) if self.batch_invariant else max_kv + ahead) // BS)
        rows_bt = [t[:width] + [0] * (width - len(t[:width])) for t in tables]
        if min(min(r) for r in rows_bt) < 0 or max(max(r) for r in rows_bt) >= self.num_blocks:
            raise ValueError(f"a block id outside the pool of {self.num_blocks} blocks")
        # The per-token index vectors, the block tables and the logits rows are built in Python and packed in one
        # buffer (workers/step_index.py): the fused forward reads it through addresses, the other paths as views.
        pos_l = [p for s, n in zip(batch.start_pos, num_new) for p in range(s, s + n)]
        kv_l = [t[p // BS] * BS + p % BS for t, s, n in zip(rows_bt, batch.start_pos, num_new) for p in range(s, s + n)]
        offsets = [0]  # [num_requests] row of each request's first new token in the flat matrix
        for n in num_new[:-1]:
            offsets.append(offsets[-1] + n)
        index = StepIndex(
            [t for ts in batch.token_ids for t in ts],
            pos_l,
            kv_l,
            [i for i, n in enumerate(num_new) for _ in range(n)],
            [p + 1 for p in pos_l],
            [offsets[i] + r for i, rs in enumerate(batch.logits_rows) for r in rs],
            rows_bt,
            max_kv,
        )
        return index, num_new, offsets

    def _forward_unfused(
        self, batch: StepBatch, index: StepIndex, num_new: list[int], offsets: list[int]
    ) -> StepOutput:
        """forward's layers as separate calls: native ops, or torch ops (see forward)."""
        dev, BS, total, max_kv = self.device, self.block_size, index.T, index.max_nvis
        nreq, max_q = len(num_new), max(num_new)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        flat_ids, positions, kv_index, req_of_tok, nvis, rows, bt = index.tensors(dev)  # [T] x5, [M], [R, nb]
        if not self.native_ops:  # the torch layers write the cache at (block, offset)
            blk_of_tok, off_of_tok = kv_index // BS, kv_index % BS

        # One request decoding one token sees every cached key: no mask needed (the common c=1 step).
        # One request with several tokens: a causal mask offset by its start. Several requests: one
        # attention call per group of equal new-token counts (see _attention_groups).
        single = nreq == 1 and max_q == 1
        mask = None
        groups: list[_AttnGroup] = []
        if self.native_attn:  # every row attends to its own keys (nvis: its position + 1): no groups, no mask
            pass
        elif self.batch_invariant:
            groups = self._attention_groups(batch, num_new, offsets, pad_keys=True)
        elif nreq == 1 and not single:
            qpos = batch.start_pos[0] + torch.arange(max_q, device=dev)  # [max_q]
            mask = (torch.arange(max_kv, device=dev)[None, :] <= qpos[:, None])[None, None]  # [1, 1, max_q, max_kv]
        elif nreq > 1:
            groups = self._attention_groups(batch, num_new, offsets)

        delta = None  # [T, hidden] the last layer's output where the native layers leave it unadded
        if self.native_ops:
            h = self.embed.index_select(0, flat_ids)  # [T, hidden]: a copy (the layers update it in place)
            h, delta = self._layers_native(h, positions, kv_index, bt, req_of_tok, nvis, max_kv)
        else:
            # The layers as torch ops: no C compiler, a non-invariant runner, or (tests isolating the
            # row-wise ops) the native attention with native_ops switched off.
            h = self.embed.index_select(0, flat_ids)  # [T, hidden]: a copy (the layers update it in place)
            cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
            sin = self.sin[positions].unsqueeze(1)
            if nreq == 1 and not self.batch_invariant:
                bt_one = bt[:, : -(-max_kv // BS)]  # [1, nb] the lone request's blocks, for the SDPA path
            for li, L in enumerate(self.layers):
                x = self._rms_norm(h, L["in_norm"])
                qkv = self._linear(x, L, "qkv")  # [T, (H + 2 Hkv) * D]
                qk = qkv[:, : (H + Hkv) * D].view(total, H + Hkv, D)
                qk = qk * cos + self._rotate_half(qk) * sin  # [T, H + Hkv, D]: RoPE on q and k in one pass
                q, k = qk[:, :H], qk[:, H:]  # [T, H, D], [T, Hkv, D]
                v = qkv[:, (H + Hkv) * D :].view(total, Hkv, D)
                kc, vc = self.k_cache[li], self.v_cache[li]  # [num_blocks, Hkv, BS, D] each
                kc[blk_of_tok, :, off_of_tok] = k.to(kc.dtype)  # in-place write, [T, Hkv, D] at (block, :, offset)
                vc[blk_of_tok, :, off_of_tok] = v.to(vc.dtype)
                if self.native_attn:
                    o = self.native_attn(
                        q.float(), self._k_storage[li], vc, bt, req_of_tok, nvis, max_kv, D**-0.5
                    )  # [T, H, D] fp32
                    o = o.reshape(total, H * D).to(self.dtype)
                elif self.batch_invariant:
                    o = q.new_empty(total, H, D)
                    for g in groups:
                        S = g.reqs.shape[0]
                        qg = (
                            q[g.dense_row0 : g.dense_row0 + S * g.n] if g.dense_row0 is not None else q[g.tok]
                        ).reshape(S, g.n, H, D)
                        tg = bt[g.reqs, : -(-g.max_kv // BS)]  # [S_g, nb]
                        attn = bi.attention(
                            qg,
                            self._gather(kc, tg, g.max_kv),
                            self._gather(vc, tg, g.max_kv),
                            g.mask,
                            D**-0.5,
                            self.attn_blocking,
                        )  # [S_g, n_g, H, D]
                        if g.dense_row0 is not None:
                            o[g.dense_row0 : g.dense_row0 + S * g.n] = attn.reshape(S * g.n, H, D)
                        else:
                            o[g.tok] = attn.reshape(S * g.n, H, D)
                    o = o.reshape(total, H * D)
                elif nreq == 1:
                    qp = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
                    attn = F.scaled_dot_product_attention(
                        qp,
                        self._gather(kc, bt_one, max_kv).to(q.dtype),
                        self._gather(vc, bt_one, max_kv).to(q.dtype),
                        attn_mask=mask,
                        enable_gqa=True,
                    )  # [1, H, T, D]
                    o = attn[0].transpose(0, 1).reshape(total, H * D)
                else:
                    o = q.new_empty(total, H, D)
                    for g in groups:
                        S = g.reqs.shape[0]
                        tg = bt[g.reqs, : -(-g.max_kv // BS)]  # [S_g, nb]
                        attn = F.scaled_dot_product_attention(
                            q[g.tok].reshape(S, g.n, H, D).transpose(1, 2),
                            self._gather(kc, tg, g.max_kv).to(q.dtype),
                            self._gather(vc, tg, g.max_kv).to(q.dtype),
                            attn_mask=g.mask,
                            enable_gqa=True,
                        )  # [S_g, H, n_g, D]
                        o[g.tok] = attn.transpose(1, 2).reshape(S * g.n, H, D)
                    o = o.reshape(total, H * D)
                h = h + self._linear(o, L, "o")
                x = self._rms_norm(h, L["post_norm"])
                gu = self._linear(x, L, "gate_up")  # [T, 2 * inter]
                gate, up = gu.chunk(2, dim=-1)
                h = h + self._linear(F.silu(gate) * up, L, "down")

        hs = self._final_norm(h, delta, rows)  # [M, hidden]
        return self._output(batch, h, delta, hs, self._lm_head(hs), offsets)

    def _output(
        self,
        batch: StepBatch,
        h: torch.Tensor,  # [T, hidden] the last layer's residual stream
        delta: torch.Tensor | None,  # [T, hidden] the last layer's output where it is left unadded, else None
        hs: torch.Tensor,  # [M, hidden] the final norm at the logits rows
        logits: torch.Tensor,  # [M, V] float32
        offsets: list[int],  # [num_requests] each request's first row
        argmax: list[int] | None = None,  # [M] the logits' argmax, where the forward found it
    ) -> StepOutput:
        extra = None
        if batch.hidden_rows is not None:
            wanted = [offsets[i] + r for i, rs in enumerate(batch.hidden_rows) for r in rs]
            hrows = torch.tensor(wanted, dtype=torch.long, device=h.device)  # [M']
            extra = self._final_norm(h, delta, hrows)  # [M', hidden]
        return StepOutput(logits=logits, hidden=hs, extra_hidden=extra, argmax=argmax)

    def _layers_native(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_index: torch.Tensor,
        bt: torch.Tensor,
        req_of_tok: torch.Tensor,
        nvis: torch.Tensor,
        max_kv: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer with the native row-wise ops and attention, one native call at a time (without the
        fused layers); the GEMMs run as ``cpu_gemm`` says.

        Each residual add is fused into the RMSNorm after it, so ``h`` is updated in place there; the last
        layer's output is returned beside it for the final norm to add (``(h, delta)``).
        """
        # h: [T, hidden] (a fresh tensor, never the embedding table) -> (h, delta), [T, hidden] each; kv_index: [T]
        # where each row's key and value go; bt: [num_requests, nb] block tables; req_of_tok, nvis: [T] each
        # row's request and visible keys
        D = self.head_dim
        ops, attn, caches = self.native_ops, self.native_attn, self._caches
        assert ops is not None and attn is not None and caches is not None  # the caller checked: the library loaded
        # every native call's arguments checked and converted once for the whole step
        step = native_attention.NativeStep(
            ops, attn, self.dtype, caches, self.num_heads, positions, kv_index, self.cos, self.sin, bt, req_of_tok,
            nvis, max_kv, D**-0.5,
        )  # fmt: skip
        x = torch.empty_like(h)  # [T, hidden] the normalized rows each GEMM reads
        delta = None
        # When the down projection's row blocking pads this step's rows (one call of call_rows > T: e.g. a
        # kernel that needs 2 rows, at batch 1), SiLU * up writes into the first rows of one zero-padded
        # buffer per step instead of every layer concatenating zero rows: the same call, the same numbers.
        T = h.shape[0]
        down_in = None  # [call_rows, inter]
        padded = False
        if self.batch_invariant and self.native_gemm is None:
            sizes = self.row_blocking["down"].sizes(T)
            if len(sizes) == 1 and sizes[0][1] > T:
                down_in, padded = h.new_zeros(sizes[0][1], self.intermediate_size), True
        if down_in is None:
            down_in = h.new_empty(T, self.intermediate_size)
        for li, L in enumerate(self.layers):
            step.add_rms_norm(h, delta, L["in_norm"], x, self.eps)
            qkv = self._linear(x, L, "qkv")  # [T, (H + 2 Hkv) * D]
            step.rope_kv(qkv, li)
            delta = self._linear(step.attention(li), L, "o")  # [T, H * D] in the model's dtype -> [T, hidden]
            step.add_rms_norm(h, delta, L["post_norm"], x, self.eps)
            gu = self._linear(x, L, "gate_up")  # [T, 2 * inter]
            step.silu_mul(gu, down_in[:T])
            if padded:
                delta = self._linear_kernel(down_in, L, "down")[:T]  # [T, hidden]
            else:
                delta = self._linear(down_in, L, "down")  # [T, hidden]
        assert delta is not None  # a model has at least one layer
        return h, delta

    def _attention_groups(
        self, batch: StepBatch, num_new: list[int], offsets: list[int], pad_keys: bool = False
    ) -> list[_AttnGroup]:
        """One attention call per distinct new-token count, over its requests' gathered blocks.

        Why: one call padded to the longest query would make every decoding request (1 new token)
        attend with as many query rows as a 32-token prefill chunk riding in the same step, and that
        padding was a large share of a mixed step. Grouping by count keeps each call dense.
        Key j is visible to query row i of a request iff j <= start + i. ``pad_keys``: the
        key axis is rounded up to whole KEY_BLOCKs for the batch-invariant attention.
        """
        dev = self.device
        by_n: dict[int, list[int]] = {}
        for i, n in enumerate(num_new):
            by_n.setdefault(n, []).append(i)
        groups = []
        for n, idxs in by_n.items():
            max_kv = max(batch.start_pos[i] + n for i in idxs)
            if pad_keys:
                max_kv = bi.padded_keys(max_kv)
            start = torch.tensor([batch.start_pos[i] for i in idxs], dtype=torch.long, device=dev)  # [S_g]
            qpos = start[:, None] + torch.arange(n, device=dev)[None, :]  # [S_g, n]
            mask = (torch.arange(max_kv, device=dev)[None, None, :] <= qpos[:, :, None]).unsqueeze(1)  # [S_g, 1, n, kv]
            if pad_keys:
                mask = ~mask.unsqueeze(1)  # [S_g, 1, 1, n, kv]: the form bi.attention masks with
            dense = idxs == list(range(idxs[0], idxs[0] + len(idxs)))
            groups.append(
                _AttnGroup(
                    reqs=torch.tensor(idxs, dtype=torch.long, device=dev),
                    n=n,
                    max_kv=max_kv,
                    mask=mask,
                    tok=torch.tensor([offsets[i] + r for i in idxs for r in range(n)], dtype=torch.long, device=dev),
                    dense_row0=offsets[idxs[0]] if dense else None,
                )
            )
        return groups

    def _lm_head(self, hs: torch.Tensor) -> torch.Tensor:
        """``[M, hidden] -> [M, vocab]`` float32 logits.

        The LM head is the largest matrix (vocab 49152 x 576, 113 MB in fp32), so it is packed for
        oneDNN like the layers: about twice as fast as ``F.linear`` (docs/benchmarks.md).
        """
        if self.native_gemm is not None:
            return self._lm_head_kernel(hs)
        if self.batch_invariant:
            return bi.blocked(self._lm_head_kernel, hs, self.row_blocking["lm_head"])
        if self._packed or self._wide_f32:
            return _bounded_rows(self._lm_head_kernel, hs)
        return self._lm_head_kernel(hs)

    def _lm_head_kernel(self, hs: torch.Tensor) -> torch.Tensor:
        # hs: [M, hidden] -> [M, vocab] float32
        if self.native_gemm is not None:
            return self.native_gemm(hs, self.lm_head, stream=self.stream_weights).float()
        if self.batch_invariant and self._wide_f32:
            return _packed_linear(hs.float().contiguous(), self.lm_head_f32)
        if self._packed:
            return _packed_linear(hs.contiguous(), self.lm_head_packed).float()  # [M, vocab]
        if self._wide_f32 and hs.shape[0] >= _WIDE_ROWS:
            return _packed_linear(hs.float().contiguous(), self.lm_head_f32)  # [M, vocab]
        return F.linear(hs, self.lm_head).float()  # [M, vocab]

    def forward_tokens(self, slot: int, start_pos: int, token_ids: Sequence[int]) -> torch.Tensor:
        """Single-request helper (tests, draft warm-up): logits for every new token, [n, vocab]."""
        out = self.forward(StepBatch([slot], [start_pos], [list(token_ids)], [list(range(len(token_ids)))]))
        return out.logits
