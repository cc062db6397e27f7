"""The application's typed configuration: the ``args`` (and ``user_config``) of ray_config.yaml.

Every model has ``extra="forbid"``: a misspelled key fails ``serve deploy`` with a
message naming it, instead of silently doing nothing (vLLM's ``disable_by_batch_size``
was ignored for many releases; we do not repeat that). :func:`check_serve_config` runs the
same models over a whole Serve YAML before anything starts (``make serve``), one line per
problem: ``engine.kv_cache_memory_gib: unknown key (did you mean kv_cache_memory_gb?); allowed: model, ...``.
"""

from __future__ import annotations

import difflib
import reprlib
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deployments.tools import ToolPromptFormat
from policies.registry import PolicyConfig, default_policy_config
from workers.config import EngineConfig


class Resources(BaseModel):
    """Where and how many replicas of one deployment run."""

    model_config = ConfigDict(extra="forbid")

    num_replicas: int = Field(1, ge=1, description="Replicas of this deployment.")
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs each replica reserves.")
    num_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves (production: 1).")
    resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources, e.g. {target_node: 0.01} to pin to a node type."
    )
    max_ongoing_requests: int = Field(64, ge=1, description="Requests a replica handles at once (Serve).")
    max_queued_requests: int = Field(-1, ge=-1, description="Requests queued per caller beyond that; -1 = unbounded.")

    def ray_actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            opts["resources"] = dict(self.resources)
        return opts


class AutoscalingConfig(BaseModel):
    """Serve's autoscaler for the target replicas (passed to Serve as its ``autoscaling_config``).

    More replicas mean smaller batches per replica, where speculation pays again: the per-step
    policy on each replica sees its own batch and drafts more as load spreads out."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=1, description="Fewest target replicas (>= 1: the service never scales to zero).")
    max_replicas: int = Field(2, ge=1, description="Most target replicas.")
    initial_replicas: int | None = Field(None, ge=1, description="Replicas at deploy (default min_replicas).")
    target_ongoing_requests: float = Field(
        8.0, gt=0, description="Requests in flight per replica the autoscaler aims for; above it, it adds replicas."
    )
    upscale_delay_s: float = Field(10.0, ge=0, description="Load must stay above target this long before a scale-up.")
    downscale_delay_s: float = Field(
        120.0, ge=0, description="Load must stay below target this long before a scale-down."
    )
    metrics_interval_s: float = Field(2.0, gt=0, description="How often replicas report their ongoing requests.")
    look_back_period_s: float = Field(10.0, gt=0, description="Window the autoscaler averages the load over.")

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) < min_replicas ({self.min_replicas})")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError("initial_replicas must lie in [min_replicas, max_replicas]")
        return self


class TargetResources(Resources):
    """The target deployment: fixed ``num_replicas``, or Serve autoscaling between bounds."""

    autoscaling_config: AutoscalingConfig | None = Field(
        None, description="When set, Serve's autoscaler sizes the target deployment and num_replicas is ignored."
    )


class DraftConfig(BaseModel):
    """The draft worker: a separate deployment holding the draft model (its own device / node)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="Deploy the draft worker and offer the 'draft_model' proposer.")
    model: str = Field("target", description="'target' (the target as its own draft), 'smollm2' or a local HF dir.")
    eagle: str | None = Field(
        None,
        description="Directory of a trained EAGLE head (e.g. models/smollm2-eagle; a relative path missing from "
        "the working directory is taken from the repo root): the draft worker also serves the 'eagle' proposer.",
    )
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: str = "auto"
    native_kernels: bool = Field(
        True,
        description="Run the draft model's attention and row-wise ops (RMSNorm, RoPE, SiLU) as the target's native "
        "kernels on a CPU with a C compiler, instead of torch ops: a shorter draft step (docs/benchmarks.md). They "
        "round differently, which may change a draft, never the output.",
    )
    cpu_gemm: Literal["auto", "onednn", "mkl", "native"] = Field(
        "auto",
        description="The draft model's weight GEMMs on a CPU, as engine.cpu_gemm: 'auto' takes the native kernels "
        "where they measured fastest. With native_kernels too, its whole forward is one native call: a draft step "
        "about half as long at one request (docs/benchmarks.md). They round differently, which may change a draft, "
        "never the output.",
    )
    num_threads: int | None = Field(None, ge=1, description="torch threads in the draft replica.")
    max_num_seqs: int = Field(
        256,
        ge=1,
        le=4096,
        description="Requests the draft keeps state for, over all target replicas; more run without drafts "
        "(output unchanged). Their KV comes from kv_cache_memory_gb, not from this times max_model_len.",
    )
    kv_cache_memory_gb: float = Field(
        0.5,
        gt=0,
        le=4096,
        description="GiB of the draft worker's paged KV pools (the draft model's and the EAGLE head's hold the same "
        "number of tokens; engine.block_size tokens per block). A request holds blocks for the tokens it has plus its "
        "drafts; when the pool is full the youngest requests run without drafts (output unchanged). 0.5 GiB holds "
        "~87k tokens with the shipped 3-layer draft and EAGLE head in fp32 (4.5 + 1.5 KiB per token). Capped at what "
        "max_num_seqs requests of engine.max_model_len can use; must hold one such request (an error naming this key).",
    )
    call_timeout_s: float = Field(
        2.0, gt=0, description="A draft call slower than this is abandoned; the step runs plain (output unchanged)."
    )
    retry_after_s: float = Field(1.0, ge=0, description="After a failed call, run plain for this long, then retry.")
    state_ttl_s: float = Field(
        60.0,
        gt=0,
        description="Draft state of a request no call touched for this long is freed (orphans of a "
        "dead target replica); a live request resyncs, output unchanged.",
    )
    resources: Resources = Field(default_factory=lambda: Resources(num_cpus=0.5))


