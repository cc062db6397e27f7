"""Who runs this step and how many tokens each request feeds: decode rows first, then prompt chunks
sized in *time* from the step-cost model.

A step's latency is every running stream's inter-token latency, so the scheduler gives each step a
time budget: ``target_itl_ms``, or ``itl_ratio`` times the predicted decode-only step of the same
batch. Decoding requests feed their pending token plus the drafts the routing policy asks for (K,
priced by the same cost model); prompt chunks take the time that is left, at the measured cost of
a prompt token. Prompts are served first come, first served, and a prompt that would miss
``max_ttft_ms`` at that pace takes what it needs to meet it (aging): its chunk is its remaining
prompt spread over the steps left before its deadline, so the budget is a soft bound that yields
to a prompt that has waited too long, never a cap that starves it.

Where this differs from the references. vLLM's chunked prefill fills a fixed *token* budget
(``max_num_batched_tokens``) with decode rows and then prompt chunks; the right budget depends on
the batch, the step cost and the latency the operator wants, so here the budget is a latency and
the token count follows from the measured costs. SmartSpec (arXiv 2406.14066) chooses K per step
from goodput with a linear batch-latency model; the policies here do that, and this scheduler
gives prompt chunks what the chosen K leaves within the step's latency budget. Speculation is
decided first: a verify's tokens are committed output for running streams, a prompt chunk only
brings a first token closer, and the TTFT deadline is what keeps prompts from waiting behind it.

KV memory is a pool of blocks (workers/kv_blocks.py). A waiting request is admitted, first come first
served, when the pool holds its whole prefill (less the cached prefix it shares) and, while others run,
still keeps a watermark of free blocks for their growth (vLLM's watermark: a request admitted into the
last free blocks would be the first preempted, its prefill wasted). A decoding request's table grows by
the blocks its pending token and its K drafts need (lookahead). When a decoding request cannot get a
block even for its pending token, the youngest running request is preempted: its blocks go back to the
pool and it waits at the head of the queue, to be recomputed (vLLM's recompute preemption; the
batch-invariant kernels make the recomputed KV, and so the output, exactly the same). Every pending
token gets its block before any draft gets one, and drafts are cut to what is free rather than
preempting anyone for them: drafts are optional, a preemption throws away a prefill.

Nothing here imports Ray or torch; the engine (workers/engine.py) runs what this returns.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from workers.cost_model import StepCostModel
from workers.kv_blocks import KVCacheManager
from workers.request import Request, Status

AGING_ROUNDS = 3  # fixed-point rounds for an aging prompt's chunk (chunk -> step time -> steps left -> chunk)
WATERMARK = 0.01  # share of the pool an admission leaves free while others run (vLLM's default watermark)


class SchedulerConfig(BaseModel):
    """How the engine trades first-token latency against the running streams' inter-token latency."""

    model_config = ConfigDict(extra="forbid")

    target_itl_ms: float | None = Field(
        None,
        gt=0,
        le=60_000,
        description="Most a step may take while requests decode, in ms: prompt chunks fill what the decode rows "
        "leave. None: itl_ratio times the predicted decode-only step of the same batch.",
    )
    itl_ratio: float = Field(
        1.5,
        ge=1.0,
        le=100.0,
        description="With target_itl_ms unset: a step with prompt chunks may take this multiple of the batch's "
        "decode-only step (1.0: prompts only advance through max_ttft_ms aging).",
    )
    max_ttft_ms: float = Field(
        1000.0,
        gt=0,
        le=3_600_000,
        description="Soft goal for the time from arrival to the first token: a prompt that would miss it at the "
        "ITL budget's pace takes bigger chunks, up to its whole remainder once its deadline is one step away.",
    )


@dataclass(frozen=True)
class PrefillDemand:
    """One prompt still being prefilled, as the chunk choice sees it."""

    remaining: int  # prompt tokens not yet fed
    waited_s: float  # since the request arrived


