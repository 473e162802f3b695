"""`bungee`: the platform from a terminal, over the portal's API (typer for the commands, rich
for tables and progress bars).

    bungee login http://portal:8000            # asks for an API token; keeps both, mode 0600
    bungee submit job.yaml --code ./mytask --follow   # the spec checked first; .bungeeignore applied here
    bungee list | status N | logs N -f | resize N K | unpin N | cancel N | download N
    bungee node list | node drain NAME [--deadline S]     # staff: a node leaves gracefully

Every command takes `--output json` (machine-readable, one JSON document). Exit codes: 0 done,
1 refused or failed (a 4xx names the field and the value), 2 wrong usage; `submit --follow`
exits 0 when the job succeeds and 1 when it fails or is cancelled, as `ray job submit` does.
"""

from __future__ import annotations

import getpass
import hashlib
import io
import json
import sys
import time
from collections.abc import Callable
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table

from bungee_cli.client import CliError, Login, Portal, describe_error
from elastic.codepack import (
    LEAVE_OUT_ADVICE,
    ArchiveError,
    EntrypointError,
    Packed,
    check_entrypoint,
    pack_directory,
)

app = typer.Typer(
    help="Bungee: elastic training jobs on a shared GPU cluster, from a terminal.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # paragraphs reflowed (rich mode keeps a docstring's line breaks)
)
out = Console()
err = Console(stderr=True)

FINAL_STATES = {"succeeded", "failed", "cancelled"}
TRAINING_STATES = {"running", "resizing"}
FOLLOW_EVERY_S = 1.0
PROGRESS_EVERY_S = 10.0
"""--follow's default pace of progress lines: often enough to see a job move, rarely enough to
leave its log lines readable."""
PROGRESS_KEYS = ("steps_done", "total_steps", "last_loss", "samples_per_s", "workers")
CHUNK = 1 << 16
ARTIFACTS_WAIT_S = 120.0
"""How long `download` waits, by default, for an ended job's files to reach the portal: rank 0's
agent uploads them after the job's last step, and the job may be reported ended before the
upload is done (seconds for a large model)."""
ARTIFACTS_EVERY_S = 1.0
PACK_LIMIT = 1 << 62
"""The CLI packs whatever the directory holds (less its .bungeeignore); the portal's limits apply."""
TOKEN_PROMPT = "Token: "


class Output(StrEnum):
    TEXT = "text"
    JSON = "json"


OutputOption = Annotated[Output, typer.Option("--output", "-o", help="text (tables) or json")]
JobId = Annotated[int, typer.Argument(help="the job's number", min=1)]


def _portal() -> Portal:
    return Portal(Login.load())


def _emit(output: Output, value: Any, text: Any = None) -> None:
    """`value` as JSON, or `text` (rich markup: a text that holds what a user or a job wrote,
    a job's name, its log, a path, goes through `escape`, or a `[/...]` in it breaks the print)."""
    if output is Output.JSON:
        out.print_json(json.dumps(value, default=str))
    else:
        out.print(text if text is not None else value)


@app.command()
def login(
    url: Annotated[str, typer.Argument(help="the portal's address, e.g. http://portal:8000")],
    token: Annotated[str | None, typer.Option(help="an API token (asked if not given)")] = None,
    output: OutputOption = Output.TEXT,
) -> None:
    """Keep the portal's URL and your API token in your config directory (mode 0600)."""
    credentials = Login(url.rstrip("/"), (token if token is not None else _ask_token()).strip())
    Portal(credentials).get("/api/jobs", owner=None, state="running")  # a refused token stops here
    path = credentials.save()
    _emit(output, {"url": credentials.url, "config": str(path)}, escape(f"logged in to {credentials.url} ({path})"))


def _ask_token() -> str:
    """The token, asked as "Token: " on the terminal without echo; read from standard input
    when that is no terminal (`echo $TOKEN | bungee login URL`), with the prompt on stderr."""
    if sys.stdin.isatty():
        return getpass.getpass(TOKEN_PROMPT)
    err.file.write(TOKEN_PROMPT)
    err.file.flush()
    return sys.stdin.readline()


