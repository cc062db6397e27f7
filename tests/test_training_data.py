"""Training prompts vs held-out evaluation prompts, and the shipped drafts' manifests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.prompts import _side, eval_prompts, make_prompts

ROOT = Path(__file__).resolve().parent.parent
POOLS = (
    "TOPICS",
    "TASKS",
    "THINGS",
    "PEOPLE",
    "ITEMS",
    "RECIPIENTS",
    "MATTERS",
    "CHARACTERS",
    "CODE_TASKS",
    "SENTENCES",
    "PARAGRAPHS",
)


def test_eval_prompts_disjoint_from_training_prompts() -> None:
    # the data generator's default: 1600 training prompts, seed 0 (training/datagen.py)
    train = {p["text"] for p in make_prompts(1600, "train", seed=0)}
    held_out = eval_prompts(200)
    assert len(train) == 1600 and len(set(held_out)) == 200
    assert not train & set(held_out)


def test_every_fill_in_value_is_on_one_side_only() -> None:
    import training.prompts as tp

    for name in POOLS:
        pool = getattr(tp, name)
        tr, ev = set(_side(False)(pool)), set(_side(True)(pool))
        assert tr and ev, name
        assert not tr & ev, name
        assert tr | ev == {v.strip() for v in pool}, name


def test_prompts_are_reproducible_and_diverse() -> None:
    a, b = make_prompts(300, "train", seed=0), make_prompts(300, "train", seed=0)
    assert a == b
    cats = {p["category"] for p in a}
    assert {"explain", "howto", "list", "story", "email", "code", "math", "summary", "rewrite"} <= cats


@pytest.mark.parametrize(
    "name, files",
    [
        ("smollm2-draft", ["config.json", "model.safetensors", "tokenizer.json", "MANIFEST.md", "training.json"]),
        ("smollm2-eagle", ["eagle_config.json", "model.safetensors", "MANIFEST.md", "training.json"]),
    ],
)
def test_shipped_drafts_have_a_manifest(name: str, files: list[str]) -> None:
    d = ROOT / "models" / name
    for f in files:
        assert (d / f).exists(), f"{d / f} missing"
    text = (d / "MANIFEST.md").read_text()
    for must in ("python -m training.", "acceptance", "held-out"):
        assert must in text, f"{name} MANIFEST lacks {must!r}"
    size = sum(p.stat().st_size for p in d.iterdir())
    assert (
        size < 90e6
    )  # the draft model carries the 49152 x 576 embedding (57 MB in bf16), f"{name} is {size / 1e6:.0f} MB"
    json.loads((d / "training.json").read_text())


def test_agreement_counts_response_hits_and_consecutive_hits():
    from training.agreement import agreement

    ids = [1, 2, 3, 4, 5, 6]  # prompt [1, 2], response [3, 4, 5, 6]
    guess = [9, 3, 4, 0, 6, 9]  # draft's guess for the next token at each position
    # response positions t = 1..4 guess ids[2..5]: hits at t = 1, 2, 4; one hit followed by a hit
    assert agreement(ids, guess, 2) == (3, 4, 1, 2)
