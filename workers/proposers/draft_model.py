"""Draft-model proposer: a small LM of the target's family guesses the next K tokens.

Speculative sampling (Leviathan et al. 2023, arXiv 2211.17192; Chen et al. 2023,
arXiv 2302.01318): the draft model runs K cheap autoregressive steps, and the
target verifies all K guesses in one forward pass. For sampled requests the
draft token ``x_j`` is drawn from ``q_j = process_logits(draft_logits_j)`` with
the request's own temperature / top-k / top-p, and ``q_j`` is returned so the
rejection sampler can accept with ``min(1, p_j(x_j) / q_j(x_j))``. Greedy
requests take the draft's argmax and return no ``q`` (one-hot).

State per request (keyed by request id): a block table in the draft's own paged
KV cache (:class:`workers.runner.ModelRunner` over a pool of ``num_blocks``
blocks, :class:`workers.kv_blocks.DraftBlocks`) and the list of tokens whose
keys/values those blocks hold. A request holds blocks for the positions it has
(committed tokens plus the drafts it feeds), growing block by block, so memory
follows the tokens in use, not ``num_slots x max_model_len``; when the pool runs
short a request gets fewer or no drafts (its output is unchanged, see
DraftBlocks). Each step the proposer feeds only what the cache lacks:

* committed tokens never change, and draft tokens the target rejected must be
  rolled back, so the reusable part of the cache is the longest common prefix
  (LCP) of the cached tokens and ``token_ids``. The LCP needs no feedback from
  the verifier (``observe`` is not needed), so a lost or late feedback message
  can never corrupt the cache. Stale entries past the LCP are simply
  overwritten by the next write at those positions.
* one batched, ragged forward feeds every request's ``token_ids[lcp:]`` (at
  least its last committed token) and yields draft 0 at each request's last
  row; then ``max(k) - 1`` batched single-token forwards feed the previous
  draft. Requests that reached their ``k`` (or an EOS) drop out of later
  forwards.

Per-request random draws come from a draft generator seeded with
``seed ^ DRAFT_SEED_SALT`` (independent of the target's generator, which the
rejection sampler owns), so a seeded request proposes the same drafts whatever
else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from workers.kv_blocks import DraftBlocks
from workers.proposers.base import ProposalRequest, Proposals, Proposer, coupled_key, draw_drafts, stack_draft_probs
from workers.sampler import make_generator
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:  # the runner imports transformers (~3 s); load it only when a proposer is built
    from transformers import PreTrainedModel

    from workers.runner import ModelRunner

# XORed into a request's seed for its draft generator, so draft draws and the
# target's draws (seeded with the plain seed) are different streams.
DRAFT_SEED_SALT = 0x5EED


def common_prefix_len(cached: list[int], token_ids: list[int], hint: int = 0) -> int:
    """Length of the longest common prefix of two token lists.

    ``hint`` is a length the caller believes is already common (the committed
    tokens seen last step); it is checked with one C-speed slice compare and
    only the tail after it is scanned in Python, so a step costs O(k), not
    O(sequence length), of interpreter work. A wrong hint falls back to a scan
    from 0.
    """
    n = min(len(cached), len(token_ids))
    i = min(hint, n)
    if cached[:i] != token_ids[:i]:
        i = 0
    while i < n and cached[i] == token_ids[i]:
        i += 1
    return i


@dataclass
class _DraftState:
    """One request's share of the draft model."""

    cached: list[int] = field(default_factory=list)  # tokens whose KV is in the request's blocks, position = index
    num_committed: int = 0  # len(token_ids) at the last propose: a known-common prefix of `cached`
    generator: torch.Generator | None = None
    generator_ready: bool = False  # created on first sampled use (None when unseeded)


