"""engine.kv_cache_dtype: a bf16 model's keys and values are bf16 values, so a bf16 KV cache holds them
exactly. Logits are ``torch.equal`` between an fp32 and a bf16 cache on every attention path (native,
torch fallback, SDPA), over whole and chunked prefills, verify-shaped steps and neighbours on scattered
blocks; the pool holds twice the tokens per GiB; bf16 KV under fp32 weights is refused at config time."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from tests.test_engine import rand_prompts
from workers import native_attention
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.runner import ModelRunner, StepBatch

pytestmark = pytest.mark.usefixtures("one_thread")


def _steps(r: ModelRunner, seed: int) -> list[StepBatch]:
    """One request's prompt whole, another's in chunks, then verify-shaped steps, each beside neighbours of
    random sizes: every request's blocks drawn at random from the pool (one table per request)."""
    rng = random.Random(seed)
    vocab, nb = r.vocab_size, r.blocks_per_seq
    blocks = rng.sample(range(r.num_blocks), r.num_blocks)
    tables = [blocks[i * nb : (i + 1) * nb] for i in range(r.num_blocks // nb)]  # disjoint, scattered
    ids = [[rng.randrange(3, vocab) for _ in range(48)] for _ in tables]
    steps = [StepBatch([-1], [0], [ids[0][:40]], [list(range(40))], block_tables=[tables[0]])]

    def with_neighbours(start: int, toks: list[int], table: list[int]) -> StepBatch:
        others = rng.sample(range(2, len(tables)), rng.randrange(0, len(tables) - 2))
        starts = [rng.randrange(0, 30) for _ in others]
        feeds = [ids[o][s : s + rng.choice([1, 1, 3, 9])] for o, s in zip(others, starts)]
        return StepBatch(
            [-1] * (1 + len(others)),
            [start] + starts,
            [toks] + feeds,
            [list(range(len(toks)))] + [[len(f) - 1] for f in feeds],
            block_tables=[table] + [tables[o] for o in others],
        )

    for pos in range(0, 40, 7):  # chunked prefill of the second request
        steps.append(with_neighbours(pos, ids[1][pos : min(pos + 7, 40)], tables[1]))
    for pos, k in ((40, 3), (42, 1), (43, 4)):  # verify steps of the first: rows past 40 are drafts
        steps.append(with_neighbours(pos, ids[0][pos : pos + k + 1], tables[0]))
    return steps


def _logits(r: ModelRunner, steps: list[StepBatch]) -> list[torch.Tensor]:
    return [r.forward(b).logits for b in steps]


@pytest.mark.parametrize("path", ["native", "torch", "sdpa"])
def test_bf16_kv_gives_the_fp32_kv_logits_of_a_bf16_model(tiny_loaded, path, monkeypatch):
    if path == "torch":
        monkeypatch.setenv(native_attention.ENV_DISABLE, "0")
    native_attention.clear_cache()
    try:
        runners = [
            ModelRunner(
                tiny_loaded.model,
                num_slots=6,
                max_model_len=64,
                dtype=torch.bfloat16,
                batch_invariant=path != "sdpa",
                kv_dtype=kv,
            )
            for kv in (torch.float32, torch.bfloat16)
        ]
        f32, bf16 = runners
        want = "native" if path == "native" and native_attention.load() is not None else path
        if want != f32.attention_kernel:
            pytest.skip(f"no {path} attention here")
        assert bf16.kv_dtype == torch.bfloat16 and bf16.kv_bytes * 2 == f32.kv_bytes
        steps = _steps(f32, seed=3)
        a, b = _logits(f32, steps), _logits(bf16, steps)
        for i, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"step {i}"
        for kc, kb, vc, vb in zip(f32.k_cache, bf16.k_cache, f32.v_cache, bf16.v_cache):
            assert torch.equal(kb.float(), kc) and torch.equal(vb.float(), vc)  # the same values, half the bytes
    finally:
        monkeypatch.undo()
        native_attention.clear_cache()


def _engine(loaded, kv_cache_dtype: str, tokens: int, **kw) -> LLMEngine:
    # the tiny model: 2 layers x (k, v) x 2 kv heads x 16 head_dim = 128 values per token
    cfg = EngineConfig(
        dtype="bfloat16",
        kv_cache_dtype=kv_cache_dtype,
        max_num_seqs=8,
        max_model_len=128,
        kv_cache_memory_gb=tokens * 128 * 4 / 2**30,
        num_speculative_tokens=3,
        **kw,
    )
    return LLMEngine(cfg, loaded)


@pytest.mark.parametrize(
    "params",
    [{"max_tokens": 32, "ignore_eos": True}, {"max_tokens": 32, "ignore_eos": True, "temperature": 0.8, "seed": 3}],
    ids=["greedy", "seeded"],
)
def test_engine_output_is_the_same_with_twice_the_tokens_per_gib(tiny_loaded, params):
    prompts = rand_prompts(5, 31, 8, 30)
    f32 = _engine(tiny_loaded, "float32", 160)  # 10 blocks: preempts
    auto = _engine(tiny_loaded, "auto", 160)  # the model's dtype, bf16: 20 blocks in the same bytes
    assert auto.runner.kv_dtype == torch.bfloat16 and f32.runner.kv_dtype == torch.float32
    assert auto.kv.num_blocks == 2 * f32.kv.num_blocks == 20
    assert auto.runner.kv_bytes == f32.runner.kv_bytes
    assert auto.generate(prompts, params) == f32.generate(prompts, params)


def test_bf16_kv_under_an_fp32_model_is_refused_naming_the_key(tiny_loaded, monkeypatch):
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(dtype="float32", kv_cache_dtype="bfloat16")
    assert EngineConfig(dtype="float32", kv_cache_dtype="float32").kv_cache_dtype == "float32"
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="float16")
    # dtype auto resolved to fp32 on this hardware: refused when the engine starts, naming the key
    monkeypatch.setattr("workers.engine.resolve_dtype", lambda name, device, cpu_gemm="auto": torch.float32)
    with pytest.raises(ValueError, match="engine.kv_cache_dtype"):
        LLMEngine(EngineConfig(kv_cache_dtype="bfloat16", proposers=[]), tiny_loaded)
    with pytest.raises(ValueError, match="kv_dtype"):
        ModelRunner(tiny_loaded.model, 1, 64, kv_dtype=torch.float16)
