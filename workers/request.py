"""Per-request state inside the engine, and what the engine hands back each step."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from workers.decision import Speculation
from workers.detokenizer import IncrementalDetokenizer
from workers.sampling_params import SamplingParams
from workers.stats import SpecDecodeStats

if TYPE_CHECKING:  # the Router and the ingress import this module's types; they never need torch
    import torch

    from workers.grammar import Grammar


class StepEvent(NamedTuple):
    """One engine step of one request, recorded only for requests that asked (tracing on)."""

    t_start_ns: int  # time.time_ns() at the start of the step
    t_end_ns: int  # after the verify (or after the forward, for a prefill chunk)
    kind: str  # "prefill" (a prompt chunk; the last one also makes the first token) | "spec" | "plain"
    num_draft: int  # draft tokens verified this step (0 unless "spec")
    num_accepted: int  # of those, accepted (the recovered / bonus token not counted)
    t_proposed_ns: int  # when the proposer returned and the target forward began


class Status(enum.Enum):
    WAITING = "waiting"  # no KV blocks yet (new, or preempted: recomputed when admitted again)
    RUNNING = "running"  # holds KV blocks: prefilling or decoding
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """One step's worth of output for one request (a streaming chunk)."""

    request_id: str
    token_ids: list[int]  # [num_new] tokens committed this step (after stop/EOS truncation)
    text: str  # text delta for this step
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int
    num_output_tokens: int
    proposer: str | None
    spec: SpecDecodeStats  # per-request totals so far (usage.speculation)
    first_token_time: float | None = None
    arrival_time: float = 0.0
    seed: int = 0  # the request's noise seed (drawn at admission when it gave none): resubmit with it to continue
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused from another request (prefix caching)
    events: list[StepEvent] | None = None  # on the final output of a request added with record_events
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when the request asked for logprobs
    # with prompt_logprobs, on the first output: one per prompt token, None for the first (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log probability under the target and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    proposer: str | None
    speculation: Speculation
    detok: IncrementalDetokenizer
    generator: torch.Generator | None  # rejection verification's stream (seeded with ``seed``)
    eos_token_ids: frozenset[int]
    seed: int = 0  # params.seed, or drawn at admission: keys the noise of every output position
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is valid in the blocks (the rest of all_ids is pending)
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused at admission rather than computed
    # The paged KV cache (workers/kv_blocks.py): position p's KV lives in block block_table[p // block_size];
    # block_hashes[i] is the prefix-cache hash of full block i, for the committed full blocks entered so far.
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_preemptions: int = 0  # times its blocks were taken back and its KV recomputed later
    finish_reason: str | None = None
    first_token_time: float | None = None
    spec: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    events: list[StepEvent] | None = None  # per-step events, only when recording (tracing on)
    # [capacity, hidden] the target's final-norm hidden state at every position the target has read
    # (valid up to num_computed); kept only when the request's proposer needs_hidden_states (EAGLE)
    hidden: torch.Tensor | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled during prefill when params ask for them
    prompt_logprobs_sent: bool = False
    num_resumed: int = 0  # output tokens given at admission (a stream resumed on this engine): prefilled, not written
    grammar: Grammar | None = None  # params.structured's matcher, advanced over output_ids (workers/grammar.py)
    forced: list[int] = field(default_factory=list)  # this step's grammar-forced tokens (set when K is decided)

    @property
    def prefill_len(self) -> int:
        """Tokens fed before the first token this engine writes: the prompt, and any resumed output."""
        return len(self.prompt_ids) + self.num_resumed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, i: int) -> int:
        """``all_ids()[i]`` (0 <= i < num_tokens) without copying the context: a step asks this of every request."""
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def ids_between(self, a: int, b: int) -> list[int]:
        """``all_ids()[a:b]`` (0 <= a <= b) copying only those positions."""
        n = len(self.prompt_ids)
        if b <= n:
            return self.prompt_ids[a:b]
        return self.prompt_ids[a:n] + self.output_ids[max(a - n, 0) : b - n]

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prefill_len
