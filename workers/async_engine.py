"""Asyncio front of the engine: one background thread runs ``LLMEngine.step`` in a loop.

Why a thread: a step is a blocking PyTorch forward (it releases the GIL), and the Serve
replica's event loop must stay free to accept requests and answer health checks while
it runs. The engine is touched only from its thread; other threads talk to it through a
command queue, so there are no locks around engine state. Cancelling the consumer of
``generate`` (a client disconnect) sends an abort, which frees the request's KV slot at
the next step boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, TypeVar

from workers import hardware
from workers.engine import LLMEngine, as_sampling_params
from workers.errors import EngineDeadError
from workers.request import RequestOutput
from workers.stats import LoadSnapshot

log = logging.getLogger(__name__)
T = TypeVar("T")
_IDLE_WAIT_S = 0.02


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``a`` then ``b`` (the same request, consecutive steps) as one chunk.

    Why: every chunk is a message through the Serve handle, the ingress and the HTTP proxy,
    each a process on the same few cores. When a consumer is slower than the engine (high
    concurrency on a small machine), sending the backlog as one chunk keeps that per-message
    cost from growing with the step rate, as vLLM's output processor does per iteration.
    """
    logprobs = None if a.logprobs is None and b.logprobs is None else (a.logprobs or []) + (b.logprobs or [])
    return dataclasses.replace(
        b,
        token_ids=a.token_ids + b.token_ids,
        text=a.text + b.text,
        logprobs=logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        first_token_time=a.first_token_time if a.first_token_time is not None else b.first_token_time,
    )


