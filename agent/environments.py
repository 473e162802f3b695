"""Jobs' own Python environments on this node: built with uv from the requirements a job's code
declares (elastic.requirements), once per digest, cached, and shared by every worker that needs
one.

An environment is layered over the node's: a virtual environment of the node's interpreter
whose site-packages holds the job's packages and a `.pth` that appends the node's site
directories, so torch and the runtime are imported from the node and never installed again.
uv cannot see a layered environment's base (it only reads the environment's own site-packages),
so the build shows it the node's distributions: a small placeholder `.dist-info` per node
distribution while it resolves and installs, and a constraint pinning each to the node's
version. A requirement that would change a node package is then a resolver error, never a
reinstall; the placeholders are removed before the environment is used.

The digest covers the requirements, the node's interpreter and every distribution installed
there: a node whose packages change builds new environments.

State on disk, under `root` (one writer per digest, through a file lock):

    locks/<digest>.lock         flock'ed while the digest is built, checked or evicted
    tmp-<digest>-<random>/      a build under way; a leftover (the agent killed) is removed by
                                the next build of that digest, under the lock
    envs/<digest>/              a finished environment: it appears by rename(2), whole or not at
                                all; bungee-size holds its bytes, its mtime is its last use
    uv-cache/                   uv's download and build cache (unless UV_CACHE_DIR is set)

Eviction (after each build) removes least-recently used environments until the cache is under
its cap, never one in use: one a process of this machine runs from (its command line starts in
the environment), or one this agent handed out and has not launched yet (`hold`).

The build runs uv in a clean environment: the agent's token and a job's variables never reach
it (only PATH, HOME, locale, proxy, TLS and uv's or pip's index settings do), in a session of
its own, killed whole at the deadline."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from packaging.utils import canonicalize_name

from agent.isolation import JobIsolation, interpreter_paths, take_back
from elastic.requirements import Declared, RequirementsError, checked_again
from elastic.wire import OWN_PACKAGES_FILE, OwnPackages
from elastic.worker import confine as confine_module
from elastic.worker.confine import CONFINEMENT_ENV, Confinement

log = logging.getLogger(__name__)

DEFAULT_BUILD_DEADLINE_S = 900.0
DEFAULT_MAX_BYTES = 20 * 1024**3
PROGRESS_EVERY_S = 5.0
"""How often a build (or the wait for another's) says how long it has taken."""
SIZE_FILE = "bungee-size"
LOG_FILE = "bungee-build.log"
NODE_PTH = "_bungee_node.pth"
_PLACEHOLDER_INSTALLER = "bungee-node-placeholder"
_POLL_S = 0.1
TORCH_PACKAGES_DOC = "docs/operator/environments.md#packages-built-against-torch"
"""Where an operator reads how a package built against torch meets the node's torch build."""
_CHECKING = "bungee-import-check "
"""How the import check's lines start (the package's own output may come between them)."""

PASSED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
              "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy",
              "all_proxy", "NETRC", "XDG_CONFIG_HOME", "XDG_CACHE_HOME")
"""What of the agent's environment a build sees, beside UV_* (an operator's uv settings)."""
PIP_TO_UV = {"PIP_INDEX_URL": "UV_INDEX_URL", "PIP_EXTRA_INDEX_URL": "UV_EXTRA_INDEX_URL", "PIP_FIND_LINKS": "UV_FIND_LINKS"}
"""A node configured for pip gets the same index through uv (unless uv's own variable is set)."""

_PROBE = """
import importlib.metadata, json, os, site, sys, sysconfig
names = {}
for dist in importlib.metadata.distributions():
    name = dist.metadata["Name"]
    if name and name.lower() not in {n.lower() for n in names}:
        names[name] = dist.version
sites = list(site.getsitepackages())
if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
    sites.append(site.getusersitepackages())
print(json.dumps({
    "interpreter": [sys.version, sys.implementation.cache_tag, sysconfig.get_platform(), os.path.realpath(sys.executable)],
    "sites": sites,
    "purelib": os.path.relpath(sysconfig.get_path("purelib"), sys.prefix),
    "distributions": names,
}))
"""

