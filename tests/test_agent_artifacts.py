"""The agent's upload of a job's artifacts (agent.artifacts) against a stand-in for the portal:
an upload the agent could not finish (it stopped, or the portal stayed away) is written down and
done by the next agent of the node; one the portal took, or refused for good, is crossed off."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from agent.artifacts import ArtifactUploader
from agent.client import PortalRejectedError, PortalUnavailableError
from elastic.artifacts import ARTIFACT_NAMES
from elastic.wire import WorkerEvent


class Portal:
    """Takes uploads, or fails them as told; records the attempts."""

    def __init__(self, fail_with: Exception | None = None) -> None:
        self.fail_with = fail_with
        self.attempts: list[int] = []
        self.taken: dict[int, dict[str, bytes]] = {}
        self.tried = threading.Event()

    def upload_artifacts(self, job_id: int, files: dict[str, Path]) -> None:
        self.attempts.append(job_id)
        self.tried.set()
        if self.fail_with is not None:
            raise self.fail_with
        self.taken[job_id] = {name: path.read_bytes() for name, path in files.items()}


def artifacts_event(tmp_path: Path, job_id: int) -> WorkerEvent:
    directory = tmp_path / f"job-{job_id}-20261128T000000" / "artifacts"
    directory.mkdir(parents=True)
    for name in ARTIFACT_NAMES:
        (directory / name).write_bytes(f"{name} of job {job_id}".encode())
    return WorkerEvent(job_id=job_id, generation=1, rank=0, kind="artifacts", at=time.time(), step=40,
                       message=str(directory))


def wait_until(condition: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_an_upload_cut_short_is_done_by_the_next_agent(tmp_path: Path) -> None:
    state = tmp_path / "agent-state"
    away = Portal(fail_with=PortalUnavailableError("portal at http://127.0.0.1:1 unreachable"))
    stopping = threading.Event()
    first = ArtifactUploader(away, stopping, state)
    first.submit(artifacts_event(tmp_path, 7))
    assert away.tried.wait(10)
    stopping.set()  # the agent stops while the portal is away
    assert list((state / "pending-artifacts").iterdir()) == [state / "pending-artifacts" / "job-7.json"]

    back = Portal()
    second = ArtifactUploader(back, threading.Event(), state)
    wait_until(lambda: second.uploaded == [7])
    assert back.taken[7]["model.pt"] == b"model.pt of job 7"
    assert not list((state / "pending-artifacts").iterdir()), "crossed off once taken"


def test_a_refusal_is_final(tmp_path: Path) -> None:
    state = tmp_path / "agent-state"
    refusing = Portal(fail_with=PortalRejectedError("job 8 never ran on node-a", 403, "forbidden"))
    uploader = ArtifactUploader(refusing, threading.Event(), state)
    uploader.submit(artifacts_event(tmp_path, 8))
    wait_until(lambda: not list((state / "pending-artifacts").iterdir()))
    assert refusing.attempts == [8] and uploader.uploaded == []
    again = Portal()
    ArtifactUploader(again, threading.Event(), state)
    time.sleep(0.3)
    assert again.attempts == [], "a refused upload is not tried again by the next agent"
