"""Fuzz the running service over its own /openapi.json with schemathesis (property-based).

    python -m benchmarks.serving.fuzz [--examples 200] [--quick]

Starts a one-node local cluster (cluster/local_cluster.py) with an API key and a short request
timeout, then drives every operation of the served description with schemathesis-generated
requests, each once with the key and once without, both requests the description allows and requests
it refuses (schemathesis' positive and negative modes). A finding is a 5xx, a response that does not
conform to the description (status, content type, body schema), a success for a request the
description refuses, or a request not answered within the request timeout. Before and after the
fuzz one greedy request is made; the two answers must be identical (the fuzz left no state behind).

``fuzz`` is also what tests/test_hostile_e2e.py runs, with a few hundred cases. Writes
benchmarks/results/fuzz.{json,png}: the cases per operation and status, and every finding.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

import requests

# positive: requests the description allows; negative: requests it refuses (each must be a described 4xx)
MODES = ("positive", "negative")
CHECK_NAMES = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
)


def _checks() -> list[Any]:
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_schema_conformance,
        status_code_conformance,
    )

    return [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
        negative_data_rejection,  # a request the description refuses must not succeed
    ]


@dataclasses.dataclass
class Tally:
    """What a fuzz saw: cases by operation and status, refusals by the field named, and the findings."""

    cases: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    refused: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    findings: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    slowest_s: float = 0.0


def fuzz(base_url: str, api_key: str | None, max_examples: int, request_timeout_s: float) -> dict:
    """Every operation of ``base_url``'s /openapi.json, ``max_examples`` generated cases each (derandomized:
    the same cases each run), with the key and (when there is one) without. Returns the case counts and
    the findings."""
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    tally = Tally()
    session = requests.Session()
    for result in schema.get_all_operations():
        for key in [api_key, None] if api_key else [None]:
            for mode in MODES:
                _fuzz_operation(result.ok(), base_url, key, mode, max_examples, request_timeout_s, session, tally)
    return {
        "cases": sum(tally.cases.values()),
        "by_operation": dict(sorted(tally.cases.items())),
        "refused_by_param": dict(tally.refused.most_common()),
        "findings": tally.findings,
        "slowest_s": tally.slowest_s,
        "checks": list(CHECK_NAMES),
        "max_examples": max_examples,
        "modes": list(MODES),
    }


def _fuzz_operation(
    op: Any,
    base_url: str,
    key: str | None,
    mode: str,
    max_examples: int,
    request_timeout_s: float,
    session: requests.Session,
    tally: Tally,
) -> None:
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis.core.failures import FailureGroup
    from schemathesis.generation import GenerationMode

    checks = _checks()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    label = f"{op.method.upper()} {op.path} {'key' if key else 'no key'} {mode}"

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=op.as_strategy(generation_mode=GenerationMode(mode)))
    def one(case: Any) -> None:  # findings are collected, not raised: no shrinking, the run goes on
        t0 = time.monotonic()
        try:
            resp = case.call(base_url=base_url, session=session, headers=headers, timeout=request_timeout_s + 10)
        except requests.RequestException as e:
            tally.findings.append({"operation": label, "check": "no answer", "detail": repr(e)[:500]})
            tally.cases[f"{label} -> no answer"] += 1
            return
        took = time.monotonic() - t0
        tally.slowest_s = max(tally.slowest_s, took)
        tally.cases[f"{label} -> {resp.status_code}"] += 1
        if 400 <= resp.status_code < 500 and key:  # what the service refused, by the field it named
            try:
                tally.refused[f"{label} -> {resp.status_code} {resp.json()['error']['param']}"] += 1
            except (ValueError, KeyError, TypeError):
                tally.refused[f"{label} -> {resp.status_code} (no error body)"] += 1
        if took > request_timeout_s + 5:
            tally.findings.append({"operation": label, "check": "hang", "detail": f"answered after {took:.1f}s"})
        try:
            case.validate_response(resp, checks=checks, headers=headers)
        except FailureGroup as e:
            titles = sorted({f.title for f in e.exceptions})
            tally.findings.append(
                {"operation": label, "check": ", ".join(titles), "status": resp.status_code, "detail": str(e)[:1500]}
            )

    try:
        one()
    except Unsatisfiable:  # negative mode on an operation that takes nothing: no request to make
        pass


def greedy(base_url: str, api_key: str | None) -> str:
    """One fixed greedy request: its answer before and after a fuzz must be identical."""
    r = requests.post(
        f"{base_url}/v1/completions",
        json={
            "model": "SmolLM2-135M-Instruct",
            "prompt": "The capital of France is",
            "max_tokens": 24,
            "temperature": 0,
        },
        headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def main() -> None:
    from benchmarks.common import RESULTS_DIR, env_info, figure, save_result
    from cluster.local_cluster import LocalCluster

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=200, help="generated cases per operation, key and mode")
    ap.add_argument("--quick", action="store_true", help="10 cases per operation, key and mode")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR / "fuzz")
    args = ap.parse_args()
    examples = 10 if args.quick else args.examples
    env = env_info()
    timeout_s, key = 30.0, "sk-fuzz"
    # caps the description carries too: generated requests stay within a few seconds of engine time
    ingress = {
        "api_key": key,
        "request_timeout_s": timeout_s,
        "max_tokens_cap": 64,
        "default_max_tokens": 32,
        "max_n": 2,
        "max_prompts": 4,
    }
    with tempfile.TemporaryDirectory() as tmp:
        cluster = LocalCluster(Path(tmp), nodes=1, args_patch={"ingress": ingress})
        cluster.start()
        try:
            before = greedy(cluster.base_url, key)
            t0 = time.monotonic()
            out = fuzz(cluster.base_url, key, examples, timeout_s)
            out["wall_s"] = time.monotonic() - t0
            out["greedy_identical_after"] = greedy(cluster.base_url, key) == before
            out["greedy_answer"] = before
        finally:
            cluster.stop()
    out["env"] = env
    out["ingress"] = {k: v for k, v in ingress.items() if k != "api_key"}
    fig, (ax,) = figure(1, width=9, height=6)
    labels = list(out["by_operation"])
    ax.barh(labels, [out["by_operation"][k] for k in labels])
    ax.tick_params(axis="y", labelsize=6)
    ax.set_xlabel("cases (operation, key, status)")
    save_result(args.out, out, fig, title=f"fuzz: {out['cases']} cases, {len(out['findings'])} findings")
    print(f"{out['cases']} cases, {len(out['findings'])} findings, greedy identical: {out['greedy_identical_after']}")


if __name__ == "__main__":
    main()
