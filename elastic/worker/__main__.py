"""`python -m elastic.worker`: read the WorkerConfig from the environment, connect to the job's
membership board in Redis, train, exit with the code that says how it ended (elastic.worker).

The last line the worker writes is an "exiting" event with that code (events.announce_exit): an
agent that re-adopted the worker is not its parent and cannot read its exit status, and a signal
that cuts the interpreter's teardown short must not hide that the job completed. A heartbeat
(elastic.worker.heartbeat) says the worker lives from before torch loads until it exits."""

from __future__ import annotations

import os
import sys
import time
import traceback

from elastic.worker import FAILED_EXIT_CODE, LEFT_EXIT_CODE, WORKER_CONFIG_ENV
from elastic.worker.events import announce_exit


def main() -> int:
    """Run the worker; return its exit code. A failure prints its traceback to stderr."""
    began = time.monotonic()
    # Installed first, so a stop asked while torch loads is honoured at the first step.
    from elastic.worker.stop import StopRequest

    stop = StopRequest()
    stop.install()
    heartbeat = None
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
            code = WorkerRun(config, settings, EventWriter(config), stop, board, began).run()
        finally:
            board.close()
    except Exception:
        traceback.print_exc()
        code = FAILED_EXIT_CODE
    finally:
        if heartbeat is not None:
            heartbeat.stop()
        sys.stderr.flush()
        announce_exit(code)
    if code == LEFT_EXIT_CODE:
        # A leaver holds nothing to save and its device is wanted at once (an owner may be
        # waiting for it): skip the interpreter's teardown of torch and gloo, which takes a
        # good part of a second on a busy machine.
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
