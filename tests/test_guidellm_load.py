"""The load benchmark's arithmetic: its goals from hand-written numbers, the client's CPU over the window
its requests ran, the sampling its in-process passes share with guidellm's requests, and the client-CPU
burners it runs the in-process engine beside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from benchmarks.serving import guidellm_load
from benchmarks.serving.guidellm_load import burn_cores, goals, window_rate
from benchmarks.serving.guidellm_workload import guidellm_sampling


def _lvl(ttft_p99_ms: float, itl_p50_ms: float, tok_s: float) -> dict:
    return {"ttft_p99_ms": ttft_p99_ms, "itl_p50_ms": itl_p50_ms, "tok_s": tok_s}


def test_goals_from_hand_written_numbers():
    http = {1: _lvl(200, 40, 25), 16: _lvl(1400, 90, 120)}
    engine = {1: _lvl(100, 30, 35), 16: _lvl(800, 60, 200)}
    g = goals(http, engine)
    assert g["ttft_p99_16_s<=1.5"] == {"value": 1.4, "met": True}
    assert g["itl_p50_16/itl_p50_1<=2.5"] == {"value": 2.25, "met": True}
    assert g["tok_s_16/tok_s_1>=4.5"] == {"value": 4.8, "met": True}
    assert g["tok_s_16_http/engine>=0.8"] == {"value": 0.6, "met": False}
    assert g["tpot_1_http/engine<=1.1"] == {"value": 1.333, "met": False}
    assert goals({1: http[1]}, engine) == {"tpot_1_http/engine<=1.1": {"value": 1.333, "met": False}}


@pytest.mark.parametrize("cores,procs", [(0.0, 0), (0.4, 1), (1.5, 2)])
def test_burners_use_about_the_cores_asked(cores, procs):
    burners = burn_cores(cores)
    try:
        assert len(burners) == procs
        if procs:
            ps = [psutil.Process(b.pid) for b in burners]
            time.sleep(0.5)  # interpreter start-up
            t0 = sum(sum(p.cpu_times()[:2]) for p in ps)
            time.sleep(2.0)
            used = (sum(sum(p.cpu_times()[:2]) for p in ps) - t0) / 2.0
            assert 0.5 * cores < used < 1.3 * cores + 0.1
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert all(b.poll() is not None for b in burners)


def test_window_rate_reads_the_counter_between_the_window_ends():
    samples = [(10.0, 0.0), (11.0, 2.0), (12.0, 2.5), (13.0, 2.5)]  # 2 cores busy, then 0.5, then idle
    assert window_rate(samples, 10.0, 11.0) == 2.0
    assert window_rate(samples, 10.5, 12.5) == (2.5 - 1.0) / 2.0  # interpolated at both ends
    assert window_rate(samples, 12.0, 20.0) == 0.0  # past the last sample: its value holds
    assert window_rate(samples, 5.0, 11.0) == 2.0 / 6.0  # before the first: the first value holds
    assert window_rate(samples[:1], 10.0, 11.0) == 0.0 and window_rate(samples, 11.0, 11.0) == 0.0


def test_in_process_passes_sample_as_guidellms_requests_do():
    """guidellm names no temperature, so the API's default (1.0) samples every token; an in-process pass
    that decodes greedily would skip the sampler's work and flatter the engine."""
    assert guidellm_sampling(64) == {
        "max_tokens": 64,
        "ignore_eos": True,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "seed": None,
    }


def test_run_guidellm_sets_the_worker_count_and_reads_its_report(tmp_path, monkeypatch):
    """The command guidellm gets (closed loop at the stream count, the local tokenizer, the worker count in
    its environment) and the numbers read back from its JSON report, with a stand-in for the process."""
    seen = {}

    def dist(p50, p99, mean=0.0):
        return {"successful": {"percentiles": {"p50": p50, "p99": p99}, "mean": mean}}

    class FakePopen:
        pid, returncode = os.getpid(), 0

        def __init__(self, cmd, env, **kwargs):
            seen["cmd"], seen["workers"] = cmd, env.get("GUIDELLM__MAX_WORKER_PROCESSES")

        def poll(self):
            return 0

        def communicate(self, timeout=None):
            now = time.time()
            report = {
                "benchmarks": [
                    {
                        "metrics": {
                            "time_to_first_token_ms": dist(100, 300),
                            "inter_token_latency_ms": dist(20, 40),
                            "output_tokens_per_second": dist(0, 0, mean=55.0),
                        },
                        "requests": {"successful": [{}] * 7, "errored": []},
                        "start_time": now - 5.0,
                        "end_time": now,
                    }
                ]
            }
            (tmp_path / "out.json").write_text(json.dumps(report))
            return "", ""

    monkeypatch.setattr(guidellm_load.subprocess, "Popen", FakePopen)
    res = guidellm_load.run_guidellm(
        "http://127.0.0.1:1", "m", "/tok", 16, 5.0, 128, 64, tmp_path / "out.json", 0.2, workers=1
    )
    assert seen["workers"] == "1"
    assert "kind=concurrent,streams=16,warmup=0.2" in seen["cmd"]
    assert "kind=huggingface_auto,model=/tok" in seen["cmd"]
    assert {
        k: res[k]
        for k in ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tok_s", "num_requests", "num_errors")
    } == {
        "ttft_p50_ms": 100,
        "ttft_p99_ms": 300,
        "itl_p50_ms": 20,
        "itl_p99_ms": 40,
        "tok_s": 55.0,
        "num_requests": 7,
        "num_errors": 0,
    }
    assert res["client_cpu_cores"] == 0.0  # the stand-in exits at once: no samples inside its window
    assert res["client_cpu_cores_whole_run"] >= 0


