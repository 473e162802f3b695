"""The node token a pool token's registration returned, kept in the agent's state directory.

An agent started with a pool token (a Slurm pool's agent job, a Kubernetes DaemonSet's pod) is
handed the node's own agent token in its first registration's reply, once. It must keep it: the
portal never lets a pool token register a node that a token holds, so an agent restarted on the
same node (a crash, a requeued job on the same allocation) registers again with the node token
or not at all. The state directory is the node's (it also holds the workers' records that a
restarted agent takes back); the pool token's file may be shared by every agent of the pool, or
read-only (a Kubernetes Secret), so the node token does not go next to it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

NODE_TOKEN_FILE = "node-token"
"""Its name in the agent's state directory."""


class NodeTokenFile:
    """The file at `path`, readable and writable by the agent's user only."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> str | None:
        """The token kept, or None if there is none. Raises OSError if the file is there but
        cannot be read."""
        try:
            return self.path.read_text().strip() or None
        except FileNotFoundError:
            return None

    def write(self, token: str) -> None:
        """Keeps `token`, replacing any earlier one at once (a new file, mode 0600, renamed over
        the old): a crash midway leaves the old token or the new one, never half of one. Raises
        OSError."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}-")
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(token)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        directory = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)
