"""Plain stats objects: the engine fills them, exporters (metrics, usage, the policy) read them.

Vocabulary (vLLM's spec_decode metrics): a *draft* is one proposal for one request in one
step; *draft tokens* are the tokens proposed; *accepted tokens* exclude the recovered or
bonus token. Acceptance rate = accepted / draft tokens (in [0, 1], 0 when nothing was
proposed); mean acceptance length = 1 + accepted / drafts (tokens committed per verify).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K_max] accepted count at draft position i
    spec_steps: int = 0
    plain_steps: int = 0
    # of the draft / accepted tokens above, those the grammar forced (structured output), not a proposer's
    num_grammar_draft_tokens: int = 0
    num_grammar_accepted_tokens: int = 0

    def record_grammar(self, num_forced: int, num_accepted: int) -> None:
        """A verify whose first ``num_forced`` drafts were grammar-forced, ``num_accepted`` drafts accepted."""
        self.num_grammar_draft_tokens += num_forced
        self.num_grammar_accepted_tokens += min(num_forced, num_accepted)

    def record_verify(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens == 0:
            self.plain_steps += 1
            return
        self.spec_steps += 1
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos.extend([0] * (num_draft_tokens - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_pos": list(self.accepted_per_pos),
            "spec_steps": self.spec_steps,
            "plain_steps": self.plain_steps,
            "num_grammar_draft_tokens": self.num_grammar_draft_tokens,
            "num_grammar_accepted_tokens": self.num_grammar_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
        }


ACCEPTANCE_DECAY = 0.98  # per-sample forgetting of the acceptance estimates: ~100 verifies of memory


class RateEma:
    """A rate in [0, 1] from weighted samples, exponentially forgotten, anchored on a weak prior.

        value = (prior * w0 * decay^n + sum_i decay^(n-i) * x_i) / (w0 * decay^n + sum_i decay^(n-i) * w_i)

    Why not a plain EMA that starts at its first sample: the policy acts on acceptance from the
    first verify on, and a few rejected first drafts then read as "acceptance 0" and hold
    speculation off for good.
    Here the prior (weight ``prior_weight`` samples) fades as evidence arrives, and the
    normalisation keeps early estimates unbiased towards 0 (unlike an EMA started at 0).

    Why ``ACCEPTANCE_DECAY`` = 0.98 (~100 samples of memory) and not 0.9 (~10): the policy
    acts on the estimate, and an estimate that dips stops being corrected. Once a dip makes
    goodput choose K = 0, no verify feeds it except a probe per ``probe_interval_steps``, so a
    short memory parks a low-acceptance proposer at K = 0 where speculating still wins
    (docs/benchmarks.md, "Why the code is the way it is"). The memory is in samples, not
    steps, so a batch of 32 still forgets a workload shift within a few steps.
    """

    def __init__(self, prior: float = 0.5, prior_weight: float = 2.0, decay: float = ACCEPTANCE_DECAY) -> None:
        self.decay = decay
        self._num = prior * prior_weight
        self._den = prior_weight
        self.num_samples = 0

    def update(self, x: float, weight: float = 1.0) -> None:
        """Add ``x`` successes out of ``weight`` trials (a verify: accepted of drafted)."""
        self._num = self.decay * self._num + x
        self._den = self.decay * self._den + weight
        self.num_samples += 1

    @property
    def value(self) -> float:
        return self._num / self._den if self._den > 0 else 0.0


class PositionalAcceptance:
    """Conditional acceptance per draft position: ``[i]`` estimates P(draft i+1 accepted | 1..i accepted).

    Why not one rate: (1 - a^(K+1)) / (1 - a) assumes every position accepts independently at
    rate a. An n-gram draft is all-or-nothing (the copied span continues or it does not: later
    positions accept far more often than the first once it did), and the i.i.d. formula then
    undervalues it. With per-position rates the expected tokens of K drafts
    are 1 + sum_{i<=K} prod_{j<=i} alpha_j, which is the formula again when all alpha_j = a.
    Positions never reached are absent (the policy extends the last measured one).
    """

    def __init__(self) -> None:
        self.rates: list[RateEma] = []

    def update(self, num_draft: int, num_accepted: int) -> None:
        # positions 1..num_accepted were reached and accepted;
        # position num_accepted + 1 (if drafted) was reached and rejected
        for i in range(min(num_accepted + 1, num_draft)):
            while len(self.rates) <= i:
                self.rates.append(RateEma())
            self.rates[i].update(1.0 if i < num_accepted else 0.0)

    def values(self) -> list[float]:
        return [r.value for r in self.rates]


class AcceptanceTracker:
    """Per proposer, the three estimates the goodput policy reads; the engine feeds them.

    One object so that the engine and the policy's closed-loop simulation
    (tests/test_goodput_sim.py) keep the same books: a proposal updates the proposal rate
    (drafted of requested tokens), a verify updates the acceptance rate (accepted of drafted)
    and the per-position rates.
    """

    def __init__(self) -> None:
        self.rate: dict[str, RateEma] = collections.defaultdict(RateEma)
        self.positions: dict[str, PositionalAcceptance] = collections.defaultdict(PositionalAcceptance)
        self.proposal_rate: dict[str, RateEma] = collections.defaultdict(lambda: RateEma(prior=1.0))

    def on_proposal(self, proposer: str, num_drafted: int, num_requested: int) -> None:
        self.proposal_rate[proposer].update(num_drafted, num_requested)

    def on_verify(self, proposer: str, num_draft: int, num_accepted: int) -> None:
        self.rate[proposer].update(num_accepted, num_draft)
        self.positions[proposer].update(num_draft, num_accepted)

    def fill(self, snapshot: LoadSnapshot) -> LoadSnapshot:
        """Write the current estimates into ``snapshot`` (and return it)."""
        snapshot.acceptance_ema = {k: v.value for k, v in self.rate.items()}
        snapshot.acceptance_pos_ema = {k: v.values() for k, v in self.positions.items()}
        snapshot.proposal_rate_ema = {k: v.value for k, v in self.proposal_rate.items()}
        return snapshot


class Ema:
    """Exponential moving average that starts at its first sample (no warm-up bias)."""

    def __init__(self, alpha: float = 0.1, initial: float | None = None) -> None:
        self.alpha = alpha
        self.value = initial

    def update(self, x: float) -> float:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        return self.value


@dataclass
class LoadSnapshot:
    """Live load of one target engine, as the router and the policy see it."""

    running: int = 0  # requests holding a KV slot (prefilling or decoding)
    decoding: int = 0  # running requests past their prompt: the batch size that decides speculation
    waiting: int = 0  # admitted to the engine but waiting for a slot
    tokens_last_step: int = 0
    kv_tokens_in_use: int = 0
    kv_tokens_capacity: int = 0
    step_time_ema_s: float = 0.0
    tokens_per_step_ema: float = 0.0
    acceptance_ema: dict[str, float] = field(default_factory=dict)  # per proposer, acceptance rate EMA
    # per proposer: [i] = EMA of P(draft i+1 accepted | drafts 1..i accepted), for the positions seen so far
    acceptance_pos_ema: dict[str, list[float]] = field(default_factory=dict)
    # per proposer: EMA of drafted / requested tokens (n-gram finds no match on most open-chat steps)
    proposal_rate_ema: dict[str, float] = field(default_factory=dict)
    num_steps: int = 0
    # cumulative counters (rates come from two snapshots' difference over their timestamps)
    # requests handed to the engine (add_request calls, rejected ones too): with it the Router tells which of
    # the requests it sent this replica the snapshot's running + waiting already count
    handed: int = 0
    output_tokens: int = 0  # tokens committed to outputs
    spec_request_steps: int = 0  # decode request-steps that verified drafts
    plain_request_steps: int = 0  # decode request-steps without drafts
    timestamp: float = 0.0  # time.time() when taken
    dtype: str = ""  # the engine's resolved dtype ("float32" / "bfloat16")
    batch_invariant: bool = False  # whether its kernels make output a pure function of the request
    attention_kernel: str = ""  # "native" / "torch" (invariant, each its own rounding) or "sdpa" (not invariant)
    gemm_kernel: str = ""  # the weight GEMMs run: "onednn" / "mkl" / "native" (CPU) or "cuda"; each rounds its own way

    def as_dict(self) -> dict:
        return dict(self.__dict__)
