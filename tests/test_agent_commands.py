"""The node's command stream on the real Redis of this machine (db 15): where reading starts,
the reader, the dispatcher, and `python -m agent.simulate`."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import pytest
import redis

from agent.code import CodeCache
from agent.commands import (
    COMMAND_FIELD,
    CommandDispatcher,
    CommandReader,
    StreamMark,
    entry_id_at,
    last_entry_id,
)
from agent.devices.api import DeviceError
from agent.devices.simulated import SimulatedBackend
from agent.environments import Environment, EnvironmentSettings
from agent.environments import Environments as Environments_
from agent.simulate import SimulateSettings
from agent.simulate import main as simulate_main
from agent.supervisor import SupervisorConfig, WorkerSupervisor
from elastic.wire import (
    LaunchCommand,
    SimulateOwnerCommand,
    SimulateSlowdownCommand,
    StopCommand,
    WorkerAssignment,
    WorkerEvent,
    command_stream,
    parse_command,
)

REDIS_URL = "redis://127.0.0.1:6379/15"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    yield client
    client.close()


@pytest.fixture
def stream(client: redis.Redis) -> Iterator[str]:
    """A fresh node's command stream, under the prefix `agent.simulate` writes with here (the
    environment's BUNGEE_REDIS_PREFIX, as the portal's)."""
    name = command_stream(f"agent-test-{uuid.uuid4().hex[:8]}", SimulateSettings.from_environ().prefix)
    yield name
    client.delete(name)


def add(client: redis.Redis, stream: str, command: object) -> str:
    text = command if isinstance(command, str) else command.model_dump_json()  # type: ignore[attr-defined]
    return str(client.xadd(stream, {COMMAND_FIELD: text}))


def entries(client: redis.Redis, stream: str, after: str | None = None) -> list[tuple[str, dict[str, str]]]:
    """The stream's entries, all or those after the id `after`."""
    return cast(list[tuple[str, dict[str, str]]], client.xrange(stream, min=f"({after}" if after else "-"))


def test_stream_name() -> None:
    assert command_stream("gpu-07") == "bungee:node:gpu-07:commands"


def test_last_entry_id_of_a_missing_stream_and_of_one_with_entries(client: redis.Redis, stream: str) -> None:
    assert last_entry_id(client, stream) == "0-0"
    add(client, stream, "a")
    second = add(client, stream, "b")
    assert last_entry_id(client, stream) == second


def test_entry_id_at_a_time_reads_what_came_after_it(client: redis.Redis, stream: str) -> None:
    add(client, stream, "before")
    time.sleep(0.3)
    moment = time.time()
    after = add(client, stream, "after")
    start = entry_id_at(client, moment)
    assert [entry_id for entry_id, _ in entries(client, stream, after=start)] == [after]


def test_a_mark_with_the_stream_known_uses_its_last_id(client: redis.Redis, stream: str) -> None:
    old = add(client, stream, "old")
    mark = StreamMark.take(REDIS_URL, stream)
    assert mark.last_id == old
    assert mark.start_id(client, REDIS_URL, stream) == old


def test_a_mark_for_another_stream_falls_back_to_the_clock(client: redis.Redis, stream: str) -> None:
    mark = StreamMark.take(REDIS_URL, "bungee:node:someone-else:commands")
    new = add(client, stream, "new")
    start = mark.start_id(client, REDIS_URL, stream)
    assert [entry_id for entry_id, _ in entries(client, stream, after=start)] == [new]


