"""A job's own Python packages, declared with its code: a `requirements.txt` at the top of the
uploaded directory, or else the `[project] dependencies` of its `pyproject.toml` (`declaring_file`
says which: the portal checks the file the agent builds from, never the other one). The portal
checks them when the code is uploaded and the agent reads them again before it builds the job's
environment (agent.environments), with the same rules:

- each file at most MAX_FILE_BYTES, MAX_LINES lines of at most MAX_LINE_CHARS characters, a
  requirement's name at most MAX_NAME_CHARS: a file is read whole, so a bigger one is refused,
  never skipped;
- one requirement a line (PEP 508: a name, extras, a version range, a marker); comments and
  blank lines are skipped, a trailing backslash continues a line;
- a direct reference (`name @ URL`) only to a host: an `https`, `http`, `git+https` or `git+ssh`
  URL (URL_SCHEMES). Any other scheme (`file:`, `hg+file:`, `svn+...`) and any path (`/abs`,
  `./x`, `../x`, `C:\\x`) is refused: the nodes do not have the user's disk, and building a
  directory of the node's would run its build backend on the node's own files;
- no option lines (`-e`, `-r`, `-c`, `--index-url`, `--find-links`, ...): packages come from the
  index or wheelhouse the node's operator configured, and an environment depends on nothing
  outside the requirements themselves. An operator may allow the index options (INDEX_OPTIONS:
  a lab's own index named by its users), on the portal and the agents alike; each then names one
  `https` or `http` URL, never a local directory or file;
- no `${VARIABLE}`: uv expands them in a requirements file, and the build's environment is the
  node's;
- a requirement on a package the node's runtime is built on (torch first, and whatever else the
  node has installed) must allow the node's version: the job's environment is layered over the
  node's, which it never changes.

No Django, no torch: the portal and the agent both use it."""

from __future__ import annotations

import tomllib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import parse_qs, urlsplit

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REQUIREMENTS_FILE = "requirements.txt"
PYPROJECT_FILE = "pyproject.toml"
INDEX_OPTIONS = frozenset({"--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--no-index"})
"""Option lines an operator may allow (BUNGEE_ENV_INDEX_OPTIONS): where uv looks for packages."""
NO_VALUE_OPTIONS = frozenset({"--no-index"})
"""The INDEX_OPTIONS that take no URL."""
MAX_REQUIREMENTS = 500
"""More than this many requirements is refused: an environment is a job's few extra packages."""
MAX_FILE_BYTES = 1 << 20
"""The most a requirements.txt or pyproject.toml may hold: the portal reads no more of either."""
MAX_LINES = 5_000
"""The most lines a requirements.txt may have, comments and blank lines counted."""
MAX_LINE_CHARS = 4_096
"""The most characters of one requirement (a requirements.txt line, its continuations joined, or
an item of pyproject.toml's dependencies)."""
MAX_NAME_CHARS = 200
"""The most characters of a requirement's name (PEP 508 sets no bound; no package on PyPI comes
near it)."""
URL_SCHEMES = ("https", "http", "git+https", "git+ssh")
"""The schemes of a direct reference (`name @ URL`): a host's, never the node's disk."""
INDEX_URL_SCHEMES = ("https", "http")
"""The schemes of an index option's URL."""
SHOWN_CHARS = 120
"""The most characters of a refused line an error quotes."""


class RequirementsError(ValueError):
    """The declared requirements are not acceptable; the message names the file, the line and
    the text that is wrong (`where`: "requirements.txt line 3" or "pyproject.toml
    dependencies[2]")."""

    def __init__(self, where: str, text: str, reason: str) -> None:
        shown = text if len(text) <= SHOWN_CHARS else f"{text[:SHOWN_CHARS]}... ({len(text)} characters)"
        super().__init__(f"{where}: {shown!r}: {reason}")
        self.where = where
        self.text = shown
        self.reason = reason


@dataclass(frozen=True)
class Declared:
    """The requirements a job's code declares, each with where it was written."""

    source: str
    """REQUIREMENTS_FILE or PYPROJECT_FILE."""
    requirements: tuple[tuple[str, Requirement], ...]
    index_options: tuple[str, ...] = ()
    """The INDEX_OPTIONS lines, as written, where the operator allows them."""

    def lines(self) -> list[str]:
        """The index options, then the requirements as uv reads them, sorted (the order does not
        change a resolution)."""
        return [*self.index_options, *sorted({str(requirement) for _, requirement in self.requirements})]


def declaring_file(names: Collection[str]) -> str | None:
    """Which of a code directory's top-level file `names` declares its requirements: its
    REQUIREMENTS_FILE if it has one, else its PYPROJECT_FILE, else None. The one rule the portal
    (at upload) and the agent (before it builds) both follow."""
    for name in (REQUIREMENTS_FILE, PYPROJECT_FILE):
        if name in names:
            return name
    return None


