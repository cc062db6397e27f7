"""Presence / frequency / repetition penalties: the arithmetic on hand-written rows, and output
identical with speculation on and off (each verify row penalized as its plain step would be)."""

from __future__ import annotations

import pytest
import torch

from tests.test_fidelity import Switcher, alone, copy_prompts, make_proposer
from tests.test_spec_engine import MAX_LEN
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.penalties import penalize_rows
from workers.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]] * 3)  # 3 rows: 2 drafts verified
    sp = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    # prompt has token 2; output so far [3, 3]; drafts [1, 3]: row 1 sees draft 1, row 2 sees drafts 1 and 3
    out = penalize_rows(logits, [2], [3, 3], [1, 3], sp)
    # row 0: token 3 seen twice (3/2 - 0.25*2 - 0.5 = 0.5); token 2 in prompt only (0.5/2 = 0.25, no count)
    assert out[0].tolist() == [2.0, -1.0, 0.25, 0.5]
    # row 1: + draft 1 once: -1*2 - 0.25 - 0.5 = -2.75
    assert out[1].tolist() == [2.0, -2.75, 0.25, 0.5]
    # row 2: + draft 3: token 3 three times: 1.5 - 0.75 - 0.5 = 0.25
    assert out[2].tolist() == [2.0, -2.75, 0.25, 0.25]
    assert torch.equal(penalize_rows(logits, [2], [3], [1], SamplingParams())[:2], logits[:2])


@pytest.fixture(scope="module")
def draft_loaded(tiny_draft_dir):
    from workers.model_loader import load_model

    return load_model(tiny_draft_dir)


@pytest.mark.parametrize(
    "params",
    [
        {"max_tokens": 24, "ignore_eos": True, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {
            "max_tokens": 24,
            "ignore_eos": True,
            "repetition_penalty": 4.0,
            "frequency_penalty": 2.0,
            "temperature": 1.2,
            "seed": 3,
        },
    ],
    ids=["greedy-frequency-presence", "seeded-repetition-frequency"],
)
def test_penalized_output_identical_with_speculation(tiny_loaded, draft_loaded, params):
    prompts = copy_prompts(4, seed=51)
    ref = alone(tiny_loaded, "float32", prompts, params)
    unpenalized = alone(tiny_loaded, "float32", prompts, {k: v for k, v in params.items() if "penalty" not in k})
    assert ref != unpenalized  # the penalties change the text, so the comparison below can fail
    for kind in ("ngram", "draft_self"):
        name, prop = make_proposer(kind, tiny_loaded, draft_loaded, num_slots=8)
        eng = LLMEngine(
            EngineConfig(
                dtype="float32",
                max_num_seqs=8,
                max_model_len=MAX_LEN,
                num_speculative_tokens=4,
                proposers=[{"name": name}],
            ),
            tiny_loaded,
            proposers={name: prop},
            decide=Switcher(),
        )
        assert eng.generate(prompts, params, speculation="on", proposer=name) == ref, kind
        if kind == "draft_self":
            assert eng.stats[name].num_draft_tokens > 0
