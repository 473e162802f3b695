"""What a standby tells its agent, as the agent reads it from the standby's output
(elastic.worker.standby.said): the protocol's lines as their models, in order; a library's or
the job's code's lines, and a line that only looks like one of the protocol's, are not."""

from __future__ import annotations

from elastic.worker.standby import PreparationFailed, Prepared, Ready, said


def test_the_protocols_lines_are_read_as_their_models() -> None:
    output = b"\n".join([
        Ready(pid=41).model_dump_json().encode(),
        b"Downloading the digits... done",
        b'{"standby": "standby prepared", "job": "seven"}',  # the job's own print, not the protocol
        b'{"standby": "standby ready"',  # cut short
        Prepared(job=7, seconds=1.5, parts={"model": 1.0, "code": 0.5}).model_dump_json().encode(),
        PreparationFailed(job=8, error="ValueError: no data").model_dump_json().encode(),
    ])
    told = said(output)
    assert told == [
        Ready(pid=41),
        Prepared(job=7, seconds=1.5, parts={"model": 1.0, "code": 0.5}),
        PreparationFailed(job=8, error="ValueError: no data"),
    ]
    assert said(b"") == [] and said(b"standby ready\n") == []
