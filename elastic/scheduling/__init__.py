"""Scheduling policies: pure functions from a cluster snapshot to a plan. No Django, no I/O.

`api` holds the data types, `registry` the policies by name; `fair_share` stays importable here
because the portal's scheduler cycle calls it directly.
"""

from elastic.scheduling.api import (
    ClusterSnapshot,
    DeviceView,
    JobView,
    Plan,
    Policy,
    Reason,
    StragglerAction,
)
from elastic.scheduling.fair import fair_share
from elastic.scheduling.goodput import GradientNoise
from elastic.scheduling.registry import DEFAULT_POLICY, POLICY_NAMES, UnknownPolicyError, get_policy
from elastic.scheduling.throughput import ThroughputLearner, ThroughputModel

__all__ = [
    "DEFAULT_POLICY",
    "POLICY_NAMES",
    "ClusterSnapshot",
    "DeviceView",
    "GradientNoise",
    "JobView",
    "Plan",
    "Policy",
    "Reason",
    "StragglerAction",
    "ThroughputLearner",
    "ThroughputModel",
    "UnknownPolicyError",
    "fair_share",
    "get_policy",
]
