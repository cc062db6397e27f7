"""The proxy middleware that cuts a stalled reader (deployments/proxy_middleware.py), driven as Serve's
proxy drives it: an ASGI app that streams, a client whose socket stops taking data."""

from __future__ import annotations

import asyncio
from typing import Any

from deployments.proxy_middleware import ENFORCED_HEADER, IDLE_HEADER, StreamIdleTimeout, middlewares


class Streamer:
    """An app that streams ``n`` chunks and, like Serve's proxy, stops when receive says disconnect."""

    def __init__(self, n: int, limit: str | None) -> None:
        self.n, self.limit = n, limit
        self.sent = 0
        self.saw_disconnect = asyncio.Event()
        self.request_headers: list[tuple[bytes, bytes]] = []

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        self.request_headers = scope["headers"]

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.saw_disconnect.set()

        watcher = asyncio.ensure_future(watch())
        headers = [(b"content-type", b"text/event-stream")]
        if self.limit is not None:
            headers.append((IDLE_HEADER, self.limit.encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(self.n):
            await asyncio.sleep(0.001)  # the next chunk is generated
            if self.saw_disconnect.is_set():
                return
            await send({"type": "http.response.body", "body": b"x" * 100, "more_body": i < self.n - 1})
            self.sent += 1
        watcher.cancel()


class Client:
    """The server side of a client's socket: takes ``capacity`` body messages, then blocks until read."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.messages: list[dict] = []
        self.reading = asyncio.Event()

    async def send(self, message: dict) -> None:
        if (
            message["type"] == "http.response.body"
            and sum(m["type"] == "http.response.body" for m in self.messages) >= self.capacity
        ):
            await self.reading.wait()  # the buffers are full until the client reads again
        self.messages.append(message)

    async def receive(self) -> dict:
        await asyncio.Event().wait()  # the client sends nothing more and never disconnects
        return {}


def run(app: Streamer, client: Client, timeout: float = 5.0) -> None:
    async def go() -> None:
        await asyncio.wait_for(
            StreamIdleTimeout(app)(
                {"type": "http", "method": "POST", "path": "/v1/x", "headers": []}, client.receive, client.send
            ),
            timeout,
        )

    asyncio.run(go())


def test_a_stalled_reader_is_cut_after_the_limit_and_the_app_told_it_disconnected():
    app, client = Streamer(n=1000, limit="0.2"), Client(capacity=5)
    run(app, client)
    assert app.saw_disconnect.is_set()
    assert app.sent < 1000  # the app stopped streaming: upstream, the request is cancelled
    start = client.messages[0]
    assert start["type"] == "http.response.start"
    assert IDLE_HEADER not in dict(start["headers"])  # the limit stays between the ingress and the proxy
    assert (ENFORCED_HEADER, b"1") in app.request_headers
    assert len(client.messages) == 1 + 5  # nothing more was written once the stream was cut


def test_a_reader_that_keeps_reading_is_never_cut():
    async def go() -> tuple[Streamer, Client]:
        app, client = Streamer(n=50, limit="0.2"), Client(capacity=5)

        async def slow_reader() -> None:  # frees the buffers every 0.1 s: slower than the app, faster than the limit
            while True:
                await asyncio.sleep(0.1)
                client.capacity += 5
                client.reading.set()
                client.reading.clear()

        reader = asyncio.ensure_future(slow_reader())
        scope = {"type": "http", "method": "POST", "path": "/v1/x", "headers": []}
        await asyncio.wait_for(StreamIdleTimeout(app)(scope, client.receive, client.send), 10)
        reader.cancel()
        return app, client

    app, client = asyncio.run(go())
    assert app.sent == 50 and not app.saw_disconnect.is_set()
    assert len(client.messages) == 51


def test_without_the_header_a_response_is_never_timed():
    """Responses the ingress does not stamp (JSON, or a limit of null) pass as they are."""
    app, client = Streamer(n=20, limit=None), Client(capacity=5)

    async def go() -> None:
        scope = {"type": "http", "method": "GET", "path": "/v1/models", "headers": []}
        task = asyncio.ensure_future(StreamIdleTimeout(app)(scope, client.receive, client.send))
        await asyncio.sleep(0.5)
        assert not task.done() and not app.saw_disconnect.is_set()  # waits on the client, uncut
        client.capacity = 100
        client.reading.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(go())
    assert app.sent == 20


def test_serve_gets_a_list_of_starlette_middlewares():
    from starlette.middleware import Middleware

    (m,) = middlewares()
    assert isinstance(m, Middleware) and m.cls is StreamIdleTimeout