def test_a_mark_without_redis_is_taken_from_the_clock(client: redis.Redis, stream: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert StreamMark.take(f"redis://127.0.0.1:{port}/0", stream).last_id is None
    assert StreamMark.take(None, None).last_id is None


def test_the_reader_passes_commands_in_order_and_skips_what_is_not_one(
    client: redis.Redis, stream: str, caplog: pytest.LogCaptureFixture
) -> None:
    skipped = add(client, stream, SimulateOwnerCommand(device_index=9, present=True))
    received: list[object] = []
    arrived = threading.Event()

    def handle(command: object) -> None:
        received.append(command)
        if len(received) == 2:
            arrived.set()

    reader = CommandReader(REDIS_URL, stream, skipped, handle, block_s=0.2)
    caplog.set_level(logging.WARNING, logger="agent.commands")
    reader.start()
    first = SimulateOwnerCommand(device_index=1, present=True)
    second = StopCommand(job_id=4, before_generation=2)
    add(client, stream, first)
    add(client, stream, '{"kind": "launch"}')
    client.xadd(stream, {"other": "x"})
    last = add(client, stream, second)
    assert arrived.wait(10)
    # Its blocking read ends within block_s, so the thread ends and stop's join returns: a read
    # that blocked for good would leave it running. (The join's bound is generous: a busy machine
    # may be slow to run the thread, and what matters is that it ends.)
    reader.stop(timeout_s=30)
    assert not reader._thread.is_alive(), "the reader's blocking read did not end when it was stopped"
    assert received == [first, second] and reader.last_id == last
    assert "not a command" in caplog.text and "no 'command' field" in caplog.text


def test_the_dispatcher_hands_each_command_to_its_handler(tmp_path: Path) -> None:
    backend = SimulatedBackend(slots=2)
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module="tests.agent_fake_worker", stop_grace_s=5))
    dispatcher = CommandDispatcher(supervisor, backend)
    try:
        dispatcher.dispatch(SimulateOwnerCommand(device_index=1, present=True))
        assert [s.owner_present for s in backend.sample({})] == [False, True]
        dispatcher.dispatch(SimulateOwnerCommand(device_index=7, present=True))  # logged, not raised
        dispatcher.dispatch(
            LaunchCommand(
                job_id=2,
                generation=1,
                world_size=1,
                master_addr="127.0.0.1",
                master_port=29500,
                workers=[WorkerAssignment(rank=0, device_index=0)],
                spec={},
                run_dir=str(tmp_path),
                coordination_key="bungee-agent-test:job:2",
                redis_url=REDIS_URL,
            )
        )
        events: list[WorkerEvent] = []
        deadline = time.monotonic() + 10
        while not any(e.kind == "progress" for e in events):  # SIGTERM is handled by now
            assert time.monotonic() < deadline
            events += supervisor.drain_events()
            time.sleep(0.02)
        dispatcher.dispatch(StopCommand(job_id=2, before_generation=2))
        while not any(e.kind == "exited" for e in events):
            assert time.monotonic() < deadline
            events += supervisor.drain_events()
            time.sleep(0.02)
        assert [(e.exit_code, e.reason) for e in events if e.kind == "exited"] == [(75, "stopped")]
    finally:
        supervisor.shutdown(grace_s=1)


def test_simulate_owner_puts_the_command_on_the_nodes_stream(client: redis.Redis, stream: str) -> None:
    node = stream.split(":")[2]
    argv = ["owner", "--redis-url", REDIS_URL, "--node", node, "--device", "1"]
    assert simulate_main([*argv, "--present"]) == 0
    assert simulate_main([*argv, "--absent"]) == 0
    commands = [parse_command(fields[COMMAND_FIELD]) for _, fields in entries(client, stream)]
    assert commands == [
        SimulateOwnerCommand(device_index=1, present=True),
        SimulateOwnerCommand(device_index=1, present=False),
    ]


