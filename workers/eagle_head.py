"""The EAGLE draft head (Li et al. 2024, arXiv 2401.15077): one decoder layer over the target's features.

EAGLE drafts at the *feature* level: with ``f_j`` the target's feature at position ``j`` and
``t_{j+1}`` the token sampled from it, the head reads the pair ``[f_j ; embed(t_{j+1})]``
(concatenated, then ``fc`` back to ``hidden``), runs one Llama decoder layer (causal attention over
the earlier pairs of the same sequence, RoPE at position ``j``) and predicts ``f_{j+1}``, which the
target's frozen LM head turns into the distribution of ``t_{j+2}``. Drafting feeds its own
predicted feature and drafted token back as the next pair.

Features: ``f_j`` is the target's hidden state *after* its final RMSNorm (what ``ModelRunner``
returns as ``hidden``), exactly what its LM head reads; the head's output is scored through the
LM head directly, with no further norm (as in the EAGLE reference code).

Reduced draft vocabulary (EAGLE-3's trick): the target's LM head is 49152 x 576, and one row of it
costs more than the whole decoder layer on this CPU. The head scores only ``draft_vocab`` (the
most frequent tokens of the target's own outputs, ids stored in ``d2t``); a draft token is always
a target token id, and tokens outside the set are simply never proposed.

Shipped files (models/smollm2-eagle/): ``eagle_config.json`` (:class:`EagleConfig`) and
``model.safetensors`` (fc + the layer + ``d2t``). The embedding and LM head are the target's and
are not stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

CONFIG_FILE = "eagle_config.json"
WEIGHTS_FILE = "model.safetensors"


class EagleConfig(BaseModel):
    """Shape of the head; must match the target it was trained on."""

    model_config = ConfigDict(extra="forbid")

    hidden_size: int = Field(description="The target's hidden size.")
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int = Field(description="The target's vocabulary (draft token ids are target ids).")
    draft_vocab_size: int = Field(description="Rows of the LM head the head scores (len(d2t)).")
    target_num_layers: int = Field(description="Layers of the target it was trained on (a sanity check).")


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class EagleHead(nn.Module):
    """fc + one Llama decoder layer. ``embed`` and ``lm_head_rows`` are the target's (frozen buffers)."""

    d2t: torch.Tensor  # buffers, declared for type checkers (nn.Module's __getattr__ is untyped)
    inv_freq: torch.Tensor

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        H, inter = cfg.hidden_size, cfg.intermediate_size  # hidden, MLP widths
        nq, nkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.fc = nn.Linear(2 * H, H, bias=False)  # [f ; e] -> hidden
        self.in_norm = nn.Parameter(torch.ones(H))
        self.qkv = nn.Linear(H, (nq + 2 * nkv) * D, bias=False)
        self.o = nn.Linear(nq * D, H, bias=False)
        self.post_norm = nn.Parameter(torch.ones(H))
        self.gate_up = nn.Linear(H, 2 * inter, bias=False)
        self.down = nn.Linear(inter, H, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size), persistent=True)  # [V_draft] target ids
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.register_buffer("inv_freq", inv, persistent=False)  # [D / 2]

    # ------------------------------------------------------------------ pieces shared by training and drafting

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.float(), self.inv_freq.float())  # [T, D / 2]
        emb = torch.cat([freqs, freqs], -1)  # [T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def qkv_proj(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [..., T, hidden] (fc output) -> q [..., T, nq, D], k/v [..., T, nkv, D] with RoPE."""
        c = self.cfg
        nq, nkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = self.qkv(rms_norm(x, self.in_norm, c.rms_norm_eps))
        q, k, v = qkv.split([nq * D, nkv * D, nkv * D], -1)
        q = q.unflatten(-1, (nq, D))
        k = k.unflatten(-1, (nkv, D))
        v = v.unflatten(-1, (nkv, D))
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # [..., T, 1, D]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x: [..., hidden] layer input; attn: [..., nq * D] -> predicted feature [..., hidden]."""
        h = x + self.o(attn)
        gate, up = self.gate_up(rms_norm(h, self.post_norm, self.cfg.rms_norm_eps)).chunk(2, -1)
        return h + self.down(F.silu(gate) * up)

    # ------------------------------------------------------------------ training: whole padded sequences

    def forward_train(
        self,
        feats: torch.Tensor,  # [B, T, hidden] target features f_0 .. f_{T-1}
        next_emb: torch.Tensor,  # [B, T, hidden] embeddings of t_1 .. t_T
    ) -> torch.Tensor:  # [B, T, hidden] predicted f_1 .. f_T
        """EAGLE-1's training forward: every pair from the target's true features (causal attention)."""
        return self.forward_ttt(feats, next_emb, steps=1)[0]

    def forward_ttt(
        self,
        feats: torch.Tensor,  # [B, T, hidden] target features f_0 .. f_{T-1}
        next_emb: torch.Tensor,  # [B, T, hidden] embeddings of t_1 .. t_T
        steps: int,
    ) -> list[torch.Tensor]:  # steps x [B, T, hidden]; [s-1][:, j] = f^_{j+s} (valid while j + s < T)
        """Training-time test (EAGLE-3, arXiv 2503.01840): unroll the drafting chain ``steps`` times.

        Why: drafting feeds the head its own predicted feature from the second draft on, and a head
        trained only on true features (plus small noise) meets inputs there it has never seen.
        A head trained that way accepted no second draft at all (docs/benchmarks.md).

        Step 1 is :meth:`forward_train`. At step ``s >= 2`` the chain anchored at true pair ``j``
        feeds ``[f^_{j+s-1} ; embed(t_{j+s})]`` at position ``j + s - 1``, and its query attends to
        the true pairs ``0 .. j`` and to the chain's own earlier pairs: exactly what the proposer's
        cache holds at that draft, given the earlier drafts were accepted (so the tokens are the
        true ones).
        """
        T = feats.shape[1]
        pos = torch.arange(T, device=feats.device)
        x = self.fc(torch.cat([feats, next_emb], -1))  # [B, T, hidden]
        cos, sin = self.rope(pos, x.dtype)
        q, k, v = self.qkv_proj(x, cos, sin)  # [B, T, n, D]
        keys, vals = [k.transpose(1, 2)], [v.transpose(1, 2)]  # [B, nkv, T, D] per step
        a = F.scaled_dot_product_attention(q.transpose(1, 2), keys[0], vals[0], is_causal=True, enable_gqa=True)
        preds = [self.finish(x, a.transpose(1, 2).flatten(-2))]
        causal = pos[None, :] <= pos[:, None]  # [T, T]: true pair i is visible to the chain anchored at j >= i
        diag = torch.eye(T, dtype=torch.bool, device=feats.device)  # a chain's own pairs: only its anchor's
        for s in range(2, steps + 1):
            emb = torch.zeros_like(next_emb)  # [B, T, hidden]: embed(t_{j+s}) at j
            emb[:, : T - (s - 1)] = next_emb[:, s - 1 :]
            x = self.fc(torch.cat([preds[-1], emb], -1))
            cos, sin = self.rope(pos + (s - 1), x.dtype)
            q, k, v = self.qkv_proj(x, cos, sin)
            keys.append(k.transpose(1, 2))
            vals.append(v.transpose(1, 2))
            mask = torch.cat([causal] + [diag] * (s - 1), 1)  # [T, s * T] over the true pairs, then each step's
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), torch.cat(keys, 2), torch.cat(vals, 2), attn_mask=mask, enable_gqa=True
            )  # [B, nq, T, D]
            preds.append(self.finish(x, a.transpose(1, 2).flatten(-2)))
        return preds


