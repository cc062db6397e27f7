"""EAGLE proposer: target hidden states flow from the runner to the head; output never changes.

Fast tests use a tiny random target and a random head (bad drafts: the verify must reject them
without changing a single token); the shipped head on the real SmolLM2 is tested in
tests/test_trained_drafts.py.
"""

from __future__ import annotations

import pytest
import torch

from workers.config import EngineConfig
from workers.eagle_head import EagleHead, head_config_for, load_head, save_head
from workers.engine import LLMEngine
from workers.proposers.base import ProposalRequest
from workers.proposers.eagle import EagleProposer
from workers.proposers.registry import known_proposers
from workers.runner import ModelRunner, StepBatch

PROMPTS = [
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],
    [100, 200, 300],
    [7, 7, 7, 7, 7, 7, 7, 7],
    [4000, 4001, 4002, 4003, 4004, 4005, 4006, 4007, 4008, 4009, 4010, 4011, 4012, 4013, 4014, 4015, 4016],
    [42],
    [9, 8, 7, 6, 5, 4, 3, 2, 1],
    [31000, 12, 31000, 12, 31000],
    [500, 600, 700, 800],
]


def tiny_head(target, seed: int = 0, draft_vocab: int | None = None) -> EagleHead:
    torch.manual_seed(seed)
    V = target.config.vocab_size
    head = EagleHead(head_config_for(target.config, draft_vocab or V))
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    if draft_vocab:
        head.d2t.copy_(torch.randperm(V)[:draft_vocab].sort().values)
    return head.eval()


def make_engine(loaded, head: EagleHead | None, k: int, max_num_seqs: int = 8, budget: int = 64) -> LLMEngine:
    cfg = EngineConfig(
        dtype="float32",
        model="x",
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        max_num_batched_tokens=budget,
        num_speculative_tokens=k,
    )
    props = {}
    if head is not None:
        props["eagle"] = EagleProposer(head, loaded.model, num_slots=max_num_seqs, max_model_len=256, device="cpu")
    return LLMEngine(cfg, loaded, proposers=props)


def test_registered() -> None:
    assert "eagle" in known_proposers()


def test_runner_hidden_rows_match_logits_rows(tiny_loaded) -> None:
    r = ModelRunner(tiny_loaded.model, num_slots=2, max_model_len=64, device="cpu")
    toks = [3, 4, 5, 6, 7]
    full = r.forward(StepBatch([0], [0], [toks], [list(range(5))]))
    part = r.forward(StepBatch([1], [0], [toks], [[4]], hidden_rows=[[0, 1, 2, 3, 4]]))
    assert part.logits.shape[0] == 1 and part.extra_hidden is not None
    torch.testing.assert_close(part.extra_hidden, full.hidden)
    assert r.forward(StepBatch([0], [0], [toks], [[4]])).extra_hidden is None  # nobody asked: no extra work