def declared_in(files: Mapping[str, bytes], index_options: bool = False) -> Declared | None:
    """The requirements among a code directory's top-level `files` (name -> content; only
    REQUIREMENTS_FILE and PYPROJECT_FILE are read; of a file over MAX_FILE_BYTES, more than
    MAX_FILE_BYTES of it is enough), or None if it declares none (no such file, or a
    pyproject.toml without dependencies); `index_options`: the operator allows INDEX_OPTIONS
    lines. Raises RequirementsError, also when either file is over MAX_FILE_BYTES, the one not
    read included (no file of the two is taken unchecked)."""
    for name in (REQUIREMENTS_FILE, PYPROJECT_FILE):
        if name in files and len(files[name]) > MAX_FILE_BYTES:
            raise RequirementsError(
                name, f"more than {MAX_FILE_BYTES} bytes",
                f"{name} may be at most {MAX_FILE_BYTES} bytes (1 MiB), the most the portal and the agents read of "
                "it; it declares a job's few extra packages",
            )
    source = declaring_file(files.keys())
    if source == REQUIREMENTS_FILE:
        found, options = _parse_requirements_txt(files[REQUIREMENTS_FILE], index_options)
        return Declared(REQUIREMENTS_FILE, tuple(found), tuple(options))
    if source == PYPROJECT_FILE:
        found = _parse_pyproject(files[PYPROJECT_FILE])
        return Declared(PYPROJECT_FILE, tuple(found)) if found else None
    return None


def declared_in_directory(directory: Path, index_options: bool = False) -> Declared | None:
    """declared_in for an unpacked code directory (no more than MAX_FILE_BYTES + 1 bytes of a
    file read). Raises RequirementsError."""
    files = {}
    for name in (REQUIREMENTS_FILE, PYPROJECT_FILE):
        if (directory / name).is_file():
            with (directory / name).open("rb") as stream:
                files[name] = stream.read(MAX_FILE_BYTES + 1)
    return declared_in(files, index_options)


def checked_again(declared: Declared, index_options: bool) -> None:
    """Raises RequirementsError if the lines `declared` gives a build (Declared.lines) are not
    all ones declared_in takes: what is built is held to the rules, whoever made `declared`."""
    again = declared_in({REQUIREMENTS_FILE: "\n".join(declared.lines()).encode()}, index_options)
    if again is None or again.lines() != declared.lines():
        raise RequirementsError(declared.source, "; ".join(declared.lines()), "not the requirements it was read as")


def conflicts(declared: Declared, installed: Mapping[str, str]) -> list[RequirementsError]:
    """The requirements of `declared` that a node with `installed` (distribution name -> version)
    cannot meet without changing one of its own packages, each as an error that names the line,
    the node's version and why it stays."""
    found = []
    versions = {canonicalize_name(name): version for name, version in installed.items()}
    for where, requirement in declared.requirements:
        version = versions.get(canonicalize_name(requirement.name))
        if version is None or (requirement.marker is not None and not requirement.marker.evaluate()):
            continue
        allowed = requirement.url is None and requirement.specifier.contains(_version(version), prereleases=True)
        if not allowed:
            found.append(RequirementsError(
                where, str(requirement),
                f"the nodes run {requirement.name} {version}, which a job's environment cannot change (it is layered "
                f"over the node's, and the runtime is built on it); allow {version} or leave the line out",
            ))
    return found


def _version(text: str) -> Version | str:
    try:
        return Version(text)
    except InvalidVersion:
        return text


def _parse_requirements_txt(content: bytes, index_options: bool) -> tuple[list[tuple[str, Requirement]], list[str]]:
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as err:
        raise RequirementsError(REQUIREMENTS_FILE, content[:40].decode("latin-1"), f"not UTF-8 text ({err})") from err
    lines = text.splitlines()
    if len(lines) > MAX_LINES:
        raise RequirementsError(REQUIREMENTS_FILE, f"{len(lines)} lines", f"more than {MAX_LINES} lines")
    found: list[tuple[str, Requirement]] = []
    options: list[str] = []
    pending, first = "", 0
    for number, raw in enumerate(lines, start=1):
        if not pending:
            first = number
        where = f"{REQUIREMENTS_FILE} line {first}"
        if len(pending) + len(raw) > MAX_LINE_CHARS:
            raise RequirementsError(where, pending + raw, f"longer than {MAX_LINE_CHARS} characters")
        line = raw.strip()
        line = "" if line.startswith("#") else line.split(" #", 1)[0].strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        option = line.split()[0].split("=", 1)[0] if line else ""
        if index_options and option in INDEX_OPTIONS:
            options.append(_index_option(where, line, option))
        elif line:
            found.append(_requirement(where, line))
        if len(found) > MAX_REQUIREMENTS:
            raise RequirementsError(REQUIREMENTS_FILE, line, f"more than {MAX_REQUIREMENTS} requirements")
    return found, options


