"""A choice's stream that survives its target replica.

When the call to the replica serving a request fails (the replica died, its engine loop died),
the request is submitted again, to another replica, with the prompt plus every token the client
has already been sent and the request's noise seed (the engine reports the seed it drew). The
engine prefills those tokens and writes on from there (``resume_output_ids``): with
batch-invariant kernels and position-keyed noise, what it writes is bit for bit what the
uninterrupted stream would have written, greedy or sampled, so the client sees no gap and no
duplicate. The same holds before the first chunk (nothing sent: a plain resubmission).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from ray.serve.exceptions import BackPressureError

log = logging.getLogger("ray.serve")

BACKOFF_S = (0.05, 0.25, 0.5, 1.0)  # before resubmission i: a dead replica takes Serve a moment to drop


class ResumableStream:
    """Async iterator of one request's chunks (dicts from ``TargetWorker.generate``), resubmitting
    on failure up to ``max_resumes`` times. ``submit(payload, resubmission, failed)`` sends a payload
    (on a resubmission, to a replica other than ``failed``, the one that wrote the last chunk, if it
    can) and returns the response generator."""

    def __init__(
        self,
        submit: Callable[[dict[str, Any], bool, str | None], Awaitable[Any]],
        payload: dict[str, Any],
        max_resumes: int,
        on_resume: Callable[[str], None] | None = None,
    ) -> None:
        self.submit = submit
        self.payload = payload
        self.max_resumes = max_resumes
        self.on_resume = on_resume
        self.gen: Any = None
        self.token_ids: list[int] = []  # every token received so far
        self.seed: int | None = None
        self.replica_id: str | None = None  # the replica writing the stream now
        self.resumes = 0
        self.cancelled = False

    async def start(self) -> None:
        self.gen = await self.submit(self.payload, False, None)

    def __aiter__(self) -> ResumableStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        while True:
            try:
                chunk = await self.gen.__anext__()
            except (StopAsyncIteration, asyncio.CancelledError, BackPressureError):
                raise
            except Exception as e:  # noqa: BLE001  (ActorDiedError, RayTaskError(EngineDeadError), ...)
                if self.cancelled or self.resumes >= self.max_resumes:
                    raise
                await self._resubmit(e)
                continue
            if "error" in chunk:
                if self.token_ids or self.resumes:  # a resubmission refused: nothing a client can fix
                    raise RuntimeError(f"resubmission refused: {chunk['error'].get('message')}")
                return chunk  # the request itself is invalid: the caller answers 400
            self.token_ids.extend(chunk.get("token_ids") or [])
            if self.seed is None:
                self.seed = chunk.get("seed")
            self.replica_id = chunk.get("replica_id", self.replica_id)
            return chunk

    async def _resubmit(self, err: BaseException) -> None:
        self.resumes += 1
        dead = self.replica_id
        log.warning(
            "target replica %s failed (%s); resubmitting with %d tokens sent (resume %d of %d)",
            dead,
            type(err).__name__,
            len(self.token_ids),
            self.resumes,
            self.max_resumes,
        )
        if self.on_resume is not None:
            self.on_resume(type(err).__name__)
        await asyncio.sleep(BACKOFF_S[min(self.resumes, len(BACKOFF_S)) - 1])
        params = dict(self.payload["params"])
        if self.seed is not None:
            params["seed"] = self.seed
        # a new engine request id: should the failed call's request still live somewhere, the two never collide
        payload = {
            **self.payload,
            "request_id": f"{self.payload['request_id']}-r{self.resumes}",
            "params": params,
            "resume_output_ids": list(self.token_ids),
        }
        self.gen = await self.submit(payload, True, dead)

    def cancel(self) -> None:
        self.cancelled = True
        if self.gen is not None:
            self.gen.cancel()
