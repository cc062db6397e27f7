"""Draft worker: a Serve deployment that holds the draft model on its own resources.

One ``propose`` call per engine step carries every speculative request of that step
(batched forward on the draft), whichever target replica sent it. Per-request KV lives in
the DraftModelProposer, keyed by request id; see deployments/remote_draft.py for the
protocol that keeps it consistent with the target. State that no call has touched for
``draft.state_ttl_s`` (its target replica died, or a release was lost) is swept; a live
request that was only idle resyncs on its next call, so sweeping never changes output.
The proposers' KV is paged: pools sized by ``draft.kv_cache_memory_gb`` (see draft_kv_blocks).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeAlias

from opentelemetry.metrics import Observation
from ray import serve

from cluster.config import AppConfig
from cluster.telemetry import Telemetry
from workers.kv_blocks import kv_bytes_per_token, pool_blocks
from workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from workers.proposers.base import ProposalRequest
    from workers.proposers.draft_model import DraftModelProposer
    from workers.proposers.eagle import EagleProposer

    DraftProposer: TypeAlias = DraftModelProposer | EagleProposer  # the proposers a draft worker holds

log = logging.getLogger("ray.serve")


def draft_kv_blocks(
    budget_gb: float, bytes_per_token: list[int], block_size: int, max_model_len: int, max_seqs: int
) -> int:
    """Blocks of each draft KV pool: ``budget_gb`` holds the same number of tokens in every pool (one per
    proposer, ``bytes_per_token`` each), capped at what ``max_seqs`` requests of ``max_model_len`` can use.
    A budget under one full-length request is a deploy error naming the key: that request would never draft."""
    return pool_blocks(budget_gb, sum(bytes_per_token), block_size, max_model_len, max_seqs, "draft.kv_cache_memory_gb")


def _observe(read: Callable[[], float]) -> Callable[[Any], list[Observation]]:
    """An observable gauge's callback: one observation of ``read()`` at each collection."""
    return lambda _options: [Observation(read())]


