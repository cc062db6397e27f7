"""Policies by name: the one place that maps a config to a policy class.

A policy config is a pydantic discriminated union on ``name``, so the app's YAML config can
embed :data:`PolicyConfig` directly and a misspelled key is a ValidationError naming it::

    policy: {name: threshold, t_low: 2, t_high: 4}

:func:`make_policy` accepts that dict or an already validated config object.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from policies.base import Clock, Policy, PolicyConfigBase
from policies.goodput import GoodputConfig, GoodputPolicy
from policies.k_table import KTableConfig, KTablePolicy
from policies.simple import AlwaysConfig, AlwaysPolicy, NeverConfig, NeverPolicy
from policies.threshold import ThresholdConfig, ThresholdPolicy

PolicyConfig = Annotated[
    NeverConfig | AlwaysConfig | ThresholdConfig | KTableConfig | GoodputConfig,
    Field(discriminator="name"),
]

DEFAULT_POLICY = GoodputPolicy.name

_POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (NeverPolicy, AlwaysPolicy, ThresholdPolicy, KTablePolicy, GoodputPolicy)
}
_ADAPTER: TypeAdapter[Any] = TypeAdapter(PolicyConfig)


def known_policies() -> list[str]:
    """Registered policy names, sorted."""
    return sorted(_POLICIES)


def default_policy_config() -> PolicyConfigBase:
    """The config used when none is given: ``goodput`` with its defaults."""
    return GoodputConfig()


def parse_policy_config(config: dict[str, Any] | PolicyConfigBase) -> PolicyConfigBase:
    """Validate a policy config dict (or pass a config object through)."""
    if isinstance(config, PolicyConfigBase):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"policy config must be a dict or a policy config object, got {type(config).__name__}")
    name = config.get("name")
    if name not in _POLICIES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(known_policies())}")
    return _ADAPTER.validate_python(config)


def make_policy(config: dict[str, Any] | PolicyConfigBase | None = None, clock: Clock = time.monotonic) -> Policy:
    """Build the policy a config names (``None``: the default, goodput)."""
    cfg = default_policy_config() if config is None else parse_policy_config(config)
    name = getattr(cfg, "name", None)
    cls = _POLICIES.get(name)  # type: ignore[arg-type]
    if cls is None or not isinstance(cfg, cls.config_cls):
        raise ValueError(f"no policy for config {type(cfg).__name__}; known policies: {', '.join(known_policies())}")
    return cls(cfg, clock=clock)