def _parse_pyproject(content: bytes) -> list[tuple[str, Requirement]]:
    try:
        project = tomllib.loads(content.decode("utf-8")).get("project", {})
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise RequirementsError(PYPROJECT_FILE, content[:40].decode("latin-1"), f"not valid TOML: {err}") from err
    dependencies = project.get("dependencies", []) if isinstance(project, dict) else []
    if not isinstance(dependencies, list) or not all(isinstance(item, str) for item in dependencies):
        raise RequirementsError(f"{PYPROJECT_FILE} [project] dependencies", str(dependencies)[:200],
                                "a list of requirement strings")
    if len(dependencies) > MAX_REQUIREMENTS:
        raise RequirementsError(PYPROJECT_FILE, "dependencies", f"more than {MAX_REQUIREMENTS} requirements")
    return [_requirement(f"{PYPROJECT_FILE} dependencies[{index}]", item) for index, item in enumerate(dependencies)]


def _no_variables(where: str, line: str) -> None:
    if "${" in line:
        raise RequirementsError(
            where, line, "no ${...}: uv would fill it in from the environment of the node's build",
        )


def _index_option(where: str, line: str, option: str) -> str:
    """An INDEX_OPTIONS line as uv is given it: the option alone, or with its one URL (written
    `OPTION URL` or `OPTION=URL`), which must be an https or http URL to a host."""
    _no_variables(where, line)
    words = line.replace("=", " ", 1).split() if line.split()[0] != option else line.split()
    values = words[1:]
    if option in NO_VALUE_OPTIONS:
        if values:
            raise RequirementsError(where, line, f"option {option} takes no value")
        return option
    if len(values) != 1:
        raise RequirementsError(where, line, f"option {option} takes one URL, an https or http one")
    _check_url(where, line, values[0], INDEX_URL_SCHEMES, f"option {option}")
    return f"{option} {values[0]}"


def _check_url(where: str, line: str, url: str, schemes: tuple[str, ...], what: str) -> None:
    """Raises RequirementsError unless `url` is one of `schemes` to a named host."""
    allowed = ", ".join(f"{scheme}://" for scheme in schemes)
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError as err:
        raise RequirementsError(where, line, f"{what}: not a URL ({err}); only {allowed} URLs are taken") from err
    scheme = parts.scheme.lower()
    if scheme not in schemes:
        found = f"the scheme {parts.scheme + ':'!r} is" if len(scheme) > 1 else "a path is"  # C:\x is a path
    elif not url[len(parts.scheme) + 1:].startswith("//") or not host:
        found = "a URL that names no host is"
    else:
        found = ""
    if found:
        raise RequirementsError(
            where, line,
            f"{what}: {found} not taken, only {allowed} URLs to a host: a local path, or a file: or "
            "VCS-over-file URL, names the node's disk, not yours",
        )
    subdirectory = parse_qs(parts.fragment).get("subdirectory", [])
    if any(PurePosixPath(value).is_absolute() or ".." in PurePosixPath(value).parts or "\\" in value
           for value in subdirectory):
        raise RequirementsError(where, line, f"{what}: a subdirectory= must stay inside what the URL names")


def _requirement(where: str, line: str) -> tuple[str, Requirement]:
    if len(line) > MAX_LINE_CHARS:
        raise RequirementsError(where, line, f"longer than {MAX_LINE_CHARS} characters")
    if line.startswith("-"):
        option = line.split()[0].split("=", 1)[0]
        allowed = " unless the operator allows index options (BUNGEE_ENV_INDEX_OPTIONS)" if option in INDEX_OPTIONS else ""
        raise RequirementsError(
            where, line,
            f"option {option} is not taken in a job's requirements{allowed}: packages come from the index or "
            "wheelhouse the node's operator configured (docs/operator/environments.md), and each line is one "
            "requirement",
        )
    _no_variables(where, line)
    try:
        requirement = Requirement(line)
    except InvalidRequirement as err:
        hint = " (a local path is not taken: the nodes do not have your disk)" if "/" in line or "\\" in line else ""
        raise RequirementsError(where, line, f"not a requirement (PEP 508): {err}{hint}") from err
    if len(requirement.name) > MAX_NAME_CHARS:
        raise RequirementsError(where, line, f"a name of {len(requirement.name)} characters; at most {MAX_NAME_CHARS}")
    if requirement.url is not None:
        _check_url(where, line, requirement.url, URL_SCHEMES, f"the URL of {requirement.name}")
    return where, requirement