def _pack(directory: Path) -> tuple[bytes, Packed]:
    """The directory as the portal would store it: its canonical tar.gz, in memory, and its
    digest. Its `.bungeeignore` applies here, before packing, so an ignored file never travels."""
    if not directory.is_dir():
        raise CliError(f"--code {directory}: not a directory", exit_code=2)
    buffer = io.BytesIO()
    try:
        packed = pack_directory(directory, buffer, max_unpacked_bytes=PACK_LIMIT, max_files=PACK_LIMIT)
    except ArchiveError as error:
        raise CliError(f"--code {directory}: {error}; {LEAVE_OUT_ADVICE}") from None
    return buffer.getvalue(), packed


LARGEST_SHOWN = 5
"""How many of its largest files a refusal of code too big to upload names."""


def _size(count: int) -> str:
    """Bytes for people: 1.1 MiB, 195.3 KiB, 14 bytes."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} bytes"


def _check_fits(directory: Path, archive_size: int, packed: Packed, limits: dict[str, int]) -> None:
    """Raises CliError, before anything is sent, if the packed code passes a limit the portal gave
    (`limits`: the dry run's code_limits), naming the directory's largest files and how to leave
    files out."""
    members = len(packed.files) + len({str(parent) for name in packed.files for parent in Path(name).parents} - {"."})
    passed = [
        f"it {what} {shown(have)}; the portal takes at most {shown(limit)} ({setting})"
        for what, have, limit, setting, shown in (
            ("packs to", archive_size, limits["max_bytes"], "BUNGEE_CODE_MAX_BYTES", _size),
            ("unpacks to", packed.unpacked_bytes, limits["max_unpacked_bytes"], "BUNGEE_CODE_MAX_UNPACKED_BYTES", _size),
            ("holds", members, limits["max_files"], "BUNGEE_CODE_MAX_FILES", "{} files and directories".format),
        )
        if have > limit
    ]
    if not passed:
        return
    sizes = sorted(((directory / name).stat().st_size, name) for name in packed.files)[::-1][:LARGEST_SHOWN]
    largest = ", ".join(f"{name} ({_size(size)})" for size, name in sizes)
    raise CliError(f"--code {directory} is too big to upload: {'; '.join(passed)}. Its largest files: {largest}; "
                   f"{LEAVE_OUT_ADVICE}")


def _upload(portal: Portal, archive: bytes, name: str, quiet: bool) -> dict[str, Any]:
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=err, disable=quiet, transient=True,
    ) as progress:  # fmt: skip
        task = progress.add_task(f"uploading {name}", total=len(archive))

        class Counted(io.BytesIO):
            def read(self, size: int | None = -1) -> bytes:
                chunk = super().read(CHUNK if size is None or size < 0 else min(size, CHUNK))
                progress.advance(task, len(chunk))
                return chunk

        uploaded: dict[str, Any] = portal.request(
            "POST", "/api/code", files={"file": (name, Counted(archive))}
        )
    return uploaded


def _read_spec(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as error:
        raise CliError(f"cannot read {path}: {error}", exit_code=2) from None
    try:
        spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise CliError(
            f"{path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: {error}", exit_code=2
        ) from None
    if not isinstance(spec, dict):
        raise CliError(f"{path} must hold a mapping (the job's spec), not {type(spec).__name__}", exit_code=2)
    return spec


ProgressEvery = Annotated[
    float, typer.Option(min=0.1, help="with --follow: seconds between progress lines (step, loss, throughput, workers)")
]


@app.command()
def submit(
    spec_file: Annotated[Path, typer.Argument(help="the job's spec, YAML or JSON (every field: docs/reference/spec.md)")],
    code: Annotated[
        Path | None, typer.Option(help="a directory of your own code: uploaded, and the spec's `code`")
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="stream logs, progress and resizes until the job ends")
    ] = False,
    progress_every: ProgressEvery = PROGRESS_EVERY_S,
    output: OutputOption = Output.TEXT,
) -> None:
    """Submit a job; print its number and page.

    The spec is checked (POST /api/jobs/validate) before any code is uploaded, and code the
    portal already holds is not sent again."""
    portal = _portal()
    spec = _read_spec(spec_file)
    archive = None
    if code is not None:
        archive, packed = _pack(code)
        spec["code"] = packed.digest
    checked = portal.post("/api/jobs/validate", spec)  # a bad spec stops here: nothing uploaded
    if code is not None and archive is not None and not checked["code_uploaded"]:
        if checked.get("code_limits"):  # a portal that does not say them refuses code over them itself
            _check_fits(code, len(archive), packed, checked["code_limits"])
        _check_entrypoint(archive, spec)
        uploaded = _upload(portal, archive, f"{code.resolve().name}.tar.gz", quiet=output is Output.JSON)
        spec["code"] = uploaded["digest"]
        if output is Output.TEXT:
            err.print(escape(f"uploaded {code} as {uploaded['digest'][:12]} ({len(uploaded['files'])} files)"))
    job = portal.post("/api/jobs", spec)
    page = f"{portal.url}/jobs/{job['id']}/"
    _emit(output, {**job, "url": page}, escape(f"submitted job {job['id']} ({job['name']}): {page}"))
    if follow:
        raise typer.Exit(_follow(portal, job["id"], output, progress_every))


def _check_entrypoint(archive: bytes, spec: dict[str, Any]) -> None:
    """Raises CliError, as the portal would refuse it, if the spec's entrypoint names a module
    or class the packed code lacks (read statically, never run)."""
    entrypoint = spec.get("entrypoint")
    if not isinstance(entrypoint, str) or ":" not in entrypoint:
        return  # the portal's validation names what is wrong with it
    try:
        check_entrypoint(io.BytesIO(archive), entrypoint)
    except EntrypointError as error:
        raise CliError(f"the job spec's entrypoint points at nothing in --code: {error}") from None


def _follow(
    portal: Portal, job_id: int, output: Output, progress_every: float = PROGRESS_EVERY_S,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Prints the job's log lines (each prefixed with its generation and rank, as the job page
    shows them), each change of state or size, and while it trains a progress line at most
    every `progress_every` seconds, until it ends; returns the exit code (0 succeeded, 1
    otherwise). Logs are the job's, so they go on across resizes and restarts of its workers."""
    after, shown, progress_due, progress_step = 0, None, clock(), 0
    while True:
        for line in portal.get(f"/api/jobs/{job_id}/logs", after=after):
            after = line["id"]
            _emit(output, line, f"[dim]{line['at'][11:19]}[/dim] {escape(_log_text(line))}")
        job = portal.get(f"/api/jobs/{job_id}")
        now = (job["state"], job["workers"], job["generation"])
        if now != shown:
            shown = now
            text = _follow_line(job)
            _emit(output, {"job": job_id, "state": job["state"], "workers": job["workers"],
                           "generation": job["generation"], "steps_done": job["steps_done"]}, f"[bold]{escape(text)}[/bold]")  # fmt: skip
        if job["state"] in FINAL_STATES:
            return 0 if job["state"] == "succeeded" else 1
        if job["state"] in TRAINING_STATES and clock() >= progress_due and job["steps_done"] != progress_step:
            progress_due, progress_step = clock() + progress_every, job["steps_done"]
            _emit(output, {"job": job_id, "progress": {key: job.get(key) for key in PROGRESS_KEYS}},
                  escape(progress_line(job)))
        sleep(FOLLOW_EVERY_S)


def _follow_line(job: dict[str, Any]) -> str:
    """One line for a change of the job's state or size; an ended job says where it stopped and,
    unless it succeeded, why."""
    if job["state"] in FINAL_STATES:
        why = f": {job['message']}" if job["state"] != "succeeded" and job.get("message") else ""
        return f"job {job['id']}: {job['state']} at step {job['steps_done']} of {job['total_steps']}{why}"
    workers = f"{job['workers']} worker{'' if job['workers'] == 1 else 's'}"
    return f"job {job['id']}: {job['state']} on {workers} (generation {job['generation']}), step {job['steps_done']}"


def _log_text(line: dict[str, Any]) -> str:
    """A log line as the job page shows it: [generation.rank] text."""
    return f"[{line['generation']}.{line['rank']}] {line['line']}"


def progress_line(job: dict[str, Any]) -> str:
    """Where a training job stands, in one line: step of steps, loss, throughput, workers."""
    parts = [f"step {job['steps_done']}/{job['total_steps']}"]
    if job.get("total_steps"):
        parts[0] += f" ({job['steps_done'] / job['total_steps']:.0%})"
    if job.get("last_loss") is not None:
        parts.append(f"loss {job['last_loss']:.4f}")
    if job.get("samples_per_s"):
        parts.append(f"{job['samples_per_s']:,.0f} samples/s")
    parts.append(f"{job['workers']} worker{'' if job['workers'] == 1 else 's'}")
    return f"job {job['id']}: " + ", ".join(parts)


@app.command("list")
def list_jobs(
    owner: Annotated[str | None, typer.Option(help="only this user's jobs")] = None,
    state: Annotated[str | None, typer.Option(help="only jobs in this state")] = None,
    limit: Annotated[int, typer.Option(min=1, help="at most this many jobs, newest first")] = 100,
    output: OutputOption = Output.TEXT,
) -> None:
    """Everyone's jobs, newest first (as squeue shows them)."""
    _list(owner, state, limit, output)


def _why(job: dict[str, Any]) -> str:
    """A list's "why" for a job: why it ended (a failed or cancelled job of yours), else the
    scheduler's note."""
    return str(job.get("reason") or job.get("schedule_note") or "")


def _list(owner: str | None, state: str | None, limit: int, output: Output) -> None:
    jobs, total = _portal().listing("/api/jobs", limit, owner=owner, state=state)
    table = Table("id", "name", "owner", "state", "workers", "steps", "why", box=None)
    for job in jobs:
        cells = (job["id"], job["name"], job["owner"], job["state"],
                 f"{job['workers']} of {job['min_workers']}-{job['max_workers']}",
                 f"{job['steps_done']}/{job['total_steps']}", _why(job))  # fmt: skip
        table.add_row(*(escape(str(cell)) for cell in cells))
    if len(jobs) < total:
        table.caption = f"the newest {len(jobs)} of {total} jobs; --limit shows more"
    _emit(output, jobs, table if jobs else "no jobs")


STATUS_ROWS = ("id", "name", "owner", "state", "workers", "pinned_workers", "generation", "steps_done", "total_steps",
               "last_loss", "samples_per_s", "attained_service_s", "restarts", "reason", "message", "schedule_note")


def seconds(value: float) -> str:
    """A duration for people: 42.6 s, 12 min 5 s, 3 h 20 min."""
    if value < 60:
        return f"{value:.1f} s"
    if value < 3600:
        return f"{value // 60:.0f} min {value % 60:.0f} s"
    return f"{value // 3600:.0f} h {value % 3600 // 60:.0f} min"


def rate(value: float) -> str:
    """A rate for people: three significant digits below 100, whole numbers above (thousands grouped)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


STATUS_FORMATS: dict[str, Callable[[Any], str]] = {
    "last_loss": lambda value: f"{value:.4g}",
    "samples_per_s": lambda value: f"{rate(value)} samples/s",
    "attained_service_s": seconds,
}
"""How `status` shows a number that is no count: a loss with 4 significant digits, a rate, seconds."""


def status_cell(key: str, value: Any) -> str:
    """One value of `status`'s table as text (empty for none)."""
    if value is None:
        return ""
    if key in STATUS_FORMATS and isinstance(value, (int, float)):
        return STATUS_FORMATS[key](value)
    return str(value)


OptionalJobId = Annotated[int | None, typer.Argument(help="the job's number; none: the newest jobs, as `list`", min=1)]


@app.command()
def status(job_id: OptionalJobId = None, output: OutputOption = Output.TEXT) -> None:
    """One job: state, size, progress, the scheduler's reason, why it ended; without a job, the
    newest jobs as `list` shows them."""
    if job_id is None:
        _list(None, None, 100, output)
        return
    job = _portal().get(f"/api/jobs/{job_id}")
    table = Table(show_header=False, box=None)
    for key in STATUS_ROWS:
        table.add_row(key, escape(status_cell(key, job.get(key))))
    for key, value in [*standing(job), *own_packages_rows(job)]:
        table.add_row(key, escape(value))
    _emit(output, job, table)


def own_packages_rows(job: dict[str, Any]) -> list[tuple[str, str]]:
    """The job's own packages, if it has them: its requirements as given, where its environment
    was built, and every package installed in it with its version."""
    own = job.get("own_packages")
    if not own:
        return []
    left_out = f"; {own['left_out']} left out for their size" if own.get("left_out") else ""
    return [
        ("own packages", f"{', '.join(own['requirements'])} (from {own['source']}; environment "
                         f"{own['digest'][:12]} on {own['node']}{left_out})"),
        ("installed", ", ".join(f"{name}=={version}" for name, version in own["packages"].items())),
    ]


def _in(unix_time: float) -> str:
    seconds = max(0.0, unix_time - time.time())
    return f"about {seconds:.0f} s" if seconds < 120 else f"about {seconds / 60:.0f} min" if seconds < 7200 \
        else f"about {seconds / 3600:.1f} h"


def standing(job: dict[str, Any]) -> list[tuple[str, str]]:
    """Where the job stands, as the board says it: progress and ETA, or its place in the queue,
    its estimated start and the jobs it waits for."""
    rows = []
    if job.get("progress") is not None and job["state"] in ("running", "resizing"):
        eta = f", {_in(job['finish_estimate_at'])} left" if job.get("finish_estimate_at") else ""
        rows.append(("progress", f"{job['progress']:.0%}{eta}"))
    queue = job.get("queue") or {}
    if queue.get("position"):
        start = f"starts in {_in(queue['start_estimate_at'])}" if queue.get("start_estimate_at") else \
            f"no start estimate: {queue.get('no_estimate')}"
        rows.append(("queue", f"{queue['position']} of {queue['waiting']} waiting; {start}"))
        for holder in queue.get("holders", []):
            ends = f"ends in {_in(holder['finish_estimate_at'])}" if holder.get("finish_estimate_at") else "end not known"
            pinned = ", pinned" if holder["pinned"] else ""
            rows.append(("waits for", f"#{holder['id']} {holder['name']} ({holder['owner']}, "
                                       f"{holder['devices']} devices{pinned}, {ends})"))
    return rows


@app.command()
def logs(
    job_id: JobId,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="keep following until the job ends")] = False,
    progress_every: ProgressEvery = PROGRESS_EVERY_S,
    output: OutputOption = Output.TEXT,
) -> None:
    r"""A job's log lines, each prefixed with \[generation.rank].

    With -f, new ones as they come,
    across resizes and restarts, and a progress line every --progress-every seconds."""
    portal = _portal()
    if follow:
        raise typer.Exit(_follow(portal, job_id, output, progress_every))
    lines = portal.get(f"/api/jobs/{job_id}/logs")
    _emit(
        output,
        lines,
        escape("\n".join(f"{line['at'][11:19]} {_log_text(line)}" for line in lines)) or "no log lines yet",
    )


