"""Serve's HTTP proxy, told to give up on a client that stops reading its stream.

Why: the proxy pulls a stream's chunks from the ingress replica as fast as they come and writes them to
the client's socket. A client that stops reading without disconnecting fills the socket's buffers; the
proxy's write then waits, and nothing upstream can see it, since Serve's streams carry no backpressure:
the engine goes on generating into the proxy's memory, and the connection and the buffered answer are
held for as long as the client likes. vLLM behind uvicorn has the same exposure; operators put a proxy
with a send timeout (nginx ``send_timeout``, HAProxy ``timeout client``) in front.

Here the ingress stamps every streamed response with its idle limit (``ingress.stream_idle_timeout_s``)
in the :data:`IDLE_HEADER` response header, and this middleware, which runs inside Serve's proxy
(installed through Ray Serve's ``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``, cluster/serve_env.py),
strips the header and gives each write of the body that long to go through. When one waits longer, the
response is abandoned: the proxy stops pulling the stream and cancels the request at the ingress, which
aborts it in the engine (its KV blocks freed) as on a disconnect, and the server closes the connection
once the client has read what its socket already holds. A slow client that keeps reading is never cut:
a write waits only while the socket's buffers are full.

The middleware also marks each request it passes with :data:`ENFORCED_HEADER`, so the ingress can
say in its log when the proxy in front of it does not enforce the limit (Ray started without the
variable above).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

log = logging.getLogger("specserve.proxy")

IDLE_HEADER = b"x-specserve-stream-idle-timeout-s"  # response: the idle limit of this stream, in seconds
ENFORCED_HEADER = b"x-specserve-idle-enforced"  # request: a proxy in front enforces the limit

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class StreamIdleTimeout:
    """Pure ASGI middleware: a streamed response whose body write waits past its idle limit is abandoned,
    and the app is told the client disconnected."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = {**scope, "headers": [*scope.get("headers", []), (ENFORCED_HEADER, b"1")]}
        limit: float | None = None
        stalled = asyncio.Event()

        async def guarded_receive() -> Message:
            # The app learns of a stall as of a disconnect: Serve's proxy then cancels the request at the
            # ingress, which aborts it in the engine.
            got = asyncio.ensure_future(receive())
            cut = asyncio.ensure_future(stalled.wait())
            await asyncio.wait((got, cut), return_when=asyncio.FIRST_COMPLETED)
            if got.done():
                cut.cancel()
                return got.result()
            got.cancel()
            return {"type": "http.disconnect"}

        async def guarded_send(message: Message) -> None:
            nonlocal limit
            if message["type"] == "http.response.start":
                headers = message.get("headers") or []
                kept = [(k, v) for k, v in headers if bytes(k).lower() != IDLE_HEADER]
                if len(kept) != len(headers):
                    limit = _parse_limit(headers)
                    message = {**message, "headers": kept}
            if stalled.is_set():
                return  # the answer is abandoned: what the app still sends goes nowhere
            if limit is None or message["type"] != "http.response.body":
                await send(message)
                return
            try:
                async with asyncio.timeout(limit):  # one timer per write: no task per token, as wait_for makes
                    await send(message)
            except TimeoutError:
                log.warning(
                    "%s %s: the client took no data for %.3g s; its stream is cancelled",
                    scope.get("method"),
                    scope.get("path"),
                    limit,
                )
                stalled.set()

        # Returning with the response unfinished makes the server close the connection.
        await self.app(scope, guarded_receive, guarded_send)


def _parse_limit(headers: list[tuple[bytes, bytes]]) -> float | None:
    for k, v in headers:
        if bytes(k).lower() == IDLE_HEADER:
            try:
                value = float(bytes(v).decode())
            except ValueError:
                return None
            return value if value > 0 else None
    return None


def middlewares() -> list[Any]:
    """What Serve's proxy calls (``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``): its middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(StreamIdleTimeout)]
