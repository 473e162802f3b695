"""A job's own Python packages, declared with its code: a `requirements.txt` at the top of the
uploaded directory, or else the `[project] dependencies` of its `pyproject.toml`. The portal
checks them when the code is uploaded and the agent reads them again before it builds the job's
environment (agent.environments), with the same rules:

- one requirement a line (PEP 508: a name, extras, a version range, a marker); comments and
  blank lines are skipped, a trailing backslash continues a line;
- no option lines (`-e`, `-r`, `-c`, `--index-url`, `--find-links`, ...): packages come from the
  index or wheelhouse the node's operator configured, and an environment depends on nothing
  outside the requirements themselves. An operator may allow the index options (INDEX_OPTIONS:
  a lab's own index named by its users), on the portal and the agents alike;
- no local paths and no `name @ file:...`: the nodes do not have the user's disk (a
  `name @ https://...` or `git+https` reference is taken);
- a requirement on a package the node's runtime is built on (torch first, and whatever else the
  node has installed) must allow the node's version: the job's environment is layered over the
  node's, which it never changes.

No Django, no torch: the portal and the agent both use it."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

REQUIREMENTS_FILE = "requirements.txt"
PYPROJECT_FILE = "pyproject.toml"
INDEX_OPTIONS = frozenset({"--index-url", "-i", "--extra-index-url", "--find-links", "-f", "--no-index"})
"""Option lines an operator may allow (BUNGEE_ENV_INDEX_OPTIONS): where uv looks for packages."""
MAX_REQUIREMENTS = 500
"""More than this many lines is refused: an environment is a job's few extra packages."""


class RequirementsError(ValueError):
    """The declared requirements are not acceptable; the message names the file, the line and
    the text that is wrong (`where`: "requirements.txt line 3" or "pyproject.toml
    dependencies[2]")."""

    def __init__(self, where: str, text: str, reason: str) -> None:
        super().__init__(f"{where}: {text!r}: {reason}")
        self.where = where
        self.text = text
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


def declared_in(files: Mapping[str, bytes], index_options: bool = False) -> Declared | None:
    """The requirements among a code directory's top-level `files` (name -> content; only
    REQUIREMENTS_FILE and PYPROJECT_FILE are read), or None if it declares none (no such file,
    or a pyproject.toml without dependencies); `index_options`: the operator allows
    INDEX_OPTIONS lines. Raises RequirementsError."""
    if REQUIREMENTS_FILE in files:
        found, options = _parse_requirements_txt(files[REQUIREMENTS_FILE], index_options)
        return Declared(REQUIREMENTS_FILE, tuple(found), tuple(options))
    if PYPROJECT_FILE in files:
        found = _parse_pyproject(files[PYPROJECT_FILE])
        return Declared(PYPROJECT_FILE, tuple(found)) if found else None
    return None


def declared_in_directory(directory: Path, index_options: bool = False) -> Declared | None:
    """declared_in for an unpacked code directory. Raises RequirementsError."""
    files = {
        name: (directory / name).read_bytes()
        for name in (REQUIREMENTS_FILE, PYPROJECT_FILE)
        if (directory / name).is_file()
    }
    return declared_in(files, index_options)


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
    found: list[tuple[str, Requirement]] = []
    options: list[str] = []
    pending, first = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        line = "" if line.startswith("#") else line.split(" #", 1)[0].strip()
        if not pending:
            first = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = (pending + line).strip(), ""
        option = line.split()[0].split("=", 1)[0] if line else ""
        if index_options and option in INDEX_OPTIONS:
            options.append(line)
        elif line:
            found.append(_requirement(f"{REQUIREMENTS_FILE} line {first}", line))
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


def _requirement(where: str, line: str) -> tuple[str, Requirement]:
    if line.startswith("-"):
        option = line.split()[0].split("=", 1)[0]
        allowed = " unless the operator allows index options (BUNGEE_ENV_INDEX_OPTIONS)" if option in INDEX_OPTIONS else ""
        raise RequirementsError(
            where, line,
            f"option {option} is not taken in a job's requirements{allowed}: packages come from the index or "
            "wheelhouse the node's operator configured (docs/operator/environments.md), and each line is one "
            "requirement",
        )
    try:
        requirement = Requirement(line)
    except InvalidRequirement as err:
        hint = " (a local path is not taken: the nodes do not have your disk)" if "/" in line or "\\" in line else ""
        raise RequirementsError(where, line, f"not a requirement (PEP 508): {err}{hint}") from err
    if requirement.url is not None and requirement.url.lower().startswith(("file:", "git+file:")):
        raise RequirementsError(where, line, "a local path is not taken: the nodes do not have your disk")
    return where, requirement
