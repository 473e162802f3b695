"""A job's own code in transit: an uploaded tar.gz or zip is checked and repacked into one
canonical tar.gz, whose sha256 names it; an agent checks that digest and unpacks it.

Repacking makes the digest depend only on the files: the same directory gives the same digest
whether it came as a zip or a tar.gz, packed today or tomorrow (members sorted, times, owners and
modes normalised, gzip header without a time). Checks, on both sides:

- no member may leave the directory: no absolute path, no `..`, no symlink or hard link, no
  device or fifo; each is refused with the member's name;
- at most `max_files` files and `max_unpacked_bytes` bytes unpacked (a zip bomb is refused
  before it is written out);
- a `.bungeeignore` at the top (one glob a line, `#` comments, a trailing `/` for a directory)
  leaves out what it matches, like a `.gitignore` without negation;
- an archive whose every file lies under one directory is taken from inside it, so that
  `tar czf code.tgz mytask/` and `cd mytask && tar czf ../code.tgz .` give the same code.

No Django and no torch here: the portal and the agent both use it."""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import io
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO

IGNORE_FILE = ".bungeeignore"
_COPY_CHUNK = 1 << 20


class ArchiveError(ValueError):
    """The archive is not acceptable code; the message names the member or the limit."""

    def __init__(self, message: str, too_big: bool = False) -> None:
        super().__init__(message)
        self.too_big = too_big


@dataclass(frozen=True)
class Packed:
    digest: str
    """sha256 of the canonical tar.gz, hex."""
    size: int
    """Bytes of the canonical tar.gz."""
    files: list[str]
    unpacked_bytes: int


@dataclass(frozen=True)
class _Member:
    path: str
    size: int
    executable: bool


def _clean_path(name: str) -> str:
    """The member's path relative to the archive's top; raises ArchiveError if it is
    absolute or climbs out."""
    if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        raise ArchiveError(f"archive member {name!r} has an absolute path")
    parts = [part for part in PurePosixPath(name.replace("\\", "/")).parts if part not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"archive member {name!r} leaves the directory ('..')")
    return "/".join(parts)


class _Reader:
    """The regular files of a tar (any compression tarfile reads) or zip archive."""

    def __init__(self, source: BinaryIO) -> None:
        head = source.read(4)
        source.seek(0)
        self._zip: zipfile.ZipFile | None = None
        self._tar: tarfile.TarFile | None = None
        try:
            if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
                self._zip = zipfile.ZipFile(source)
            else:
                self._tar = tarfile.open(fileobj=source, mode="r:*")
        except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as err:
            raise ArchiveError(f"not a tar.gz or zip archive: {err}") from err

    def members(self) -> list[tuple[_Member, object]]:
        found: list[tuple[_Member, object]] = []
        try:
            if self._zip is not None:
                for info in self._zip.infolist():
                    mode = info.external_attr >> 16
                    if (mode & 0o170000) == 0o120000:
                        raise ArchiveError(f"archive member {info.filename!r} is a symbolic link")
                    path = _clean_path(info.filename)
                    if info.is_dir() or not path:
                        continue
                    found.append((_Member(path, info.file_size, bool(mode & 0o111)), info))
            else:
                assert self._tar is not None
                for tar_info in self._tar:
                    path = _clean_path(tar_info.name)
                    if tar_info.issym() or tar_info.islnk():
                        raise ArchiveError(f"archive member {tar_info.name!r} is a link")
                    if tar_info.isdir() or not path:
                        continue
                    if not tar_info.isfile():
                        raise ArchiveError(f"archive member {tar_info.name!r} is not a regular file")
                    found.append((_Member(path, tar_info.size, bool(tar_info.mode & 0o111)), tar_info))
        except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as err:
            raise ArchiveError(f"the archive is damaged: {err}") from err
        return found

    @contextmanager
    def open(self, handle: object) -> Iterator[IO[bytes]]:
        if self._zip is not None:
            assert isinstance(handle, zipfile.ZipInfo)
            with self._zip.open(handle) as stream:
                yield stream
        else:
            assert self._tar is not None and isinstance(handle, tarfile.TarInfo)
            extracted = self._tar.extractfile(handle)
            if extracted is None:
                raise ArchiveError(f"archive member {handle.name!r} cannot be read")
            with extracted:
                yield extracted


def _ignore_patterns(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def _ignored(path: str, patterns: list[str]) -> bool:
    parts = path.split("/")
    for pattern in patterns:
        directory_only = pattern.endswith("/")
        pattern = pattern.strip("/")
        anchored = "/" in pattern
        if anchored:
            prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts) - (1 if directory_only else 0))]
            if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
                return True
        else:
            names = parts[:-1] if directory_only else parts
            if any(fnmatch.fnmatchcase(name, pattern) for name in names):
                return True
    return False


def _common_top(paths: list[str]) -> str:
    """The one directory every path lies under, or ''."""
    tops = {path.split("/", 1)[0] for path in paths}
    if len(tops) == 1 and all("/" in path for path in paths):
        return next(iter(tops)) + "/"
    return ""


