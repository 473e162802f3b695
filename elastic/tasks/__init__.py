"""Tasks: the user's training code, run by Bungee's own loop.

A task is a Python class in a module of a directory (the job's code). Bungee imports it inside a
worker (`loader`), binds it to a job's hyperparameters, seed and device (`runtime`), and keeps the
loop itself: which sample each virtual worker trains on, the random streams, the reduction order
and the step boundary where a resize happens. The class needs nothing from Bungee; the methods it
defines are listed in `api.TASK_METHODS`. The shipped workloads are tasks of this same interface
(`examples/`)."""

from __future__ import annotations

from elastic.tasks.api import TASK_METHODS, TaskDefinitionError, UserCodeError

__all__ = ["TASK_METHODS", "TaskDefinitionError", "UserCodeError"]
