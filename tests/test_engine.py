"""The plain engine: HF-exact logits and greedy output, continuous batching, sampling, limits."""

from __future__ import annotations

import asyncio
import copy
import random
import threading

import pytest
import torch
from pydantic import ValidationError

from workers.async_engine import AsyncEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.errors import InvalidRequestError
from workers.runner import ModelRunner, StepBatch


def hf_greedy(model, prompt: list[int], n: int, stop_at_eos: bool = False) -> list[int]:
    """HF transformers' own greedy decoding: ``generate`` (stops at EOS), or, to run past EOS
    like ``ignore_eos``, HF's forward with its own KV cache in a plain argmax loop."""
    if stop_at_eos:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
        return out[0, len(prompt) :].tolist()
    toks, past, inp = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            o = model(inp, cache=past, use_cache=True)
            past = o.cache
            t = int(o.logits[0, -1].argmax())
            toks.append(t)
            inp = torch.tensor([[t]])
    return toks


# bf16 logits vs fp32, relative to the largest |logit| (tiny model: measured 0.020-0.022; wide vs narrow 0.007)
BF16_REL_TOL = 0.06


def rand_prompts(n: int, seed: int, lo: int = 3, hi: int = 40, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_runner_logits_match_hf_and_rollback(tiny_loaded):
    model = tiny_loaded.model
    r = ModelRunner(model, num_slots=4, max_model_len=256)
    ids = rand_prompts(1, 0, 30, 30)[0]
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]  # [30, V]
    # ragged: slot 2 prefills 20 tokens in two chunks while slot 0 prefills 7 in one step
    a = r.forward_tokens(2, 0, ids[:12])
    out = r.forward(StepBatch([2, 0], [12, 0], [ids[12:20], ids[:7]], [list(range(8)), [6]])).logits
    assert (a - ref[:12]).abs().max() < 1e-4
    assert (out[:8] - ref[12:20]).abs().max() < 1e-4
    assert (out[8] - ref[6]).abs().max() < 1e-4
    # decode 5 more, roll back 3 (move the length back) and re-decode: same logits
    step = [r.forward_tokens(2, 20 + i, [ids[20 + i]]) for i in range(5)]
    again = [r.forward_tokens(2, 22 + i, [ids[22 + i]]) for i in range(3)]
    for x, y in zip(step[2:], again):
        assert torch.equal(x, y)
    assert (torch.cat(step) - ref[20:25]).abs().max() < 1e-4


def test_long_prefill_runs_in_bounded_row_counts_and_matches_hf(tiny_loaded, monkeypatch):
    """A non-invariant runner multiplies at most ``_ONEDNN_MAX_ROWS`` rows at a time, padded to a
    multiple of 8 (so oneDNN's per-shape caches stay small), and a 150-token prefill still matches HF."""
    import workers.runner as runner_mod

    model = tiny_loaded.model
    r = ModelRunner(model, num_slots=1, max_model_len=256)
    ids = rand_prompts(1, 5, 150, 150)[0]
    seen: set[int] = set()
    kernel = r._linear_kernel
    monkeypatch.setattr(r, "_linear_kernel", lambda x, L, name: (seen.add(x.shape[0]), kernel(x, L, name))[1])
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]  # [150, V]
    out = r.forward_tokens(0, 0, ids)  # [150, V]
    assert (out - ref).abs().max() < 1e-4
    if r._packed:
        assert max(seen) <= runner_mod._ONEDNN_MAX_ROWS and seen == {64, 24}


def test_bf16_runner_tracks_fp32_in_one_and_many_row_steps(tiny_loaded):
    """bf16 one-row steps (bf16 weights) and many-row steps (which, on CPUs without native bf16
    GEMMs, multiply through fp32 packed copies of the same bf16 weights) both stay within bf16
    rounding of the fp32 forward, and agree with each other as closely."""
    model = tiny_loaded.model
    ids = rand_prompts(1, 3, 24, 24)[0]
    f32 = ModelRunner(model, num_slots=1, max_model_len=64).forward_tokens(0, 0, ids)  # [24, V]
    bf = ModelRunner(model, num_slots=2, max_model_len=64, dtype=torch.bfloat16)
    wide = bf.forward_tokens(0, 0, ids)  # one 24-row step
    narrow = torch.cat([bf.forward_tokens(1, i, [t]) for i, t in enumerate(ids)])  # 24 one-row steps
    scale = f32.abs().max().item()
    errs = [
        (wide - f32).abs().max().item() / scale,
        (narrow - f32).abs().max().item() / scale,
        (wide - narrow).abs().max().item() / scale,
    ]
    assert max(errs) < BF16_REL_TOL, errs


