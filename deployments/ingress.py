"""HTTP ingress: OpenAI-compatible routes, auth, routing, SSE streaming.

Every bad input is answered here with a 4xx in OpenAI's error shape naming the problem
(the checks, the chat template and tokenization live in deployments/request_parsing.py),
before it reaches an engine; what only the engine can judge (e.g. a proposer that is not
configured) comes back as an error chunk and is answered the same way.
"""

import asyncio
import hmac
import logging
import os
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.config import DRAFT_WORKER_PROPOSERS, AppConfig
from cluster.telemetry import render_prometheus, spec_decode_summary
from deployments import choices as C
from deployments import protocol as P
from deployments import sse
from deployments import tools as T
from deployments.ingress_telemetry import IngressTelemetry, RequestTelemetry, gather_cluster_samples
from deployments.openapi import describe
from deployments.proxy_middleware import ENFORCED_HEADER, IDLE_HEADER
from deployments.request_parsing import HTTPError, parse_request
from deployments.resume import ResumableStream
from deployments.router_client import RouterClient
from workers.kv_blocks import block_hashes

log = logging.getLogger("ray.serve")
# /openapi.json is the Ingress's own route: the document names this deployment's model and limits.
app = FastAPI(title="specserve", docs_url=None, redoc_url=None, openapi_url=None)


@app.exception_handler(StarletteHTTPException)
async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown route (404), wrong method (405): OpenAI's error shape, like every other error."""
    return JSONResponse(P.error_body(str(exc.detail)), exc.status_code, headers=getattr(exc, "headers", None))


