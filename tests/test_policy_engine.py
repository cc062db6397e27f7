"""The routing policy inside the engine loop: a running request changes path with load,
and its greedy output does not change."""

from __future__ import annotations

from policies.registry import make_policy
from tests.test_engine import rand_prompts
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.proposers.draft_model import DraftModelProposer


def self_draft(loaded) -> dict:
    # the target as its own draft: drafts are proposed whenever the policy allows
    return {"draft_model": DraftModelProposer(loaded.model, num_slots=8, max_model_len=256)}


def test_threshold_request_switches_to_plain_when_load_rises_output_unchanged(tiny_loaded):
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, num_speculative_tokens=4)
    prompt = rand_prompts(1, 11)[0]
    plain = LLMEngine(cfg, tiny_loaded, proposers=self_draft(tiny_loaded)).generate(
        [prompt], {"max_tokens": 60, "ignore_eos": True}, speculation="off"
    )[0]

    policy = make_policy({"name": "threshold", "t_low": 1, "t_high": 1, "min_dwell_s": 0})
    eng = LLMEngine(cfg, tiny_loaded, proposers=self_draft(tiny_loaded), decide=policy.decide)
    eng.add_request("alone", prompt, {"max_tokens": 60, "ignore_eos": True})
    out: list[int] = []
    path: list[str] = []  # alone's path each step, with how many requests were decoding
    steps, spec_seen = 0, 0
    while eng.has_work():
        if steps == 3:  # load rises above T: three short requests join
            for i, p in enumerate(rand_prompts(3, 12)):
                eng.add_request(f"crowd{i}", p, {"max_tokens": 6, "ignore_eos": True})
        decoding = eng.snapshot().decoding
        for o in eng.step():
            if o.request_id == "alone":
                out += o.token_ids
                path.append(("spec" if o.spec.spec_steps > spec_seen else "plain") + f"@{decoding}")
                spec_seen = o.spec.spec_steps
        steps += 1
    assert out == plain
    # above T: on a loaded machine the time-sized prefill chunks can admit the crowd over several steps
    crowd = [i for i, p in enumerate(path) if int(p.split("@")[1]) >= 2]
    assert crowd, path
    assert any(p.startswith("spec") for p in path[: crowd[0]]), path  # speculated while alone
    assert all(path[i].startswith("plain") for i in crowd), path  # plain while the batch is above T
    assert any(p.startswith("spec") for p in path[crowd[-1] + 1 :]), path  # and resumed once load fell
    assert policy.decisions[("plain", 0)] > 0
    # the cumulative counters a snapshot publishes (rates over a window come from two snapshots)
    snap = eng.snapshot()
    assert snap.output_tokens == len(out) + 3 * 6
    assert snap.spec_request_steps == sum(p.startswith("spec") for p in path)  # the crowd never speculates
    # alone's first output came from its prefill step; each crowd request decodes 5 plain steps after its own
    assert snap.plain_request_steps == sum(p.startswith("plain") for p in path) - 1 + 3 * 5
