"""How long the portal takes to refuse a code archive of too many tiny files, and what the
refusals leave in its memory.

    python bench/archive_limit.py [--uploads 5] [--files 100001] [--formats zip,tar.gz]

Per format, a fresh portal (tests.platform.running_platform: PostgreSQL, Redis, the ASGI server
of portal.launcher.portal_command, with its Celery worker and beat, no agent) is sent `--uploads`
times the same archive of `--files` one-byte files through `POST /api/code`, one upload after the
other, with the default limit (BUNGEE_CODE_MAX_FILES, 10,000). Per upload: the seconds from the
start of the request to the refusal, and the resident memory of the portal's process tree just
before and just after it (psutil). Printed: min / median / max of both, the portal's memory at
its start and after the last upload, and the conditions; the last line is one JSON object.

The same script on another checkout measures that checkout's portal (its ROOT starts the
processes): clone it, link its .venv, copy this file into its bench/ and run it there. A run of
four checkouts, with where the memory went: bench/results/archive-limit-cpu-2core-2026-11-26.txt.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conditions import ROOT, machine, show, spread  # noqa: E402
from portal.launcher import portal_command  # noqa: E402
from tests.platform import Platform, running_platform  # noqa: E402

MIB = 1 << 20


def archive(kind: str, files: int) -> bytes:
    """An archive of `files` one-byte files, f0.py ... (a zip deflated, as zip tools write)."""
    buffer = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as packed:
            for index in range(files):
                packed.writestr(f"f{index}.py", b"x")
    else:
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for index in range(files):
                info = tarfile.TarInfo(f"f{index}.py")
                info.size = 1
                tar.addfile(info, io.BytesIO(b"x"))
    return buffer.getvalue()


def portal_rss(platform: Platform) -> int:
    """Bytes resident in the portal's process and its children (one process under daphne; a
    server with workers counts them all)."""
    [portal] = [p for p in platform.group.processes if p.name == "portal"]
    root = psutil.Process(portal.process.pid)
    return sum(process.memory_info().rss for process in [root, *root.children(recursive=True)])


def upload(platform: Platform, data: bytes, name: str) -> dict[str, Any]:
    """One upload: seconds to the answer, its status and message, the RSS around it."""
    before = portal_rss(platform)
    started = time.perf_counter()
    with platform.api("alice") as client:
        reply = client.post("/api/code", files={"file": (name, data)}, timeout=300)
    seconds = time.perf_counter() - started
    after = portal_rss(platform)
    try:
        message = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reply.text[:200]
    return {"seconds": seconds, "status": reply.status_code, "message": message,
            "rss_before_mib": before / MIB, "rss_after_mib": after / MIB, "load_1m": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--uploads", type=int, default=5)
    parser.add_argument("--files", type=int, default=100_001)
    parser.add_argument("--formats", default="zip,tar.gz")
    args = parser.parse_args(argv)
    kinds = args.formats.split(",")
    archives = {kind: archive(kind, args.files) for kind in kinds}
    conditions = {**machine(), "server": portal_command(0)[1]}
    commit = os.popen(f"git -C {ROOT} log -1 --format=%h").read().strip()
    print(f"conditions: {conditions}; checkout {ROOT} at {commit}", flush=True)
    for kind, data in archives.items():
        print(f"{kind}: {args.files} files, {len(data)} bytes", flush=True)
    results: dict[str, Any] = {}
    for kind, data in archives.items():
        with tempfile.TemporaryDirectory(prefix="bench-archive-") as tmp, \
                running_platform(Path(tmp), {}) as platform:
            started_rss = portal_rss(platform) / MIB
            print(f"{kind}: a fresh portal, {started_rss:.1f} MiB resident", flush=True)
            rows = []
            for index in range(args.uploads):
                row = upload(platform, data, f"many.{kind}")
                rows.append(row)
                print(f"{kind} upload {index + 1}: HTTP {row['status']} in {row['seconds']:.3f} s, "
                      f"RSS {row['rss_before_mib']:.1f} -> {row['rss_after_mib']:.1f} MiB "
                      f"(load {row['load_1m']:.2f}): {row['message'][:160]}", flush=True)
        seconds = [row["seconds"] for row in rows]
        before = [row["rss_before_mib"] for row in rows]
        after = [row["rss_after_mib"] for row in rows]
        growth = after[-1] - started_rss
        print(f"{kind}: to the refusal {show(seconds)}; RSS before {show(before, 'MiB', 1)}, "
              f"after {show(after, 'MiB', 1)}; {started_rss:.1f} -> {after[-1]:.1f} MiB ({growth:+.1f}) "
              f"over {args.uploads} uploads", flush=True)
        results[kind] = {"bytes": len(data), "statuses": sorted({row["status"] for row in rows}),
                         "seconds": spread(seconds), "portal_started_mib": round(started_rss, 1),
                         "rss_before_mib": spread(before), "rss_after_mib": spread(after),
                         "rss_growth_mib": round(growth, 1), "message": rows[-1]["message"]}
    print(json.dumps({"bench": "archive_limit", "checkout": str(ROOT), "commit": commit, "files": args.files,
                      "uploads": args.uploads, **conditions, "load_after": round(os.getloadavg()[0], 2),
                      **results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
