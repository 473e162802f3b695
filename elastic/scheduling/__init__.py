"""Scheduling policies: pure functions from a cluster snapshot to a plan. No Django, no I/O."""

from elastic.scheduling.api import ClusterSnapshot, DeviceView, JobView, Plan
from elastic.scheduling.fair import fair_share

__all__ = ["ClusterSnapshot", "DeviceView", "JobView", "Plan", "fair_share"]