@pytest.mark.slow
def test_smollm2_logits_within_1e4_of_hf(smollm2_loaded):
    """The CPU matmul backends against HF's own forward, and against the fp64 forward.

    ``mkl`` makes the same F.linear calls as HF, so it must be within 1e-4 (it is bit-identical).
    ``onednn`` (the default) sums in another order, so the fair bar is accuracy: its error against
    the fp64 forward must be of the order of HF's own fp32 error (measured 8.5e-5 vs 4.1e-5).
    """
    model, tok = smollm2_loaded.model, smollm2_loaded.tokenizer
    ids = tok.encode("The history of the Roman empire is long and complicated, and")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
        ref64 = copy.deepcopy(model).double()(torch.tensor([ids])).logits[0]
    hf_err = (ref.double() - ref64).abs().max().item()
    exact = ModelRunner(model, num_slots=2, max_model_len=512, cpu_gemm="mkl").forward_tokens(1, 0, ids)
    assert (exact - ref).abs().max().item() < 1e-4
    fast = ModelRunner(model, num_slots=2, max_model_len=512).forward_tokens(1, 0, ids)
    assert (fast - ref).abs().max().item() < 3e-4
    assert (fast.double() - ref64).abs().max().item() < 4 * hf_err
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))
    native = ModelRunner(model, num_slots=2, max_model_len=512, cpu_gemm="native")
    if native.cpu_gemm == "native":  # the project's own linear kernel: the same bar as oneDNN's
        got = native.forward_tokens(1, 0, ids)
        assert (got.double() - ref64).abs().max().item() < 4 * hf_err
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three colors.",
    "Repeat exactly: the quick brown fox jumps over the lazy dog.",
    "What is 12 times 12?",
]


@pytest.mark.slow
def test_smollm2_greedy_identical_to_hf_generate(smollm2_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=8, max_model_len=512), smollm2_loaded)
    prompts = [eng.tokenize_chat([{"role": "user", "content": c}]) for c in CHAT]
    outs = eng.generate(prompts, {"max_tokens": 48})
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(smollm2_loaded.model, p, 48, stop_at_eos=True)
    # and past EOS, 48 tokens each, against HF's forward + cache
    outs = eng.generate(prompts, {"max_tokens": 48, "ignore_eos": True})
    for p, o in zip(prompts, outs):
        assert o == hf_greedy(smollm2_loaded.model, p, 48)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_tiny_continuous_batching_matches_hf(tiny_loaded, batch):
    """Requests join mid-flight and finish at different times; each output equals HF greedy alone."""
    eng = LLMEngine(
        EngineConfig(dtype="float32", max_num_seqs=batch, max_model_len=256, max_num_batched_tokens=32), tiny_loaded
    )
    prompts = rand_prompts(batch + 3, seed=batch)
    lens = [5 + (i * 7) % 19 for i in range(len(prompts))]
    outs: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    steps = 0
    while pending or eng.has_work():
        if pending and steps % 2 == 0:  # join every other step
            i = pending.pop(0)
            eng.add_request(f"r{i}", prompts[i], {"max_tokens": lens[i], "ignore_eos": True})
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.token_ids)
        steps += 1
    for i, p in enumerate(prompts):
        assert outs[f"r{i}"] == hf_greedy(tiny_loaded.model, p, lens[i]), i
    assert eng.runner is not None and not eng.running and eng.kv.num_free == eng.kv.num_blocks


