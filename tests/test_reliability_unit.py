"""Fast reliability checks without a cluster (issue 7): a wedged or dead engine loop fails the
health check; the draft's per-request state is released when a request ends (also after a
failed draft call) and swept when nobody will ever release it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from workers.async_engine import AsyncEngine
from workers.config import EngineConfig
from workers.engine import LLMEngine
from workers.errors import EngineDeadError
from workers.proposers.base import ProposalRequest, Proposals, Proposer
from workers.sampling_params import SamplingParams


class WedgeProposer(Proposer):
    """Blocks inside ``propose`` until released (a stuck draft RPC, a deadlock); or raises."""

    name = "wedge"

    def __init__(self, fail: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = fail

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        self.entered.set()
        if self.fail:
            raise RuntimeError("proposer blew up")
        self.release.wait(30)
        return Proposals([[] for _ in requests], [None for _ in requests])


def _target_worker_with(engine: AsyncEngine):
    from deployments.target import TargetWorker

    tw = object.__new__(TargetWorker.func_or_class)  # only what check_health reads
    tw.engine = engine
    return tw


def test_check_health_fails_while_the_engine_loop_is_wedged_and_recovers(tiny_loaded):
    wedge = WedgeProposer()
    ae = AsyncEngine(
        LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=128), tiny_loaded, proposers={"wedge": wedge})
    )
    tw = _target_worker_with(ae)
    try:
        time.sleep(0.1)
        assert ae.healthy(stall_s=0.05)  # idle: the loop keeps ticking
        tw.check_health()

        async def main():
            out = []
            async for o in ae.generate(
                "r", [1, 2, 3, 4], params={"max_tokens": 4, "ignore_eos": True}, speculation="on"
            ):
                out += o.token_ids
            return out

        result: dict = {}
        t = threading.Thread(target=lambda: result.setdefault("out", asyncio.run(main())), daemon=True)
        t.start()
        assert wedge.entered.wait(30)
        time.sleep(0.3)
        assert not ae.healthy(stall_s=0.2)  # stuck inside a step: no iteration for 0.3 s
        ae.last_progress -= 60  # as if wedged for a minute (check_health's threshold is 30 s)
        with pytest.raises(RuntimeError, match="wedged"):
            tw.check_health()
        wedge.release.set()  # unstuck: the loop moves on, the request finishes, health comes back
        t.join(30)
        assert len(result["out"]) == 4
        assert ae.healthy(stall_s=1.0)
        tw.check_health()
    finally:
        wedge.release.set()
        ae.shutdown()


def test_check_health_fails_when_the_engine_loop_died(tiny_loaded):
    ae = AsyncEngine(
        LLMEngine(
            EngineConfig(max_num_seqs=2, max_model_len=128), tiny_loaded, proposers={"wedge": WedgeProposer(fail=True)}
        )
    )
    tw = _target_worker_with(ae)
    try:

        async def main():
            async for _ in ae.generate("r", [1, 2, 3], params={"max_tokens": 4}, speculation="on"):
                pass

        with pytest.raises(EngineDeadError):
            asyncio.run(main())
        assert ae.dead is not None and not ae.healthy()
        with pytest.raises(RuntimeError):
            tw.check_health()
    finally:
        ae.shutdown()


def test_a_dead_engine_loop_fails_pending_and_later_calls_within_a_second(tiny_loaded):
    """A stats call queued behind a step that dies, a stream, and any later call or request all fail
    with EngineDeadError at once instead of awaiting a loop that will never answer."""
    wedge = WedgeProposer(fail=True)
    wedge.fail = False  # first block inside the step, then blow up
    ae = AsyncEngine(
        LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=128), tiny_loaded, proposers={"wedge": wedge})
    )

    def blow_up(requests):
        wedge.entered.set()
        wedge.release.wait(30)
        raise RuntimeError("proposer blew up")

    wedge.propose = blow_up
    try:

        async def main():
            async def stream():
                async for _ in ae.generate("r", [1, 2, 3], params={"max_tokens": 4}, speculation="on"):
                    pass

            streaming = asyncio.create_task(stream())
            while not wedge.entered.is_set():
                await asyncio.sleep(0.01)
            pending = asyncio.create_task(ae.call(lambda e: e.snapshot()))  # queued behind the stuck step
            await asyncio.sleep(0.05)
            assert not pending.done()
            wedge.release.set()  # the step raises: the loop dies
            t0 = time.monotonic()
            for task in (pending, streaming):
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(task, 1.0)
            assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await ae.call(lambda e: e.snapshot())
            with pytest.raises(EngineDeadError):
                async for _ in ae.generate("later", [1, 2], params={"max_tokens": 2}):
                    pass
            assert time.monotonic() - t0 < 1.0

        asyncio.run(main())
        assert not ae.healthy()
    finally:
        wedge.release.set()
        ae.shutdown()


def test_a_request_cancelled_while_its_admission_is_in_flight_leaves_no_slot(tiny_loaded):
    """The add_request command may already be queued when the caller is cancelled: it is followed by
    an abort, so the request never holds a KV slot nobody reads."""
    ae = AsyncEngine(LLMEngine(EngineConfig(max_num_seqs=2, max_model_len=128), tiny_loaded))
    try:

        async def main():
            gate = threading.Event()
            blocker = asyncio.create_task(ae.call(lambda e: gate.wait(5)))  # the loop is busy with this
            await asyncio.sleep(0.05)

            async def consume():
                async for _ in ae.generate("c", [1, 2, 3], params={"max_tokens": 50, "ignore_eos": True}):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.05)  # its add_request is queued behind the blocker
            task.cancel()
            gate.set()
            await blocker
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                snap = await ae.call(lambda e: e.snapshot())
                if snap.running == 0 and snap.waiting == 0:
                    break
                await asyncio.sleep(0.02)
            assert snap.running == 0 and snap.waiting == 0
            assert await ae.call(lambda e: "c" not in e.requests)

        asyncio.run(main())
    finally:
        ae.shutdown()


# ----------------------------------------------------------------------------- draft state


class _Resp:
    def __init__(self, fn, args):
        try:
            self.value, self.exc = fn(*args), None
        except Exception as e:  # noqa: BLE001
            self.value, self.exc = None, e

    def result(self, timeout_s=None):
        if self.exc is not None:
            raise self.exc
        return self.value


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return _Resp(self.fn, args)


class FakeDraftHandle:
    """Stands in for the DraftWorker handle: tracks which request ids the draft holds."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.down = False
        self.propose = _Method(self._propose)
        self.release = _Method(self._release)

    def _propose(self, batch, released):
        if self.down:
            raise TimeoutError("draft call timed out")
        self._release(released)
        out = []
        for m in batch:
            if m["offset"] != self.held.get(m["request_id"], 0):
                self.held.pop(m["request_id"], None)
                out.append({"resync": True})
                continue
            self.held[m["request_id"]] = m["offset"] + len(m["new_tokens"])
            out.append({"draft_token_ids": [7] * m["k"], "draft_probs": None})
        return out

    def _release(self, ids):
        for rid in ids:
            self.held.pop(rid, None)