def repack(source: BinaryIO, destination: BinaryIO, max_unpacked_bytes: int, max_files: int) -> Packed:
    """Checks the tar or zip archive `source` (seekable) and writes its canonical tar.gz to
    `destination`. Raises ArchiveError (`too_big` for a limit passed)."""
    reader = _Reader(source)
    members = reader.members()
    top = _common_top([member.path for member, _ in members])
    members = [(_Member(m.path[len(top):], m.size, m.executable), handle) for m, handle in members]
    seen: set[str] = set()
    for member, _ in members:
        if member.path in seen:
            raise ArchiveError(f"archive member {member.path!r} appears twice")
        seen.add(member.path)
    patterns: list[str] = []
    for member, handle in members:
        if member.path == IGNORE_FILE:
            with reader.open(handle) as stream:
                patterns = _ignore_patterns(stream.read(1 << 16).decode("utf-8", errors="replace"))
    kept = sorted(((m, h) for m, h in members if not _ignored(m.path, patterns)), key=lambda pair: pair[0].path)
    if len(kept) > max_files:
        raise ArchiveError(f"the code has {len(kept)} files; at most {max_files} are taken", too_big=True)
    declared = sum(member.size for member, _ in kept)
    if declared > max_unpacked_bytes:
        raise ArchiveError(
            f"the code unpacks to {declared} bytes; at most {max_unpacked_bytes} are taken", too_big=True
        )
    hasher = _HashingWriter(destination)
    unpacked = 0
    with gzip.GzipFile(fileobj=hasher, mode="wb", mtime=0, filename="") as compressed:  # type: ignore[arg-type]
        with tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as out:
            for member, handle in kept:
                info = tarfile.TarInfo(member.path)
                info.size = member.size
                info.mode = 0o755 if member.executable else 0o644
                info.mtime = 0
                with reader.open(handle) as stream:
                    limited = _Limited(stream, member.size, member.path)
                    out.addfile(info, limited)
                unpacked += member.size
    return Packed(hasher.hexdigest(), hasher.size, [m.path for m, _ in kept], unpacked)


class _Limited(io.RawIOBase):
    """Reads exactly `size` bytes of a member; raises ArchiveError if it holds more or less
    than its header said (a zip's sizes are only a claim)."""

    def __init__(self, stream: IO[bytes], size: int, name: str) -> None:
        self._stream, self._left, self._name = stream, size, name

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        want = self._left if n < 0 else min(n, self._left)
        try:
            data = self._stream.read(want) if want else b""
        except (zipfile.BadZipFile, tarfile.TarError, OSError, EOFError) as err:
            raise ArchiveError(f"archive member {self._name!r} is damaged: {err}") from err
        if want and not data:
            raise ArchiveError(f"archive member {self._name!r} is shorter than its header says")
        self._left -= len(data)
        return data


class _HashingWriter:
    def __init__(self, target: BinaryIO) -> None:
        self._target = target
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._hash.update(data)
        self.size += len(data)
        return self._target.write(data)

    def flush(self) -> None:
        self._target.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def file_digest(path: Path) -> str:
    """sha256 of a file, hex."""
    with path.open("rb") as stream:
        return hashlib.file_digest(stream, "sha256").hexdigest()


def unpack(archive: Path, target: Path, max_unpacked_bytes: int) -> None:
    """Unpacks a canonical tar.gz into the new directory `target` with the same checks as
    `repack` (and tarfile's "data" filter). Raises ArchiveError; leaves nothing behind then."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with archive.open("rb") as source:
            reader = _Reader(source)
            members = reader.members()
            total = sum(member.size for member, _ in members)
            if total > max_unpacked_bytes:
                raise ArchiveError(f"the code unpacks to {total} bytes; at most {max_unpacked_bytes}", too_big=True)
            for member, handle in members:
                path = staging / member.path
                path.parent.mkdir(parents=True, exist_ok=True)
                with reader.open(handle) as stream, path.open("wb") as out:
                    shutil.copyfileobj(_Limited(stream, member.size, member.path), out, _COPY_CHUNK)  # type: ignore[misc]
                path.chmod(0o755 if member.executable else 0o644)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


SKIPPED_WHEN_PACKING = ("__pycache__", ".git")
"""Directories `pack_directory` never takes (a .bungeeignore can leave out more)."""


def pack_directory(directory: Path, destination: BinaryIO, max_unpacked_bytes: int, max_files: int) -> Packed:
    """Packs the directory as an upload would be, canonically (see `repack`), into
    `destination`; the digest is the one the portal gives the same files. Raises ArchiveError
    (a link in the directory is refused, as in an upload)."""

    def skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if set(PurePosixPath(info.name).parts) & set(SKIPPED_WHEN_PACKING) else info

    with tempfile.TemporaryFile() as plain:
        with tarfile.open(fileobj=plain, mode="w") as archive:
            for path in sorted(directory.iterdir()):
                archive.add(path, arcname=path.name, filter=skip)
        plain.seek(0)
        return repack(plain, destination, max_unpacked_bytes, max_files)  # type: ignore[arg-type]