@dataclasses.dataclass
class _Stream:
    """One request's way out of the engine thread: its consumer's loop and queue, and (engine thread only) the
    outputs held back until they make a chunk."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    held: RequestOutput | None = None
    sent_first: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine], claim_cpu: bool = False) -> None:
        """``engine``: a built engine, or a factory that the loop thread calls to build one.
        ``claim_cpu``: the loop thread and its OpenMP pool run at normal priority ahead of the
        processes around it (:func:`workers.hardware.claim_cpu`); ``cpu_priority`` says what they got.

        Pass a factory wherever the step speed matters (the Serve replica). libgomp gives every
        thread that opens an OpenMP region its own worker pool, and once the process holds more
        OpenMP threads than CPUs it stops spinning between regions (100 spins, then a futex
        sleep), so each of the ~400 parallel ops of a step pays a wake-up. Building the engine
        (model load, weight packing) in the loop thread keeps that thread the only one that
        opens regions (the per-token cost of the alternatives is in docs/benchmarks.md).
        """
        self._cmds: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._wake = threading.Event()
        self._stop = False
        self.dead: BaseException | None = None
        self.last_progress = time.monotonic()  # last loop iteration; a wedged loop stops moving it
        self._claim_cpu = claim_cpu
        self.cpu_priority = "inherit"
        self._thread = threading.Thread(target=self._run, args=(engine,), name="engine-loop", daemon=True)
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error

    # ------------------------------------------------------------------ public, any thread / event loop

    @property
    def thread_id(self) -> int | None:
        """The loop thread's OS thread id."""
        return self._thread.native_id

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps (reconfigure, stats).

        Raises ``EngineDeadError`` at once when the loop is dead, and fails calls still queued
        when it dies, so no caller waits on a loop that will never answer."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((lambda: fn(self.engine), fut))
        self._wake.set()
        if self.dead is not None:  # it died between the check and the put: nobody will run this
            self._fail_pending()
        return await asyncio.wrap_future(fut)

    async def generate(self, request_id: str, prompt_ids: list[int], **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Submit a request and stream its outputs. Raises ``InvalidRequestError`` before the first chunk."""
        if self.dead is not None:
            raise EngineDeadError(f"engine loop died: {self.dead!r}")
        loop = asyncio.get_running_loop()
        params = kwargs["params"] = as_sampling_params(kwargs.get("params"))
        if params.structured is not None:  # compiled here, in a worker thread: a slow grammar never stalls a step
            kwargs["grammar"] = await loop.run_in_executor(None, self.engine.grammars.compile, params.structured)
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = _Stream(loop, q)
        try:
            await self.call(lambda e: e.add_request(request_id, prompt_ids, **kwargs))
        except BaseException as e:
            self._streams.pop(request_id, None)
            if isinstance(e, asyncio.CancelledError):  # the add may still run: abort after it (FIFO)
                self.abort(request_id)
            raise
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                # One chunk, not many: take what is already queued (this consumer fell behind the engine).
                while not item.finished and not q.empty():
                    nxt = q.get_nowait()
                    if isinstance(nxt, BaseException):
                        raise nxt
                    item = merge_outputs(item, nxt)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # consumer went away (disconnect, timeout): free its KV now
                self._cmds.put((lambda: self.engine.abort(request_id), concurrent.futures.Future()))
                self._wake.set()

    def abort(self, request_id: str) -> None:
        self._cmds.put((lambda: self.engine.abort(request_id), concurrent.futures.Future()))
        self._wake.set()

    def _fail_pending(self) -> None:
        """Fail every queued command (the loop is dead and will not run them)."""
        err = EngineDeadError(f"engine loop died: {self.dead!r}")
        while True:
            try:
                _, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if not fut.done():
                fut.set_exception(err)

    def snapshot(self) -> LoadSnapshot:
        """The load as of the last step (published by the loop thread, never older than one step)."""
        return self._snapshot

    def healthy(self, stall_s: float = 30.0) -> bool:
        """False when the loop died or has not completed an iteration in ``stall_s`` (wedged)."""
        return self.dead is None and (time.monotonic() - self.last_progress) < stall_s

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ engine thread

    def _deliver(self, rid: str, item: Any) -> None:
        """Hand ``item`` (a step's output, or an error) to its stream's loop. After a stream's first token, outputs
        are merged here, in the engine thread, until they hold ``stream_interval`` tokens: each hand-off wakes the
        replica's event loop, whose CPU time on a node where the engine holds every core stretches the steps."""
        s = self._streams.get(rid)
        if s is None:
            return
        if isinstance(item, RequestOutput):
            if s.held is not None:
                item, s.held = merge_outputs(s.held, item), None
            if s.sent_first and not item.finished and len(item.token_ids) < self.engine.config.stream_interval:
                s.held = item
                return
            s.sent_first = s.sent_first or bool(item.token_ids)
        try:
            s.loop.call_soon_threadsafe(s.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed
            pass

    def _run(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        # before the engine is built: the OpenMP pool its first parallel op starts inherits this
        self.cpu_priority = (
            hardware.claim_cpu() if self._claim_cpu else hardware.thread_priority(threading.get_native_id())
        )
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
            self._snapshot = self.engine.snapshot()  # here: only this thread touches the engine
        except BaseException as e:
            self._build_error = e
            return
        finally:
            self._ready.set()
        eng = self.engine
        while not self._stop:
            self.last_progress = time.monotonic()
            while True:
                try:
                    fn, fut = self._cmds.get_nowait()
                except queue.Empty:
                    break
                try:
                    res = fn()
                    if not fut.done():
                        fut.set_result(res)
                except BaseException as e:  # validation errors go back to the caller
                    if not fut.done():
                        fut.set_exception(e)
            if not eng.has_work():
                self._snapshot = eng.snapshot()
                self._wake.wait(_IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outs = eng.step()
            except BaseException as e:  # a broken step fails every request; the replica reports unhealthy
                log.exception("engine step failed")
                self.dead = e
                self._fail_pending()
                for rid in list(self._streams):
                    self._deliver(rid, EngineDeadError(f"engine step failed: {e!r}"))
                return
            for o in outs:
                self._deliver(o.request_id, o)
            self._snapshot = eng.snapshot()