def _req(rid: str, n: int) -> ProposalRequest:
    return ProposalRequest(request_id=rid, token_ids=list(range(1, n + 1)), num_prompt_tokens=3, k=2)


def test_remote_draft_releases_at_finish_without_waiting_for_another_call():
    from deployments.remote_draft import RemoteDraftProposer

    h = FakeDraftHandle()
    p = RemoteDraftProposer(h, timeout_s=1.0, retry_after_s=0.0)
    assert p.propose([_req("a", 4), _req("b", 4)]).draft_token_ids == [[7, 7], [7, 7]]
    assert set(h.held) == {"a", "b"}
    p.finish("a", [])
    assert set(h.held) == {"b"}  # freed at once, no further propose needed
    # the draft stops answering: the step runs plain, and "b" is still released when it ends
    h.down = True
    assert p.propose([_req("b", 5)]).draft_token_ids == [[]]
    p.finish("b", [])
    assert h.held == {}


def test_remote_draft_resyncs_after_a_failed_call():
    from deployments.remote_draft import RemoteDraftProposer

    h = FakeDraftHandle()
    p = RemoteDraftProposer(h, timeout_s=1.0, retry_after_s=0.0)
    p.propose([_req("a", 4)])
    h.down = True
    p.propose([_req("a", 5)])  # fails
    h.down = False
    assert p.propose([_req("a", 6)]).draft_token_ids == [[]]  # offset 0 != what the draft holds: resync
    assert p.propose([_req("a", 6)]).draft_token_ids == [[7, 7]]  # whole sequence sent again
    assert h.held == {"a": 6}


