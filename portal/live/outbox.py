"""What one socket has yet to be sent, kept while the socket is writing (its browser reads slower
than the portal sends). A job's state replaces an older state of the same job still waiting,
where that older one stood: the page keeps only the newest `job` it gets, so the older one would
be written only to be overwritten. Nothing else is replaced or dropped. What waits goes out in
arrival order, the waiting job states together as one `jobs` message at the place of the first
(one state alone as a `job` message). Past `limit` other messages waiting the socket is too far
behind to be worth catching up message by message: `put` says so, and the socket is closed (its
page reconnects and starts from a snapshot). Plain data; no Django."""

from __future__ import annotations

import itertools


class OutboxFullError(Exception):
    """More than the outbox's limit of messages wait beyond the newest state of each job."""


class Outbox:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        # Insertion-ordered: ("job", id) -> the job's newest summary as JSON, or ("text", n) -> a
        # message as it is written.
        self._waiting: dict[tuple[str, int], str] = {}
        self._others = 0
        self._numbers = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def put_jobs(self, jobs: list[tuple[int, str]]) -> None:
        """(job id, its summary as JSON (Job.summary)): each replaces a waiting state of that job.
        The JSON is the layer's, encoded once for every socket: it is joined here, not parsed."""
        for job_id, summary in jobs:
            self._waiting[("job", job_id)] = summary

    def put(self, text: str) -> None:
        """A message as it is written. Raises OutboxFullError past the limit (the message is not kept)."""
        if self._others >= self.limit:
            raise OutboxFullError(f"{self._others} messages wait to be written to this socket, its limit is {self.limit}")
        self._waiting[("text", next(self._numbers))] = text
        self._others += 1

    def take(self) -> list[str]:
        """Everything waiting, as the texts to write in order; the outbox is empty after."""
        texts: list[str] = []
        jobs: list[str] = []
        jobs_at = -1
        for (kind, _), value in self._waiting.items():
            if kind == "job":
                if jobs_at < 0:
                    jobs_at = len(texts)
                    texts.append("")
                jobs.append(value)
            else:
                texts.append(value)
        if jobs:
            texts[jobs_at] = jobs_message(jobs)
        self._waiting.clear()
        self._others = 0
        return texts


def jobs_message(summaries: list[str]) -> str:
    """The message for job summaries given as JSON: `job` for one, `jobs` (a list) for more."""
    if len(summaries) == 1:
        return '{"type":"job","job":' + summaries[0] + "}"
    return '{"type":"jobs","jobs":[' + ",".join(summaries) + "]}"
