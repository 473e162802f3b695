"""Time to the refusal: how long a real portal takes to refuse an anonymous `POST /api/jobs` (or
`--path`, e.g. an upload route, answered 401) that declares a 2 GiB body (`Content-Length:
2147483648`; or, `--chunked`, no length), from the client's headers sent to the first byte of
the answer. The client is tests/body_limit_support.py's: after the headers it sends the
body 16 KiB at a time, at most 1 MiB spread over the bound, for as long as no answer has come.

Arms: the portal's server (portal.launcher.portal_command: uvicorn through portal.serve), and,
as the baseline, daphne (`python -m daphne`, the server `make demo` and the tests ran before),
which reads a whole body before the application sees the request: a try with no answer within
the bound is counted as a timeout at the bound. Each arm is one portal (tests.platform's
running_portal: PostgreSQL, Redis, no Celery, no agents) on this machine, tried `--runs` times
in a row. Prints per arm min / median / max, the body bytes sent before the answer, how the
connection ended, and the conditions; the last line is one JSON object.

    python bench/body_limit.py                       # 20 tries of the portal's server
    python bench/body_limit.py --daphne-runs 3       # and 3 of daphne (each up to --bound-s)
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import statistics
import sys
import tempfile
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from portal.launcher import portal_command  # noqa: E402
from tests.body_limit_support import LyingUpload, lying_upload  # noqa: E402
from tests.platform import running_portal  # noqa: E402

DECLARED = 2**31


def daphne_command(port: int) -> list[str]:
    """The portal's server before: daphne on one address."""
    return ["-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "portal.asgi:application"]


def run_arm(
    name: str, server: Callable[[int], list[str]], runs: int, bound_s: float, path: str = "/api/jobs",
    chunked: bool = False,
) -> dict[str, Any]:
    """`runs` lying uploads to `path`, one after the other, to one portal started with `server`."""
    uploads: list[LyingUpload] = []
    with tempfile.TemporaryDirectory(prefix=f"bench-body-limit-{name}-") as folder:
        with running_portal(Path(folder), server=server) as portal:
            for attempt in range(runs):
                upload = lying_upload(portal.base_url, path, None if chunked else DECLARED, within_s=bound_s)
                uploads.append(upload)
                said = (f"{upload.answered_after_s * 1000:.2f} ms, HTTP {upload.status}"
                        if upload.answered_after_s is not None else f"no answer within {bound_s:.0f} s")
                print(f"{name} try {attempt + 1}: {said}, {upload.body_bytes_sent} body bytes sent, "
                      f"connection {upload.closed or 'left open'}", flush=True)
    answered = [u.answered_after_s for u in uploads if u.answered_after_s is not None]
    return {
        "arm": name,
        "command": " ".join(["python", *server(8000)]).replace("8000", "PORT"),
        "runs": runs,
        "path": path,
        "chunked": chunked,
        "answered": len(answered),
        "timeouts": runs - len(answered),
        "bound_s": bound_s,
        "statuses": sorted({u.status for u in uploads if u.status is not None}),
        "min_ms": round(min(answered) * 1000, 3) if answered else None,
        "median_ms": round(statistics.median(answered) * 1000, 3) if answered else None,
        "max_ms": round(max(answered) * 1000, 3) if answered else None,
        "max_body_bytes_sent": max(u.body_bytes_sent for u in uploads),
        "closed": sorted({u.closed or "open" for u in uploads}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="tries of the portal's server")
    parser.add_argument("--daphne-runs", type=int, default=0, help="tries of daphne, the baseline (0: none)")
    parser.add_argument("--bound-s", type=float, default=20.0, help="how long a try waits for an answer")
    parser.add_argument("--path", default="/api/jobs", help="where to post (an upload route: /api/code, "
                        "/api/agent/jobs/1/artifacts)")
    parser.add_argument("--chunked", action="store_true", help="declare no length: Transfer-Encoding: chunked")
    args = parser.parse_args()

    load_before = os.getloadavg()
    arms = [run_arm("portal.serve (uvicorn)", lambda port: portal_command(port), args.runs, args.bound_s, args.path,
                    args.chunked)]
    if args.daphne_runs:
        arms.append(run_arm("daphne", daphne_command, args.daphne_runs, args.bound_s, args.path, args.chunked))
    load_after = os.getloadavg()

    conditions = {
        "machine": host.node(), "cpu": host.processor() or host.machine(), "cores": os.cpu_count(),
        "python": host.python_version(), "uvicorn": version("uvicorn"), "daphne": version("daphne"),
        "load_average_1m_before": round(load_before[0], 2), "load_average_1m_after": round(load_after[0], 2),
        "declared_bytes": None if args.chunked else DECLARED, "client": "16 KiB body chunks, at most 1 MiB over the bound, loopback",
    }
    print(f"\nconditions: {conditions}")
    print(f"{'arm':<24} {'answered':>9} {'min ms':>9} {'median ms':>10} {'max ms':>9} {'body sent':>10}  closed")
    for arm in arms:
        cells = [f"{arm[k]:.2f}" if arm[k] is not None else f">{arm['bound_s'] * 1000:.0f}"
                 for k in ("min_ms", "median_ms", "max_ms")]
        print(f"{arm['arm']:<24} {arm['answered']:>4}/{arm['runs']:<4} {cells[0]:>9} {cells[1]:>10} {cells[2]:>9} "
              f"{arm['max_body_bytes_sent']:>10}  {','.join(arm['closed'])}")
    print(json.dumps({"benchmark": "body_limit", "conditions": conditions, "arms": arms}))


if __name__ == "__main__":
    main()