class _LoopOnlyMethod:
    """A handle method as Serve makes it when it routes on the caller's loop: a call from any other
    thread raises, and the response is awaited there."""

    def __init__(self, fn, loop, delay_s: float = 0.0) -> None:
        self.fn, self.loop, self.delay_s, self.cancelled = fn, loop, delay_s, 0

    def remote(self, *args):
        if asyncio.get_running_loop() is not self.loop:  # raises too when no loop runs in this thread
            raise RuntimeError("not on the handle's loop")

        async def answer():
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            return self.fn(*args)

        return self.loop.create_task(answer())


def test_remote_draft_makes_its_handle_calls_on_the_replicas_loop():
    """From the engine thread, given the replica's loop: propose and release run there, and a call
    slower than ``timeout_s`` makes the step plain and is cancelled, not left running."""
    from deployments.remote_draft import RemoteDraftProposer

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        h = FakeDraftHandle()
        h.propose, h.release = _LoopOnlyMethod(h._propose, loop), _LoopOnlyMethod(h._release, loop)
        p = RemoteDraftProposer(h, timeout_s=0.5, retry_after_s=0.0, loop=loop)
        assert p.propose([_req("a", 4), _req("b", 4)]).draft_token_ids == [[7, 7], [7, 7]]
        p.finish("a", [])
        deadline = time.monotonic() + 5
        while "a" in h.held and time.monotonic() < deadline:
            time.sleep(0.01)
        assert set(h.held) == {"b"}
        h.propose.delay_s = 2.0
        t0 = time.monotonic()
        assert p.propose([_req("b", 5)]).draft_token_ids == [[]]  # timed out: a plain step
        assert time.monotonic() - t0 < 1.5 and p.num_failures == 1
        deadline = time.monotonic() + 5
        while not h.propose.cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert h.propose.cancelled == 1
        # without the loop, the same handle refuses the engine thread's call: a plain step as well
        assert RemoteDraftProposer(h, timeout_s=0.5).propose([_req("c", 4)]).draft_token_ids == [[]]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
    # the replica's loop closed under the engine thread (shutdown): finishing neither raises nor loses the id
    loop.close()
    p.finish("b", [])
    assert p._released == ["b"]
    assert p.propose([_req("d", 4)]).draft_token_ids == [[]]  # and a draft call makes the step plain


def test_draft_worker_sweeps_state_nobody_releases(tiny_model_dir, monkeypatch):
    from deployments.draft import DraftWorker

    monkeypatch.setattr("ray.serve.get_replica_context", lambda: None)  # not inside a Serve replica here
    cfg = {
        "engine": {"model": tiny_model_dir, "max_model_len": 128},
        "draft": {"model": "target", "max_num_seqs": 4, "state_ttl_s": 0.3},
    }
    w = DraftWorker.func_or_class(cfg)

    def msg(rid: str) -> dict:
        return {
            "request_id": rid,
            "offset": 0,
            "new_tokens": [1, 2, 3, 4],
            "num_prompt_tokens": 4,
            "k": 2,
            "eos_token_ids": [],
            "sampling": SamplingParams().model_dump(),
        }

    w.propose([msg("orphan"), msg("live")], [])
    assert w.stats()["active"] == 2 and w.stats()["kv_tokens_in_use"] == 2 * (4 + 1)  # prompt + draft 0 fed
    assert w.stats()["kv_blocks_in_use"] == 2  # one block of 16 each: KV follows the tokens in use
    w.release(["live"])  # released by its target: freed at once
    assert w.stats()["active"] == 1
    t0 = time.monotonic()
    while w.stats()["active"] and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    s = w.stats()
    assert s["active"] == 0 and s["kv_tokens_in_use"] == 0 and s["swept"] == 1 and s["known"] == 0
    assert s["kv_blocks_in_use"] == 0  # the sweep gave the blocks back
    # a request that was only idle resyncs on its next call (its offset no longer matches)
    assert w.propose([{**msg("orphan"), "offset": 4, "new_tokens": [5]}], []) == [{"resync": True}]