@serve.deployment(name="DraftWorker")
class DraftWorker:
    def __init__(self, app_config: dict) -> None:
        # torch and the models load here, in the replica: `serve deploy` imports this module only to
        # build the app graph, and that build then takes a second instead of several.
        import torch

        from workers.eagle_head import load_head
        from workers.model_loader import load_model
        from workers.proposers.draft_model import DraftModelProposer
        from workers.proposers.eagle import EagleProposer

        cfg = AppConfig.model_validate(app_config)
        d = cfg.draft
        if d.num_threads:
            torch.set_num_threads(d.num_threads)

        target = load_model(cfg.engine.model)
        loaded = target if d.model == "target" else load_model(d.model)
        head = load_head(d.eagle) if d.eagle else None
        elt = torch.tensor([], dtype=getattr(torch, d.dtype)).element_size()
        mc = loaded.model.config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        # (name, KV bytes per token of its pool, its constructor less the pool arguments every proposer takes)
        makers: list[tuple[str, int, Callable[..., DraftProposer]]] = [
            (
                "draft_model",
                kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, head_dim, elt),
                partial(
                    DraftModelProposer,
                    loaded.model,
                    target_vocab_size=target.model.config.vocab_size,
                    vocab_ids=loaded.draft_vocab,
                    native_kernels=d.native_kernels,
                    cpu_gemm=d.cpu_gemm,
                ),
            ),
        ]
        if head is not None:  # drafts from the target's hidden states, which each call carries; one layer
            hc = head.cfg
            per_token = kv_bytes_per_token(1, hc.num_key_value_heads, hc.head_dim, elt)
            makers.append(("eagle", per_token, partial(EagleProposer, head, target.model)))
        bs, max_len = cfg.engine.block_size, cfg.engine.max_model_len
        num_blocks = draft_kv_blocks(d.kv_cache_memory_gb, [b for _, b, _ in makers], bs, max_len, d.max_num_seqs)
        self.proposers: dict[str, DraftProposer] = {
            name: make(
                num_slots=d.max_num_seqs,
                max_model_len=max_len,
                dtype=d.dtype,
                device=d.device,
                num_blocks=num_blocks,
                block_size=bs,
            )
            for name, _, make in makers
        }
        self._hidden: dict[str, torch.Tensor] = {}  # eagle requests: [len(known) - 1, hidden] fp16
        self._known: dict[str, list[int]] = {}
        self._last_seen: dict[str, float] = {}  # request id -> time.monotonic() of its last call
        self._lock = threading.Lock()  # Serve may run sync methods on a thread pool
        self.num_calls = 0
        self.num_swept = 0
        self.state_ttl_s = d.state_ttl_s
        self._init_metrics(cfg)
        threading.Thread(target=self._sweep_loop, name="draft-state-sweeper", daemon=True).start()

    def _forget(self, rid: str) -> None:
        self._known.pop(rid, None)
        self._last_seen.pop(rid, None)
        self._hidden.pop(rid, None)
        for prop in self.proposers.values():
            prop.finish(rid, [])

    def release(self, released: list[str]) -> None:
        """The target finished or cancelled these requests: free their draft KV now."""
        with self._lock:
            for rid in released:
                self._forget(rid)

    def _sweep_loop(self) -> None:
        while True:
            time.sleep(min(5.0, self.state_ttl_s / 2))
            with self._lock:
                now = time.monotonic()
                for rid in [r for r, t in self._last_seen.items() if now - t > self.state_ttl_s]:
                    self._forget(rid)
                    self.num_swept += 1

    def propose(self, batch: list[dict[str, Any]], released: list[str]) -> list[dict[str, Any]]:
        import torch  # loaded since __init__: a dictionary lookup

        from workers.proposers.base import ProposalRequest

        with self._lock:
            for rid in released:
                self._forget(rid)
            now = time.monotonic()
            answers: list[dict[str, Any] | None] = [None] * len(batch)
            by_method: dict[str, tuple[list[ProposalRequest], list[int]]] = {}
            free = {name: p.num_slots - p.num_active for name, p in self.proposers.items()}
            for i, m in enumerate(batch):
                method = m.get("proposer", "draft_model")
                prop = self.proposers.get(method)
                if prop is None:  # no such proposer here (no EAGLE head configured): plain step
                    answers[i] = {"draft_token_ids": [], "draft_probs": None}
                    continue
                rid = m["request_id"]
                known = self._known.get(rid, [])
                if m["offset"] != len(known):  # we lost this request's state (restart): ask for everything
                    self._forget(rid)
                    answers[i] = {"resync": True}
                    continue
                known = known + m["new_tokens"]
                hidden = None
                # rows for positions len(old known) - 1 .. len(known) - 2 arrive with the call
                if prop.needs_hidden_states:
                    old = self._hidden.get(rid)
                    hidden = m["hidden"] if old is None else torch.cat([old, m["hidden"]])
                    if hidden.shape[0] != len(known) - 1:
                        self._forget(rid)
                        answers[i] = {"resync": True}
                        continue
                    self._hidden[rid] = hidden
                self._known[rid] = known
                self._last_seen[rid] = now
                if not prop.has(rid):
                    if free[method] <= 0:  # every draft slot is taken: this request runs plain this step
                        answers[i] = {"draft_token_ids": [], "draft_probs": None}
                        continue
                    free[method] -= 1
                reqs, idx = by_method.setdefault(method, ([], []))
                reqs.append(
                    ProposalRequest(
                        request_id=rid,
                        token_ids=known,
                        num_prompt_tokens=m["num_prompt_tokens"],
                        k=m["k"],
                        eos_token_ids=frozenset(m["eos_token_ids"]),
                        sampling=SamplingParams(**m["sampling"]),
                        hidden_states=hidden,
                        coupled=bool(m.get("coupled", False)),
                    )
                )
                idx.append(i)
            for method, (reqs, idx) in by_method.items():
                props = self.proposers[method].propose(reqs)
                for j, i in enumerate(idx):
                    p = props.draft_probs[j]
                    answers[i] = {
                        "draft_token_ids": props.draft_token_ids[j],
                        "draft_probs": None if p is None else p.cpu(),
                    }
            self.num_calls += 1
            return answers  # type: ignore[return-value]

    def _init_metrics(self, cfg: AppConfig) -> None:
        ctx = serve.get_replica_context()
        self.telemetry = Telemetry(cfg.telemetry, "draft", ctx.replica_id.unique_id if ctx else "draft")
        m = self.telemetry.meter
        m.create_observable_counter(
            "specserve_draft_calls",
            callbacks=[lambda _o: [Observation(self.num_calls)]],
            description="Batched propose calls served by the draft worker.",
        )
        m.create_observable_counter(
            "specserve_draft_swept_requests",
            callbacks=[lambda _o: [Observation(self.num_swept)]],
            description="Request states dropped after state_ttl_s without a call.",
        )

        def dm() -> DraftProposer:  # the gauges read the draft model's state and pool
            return self.proposers["draft_model"]

        gauges: list[tuple[str, Callable[[], float], str]] = [
            (
                "specserve_draft_active_requests",
                lambda: dm().num_active,
                "Requests holding draft model state (and KV blocks).",
            ),
            (
                "specserve_draft_kv_tokens_in_use",
                lambda: dm().kv_tokens_in_use,
                "Draft model KV cache tokens in use (committed tokens and fed drafts).",
            ),
            (
                "specserve_draft_kv_tokens_capacity",
                lambda: dm().blocks.tokens_capacity,
                "Tokens the draft model's KV pool holds (draft.kv_cache_memory_gb).",
            ),
            (
                "specserve_draft_kv_usage",
                lambda: dm().blocks.usage,
                "Fraction of the draft model's KV blocks held by requests (vLLM's kv_cache_usage_perc).",
            ),
        ]
        for name, read, desc in gauges:
            m.create_observable_gauge(name, callbacks=[_observe(read)], description=desc)

    def metrics_samples(self) -> list[dict[str, Any]]:
        """The draft worker's metric samples (plain dicts) for the ingress's ``/metrics``."""
        with self._lock:  # the gauges read proposer state that propose() mutates
            return self.telemetry.samples()

    def placement(self) -> dict[str, Any]:
        import os

        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def stats(self) -> dict[str, Any]:
        dm = self.proposers["draft_model"]
        return {
            "active": dm.num_active,
            "kv_tokens_in_use": dm.kv_tokens_in_use,
            "kv_tokens_capacity": dm.blocks.tokens_capacity,
            "kv_blocks_in_use": dm.blocks.num_used,
            "calls": self.num_calls,
            "known": len(self._known),
            "swept": self.num_swept,
        }