class IngressConfig(BaseModel):
    """HTTP-facing limits and auth."""

    model_config = ConfigDict(extra="forbid")

    max_tokens_cap: int = Field(1024, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when the request gives none.")
    max_body_bytes: int = Field(1_000_000, ge=1024, description="Request bodies above this get 413.")
    max_stop_strings: int = Field(8, ge=0, description="Most stop strings per request.")
    max_stop_chars: int = Field(64, ge=1, description="Longest stop string.")
    api_key: str | None = Field(
        None, description="If set (or env SPECSERVE_API_KEY), every route but /health needs 'Authorization: Bearer'."
    )
    request_timeout_s: float = Field(300.0, gt=0, description="A request running longer is cancelled with 408.")
    stream_idle_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="A streamed answer whose client takes no data for this long (it stopped reading without "
        "disconnecting) is cancelled as on a disconnect: the engine aborts it and the connection is closed. "
        "Enforced by Serve's HTTP proxy through the middleware the launchers install "
        "(RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, docs/operations.md); null: never.",
    )
    max_n: int = Field(8, ge=1, le=128, description="Largest n (choices per prompt) a request may ask for.")
    max_prompts: int = Field(32, ge=1, le=1024, description="Most prompts in one batched completions request.")
    max_resumes: int = Field(
        3,
        ge=0,
        le=10,
        description="Times one request is submitted again when its target replica dies (before or during its "
        "stream): with the tokens already sent, so the stream continues bit-identically on another replica. 0: a "
        "replica's death ends its streams with an error.",
    )
    tool_prompt: ToolPromptFormat = Field(
        default_factory=ToolPromptFormat,
        description="How tools reach the served model as text and how its calls are read back (the model's chat "
        "template has no tool section): Hermes-style <tool_call> JSON blocks by default; deployments/tools.py.",
    )
    num_replicas: int = Field(1, ge=1, description="Ingress replicas (HTTP parsing, SSE framing).")
    max_ongoing_requests: int = Field(
        256,
        ge=1,
        description="Requests one ingress replica streams at once. Serve's own default (5) would cap the "
        "whole service at 5 concurrent requests; the target's limits (target.max_ongoing_requests / "
        "max_queued_requests) are where overload is turned into 503s.",
    )


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    report_interval_s: float = Field(
        0.05, gt=0, le=5, description="How often target replicas check their load and push it if it changed."
    )
    heartbeat_s: float = Field(
        0.5,
        gt=0,
        le=60,
        description="Most time between two pushes of an unchanged load (keeps the replica fresh "
        "for the Router and brings a changed policy within this time).",
    )
    stale_after_s: float = Field(2.0, gt=0, description="Loads older than this are ignored when picking a replica.")
    route_timeout_s: float = Field(
        0.1,
        gt=0,
        le=10,
        description="Most the ingress waits for the Router's answer. A Router that fails, restarts or is slow is "
        "then skipped: Serve picks a target replica and the engine's per-step policy decides the path.",
    )
    prefix_affinity_max_imbalance: float = Field(
        2.0,
        ge=0,
        description="Prefix-aware placement: a request that continues an earlier prompt (a conversation's next "
        "turn, a repeat) goes to the replica that was sent that prompt's KV blocks while that replica has at most "
        "this many requests (in its engine and routed to it) more than the least busy replica; beyond it, to the "
        "least-loaded. Small, so that a hot prompt never leaves another replica idle. 0 turns affinity off. "
        "Placement changes speed only, never output.",
    )
    prefix_index_blocks: int = Field(
        65536,
        ge=0,
        description="Most KV blocks the Router remembers the placement of (least recently routed forgotten "
        "first; about 300 bytes each, 20 MB at the default). Enough for several replicas' block pools; "
        "0 turns affinity off.",
    )

    @model_validator(mode="after")
    def _fresh_enough(self) -> RouterConfig:
        if self.heartbeat_s >= self.stale_after_s:
            raise ValueError(
                f"heartbeat_s ({self.heartbeat_s}) must be below stale_after_s ({self.stale_after_s}): "
                "an idle replica would look dead to the Router"
            )
        return self


