"""The elastic worker: one process per device, started by an agent as `python -m elastic.worker`
with its WorkerConfig as JSON in the environment variable named by WORKER_CONFIG_ENV.

The exit code says how it ended. Importing this package does not import torch, so the agent can
read these constants cheaply; the runtime lives in the submodules.
"""

from __future__ import annotations

WORKER_CONFIG_ENV = "BUNGEE_WORKER_CONFIG"
"""The environment variable that carries the worker's elastic.wire.WorkerConfig as JSON."""

EXPORT_CONFIG_ENV = "BUNGEE_EXPORT_CONFIG"
"""The environment variable that carries `python -m elastic.worker.export`'s elastic.wire.ExportConfig
as JSON."""

COMPLETED_EXIT_CODE = 0
"""Every step of the job is done and rank 0 has saved the final checkpoint."""
FAILED_EXIT_CODE = 1
"""Something went wrong; the traceback is on stderr. Steps since the last checkpoint are lost."""
STOPPED_EXIT_CODE = 75
"""Stopped by SIGTERM or SIGINT: all ranks finished the same step and rank 0 saved it. (A worker
that held no training state yet, a joiner warming up, just goes.)"""
LEFT_EXIT_CODE = 76
"""Left the job at a resize: the newest membership record does not name it. Its state, if it had
any, lives on in the survivors; its device is free."""
USER_ERROR_EXIT_CODE = 77
"""The job's own code failed in a way that fails again on any device (elastic.tasks.UserCodeError:
an import error, an exception in `loss`); its traceback went to the job's log. The job fails;
restarting it would only burn devices."""
USER_ERROR_LOG_PREFIX = "the job's code failed: "
"""How the log line a worker writes for a UserCodeError starts: this, the error (what raised what),
then the traceback of the job's own files on the lines after (its whole traceback follows in a
log line of its own). For the job's log, which people read; the portal takes the failure from the
exit's elastic.wire.UserError."""

WHOLE_TRACEBACK_HEAD = "the whole traceback, the platform's frames with the job's:"
"""How the log line after a USER_ERROR_LOG_PREFIX line starts: this, then the whole traceback."""


class WorkerExit(Exception):  # noqa: N818 - a way out, not an error
    """Ends the worker's life with exit code `code`; its message, if any, is logged first."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


__all__ = [
    "COMPLETED_EXIT_CODE",
    "EXPORT_CONFIG_ENV",
    "FAILED_EXIT_CODE",
    "LEFT_EXIT_CODE",
    "STOPPED_EXIT_CODE",
    "USER_ERROR_EXIT_CODE",
    "USER_ERROR_LOG_PREFIX",
    "WHOLE_TRACEBACK_HEAD",
    "WORKER_CONFIG_ENV",
    "WorkerExit",
]
