"""pyproject.toml stays in step with requirements.txt and ships the native kernels' sources."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(path: Path) -> list[str]:
    lines = (ln.split("#", 1)[0].strip() for ln in path.read_text().splitlines())
    return [ln for ln in lines if ln]


def test_dependencies_are_requirements_txt():
    """`pip install -r requirements.txt` and `pip install .` install the same pins (torch's CPU pin included)."""
    assert sorted(PYPROJECT["project"]["dependencies"]) == sorted(_requirements(ROOT / "requirements.txt"))
    assert "torch==2.13.0" in PYPROJECT["project"]["dependencies"]


def test_kernel_sources_are_package_data():
    """A wheel carries every file the native kernels compile from (workers/native_attention.py)."""
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["workers.kernels"]
    files = [p.name for p in (ROOT / "workers" / "kernels").iterdir() if p.is_file()]
    assert files
    assert [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)] == []