def save_head(head: EagleHead, out_dir: Path, dtype: torch.dtype = torch.float16) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    save_file(sd, str(out_dir / WEIGHTS_FILE))
    (out_dir / CONFIG_FILE).write_text(json.dumps(head.cfg.model_dump(), indent=1) + "\n")


def load_head(path: str | Path) -> EagleHead:
    """Load a head saved by :func:`save_head` (weights come back in fp32)."""
    from safetensors.torch import load_file

    from workers.model_loader import resolve_local_dir

    p = resolve_local_dir(str(path))
    if not (p / CONFIG_FILE).exists():
        raise FileNotFoundError(f"{p} is not an EAGLE head directory (no {CONFIG_FILE})")
    cfg = EagleConfig.model_validate_json((p / CONFIG_FILE).read_text())
    head = EagleHead(cfg)
    sd = load_file(str(p / WEIGHTS_FILE))
    head.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in sd.items()})
    return head.eval()


def head_config_for(target_cfg, draft_vocab_size: int) -> EagleConfig:
    """The head's shape for a HF Llama target config."""
    rope = getattr(target_cfg, "rope_parameters", None) or {}
    return EagleConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=float(rope.get("rope_theta", getattr(target_cfg, "rope_theta", 10000.0))),
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_num_layers=target_cfg.num_hidden_layers,
    )