@app.command()
def resize(
    job_id: JobId,
    workers: Annotated[int, typer.Argument(help="the worker count to pin the job to", min=1)],
    output: OutputOption = Output.TEXT,
) -> None:
    """Pin a job to a worker count (the scheduler keeps it there until `unpin`)."""
    job = _portal().post(f"/api/jobs/{job_id}/resize", {"workers": workers})
    _emit(output, job, f"job {job_id} pinned to {workers} worker{'s' if workers != 1 else ''}")


@app.command()
def unpin(job_id: JobId, output: OutputOption = Output.TEXT) -> None:
    """Lift a job's pin: the scheduler sizes it again."""
    job = _portal().post(f"/api/jobs/{job_id}/unpin")
    _emit(output, job, f"job {job_id}: pin lifted")


@app.command()
def cancel(job_id: JobId, output: OutputOption = Output.TEXT) -> None:
    """Cancel a queued or running job."""
    job = _portal().post(f"/api/jobs/{job_id}/cancel")
    _emit(output, job, f"job {job_id}: {job['state']}")


def download_target(job_id: int, name: str, output_dir: Path | None) -> Path:
    """Where a downloaded file goes: under its own name in the directory asked for (-d), else
    in the current directory named after its job (job-7-model.pt), beside other jobs' files."""
    return output_dir / name if output_dir is not None else Path(f"job-{job_id}-{name}")


