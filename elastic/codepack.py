"""A job's own code in transit: an uploaded tar.gz or zip is checked and repacked into one
canonical tar.gz, whose sha256 names it; an agent checks that digest and unpacks it.

Repacking makes the digest depend only on the files: the same directory gives the same digest
whether it came as a zip or a tar.gz, packed today or tomorrow (members sorted, times, owners and
modes normalised, gzip header without a time). Checks, on both sides:

- no member may leave the directory: no absolute path, no `..`, no symlink or hard link, no
  device or fifo; each is refused with the member's name;
- at most `max_files` members, counted while the archive's index is read and refused at the
  first one past the limit: a zip's end record says how many its central directory lists (an
  archive that claims more is refused before a member is parsed, and the directory is counted
  record by record before zipfile parses it, since zipfile believes its size, not its count), a
  tar is read member by member. Every member counts, directories and the files a
  `.bungeeignore` leaves out included: each costs as much to read as a file kept;
- at most `max_unpacked_bytes` bytes unpacked (a zip bomb is refused before it is written out);
- a `.bungeeignore` at the top (one glob a line, `#` comments, a trailing `/` for a directory)
  leaves out what it matches, like a `.gitignore` without negation;
- an archive whose every file lies under one directory is taken from inside it, so that
  `tar czf code.tgz mytask/` and `cd mytask && tar czf ../code.tgz .` give the same code.

No Django and no torch here: the portal and the agent both use it."""

from __future__ import annotations

import ast
import fnmatch
import gzip
import hashlib
import io
import shutil
import struct
import tarfile
import tempfile
import zipfile
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path, PurePosixPath
from typing import IO, BinaryIO

IGNORE_FILE = ".bungeeignore"
IGNORE_FILE_MAX_BYTES = 1 << 16
"""How much of a `.bungeeignore` is read."""
_COPY_CHUNK = 1 << 20


class Limit(Enum):
    """Which limit an archive passed."""

    FILES = "files"
    UNPACKED_BYTES = "unpacked_bytes"


class ArchiveError(ValueError):
    """The archive is not acceptable code; the message names the member or the limit (`limit`:
    which one it passed; None for any other fault)."""

    def __init__(self, message: str, limit: Limit | None = None) -> None:
        super().__init__(message)
        self.limit = limit


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


_ZIP_END = struct.Struct("<4s4H2LH")
"""A zip's end of central directory record: signature, disk numbers, members on this disk, members
in all, the central directory's size and offset, the comment's length."""
_ZIP_END_SIGNATURE = b"PK\x05\x06"
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_LOCATOR_SIGNATURE = b"PK\x06\x07"
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")
"""The zip64 end record: ..., members on this disk, members in all, the directory's size and offset."""
_ZIP64_END_SIGNATURE = b"PK\x06\x06"
_ZIP_CENTRAL = struct.Struct("<4s24x3H12x")
"""A central directory record's fixed part (46 bytes): its signature and the lengths of the name,
extra field and comment that follow it."""
_ZIP_CENTRAL_SIGNATURE = b"PK\x01\x02"
_ZIP_END_SEARCHED = 1 << 16
"""How far before its end record zipfile looks for it (a comment may follow the record)."""


def _too_many(max_members: int, listed: int | None = None) -> ArchiveError:
    said = f"{listed}" if listed is not None else f"more than {max_members}"
    return ArchiveError(
        f"the archive lists {said} members (files and directories); at most {max_members} are taken", Limit.FILES
    )


def _zip_directory(source: BinaryIO) -> tuple[int, int, int] | None:
    """(the members a zip's end record says its central directory lists, where that directory
    starts, its size in bytes), found as zipfile finds them: the directory ends where the end
    records begin, whatever offset they claim (bytes may be prepended to an archive); None without
    an end record (zipfile then refuses the archive)."""
    source.seek(0, io.SEEK_END)
    size = source.tell()
    tail_start = max(0, size - _ZIP_END.size - _ZIP_END_SEARCHED)
    source.seek(tail_start)
    tail = source.read()
    if tail[-_ZIP_END.size:][:4] == _ZIP_END_SIGNATURE and tail[-2:] == b"\0\0":
        at = len(tail) - _ZIP_END.size
    else:
        at = tail.rfind(_ZIP_END_SIGNATURE)
    if at < 0 or len(tail) - at < _ZIP_END.size:
        return None
    _, _, _, _, listed, directory_size, _, _ = _ZIP_END.unpack_from(tail, at)
    end = tail_start + at
    start = end - directory_size
    locator_at = end - _ZIP64_LOCATOR.size
    if locator_at - _ZIP64_END.size >= 0:
        source.seek(locator_at - _ZIP64_END.size)
        records = source.read(_ZIP64_END.size + _ZIP64_LOCATOR.size)
        if records[_ZIP64_END.size:][:4] == _ZIP64_LOCATOR_SIGNATURE and records[:4] == _ZIP64_END_SIGNATURE:
            *_, listed, directory_size, _ = _ZIP64_END.unpack_from(records)
            start = locator_at - _ZIP64_END.size - directory_size
    return listed, start, directory_size


