"""Routing policies: given a load snapshot, K per decoding request (0 = plain). No Ray here."""

from policies.base import Policy, PolicyConfigBase
from policies.registry import (
    DEFAULT_POLICY,
    PolicyConfig,
    default_policy_config,
    known_policies,
    make_policy,
    parse_policy_config,
)
from workers.cost_model import StepCostModel

__all__ = [
    "DEFAULT_POLICY",
    "Policy",
    "PolicyConfig",
    "PolicyConfigBase",
    "StepCostModel",
    "default_policy_config",
    "known_policies",
    "make_policy",
    "parse_policy_config",
]