def artifacts_listing(
    portal: Portal, job_id: int, wait_s: float, clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Any:
    """The job's artifacts as the API lists them. A job that has not ended has none yet, refused at
    once, or those of an earlier stop (a drain, the node stopped), given with a line saying so. An
    ended job's may still be on their way (its rank 0's agent uploads them once the
    job's last step is done, and the job can be reported ended first): asked again every
    ARTIFACTS_EVERY_S for up to `wait_s` seconds, then refused with what to look at."""
    deadline = clock() + wait_s
    told = False
    while True:
        job = portal.get(f"/api/jobs/{job_id}")
        state, kept = job["state"], job.get("artifacts")
        if kept:
            if state not in FINAL_STATES:  # files of an earlier stop: say so, they are not its last
                err.print(escape(f"job {job_id} is {state}: these files are of step {kept['step']}, when it "
                                 f"{kept['ended']}; its last ones come when it ends"))  # fmt: skip
            return portal.get(f"/api/jobs/{job_id}/artifacts")
        if state not in FINAL_STATES:
            raise CliError(f"job {job_id} is {state}: its files come when it ends (`bungee logs -f {job_id}` follows it)")
        if clock() >= deadline:
            raise CliError(
                f"job {job_id} {state}, but its files did not reach the portal within {wait_s:g} s: its rank 0's "
                "agent uploads them after the last step (its log says why they did not come); a job that "
                "trained no step, or whose files passed their retention, has none"
            )
        if not told:
            err.print(f"job {job_id} {state}; waiting up to {wait_s:g} s for its files to reach the portal")
            told = True
        sleep(ARTIFACTS_EVERY_S)


LOCK_NAME = "requirements.lock"


def lock_text(job_id: int, manifest: Any) -> str | None:
    """The requirements.lock of a job that had packages of its own, from its manifest: a line
    `name==version` for each package its environment held (after the index lines the job gave),
    below comments saying which Python and torch build they went with (the node's, not in the
    lock) and the requirements as given; None for a job without own packages (or a manifest
    that does not say)."""
    environment = manifest.get("environment") if isinstance(manifest, dict) else None
    if not isinstance(environment, dict) or not isinstance(own := environment.get("own_packages"), dict):
        return None
    cuda = environment.get("torch_cuda")
    python = " ".join(str(environment.get("python", "")).split()[:1])
    lines = [
        f"# The packages of job {job_id}'s own environment ({str(own.get('digest', ''))[:12]}), pinned.",
        f"# They ran beside the node's Python {python} and torch {environment.get('torch')} "
        f"({f'CUDA {cuda}' if cuda else 'CPU'} build), which this file does not install.",
        "# Rebuild: a virtual environment of that Python with that torch, then",
        "#   pip install -r requirements.lock",
        f"# The job's requirements, as given in its {own.get('source')}:",
        *(f"#   {line}" for line in own.get("requirements", [])),
    ]
    if own.get("left_out"):
        lines.append(f"# Incomplete: {own['left_out']} requirements and packages were left out for their size.")
    lines += [line for line in own.get("requirements", []) if line.startswith("-")]  # the job's index lines
    lines += [f"{name}=={version}" for name, version in sorted(own.get("packages", {}).items())]
    return "\n".join(lines) + "\n"


@app.command()
def download(
    job_id: JobId,
    output_dir: Annotated[
        Path | None, typer.Option("--output-dir", "-d", help="where the files go, under their own names "
                                  "(model.pt, checkpoint.pt, manifest.json); default: here, as job-N-NAME")
    ] = None,
    wait: Annotated[
        float, typer.Option(help="seconds to wait for an ended job's files still on their way to the portal", min=0)
    ] = ARTIFACTS_WAIT_S,
    output: OutputOption = Output.TEXT,
) -> None:
    """Fetch a finished job's model, checkpoint and manifest; checks each file's sha256.

    A job that had packages of its own also gets a requirements.lock beside them: the packages
    pinned, to build its environment again."""
    portal = _portal()
    listed = artifacts_listing(portal, job_id, wait)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
    saved = []
    with Progress(
        "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
        console=err, disable=output is Output.JSON,
    ) as progress:  # fmt: skip
        for entry in listed["files"]:
            target = download_target(job_id, entry["name"], output_dir)
            task = progress.add_task(entry["name"], total=entry.get("size"))
            digest = hashlib.sha256()
            partial = target.with_suffix(target.suffix + ".part")
            with portal.download(entry["url"]) as reply, partial.open("wb") as file:
                for chunk in reply.iter_bytes(CHUNK):
                    file.write(chunk)
                    digest.update(chunk)
                    progress.advance(task, len(chunk))
            if entry.get("sha256") and digest.hexdigest() != entry["sha256"]:
                partial.unlink()
                raise CliError(
                    f"{entry['name']}: sha256 {digest.hexdigest()} is not the portal's {entry['sha256']}"
                )
            partial.replace(target)
            saved.append({"name": entry["name"], "path": str(target), "sha256": digest.hexdigest()})
    manifest = next((Path(s["path"]) for s in saved if s["name"] == "manifest.json"), None)
    lock = lock_text(job_id, json.loads(manifest.read_text())) if manifest is not None else None
    if lock is not None:
        target = download_target(job_id, LOCK_NAME, output_dir)
        target.write_text(lock)
        saved.append({"name": LOCK_NAME, "path": str(target), "sha256": hashlib.sha256(lock.encode()).hexdigest()})
    _emit(output, {"job": job_id, "step": listed["step"], "files": saved},
          escape("\n".join(f"{s['path']} (sha256 {s['sha256'][:12]})" for s in saved)))  # fmt: skip


node_app = typer.Typer(help="The cluster's nodes: list them; drain one (staff).", no_args_is_help=True)
app.add_typer(node_app, name="node")


def _node_row(node: dict[str, Any]) -> tuple[str, ...]:
    drain = node.get("drain_cause") or ""
    if node["state"] == "draining" and node.get("drain_deadline_at"):
        drain += f" (devices leave by {node['drain_deadline_at']})"
    return node["name"], node["state"], drain, str(node["last_seen_at"])


@node_app.command("list")
def list_nodes(output: OutputOption = Output.TEXT) -> None:
    """Every node: online, agent unreachable, draining (why, and by when), drained or lost."""
    nodes = _portal().get("/api/nodes")
    table = Table("node", "state", "drain", "last seen", box=None)
    for node in nodes:
        table.add_row(*(escape(cell) for cell in _node_row(node)))
    _emit(output, nodes, table if nodes else "no nodes")


@node_app.command("drain")
def drain_node(
    name: Annotated[str, typer.Argument(help="the node's name, as `bungee node list` shows it")],
    deadline: Annotated[
        float, typer.Option(min=0.001, help="seconds the node's jobs have to move off it before its agent stops "
                            "what is left and exits")
    ] = 60.0,
    output: OutputOption = Output.TEXT,
) -> None:
    """Drain a node (staff): its jobs shrink in place off it, or save their step and wait for
    devices; its agent exits once its workers are gone."""
    node = _portal().post(f"/api/nodes/{name}/drain", {"deadline_s": deadline})
    _emit(output, node, f"node {escape(node['name'])} is {node['state']}: {escape(node['drain_cause'])}; "
          f"its devices leave by {node['drain_deadline_at']}")


def main() -> None:
    """The console script: typer answers wrong usage (exit 2); a CliError is one clear message
    and its exit code, never a traceback."""
    try:
        app()
    except CliError as error:
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False)
        raise SystemExit(error.exit_code) from None


__all__ = ["app", "describe_error", "main"]
