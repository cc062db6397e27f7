"""EAGLE proposer: drafts with a one-layer head over the target's own features (arXiv 2401.15077).

The head (workers/eagle_head.py) reads pairs ``[f_j ; embed(t_{j+1})]`` and predicts ``f_{j+1}``;
the target's LM head (restricted to the head's draft vocabulary) turns it into the next draft
token. The engine passes the target's final-norm features of every committed position
(``ProposalRequest.hidden_states``, positions ``0 .. n-2`` for ``n`` committed tokens: the last
token has not been read by the target yet), because this proposer sets ``needs_hidden_states``.

Per request (keyed by id) the proposer keeps a block table in the head's own paged KV cache (one
layer; blocks held for the pairs it has, as the draft model proposer does, workers/kv_blocks.py
DraftBlocks) and ``n_true``: how many pairs at the front of that slot were computed from the target's *true*
features. Each step it

1. feeds the pairs ``j = n_true .. n-2`` (the features committed since the last call; at the first
   call, the whole prompt) in one ragged batch: the last row predicts ``f_{n-1}``, whose LM-head
   argmax (greedy) or sample (``q``, same temperature / top-k / top-p as the target) is draft 0;
2. feeds ``[f^_{n-2+i} ; embed(d_{i-1})]`` at position ``n-2+i`` for drafts ``i = 1 .. k-1``, its own
   predicted feature and draft token, like EAGLE's autoregressive drafting (a chain, no tree).

Pairs built from predicted features sit past ``n_true`` and are overwritten by the next call
(rejected drafts roll back by moving ``n_true``, like the target's KV). Committed tokens never change,
so no feedback from the verifier is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from workers.eagle_head import EagleHead, load_head
from workers.kv_blocks import DraftBlocks
from workers.proposers.base import ProposalRequest, Proposals, Proposer, coupled_key, draw_drafts, stack_draft_probs
from workers.proposers.draft_model import DRAFT_SEED_SALT
from workers.sampler import make_generator
from workers.sampling_params import SamplingParams


@dataclass
class _EagleState:
    n_true: int = 0  # pairs 0 .. n_true-1 in the request's blocks were built from the target's true features
    generator: torch.Generator | None = None
    generator_ready: bool = False


class EagleProposer(Proposer):
    """Proposes with an EAGLE head over the target's hidden states.

    Args:
        head: an :class:`EagleHead`, or the directory it was saved to (models/smollm2-eagle).
        target_model: the target HF model: its embedding and LM head (frozen) are read from it.
        num_slots, max_model_len: requests with head KV at once (more get no drafts), and their longest sequence.
        num_blocks, block_size: the head's KV pool, shared by every request; None sizes it for
            ``num_slots`` requests of ``max_model_len``.
        dtype, device: of the head's weights and cache (``device="auto"``: CUDA when present).
    """

    name = "eagle"
    needs_hidden_states = True

    def __init__(
        self,
        head: EagleHead | str,
        target_model,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "auto",
        num_blocks: int | None = None,
        block_size: int = 16,
    ) -> None:
        from workers.runner import pick_device

        if num_slots < 1 or max_model_len < 2:
            raise ValueError(f"num_slots must be >= 1 and max_model_len >= 2, got {num_slots}, {max_model_len}")
        if isinstance(dtype, str):
            dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.device = pick_device(device) if isinstance(device, str) else device
        self.dtype = dtype
        h = load_head(head) if isinstance(head, str) else head
        tcfg = target_model.config
        if h.cfg.hidden_size != tcfg.hidden_size or h.cfg.vocab_size != tcfg.vocab_size:
            raise ValueError(
                f"EAGLE head (hidden {h.cfg.hidden_size}, vocab {h.cfg.vocab_size}) does not fit the target "
                f"(hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size})"
            )
        self.head = h.to(device=self.device, dtype=dtype).eval()
        self.head.d2t = h.d2t.to(device=self.device, dtype=torch.long)
        self.cfg = h.cfg
        self.vocab_size = int(tcfg.vocab_size)
        self.embed = target_model.model.embed_tokens.weight.detach().to(self.device, dtype)  # [V, hidden]
        lm = target_model.lm_head.weight.detach()  # [V, hidden] (tied with embed for SmolLM2)
        self.lm_rows = lm[self.head.d2t.cpu()].to(self.device, dtype).contiguous()  # [V_draft, hidden]
        self.lm_rows_t = self.lm_rows.t().contiguous()  # [hidden, V_draft]: the fast layout for one row on CPU
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        c = self.cfg
        if num_blocks is None:
            num_blocks = num_slots * -(-max_model_len // block_size)
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.blocks = DraftBlocks(num_blocks, block_size)
        shape = (num_blocks, c.num_key_value_heads, block_size, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)  # [num_blocks, nkv, BS, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self._states: dict[str, _EagleState] = {}

    # ------------------------------------------------------------------ state

    @property
    def num_active(self) -> int:
        return len(self._states)

    @property
    def kv_tokens_in_use(self) -> int:
        return sum(st.n_true for st in self._states.values())

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def finish(self, request_id: str, token_ids: Sequence[int] = ()) -> None:
        self._states.pop(request_id, None)
        self.blocks.free(request_id)

    def reset(self, request_id: str) -> None:
        st = self._states.get(request_id)
        if st is not None:
            st.n_true = 0

    # ------------------------------------------------------------------ the head's forward over ragged rows

    @torch.inference_mode()
    def _forward(
        self,
        tables: list[list[int]],  # per request: its blocks, position p in table[p // block_size]
        starts: list[int],  # position of each request's first new pair
        feats: torch.Tensor,  # [T, hidden] features of the new pairs, requests concatenated
        tokens: torch.Tensor,  # [T] the next token of each pair
        counts: list[int],  # new pairs per request (sum = T)
    ) -> torch.Tensor:  # [num_requests, hidden] predicted feature at each request's last new pair
        hd = self.head
        positions = torch.tensor([s + i for s, n in zip(starts, counts) for i in range(n)], device=self.device)
        x = hd.fc(torch.cat([feats, self.embed[tokens]], -1))  # [T, hidden]
        cos, sin = hd.rope(positions, x.dtype)
        q, k, v = hd.qkv_proj(x, cos, sin)  # [T, nq, D], [T, nkv, D], [T, nkv, D]
        attn_out = []
        off = 0
        BS, nkv, D = self.blocks.block_size, self.k_cache.shape[1], self.k_cache.shape[3]
        for table, s, n in zip(tables, starts, counts):
            kv_len = s + n
            bt = torch.tensor(table[: -(-kv_len // BS)], dtype=torch.long, device=self.device)  # [nb]
            pos = positions[off : off + n]
            self.k_cache[bt[pos // BS], :, pos % BS] = k[off : off + n]  # [n, nkv, D] at (block, :, offset)
            self.v_cache[bt[pos // BS], :, pos % BS] = v[off : off + n]
            # one layer: only the last pair's output is needed, and it attends to every pair so far (no mask)
            a = F.scaled_dot_product_attention(
                q[off + n - 1 : off + n].transpose(0, 1).unsqueeze(0),  # [1, nq, 1, D]
                self.k_cache[bt].transpose(0, 1).reshape(1, nkv, -1, D)[:, :, :kv_len],  # [1, nkv, kv_len, D]
                self.v_cache[bt].transpose(0, 1).reshape(1, nkv, -1, D)[:, :, :kv_len],
                enable_gqa=True,
            )  # [1, nq, 1, D]
            attn_out.append(a[0, :, 0])  # [nq, D]
            off += n
        last = torch.tensor([sum(counts[: i + 1]) - 1 for i in range(len(counts))], device=self.device)
        return hd.finish(x[last], torch.stack(attn_out).flatten(1))  # [R, hidden]

    def _logits(self, f: torch.Tensor) -> torch.Tensor:  # f: [R, hidden] -> [R, V_draft] float32
        if f.shape[0] == 1 and self.device.type == "cpu":
            return (f @ self.lm_rows_t).float()
        return F.linear(f, self.lm_rows).float()

    # ---------------------------------------------------------------- propose

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        drafts: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]
        rows: list[int] = []
        k_of: list[int] = []
        for i, r in enumerate(requests):
            n = len(r.token_ids)
            if r.hidden_states is None or r.hidden_states.shape[0] < n - 1:
                raise ValueError(
                    f"request {r.request_id!r}: the eagle proposer needs the target's hidden states "
                    f"of its {n - 1} committed positions"
                )
            k_of.append(max(0, min(r.k, self.max_model_len - n)))
            if k_of[i] > 0 and n >= 2:
                rows.append(i)
        # Requests beyond num_slots and those the pool cannot hold now get no drafts (DraftBlocks).
        free = self.num_slots - len(self._states)
        admitted = []
        for i in rows:
            if requests[i].request_id in self._states or free > 0:
                free -= requests[i].request_id not in self._states
                admitted.append(i)
        # Positions fed: the n - 1 committed pairs, then one pair per draft but the last.
        n_of = {i: len(requests[i].token_ids) for i in admitted}
        covered = self.blocks.reserve([(requests[i].request_id, n_of[i] - 1, n_of[i] + k_of[i] - 2) for i in admitted])
        rows = []
        for i, c in zip(admitted, covered):
            rid = requests[i].request_id
            if c == 0:
                self._states.pop(rid, None)  # its blocks went back to the pool: it re-prefills later
                continue
            k_of[i] = min(k_of[i], c - n_of[i] + 2)
            self._states.setdefault(rid, _EagleState())
            rows.append(i)
        states = {i: self._states[requests[i].request_id] for i in rows}

        # Step 0: the pairs committed since the last call (at least the last one, re-fed if nothing is new).
        tables = {i: self.blocks.tables[requests[i].request_id] for i in rows}
        starts, counts, feats = [], [], []
        toks: list[int] = []
        for i in rows:
            r, st = requests[i], states[i]
            assert r.hidden_states is not None, "the engine passes EAGLE's requests their hidden states"
            n = len(r.token_ids)
            s = min(st.n_true, n - 2)
            starts.append(s)
            counts.append(n - 1 - s)
            feats.append(r.hidden_states[s : n - 1])  # [n-1-s, hidden] f_s .. f_{n-2}
            toks.extend(r.token_ids[s + 1 : n])  # t_{s+1} .. t_{n-1}
            st.n_true = n - 1
        pos_next = {i: len(requests[i].token_ids) - 1 for i in rows}  # position of the next pair to feed
        f_prev: torch.Tensor | None = None
        while rows:
            if f_prev is None:
                f = self._forward(
                    [tables[i] for i in rows],
                    starts,
                    torch.cat(feats).to(self.device, self.dtype),
                    torch.tensor(toks, device=self.device),
                    counts,
                )
            else:
                f = self._forward(
                    [tables[i] for i in rows],
                    [pos_next[i] for i in rows],
                    f_prev,
                    torch.tensor([drafts[i][-1] for i in rows], device=self.device),
                    [1] * len(rows),
                )
                for i in rows:
                    pos_next[i] += 1
            chosen, q = self._select(
                self._logits(f),
                [requests[i].sampling for i in rows],
                [states[i] for i in rows],
                [coupled_key(requests[i], len(drafts[i])) for i in rows],
            )
            still, keep = [], []
            for j, i in enumerate(rows):
                if chosen[j] in requests[i].eos_token_ids:
                    continue  # never propose EOS: the target decides whether to stop
                drafts[i].append(chosen[j])
                if (q_j := q[j]) is not None:
                    q_rows[i].append(q_j)
                if len(drafts[i]) < k_of[i] and pos_next[i] < self.max_model_len:
                    still.append(i)
                    keep.append(j)
            rows = still
            f_prev = f[keep] if keep else None

        return Proposals(
            draft_token_ids=drafts, draft_probs=stack_draft_probs(requests, q_rows, self.vocab_size, self.device)
        )

    def _select(
        self,
        logits: torch.Tensor,  # [n, V_draft] float32 over the draft vocabulary
        params: list[SamplingParams],
        states: list[_EagleState],
        keys: list[int | None],  # per row: coupled_key (None: draw from the draft's own stream)
    ) -> tuple[list[int], list[torch.Tensor | None]]:  # target token id per row; q row [V] (None for greedy)
        d2t = self.head.d2t
        chosen = d2t[logits.argmax(-1)]  # [n] target ids
        q_out: list[torch.Tensor | None] = [None] * len(params)
        sampled = [j for j, sp in enumerate(params) if not sp.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            full = logits.new_full((len(sampled), self.vocab_size), float("-inf"))  # [S, V]: q is 0 off the draft vocab
            full[:, d2t] = logits[idx]
            picked, sent = draw_drafts(
                full,
                list(range(len(sampled))),
                [params[j] for j in sampled],
                [keys[j] for j in sampled],
                lambda a: self._generator(states[sampled[a]], params[sampled[a]]),
            )
            for a, q in sent.items():
                q_out[sampled[a]] = q  # [V] q: the draft's processed probabilities
            chosen[idx] = torch.tensor(picked, device=logits.device)
        return chosen.tolist(), q_out

    def _generator(self, st: _EagleState, sp: SamplingParams) -> torch.Generator | None:
        if not st.generator_ready:
            st.generator = make_generator(None if sp.seed is None else sp.seed ^ DRAFT_SEED_SALT, self.device)
            st.generator_ready = True
        return st.generator
