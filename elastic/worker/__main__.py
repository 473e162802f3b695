"""`python -m elastic.worker`: read the WorkerConfig from the environment, connect to the job's
membership board in Redis, train, exit with the code that says how it ended (elastic.worker)."""

from __future__ import annotations

import os
import sys
import traceback

from elastic.worker import FAILED_EXIT_CODE, LEFT_EXIT_CODE, WORKER_CONFIG_ENV


def main() -> int:
    """Run the worker; return its exit code. A failure prints its traceback to stderr."""
    # Installed first, so a stop asked while torch loads is honoured at the first step.
    from elastic.worker.stop import StopRequest

    stop = StopRequest()
    stop.install()
    try:
        from elastic.membership.redis import RedisBoard
        from elastic.wire import WorkerConfig
        from elastic.worker.events import EventWriter
        from elastic.worker.runner import WorkerRun
        from elastic.worker.settings import WorkerSettings

        raw_config = os.environ.get(WORKER_CONFIG_ENV)
        if raw_config is None:
            raise RuntimeError(f"{WORKER_CONFIG_ENV} is not set")
        config = WorkerConfig.model_validate_json(raw_config)
        settings = WorkerSettings.from_env(os.environ)
        board = RedisBoard.connect(config.redis_url, config.coordination_key)
        try:
            code = WorkerRun(config, settings, EventWriter(config), stop, board).run()
        finally:
            board.close()
    except Exception:
        traceback.print_exc()
        return FAILED_EXIT_CODE
    finally:
        sys.stdout.flush()
    if code == LEFT_EXIT_CODE:
        # A leaver holds nothing to save and its device is wanted at once (an owner may be
        # waiting for it): skip the interpreter's teardown of torch and gloo, which takes a
        # good part of a second on a busy machine.
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
