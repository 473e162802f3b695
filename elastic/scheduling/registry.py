"""Policies by name, for the portal's setting and the simulator's command line.

| name | what it is |
|---|---|
| `bungee` (default) | the goodput dynamic program with fairness, resize penalty and straggler handling |
| `saxena` | the same dynamic program maximising useful work alone |
| `fair` | the backbone's min-then-round-robin fair share |
| `fifo` | static FIFO gang |
| `tiresias` | Tiresias-like two-queue least attained service |
| `optimus` | Optimus-like greedy marginal gain at fixed batch size |

`resize_cost_s` tells the policies that weigh it (`bungee`) what a resize costs the job; the
portal passes its measured resize pause, the simulator its `--resize-cost`.
"""

from __future__ import annotations

from dataclasses import replace

from elastic.scheduling.api import Policy
from elastic.scheduling.baselines import fifo, optimus, tiresias
from elastic.scheduling.fair import fair_share
from elastic.scheduling.goodput_policy import BUNGEE, SAXENA, GoodputPolicy

DEFAULT_POLICY = "bungee"
POLICY_NAMES = ("bungee", "saxena", "fair", "fifo", "tiresias", "optimus")


class UnknownPolicyError(ValueError):
    """No policy has that name."""


def get_policy(name: str, *, resize_cost_s: float | None = None) -> Policy:
    """The policy called `name`. Raises UnknownPolicyError (quoting the name and the known ones)."""
    if name == "bungee":
        config = BUNGEE if resize_cost_s is None else replace(BUNGEE, resize_cost_s=resize_cost_s)
        return GoodputPolicy(config)
    if name == "saxena":
        return GoodputPolicy(SAXENA)
    simple: dict[str, Policy] = {"fair": fair_share, "fifo": fifo, "tiresias": tiresias, "optimus": optimus}
    if name in simple:
        return simple[name]
    raise UnknownPolicyError(f"unknown scheduling policy {name!r}; known: {', '.join(POLICY_NAMES)}")
