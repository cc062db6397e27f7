"""The workload guidellm sends, made again for the engine in process: the shipped app config, guidellm's
synthetic prompts and sampling parameters, and the proposers the target replica runs itself. The
in-process passes of benchmarks/serving/guidellm_load.py run exactly this, so the two sides differ only in
the serving path."""

from __future__ import annotations

from typing import Any

from cluster.config import DRAFT_WORKER_PROPOSERS, AppConfig
from cluster.local_cluster import shipped_app_args
from deployments.protocol import CompletionRequest
from workers.proposers.registry import make_proposer


def service_config() -> AppConfig:
    """The app config as shipped in ray_config.yaml."""
    return AppConfig.model_validate(shipped_app_args())


def guidellm_sampling(output_tokens: int) -> dict[str, Any]:
    """The engine's sampling parameters for a request as guidellm 0.8 sends it to ``/v1/completions``
    (model, prompt, stream with usage, ``max_tokens``, ``stop: null``, ``ignore_eos``), read through
    the API's own request model, so that the in-process passes sample exactly as the served ones."""
    body = {
        "model": "m",
        "prompt": "x",
        "stream": True,
        "max_tokens": output_tokens,
        "stop": None,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    req = CompletionRequest.model_validate(body)
    return {
        "max_tokens": req.max_tokens,
        "ignore_eos": req.ignore_eos,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "seed": req.seed,
    }


def guidellm_prompts(tokenizer: Any, n: int, prompt_tokens: int, seed: int) -> list[list[int]]:
    """``n`` prompts as guidellm 0.8's synthetic_text makes them (seeded Faker text, encoded, cut to
    ``prompt_tokens``, decoded), then encoded as the service encodes the text it receives."""
    from faker import Faker  # guidellm's own dependency

    fake = Faker()
    fake.seed_instance(seed)
    out = []
    for _ in range(n):
        ids: list[int] = []
        attempts = 0
        while len(ids) < prompt_tokens:
            attempts += 1
            ids = tokenizer.encode(
                fake.text(max_nb_chars=int(prompt_tokens * 5 * 1.5 * attempts)), add_special_tokens=False
            )
        out.append(
            tokenizer.encode(tokenizer.decode(ids[:prompt_tokens], skip_special_tokens=True), add_special_tokens=False)
        )
    return out


def local_proposers(cfg: AppConfig) -> dict[str, Any]:
    """The proposers the target replica runs in its own process (the draft worker's are remote)."""
    return {
        p.name: make_proposer(p.name, **p.options) for p in cfg.engine.proposers if p.name not in DRAFT_WORKER_PROPOSERS
    }
