"""deployments/request_parsing.py without a cluster: every refused body of the e2e bad-input tests
(tests/bad_inputs.py, tests/test_e2e_http.py) is refused by the parse step alone, with the param and
status those tests expect, and a good body becomes the engine's params and the prompt's token ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from cluster.config import AppConfig
from cluster.local_cluster import shipped_app_args
from deployments.request_parsing import HTTPError, parse_request
from tests.bad_inputs import CHAT, COMPL, HOSTILE, MODEL
from tests.test_e2e_http import BAD

PROPOSERS = ["ngram", "suffix", "draft_model"]


@pytest.fixture(scope="module")
def cfg() -> AppConfig:
    args = shipped_app_args()
    # the e2e cluster's context (cluster/local_cluster.py), which the context-length cases are sized for
    return AppConfig.model_validate({**args, "engine": {**args["engine"], "max_model_len": 512}})


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's tokenizer and chat template


def raw_body(route: str, payload: Any) -> bytes:
    """The bytes tests/bad_inputs.py:send posts for this case."""
    if isinstance(payload, bytes):
        return payload
    base = (
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        if route == CHAT
        else {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    )
    payload = dict(payload)
    keep_null = payload.pop("_keep_null", False)
    merged = {**base, **payload}
    if not keep_null:
        merged = {k: v for k, v in merged.items() if v is not None}
    return json.dumps(merged).encode()


CASES = [(n, r, p, param, st) for n, r, p, param, st in HOSTILE if r in (CHAT, COMPL)]  # not 404 / 405
CASES += [(n, CHAT, b, param, None) for n, b, param in BAD]


@pytest.mark.parametrize("name,route,payload,param,status", CASES, ids=[c[0] for c in CASES])
def test_each_bad_body_is_refused_by_the_parse_step(cfg, tokenizer, name, route, payload, param, status):
    with pytest.raises(HTTPError) as e:
        parse_request(raw_body(route, payload), route == CHAT, cfg, PROPOSERS, tokenizer)
    assert 400 <= e.value.status < 500
    assert status is None or e.value.status == status
    assert param is None or e.value.param == param


def test_a_good_body_becomes_params_and_token_ids(cfg, tokenizer):
    body = {"model": MODEL, "prompt": [[1, 2, 3], [4, 5]], "temperature": 0.5, "seed": 7, "stop": ["."]}
    _, params, prompts = parse_request(json.dumps(body).encode(), False, cfg, PROPOSERS, tokenizer)
    assert prompts == [[1, 2, 3], [4, 5]]
    assert (params["temperature"], params["seed"], params["stop"]) == (0.5, 7, ["."])
    assert params["max_tokens"] == cfg.ingress.default_max_tokens and params["logprobs"] is None
    chat = {"model": MODEL, "messages": [{"role": "user", "content": " w" * 400}]}
    _, params, (ids,) = parse_request(json.dumps(chat).encode(), True, cfg, PROPOSERS, tokenizer)
    assert ids[-3:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)[-3:]  # the template
    assert len(ids) + 256 > 512 and params["max_tokens"] == 512 - len(ids)  # the default 256 cut to the context