def test_chunked_prefill_does_not_stall_running_requests(tiny_loaded):
    eng = LLMEngine(
        EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=512, max_num_batched_tokens=32), tiny_loaded
    )
    eng.add_request("short", rand_prompts(1, 1, 5, 5)[0], {"max_tokens": 20, "ignore_eos": True})
    eng.step()  # prefill + first token
    eng.add_request("long", rand_prompts(1, 2, 300, 300)[0], {"max_tokens": 2, "ignore_eos": True})
    for _ in range(5):  # the 300-token prompt needs ~10 steps of 31 tokens; "short" decodes every step
        outs = {o.request_id: o for o in eng.step()}
        assert len(outs["short"].token_ids) == 1
        assert eng.snapshot().tokens_last_step <= 32


def test_seeded_sampling_reproducible_across_batch_compositions(tiny_loaded):
    params = {"max_tokens": 24, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1234, "ignore_eos": True}
    prompt = rand_prompts(1, 3)[0]
    alone = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=8, max_model_len=256), tiny_loaded).generate(
        [prompt], params
    )[0]
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=8, max_model_len=256), tiny_loaded)
    others = rand_prompts(5, 4)
    crowd = eng.generate(others[:2] + [prompt] + others[2:], [params] and params)[2]
    assert crowd == alone
    other_seed = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=8, max_model_len=256), tiny_loaded).generate(
        [prompt], {**params, "seed": 99}
    )[0]
    assert other_seed != alone


def test_max_tokens_and_stop_strings_exact(tiny_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=256), tiny_loaded)
    prompt = rand_prompts(1, 5)[0]
    full = eng.generate([prompt], {"max_tokens": 30, "ignore_eos": True})[0]
    assert len(full) == 30
    text = eng.tokenizer.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip() and stop in text
    eng.add_request("s", prompt, {"max_tokens": 30, "ignore_eos": True, "stop": [stop]})
    chunks, reason = [], None
    while eng.has_work():
        for o in eng.step():
            chunks.append(o.text)
            reason = o.finish_reason if o.finished else reason
    assert reason == "stop"
    assert "".join(chunks) == text[: text.index(stop)]


def test_bad_input_named_and_engine_keeps_serving(tiny_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=128), tiny_loaded)
    good = rand_prompts(1, 6)[0]
    eng.add_request("ok", good, {"max_tokens": 8, "ignore_eos": True})
    cases = [
        ([], {}, "prompt"),
        ([5] * 200, {}, "prompt"),
        (good, {"max_tokens": 0}, "max_tokens"),
        (good, {"max_tokens": 1000}, "max_tokens"),
        (good, {"temperature": -1}, "temperature"),
        (good, {"top_p": 0}, "top_p"),
        (good, {"top_p": 1.5}, "top_p"),
        ([1, 2, 10**9], {}, "prompt"),
        ([-1], {}, "prompt"),
        (good, {"bogus": 1}, "bogus"),
    ]
    for i, (p, params, field) in enumerate(cases):
        with pytest.raises(InvalidRequestError) as ei:
            eng.add_request(f"bad{i}", p, params)
        assert ei.value.param == field, (params, ei.value)
        assert field in str(ei.value) or field == "prompt"
    with pytest.raises(InvalidRequestError):
        eng.add_request("ok2", good, {}, proposer="nope")
    # every request handed over counts, rejected ones too: the Router matches the count against what it sent
    assert eng.snapshot().handed == 2 + len(cases) and eng.snapshot().waiting == 1
    out = []
    while eng.has_work():
        out += [t for o in eng.step() for t in o.token_ids]
    assert out == hf_greedy(tiny_loaded.model, good, 8)


def test_cancellation_frees_kv_at_once(tiny_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=128), tiny_loaded)
    p = rand_prompts(3, 7)
    for i in range(3):
        eng.add_request(f"r{i}", p[i], {"max_tokens": 50, "ignore_eos": True})
    eng.step()
    assert eng.snapshot().running == 2 and eng.snapshot().waiting == 1
    out = eng.abort("r0")
    assert out.finished and out.finish_reason == "abort"
    snap = eng.snapshot()
    assert snap.running == 1 and eng.kv.num_used == len(eng.requests["r1"].block_table)
    eng.abort("r2")  # a waiting request can be cancelled too
    assert eng.snapshot().waiting == 0
    eng.abort("r1")
    assert eng.snapshot().running == 0 and eng.snapshot().kv_tokens_in_use == 0 and not eng.has_work()


