"""Archives for the code tests, built in memory."""

from __future__ import annotations

import io
import tarfile
import zipfile
from pathlib import Path
from typing import Any

RINGS = Path(__file__).parent / "tasks" / "rings"


def directory_files(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def tar_gz(files: dict[str, bytes], top: str = "", links: dict[str, str] | None = None, hard: bool = False) -> bytes:
    """A tar.gz of `files` (under the directory `top`, if given) and symbolic (or hard) links."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(top + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(top + name)
            info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
            info.linkname = target
            archive.addfile(info)
    return buffer.getvalue()


def zip_of(files: dict[str, bytes], links: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        for name, target in (links or {}).items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o120777 << 16)
            archive.writestr(info, target)
    return buffer.getvalue()


RELOAD = """
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
try:
    import elastic.tasks  # noqa: F401  (the CLI's install brings elastic.codepack, nothing of the runtime)
except ImportError:
    pass
else:
    raise SystemExit("Bungee's runtime is importable here; the reload must not need it")
import task

torch.set_num_threads(1)
manifest = json.load(open(sys.argv[3]))
the_task = task.RingsTask(task.RingsTask.Hyperparameters(**manifest["spec"]["hyperparameters"]))
model = the_task.model()
model.load_state_dict(torch.load(sys.argv[2], weights_only=True))
model.eval()
data = the_task.eval_data()
size = manifest["final"]["evaluated_with_batch_size"]
totals, count = {}, 0
with torch.no_grad():
    for start in range(0, len(data), size):
        rows = range(start, min(start + size, len(data)))
        batch = the_task.collate([data[i] for i in rows])
        for name, value in the_task.evaluate(model, batch).items():
            totals[name] = totals.get(name, 0.0) + float(value) * len(rows)
        count += len(rows)
print(json.dumps({name: total / count for name, total in totals.items()}))
"""


def evaluate_without_bungee(model: Path, manifest: Path) -> dict[str, float]:
    """Loads `model` into the rings task's own model class in a fresh interpreter that cannot
    import Bungee (-I: no PYTHONPATH, no current directory) and evaluates it as the manifest says
    the runtime did; returns the metrics."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-I", "-c", RELOAD, str(RINGS), str(model), str(manifest)],
        capture_output=True, text=True, timeout=120, cwd="/",
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, float] = json.loads(done.stdout)
    return result


def upload_code(token: str, files: dict[str, bytes]) -> Any:
    """POST /api/code through Django's test client, with `token`: a task.py and `files`, as a
    tar.gz."""
    from django.core.files.uploadedfile import SimpleUploadedFile
    from django.test import Client

    archive = SimpleUploadedFile("code.tar.gz", tar_gz({"task.py": b"x = 1\n", **files}))
    return Client().post("/api/code", {"file": archive}, HTTP_AUTHORIZATION=f"Bearer {token}")