class DraftModelProposer(Proposer):
    """Proposes with a small Llama-family LM that has its own KV cache.

    Args:
        model: the draft LM (HF ``PreTrainedModel``, Llama family); its weights
            are copied into a :class:`~workers.runner.ModelRunner`.
        num_slots: how many requests can hold draft state at once (more get no drafts).
        max_model_len: longest sequence (prompt + output) the draft cache holds;
            drafts are cut so that ``len(token_ids) + k <= max_model_len``.
        num_blocks, block_size: the draft's KV pool, shared by every request; None
            sizes it for ``num_slots`` requests of ``max_model_len`` (never short).
        dtype, device: of the draft's weights and cache (``device="auto"``:
            CUDA when present). ``dtype`` may be a ``torch.dtype`` or its name.
        target_vocab_size: when given, must equal the draft's vocabulary size:
            draft token ids are target token ids, and ``q`` must have the same
            width as the target's ``p``.
        vocab_ids: draft only among these token ids (``LoadedModel.draft_vocab``: the
            vocabulary a trained draft was distilled on). Why: rows of the tied LM head
            that the distillation never trained can win the argmax and lower the
            agreement with the target, and the head over the draft vocabulary instead
            of all 49152 rows saves most of the draft's per-token cost. ``q`` stays full-width, 0 outside ``vocab_ids``,
            so the rejection sampler's guarantee is untouched.
        native_kernels, cpu_gemm: the draft runner's native attention and row-wise ops, and its weight GEMMs
            (``ModelRunner``'s). With both native on the CPU its whole forward is one native call, as the
            target's is. They round differently from torch's ops, which may change a draft, never the output.
            The defaults keep torch's ops (the tests' reference); the draft worker passes its config's.
    """

    name = "draft_model"

    def __init__(
        self,
        model: PreTrainedModel,
        num_slots: int,
        max_model_len: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "auto",
        target_vocab_size: int | None = None,
        vocab_ids: Sequence[int] | None = None,
        num_blocks: int | None = None,
        block_size: int = 16,
        native_kernels: bool = False,
        cpu_gemm: str = "onednn",
    ) -> None:
        from workers.runner import ModelRunner

        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        if max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
        draft_vocab = int(model.config.vocab_size)
        if target_vocab_size is not None and int(target_vocab_size) != draft_vocab:
            raise ValueError(
                f"draft vocabulary {draft_vocab} != target vocabulary {int(target_vocab_size)}: "
                "the draft must share the target's tokenizer"
            )
        if isinstance(dtype, str):
            resolved = getattr(torch, dtype, None)
            if not isinstance(resolved, torch.dtype):
                raise ValueError(f"unknown dtype {dtype!r}")
            dtype = resolved
        self.runner: ModelRunner = ModelRunner(
            model,
            num_slots,
            max_model_len,
            dtype=dtype,
            device=device,
            head_rows=vocab_ids,
            num_blocks=num_blocks,
            block_size=block_size,
            native_kernels=native_kernels,
            cpu_gemm=cpu_gemm,
        )
        self.blocks = DraftBlocks(self.runner.num_blocks, block_size)
        self.vocab_size = draft_vocab
        # [V_draft] the full-vocabulary id of each logit column, or None when the head is whole
        self._vocab_ids = None if vocab_ids is None else torch.as_tensor(list(vocab_ids), device=self.runner.device)
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self._states: dict[str, _DraftState] = {}

    # ------------------------------------------------------------------ state

    @property
    def num_active(self) -> int:
        """Requests holding draft state (and KV blocks)."""
        return len(self._states)

    def has(self, request_id: str) -> bool:
        """Whether the request holds draft state."""
        return request_id in self._states

    @property
    def kv_tokens_in_use(self) -> int:
        """Tokens whose keys/values sit in the draft cache, over all requests."""
        return sum(len(st.cached) for st in self._states.values())

    def finish(self, request_id: str, token_ids: Sequence[int] = ()) -> None:
        """Free the request's blocks and state (unknown ids are ignored)."""
        self._states.pop(request_id, None)
        self.blocks.free(request_id)

    def reset(self, request_id: str) -> None:
        """Forget the request's cached KV (the next propose re-prefills it); its blocks
        and the draft generator's stream are kept."""
        st = self._states.get(request_id)
        if st is not None:
            st.cached = []
            st.num_committed = 0

    def _generator(self, st: _DraftState, sp: SamplingParams) -> torch.Generator | None:
        if not st.generator_ready:
            seed = None if sp.seed is None else sp.seed ^ DRAFT_SEED_SALT
            st.generator = make_generator(seed, self.runner.device)
            st.generator_ready = True
        return st.generator

    # ---------------------------------------------------------------- propose

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        from workers.runner import StepBatch

        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate request ids in one propose call: {ids}")
        drafts: list[list[int]] = [[] for _ in requests]
        q_rows: list[list[torch.Tensor]] = [[] for _ in requests]  # sampled requests: [V] per draft

        # Cap k so the verify pass (len + k tokens) fits; requests with nothing to do get no forward.
        tokens_of: list[list[int]] = []
        k_of: list[int] = []
        for r in requests:
            tokens = list(r.token_ids)
            if not tokens:
                raise ValueError(f"request {r.request_id!r} has no tokens")
            tokens_of.append(tokens)
            k_of.append(max(0, min(r.k, self.max_model_len - len(tokens))))
        # Requests beyond num_slots and those the pool cannot hold now get no drafts (DraftBlocks).
        free = self.num_slots - len(self._states)
        rows = []
        for i in range(len(requests)):
            if k_of[i] > 0 and (requests[i].request_id in self._states or free > 0):
                free -= requests[i].request_id not in self._states
                rows.append(i)
        # Positions fed: the committed tokens, then every draft but the last.
        covered = self.blocks.reserve(
            [(requests[i].request_id, len(tokens_of[i]), len(tokens_of[i]) + k_of[i] - 1) for i in rows]
        )
        held = []
        for i, c in zip(rows, covered):
            rid = requests[i].request_id
            if c == 0:
                self._states.pop(rid, None)  # its blocks went back to the pool: it re-prefills later
                continue
            k_of[i] = min(k_of[i], c - len(tokens_of[i]) + 1)
            self._states.setdefault(rid, _DraftState())
            held.append(i)
        rows = held
        states = {i: self._states[requests[i].request_id] for i in rows}  # every row's, new ones included

        # Step 0: one ragged forward feeding what each request's cache lacks.
        tables = {i: self.blocks.tables[requests[i].request_id] for i in rows}
        starts, feeds = [], []
        for i in rows:
            st, tokens = states[i], tokens_of[i]
            lcp = common_prefix_len(st.cached, tokens, st.num_committed)
            lcp = min(lcp, len(tokens) - 1)  # always feed at least the last committed token
            starts.append(lcp)
            feeds.append(tokens[lcp:])
            st.cached = tokens  # a fresh list (copied above); drafts fed later are appended
            st.num_committed = len(tokens)
        step = 0
        while rows:
            if step == 0:
                batch = StepBatch(
                    [0] * len(rows),
                    starts,
                    feeds,
                    [[len(f) - 1] for f in feeds],
                    block_tables=[tables[i] for i in rows],
                )
            else:
                batch = StepBatch(
                    [0] * len(rows),
                    [len(states[i].cached) for i in rows],
                    [[drafts[i][-1]] for i in rows],
                    [[0] for _ in rows],
                    block_tables=[tables[i] for i in rows],
                )
                for i in rows:  # the previous draft is now in the cache
                    states[i].cached.append(drafts[i][-1])
            logits = self._full_width(
                self.runner.forward(batch).logits
            )  # [len(rows), V] at each request's last fed token
            tokens, q = self._select(
                logits,
                [requests[i].sampling for i in rows],
                [states[i] for i in rows],
                [coupled_key(requests[i], len(drafts[i])) for i in rows],
            )
            still = []
            for j, i in enumerate(rows):
                if tokens[j] in requests[i].eos_token_ids:
                    continue  # never propose EOS or past it: the target decides whether to stop
                drafts[i].append(tokens[j])
                if (q_j := q[j]) is not None:
                    q_rows[i].append(q_j)
                if len(drafts[i]) < k_of[i]:
                    still.append(i)
            rows = still
            step += 1

        return Proposals(
            draft_token_ids=drafts, draft_probs=stack_draft_probs(requests, q_rows, self.vocab_size, self.runner.device)
        )

    def _full_width(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V_draft] -> [n, V]``: logits over the draft vocabulary placed at their token ids, -inf elsewhere."""
        if self._vocab_ids is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))  # [n, V]
        full[:, self._vocab_ids] = logits
        return full

    def _select(
        self,
        logits: torch.Tensor,  # [n, V] float32 draft logits, row j belongs to params[j]
        params: list[SamplingParams],
        states: list[_DraftState],
        keys: list[int | None],  # per row: coupled_key (None: draw from the draft's own stream)
    ) -> tuple[list[int], list[torch.Tensor | None]]:  # draft token per row; q row [V] (None for greedy rows)
        """Greedy rows take the argmax; sampled rows draw from the processed ``q``."""
        chosen = logits.argmax(dim=-1)  # [n]
        q_out: list[torch.Tensor | None] = [None] * len(params)
        sampled = [j for j, sp in enumerate(params) if not sp.greedy]
        if sampled:
            picked, sent = draw_drafts(
                logits,
                sampled,
                [params[j] for j in sampled],
                [keys[j] for j in sampled],
                lambda a: self._generator(states[sampled[a]], params[sampled[a]]),
            )
            for a, q in sent.items():
                q_out[sampled[a]] = q  # [V] q: the draft's processed probabilities
            chosen[torch.tensor(sampled, device=logits.device)] = torch.tensor(picked, device=logits.device)
        return chosen.tolist(), q_out