def test_admission_waits_when_full(tiny_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=128), tiny_loaded)
    prompts = rand_prompts(5, 8)
    outs = eng.generate(prompts, {"max_tokens": 6, "ignore_eos": True})
    assert all(len(o) == 6 for o in outs)


def test_async_engine_streams_and_cancels(tiny_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=256), tiny_loaded)
    ae = AsyncEngine(eng)
    prompt = rand_prompts(1, 9)[0]

    async def main():
        toks = []
        async for o in ae.generate("a", prompt, params={"max_tokens": 12, "ignore_eos": True}):
            toks += o.token_ids
        assert toks == hf_greedy(tiny_loaded.model, prompt, 12)
        with pytest.raises(InvalidRequestError):
            async for _ in ae.generate("b", [], params={}):
                pass
        gen = ae.generate("c", prompt, params={"max_tokens": 200, "ignore_eos": True})
        await gen.__anext__()
        await gen.aclose()  # consumer goes away: the engine aborts the request
        for _ in range(100):
            if (await ae.call(lambda e: e.snapshot())).running == 0:
                break
            await asyncio.sleep(0.02)
        assert (await ae.call(lambda e: e.snapshot())).running == 0

    try:
        asyncio.run(main())
        assert ae.healthy()
    finally:
        ae.shutdown()


def test_slow_stream_consumer_gets_the_backlog_as_one_chunk(tiny_loaded):
    """A consumer that falls behind receives merged chunks, and no token or text is lost."""
    import asyncio

    from workers.async_engine import AsyncEngine

    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=128), tiny_loaded)
    want = eng.generate([[5, 6, 7]], {"max_tokens": 24, "temperature": 0, "ignore_eos": True})[0]
    ae = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=128), tiny_loaded))
    try:

        async def consume() -> list:
            chunks = []
            async for o in ae.generate(
                "slow", [5, 6, 7], params={"max_tokens": 24, "temperature": 0, "ignore_eos": True}
            ):
                chunks.append(o)
                await asyncio.sleep(0.05)  # slower than the tiny model's steps
            return chunks

        chunks = asyncio.run(consume())
    finally:
        ae.shutdown()
    assert [t for c in chunks for t in c.token_ids] == want
    assert len(chunks) < len(want)  # merged: fewer messages than tokens
    assert chunks[-1].finished and chunks[-1].num_output_tokens == 24


def test_stream_interval_sends_fewer_chunks_with_the_same_tokens_text_and_logprobs(tiny_loaded, monkeypatch):
    """stream_interval N: the first token without waiting for N, then chunks of at least N tokens (the last may be
    shorter); merged chunks keep every token, the text and every logprob. The engine thread merges them before the
    hand-off, so the consumer's loop is woken once per chunk, not once per step."""
    import asyncio

    from workers.async_engine import AsyncEngine

    params = {"max_tokens": 23, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    handoffs = [0]
    put = asyncio.Queue.put_nowait

    def counted(self, item):
        handoffs[0] += 1
        return put(self, item)

    monkeypatch.setattr(asyncio.Queue, "put_nowait", counted)

    def run(interval: int) -> list:
        handoffs[0] = 0
        ae = AsyncEngine(
            LLMEngine(
                EngineConfig(
                    dtype="float32", max_num_seqs=2, max_model_len=128, proposers=[], stream_interval=interval
                ),
                tiny_loaded,
            )
        )
        try:

            async def consume() -> list:
                return [o async for o in ae.generate("s", [5, 6, 7], params=params)]

            return asyncio.run(consume())
        finally:
            ae.shutdown()

    one = run(1)
    assert handoffs[0] == 23  # one step, one token, one hand-off
    four = run(4)
    assert handoffs[0] <= 1 + -(-22 // 4)
    # A consumer that falls behind the engine (a loaded machine) takes the backlog as one chunk, so the
    # chunk counts are upper bounds; the tokens, text and logprobs are exact whatever the timing.
    assert sum(len(c.token_ids) for c in one) == 23 and len(one) <= 23 and len(four[0].token_ids) >= 1
    assert all(len(c.token_ids) >= 4 for c in four[1:-1]) and len(four) <= 1 + -(-22 // 4)
    for a, b in [(one, four)]:
        assert [t for c in a for t in c.token_ids] == [t for c in b for t in c.token_ids]
        assert "".join(c.text for c in a) == "".join(c.text for c in b)
        assert [e for c in a for e in c.logprobs] == [e for c in b for e in c.logprobs]


def test_async_engine_builds_from_a_factory_in_its_loop_thread(tiny_loaded):
    """The Serve replica hands AsyncEngine a factory so that model load, weight packing and every
    step run in one thread (one OpenMP pool: see AsyncEngine); a factory error reaches the caller."""
    built_in: list[str] = []

    def build() -> LLMEngine:
        built_in.append(threading.current_thread().name)
        return LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=128), tiny_loaded)

    ae = AsyncEngine(build)
    try:
        prompt = rand_prompts(1, 5)[0]

        async def run() -> list[int]:
            return [
                t
                async for o in ae.generate("f", prompt, params={"max_tokens": 6, "ignore_eos": True})
                for t in o.token_ids
            ]

        assert asyncio.run(run()) == hf_greedy(tiny_loaded.model, prompt, 6)
        assert built_in == ["engine-loop"] and ae.snapshot().running == 0
    finally:
        ae.shutdown()

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)


