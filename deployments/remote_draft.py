"""The target-side proxy of the draft worker: a Proposer whose ``propose`` is one batched RPC.

Protocol (robust to lost messages and draft restarts): committed tokens never change, so
each call sends only the tokens committed since the last call (``offset`` + ``new_tokens``).
The draft worker rolls its KV back by itself (longest common prefix with what it cached),
which is exactly "piggybacking the accepted counts on the next call". If the draft lost a
request's state it answers ``resync`` and the next call sends the whole sequence. A finished
or cancelled request is released at once with a fire-and-forget ``release`` call (so the
draft's KV is freed even when no further draft call follows); ids that could not be sent
ride along in the next call's ``released``. Any failure or time-out makes this step plain
for the requests involved (same output, fewer tokens per pass) and backs off for
``retry_after_s``; the requests stay tracked, so they are still released when they finish.

Called from the engine thread (not an event loop), so it may block on the answer. Given the
replica's event loop, it makes every handle call on that loop: Serve may route a handle's calls on
the loop that makes them (``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0``, cluster/serve_env.py), and
then refuses a call from any other thread. Without a loop it calls the handle from this thread,
which needs Serve's router thread (Serve's default).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Any, Callable, Sequence

import torch

from workers.proposers.base import ProposalRequest, Proposals, Proposer

log = logging.getLogger("ray.serve")


class RemoteDraftProposer(Proposer):
    name = "draft_model"

    def __init__(
        self,
        handle: Any,
        timeout_s: float = 2.0,
        retry_after_s: float = 1.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.handle = handle
        self.loop = loop  # where handle calls are made (see the module docstring); None: the calling thread
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._sent: dict[str, int] = {}  # request id -> committed tokens the draft worker has
        self._released: list[str] = []
        self._down_until = 0.0
        self.up = True
        self.num_failures = 0
        self.last_call_s = 0.0
        self.on_call: Callable[[float], None] | None = None  # seconds of each successful call (metrics)

    def propose(self, requests: list[ProposalRequest]) -> Proposals:
        empty = Proposals([[] for _ in requests], [None for _ in requests])
        if time.monotonic() < self._down_until:
            return empty
        batch = [self._message(r, self._sent.get(r.request_id, 0)) for r in requests]
        released, self._released = self._released, []
        t0 = time.perf_counter()
        try:
            answer = self._call_propose(batch, released)
        except Exception as e:  # unreachable, crashed or too slow: plain step, output unchanged
            self.num_failures += 1
            self.up = False
            self._down_until = time.monotonic() + self.retry_after_s
            # the draft may have lost everything: resend whole sequences next time, but keep the ids
            # (a draft that only timed out still holds their state and must be told when they finish)
            self._sent = dict.fromkeys(self._sent, 0)
            log.warning("draft worker call failed (%s); plain steps for %.1fs", type(e).__name__, self.retry_after_s)
            return empty
        self.last_call_s = time.perf_counter() - t0
        self.up = True
        if self.on_call is not None:
            self.on_call(self.last_call_s)
        drafts: list[list[int]] = []
        probs: list[torch.Tensor | None] = []
        for r, a in zip(requests, answer):
            if a.get("resync"):
                self._sent[r.request_id] = 0
                drafts.append([])
                probs.append(None)
                continue
            self._sent[r.request_id] = len(r.token_ids)
            drafts.append(list(a["draft_token_ids"]))
            probs.append(a.get("draft_probs"))
        return Proposals(drafts, probs)

    def _call_propose(self, batch: list[dict[str, Any]], released: list[str]) -> list[dict[str, Any]]:
        """One ``propose`` call, waited for at most ``timeout_s``; raises on failure or time-out."""
        if self.loop is None:
            return self.handle.propose.remote(batch, released).result(timeout_s=self.timeout_s)

        async def call() -> list[dict[str, Any]]:
            return await self.handle.propose.remote(batch, released)

        fut = asyncio.run_coroutine_threadsafe(call(), self.loop)
        try:
            return fut.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()  # cancels the awaited response, and with it the call
            raise TimeoutError(f"draft call took over {self.timeout_s}s") from None

    def _message(self, r: ProposalRequest, off: int) -> dict[str, Any]:
        """One request's part of a draft call: the tokens committed since ``off`` (what the draft has)."""
        return {
            "request_id": r.request_id,
            "offset": off,
            "new_tokens": list(r.token_ids[off:]),
            "num_prompt_tokens": r.num_prompt_tokens,
            "k": r.k,
            "eos_token_ids": sorted(r.eos_token_ids),
            "sampling": r.sampling.model_dump(),
            "coupled": r.coupled,
        }

    def finish(self, request_id: str, token_ids: Sequence[int]) -> None:
        if self._sent.pop(request_id, None) is None:
            return
        self._released.append(request_id)
        released, self._released = self._released, []
        if self.loop is None:
            self._release_now(released)
            return
        try:  # fire and forget, on the loop that makes handle calls
            self.loop.call_soon_threadsafe(self._release_now, released)
        except RuntimeError:  # that loop is closed (the replica is stopping): never fail the engine's step
            self._released.extend(released)

    def _release_now(self, released: list[str]) -> None:
        try:  # fire and forget: frees the draft's KV now, not at the next draft call
            self.handle.release.remote(released)
        except Exception:
            self._released.extend(released)  # piggyback on the next propose instead


class RemoteEagleProposer(RemoteDraftProposer):
    """The EAGLE head in the draft worker: each call also carries the target's hidden states.

    With ``n`` committed tokens the head needs the target's features at positions ``0 .. n-2``
    (workers/proposers/eagle.py). The draft worker holds the rows of earlier calls, so a call sends
    only the rows committed since (fp16, ``[new rows, hidden]``): after ``off`` tokens the draft has
    ``off - 1`` rows; a resync (``off = 0``) sends them all.
    """

    name = "eagle"
    needs_hidden_states = True

    def _message(self, r: ProposalRequest, off: int) -> dict[str, Any]:
        m = super()._message(r, off)
        assert r.hidden_states is not None, "the engine passes hidden states to proposers that need them"
        m["proposer"] = "eagle"
        m["hidden"] = r.hidden_states[max(off - 1, 0) :].to(device="cpu", dtype=torch.float16)  # [new rows, hidden]
        return m
