"""N-gram (prompt lookup) proposer and the proposer registry, on hand-written token lists."""

from __future__ import annotations

import random
import time
from typing import Sequence

import pytest

from workers.proposers import registry
from workers.proposers.base import ProposalRequest, Proposer
from workers.proposers.ngram import NgramConfig, NgramProposer
from workers.proposers.registry import known_proposers, make_proposer, register_proposer


def req(tokens: Sequence[int], k: int = 4, rid: str = "r", eos: Sequence[int] = ()) -> ProposalRequest:
    return ProposalRequest(
        request_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        k=k,
        eos_token_ids=frozenset(eos),
    )


def draft(p: Proposer, tokens: Sequence[int], k: int = 4, rid: str = "r", eos: Sequence[int] = ()) -> list[int]:
    out = p.propose([req(tokens, k, rid, eos)])
    assert out.draft_probs == [None]
    return out.draft_token_ids[0]


def reference(tokens: list[int], min_n: int, max_n: int, k: int, eos: frozenset[int]) -> list[int]:
    """The documented rule, written the slow obvious way."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        pattern = tokens[length - n :]
        for end in range(length - 2, n - 2, -1):  # most recent earlier occurrence first
            if n <= length - 1 and tokens[end - n + 1 : end + 1] == pattern:
                ext = list(tokens)
                for j in range(k):  # overlapping copy
                    ext.append(ext[end + 1 + j])
                out = ext[length:]
                for i, t in enumerate(out):
                    if t in eos:
                        return out[:i]
                return out
    return []


def test_copies_continuation_of_earlier_occurrence() -> None:
    p = NgramProposer()
    assert draft(p, [1, 2, 3, 4, 5, 6, 7, 9, 1, 2, 3], k=3) == [4, 5, 6]


def test_longest_match_wins_over_more_recent_shorter_one() -> None:
    # Suffix [7, 8, 9]: 3-gram occurs at the start (-> 10), the 1-gram [9] occurs
    # more recently (-> 20). The longer match wins.
    p = NgramProposer(max_n=3)
    assert draft(p, [7, 8, 9, 10, 11, 5, 9, 20, 21, 7, 8, 9], k=2) == [10, 11]
    # With max_n=1 only the last token is matched, so the most recent [9] wins.
    p1 = NgramProposer(min_n=1, max_n=1)
    assert draft(p1, [7, 8, 9, 10, 11, 5, 9, 20, 21, 7, 8, 9], k=2) == [20, 21]


def test_tie_rule_most_recent_occurrence() -> None:
    # [1, 2] occurs twice before the suffix: -> 3 (older) and -> 4 (newer).
    p = NgramProposer(max_n=2)
    assert draft(p, [1, 2, 3, 0, 1, 2, 4, 0, 9, 1, 2], k=1) == [4]


def test_overlapping_copy_repeats_periodic_tail() -> None:
    p = NgramProposer(max_n=3)
    # Most recent earlier [b, a, b] ends 2 tokens before the end: period 2.
    assert draft(p, [5, 1, 2, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert draft(p, [3, 3, 3], k=4, rid="run") == [3, 3, 3, 3]


def test_no_match_gives_empty_draft() -> None:
    p = NgramProposer()
    assert draft(p, [1, 2, 3, 4, 5]) == []
    assert draft(p, [7], rid="one") == []
    assert draft(p, [], rid="empty") == []
    # min_n=3: the 2-gram [1, 2] repeats but no 3-gram does.
    assert draft(NgramProposer(min_n=3, max_n=4), [9, 1, 2, 3, 8, 1, 2]) == []


def test_never_proposes_across_eos() -> None:
    p = NgramProposer()
    tokens = [1, 2, 3, 0, 4, 5, 1, 2]
    assert draft(p, tokens, k=4, eos=[0]) == [3]
    assert draft(p, tokens, k=4, eos=[3], rid="b") == []
    assert draft(p, tokens, k=4, rid="c") == [3, 0, 4, 5]


def test_draft_length_at_most_k() -> None:
    p = NgramProposer()
    tokens = list(range(20)) + list(range(5))
    for k in range(1, 10):
        d = draft(p, tokens, k=k)
        assert d == list(range(5, 5 + k))
    assert len(draft(p, [4, 4, 4, 4, 4, 4], k=3, rid="x")) == 3


def test_batch_keeps_order_and_requests_apart() -> None:
    p = NgramProposer()
    out = p.propose([req([1, 2, 1], 2, "a"), req([5, 6, 7], 2, "b"), req([8, 9, 8], 1, "c")])
    assert out.draft_token_ids == [[2, 1], [], [9]]
    assert out.draft_probs == [None, None, None]


def test_matches_reference_on_random_sequences() -> None:
    rng = random.Random(0)
    for trial in range(1000):
        min_n = rng.randint(1, 3)
        max_n = rng.randint(min_n, 5)
        p = NgramProposer(min_n=min_n, max_n=max_n)
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 40))]
        k = rng.randint(1, 7)
        eos = frozenset({3}) if trial % 2 else frozenset()
        assert draft(p, tokens, k, eos=eos) == reference(tokens, min_n, max_n, k, eos), (tokens, k)


def test_incremental_updates_match_fresh_proposer() -> None:
    rng = random.Random(1)
    incremental = NgramProposer(min_n=1, max_n=3)
    tokens = [rng.randrange(6) for _ in range(10)]
    for _ in range(60):
        tokens += [rng.randrange(6) for _ in range(rng.randint(1, 5))]  # 1..k+1 committed
        got = draft(incremental, tokens, k=4, rid="inc")
        assert got == draft(NgramProposer(min_n=1, max_n=3), tokens, k=4, rid="fresh")


def test_reused_request_id_with_other_tokens_rebuilds() -> None:
    p = NgramProposer()
    assert draft(p, [1, 2, 3, 1, 2], k=1) == [3]
    assert draft(p, [4, 5, 6, 4, 5], k=1) == [6]  # same id, different history
    assert draft(p, [4, 5], k=1) == []  # shorter


def test_finish_frees_state() -> None:
    p = NgramProposer()
    draft(p, [1, 2, 1], rid="a")
    draft(p, [1, 2, 1], rid="b")
    assert p.num_tracked_requests == 2
    p.finish("a", [1, 2, 1, 2])
    assert p.num_tracked_requests == 1
    p.finish("a", [])  # idempotent: cancellation after finish is harmless
    p.finish("b", [1, 2, 1])
    assert p.num_tracked_requests == 0


@pytest.mark.parametrize(
    ("options", "field"),
    [({"min_n": 0}, "min_n"), ({"max_n": 0}, "max_n"), ({"min_n": 3, "max_n": 2}, "max_n"), ({"mx_n": 3}, "mx_n")],
)
def test_invalid_config_names_the_field(options: dict[str, int], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        NgramProposer(**options)
    with pytest.raises(ValueError, match=field):
        make_proposer("ngram", **options)


def test_config_defaults() -> None:
    assert NgramConfig() == NgramConfig(min_n=1, max_n=4)
    assert NgramProposer(NgramConfig(min_n=2)).config.min_n == 2


def test_steady_state_cost_is_well_under_a_millisecond_per_request() -> None:
    rng = random.Random(2)
    p = NgramProposer()
    seqs = [[rng.randrange(1000) for _ in range(2000)] for _ in range(32)]
    p.propose([req(s, 8, f"r{i}") for i, s in enumerate(seqs)])  # prefill: buffers built
    times: list[float] = []
    steps = 20
    for _ in range(steps):
        for s in seqs:
            s += [rng.randrange(1000) for _ in range(3)]
        batch = [req(s, 8, f"r{i}") for i, s in enumerate(seqs)]
        start = time.perf_counter()
        p.propose(batch)
        times.append(time.perf_counter() - start)
    # Median step: robust to the test machine preempting one step.
    per_request_ms = sorted(times)[steps // 2] / len(seqs) * 1e3
    assert per_request_ms < 0.5, per_request_ms  # measured ~0.02 ms


# -- registry -----------------------------------------------------------------


def test_registry_builds_known_proposers() -> None:
    assert {"ngram", "suffix"} <= set(known_proposers())
    p = make_proposer("ngram", min_n=2, max_n=3)
    assert isinstance(p, NgramProposer) and p.config == NgramConfig(min_n=2, max_n=3)
    assert make_proposer("suffix").name == "suffix"


def test_registry_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown proposer 'medusa'.*ngram.*suffix"):
        make_proposer("medusa")


def test_register_proposer_adds_one_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_PROPOSERS", dict(registry._PROPOSERS))
    register_proposer("ngram_long", lambda **o: NgramProposer(min_n=3, max_n=8, **o))
    p = make_proposer("ngram_long")
    assert isinstance(p, NgramProposer) and p.config.max_n == 8
    with pytest.raises(ValueError, match="already registered"):
        register_proposer("ngram", NgramProposer)
    register_proposer("ngram", NgramProposer, replace=True)