def _check_zip_members(source: BinaryIO, max_members: int) -> None:
    """Raises ArchiveError if the zip `source` lists more than `max_members` members: at once if
    its end record says so, else at the first central directory record past the limit. zipfile
    reads the directory by its size, not by the count the end record claims, and builds every
    record's ZipInfo as it opens the archive; this walks the same records and builds nothing.
    A directory this cannot walk is left to zipfile to refuse."""
    found = _zip_directory(source)
    if found is None:
        return
    listed, start, directory_size = found
    if listed > max_members:
        raise _too_many(max_members, listed)
    if start < 0:
        return
    source.seek(start)
    walked = counted = 0
    while walked < directory_size:
        record = source.read(_ZIP_CENTRAL.size)
        if len(record) < _ZIP_CENTRAL.size:
            return
        signature, name_length, extra_length, comment_length = _ZIP_CENTRAL.unpack(record)
        if signature != _ZIP_CENTRAL_SIGNATURE:
            return
        counted += 1
        if counted > max_members:
            raise _too_many(max_members)
        variable = name_length + extra_length + comment_length
        source.seek(variable, io.SEEK_CUR)
        walked += _ZIP_CENTRAL.size + variable


class _Reader:
    """The regular files of a tar (any compression tarfile reads) or zip archive, refused where it
    lists more than `max_members` members (None: any number) before they are all read."""

    def __init__(self, source: BinaryIO, max_members: int | None) -> None:
        head = source.read(4)
        source.seek(0)
        self._zip: zipfile.ZipFile | None = None
        self._tar: tarfile.TarFile | None = None
        self._max_members = max_members
        try:
            if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
                if max_members is not None:
                    _check_zip_members(source, max_members)
                    source.seek(0)
                self._zip = zipfile.ZipFile(source)
            else:
                self._tar = tarfile.open(fileobj=source, mode="r:*")
        except (tarfile.TarError, zipfile.BadZipFile, OSError, EOFError) as err:
            raise ArchiveError(f"not a tar.gz or zip archive: {err}") from err

    def members(self) -> list[tuple[_Member, object]]:
        """The archive's regular files with their handles for `open`. Raises ArchiveError for a
        link, a device or a path that leaves the directory, naming the member, and for a tar at its
        first member past `max_members`."""
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
                # Iterating reads one header at a time; getmembers() would read them all first.
                for counted, tar_info in enumerate(self._tar, start=1):
                    if self._max_members is not None and counted > self._max_members:
                        raise _too_many(self._max_members)
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