def test_engine_passes_hidden_of_committed_positions(tiny_loaded) -> None:
    """The hidden states the proposer sees equal a teacher-forced forward over the committed tokens."""
    seen: list[tuple[list[int], torch.Tensor]] = []

    class Spy(EagleProposer):
        def propose(self, requests: list[ProposalRequest]):
            for q in requests:
                seen.append((list(q.token_ids), q.hidden_states.clone()))
            return super().propose(requests)

    head = tiny_head(tiny_loaded.model)
    cfg = EngineConfig(
        dtype="float32",
        model="x",
        max_num_seqs=2,
        max_model_len=128,
        max_num_batched_tokens=16,
        num_speculative_tokens=3,
    )
    eng = LLMEngine(cfg, tiny_loaded, proposers={"eagle": Spy(head, tiny_loaded.model, 2, 128, device="cpu")})
    eng.generate([PROMPTS[0], PROMPTS[3]], {"max_tokens": 12, "ignore_eos": True})  # chunked prefill (budget 16)
    ref = ModelRunner(tiny_loaded.model, num_slots=1, max_model_len=128, device="cpu")
    assert len(seen) > 4
    for toks, hs in seen:
        assert hs.shape[0] == len(toks) - 1
        want = ref.forward(StepBatch([0], [0], [toks[:-1]], [list(range(len(toks) - 1))])).hidden
        torch.testing.assert_close(hs, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_identical_to_plain(tiny_loaded, k: int, batch: int) -> None:
    prompts = PROMPTS[:batch]
    params = {"max_tokens": 20, "ignore_eos": True}
    plain = make_engine(tiny_loaded, None, 0).generate(prompts, params)
    eng = make_engine(tiny_loaded, tiny_head(tiny_loaded.model, draft_vocab=4096), k)
    spec = eng.generate(prompts, params, proposer="eagle")
    assert spec == plain
    assert eng.stats["eagle"].num_draft_tokens > 0
    assert eng.proposers["eagle"].num_active == 0  # finished requests freed their head KV slot


def test_sampled_goes_through_rejection_sampler_with_q(tiny_loaded) -> None:
    eng = make_engine(tiny_loaded, tiny_head(tiny_loaded.model, draft_vocab=4096), 3)
    prop = eng.proposers["eagle"]
    hs = torch.randn(len(PROMPTS[0]) - 1, tiny_loaded.model.config.hidden_size)
    from workers.sampling_params import SamplingParams

    req = ProposalRequest("r", PROMPTS[0], 5, 3, sampling=SamplingParams(temperature=0.7, seed=1), hidden_states=hs)
    out = prop.propose([req])
    q = out.draft_probs[0]
    assert q is not None and q.shape == (len(out.draft_token_ids[0]), tiny_loaded.model.config.vocab_size)
    torch.testing.assert_close(q.sum(-1), torch.ones(q.shape[0]))
    outside = torch.ones(q.shape[1], dtype=torch.bool)
    outside[prop.head.d2t] = False
    assert float(q[:, outside].sum()) == 0.0  # q lives on the draft vocabulary only
    for t, row in zip(out.draft_token_ids[0], q):
        assert row[t] > 0
    # end to end: seeded sampling is reproducible and runs speculative steps
    a = eng.generate(
        [PROMPTS[1]], {"max_tokens": 16, "temperature": 0.7, "seed": 3, "ignore_eos": True}, proposer="eagle"
    )
    b = make_engine(tiny_loaded, tiny_head(tiny_loaded.model, draft_vocab=4096), 3).generate(
        [PROMPTS[1]], {"max_tokens": 16, "temperature": 0.7, "seed": 3, "ignore_eos": True}, proposer="eagle"
    )
    assert a == b and len(a[0]) == 16


def test_save_load_roundtrip(tiny_loaded, tmp_path) -> None:
    head = tiny_head(tiny_loaded.model, draft_vocab=1000)
    save_head(head, tmp_path / "h", dtype=torch.float32)
    back = load_head(tmp_path / "h")
    assert torch.equal(back.d2t, head.d2t)
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_requires_hidden_states(tiny_loaded) -> None:
    prop = EagleProposer(tiny_head(tiny_loaded.model), tiny_loaded.model, 1, 64, device="cpu")
    with pytest.raises(ValueError, match="hidden states"):
        prop.propose([ProposalRequest("r", [1, 2, 3], 2, 2)])


# ----------------------------------------------------------------------------- through the draft worker


class _WorkerHandle:
    """Stands in for the DraftWorker's Serve handle: calls the worker in process."""

    def __init__(self, worker) -> None:
        from tests.test_reliability_unit import _Method

        self.propose = _Method(worker.propose)
        self.release = _Method(worker.release)


@pytest.mark.parametrize("lose_state", [False, True])
def test_remote_eagle_through_draft_worker_identical_to_plain(
    tiny_loaded, tiny_model_dir, tmp_path, monkeypatch, lose_state: bool
) -> None:
    """Target engine -> RemoteEagleProposer (sends fp16 hidden rows) -> DraftWorker's EagleProposer.

    ``lose_state``: the draft forgets everything mid-generation (a restart): it answers resync, the
    next call resends every token and hidden row, and the output still equals plain decoding.
    """
    from deployments.draft import DraftWorker
    from deployments.remote_draft import RemoteEagleProposer

    monkeypatch.setattr("ray.serve.get_replica_context", lambda: None)
    save_head(tiny_head(tiny_loaded.model, draft_vocab=4096), tmp_path / "eagle", dtype=torch.float32)
    cfg = {
        "engine": {"model": tiny_model_dir, "max_model_len": 256},
        "draft": {"model": "target", "eagle": str(tmp_path / "eagle"), "max_num_seqs": 8},
    }
    worker = DraftWorker.func_or_class(cfg)
    remote = RemoteEagleProposer(_WorkerHandle(worker), timeout_s=5.0, retry_after_s=0.0)
    if lose_state:
        calls = {"n": 0}
        orig = worker.propose

        def flaky(batch, released):
            calls["n"] += 1
            if calls["n"] == 3:
                for m in batch:
                    worker._forget(m["request_id"])
            return orig(batch, released)

        worker.propose = flaky
        remote.handle.propose = type(remote.handle.propose)(flaky)
    eng_cfg = EngineConfig(
        dtype="float32",
        model="x",
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=64,
        num_speculative_tokens=3,
    )
    eng = LLMEngine(eng_cfg, tiny_loaded, proposers={"eagle": remote})
    params = {"max_tokens": 20, "ignore_eos": True}
    spec = eng.generate(PROMPTS[:4], params, proposer="eagle")
    assert spec == make_engine(tiny_loaded, None, 0).generate(PROMPTS[:4], params)
    assert eng.stats["eagle"].num_draft_tokens > 0
    assert worker.proposers["eagle"].num_active == 0  # released at finish
    assert worker.stats()["known"] == 0


def test_ray_config_offers_eagle_and_config_validates_it() -> None:
    from cluster.config import AppConfig
    from cluster.local_cluster import shipped_app_args

    args = shipped_app_args()
    cfg = AppConfig.model_validate(args)
    assert "eagle" in [p.name for p in cfg.engine.proposers]
    assert cfg.draft.eagle and cfg.draft.model != "target"
    args["draft"].pop("eagle")
    with pytest.raises(ValueError, match="draft.eagle"):
        AppConfig.model_validate(args)


def test_training_time_test_unroll_matches_the_proposers_drafting_chain(tiny_loaded) -> None:
    """forward_ttt's step-s prediction for the chain anchored at j is what the proposer computes at
    draft s after committing t_0 .. t_{j+1} (earlier drafts accepted, so they are the true tokens)."""
    target = tiny_loaded.model
    head = tiny_head(target, seed=3, draft_vocab=2048)
    H = target.config.hidden_size
    torch.manual_seed(0)
    T = 14
    toks = torch.randint(0, target.config.vocab_size, (T + 1,))  # t_0 .. t_T
    feats = torch.randn(T, H)  # f_0 .. f_{T-1}
    embed = target.model.embed_tokens.weight.detach()
    with torch.no_grad():
        preds = head.forward_ttt(feats[None], embed[toks[1:]][None], steps=3)
        torch.testing.assert_close(preds[0], head.forward_train(feats[None], embed[toks[1:]][None]))
    for j in (0, 5, 10):
        prop = EagleProposer(head, target, num_slots=1, max_model_len=64, device="cpu")
        table = [0, 1, 2, 3]  # the blocks of 64 positions
        f = prop._forward([table], [0], feats[: j + 1], toks[1 : j + 2], [j + 1])  # true pairs 0 .. j
        for s in range(1, 4):
            if j + s >= T:
                break
            torch.testing.assert_close(f[0], preds[s - 1][0, j], atol=1e-4, rtol=1e-4)
            f = prop._forward([table], [j + s], f, toks[j + s + 1 : j + s + 2], [1])  # [f^_{j+s} ; embed(t_{j+s+1})]


def test_scaling_heldout_acceptance_counts_what_the_proposer_would_have_accepted(tiny_loaded) -> None:
    """training/scaling.py's teacher-forced acceptance equals, anchor by anchor, the leading drafts
    the real EagleProposer proposes that match the sequence. The sequence is built from the proposer's
    own drafts at some anchors (all K, or the first two then a wrong token), so hits do occur."""
    from training.data import Seq
    from training.scaling import heldout_acceptance

    target = tiny_loaded.model
    head = tiny_head(target, seed=5, draft_vocab=2048)
    H, V, K, P, T = target.config.hidden_size, target.config.vocab_size, 3, 5, 30
    torch.manual_seed(1)
    toks = torch.randint(0, V, (T + 1,))  # t_0 .. t_T; the prompt is t_0 .. t_{P-1}
    feats = torch.randn(T, H).half()  # f_0 .. f_{T-1}, stored in fp16 as the data set is
    greedy = {"temperature": 0.0}

    def drafts(j: int) -> list[int]:  # what the proposer drafts having committed t_0 .. t_{j+1}
        from workers.sampling_params import SamplingParams

        prop = EagleProposer(head, target, num_slots=1, max_model_len=64, device="cpu")
        req = ProposalRequest(
            request_id="r",
            token_ids=toks[: j + 2].tolist(),
            num_prompt_tokens=P,
            k=K,
            eos_token_ids=frozenset(),
            sampling=SamplingParams(**greedy),
            hidden_states=feats[: j + 1].float(),
        )
        return prop.propose([req]).draft_token_ids[0]

    for j0, keep in ((P - 1, K), (P + 5, 2), (P + 12, K)):  # plant hits; each anchor reads only earlier tokens
        d = drafts(j0)
        toks[j0 + 2 : j0 + 2 + keep] = torch.tensor(d[:keep])
        if keep < K:
            toks[j0 + 2 + keep] = (d[keep] + 1) % V
    ref = []
    for j in range(P - 1, T - K):  # anchors whose K drafts all have a token in the sequence
        d = drafts(j)
        n = 0
        while n < K and d[n] == int(toks[j + 2 + n]):
            n += 1
        ref.append(n)
    assert ref.count(K) >= 2 and 2 in ref  # the planted anchors hit, so the comparison can fail
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    got = heldout_acceptance(head, embed, lm_head, [Seq(toks, feats, P)], K)
    assert got["anchors"] == len(ref)
    assert abs(got["mean_acceptance_length"] - (1 + sum(ref) / len(ref))) < 1e-9
