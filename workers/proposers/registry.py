"""Proposers by name: the one place that maps a config string to a class.

The engine and the app builder call :func:`make_proposer` with the method name
from the (pydantic-validated) config, so nothing else branches on method-name
strings. Adding a method is one entry in ``_PROPOSERS`` (or one
:func:`register_proposer` call from the module that defines it, e.g. a draft
model proposer that needs heavier imports).
"""

from __future__ import annotations

from typing import Any, Callable

from workers.proposers.base import Proposer
from workers.proposers.draft_model import DraftModelProposer
from workers.proposers.eagle import EagleProposer
from workers.proposers.ngram import NgramProposer
from workers.proposers.suffix import SuffixProposer

ProposerFactory = Callable[..., Proposer]

# name -> factory(**options) -> Proposer. Each factory validates its own options
# and raises ValueError naming the offending field.
_PROPOSERS: dict[str, ProposerFactory] = {
    NgramProposer.name: NgramProposer,
    SuffixProposer.name: SuffixProposer,
    DraftModelProposer.name: DraftModelProposer,
    EagleProposer.name: EagleProposer,
}


def register_proposer(name: str, factory: ProposerFactory, *, replace: bool = False) -> None:
    """Make ``make_proposer(name, **options)`` call ``factory(**options)``.

    Registering an existing name is an error unless ``replace`` is set, so two
    modules cannot silently fight over one name.
    """
    if not name:
        raise ValueError("proposer name must be non-empty")
    if name in _PROPOSERS and not replace:
        raise ValueError(f"proposer {name!r} is already registered")
    _PROPOSERS[name] = factory


def known_proposers() -> list[str]:
    """Registered proposer names, sorted."""
    return sorted(_PROPOSERS)


def make_proposer(name: str, **options: Any) -> Proposer:
    """Build the proposer registered as ``name`` with its config ``options``."""
    factory = _PROPOSERS.get(name)
    if factory is None:
        raise ValueError(f"unknown proposer {name!r}; known proposers: {', '.join(known_proposers())}")
    return factory(**options)
