"""The shipped context (8192) and running requests (128) in a small KV pool (1.5 GiB), over HTTP: a 4,000-token
prompt completes beside two streams and the target replica's RSS stays under 4.5 GB. The 6,000-token prompt
beside 96 streams is benchmarks/serving/long_context.py (too slow for the suite on two cores)."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from benchmarks.serving.long_context import ARGS, GOAL_RSS_GB, RssSampler, load
from cluster.local_cluster import LocalCluster
from tests.e2e_helpers import started

pytestmark = pytest.mark.slow


def test_a_long_prompt_completes_beside_streams_in_a_small_pool(tmp_path):
    with started(LocalCluster(tmp_path, args_patch=ARGS, nodes=1)) as cluster:
        pid = cluster.call("TargetWorker", "placement")["pid"]
        with RssSampler({"target": pid}) as rss:
            run = asyncio.run(load(cluster.base_url, streams=2, long_tokens=4000))
        assert run["long"]["prompt_tokens"] == 4000 and run["long"]["completion_tokens"] == 16, run
        assert run["streams_done"] == 2, run
        assert rss.peak("target") < GOAL_RSS_GB, rss.peak("target")
        assert psutil.Process(pid).is_running()