def test_decode_steps_in_one_call_write_what_single_steps_write(tiny_loaded):
    """``decode_steps``: plain decoding runs several steps per engine iteration and writes, token for token and
    chunk text for chunk text, what one step per iteration writes: through a stop string and EOS found inside a
    call, max_tokens cut to the call, a request arriving meanwhile (prefilled between calls), seeded sampled
    requests beside them (temperature, top-p, top-k: each step's token raced with the noise of its position),
    and a penalized one (its steps one at a time, so every request's are then)."""
    prompts = rand_prompts(4, 11)

    def run(decode_steps: int) -> tuple[dict[str, tuple[list[int], str, str | None]], int, int]:
        eng = LLMEngine(
            EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=256, proposers=[], decode_steps=decode_steps),
            tiny_loaded,
        )
        if decode_steps > 1 and not eng.runner.runs_decode_steps:
            pytest.skip("no fused native forward here (no C compiler)")
        full = LLMEngine(EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=256, proposers=[]), tiny_loaded)
        text = full.tokenizer.decode(full.generate([prompts[1]], {"max_tokens": 40, "ignore_eos": True})[0])
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        # an end-of-sequence token the third request writes: its 13th (or an earlier one like it)
        eng.eos_token_ids = frozenset(full.generate([prompts[2]], {"max_tokens": 13, "ignore_eos": True})[0][-1:])
        eng.add_request("long", prompts[0], {"max_tokens": 37, "ignore_eos": True})
        eng.add_request("stop", prompts[1], {"max_tokens": 40, "ignore_eos": True, "stop": [stop]})
        eng.add_request("eos", prompts[2], {"max_tokens": 60})
        eng.add_request("t1", prompts[0], {"max_tokens": 30, "ignore_eos": True, "temperature": 1.0, "seed": 5})
        eng.add_request("top_p", prompts[1], {"max_tokens": 33, "ignore_eos": True, "temperature": 0.8, "top_p": 0.9})
        eng.add_request("top_k", prompts[2], {"max_tokens": 26, "temperature": 1.3, "top_k": 7, "seed": 9})
        eng.requests["top_p"].seed = 11  # an unseeded request's drawn seed, the same in both runs
        got: dict[str, tuple[list[int], str, str | None]] = {}
        calls = 0
        while eng.has_work():
            calls += 1
            if calls == 4:
                eng.add_request("late", prompts[3], {"max_tokens": 21, "ignore_eos": True})
            if calls == 9:
                eng.add_request("penalized", prompts[3], {"max_tokens": 6, "temperature": 0.9, "seed": 3,
                                                          "frequency_penalty": 0.5})  # fmt: skip
            for o in eng.step():
                ids, txt, _ = got.get(o.request_id, ([], "", None))
                got[o.request_id] = (ids + o.token_ids, txt + o.text, o.finish_reason)
        return got, calls, eng.num_steps

    one, calls_one, _ = run(1)
    many, calls_many, steps_many = run(6)
    assert many == one
    assert one["stop"][2] == one["eos"][2] == "stop" and len(one["long"][0]) == 37 and len(one["late"][0]) == 21
    assert len(one["t1"][0]) == 30 and len(one["top_p"][0]) == 33
    assert calls_many < calls_one and steps_many > calls_many  # iterations that ran several steps each

    def sampled_alone(decode_steps: int) -> tuple[list[int], int, int]:
        eng = LLMEngine(
            EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=256, proposers=[], decode_steps=decode_steps),
            tiny_loaded,
        )
        eng.add_request("s", prompts[0], {"max_tokens": 24, "ignore_eos": True, "temperature": 1.0, "seed": 2})
        tokens, calls = [], 0
        while eng.has_work():
            calls += 1
            tokens += [t for o in eng.step() for t in o.token_ids]
        return tokens, calls, eng.num_steps

    alone_one, alone_calls_one, _ = sampled_alone(1)
    alone_many, alone_calls, alone_steps = sampled_alone(6)
    assert alone_many == alone_one and alone_calls < alone_calls_one and alone_steps > alone_calls  # sampled, too


