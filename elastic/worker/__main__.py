"""`python -m elastic.worker`: read the WorkerConfig from the environment, connect to the job's
membership board in Redis, train, exit with the code that says how it ended (elastic.worker).

The last line the worker writes is an "exiting" event with that code (events.announce_exit): an
agent that re-adopted the worker is not its parent and cannot read its exit status, and a signal
that cuts the interpreter's teardown short must not hide that the job completed. A heartbeat
(elastic.worker.heartbeat) says the worker lives from before torch loads until it exits."""

from __future__ import annotations

import atexit
import os
import sys
import time
import traceback
from typing import NoReturn

from elastic.worker import FAILED_EXIT_CODE, STOPPED_EXIT_CODE, WORKER_CONFIG_ENV
from elastic.worker.events import announce_exit


def main() -> int:
    """Run the worker; return its exit code. A failure prints its traceback to stderr."""
    began = time.monotonic()
    from elastic.worker.confine import ConfinementError, confine_from_env

    try:  # before anything of the job's: a fork server's child or a standby was started as root
        confine_from_env()
    except ConfinementError as err:
        print(f"the job's process could not be confined: {err}", file=sys.stderr)
        announce_exit(FAILED_EXIT_CODE)
        return FAILED_EXIT_CODE
    # Installed first, so that a stop asked while torch loads or the job builds ends the start at
    # once (StoppedStarting); WorkerRun settles it before the worker meets its peers. SIGTERM is
    # held before any thread starts and before the handler is in place: only the gate passes it
    # on, and only the agent's (a cluster engine's TERM to the agent's whole job is the agent's).
    from elastic.worker.stop import StoppedStarting, StopRequest, agent_pid, guard_term, hold_term

    hold_term()
    stop = StopRequest()
    stop.install(starting=True)
    try:
        guard_term(agent_pid())
    except ValueError as err:
        print(f"the worker cannot tell its agent: {err}", file=sys.stderr)
        announce_exit(FAILED_EXIT_CODE)
        return FAILED_EXIT_CODE
    heartbeat = None
    events = None
    run = None
    code = FAILED_EXIT_CODE
    try:
        from elastic.membership.redis import RedisBoard
        from elastic.wire import WorkerConfig
        from elastic.worker.events import EventWriter
        from elastic.worker.heartbeat import Heartbeat
        from elastic.worker.settings import WorkerSettings

        raw_config = os.environ.get(WORKER_CONFIG_ENV)
        if raw_config is None:
            raise RuntimeError(f"{WORKER_CONFIG_ENV} is not set")
        config = WorkerConfig.model_validate_json(raw_config)
        settings = WorkerSettings.from_env(os.environ)
        heartbeat = Heartbeat.connect(config.redis_url, config.coordination_key, config.member_key).start()
        from elastic.worker.runner import WorkerRun

        board = RedisBoard.connect(config.redis_url, config.coordination_key)
        try:
            events = EventWriter(config)
            run = WorkerRun(config, settings, events, stop, board, began)
            code = run.run()
        finally:
            board.close()
    except StoppedStarting as stopped:
        # It held no training state, and no peer waits for it yet: nothing to save or tell.
        message = f"{stopped}, after {time.monotonic() - began:.1f} s: it held no training state"
        if events is not None:
            events.log(message)
        else:
            print(message, file=sys.stderr)
        code = STOPPED_EXIT_CODE
    except Exception:
        stop.settle()
        traceback.print_exc()
        code = FAILED_EXIT_CODE
    finally:
        stop.settle()
        if heartbeat is not None:
            heartbeat.stop()
        sys.stderr.flush()
        announce_exit(code, user_error=run.user_error if run is not None else None)
    return code


def leave(code: int) -> NoReturn:
    """Ends the worker with `code` at once, however it ended: the exit handlers registered with
    atexit (the job's own, logging's) run and the standard streams are flushed, but the
    interpreter's teardown of torch's modules, which took 0.7 s on a quiet machine and 2.5 s at
    load 6 (bench/worker_exit.py), is skipped, as multiprocessing does for its children. The device
    is free, and the job's end known, that much sooner; a start cut short may also have left a
    module half imported. Threads still running are not waited for (the worker's own are joined
    before this; a thread of the job's code that never ends no longer holds the device)."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed, or its reader gone
                pass
        os._exit(code)


if __name__ == "__main__":
    leave(main())
