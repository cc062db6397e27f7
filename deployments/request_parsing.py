"""Request bodies to engine inputs: the validated request, the engine's sampling params, the prompts'
token ids, or an HTTPError in OpenAI's error shape naming the problem.

Pure functions of the body and the deployment's config (and tokenizer), so the ingress (deployments/
ingress.py) keeps only HTTP: reading the body, auth, routing, streaming and responding.
"""

import json
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from cluster.config import AppConfig, IngressConfig
from deployments import protocol as P
from deployments import tools as T
from deployments.structured import structured_params


class HTTPError(Exception):
    """A request answered with ``status`` and OpenAI's error shape (``response``)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: Any = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(
            P.error_body(self.message, self.type, self.param, self.code), self.status, headers=self.headers
        )


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"] if not isinstance(x, int) or True)
    if err["type"] == "extra_forbidden":
        return f"unknown field '{loc}'", loc
    return f"{loc}: {err['msg']}", loc or None


def parse_request(
    raw: bytes, is_chat: bool, cfg: AppConfig, proposers: Sequence[str], tokenizer: Any
) -> tuple[Any, dict[str, Any], list[list[int]]]:
    """The parse step whole: the validated request, the engine's sampling params and each prompt's
    token ids, checked against the context; the first problem found is raised as an HTTPError."""
    req = parse_body(raw, P.ChatCompletionRequest if is_chat else P.CompletionRequest, cfg, proposers)
    params = engine_params(req, cfg.ingress)
    explicit = (getattr(req, "max_completion_tokens", None) or req.max_tokens) is not None
    prompts = prompt_token_ids(req, is_chat, tokenizer, cfg.ingress)
    for prompt_ids in prompts:
        check_len(prompt_ids, params, explicit, "messages" if is_chat else "prompt", cfg.engine.max_model_len)
    return req, params, prompts


def parse_body(
    raw: bytes,
    model: type[P.ChatCompletionRequest] | type[P.CompletionRequest],
    cfg: AppConfig,
    proposers: Sequence[str],
) -> Any:
    """The body validated as ``model`` (a chat or a completion request) against this deployment's model
    name, ``proposers`` and ingress limits."""
    if len(raw) > cfg.ingress.max_body_bytes:
        raise HTTPError(413, f"request body of {len(raw)} bytes exceeds {cfg.ingress.max_body_bytes}")
    try:
        data = json.loads(raw)
        json.dumps(data, ensure_ascii=False).encode()  # lone surrogates (\ud800) would crash the tokenizer
    except (ValueError, UnicodeError) as e:
        raise HTTPError(400, f"body is not valid JSON: {e}") from None
    except RecursionError:  # [[[[...]]]] nested deeper than the parser's stack
        raise HTTPError(400, "body is not valid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "body must be a JSON object")
    bad = P.strip_unsupported(data, chat=model is P.ChatCompletionRequest)
    if bad is not None:
        raise HTTPError(400, f"'{bad}' is not supported by this server", bad, code="unsupported_parameter")
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        msg, param = _validation_message(e)
        raise HTTPError(400, msg, param) from None
    model_name = cfg.engine.served_model_name
    if req.model != model_name:
        raise HTTPError(
            400,
            f"model '{req.model}' does not exist; available: ['{model_name}']",
            "model",
            code="model_not_found",
        )
    ing = cfg.ingress
    if len(req.stop) > ing.max_stop_strings:
        raise HTTPError(400, f"at most {ing.max_stop_strings} stop strings are allowed", "stop")
    if any(len(s) > ing.max_stop_chars or not s for s in req.stop):
        raise HTTPError(400, f"stop strings must be 1 to {ing.max_stop_chars} characters", "stop")
    if req.proposer is not None and req.proposer not in proposers:
        raise HTTPError(400, f"unknown proposer '{req.proposer}'; configured: {proposers}", "proposer")
    return req


def engine_params(req: Any, ing: IngressConfig) -> dict[str, Any]:
    """The engine's sampling params of a validated request (max_tokens defaulted, tool_choice that forces
    calls turned into a grammar), checked against the ingress limits and the rules between fields."""
    if req.n > ing.max_n:
        raise HTTPError(400, f"n {req.n} is above this server's limit of {ing.max_n}", "n")
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if max_tokens is not None and max_tokens > ing.max_tokens_cap:
        raise HTTPError(400, f"max_tokens {max_tokens} is above the cap of {ing.max_tokens_cap}", "max_tokens")
    if isinstance(req, P.ChatCompletionRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    if max_tokens == 0 and not getattr(req, "echo", False):
        raise HTTPError(400, "max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
    echo_scores = getattr(req, "echo", False) and logprobs is not None
    try:
        structured = structured_params(req.response_format, req.structured_outputs)
    except ValueError as e:
        raise HTTPError(400, str(e), "response_format") from None
    if isinstance(req, P.ChatCompletionRequest):
        lark = T.tool_call_lark(req.tools, req.tool_choice, req.parallel_tool_calls, ing.tool_prompt)
        if lark is not None:  # "required" or a named function: the answer is forced to be call blocks
            if structured is not None:
                raise HTTPError(
                    400,
                    "tool_choice 'required' or a named function forces tool calls; it cannot "
                    "be combined with response_format or structured_outputs",
                    "tool_choice",
                )
            structured = {"kind": "lark", "value": lark, "param": "tools"}
    return {
        "structured": structured,
        "prompt_logprobs": logprobs if echo_scores else None,
        "logprobs": logprobs,
        "max_tokens": ing.default_max_tokens if max_tokens is None else max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
        "stop": list(req.stop),
        "ignore_eos": req.ignore_eos,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
    }


def check_len(prompt_ids: list[int], params: dict[str, Any], explicit: bool, field: str, ctx: int) -> None:
    """The prompt and ``params["max_tokens"]`` against the context of ``ctx`` tokens: a default max_tokens
    is cut to fill the context, an ``explicit`` one that does not fit is an error."""
    if len(prompt_ids) >= ctx:
        raise HTTPError(
            400,
            f"prompt has {len(prompt_ids)} tokens; this model's context is {ctx} tokens",
            field,
            code="context_length_exceeded",
        )
    if len(prompt_ids) + params["max_tokens"] > ctx:
        if explicit:
            raise HTTPError(
                400,
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params['max_tokens']}) "
                f"exceeds the context of {ctx} tokens",
                "max_tokens",
                code="context_length_exceeded",
            )
        params["max_tokens"] = ctx - len(prompt_ids)  # default max_tokens: fill the context


def prompt_token_ids(req: Any, is_chat: bool, tokenizer: Any, ing: IngressConfig) -> list[list[int]]:
    """The token ids of each prompt: a chat's messages through its template, or a completion's prompts
    (text, or token ids checked against the vocabulary)."""
    if is_chat:  # tool definitions, past calls and tool results become text the template takes
        messages = T.render_messages(req.messages, req.tools, req.tool_choice, ing.tool_prompt)
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return [tokenizer.encode(text, add_special_tokens=False)]
    out = []
    if len(req.prompts()) > ing.max_prompts:
        raise HTTPError(
            400,
            f"{len(req.prompts())} prompts in one request; the limit is {ing.max_prompts}",
            "prompt",
        )
    for p in req.prompts():
        if isinstance(p, str):
            out.append(tokenizer.encode(p, add_special_tokens=False))
        else:
            if any(t < 0 or t >= len(tokenizer) for t in p):
                raise HTTPError(400, f"prompt has token ids outside [0, {len(tokenizer)})", "prompt")
            out.append(list(p))
    return out
