"""Closed-loop simulation of the goodput policy: the real policy and the engine's own acceptance
books (``AcceptanceTracker``), with synthetic drafts and step costs. No model, no Ray.

Why simulate: the HTTP sweep is the real check of issue 5's bar (goodput >= 0.97x the better of
``never`` and ``always``), but one cell takes minutes and its rounds differ by 5-10% on this VM.
A decision bug that costs a few percent hides in that noise; here a cell of a few thousand steps
runs in a fraction of a second and a seed makes it exact. Measured on the real cell that made this
file (chat c=1, session 7): ``always`` beat ``never`` by 4-7%, and goodput parked at K = 0 after
its acceptance estimate dipped (ten-sample memory, and a floor on the per-token rate, which an
all-or-nothing n-gram draft keeps low at K = 4). The workloads below are that cell and its
neighbours, with the drafting statistics the sweep measured for the n-gram proposer on open chat:
a draft on ~37% of steps, draft 1 accepted ~17% of the time, later drafts ~65% once it was.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import pytest

from policies import make_policy
from policies.base import Policy
from workers.decision import SpecCandidate
from workers.stats import AcceptanceTracker, LoadSnapshot

K_MAX = 4
PROPOSER = "ngram"


@dataclass(frozen=True)
class Workload:
    """One proposer's drafts and the target's step cost at a fixed decode batch."""

    batch: int
    proposal_rate: float  # P(the proposer drafts at all when asked): an n-gram needs a match
    first: float  # P(draft 1 accepted)
    later: float  # P(draft i + 1 accepted | drafts 1..i accepted)
    plain_s: float  # a plain step of the whole batch
    per_draft_s: float  # each drafted token fed to the verify
    noise: float = 0.05  # relative std of a step's measured time


def simulate(policy: Policy, w: Workload, steps: int = 3000, seed: int = 0) -> tuple[float, float]:
    """Run ``steps`` engine steps; returns (committed tokens per second, share of request-steps with K > 0).

    Each step: the policy decides K per request from the tracker's snapshot; each asked request
    drafts K tokens with probability ``proposal_rate``; acceptance stops at the first rejection;
    the step's time (plain + drafted tokens, with noise) is fed back to the policy's cost model.
    """
    # Common random numbers: every policy run with this seed meets the same luck (request i at step s
    # finds a match, and its draft j is accepted, on the same draws), so two policies' difference is
    # their decisions, not their dice.
    rng = random.Random(seed)
    luck = [[(rng.random(), [rng.random() for _ in range(K_MAX)]) for _ in range(w.batch)] for _ in range(steps)]
    noise = [max(0.5, 1.0 + w.noise * rng.gauss(0.0, 1.0)) for _ in range(steps)]
    books = AcceptanceTracker()
    cands = [SpecCandidate(f"r{i}", PROPOSER, "auto", K_MAX) for i in range(w.batch)]
    tokens, seconds, asked = 0, 0.0, 0
    for s in range(steps):
        snap = books.fill(LoadSnapshot(running=w.batch, decoding=w.batch))
        drafted = 0
        for k, (match, accept) in zip(policy.decide(snap, cands), luck[s]):
            asked += k > 0
            n_draft = k if (k > 0 and match < w.proposal_rate) else 0
            if k > 0:
                books.on_proposal(PROPOSER, n_draft, k)
            n_acc = 0
            while n_acc < n_draft and accept[n_acc] < (w.first if n_acc == 0 else w.later):
                n_acc += 1
            if n_draft:
                books.on_verify(PROPOSER, n_draft, n_acc)
            tokens += 1 + n_acc
            drafted += n_draft
        dt = (w.plain_s + w.per_draft_s * drafted) * noise[s]
        policy.observe_step(w.batch + drafted, dt, w.batch)
        seconds += dt
    return tokens / seconds, asked / (steps * w.batch)


@functools.cache  # deterministic per (workload, seed); two tests read seed 0's cells
def peers(w: Workload, seed: int) -> dict[str, tuple[float, float]]:
    return {
        name: simulate(make_policy({"name": name, **extra}), w, seed=seed)
        for name, extra in (("never", {}), ("always", {"num_speculative_tokens": K_MAX}), ("goodput", {}))
    }


# open chat, n-gram: speculation wins at B = 1 (costs as measured: a B = 1 step ~65 ms plain, ~76 ms with 4 drafts)
CHAT_B1 = Workload(batch=1, proposal_rate=0.37, first=0.17, later=0.65, plain_s=0.065, per_draft_s=0.00275)
# ... and loses at B = 4, where each drafted token costs more (always ~15% below never, as in the sweep)
CHAT_B4 = Workload(batch=4, proposal_rate=0.37, first=0.17, later=0.65, plain_s=0.090, per_draft_s=0.0055)
# copy-heavy: every step drafts and most drafts land
COPY_B4 = Workload(batch=4, proposal_rate=0.95, first=0.8, later=0.9, plain_s=0.090, per_draft_s=0.0055)


SEEDS = range(6)


@pytest.mark.parametrize("w", [CHAT_B1, CHAT_B4, COPY_B4], ids=["chat_b1", "chat_b4", "copy_b4"])
def test_goodput_reaches_the_better_path(w: Workload) -> None:
    """Issue 5's bar, per simulated cell: goodput >= 0.97x the better of never and always, on the
    mean over seeds (a cell of the sweep is a few rounds too), and no seed far below it."""
    ratios = []
    for seed in SEEDS:
        r = peers(w, seed)
        ratios.append(r["goodput"][0] / max(r["never"][0], r["always"][0]))
    assert sum(ratios) / len(ratios) >= 0.97, ratios
    assert min(ratios) >= 0.94, ratios


def test_the_workloads_have_a_winner() -> None:
    """The bar above would be empty if never and always tied: the chat B = 1 cell is one where
    always wins by a few percent (the margin that goodput lost by parking), the B = 4 cells clear."""
    chat1, chat4, copy4 = (peers(w, seed=0) for w in (CHAT_B1, CHAT_B4, COPY_B4))
    assert 1.03 < chat1["always"][0] / chat1["never"][0] < 1.15
    assert chat4["always"][0] < 0.9 * chat4["never"][0]
    assert copy4["always"][0] > 1.5 * copy4["never"][0]


def test_goodput_keeps_speculating_where_it_wins_by_a_little() -> None:
    """The failure itself: at chat B = 1 goodput must not park at K = 0 after a dip in its estimate."""
    for seed in SEEDS:
        _, spec_share = simulate(make_policy({"name": "goodput"}), CHAT_B1, seed=seed)
        assert spec_share > 0.8, (seed, spec_share)
