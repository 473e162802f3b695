"""Jobs' own environments (agent.environments): how long a node takes to build one, and to find
it in its cache, for one small package and for a realistic set, both from a wheelhouse, offline
(UV_OFFLINE=1), side by side.

    python bench/environments.py --wheelhouse DIR --requirements "einops transformers datasets"
    python bench/environments.py --quick          # the small package only, 3 repeats

Fill the wheelhouse once, on a machine with access to an index:
`pip download -d DIR --only-binary=:all: einops transformers datasets`. The small package is
written into a wheelhouse of its own (tests.environment_support). Each repeat of a cold build
starts from an empty environment cache *and* an empty uv cache (the first job with these
requirements on a fresh node: uv unpacks every wheel); "cold, uv cache warm" keeps uv's cache
(a node that built environments with these packages before, then evicted them); a cache hit is
`ensure` on the built environment (what every later job pays). A small package that requires
torch shows what the import check after the install costs (it imports torch and the package in
the new environment). Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.environments import Environments, EnvironmentSettings, uv_binary  # noqa: E402
from bench.conditions import machine, show, spread  # noqa: E402
from elastic.requirements import Declared, declared_in  # noqa: E402
from tests.environment_support import TINY, tiny_wheelhouse, write_wheel  # noqa: E402

TORCH_DEPENDENT = "bungeetorchdependent"


def cache(root: Path, wheelhouse: Path, uv_cache: Path) -> Environments:
    return Environments(
        EnvironmentSettings(root=root, python=sys.executable, uv=uv_binary(), find_links=(str(wheelhouse),)),
        {"PATH": os.defpath, "UV_OFFLINE": "1", "UV_CACHE_DIR": str(uv_cache)},
    )


def measure(label: str, declared: Declared, wheelhouse: Path, repeats: int, work: Path) -> dict[str, Any]:
    cold: list[float] = []
    warm_uv: list[float] = []
    hits: list[float] = []
    size = 0
    for repeat in range(repeats):
        uv_cache = work / f"{label}-uv-{repeat}"
        root = work / f"{label}-cold-{repeat}"
        started = time.monotonic()
        built = cache(root, wheelhouse, uv_cache).ensure(declared)
        cold.append(time.monotonic() - started)
        size = int((built.path / "bungee-size").read_text())
        again = work / f"{label}-warm-{repeat}"
        started = time.monotonic()
        cache(again, wheelhouse, uv_cache).ensure(declared)
        warm_uv.append(time.monotonic() - started)
        for _ in range(5):
            agent = cache(root, wheelhouse, uv_cache)  # a restarted agent: reads the node once
            agent.base()
            started = time.monotonic()
            hit = agent.ensure(declared)
            hits.append(time.monotonic() - started)
            assert hit.built_s is None
        for path in (root, again, uv_cache):
            shutil.rmtree(path, ignore_errors=True)
    print(f"{label} ({', '.join(declared.lines())}; environment {size / 1e6:.1f} MB)")
    print(f"  cold build, empty uv cache   {show(cold)}")
    print(f"  cold build, uv cache warm    {show(warm_uv)}")
    print(f"  cache hit                    {show(hits, digits=4)}", flush=True)
    return {"requirements": declared.lines(), "environment_mb": round(size / 1e6, 1), "cold_s": spread(cold),
            "cold_uv_cache_warm_s": spread(warm_uv), "hit_s": spread(hits)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheelhouse", type=Path, help="wheels of the realistic set (pip download)")
    parser.add_argument("--requirements", default="einops transformers datasets", help="the realistic set")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="the small package only, 3 repeats")
    args = parser.parse_args(argv)
    conditions = machine()
    print(f"conditions: {conditions}", flush=True)
    repeats = 3 if args.quick else args.repeats
    work = Path(tempfile.mkdtemp(prefix="bungee-bench-environments-"))
    results = {"small": measure("one small package", _declared(f"{TINY}==2.0"), tiny_wheelhouse(work / "tiny"),
                                repeats, work)}
    write_wheel(work / "torch-dependent", TORCH_DEPENDENT, "1.0", requires=("torch",), code="import torch")
    results["torch_dependent"] = measure("one small package that requires torch (the import check imports it)",
                                         _declared(f"{TORCH_DEPENDENT}==1.0"), work / "torch-dependent", repeats, work)
    if args.wheelhouse and not args.quick:
        results["realistic"] = measure("a realistic set", _declared("\n".join(args.requirements.split())),
                                       args.wheelhouse, repeats, work)
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"bench": "environments", **results, "repeats": repeats, "conditions": conditions,
                      "load_average_1m_end": round(os.getloadavg()[0], 2)}))
    return 0


def _declared(text: str) -> Declared:
    found = declared_in({"requirements.txt": text.encode()})
    assert found is not None
    return found


if __name__ == "__main__":
    sys.exit(main())