def test_stopped_holds_the_processes_still_inside_the_block_and_continues_them_after(tmp_path):
    """The paired pass beside the stopped service: a stopped process takes no CPU inside the block (its
    CPU time does not move) and runs again after it, also when the block raises."""
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        p = psutil.Process(child.pid)
        time.sleep(0.3)
        with pytest.raises(RuntimeError):
            with guidellm_load.stopped([p]):
                assert p.status() == psutil.STATUS_STOPPED
                before = sum(p.cpu_times()[:2])
                time.sleep(0.5)
                assert sum(p.cpu_times()[:2]) == before
                raise RuntimeError("a pass failed")
        assert p.status() != psutil.STATUS_STOPPED
        before = sum(p.cpu_times()[:2])
        time.sleep(0.5)
        assert sum(p.cpu_times()[:2]) > before
    finally:
        child.kill()
        child.wait()


def test_the_sampler_reads_the_services_cpu_by_role_beside_the_clients():
    """The service's CPU is sampled in the thread and on the clock the client's is, so both are read over
    the window guidellm's requests ran in: a busy service process reads about a core there."""
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.5)"])
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        samples, by_role = [], []
        t0 = time.time()
        guidellm_load._sample_cpu(client, samples, [psutil.Process(busy.pid)], by_role, every_s=0.1)
        assert len(by_role) == len(samples) >= 5 and all(set(d) == {"other"} for _, d in by_role)
        cores = guidellm_load.window_rate([(t, d["other"]) for t, d in by_role], t0 + 0.3, time.time() - 0.2)
        assert 0.3 < cores <= 1.05
    finally:
        busy.kill()
        busy.wait()


def test_in_process_prompts_are_guidellm_like_text_of_the_asked_length(tiny_loaded):
    """The in-process passes send what guidellm sends: seeded English-like text of about the asked
    length in the served tokenizer (not random token ids, on which n-gram speculation never fires)."""
    from benchmarks.serving.guidellm_workload import guidellm_prompts

    tok = tiny_loaded.tokenizer
    a = guidellm_prompts(tok, 4, 128, seed=3)
    assert len(a) == 4 and all(abs(len(p) - 128) <= 4 for p in a)  # decode then encode may merge a token or two
    assert a == guidellm_prompts(tok, 4, 128, seed=3) and a != guidellm_prompts(tok, 4, 128, seed=4)
    text = tok.decode(a[0])
    assert len(text.split()) > 40 and text.isascii()
    words = text.lower().split()
    assert len(set(words)) < len(words)  # natural text repeats words: what the n-gram proposer matches on


def test_in_process_engine_runs_the_replicas_own_proposers():
    from benchmarks.serving.guidellm_workload import local_proposers, service_config

    cfg = service_config()
    names = set(local_proposers(cfg))
    assert names == {p.name for p in cfg.engine.proposers} - {"draft_model", "eagle"} and "ngram" in names


def test_steady_state_keeps_the_requests_sent_after_the_warmup_window():
    """guidellm keeps every request that completes after its warm-up window, so a closed loop's first
    wave (all streams at once) stays in its TTFT; the steady state keeps those *sent* after it."""
    from benchmarks.serving.guidellm_report import steady_state, steady_view

    first_wave = [
        {
            "request_start_time": 100.0 + i / 100,
            "time_to_first_token_ms": 1000.0 + 500 * i,
            "inter_token_latency_ms": 150.0,
        }
        for i in range(4)
    ]
    later = [
        {"request_start_time": 111.0 + i, "time_to_first_token_ms": 700.0 + 10 * i, "inter_token_latency_ms": 140.0}
        for i in range(4)
    ]
    bench = {"start_time": 105.0, "requests": {"successful": first_wave + later}}
    s = steady_state(bench)
    assert s["steady_num_requests"] == 4
    assert s["steady_ttft_p50_ms"] == pytest.approx(715.0) and s["steady_ttft_p99_ms"] == pytest.approx(729.7)
    assert s["steady_itl_p50_ms"] == 140.0
    assert steady_state({"start_time": 200.0, "requests": {"successful": later}}) == {"steady_num_requests": 0}
    http = {
        32: {
            "ttft_p50_ms": 2000.0,
            "ttft_p99_ms": 2500.0,
            "itl_p50_ms": 145.0,
            "itl_p99_ms": 150.0,
            "tok_s": 180.0,
            **s,
        }
    }
    v = steady_view(http)[32]
    assert v["ttft_p99_ms"] == s["steady_ttft_p99_ms"] and v["tok_s"] == 180.0