def test_simulate_takes_its_redis_and_prefix_from_the_environment(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """agent.simulate.SimulateSettings: --redis-url and --prefix default to BUNGEE_AGENT_REDIS_URL and
    BUNGEE_REDIS_PREFIX."""
    node, prefix = f"agent-test-{uuid.uuid4().hex[:8]}", f"simulate-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("BUNGEE_AGENT_REDIS_URL", REDIS_URL)
    monkeypatch.setenv("BUNGEE_REDIS_PREFIX", prefix)
    try:
        assert simulate_main(["slow", "--node", node, "--device", "2", "--factor", "3"]) == 0
        [(_, fields)] = entries(client, command_stream(node, prefix))
        assert parse_command(fields[COMMAND_FIELD]) == SimulateSlowdownCommand(device_index=2, factor=3.0)
    finally:
        client.delete(command_stream(node, prefix))


def test_simulate_owner_as_a_process(client: redis.Redis, stream: str) -> None:
    node = stream.split(":")[2]
    result = subprocess.run(
        [sys.executable, "-m", "agent.simulate", "owner", "--redis-url", REDIS_URL, "--node", node]
        + ["--device", "0", "--present"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    assert f"{stream} " in result.stdout and "owner of device 0 present" in result.stdout
    [(_, fields)] = entries(client, stream)
    assert parse_command(fields[COMMAND_FIELD]) == SimulateOwnerCommand(device_index=0, present=True)


def test_simulate_owner_needs_present_or_absent() -> None:
    with pytest.raises(SystemExit) as caught:
        simulate_main(["owner", "--node", "n", "--device", "0"])
    assert caught.value.code == 2


def test_a_played_owner_makes_the_agent_report_at_once() -> None:
    backend = SimulatedBackend(slots=2)
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module="tests.agent_fake_worker", stop_grace_s=5))
    report_now = threading.Event()
    dispatcher = CommandDispatcher(supervisor, backend, report_now=report_now.set)
    dispatcher.dispatch(SimulateOwnerCommand(device_index=0, present=True))
    assert report_now.is_set() and [s.owner_present for s in backend.sample({})] == [True, False]
    report_now.clear()
    dispatcher.dispatch(SimulateOwnerCommand(device_index=5, present=True))  # no such device
    assert not report_now.is_set()


def test_a_slow_device_is_played_for_the_workers_started_on_it(client: redis.Redis, stream: str) -> None:
    node = stream.split(":")[2]
    assert (
        simulate_main(["slow", "--redis-url", REDIS_URL, "--node", node, "--device", "1", "--factor", "3"])
        == 0
    )
    [command] = [parse_command(fields[COMMAND_FIELD]) for _, fields in entries(client, stream)]
    assert command == SimulateSlowdownCommand(device_index=1, factor=3.0)
    backend = SimulatedBackend(slots=2)
    supervisor = WorkerSupervisor(SupervisorConfig(worker_module="tests.agent_fake_worker", stop_grace_s=5))
    CommandDispatcher(supervisor, backend).dispatch(command)
    assert backend.placement(1).env == {"BUNGEE_SIM_SLOWDOWN": "3.0"} and backend.placement(0).env == {}
    with pytest.raises(DeviceError, match="at least 1, got 0.5"):
        backend.set_slowdown(0, 0.5)


def test_a_slowdown_factor_below_one_is_refused_by_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        simulate_main(["slow", "--node", "n", "--device", "0", "--factor", "0.5"])
    assert "--factor must be between 1 and 100, got 0.5" in capsys.readouterr().err


def test_a_job_in_its_own_environment_keeps_it_when_a_launch_starts_no_worker_here(tmp_path: Path) -> None:
    """The launch that starts a worker runs it from the job's environment (built in a thread of
    its own); a later launch of the job that starts none here (its survivors go on) keeps that
    interpreter, so that no standby is prepared for the job in the node's environment."""
    code_dir = tmp_path / "code"
    code_dir.mkdir()
    (code_dir / "requirements.txt").write_text("einops\n")
    launched: list[tuple[int, str | None]] = []
    done = threading.Event()

    class Code:
        def prepare(self, job_id: int, digest: str) -> Path:
            return code_dir

    class Environments:
        settings = EnvironmentSettings(root=tmp_path, python=sys.executable)

        def ensure(self, declared: object, progress: object = None) -> Environment:
            return Environment("d" * 64, tmp_path / "env", None)

        def hold(self, digest: str) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

    class Supervisor:
        def launch(self, command: LaunchCommand, *args: object) -> bool:
            launched.append((command.generation, cast(str | None, args[-1]) if len(args) == 5 else None))
            done.set()
            return True

        def job_log(self, command: LaunchCommand, line: str) -> None:
            pass

        def stop(self, command: StopCommand) -> int:
            return 0

    dispatcher = CommandDispatcher(cast(WorkerSupervisor, Supervisor()), SimulatedBackend(slots=1),
                                   code=cast(CodeCache, Code()), environments=cast(Environments_, Environments()))
    command = LaunchCommand(job_id=3, generation=1, world_size=1, master_addr="127.0.0.1", master_port=29500,
                            workers=[WorkerAssignment(rank=0, device_index=0)], spec={"code": "c" * 64},
                            run_dir=str(tmp_path), coordination_key="bungee-agent-test:job:3",
                            redis_url=REDIS_URL)
    dispatcher.dispatch(command)
    assert done.wait(10)
    dispatcher.dispatch(command.model_copy(update={"generation": 2, "workers": []}))
    python = str(tmp_path / "env" / "bin" / "python")
    assert launched == [(1, python), (2, python)]