def prefill_chunks(
    demands: Sequence[PrefillDemand],
    budget_tokens: int,
    token_cap: int,
    step_time: Callable[[int], float],
    max_ttft_s: float,
) -> list[int]:
    """Tokens each prompt feeds this step, in the order given (first come, first served).

    ``budget_tokens``: what the step's latency budget leaves for prompts. ``token_cap``: the step's
    hard token limit left after the decode rows. ``step_time(n)``: predicted seconds of this step if
    it feeds ``n`` prompt tokens, to count the steps left before a prompt's TTFT deadline. A prompt
    takes what the budget still holds or, if more, ``ceil(remaining / steps_left)``: the pace that
    finishes it by its deadline, where a bigger chunk makes every step, and so the pace, slower (a
    few rounds of that fixed point).
    """
    chunks: list[int] = []
    taken = 0
    for d in demands:
        need = 0
        for _ in range(AGING_ROUNDS):
            left_s = max_ttft_s - d.waited_s
            steps_left = max(1, math.floor(left_s / max(step_time(taken + need), 1e-9)))
            need = -(-d.remaining // steps_left)
            if steps_left == 1:
                break
        c = max(0, min(d.remaining, max(budget_tokens, need), token_cap))
        budget_tokens = max(0, budget_tokens - c)
        token_cap -= c
        taken += c
        chunks.append(c)
    return chunks


@dataclass
class SchedulerOutput:
    """One step's plan: decoding requests with their K, prompt chunks with their length."""

    decode: list[tuple[Request, int]]  # (request, drafts asked for), in running order
    prefill: list[tuple[Request, int]]  # (request, prompt tokens fed this step), first come first served
    step_budget_s: float | None  # the latency budget the chunks were sized for (None: no one decoding)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)


class Scheduler:
    """Owns the queues and the requests' KV blocks; ``schedule`` says who feeds what this step.

    ``decide_k(decoding, token_cap)`` is the routing policy's K per decoding request (the engine
    clamps it to each request's room); ``may_read_cache(request)`` says whether an admitted request may
    start after the cached prefix of its prompt (the engine's rule: not when its proposer needs the
    target's hidden state at every prompt position, nor when it scores its prompt).
    """

    def __init__(
        self,
        config: SchedulerConfig,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cost_model: StepCostModel,
        decide_k: Callable[[list[Request], int], list[int]],
        kv: KVCacheManager,
        clock: Callable[[], float],
        may_read_cache: Callable[[Request], bool] = lambda r: True,
    ) -> None:
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.cost_model = cost_model
        self.decide_k = decide_k
        self.kv = kv
        self.may_read_cache = may_read_cache
        self.clock = clock  # the clock Request.arrival_time is read with (time.monotonic)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # in admission order: the last is the youngest
        self.num_preemptions = 0

    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def free(self, r: Request) -> None:
        """Take ``r`` out of the queues, and its blocks back if it held any."""
        if r.status is Status.WAITING:
            self.waiting.remove(r)
        elif r.status is Status.RUNNING:
            self.running.remove(r)
            self.kv.free(r)

    def preempt(self, r: Request) -> None:
        """Give ``r``'s blocks back and queue it first, to be recomputed: its output so far is fed as a
        resumed stream's is (prefilled after the prompt, never sent again), so the next token it writes
        comes from the same logits at the same output position as if it had never stopped."""
        self.running.remove(r)
        self.kv.free(r)
        if r.prompt_logprobs is not None and r.in_prefill:
            r.prompt_logprobs = [None]  # scored again from the first chunk
        r.num_computed = 0
        r.num_resumed = len(r.output_ids)
        r.status = Status.WAITING
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(r)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        self._admit()
        decoding = [r for r in self.running if not r.in_prefill]
        ks = self.decide_k(decoding, self.max_num_batched_tokens) if decoding else []
        decoding, ks = self._reserve(decoding, ks)
        decode_tokens = len(decoding) + sum(ks)
        prefilling = sorted((r for r in self.running if r.in_prefill), key=lambda r: r.arrival_time)
        if not prefilling:
            return SchedulerOutput(list(zip(decoding, ks)), [], None)
        cap = self.max_num_batched_tokens - decode_tokens
        cm = self.cost_model
        if decoding:  # running streams wait for this step: the prompt part gets the latency budget's rest
            if self.config.target_itl_ms is not None:
                budget_s = self.config.target_itl_ms / 1e3
            else:
                budget_s = self.config.itl_ratio * cm.predict_step(len(decoding), len(decoding))
            spare_s = budget_s - cm.predict_step(decode_tokens, len(decoding))
            budget_tokens = max(0, math.floor(spare_s / cm.prefill_per_token_s()))
        else:  # only prompts wait for this step
            budget_s, budget_tokens = None, cap
        now = self.clock()
        demands = [PrefillDemand(r.prefill_len - r.num_computed, now - r.arrival_time) for r in prefilling]
        chunks = prefill_chunks(
            demands,
            budget_tokens,
            cap,
            lambda n: cm.predict_step(decode_tokens, len(decoding), max(n, budget_tokens)),
            self.config.max_ttft_ms / 1e3,
        )
        prefill = [(r, n) for r, n in zip(prefilling, chunks) if n > 0]
        return SchedulerOutput(list(zip(decoding, ks)), prefill, budget_s)

    def _admit(self) -> None:
        """First come, first served: the head of the queue waits until the pool holds its prefill and, while
        others run, the watermark beside it. Alone, a request may take the whole pool (it never waits forever)."""
        watermark = max(1, math.ceil(WATERMARK * self.kv.num_blocks))
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self.kv.admit(r, r.prefill_len, self.may_read_cache(r), watermark if self.running else 0):
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            self.running.append(r)

    def _reserve(self, decoding: list[Request], ks: list[int]) -> tuple[list[Request], list[int]]:
        """Blocks for each decoding request's pending token, oldest first: one that cannot get its block
        preempts the youngest running request (itself, if it is the youngest) until it can. Then lookahead
        blocks for the drafts, oldest first, from what is left: drafts are cut to what is free, so no
        request's drafts ever cost another its place. A victim is always younger than the request that
        needs the block, so no request that got its block is preempted after."""
        for r in decoding:
            while r.status is Status.RUNNING and not self.kv.grow(r, r.num_computed + 1):
                self.preempt(self.running[-1])
        kept, kept_ks = [], []
        for r, k in zip(decoding, ks):
            if r.status is not Status.RUNNING:  # preempted for an older request this step
                continue
            k = max(0, min(k, self.kv.room(r) - r.num_computed - 1))  # lookahead for the drafts: what fits
            self.kv.grow(r, r.num_computed + 1 + k)
            kept.append(r)
            kept_ks.append(k)
        return kept, kept_ks