_IMPORT_CHECK = """
import importlib, importlib.metadata, json, re, sys
site_packages = sys.argv[1]
say = lambda what, **told: print("%s%s %s" % (MARK, what, json.dumps(told)), flush=True)

def needs_torch(dist):
    for line in dist.requires or ():
        name, _, marker = line.partition(";")
        bare = re.match(r"[A-Za-z0-9._-]+", name.strip())
        if bare and re.sub(r"[-_.]+", "-", bare.group(0)).lower() == "torch" and "extra" not in marker:
            return True
    return False

def modules(dist):
    top = dist.read_text("top_level.txt")
    names = top.split() if top else []
    if not names:
        for path in dist.files or ():
            first = path.parts[0] if path.parts else ""
            if len(path.parts) > 1 and not first.endswith((".dist-info", ".data")) and first not in ("..", "__pycache__"):
                names.append(first)
            elif len(path.parts) == 1 and first.endswith((".py", ".so")):
                names.append(first.split(".", 1)[0])
    return sorted({name for name in names if name.isidentifier() and not name.startswith("_")})

installed = list(importlib.metadata.distributions(path=[site_packages]))
say("installed", packages={dist.metadata["Name"]: dist.version for dist in installed if dist.metadata["Name"]})
checked = [dist for dist in installed if needs_torch(dist)]
if checked:
    import torch
    say("torch", version=torch.__version__, cuda=torch.version.cuda)
for dist in checked:
    for module in modules(dist):
        say("importing", package=dist.metadata["Name"], version=dist.version, module=module)
        try:
            importlib.import_module(module)
        except BaseException as err:
            said = (str(err).strip().splitlines() or [""])[0][:500]
            say("failed", package=dist.metadata["Name"], version=dist.version, module=module,
                error=type(err).__name__ + (": " + said if said else ""))
            sys.exit(0)
say("passed")
"""
"""Run by an environment's interpreter once it is built: imports every module of each of the
environment's own distributions that requires torch (unconditionally), after the node's torch.
It says what it does on lines of its own, so that a crash names the package it was importing."""


class BuildFailed(Exception):  # noqa: N818 - a condition, reported as the job's failure
    """An environment could not be built. `output` is uv's (or the probe's) output; the message
    is its last line, or names the deadline and its setting."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


@dataclass(frozen=True)
class EnvironmentSettings:
    root: Path
    python: str
    """The node's interpreter, the one workers run: environments are layered over its packages."""
    uv: str = "uv"
    find_links: tuple[str, ...] = ()
    """Wheelhouses (directories or URLs) uv looks in beside the index (--find-links)."""
    build_deadline_s: float = DEFAULT_BUILD_DEADLINE_S
    deadline_setting: str = "--env-build-deadline (BUNGEE_ENV_BUILD_DEADLINE_S)"
    """Named in the message of a build that passed its deadline."""
    max_bytes: int = DEFAULT_MAX_BYTES
    index_options: bool = False
    """Jobs' requirements may hold elastic.requirements.INDEX_OPTIONS lines (the operator's choice)."""
    isolation: JobIsolation | None = None
    """Where jobs are confined, so are builds (agent.isolation): as the builder's uid, in a pid
    namespace of their own that ends with them; None: as the agent's user."""


@dataclass(frozen=True)
class NodeBase:
    """What a job's environment is layered over: the node's interpreter and its distributions."""

    interpreter: tuple[str, ...]
    sites: tuple[str, ...]
    purelib: str
    """The site-packages of an environment, relative to its top."""
    distributions: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Environment:
    digest: str
    path: Path
    built_s: float | None
    """Seconds this call spent building it; None: it was in the cache."""

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def own_packages(self) -> OwnPackages | None:
        """What the environment holds, as its build recorded it; None for one built before
        builds recorded it, or whose record cannot be read."""
        try:
            return OwnPackages.model_validate_json((self.path / OWN_PACKAGES_FILE).read_bytes())
        except (OSError, ValueError):
            return None