@serve.deployment(name="Ingress", ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        app_config: dict,
        target: DeploymentHandle,
        router: DeploymentHandle,
        draft: DeploymentHandle | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        from workers.model_loader import resolve_model_path

        self.cfg = AppConfig.model_validate(app_config)
        self.model_name = self.cfg.engine.served_model_name
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(self.cfg.engine.model))
        self.target = target.options(stream=True)
        self.target_unary = target
        self.router = router
        self.draft = draft
        ctx = serve.get_replica_context()
        self.telemetry = IngressTelemetry(self.cfg, ctx.replica_id.unique_id if ctx is not None else "ingress")
        self.router_client = RouterClient(
            router,
            target,
            self.cfg.router.route_timeout_s,
            self.cfg.engine.num_speculative_tokens,
            self.telemetry.on_route_fallback,
        )
        self.api_key = self.cfg.ingress.api_key or os.environ.get("SPECSERVE_API_KEY") or None
        self.started = int(time.time())  # /v1/models "created": when this server started serving the model
        self.proposers = [
            p.name for p in self.cfg.engine.proposers if p.name not in DRAFT_WORKER_PROPOSERS or self.cfg.draft.enabled
        ]
        self.openapi_doc: dict[str, Any] | None = None
        idle = self.cfg.ingress.stream_idle_timeout_s
        # The proxy in front enforces the idle limit it reads here (deployments/proxy_middleware.py).
        self.stream_headers = {IDLE_HEADER.decode(): f"{idle:g}"} if idle else None
        self.warned_unenforced = False

    # ------------------------------------------------------------------ the completion path

    @app.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, is_chat=True)

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._complete(request, is_chat=False)

    async def _complete(self, request: Request, is_chat: bool) -> Response:
        """One completion request. Its RequestTelemetry watches from outside: the server span, the
        request count when the response goes out, and (as every choice's observer) the latencies."""
        route = "/v1/chat/completions" if is_chat else "/v1/completions"
        rt = self.telemetry.request(request.headers, "POST", route)
        return await rt.answer(self._answer(request, is_chat, rt))

    async def _answer(self, request: Request, is_chat: bool, rt: RequestTelemetry) -> Response:
        """Every failure as a response in OpenAI's error shape (a client gone away propagates)."""
        try:
            return await self._run(request, is_chat, rt)
        except HTTPError as e:
            return e.response()
        except TimeoutError:
            return HTTPError(408, "request timed out", type_="timeout_error", code="timeout").response()
        except Exception as e:  # a bug, not the client's fault: say so in the OpenAI shape
            log.exception("request failed")
            return HTTPError(500, f"internal error: {type(e).__name__}", type_="server_error").response()

    async def _run(self, request: Request, is_chat: bool, rt: RequestTelemetry) -> Response:
        """parse -> route and start every choice -> stream (SSE) or read to the end -> respond."""
        # parse: every bad input is a 4xx here, before an engine sees it
        self._auth(request)
        req, params, prompts = parse_request(await request.body(), is_chat, self.cfg, self.proposers, self.tokenizer)
        rid = P.new_id("chatcmpl" if is_chat else "cmpl")
        deadline = time.monotonic() + self.cfg.ingress.request_timeout_s
        choices = [
            C.Choice(index=pi * req.n + i, prompt_index=pi, observe=rt.on_chunk)
            for pi in range(len(prompts))
            for i in range(req.n)
        ]

        # route and start: each choice is its own engine request; its first chunk is read here
        gens = await self._start_all(req, prompts, params, rid, choices, rt)
        want_logprobs = params["logprobs"] is not None
        echo = [self._echo_text(req, p) for p in prompts]
        tool_names = self._tool_names(req) if is_chat else None

        # stream: SSE events as the chunks come
        if req.stream:
            so = req.stream_options
            framer = sse.SSEFramer(
                rid,
                self.model_name,
                is_chat,
                choices,
                self.tokenizer,
                want_logprobs,
                bool(so and so.continuous_usage_stats),
                echo,
                self.cfg.ingress.tool_prompt,
                tool_names,
            )
            events = self._sse(gens, choices, framer, deadline, bool(so and so.include_usage), rt)
            if self.stream_headers and not self.warned_unenforced and ENFORCED_HEADER.decode() not in request.headers:
                self.warned_unenforced = True
                log.warning(
                    "ingress.stream_idle_timeout_s is set but the HTTP proxy does not enforce it: start Ray with "
                    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.proxy_middleware.middlewares"
                )
            return StreamingResponse(events, media_type="text/event-stream", headers=self.stream_headers)

        # or read every choice to its end, and respond
        try:
            await asyncio.gather(*[self._drain(g, c, deadline) for g, c in zip(gens, choices)])
        except BaseException:
            for g in gens:
                g.cancel()
            raise
        body = (P.chat_response if is_chat else P.completion_response)(rid, self.model_name, "", None, choices[0].last)
        body["choices"] = [
            self._choice_body(c, is_chat, want_logprobs, echo[c.prompt_index], tool_names) for c in choices
        ]
        body["usage"] = C.usage(choices)
        body["system_fingerprint"] = choices[0].last.get("system_fingerprint")
        return JSONResponse(body)

    # ------------------------------------------------------------------ auth (then deployments/request_parsing.py)

    def _auth(self, request: Request) -> None:
        if not self.api_key:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise HTTPError(401, "missing or invalid API key", type_="authentication_error", code="invalid_api_key")

    # ------------------------------------------------------------------ route and start

    async def _start_all(
        self,
        req: Any,
        prompts: list[list[int]],
        params: dict[str, Any],
        rid: str,
        choices: list[C.Choice],
        rt: RequestTelemetry,
    ) -> list[ResumableStream]:
        """Start every choice and add its first chunk, within the request's timeout. One choice
        refused: the request is refused, and the choices that started are cancelled."""
        started = await asyncio.wait_for(
            asyncio.gather(
                *[
                    self._start(
                        req,
                        prompts[c.prompt_index],
                        C.seeded(params, c.index % req.n),
                        rid if len(choices) == 1 else f"{rid}-{c.index}",
                        rt,
                    )
                    for c in choices
                ],
                return_exceptions=True,
            ),
            self.cfg.ingress.request_timeout_s,
        )
        failed = [x for x in started if isinstance(x, BaseException)]
        if failed:
            for x in started:
                if not isinstance(x, BaseException):
                    x[0].cancel()
            raise failed[0]
        for c, (_, first) in zip(choices, started):
            c.add(first, prompts[c.prompt_index])
        return [g for g, _ in started]

    def _prefix(self, prompt_ids: list[int]) -> list[int] | None:
        """The prompt's full KV blocks as the replicas' prefix caches key them, for prefix-aware
        placement; none when the Router would not use them."""
        rc, ec = self.cfg.router, self.cfg.engine
        if rc.prefix_affinity_max_imbalance <= 0 or rc.prefix_index_blocks <= 0 or not ec.enable_prefix_caching:
            return None
        return block_hashes(prompt_ids, ec.block_size)

    async def _start(self, req: Any, prompt_ids: list[int], params: dict[str, Any], rid: str, rt: RequestTelemetry):
        """Route, submit, and read the first chunk (so errors become a 4xx before any SSE byte)."""
        prefix = self._prefix(prompt_ids)
        route = await rt.routed(self.router_client.route(req.speculation, req.proposer, prefix=prefix))
        payload = {
            "request_id": rid,
            "prompt_ids": prompt_ids,
            "params": params,
            "proposer": req.proposer,
            "speculation": req.speculation,
        }
        if route.get("policy_version") is not None:
            payload["policy_version"] = route["policy_version"]  # the target runs it under at least this policy
        carrier = rt.carrier()
        if carrier:
            payload["trace_context"] = carrier  # W3C traceparent: the target's spans join this trace

        async def submit(p: dict[str, Any], resubmission: bool, failed: str | None):
            hint = route.get("replica_id")
            if resubmission:  # anywhere but the replica that failed it (if none wrote a chunk: the one routed to)
                hint = (await self.router_client.route(req.speculation, req.proposer, failed or hint, prefix)).get(
                    "replica_id"
                )
            return self.target.generate.remote(p, replica_id=hint)

        stream = ResumableStream(submit, payload, self.cfg.ingress.max_resumes, self.telemetry.on_resume)
        try:
            await stream.start()
            first = await stream.__anext__()
        except asyncio.CancelledError:  # timed out or the client left before the first token: free it end to end
            stream.cancel()
            raise
        except BackPressureError:
            raise HTTPError(
                503,
                "the service is at capacity; retry later",
                type_="overloaded_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            ) from None
        except StopAsyncIteration:
            raise HTTPError(500, "the engine returned no output", type_="server_error") from None
        except Exception as e:  # target replicas kept failing
            raise HTTPError(
                503, f"target worker failed: {type(e).__name__}", type_="server_error", headers={"Retry-After": "1"}
            ) from None
        if "error" in first:
            raise HTTPError(400, first["error"]["message"], first["error"].get("param"))
        return stream, first

    # ------------------------------------------------------------------ stream or read to the end

    async def _sse(
        self,
        gens: list[ResumableStream],
        choices: list[C.Choice],
        framer: sse.SSEFramer,
        deadline: float,
        include_usage: bool,
        rt: RequestTelemetry,
    ) -> AsyncIterator[bytes]:
        """One SSE stream for every choice: chunks carry ``index``; choices interleave as they come.
        A timeout or a failed target ends it with an error event; a client gone away cancels every
        choice end to end. ``rt.end`` closes the request's span with how the stream ended."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(j: int) -> None:  # one choice's chunks into the shared queue
            try:
                while True:
                    item = await gens[j].__anext__()
                    await queue.put((j, item, None))
                    if item["finished"]:
                        return
            except StopAsyncIteration:
                await queue.put((j, None, RuntimeError("the engine stream ended early")))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                await queue.put((j, None, e))

        pumps = [asyncio.ensure_future(pump(j)) for j, c in enumerate(choices) if not c.last["finished"]]
        open_choices = len(choices)
        status, error, error_event = 200, None, b""
        try:
            for j, c in enumerate(choices):  # first chunks were read by _start
                if event := framer.first(j):
                    yield event
                open_choices -= bool(c.last["finished"])
            while open_choices:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):  # a timer, not a task per token
                    j, item, err = await queue.get()
                if err is not None:
                    raise err
                choices[j].add(item)
                if event := framer.next(j, item):
                    yield event
                open_choices -= bool(item["finished"])
            if include_usage:
                yield framer.usage()
        except TimeoutError:
            error = "timeout"
            error_event = sse.error_event("request timed out", "timeout_error", code="timeout")
        except asyncio.CancelledError:  # client went away: cancel the request end to end
            status, error = 499, "client disconnected"
            raise
        except Exception as e:  # the target replica died mid-stream: end the stream with an error event
            status, error = 503, "target worker failed"
            error_event = sse.error_event(f"target worker failed mid-request: {type(e).__name__}", "server_error")
        finally:
            for p in pumps:
                p.cancel()
            if open_choices:  # ended early (client gone, timeout, failure): free every choice's engine slot
                for g in gens:
                    g.cancel()
            rt.end(status, error)
        if error_event:
            yield error_event
        yield sse.DONE

    async def _drain(self, gen: ResumableStream, c: C.Choice, deadline: float) -> None:
        """Read one choice to its end (non-streaming)."""
        try:
            while not c.last["finished"]:  # type: ignore[index]
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    c.add(await gen.__anext__())
        except TimeoutError:
            gen.cancel()
            raise HTTPError(
                408,
                f"request exceeded the {self.cfg.ingress.request_timeout_s}s timeout",
                type_="timeout_error",
                code="timeout",
            ) from None
        except StopAsyncIteration:
            raise HTTPError(500, "the engine stream ended early", type_="server_error") from None
        except HTTPError:
            raise
        except Exception as e:  # the target replica died mid-request (ActorDiedError, ...)
            raise HTTPError(
                503,
                f"target worker failed mid-request: {type(e).__name__}",
                type_="server_error",
                headers={"Retry-After": "1"},
            ) from None

    # ------------------------------------------------------------------ respond

    def _echo_text(self, req: Any, prompt_ids: list[int]) -> str:
        """The prompt as text, for completions with ``echo``; empty otherwise."""
        if not getattr(req, "echo", False):
            return ""
        return self.tokenizer.decode(prompt_ids)

    def _tool_names(self, req: P.ChatCompletionRequest) -> list[str] | None:
        """The tools whose calls are read back from the answer; None when the request can make none."""
        if T.effective_tool_choice(req.tools, req.tool_choice) == "none":
            return None
        return [t.function.name for t in req.tools or ()]

    def _choice_body(
        self, c: C.Choice, is_chat: bool, want_logprobs: bool, echo: str, tool_names: list[str] | None = None
    ) -> dict[str, Any]:
        assert c.last is not None
        if is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            finish = c.last["finish_reason"]
            if tool_names is not None:  # call blocks in the answer become message.tool_calls
                content, calls = T.parse_tool_calls(c.text, self.cfg.ingress.tool_prompt, tool_names)
                message["content"] = content
                if calls:
                    message["tool_calls"] = [call.model_dump() for call in calls]
                finish = T.finish_reason(finish, len(calls))
            out = {"index": c.index, "message": message, "finish_reason": finish, "logprobs": None}
            if want_logprobs:
                out["logprobs"] = P.chat_logprobs(c.logprobs, self.tokenizer)
            return out
        out = {"index": c.index, "text": echo + c.text, "finish_reason": c.last["finish_reason"], "logprobs": None}
        if want_logprobs:  # with echo: the prompt's tokens first, from offset 0
            out["logprobs"] = P.completion_logprobs(
                (c.prompt_logprobs or []) + c.logprobs, self.tokenizer, 0 if c.prompt_logprobs else len(echo)
            )
        return out

    # ------------------------------------------------------------------ the other routes

    def _counted(self, route: str, resp: Response) -> Response:
        self.telemetry.count(route, resp.status_code)
        return resp

    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._auth(request)
        except HTTPError as e:
            return self._counted("/v1/models", e.response())
        return self._counted("/v1/models", JSONResponse({"object": "list", "data": [self._model_card()]}))

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "specserve",
            "root": self.cfg.engine.model,
            "parent": None,
            "max_model_len": self.cfg.engine.max_model_len,
        }

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str, request: Request) -> Response:
        try:
            self._auth(request)
        except HTTPError as e:
            return self._counted("/v1/models/{id}", e.response())
        if model_id != self.model_name:
            return self._counted(
                "/v1/models/{id}",
                HTTPError(
                    404,
                    f"model '{model_id}' does not exist; available: ['{self.model_name}']",
                    "model",
                    code="model_not_found",
                ).response(),
            )
        return self._counted("/v1/models/{id}", JSONResponse(self._model_card()))

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> Response:
        """Bodies and responses from the models the routes validate with (deployments/openapi.py)."""
        if self.openapi_doc is None:
            self.openapi_doc = describe(request.app, self.cfg, self.proposers, len(self.tokenizer))
        return JSONResponse(self.openapi_doc)

    @app.get("/health")
    async def health(self) -> Response:
        ok = await self.router_client.healthy()
        return self._counted(
            "/health", JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)
        )

    async def _cluster_samples(self) -> list[dict[str, Any]]:
        return await gather_cluster_samples(self.telemetry.tel.samples(), self.router, self.target_unary, self.draft)

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Prometheus text for the whole cluster: this ingress, the Router, every target replica, the draft."""
        try:
            self._auth(request)
        except HTTPError as e:
            return self._counted("/metrics", e.response())
        self.telemetry.count("/metrics", 200)  # counted before the scrape, so it shows in this scrape
        text = render_prometheus(await self._cluster_samples())
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/speculation/stats")
    async def spec_stats(self, request: Request) -> Response:
        """Policy and parameters, live load per replica, and per proposer acceptance rate and mean
        acceptance length (over all target replicas, and per replica)."""
        try:
            self._auth(request)
        except HTTPError as e:
            return self._counted("/v1/speculation/stats", e.response())
        stats, samples = await asyncio.gather(self.router.stats.remote(), self._cluster_samples())
        stats["proposers"] = spec_decode_summary(samples)
        stats["proposers_by_replica"] = {
            rid: spec_decode_summary(s for s in samples if s["labels"].get("replica") == rid)
            for rid in stats["replicas"]
        }
        return self._counted("/v1/speculation/stats", JSONResponse(stats))

    def debug_spans(self) -> list[dict[str, Any]]:
        """Finished spans, when ``telemetry.tracing`` is "memory" (tests); else empty."""
        return self.telemetry.tel.finished_spans()
