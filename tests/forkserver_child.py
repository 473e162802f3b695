"""A process for tests/test_forkserver.py to fork: prints what it was given as one JSON line, reads
one line from stdin, then ends with the exit code that line names (or raises, if it says so)."""

from __future__ import annotations

import json
import os
import sys

import numpy

if __name__ == "__main__":
    print(
        json.dumps(
            {
                "argv": sys.argv[1:],
                "name": __name__,
                "pid": os.getpid(),
                "own_session": os.getsid(0) == os.getpid(),
                "cores": sorted(os.sched_getaffinity(0)),
                "env": {k: os.environ.get(k) for k in ("FOO", "KMP_DUPLICATE_LIB_OK", "BAR")},
                "random": int(numpy.random.randint(1 << 30)),
                "torch_loaded": "torch" in sys.modules,
                "cmdline": open("/proc/self/cmdline", "rb").read().replace(b"\0", b" ").decode().strip(),
            }
        ),
        flush=True,
    )
    line = sys.stdin.readline().strip()
    if line == "raise":
        raise RuntimeError("the child's own error")
    sys.exit(int(line or 0))
