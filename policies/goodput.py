"""``goodput`` (the default policy): pick K to maximize committed tokens per second.

SmartSpec (Liu et al. 2024, arXiv 2406.14066) chooses the speculation length each step
to maximize *goodput*, the tokens the batch commits per second, from an estimate of the
acceptance rate and a model of the step cost. Here, for a decode batch of B requests that
draft K tokens with per-token acceptance rate a:

    E[tokens](K, a) = (1 - a^(K+1)) / (1 - a)      # committed per verify (Leviathan et al.),
                                                    # K + 1 when a == 1, 1 when K == 0
    goodput(K)     = B * E[tokens](K, a) / time(B * (K + 1))

Two measured refinements, both reducing to the formula above when the measurement agrees
with its assumption:

- *Acceptance per position* (``snapshot.acceptance_pos_ema``): the formula assumes every
  draft position accepts independently at rate a. An n-gram draft is all-or-nothing (later
  positions accept far more often than the first once it did), which the formula
  undervalues; so E[tokens] = 1 + sum_{i<=K} prod_{j<=i} alpha_j over the
  measured conditional rates alpha_j (the last one extends to unmeasured positions).
- *Proposal rate* rho (``snapshot.proposal_rate_ema``, drafted / requested tokens): an n-gram
  proposer finds no match on most open-chat steps, and a request with no draft runs a plain
  step. Of B requests, j ~ Binomial(B, rho) draft, so tokens = B * (1 + rho * (E - 1)) and
  time = E_j[time(B + j * K)] (for B > 64, time(B + rho * B * K): the binomial is narrow).

with ``time`` the online linear step-cost model (workers/cost_model.py) that the engine
loop feeds through :meth:`Policy.observe_step`. Every K in [0, k_max] is evaluated; K is
uniform per proposer (acceptance is per proposer, from ``snapshot.acceptance_ema``, with
``prior_acceptance`` until a proposer has an EMA). A proposer whose *first* draft is accepted
less often than ``min_acceptance`` gets K = 0: the first position, because a verify gains
nothing unless draft 1 is accepted, and because the per-token rate of an all-or-nothing n-gram
draft shrinks with K, so a floor on it cut off a proposer that was winning whenever its estimate
dipped.

Hysteresis: the K chosen for a proposer changes only when the best K's goodput beats the
current K's by more than ``switch_margin`` (relative), so two K within noise of each other
do not make the path flap step by step. The margin is 2%, not more, because it is also the
loss goodput accepts by holding a K, which must stay within 3% of the better path
(tests/test_goodput_sim.py).

Exploring: a K whose step cost is unmeasured is predicted by the line and tried when it looks
best, which fills the cost table where it matters; the plain step's cost at the current batch
size, the baseline of every comparison, is measured first (a plain step or two per new batch
size) so that a line pulled up by costly verify steps cannot make plain look worse than it is.
Only when the call is close, though: where the line says speculation wins by more than
``BASELINE_MARGIN``, no plausible error in the plain estimate flips the decision, and the plain
steps would be pure loss (each ramp of the batch size through new values would pay them again).

Probing: acceptance is only observed on steps that speculate, so once a proposer is held at
K = 0 its acceptance EMA would freeze at the value that made it lose, and a workload that
turns copy-heavy later would never be noticed. After ``probe_interval_steps`` consecutive
K = 0 decisions for a proposer, *one request* of that step drafts ``probe_k`` tokens to refresh
the estimate. One request, not the batch: acceptance is a per-request sample either way, and a
whole-batch probe multiplies one step's tokens, a visible cost where speculation does not pay;
one request's probe adds ``probe_k`` tokens to one step.

The same blind spot exists above the chosen K: a verify of K drafts never reaches position K + 1,
so a position measured low early (a few samples, while the cost model was still unfitted) would
hold K below its best forever (tests/test_goodput_sim.py shows it on a copy-heavy cell). So after
``probe_interval_steps`` consecutive decisions of 0 < K < k_max, one request drafts k_max, which
refreshes the positions past K.
"""

from __future__ import annotations

