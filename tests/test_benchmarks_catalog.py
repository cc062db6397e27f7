"""benchmarks/catalog.py: every benchmark listed with its question and canonical result, the results
index current, and save_result (the epilogue every benchmark ends with) writing what it promises."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.catalog import (
    BENCHMARKS,
    GROUPS,
    INDEX,
    RESULTS_DIR,
    index,
    listing,
    unlisted_modules,
    unlisted_results,
)

ROOT = Path(__file__).resolve().parent.parent


def test_index_is_current():
    assert INDEX.read_text() == index(), "benchmarks/results/INDEX.md is stale: run python -m benchmarks --index"


def test_every_module_under_benchmarks_is_listed():
    assert unlisted_modules() == [], "add them to BENCHMARKS or HELPERS in benchmarks/catalog.py"


def test_every_result_file_is_indexed():
    assert unlisted_results() == [], "add them to BENCHMARKS or RECORDS in benchmarks/catalog.py, or remove them"


def test_each_benchmark_exists_has_a_group_a_question_and_its_result():
    for b in BENCHMARKS:
        assert b.group in GROUPS, b
        assert (ROOT / (b.module.replace(".", "/") + ".py")).exists(), b.module
        assert "?" in b.question, b
        assert not b.result or (RESULTS_DIR / b.result).exists(), b.result
    assert len({b.module for b in BENCHMARKS}) == len(BENCHMARKS)
    text = listing()
    assert all(b.module in text for b in BENCHMARKS)


def test_save_result_writes_json_with_the_machine_and_a_png_titled_with_the_cpu(tmp_path, capsys):
    from benchmarks.common import figure, save_result

    fig, (ax,) = figure()
    ax.plot([1, 2], [3, 4])
    path = save_result(tmp_path / "x", {"rows": [1.5, float("nan")]}, fig, title="T")
    got = json.loads(path.read_text())
    assert path == tmp_path / "x.json" and (tmp_path / "x.png").exists()
    assert got["rows"] == [1.5, None]
    assert got["env"]["cpu"] and "loadavg_start" in got["env"] and "loadavg_end" in got["env"]
    assert fig._suptitle.get_text() == f"T, {got['env']['cpu']}"
    assert "x.json" in capsys.readouterr().err