# ----------------------------------------------------------------------------- resumed streams


class _Gen:
    """A target call's stream: the given chunks, then an exception (a replica that dies) or the end."""

    def __init__(self, chunks: list[dict], fail: BaseException | None = None) -> None:
        self.chunks, self.fail, self.cancelled = list(chunks), fail, False

    async def __anext__(self) -> dict:
        if self.chunks:
            return self.chunks.pop(0)
        if self.fail is not None:
            raise self.fail
        raise StopAsyncIteration

    def cancel(self) -> None:
        self.cancelled = True


def _chunk(ids: list[int], replica: str, finished: bool = False) -> dict:
    return {"token_ids": ids, "text": "", "finished": finished, "seed": 1234, "replica_id": replica}


def test_a_stream_whose_replica_dies_is_resubmitted_with_what_was_sent():
    from deployments.resume import ResumableStream

    calls: list[tuple[dict, bool, str | None]] = []
    gens = [
        _Gen([_chunk([1], "a"), _chunk([2, 3], "a")], RuntimeError("ActorDiedError")),
        _Gen([_chunk([4], "b"), _chunk([5], "b", finished=True)]),
    ]

    async def submit(payload, resubmission, failed):
        calls.append((payload, resubmission, failed))
        return gens[len(calls) - 1]

    async def main() -> list[int]:
        s = ResumableStream(submit, {"request_id": "x", "params": {"temperature": 1.0, "seed": None}}, 3)
        await s.start()
        return [t async for c in s for t in c["token_ids"]]

    assert asyncio.run(main()) == [1, 2, 3, 4, 5]
    (first, r0, f0), (again, r1, f1) = calls
    assert (r0, f0) == (False, None) and (r1, f1) == (True, "a")  # the failed replica is named
    assert again["resume_output_ids"] == [1, 2, 3] and again["params"]["seed"] == 1234  # the engine's drawn seed
    assert again["request_id"] != first["request_id"] and "resume_output_ids" not in first


def test_resubmissions_are_bounded_and_a_refused_one_fails_the_stream():
    from deployments.resume import ResumableStream

    async def always_dies(payload, resubmission, failed):
        return _Gen([], RuntimeError("ActorDiedError"))

    async def drain(submit, max_resumes: int) -> None:
        s = ResumableStream(submit, {"request_id": "x", "params": {}}, max_resumes)
        await s.start()
        async for _ in s:
            pass

    with pytest.raises(RuntimeError, match="ActorDiedError"):
        asyncio.run(drain(always_dies, 2))

    gens = [_Gen([_chunk([1], "a")], RuntimeError("ActorDiedError")), _Gen([{"error": {"message": "bad"}}])]

    async def refused(payload, resubmission, failed):
        return gens.pop(0)

    with pytest.raises(RuntimeError, match="resubmission refused"):
        asyncio.run(drain(refused, 3))


def test_draft_kv_budget_sizes_the_pools_and_too_small_a_budget_names_the_key(tiny_model_dir, monkeypatch):
    from deployments.draft import DraftWorker, draft_kv_blocks

    # 1 GiB over 6 KiB per token (two pools) = 174762 tokens = 10922 blocks of 16, capped at 4 x 8192 tokens
    assert draft_kv_blocks(1.0, [4608, 1536], 16, 8192, 4) == 4 * 512
    assert draft_kv_blocks(1.0, [4608, 1536], 16, 8192, 256) == 10922
    monkeypatch.setattr("ray.serve.get_replica_context", lambda: None)
    cfg = {"engine": {"model": tiny_model_dir, "max_model_len": 128}, "draft": {"model": "target", "max_num_seqs": 4}}
    w = DraftWorker.func_or_class({**cfg, "draft": {**cfg["draft"], "kv_cache_memory_gb": 0.00015}})
    assert w.stats()["kv_tokens_capacity"] == 19 * 16  # 512 B per token: budget-bound, not max_num_seqs x max_model_len
    with pytest.raises(ValueError, match=r"draft\.kv_cache_memory_gb=1e-05 .* engine\.max_model_len=128"):
        DraftWorker.func_or_class({**cfg, "draft": {**cfg["draft"], "kv_cache_memory_gb": 1e-5}})