def uv_binary() -> str:
    """The uv that builds environments: the one the `uv` package installed beside the agent's
    interpreter, else the first on PATH."""
    try:
        from uv import find_uv_bin
    except ImportError:
        return shutil.which("uv") or "uv"
    try:
        return str(find_uv_bin())
    except FileNotFoundError:
        return shutil.which("uv") or "uv"


def build_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a build runs in: `environ`'s PATH, HOME, locale, proxy and TLS settings
    and uv's settings (pip's index settings as uv's), nothing else: no token, no job variable."""
    clean = {name: environ[name] for name in PASSED_ENV if name in environ}
    clean.update({name: value for name, value in environ.items() if name.startswith("UV_")})
    for pip_name, uv_name in PIP_TO_UV.items():
        if pip_name in environ and uv_name not in clean:
            clean[uv_name] = environ[pip_name]
    clean.setdefault("PATH", os.defpath)
    clean["UV_PYTHON_DOWNLOADS"] = "never"
    clean["UV_NO_PROGRESS"] = "1"
    return clean


class Environments:
    """The node's cache of jobs' environments. Thread-safe; `ensure` blocks while it builds."""

    def __init__(self, settings: EnvironmentSettings, environ: Mapping[str, str] | None = None) -> None:
        self.settings = settings
        self.root = settings.root
        self._environ = build_environment(os.environ if environ is None else environ)
        self._environ.setdefault("UV_CACHE_DIR", str(self.root / "uv-cache"))
        self._base: NodeBase | None = None
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()
        self._interpreters: Callable[[], Iterable[str]] = set
        """The interpreters of processes the machine's process list may not show by their command
        line yet (the agent's standbys, agent.spawn.WorkerSpawner.standby_interpreters)."""

    # --- what an environment is ------------------------------------------------------------

    def base(self) -> NodeBase:
        """The node's interpreter and distributions, read once from the node's interpreter.
        Raises BuildFailed."""
        with self._lock:
            if self._base is None:
                self._base = self._probe()
            return self._base

    def digest(self, declared: Declared) -> str:
        """The digest of the environment `declared` gets on this node. Raises BuildFailed."""
        base = self.base()
        key = {
            "layout": 2,
            "requirements": declared.lines(),
            "interpreter": list(base.interpreter),
            "sites": list(base.sites),
            "base": sorted(f"{canonicalize_name(n)}=={v}" for n, v in base.distributions.items()),
        }
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()

    def path(self, digest: str) -> Path:
        return self.root / "envs" / digest

    # --- using one ---------------------------------------------------------------------------

    def ensure(self, declared: Declared, progress: Callable[[float], None] | None = None) -> Environment:
        """The environment of `declared`: from the cache, or built now (one build per digest on
        this node, whatever the number of callers; the others wait for it). `progress` is called
        every PROGRESS_EVERY_S with the seconds spent so far. Raises BuildFailed, also for
        requirements the portal would refuse (elastic.requirements, checked again here: nothing
        reaches uv that the rules do not take, from the cache either)."""
        try:
            checked_again(declared, self.settings.index_options)
        except RequirementsError as err:
            raise BuildFailed(f"the job's requirements are refused: {err}") from err
        started = time.monotonic()
        digest = self.digest(declared)
        target = self.path(digest)
        with self._digest_lock(digest, lambda: progress(time.monotonic() - started) if progress else None):
            if target.is_dir():
                os.utime(target)
                return Environment(digest, target, None)
            self._build(declared, digest, target, started, progress)
        built = Environment(digest, target, time.monotonic() - started)
        with self.hold(digest):
            self.evict()
        return built

    @contextlib.contextmanager
    def hold(self, digest: str) -> Iterator[None]:
        """Keeps `digest` from eviction while the block runs (between `ensure` and the start of
        the process that will run from it)."""
        with self._lock:
            self._held[digest] += 1
        try:
            yield
        finally:
            with self._lock:
                self._held[digest] -= 1
                if not self._held[digest]:
                    del self._held[digest]

    def count_in_use(self, interpreters: Callable[[], Iterable[str]]) -> None:
        """Counts the environments whose interpreters `interpreters()` names as in use too: a
        standby started in a job's environment holds it from the moment it is asked for (its
        command line names the node's interpreter while it is confined, before it runs the
        environment's)."""
        self._interpreters = interpreters

    def in_use(self) -> set[str]:
        """The digests held, that a process of this machine runs from, or whose interpreter
        count_in_use's callable names."""
        envs = str(self.root / "envs") + os.sep
        commands = [process.info.get("cmdline") or [] for process in psutil.process_iter(["cmdline"])]
        used = set()
        for program in [command[0] for command in commands if command] + list(self._interpreters()):
            if program.startswith(envs):
                used.add(program[len(envs):].split(os.sep, 1)[0])
        with self._lock:
            return used | set(self._held)

    def evict(self) -> list[str]:
        """Removes least-recently used environments not in use until the cache holds at most
        `max_bytes`; returns their digests."""
        entries = []
        for path in (self.root / "envs").glob("*"):
            try:
                entries.append((path.stat().st_mtime, int((path / SIZE_FILE).read_text()), path))
            except (OSError, ValueError):
                continue
        total = sum(size for _, size, _ in entries)
        if total <= self.settings.max_bytes:
            return []
        used = self.in_use()
        evicted = []
        for _, size, path in sorted(entries):
            if total <= self.settings.max_bytes:
                break
            if path.name in used:
                continue
            with self._digest_lock(path.name, None, wait=False) as locked:
                if not locked or not path.is_dir():
                    continue
                doomed = self.root / f"evicted-{path.name}-{uuid.uuid4().hex[:8]}"
                os.rename(path, doomed)
            shutil.rmtree(doomed, ignore_errors=True)
            total -= size
            evicted.append(path.name)
            log.info("evicted environment %s (%d bytes): the cache holds over %d bytes", path.name, size,
                     self.settings.max_bytes)
        return evicted

    # --- building ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _digest_lock(self, digest: str, waiting: Callable[[], object] | None, wait: bool = True) -> Iterator[bool]:
        """Holds `digest`'s file lock (an flock: across the agent's threads and any process on the
        same root); `waiting` is called every PROGRESS_EVERY_S while another holds it. With
        wait=False, yields False at once if it is taken."""
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{digest}.lock", "a+b") as handle:
            said = time.monotonic()
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if not wait:
                        yield False
                        return
                    time.sleep(_POLL_S)
                    if waiting is not None and time.monotonic() - said >= PROGRESS_EVERY_S:
                        said = time.monotonic()
                        waiting()
            try:
                yield True
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _build(
        self, declared: Declared, digest: str, target: Path, started: float, progress: Callable[[float], None] | None
    ) -> None:
        """Builds `declared` in a temporary directory and renames it to `target`. Call under
        `digest`'s lock. Raises BuildFailed."""
        for leftover in self.root.glob(f"tmp-{digest}-*"):
            log.info("removing %s, a build of %s that did not finish", leftover.name, digest)
            shutil.rmtree(leftover, ignore_errors=True)
        base = self.base()
        building = self.root / f"tmp-{digest}-{uuid.uuid4().hex[:8]}"
        log.info("building environment %s: %s", digest, ", ".join(declared.lines()))
        try:
            confinement = self._confinement(building)
            output = self._run([self.settings.uv, "venv", "--relocatable", "--python", self.settings.python,
                                str(building)], started, progress, confinement)
            site_packages = building / base.purelib
            placeholders = self._show_base(site_packages, base)
            (building / "bungee-requirements.txt").write_text("\n".join(declared.lines()) + "\n")
            (building / "bungee-constraints.txt").write_text(
                "\n".join(f"{name}=={version}" for name, version in sorted(base.distributions.items())) + "\n"
            )
            install = [self.settings.uv, "pip", "install", "--python", str(building / "bin" / "python"),
                       "-r", str(building / "bungee-requirements.txt"),
                       "--constraint", str(building / "bungee-constraints.txt")]
            for wheelhouse in self.settings.find_links:
                install += ["--find-links", wheelhouse]
            output += self._run(install, started, progress, confinement)
            if confinement is not None:
                take_back(building)  # before it is used: no job's process may change it
            for placeholder in placeholders:
                shutil.rmtree(placeholder)
            (site_packages / NODE_PTH).write_text(
                "".join(f"import site; site.addsitedir({directory!r})\n" for directory in base.sites)
            )
            output, installed = self._check_imports(building, site_packages, started, progress, confinement)
            (building / OWN_PACKAGES_FILE).write_text(
                OwnPackages.fitted(digest, declared.source, declared.lines(), installed).model_dump_json()
            )
            (building / LOG_FILE).write_text(output)
            (building / SIZE_FILE).write_text(str(_size(building)))
            target.parent.mkdir(parents=True, exist_ok=True)
            os.rename(building, target)
        finally:
            shutil.rmtree(building, ignore_errors=True)
        log.info("built environment %s in %.1f s", digest, time.monotonic() - started)

    def _check_imports(
        self, building: Path, site_packages: Path, started: float, progress: Callable[[float], None] | None,
        confinement: Confinement | None,
    ) -> tuple[str, dict[str, str]]:
        """Imports, in the environment built in `building` and confined as its build, the modules
        of its distributions that require torch (_IMPORT_CHECK); returns the check's output and
        the environment's own distributions (name -> version). A package built for another torch
        installs and resolves but fails here, and not in the job's first worker. Raises
        BuildFailed naming the package and the node's torch build, or the package whose import
        was under way at the build's deadline."""
        check = [str(building / "bin" / "python"), "-I", "-c", f"MARK = {_CHECKING!r}\n{_IMPORT_CHECK}", str(site_packages)]
        torch_build = "this node's torch"
        try:
            output = self._run(check, started, progress, confinement)
        except BuildFailed as err:
            output, crashed = err.output, str(err)
            past_deadline = time.monotonic() >= started + self.settings.build_deadline_s
        else:
            crashed, past_deadline = "", False
        said: dict[str, dict[str, Any]] = {}
        for line in output.splitlines():
            if line.startswith(_CHECKING):
                what, _, told = line.removeprefix(_CHECKING).partition(" ")
                with contextlib.suppress(ValueError):
                    if isinstance(found := json.loads(told), dict):
                        said[what] = found
        if past_deadline:
            importing = said.get("importing")
            raise BuildFailed(crashed + (
                f", importing package {importing.get('package')} {importing.get('version')} (import "
                f"{importing.get('module')}) beside this node's torch" if importing else ""
            ), output)
        if "torch" in said:
            version, cuda = said["torch"].get("version"), said["torch"].get("cuda")
            torch_build = f"this node's torch {version} ({f'CUDA {cuda}' if cuda else 'CPU'} build)"
        if "passed" in said and not crashed:
            packages = said.get("installed", {}).get("packages")
            packages = packages if isinstance(packages, dict) else {}
            return output, {str(name): str(version) for name, version in packages.items()}
        if "failed" in said:
            failed = said["failed"]
            error = failed.get("error")
        elif "importing" in said:
            last = [line for line in output.splitlines() if line.strip() and not line.startswith(_CHECKING)]
            failed, error = said["importing"], f"an error that ended the interpreter ({(last or [crashed])[-1][:500]})"
        else:
            raise BuildFailed(f"the environment's interpreter failed before it imported any package: {crashed}",
                              output)
        raise BuildFailed(
            f"package {failed.get('package')} {failed.get('version')} installed but does not import beside "
            f"{torch_build}: import {failed.get('module')} raised {error}. It was built for another torch: "
            "take a build made for the node's torch from a wheelhouse that holds it (the agent's --env-find-links, "
            "BUNGEE_ENV_FIND_LINKS) or an index that serves it (the agent's UV_INDEX_URL or UV_EXTRA_INDEX_URL; "
            "or a line --extra-index-url in the job's requirements.txt, where the operator allows index options: "
            f"--env-index-options, BUNGEE_ENV_INDEX_OPTIONS); see {TORCH_PACKAGES_DOC}",
            output,
        )

    def _show_base(self, site_packages: Path, base: NodeBase) -> list[Path]:
        """Writes a placeholder .dist-info for each node distribution into `site_packages`, so
        that uv counts it as installed; returns them."""
        made = []
        for name, version in base.distributions.items():
            directory = site_packages / f"{canonicalize_name(name).replace('-', '_')}-{version}.dist-info"
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
            (directory / "INSTALLER").write_text(_PLACEHOLDER_INSTALLER + "\n")
            made.append(directory)
        return made

    def _confinement(self, building: Path) -> Confinement | None:
        """The confinement of a build into `building`, where builds are confined (its
        directories made); None where they are not. Raises BuildFailed."""
        isolation = self.settings.isolation
        if isolation is None:
            return None
        reach = {*interpreter_paths(self.settings.python), str(Path(self.settings.uv).resolve().parent),
                 *(link for link in self.settings.find_links if "://" not in link)}
        try:
            return isolation.build_confinement(self.root, building, [Path(self._environ["UV_CACHE_DIR"])], reach)
        except OSError as err:
            raise BuildFailed(f"cannot make the build's directories: {err}") from err

    def _run(
        self, argv: list[str], started: float, progress: Callable[[float], None] | None,
        confinement: Confinement | None = None,
    ) -> str:
        """Runs `argv` in the clean environment, in a session of its own (confined in a pid
        namespace of its own, if `confinement`: whatever it leaves behind ends with it); returns
        its output. Raises BuildFailed (its last line) if it fails, or kills it at the build's
        deadline."""
        deadline = started + self.settings.build_deadline_s
        env = self._environ
        if confinement is not None:
            env = {**env, CONFINEMENT_ENV: confinement.to_json()}
            argv = ["unshare", "--pid", "--fork", "--kill-child", sys.executable, "-I", "-S",
                    str(confine_module.__file__), "--", *argv]
        try:
            process = subprocess.Popen(
                argv, env=env, cwd=self.root, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        except OSError as err:
            raise BuildFailed(f"cannot run {argv[0]!r}: {err.strerror}") from err
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(process.stdout.read() if process.stdout else b""),
                                  daemon=True)
        reader.start()
        said = time.monotonic()
        while True:
            try:
                process.wait(timeout=min(PROGRESS_EVERY_S, max(0.0, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now >= deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    reader.join()
                    raise BuildFailed(
                        f"building the environment took over {self.settings.build_deadline_s:.0f} s, its deadline "
                        f"({self.settings.deadline_setting}); it was stopped", b"".join(chunks).decode(errors="replace"),
                    ) from None
                if progress is not None and now - said >= PROGRESS_EVERY_S:
                    said = now
                    progress(now - started)
        reader.join()
        output = b"".join(chunks).decode(errors="replace")
        if process.returncode != 0:
            raise BuildFailed(summary(output) or f"{argv[0]} exited with code {process.returncode}", output)
        return output

    def _probe(self) -> NodeBase:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            done = subprocess.run([self.settings.python, "-c", _PROBE], env=self._environ, cwd=self.root,
                                  capture_output=True, text=True, timeout=60, check=True)
            found = json.loads(done.stdout)
        except (OSError, subprocess.SubprocessError, ValueError) as err:
            raise BuildFailed(f"cannot read the node's environment from {self.settings.python}: {err}") from err
        return NodeBase(tuple(found["interpreter"]), tuple(found["sites"]), found["purelib"], found["distributions"])


def summary(output: str) -> str:
    """The line of uv's `output` that says what went wrong: its error and the cause it gives
    ("No solution found when resolving dependencies: Because ..."), else its last line that is
    not a hint."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if line.startswith("error:"):
            said = line.removeprefix("error:").strip().rstrip(":")
            cause = lines[index + 1] if index + 1 < len(lines) else ""
            for mark in ("cause:", "Caused by:", "╰─▶"):
                if cause.startswith(mark):
                    return f"{said}: {cause.removeprefix(mark).strip()}"
            return said
    told = [line for line in lines if not line.startswith("hint:")]
    return told[-1] if told else ""


def _size(directory: Path) -> int:
    total = 0
    for parent, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(parent, name)).st_size
    return total
