"""`make serve` answers a config error in seconds: checked before Ray starts, and a DEPLOY_FAILED ends the wait.

No Ray here: the CLI runs in a subprocess with Ray's and Serve's commands replaced by a failure, so a check
that let a bad YAML through fails this test instead of starting a cluster.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import yaml

from cluster import serve_local
from cluster.config import check_serve_config
from cluster.local_cluster import shipped_config

ROOT = Path(__file__).resolve().parent.parent

# `python -m cluster.serve_local ARGS`, except that starting anything raises
_CLI = (
    "import sys\n"
    "import cluster.serve_local as s\n"
    "def refuse(*a, **k):\n"
    "    raise SystemExit(f'would have run {a[:2]}')\n"
    "s._ray = s.subprocess.run = refuse\n"
    "sys.argv = ['serve_local', *sys.argv[1:]]\n"
    "s.main()\n"
)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _CLI, *args], cwd=ROOT, text=True, capture_output=True, timeout=60)


def _bad_yaml(tmp_path: Path) -> Path:
    cfg = shipped_config()
    cfg["applications"][0]["args"]["engine"]["kv_cache_memory_gib"] = 4
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_start_with_an_unknown_key_exits_at_once_naming_it(tmp_path):
    t0 = time.monotonic()
    out = _cli("start", "--config", str(_bad_yaml(tmp_path)))
    assert time.monotonic() - t0 < 30
    assert out.returncode == 1, out.stderr
    assert "would have run" not in out.stderr + out.stdout  # nothing started
    assert "engine.kv_cache_memory_gib: unknown key" in out.stderr
    assert "kv_cache_memory_gb" in out.stderr and "allowed: model, served_model_name, dtype," in out.stderr
    assert "Traceback" not in out.stderr
    assert _cli("check", "--config", str(_bad_yaml(tmp_path))).returncode == 1


def test_the_shipped_config_passes_the_check():
    out = _cli("check")
    assert out.returncode == 0, out.stderr
    assert check_serve_config(shipped_config()) == []


def test_check_names_each_problem_where_it_is():
    cfg = shipped_config()
    args = cfg["applications"][0]["args"]
    args["engine"]["scheduler"]["itl_ratoi"] = 1.5
    args["engine"]["proposers"][0]["optons"] = {}
    args["target"]["num_replicas"] = 0
    cfg["applications"][0]["deployments"][0]["user_config"]["policy"]["prior_acceptence"] = 0.5
    problems = check_serve_config(cfg)
    assert "engine.scheduler.itl_ratoi: unknown key (did you mean itl_ratio?); allowed: " in problems[0]
    assert problems[1].startswith("engine.proposers[0].optons: unknown key (did you mean options?); allowed: name,")
    assert problems[2] == "target.num_replicas: Input should be greater than or equal to 1 (got 0)"
    # the Router's user_config: the policy's own keys (the discriminated union's tag is no place in the YAML)
    assert problems[3].startswith(
        "deployments[Router].user_config.policy.prior_acceptence: unknown key (did you "
        "mean prior_acceptance?); allowed: "
    )
    assert len(problems) == 4


def test_check_leaves_other_apps_to_serve():
    cfg = {"applications": [{"name": "other", "import_path": "elsewhere:app", "args": {"anything": 1}}]}
    assert check_serve_config(cfg) == []
    assert check_serve_config({"applications": []}) == ["applications: a list of at least one application is required"]


# What Serve's controller reports when build_app raises (nested tracebacks, the original one last).
DEPLOY_FAILED_MESSAGE = """Deploying app 'specserve' failed with exception:
Traceback (most recent call last):
  File "/venv/.../ray/serve/_private/application_state.py", line 1820, in build_serve_application
    app = call_user_app_builder_with_args_if_necessary(import_attr(import_path), args)
ray.exceptions.RayTaskError(RuntimeError): ray::build_serve_application() (pid=123, ip=127.0.0.1)
RuntimeError: Traceback (most recent call last):
  File "/repo/deployments/builder.py", line 21, in build_app
    cfg = AppConfig.model_validate(args or {})
pydantic_core._pydantic_core.ValidationError: 2 validation errors for AppConfig
engine.kv_cache_memory_gib
  Extra inputs are not permitted [type=extra_forbidden, input_value=4, input_type=int]
    For further information visit https://errors.pydantic.dev/2.14/v/extra_forbidden
target.num_replicas
  Input should be greater than or equal to 1 [type=greater_than_equal, input_value=0, input_type=int]
    For further information visit https://errors.pydantic.dev/2.14/v/greater_than_equal
"""


def test_failure_summary_keeps_the_original_error_only():
    assert serve_local.failure_summary(DEPLOY_FAILED_MESSAGE).splitlines() == [
        "2 validation errors for AppConfig",
        "  engine.kv_cache_memory_gib: Extra inputs are not permitted",
        "  target.num_replicas: Input should be greater than or equal to 1",
    ]
    other = "Deploying app 'x' failed:\nTraceback (most recent call last):\n  File \"a.py\", line 1\nOSError: no model"
    assert serve_local.failure_summary(other) == "OSError: no model"


def test_deploy_failure_ends_the_wait_only_for_this_deploy(monkeypatch):
    now = time.time()
    status = {"status": "DEPLOY_FAILED", "message": DEPLOY_FAILED_MESSAGE, "last_deployed_time_s": now}
    monkeypatch.setattr(serve_local, "app_status", lambda name: status)
    assert "engine.kv_cache_memory_gib" in serve_local.deploy_failure("specserve", now)
    status["last_deployed_time_s"] = now - 60  # a failure of the deploy before ours
    assert serve_local.deploy_failure("specserve", now) is None
    status.update(status="DEPLOYING", last_deployed_time_s=now)
    assert serve_local.deploy_failure("specserve", now) is None
    monkeypatch.setattr(serve_local, "app_status", lambda name: None)  # dashboard not up yet
    assert serve_local.deploy_failure("specserve", now) is None


def test_a_kv_budget_too_small_for_one_request_is_named_before_anything_starts(tmp_path):
    """Both pools are checked against the models' sizes (read from their config files) before Ray starts."""
    cfg = shipped_config()
    args = cfg["applications"][0]["args"]
    args["engine"].update({"model": "models/smollm2-draft", "kv_cache_memory_gb": 0.01})
    args["draft"].update({"kv_cache_memory_gb": 0.001})
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = _cli("start", "--config", str(path))
    assert out.returncode == 1, out.stderr
    assert "would have run" not in out.stderr + out.stdout  # nothing started
    assert "engine.kv_cache_memory_gb=0.01 holds" in out.stderr and "raise engine.kv_cache_memory_gb" in out.stderr
    assert "draft.kv_cache_memory_gb=0.001 holds" in out.stderr
    assert "Traceback" not in out.stderr
    assert serve_local.kv_budget_problems(shipped_config()["applications"][0]["args"]) == []
