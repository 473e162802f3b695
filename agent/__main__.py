"""`python -m agent`: see agent.main.

The agent ends without the interpreter's teardown once main() has returned: by then its workers
are stopped or gone, its last report is sent and its logs are written, and the teardown of what
it imported (hundreds of modules) took 0.4-1.1 s on a loaded 2-core VM, which a drained agent's
Slurm allocation (and the owner's job waiting for it) would spend for nothing."""

import logging
import os
import sys

from agent.main import main

code = main()
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
