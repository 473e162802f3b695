"""A wheelhouse for the environment tests and bench, made here, offline: small pure-Python
packages written straight as wheels (a wheel is a zip with its metadata, PEP 427), which takes
milliseconds where `pip wheel` of a source directory takes a second and more of the suite's
time per version."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

TINY = "bungeetiny"
"""The package the tests' tasks import: versions 1.0 and 2.0 in the wheelhouse."""


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def write_wheel(
    wheelhouse: Path, name: str, version: str, requires: tuple[str, ...] = (), code: str = "",
    top_level: bool = False,
) -> Path:
    """A wheel of the package `name` (its module runs `code`, then says VERSION) in `wheelhouse`;
    `top_level`: with a top_level.txt naming its module (else only its RECORD does)."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"{code}\nVERSION = {version!r}\n".encode(),
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
            + "".join(f"Requires-Dist: {requirement}\n" for requirement in requires)
        ).encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: bungee-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if top_level:
        files[f"{info}/top_level.txt"] = f"{name}\n".encode()
    record = "\n".join(_record_line(path, data) for path, data in files.items()) + f"\n{info}/RECORD,,\n"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    path = wheelhouse / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for member, data in {**files, f"{info}/RECORD": record.encode()}.items():
            wheel.writestr(member, data)
    return path


def tiny_wheelhouse(wheelhouse: Path) -> Path:
    """`wheelhouse` with TINY 1.0 and 2.0 (2.0 needs numpy, which the node has)."""
    write_wheel(wheelhouse, TINY, "1.0")
    write_wheel(wheelhouse, TINY, "2.0", requires=("numpy>=1",))
    return wheelhouse