def test_sampled_decode_steps_race_in_the_native_call_and_hand_near_ties_to_the_definition(tiny_loaded, monkeypatch):
    """Sampled requests (temperature only, and top-k; beside greedy ones) run their decode_steps as one native
    call that races each row itself: no pick between the steps. Where a race cannot decide (forced here for
    every temperature-only row: too many candidates) the call ends at that step and the definition picks its
    tokens. Either way the tokens are those of one step per iteration."""
    from workers import sampler
    from workers.output_processor import OutputProcessor

    prompts = rand_prompts(3, 12)
    picks = [0]
    plain_picks = OutputProcessor.plain_picks

    def counted(self, requests):
        pick = plain_picks(self, requests)

        def wrapped(step, logits, argmax):
            picks[0] += 1
            return pick(step, logits, argmax)

        return wrapped

    monkeypatch.setattr(OutputProcessor, "plain_picks", counted)

    def run(decode_steps: int) -> tuple[dict[str, list[int]], int, int]:
        eng = LLMEngine(
            EngineConfig(dtype="bfloat16", max_num_seqs=8, max_model_len=256, proposers=[], decode_steps=decode_steps),
            tiny_loaded,
        )
        if decode_steps > 1 and not eng.runner.runs_decode_steps:
            pytest.skip("no fused native forward here (no C compiler)")
        eng.add_request("t1", prompts[0], {"max_tokens": 30, "ignore_eos": True, "temperature": 1.0, "seed": 4})
        eng.add_request("t07", prompts[1], {"max_tokens": 25, "ignore_eos": True, "temperature": 0.7, "seed": 8})
        eng.add_request("greedy", prompts[2], {"max_tokens": 28, "ignore_eos": True})
        eng.add_request("top_k", prompts[0], {"max_tokens": 27, "ignore_eos": True, "temperature": 0.9, "top_k": 20,
                                              "seed": 6})  # fmt: skip
        picks[0] = 0
        got: dict[str, list[int]] = {}
        calls = 0
        while eng.has_work():
            calls += 1
            for o in eng.step():
                got[o.request_id] = got.get(o.request_id, []) + o.token_ids
        return got, calls, picks[0]

    one, calls_one, _ = run(1)
    raced, calls_raced, picks_raced = run(6)
    assert raced == one and calls_raced < calls_one
    assert picks_raced == 0  # every step's tokens came from the native races
    # every entry a candidate, more than a race may weigh: no race decides, each call's first step is handed over
    monkeypatch.setattr(sampler, "_RACE_MARGIN", 1.0)
    handed, calls_handed, picks_handed = run(6)
    assert handed == one and picks_handed > 0 and calls_handed == calls_one  # one step an iteration, as handed over
    with pytest.raises(ValidationError, match="decode_steps"):
        EngineConfig(decode_steps=0)