class RouterUserConfig(BaseModel):
    """``user_config`` of the Router deployment: applied live by ``serve deploy`` (no replica restart).

    The Router is the one place the policy lives; target replicas pick up a new policy
    from the Router's answer to their next load report (within ``report_interval_s``).
    """

    model_config = ConfigDict(extra="forbid")

    policy: PolicyConfig = Field(default_factory=default_policy_config, description="Routing policy (default goodput).")

    def policy_dump(self) -> dict[str, Any]:
        return self.policy.model_dump(mode="json")


class TelemetryConfig(BaseModel):
    """Metrics (on by default, pulled by ``GET /metrics``) and traces (off by default)."""

    model_config = ConfigDict(extra="forbid")

    metrics: bool = Field(
        True,
        description="Record metrics for GET /metrics. false: no-op instruments, /metrics has no samples "
        "(the telemetry-overhead benchmark's baseline).",
    )

    tracing: Literal["off", "console", "otlp", "memory"] = Field(
        "off",
        description="Span exporter: 'off' (no tracer, no per-step event recording: zero cost), 'console' "
        "(replica logs), 'otlp' (OTLP/HTTP to otlp_endpoint) or 'memory' (kept in process, for tests).",
    )
    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces URL, e.g. http://collector:4318/v1/traces; None: the exporter's default "
        "(env OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or http://localhost:4318/v1/traces).",
    )
    service_name: str = Field("specserve", min_length=1, description="OTel resource service.name of every span.")

    @field_validator("tracing", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        return "off" if v is False else v  # YAML 1.1 reads a bare `off` as false


# Proposers that run in the draft worker (the target worker holds a remote proxy for each).
DRAFT_WORKER_PROPOSERS = ("draft_model", "eagle")


class AppConfig(BaseModel):
    """``args`` of the Serve application in ray_config.yaml."""

    model_config = ConfigDict(extra="forbid")

    engine: EngineConfig = Field(default_factory=EngineConfig)
    target: TargetResources = Field(default_factory=lambda: TargetResources(num_cpus=1.0))
    draft: DraftConfig = Field(default_factory=DraftConfig)
    ingress: IngressConfig = Field(default_factory=IngressConfig)
    router: RouterConfig = Field(default_factory=RouterConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @model_validator(mode="after")
    def _eagle_needs_a_head(self) -> AppConfig:
        if self.draft.enabled and any(p.name == "eagle" for p in self.engine.proposers) and not self.draft.eagle:
            raise ValueError("engine.proposers lists 'eagle' but draft.eagle (the EAGLE head directory) is not set")
        return self


# ---------------------------------------------------------------------------------------------------------- checks

APP_IMPORT_PATH = "deployments.builder:build_app"  # the applications whose args AppConfig describes
ROUTER_DEPLOYMENT = "Router"  # its user_config is a RouterUserConfig


def _members(tp: Any) -> list[Any]:
    """The types a field annotation may hold: Annotated and unions (Optional included) unwrapped."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _members(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return [m for a in get_args(tp) for m in _members(a)]
    return [tp]


def _step(tp: Any, key: str | int) -> tuple[Any, bool]:
    """The type at ``key`` of an error's location inside ``tp``, and whether ``key`` is a place in the YAML
    (False: the tag pydantic adds for the member of a discriminated union, e.g. a policy's name)."""
    models = [m for m in _members(tp) if isinstance(m, type) and issubclass(m, BaseModel)]
    for m in _members(tp):
        if isinstance(key, int) and get_origin(m) in (list, tuple):
            return get_args(m)[0], True
        if isinstance(key, str) and get_origin(m) is dict:
            return get_args(m)[1], True
    for m in models:
        if isinstance(key, str) and key in m.model_fields:
            return m.model_fields[key].annotation, True
    for m in models:  # a union member by its tag: the Literal one of its fields holds
        if any(get_origin(f.annotation) is Literal and key in get_args(f.annotation) for f in m.model_fields.values()):
            return m, False
    return None, True


def _path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}" if out else p
    return out


def describe_errors(err: ValidationError, model: type[BaseModel], prefix: str = "") -> list[str]:
    """One line per error of ``err`` (raised by ``model.model_validate``): where in the YAML, what is wrong,
    and for an unknown key the keys allowed there (and the closest one)."""
    lines = []
    for e in err.errors(include_url=False):
        tp: Any = model
        where: list[str | int] = []
        parents: list[Any] = []
        for key in e["loc"]:
            parents.append(tp)
            tp, in_yaml = _step(tp, key) if tp is not None else (None, True)
            if in_yaml:
                where.append(key)
        at = prefix + _path(where) if where else (prefix.rstrip(".") or "args")
        if e["type"] == "extra_forbidden":
            parent = next((m for m in _members(parents[-1]) if isinstance(m, type) and issubclass(m, BaseModel)), None)
            allowed = list(parent.model_fields) if parent is not None else []
            close = difflib.get_close_matches(str(e["loc"][-1]), allowed, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            lines.append(f"{at}: unknown key{hint}; allowed: {', '.join(allowed)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = f" (got {reprlib.repr(e['input'])})" if e["type"] not in ("missing", "value_error") else ""
            lines.append(f"{at}: {msg}{got}")
    return lines


def check_serve_config(cfg: Any) -> list[str]:
    """What the app's models find wrong in a Serve config (ray_config.yaml, loaded), before anything starts:
    the ``args`` of each application built by :data:`APP_IMPORT_PATH` (:class:`AppConfig`) and the Router's
    ``user_config`` (:class:`RouterUserConfig`). The same models run in ``build_app`` and the Router, so
    what passes here passes there. Empty when all is well."""
    apps = cfg.get("applications") if isinstance(cfg, dict) else None
    if not isinstance(apps, list) or not apps:
        return ["applications: a list of at least one application is required"]
    problems: list[str] = []
    for i, app in enumerate(apps):
        if not isinstance(app, dict) or app.get("import_path") != APP_IMPORT_PATH:
            continue  # not ours: Serve checks it
        where = f"applications[{i}] ({app.get('name', 'default')})." if len(apps) > 1 else ""
        try:
            AppConfig.model_validate(app.get("args") or {})
        except ValidationError as e:
            problems += describe_errors(e, AppConfig, where)
        for d in app.get("deployments") or []:
            if isinstance(d, dict) and d.get("name") == ROUTER_DEPLOYMENT and "user_config" in d:
                try:
                    RouterUserConfig.model_validate(d["user_config"] or {})
                except ValidationError as e:
                    problems += describe_errors(
                        e, RouterUserConfig, f"{where}deployments[{ROUTER_DEPLOYMENT}].user_config."
                    )
    return problems