def ignore_patterns(text: str) -> list[str]:
    """The globs of a `.bungeeignore`'s text: one a line, blank lines and `#` comments skipped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def ignored(path: str, patterns: list[str], is_directory: bool = False) -> bool:
    """Whether the `.bungeeignore` globs `patterns` leave out `path` (relative, `/`-separated):
    a glob with a `/` inside matches from the top, one without matches any name in the path; a
    trailing `/` matches directories only (`is_directory`: `path` itself is one)."""
    parts = path.split("/")
    for pattern in patterns:
        directory_only = pattern.endswith("/")
        pattern = pattern.strip("/")
        anchored = "/" in pattern
        names = parts if is_directory or not directory_only else parts[:-1]
        if anchored:
            prefixes = ["/".join(names[: i + 1]) for i in range(len(names))]
            if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes):
                return True
        elif any(fnmatch.fnmatchcase(name, pattern) for name in names):
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
    `destination`. Raises ArchiveError (`limit` says which one was passed): for more than
    `max_files` members as soon as the archive's index has listed one past the limit."""
    reader = _Reader(source, max_files)
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
                patterns = ignore_patterns(stream.read(IGNORE_FILE_MAX_BYTES).decode("utf-8", errors="replace"))
    kept = sorted(((m, h) for m, h in members if not ignored(m.path, patterns)), key=lambda pair: pair[0].path)
    declared = sum(member.size for member, _ in kept)
    if declared > max_unpacked_bytes:
        raise ArchiveError(
            f"the code unpacks to {declared} bytes; at most {max_unpacked_bytes} are taken", Limit.UNPACKED_BYTES
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
            reader = _Reader(source, max_members=None)  # the portal counted them; the digest is checked
            members = reader.members()
            total = sum(member.size for member, _ in members)
            if total > max_unpacked_bytes:
                raise ArchiveError(
                    f"the code unpacks to {total} bytes; at most {max_unpacked_bytes}", Limit.UNPACKED_BYTES
                )
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


def read_top_files(archive: Path, names: Collection[str], max_bytes: int) -> dict[str, bytes]:
    """The files called `names` at the top of a canonical tar.gz (a job's requirements.txt and
    pyproject.toml): name -> content, of a file over `max_bytes` its first `max_bytes` + 1 bytes.
    A file that is too big is still there, cut, so that the caller refuses it: skipping it would
    check another file than the one a node reads."""
    found = {}
    with tarfile.open(archive, "r:gz") as packed:
        for info in packed:
            if info.name in names and info.isfile():
                stream = packed.extractfile(info)
                if stream is not None:
                    found[info.name] = stream.read(max_bytes + 1)
    return found


SKIPPED_WHEN_PACKING = ("__pycache__", ".git")
"""Directories `pack_directory` never takes (a .bungeeignore can leave out more)."""
LEAVE_OUT_ADVICE = (
    f"leave out what the job does not need with a {IGNORE_FILE} at the top of the code (one glob a line, "
    "e.g. data/ or *.ckpt): the bungee command applies it before it packs, so an ignored file is never sent"
)
"""How to make code smaller, said wherever code is refused for its size."""


def pack_directory(directory: Path, destination: BinaryIO, max_unpacked_bytes: int, max_files: int) -> Packed:
    """Packs the directory as an upload would be, canonically (see `repack`), into
    `destination`; the digest is the one the portal gives the same files. Its `.bungeeignore`
    applies as the directory is walked, so an ignored file or directory is never read (nor
    is a link under it). Raises ArchiveError (a link in what is packed is refused, as in an
    upload)."""
    patterns: list[str] = []
    if (directory / IGNORE_FILE).is_file():
        with (directory / IGNORE_FILE).open("rb") as rules:
            patterns = ignore_patterns(rules.read(IGNORE_FILE_MAX_BYTES).decode("utf-8", errors="replace"))

    def skip(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        path = PurePosixPath(info.name)
        if set(path.parts) & set(SKIPPED_WHEN_PACKING) or ignored(str(path), patterns, info.isdir()):
            return None
        return info

    with tempfile.TemporaryFile() as plain:
        with tarfile.open(fileobj=plain, mode="w") as archive:
            for path in sorted(directory.iterdir()):
                archive.add(path, arcname=path.name, filter=skip)
        plain.seek(0)
        return repack(plain, destination, max_unpacked_bytes, max_files)  # type: ignore[arg-type]


class EntrypointError(ValueError):
    """The code has no class where a job's entrypoint points; the message names the module and
    the class, and lists what the code does hold (its modules, or the module's classes)."""


def _bound_names(statements: list[ast.stmt]) -> tuple[list[str], set[str]]:
    """The classes that `statements` (a module's top level) define, and every other name they
    bind (imports, assignments, functions), looking inside top-level if/try/with blocks."""
    classes: list[str] = []
    others: set[str] = set()
    for statement in statements:
        if isinstance(statement, ast.ClassDef):
            classes.append(statement.name)
        elif isinstance(statement, (ast.Import, ast.ImportFrom)):
            others.update((alias.asname or alias.name).split(".")[0] for alias in statement.names)
        elif isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)):
            others.add(statement.name)
        elif isinstance(statement, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            others.update(node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name))
        elif isinstance(statement, (ast.If, ast.Try, ast.With)):
            blocks = [getattr(statement, field, []) for field in ("body", "orelse", "finalbody")]
            blocks += [handler.body for handler in getattr(statement, "handlers", [])]
            for block in blocks:
                inner_classes, inner_others = _bound_names(block)
                classes.extend(inner_classes)
                others |= inner_others
    return classes, others


def check_entrypoint(archive: BinaryIO, entrypoint: str) -> None:
    """Checks, without importing or running anything of it, that the canonical tar.gz `archive`
    holds the module `entrypoint` (`module:ClassName`) names and that the module binds the name:
    a class it defines, or a name it imports or assigns (which only running it could check).
    Raises EntrypointError naming a missing module (and listing the code's modules), a module
    that does not parse, or a missing class (listing the classes the module defines)."""
    module, _, name = entrypoint.partition(":")
    wanted = module.replace(".", "/")
    sources: dict[str, bytes] = {}
    modules: list[str] = []
    reader = _Reader(archive, max_members=None)
    for member, handle in reader.members():
        if not member.path.endswith(".py"):
            continue
        modules.append(member.path[: -len(".py")].removesuffix("/__init__").replace("/", "."))
        if member.path in (f"{wanted}.py", f"{wanted}/__init__.py"):
            with reader.open(handle) as stream:
                sources[member.path] = _Limited(stream, member.size, member.path).read()
    # A package comes before a module of the same name, as Python imports them.
    found = sources.get(f"{wanted}/__init__.py", sources.get(f"{wanted}.py"))
    if found is None:
        listed = ", ".join(sorted(modules)[:20]) or "none"
        raise EntrypointError(
            f"entrypoint {entrypoint!r}: the code has no module {module!r} (no {wanted}.py or "
            f"{wanted}/__init__.py at its top); its modules: {listed}"
        )
    try:
        tree = ast.parse(found, filename=f"{wanted}.py")
    except (SyntaxError, ValueError) as err:
        raise EntrypointError(f"entrypoint {entrypoint!r}: module {module!r} does not parse: {err}") from err
    classes, others = _bound_names(tree.body)
    if name in classes or name in others or "*" in others:  # a star import may bring it
        return
    defined = f"its classes: {', '.join(classes)}" if classes else "it defines no class at all"
    raise EntrypointError(f"entrypoint {entrypoint!r}: module {module!r} defines no class {name!r}; {defined}")