import math
import time
from typing import Any, Literal, NamedTuple, Sequence

from pydantic import Field

from policies.base import Clock, Policy, PolicyConfigBase, batch_size
from workers.cost_model import StepCostModel
from workers.decision import SpecCandidate
from workers.stats import LoadSnapshot

BASELINE_TRIES = 4  # plain steps a batch size may spend measuring its own cost before the line is trusted
BASELINE_MARGIN = 1.5  # ... spent only when the line's best K is predicted to beat plain by less than this


class GoodputConfig(PolicyConfigBase):
    """Choose K per proposer to maximize expected committed tokens per second (SmartSpec-style)."""

    name: Literal["goodput"] = Field("goodput", description="Policy name.")
    prior_acceptance: float = Field(
        0.5, ge=0.0, le=1.0, description="Acceptance rate assumed for a proposer with no acceptance EMA yet."
    )
    min_acceptance: float = Field(
        0.05,
        ge=0.0,
        le=1.0,
        description="A proposer whose first draft position accepts less often than this never speculates.",
    )
    switch_margin: float = Field(
        0.02,
        ge=0.0,
        description="Relative goodput gain the best K must have over the current K before K changes (0.02 = 2%).",
    )
    prior_base_s: float = Field(
        0.05, gt=0.0, description="Step-cost prior: fixed seconds per engine step, used until the model is fitted."
    )
    prior_per_token_s: float = Field(
        0.003, ge=0.0, description="Step-cost prior: seconds per token fed to a step, used until the model is fitted."
    )
    cost_min_samples: int = Field(
        8, ge=2, description="Step measurements needed before the fitted cost model replaces the priors."
    )
    probe_interval_steps: int = Field(
        100,
        ge=0,
        description="After this many consecutive K = 0 steps for a proposer, one request of one step drafts "
        "probe_k tokens to re-measure its acceptance (0 = never probe).",
    )
    probe_k: int = Field(2, ge=1, description="Drafts per request on a probing step (clipped to k_max).")
    cost_decay: float = Field(
        0.98,
        gt=0.0,
        le=1.0,
        description="Per-sample forgetting factor of the cost model's weighted least squares (1 = never forget).",
    )


def expected_tokens(k: int, acceptance: float, positions: Sequence[float] = ()) -> float:
    """Expected tokens committed by one verify of ``k`` drafts.

    ``positions``: measured conditional acceptance per draft position (the last one stands for
    later positions); without it, i.i.d. acceptance ``acceptance`` at every position.
    """
    if k <= 0:
        return 1.0
    if positions:
        total, reach = 1.0, 1.0
        for i in range(k):
            reach *= min(max(positions[min(i, len(positions) - 1)], 0.0), 1.0)
            total += reach
        return total
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


BINOMIAL_MAX_BATCH = 64  # above this, the expected step cost uses the mean number of drafting requests


class _Acceptance(NamedTuple):
    """What the policy knows of one proposer's drafts (from the snapshot)."""

    rate: float  # acceptance rate EMA (or the prior)
    positions: tuple[float, ...]  # conditional acceptance per draft position, measured so far
    proposal_rate: float  # drafted / requested tokens (1.0 until measured)

    @property
    def first(self) -> float:
        """P(draft 1 accepted): the measured first position, else the i.i.d. rate."""
        return self.positions[0] if self.positions else self.rate


