"""pytest.ini's filterwarnings: a warning from the project's own code is an error, a library's is not."""

from __future__ import annotations

import warnings

import pytest


def _warn_from(module: str, category: type[Warning] = UserWarning) -> None:
    """A warning as if raised at line 1 of ``module`` (what the filters' module field is matched against)."""
    warnings.warn_explicit("a warning", category, f"{module.replace('.', '/')}.py", 1, module=module)


@pytest.mark.parametrize("category", [UserWarning, DeprecationWarning, RuntimeWarning])
@pytest.mark.parametrize("module", ["workers.engine", "policies", "deployments.remote_draft", "cluster.config"])
def test_a_warning_from_the_project_is_an_error(module, category):
    with pytest.raises(category):
        _warn_from(module, category)


@pytest.mark.parametrize("module", ["torch.nn.modules.module", "ray.serve._private.config", "workers_elsewhere"])
def test_a_warning_from_a_library_stays_a_warning(module):
    with warnings.catch_warnings(record=True) as seen:  # the filters as they are, only recorded
        _warn_from(module)
    assert [str(w.message) for w in seen] == ["a warning"]


def test_a_coroutine_never_awaited_is_an_error_wherever_it_is_reported():
    # The interpreter reports it from the coroutine's finalizer, in whatever module runs then.
    with pytest.raises(RuntimeWarning, match="was never awaited"):
        _warn_from_message("coroutine 'RemoteDraftProposer._call_propose.<locals>.call' was never awaited")


def _warn_from_message(message: str) -> None:
    warnings.warn_explicit(message, RuntimeWarning, "asyncio/base_events.py", 1, module="asyncio.base_events")
