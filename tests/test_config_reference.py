"""docs/configuration.md is generated from the pydantic models (cluster/config_reference.py).

It fails when the committed page no longer matches the models or ray_config.yaml, and says the
command that regenerates it; and when a model reachable from the config roots, or a proposer's
options, would be missing from the page.
"""

from __future__ import annotations

import difflib
import typing

import pytest
from pydantic import BaseModel

from cluster import config_reference as ref
from cluster.config import DRAFT_WORKER_PROPOSERS, AppConfig, RouterUserConfig
from workers.config import ProposerConfig


def test_committed_page_is_current():
    committed = ref.PAGE.read_text() if ref.PAGE.exists() else ""
    fresh = ref.render()
    if committed != fresh:
        diff = difflib.unified_diff(committed.splitlines(), fresh.splitlines(), "committed", "generated", lineterm="")
        pytest.fail(
            f"docs/configuration.md is stale: run `{ref.COMMAND}` and commit the page.\n" + "\n".join(list(diff)[:40]),
            pytrace=False,
        )


def _reachable(model: type[BaseModel], seen: set[type[BaseModel]]) -> set[type[BaseModel]]:
    """Every model a config root nests, through X | None, list[X], dict values and unions."""
    if model in seen:
        return seen
    seen.add(model)

    def visit(ann: typing.Any) -> None:
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _reachable(ann, seen)
        for arg in typing.get_args(ann):
            visit(arg)

    for info in model.model_fields.values():
        visit(info.annotation)
    return seen


def test_every_nested_model_has_a_section():
    page = ref.render()
    models = _reachable(AppConfig, set()) | _reachable(RouterUserConfig, set())
    missing = [m.__qualname__ for m in models if f"Model: `{m.__module__}.{m.__qualname__}`." not in page]
    assert not missing, f"cluster/config_reference.py leaves out {missing}"


def test_every_proposer_with_options_is_documented():
    names = typing.get_args(ProposerConfig.model_fields["name"].annotation)
    undocumented = [n for n in names if n not in ref.PROPOSER_OPTIONS and n not in DRAFT_WORKER_PROPOSERS]
    assert not undocumented, (
        f"proposers {undocumented} take options the page does not describe: add their config "
        "model to PROPOSER_OPTIONS in cluster/config_reference.py"
    )


def test_every_key_has_a_row_with_its_default():
    page = ref.render()
    for m in (AppConfig, RouterUserConfig, *ref.PROPOSER_OPTIONS.values()):
        for name in m.model_fields:
            assert f"| `{name}` |" in page, (m.__name__, name)
    # a default the parent overrides shows as it applies (draft.resources: 0.5 CPUs, Resources' own is 1.0)
    draft_resources = page.split('<a id="draft-resources"></a>')[1].split("<a id=")[0]
    assert "| `num_cpus` | float | `0.5` |" in draft_resources


def test_check_flag_reports_a_stale_page(tmp_path, capsys):
    out = tmp_path / "configuration.md"
    out.write_text("old\n")
    assert ref.main(["--check", "--out", str(out)]) == 1
    assert ref.COMMAND in capsys.readouterr().err
    assert ref.main(["--out", str(out)]) == 0
    assert ref.main(["--check", "--out", str(out)]) == 0


def test_type_rendering_of_unions_and_literals():
    assert ref._type(int | None, {}) == "int or null"
    assert ref._type(typing.Literal["a", "b"], {}) == '`"a"` / `"b"`'
    assert ref._type(list[int], {}) == "list of int"