class GoodputPolicy(Policy[GoodputConfig]):
    name = "goodput"
    config_cls = GoodputConfig

    def __init__(self, config: GoodputConfig | None = None, clock: Clock = time.monotonic) -> None:
        super().__init__(config, clock)
        cfg = self.config
        self.cost_model = StepCostModel(
            prior_base_s=cfg.prior_base_s,
            prior_per_token_s=cfg.prior_per_token_s,
            min_samples=cfg.cost_min_samples,
            decay=cfg.cost_decay,
        )
        self._owns_cost_model = True
        self._baseline_tries: dict[int, int] = {}  # batch size -> plain steps spent measuring its cost
        self.current: dict[str, int] = {}  # proposer -> K chosen last (the hysteresis state)
        self._short_run: dict[str, int] = {}  # proposer -> consecutive decisions of K < k_hi (probing)
        self.num_probes = 0
        self._last: dict[str, dict[str, float]] = {}
        self._probing: dict[str, int] = {}  # proposer -> K of the one probing request this step
        self._detail: dict[str, dict[str, Any]] = {}  # proposer -> this step's goodput per K (step_detail)

    def use_cost_model(self, model: StepCostModel) -> None:
        """Predict from (and let its owner feed) ``model`` instead of a private one.

        Step cost is a property of the hardware and the model, not of the policy: the target
        worker keeps one model across live policy swaps, measured every step whatever policy is
        active, so a goodput policy deployed mid-flight starts with the costs already measured
        instead of exploring again. This policy's priors and decay are applied to it.
        """
        cfg = self.config
        model.prior_base_s, model.prior_per_token_s = cfg.prior_base_s, cfg.prior_per_token_s
        model.min_samples, model.decay = cfg.cost_min_samples, cfg.cost_decay
        self.cost_model = model
        self._owns_cost_model = False

    def observe_step(self, tokens: int, seconds: float, requests: int | None = None) -> None:
        if self._owns_cost_model:  # a shared model is fed by its owner
            self.cost_model.observe(tokens, seconds, requests)

    def goodput(
        self, k: int, acceptance: float, batch: int, positions: Sequence[float] = (), proposal_rate: float = 1.0
    ) -> float:
        """Expected committed tokens per second when ``batch`` requests are asked for ``k`` drafts
        and each drafts them with probability ``proposal_rate`` (else runs a plain step)."""

        def predict(tokens: float) -> float:  # a decode step of this batch: its own measurements
            return self.cost_model.predict(tokens, requests=batch)

        if k <= 0:
            return batch / predict(batch)
        rho = min(max(proposal_rate, 0.0), 1.0)
        tokens = batch * (1.0 + rho * (expected_tokens(k, acceptance, positions) - 1.0))
        if rho >= 1.0:
            cost = predict(batch * (k + 1))
        elif batch > BINOMIAL_MAX_BATCH:
            cost = predict(batch + rho * batch * k)
        else:  # j of the batch draft, j ~ Binomial(batch, rho)
            cost = sum(
                math.comb(batch, j) * rho**j * (1.0 - rho) ** (batch - j) * predict(batch + j * k)
                for j in range(batch + 1)
            )
        return tokens / cost

    def acceptance(self, snapshot: LoadSnapshot, proposer: str) -> float:
        return snapshot.acceptance_ema.get(proposer, self.config.prior_acceptance)

    def _acceptance(self, snapshot: LoadSnapshot, proposer: str) -> _Acceptance:
        return _Acceptance(
            rate=self.acceptance(snapshot, proposer),
            positions=tuple(snapshot.acceptance_pos_ema.get(proposer, ())),
            proposal_rate=snapshot.proposal_rate_ema.get(proposer, 1.0),
        )

    def _choose(self, proposer: str, acceptance: _Acceptance, batch: int, k_hi: int) -> int:
        cm, cfg = self.cost_model, self.config
        if (
            k_hi > 0
            and cm.fitted
            and cm.bucket_min_samples
            and cm.measured(batch, requests=batch) is None
            and self._close_call(acceptance, batch, k_hi)
        ):
            # The plain step's cost at this batch size is the baseline every K is compared with;
            # while it is unmeasured, spend a plain step measuring it rather than trusting the line.
            # A step that also carries a prefill chunk measures a larger token count instead, so
            # under steady arrivals this could repeat: a few tries per batch size, then the line.
            tries = self._baseline_tries.get(batch, 0)
            if tries < BASELINE_TRIES:
                self._baseline_tries[batch] = tries + 1
                return 0
        if k_hi <= 0:  # every request is at its last token: nothing to decide, and no step to count
            return 0
        k = self._choose_by_goodput(proposer, acceptance, batch, k_hi)
        # Probe (one request, see choose_k) after probe_interval_steps decisions below k_hi: K = 0
        # drafts probe_k to refresh the acceptance estimate at all; 0 < K < k_hi drafts k_hi to
        # refresh the positions past K, which no verify of K drafts reaches.
        run = 0 if k >= k_hi else self._short_run.get(proposer, 0) + 1
        if cfg.probe_interval_steps and run >= cfg.probe_interval_steps:
            run = 0
            self.num_probes += 1
            self._probing[proposer] = min(cfg.probe_k, k_hi) if k == 0 else k_hi
        self._short_run[proposer] = run
        return k

    def _close_call(self, acc: _Acceptance, batch: int, k_hi: int) -> bool:
        """Whether plain vs the best K is within BASELINE_MARGIN by the current (unmeasured) estimates."""
        if acc.first < self.config.min_acceptance:
            return False  # plain anyway: measuring its cost cannot change anything
        g0 = self.goodput(0, acc.rate, batch)
        best = max(self.goodput(k, acc.rate, batch, acc.positions, acc.proposal_rate) for k in range(1, k_hi + 1))
        return best < g0 * BASELINE_MARGIN

    def _choose_by_goodput(self, proposer: str, acc: _Acceptance, batch: int, k_hi: int) -> int:
        cfg = self.config
        if acc.first < cfg.min_acceptance:
            self.current[proposer] = 0
            return 0
        g = [self.goodput(k, acc.rate, batch, acc.positions, acc.proposal_rate) for k in range(k_hi + 1)]
        best = max(range(k_hi + 1), key=g.__getitem__)  # first maximum: the smallest K on a tie
        cur = self.current.get(proposer)
        held = best if cur is None else min(cur, k_hi)  # a request near its end may cap K below cur
        k = best if g[best] > g[held] * (1.0 + cfg.switch_margin) else held
        if cur is None or k != held:
            self.current[proposer] = k  # otherwise keep cur, uncapped, for the next step
        self._last[proposer] = {
            "k": k,
            "acceptance": acc.rate,
            "proposal_rate": acc.proposal_rate,
            "expected_tokens": expected_tokens(k, acc.rate, acc.positions),
            "goodput": g[k],
        }
        self._detail[proposer] = {
            "batch": batch,
            "k": k,
            "goodput": [round(x, 3) for x in g],
            "positions": [round(x, 3) for x in acc.positions],
            "proposal_rate": round(acc.proposal_rate, 3),
        }
        return k

    def choose_k(self, snapshot: LoadSnapshot, candidates: Sequence[SpecCandidate]) -> list[int]:
        batch = batch_size(snapshot, candidates)
        k_hi: dict[str, int] = {}
        for c in candidates:
            if c.proposer is not None:
                k_hi[c.proposer] = max(k_hi.get(c.proposer, 0), c.k_max)
        self._probing.clear()
        self._detail = {}
        chosen = {p: self._choose(p, self._acceptance(snapshot, p), batch, hi) for p, hi in k_hi.items()}
        ks = [chosen[c.proposer] if c.proposer is not None else 0 for c in candidates]
        for p, k_probe in self._probing.items():  # a probe is one request's drafts: the first that can draft
            probe = next(
                (i for i, c in enumerate(candidates) if c.proposer == p and c.k_max > 0 and c.speculation != "off"),
                None,
            )
            if probe is not None:
                ks[probe] = k_probe
        return ks

    def step_detail(self) -> dict[str, Any]:
        """Per proposer decided on by goodput this step: batch size, K, predicted goodput for every
        K (tokens/s), the acceptance per position and the proposal rate it was computed from; and the
        probe K where one request probed. A proposer held by a rule (the floor, a baseline step) has
        no prediction: only its probe K, if it probed."""
        out = {p: dict(d) for p, d in self._detail.items()}
        for p, k in self._probing.items():
            out.setdefault(p, {})["probe_k"] = k
        return out

    def state(self) -> dict[str, Any]:
        return {
            "k": dict(self.current),
            "last": {p: dict(v) for p, v in self._last.items()},
            "cost_model": self.cost_model.as_dict(),
            "probes": self.num_probes,
        }
