"""What `bungee submit` and `bungee logs -f` do before and after a job is stored, driven in
process against the portal's WSGI application (no server): the spec is checked before any code
is uploaded, a `.bungeeignore` applies before packing so that an ignored file never travels, code
the portal holds is not sent twice; `--follow` prints a progress line every N seconds and each
log line after its worker's [generation.rank]; `login` asks "Token: "."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.test import Client
from typer.testing import CliRunner

from bungee_cli import main as cli
from bungee_cli.client import CliError
from portal.jobs.models import CodeUpload, Job
from tests.code_support import RINGS, directory_files

ROOT = Path(__file__).resolve().parent.parent
SPEC = "name: rings\nentrypoint: task:RingsTask\nmax_workers: 2\nsteps: 20\nhyperparameters: {batch_size: 24}\n"


@pytest.fixture
def sent(tokens: dict[str, str], settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[httpx.Request]:
    """Every request the CLI sends, as alice, answered by the portal in this process."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={"data_dir": tmp_path})
    monkeypatch.setenv("BUNGEE_URL", "http://testserver")
    monkeypatch.setenv("BUNGEE_TOKEN", tokens["alice"])
    requests: list[httpx.Request] = []

    class Recorded(httpx.BaseTransport):
        """Through Django's test client, which keeps the test's database connection open."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            requests.append(request)
            path = request.url.path + (f"?{request.url.query.decode()}" if request.url.query else "")
            reply = Client().generic(
                request.method, path, request.read(), content_type=request.headers.get("content-type", ""),
                HTTP_AUTHORIZATION=request.headers["authorization"],
            )
            return httpx.Response(reply.status_code, headers=dict(reply.headers), content=reply.content)

    monkeypatch.setattr(httpx, "Client", functools.partial(httpx.Client, transport=Recorded()))
    return requests


def task_directory(tmp_path: Path, extra: dict[str, bytes] | None = None) -> Path:
    directory = tmp_path / "mytask"
    for name, data in {**directory_files(RINGS), **(extra or {})}.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return directory


def submit(tmp_path: Path, spec: str, code: Path) -> Any:
    (tmp_path / "job.yaml").write_text(spec)
    return CliRunner().invoke(cli.app, ["submit", str(tmp_path / "job.yaml"), "--code", str(code)])


def paths(requests: list[httpx.Request]) -> list[str]:
    return [f"{request.method} {request.url.path}" for request in requests]


@pytest.mark.parametrize(
    ("spec", "said"),
    [
        (SPEC + "max_wokers: 2\n", "max_wokers: unknown field; did you mean max_workers?"),
        (SPEC.replace("task:RingsTask", "task:RingTask"), "defines no class 'RingTask'; its classes: "),
    ],
)
def test_a_bad_spec_costs_no_upload(sent: list[httpx.Request], tmp_path: Path, spec: str, said: str) -> None:
    done = submit(tmp_path, spec, task_directory(tmp_path))
    assert "POST /api/code" not in paths(sent) and not CodeUpload.objects.exists() and not Job.objects.exists()
    assert isinstance(done.exception, CliError) and said in str(done.exception), done.output


def test_ignored_files_never_travel_and_held_code_is_not_sent_again(sent: list[httpx.Request], tmp_path: Path) -> None:
    big = os.urandom(300_000)  # random: gzip cannot make it small
    code = task_directory(tmp_path, {".bungeeignore": b"data/\n*.ckpt\n", "data/big.bin": big, "run.ckpt": big})
    (code / "data" / "elsewhere").symlink_to("/etc")  # a link is refused, unless it is left out
    done = submit(tmp_path, SPEC, code)
    assert done.exit_code == 0, (done.output, done.exception)
    [upload] = [request for request in sent if request.url.path == "/api/code"]
    assert len(upload.content) < len(big)
    assert sorted(CodeUpload.objects.get().files) == sorted([".bungeeignore", *directory_files(RINGS)])
    sent.clear()
    again = submit(tmp_path, SPEC, code)
    assert again.exit_code == 0 and paths(sent) == ["POST /api/jobs/validate", "POST /api/jobs"]
    assert Job.objects.count() == 2 and len({job.code for job in Job.objects.all()}) == 1


@pytest.mark.parametrize(
    ("limit", "value", "said"),
    [
        ("code_max_bytes", 200_000, "it packs to 1.1 MiB; the portal takes at most 195.3 KiB (BUNGEE_CODE_MAX_BYTES)"),
        ("code_max_unpacked_bytes", 300_000, "it unpacks to 1.1 MiB; the portal takes at most 293.0 KiB (BUNGEE_CODE_MAX_UNPACKED_BYTES)"),
        ("code_max_files", 3, "files and directories; the portal takes at most 3 files and directories (BUNGEE_CODE_MAX_FILES)"),
    ],
)
def test_code_over_a_limit_is_refused_before_the_upload_naming_its_largest_files(
    sent: list[httpx.Request], tmp_path: Path, settings: Any, limit: str, value: int, said: str
) -> None:
    """The portal's limits (in the dry run's answer) are checked here: nothing is uploaded, and the
    refusal names the largest files, with their sizes, and the .bungeeignore that leaves them out."""
    settings.BUNGEE = settings.BUNGEE.model_copy(update={limit: value})
    code = task_directory(tmp_path, {"data/frames.bin": os.urandom(1_000_000), "run.ckpt": os.urandom(150_000)})
    done = submit(tmp_path, SPEC, code)
    assert done.exit_code == 1 and paths(sent) == ["POST /api/jobs/validate"], (done.output, paths(sent))
    message = " ".join(str(done.exception).split())
    assert said in message, message
    assert "Its largest files: data/frames.bin (976.6 KiB), run.ckpt (146.5 KiB)," in message, message
    assert ".bungeeignore" in message and not CodeUpload.objects.exists()


def test_what_users_and_jobs_wrote_prints_as_written_not_as_markup(sent: list[httpx.Request], tmp_path: Path) -> None:
    """A job's name, its log lines (gloo's errors quote `[/path/pair.cc:553]`) and the code's
    directory may hold what rich reads as markup: a closing tag that opens nothing made `bungee
    logs` raise MarkupError, and a name like `[bold]` vanished."""
    name = "ring [/x] [bold]s[/bold]"
    code = task_directory(tmp_path / "[red]code[/red]")
    done = submit(tmp_path, SPEC.replace("name: rings", f"name: '{name}'"), code)
    assert done.exit_code == 0, (done.output, done.exception)
    printed = done.output.replace("\n", "")  # rich wraps at the runner's 80 columns
    assert f"({name})" in printed and f"uploaded {code} as " in printed
    job = Job.objects.get()
    line = "[c10d] connection closed by peer [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553]"
    job.logs.create(generation=1, rank=0, at=job.created_at, line=line)
    shown = CliRunner().invoke(cli.app, ["logs", str(job.pk)])
    assert shown.exit_code == 0, (shown.output, shown.exception)
    assert f"[1.0] {line}" in " ".join(shown.output.split())  # rich wraps at the runner's 80 columns


class ScriptedPortal:
    """A job that trains one step a second on a clock the test moves: its log grows a line per
    step, from rank step % 2."""

    def __init__(self, clock: list[float], steps: int) -> None:
        self.clock, self.steps = clock, steps

    def step(self) -> int:
        return min(int(self.clock[0]), self.steps)

    def get(self, path: str, **params: Any) -> Any:
        if path.endswith("/logs"):
            return [{"id": n, "generation": 1, "rank": n % 2, "at": "2026-11-26T18:00:00", "line": f"step {n}"}
                    for n in range(params["after"] + 1, self.step() + 1)]
        done = self.step() == self.steps
        return {"id": 7, "state": "succeeded" if done else "running", "workers": 2, "generation": 1,
                "steps_done": self.step(), "total_steps": self.steps, "last_loss": 1 / (1 + self.step()),
                "samples_per_s": 1234.5, "message": ""}


def test_follow_prints_progress_every_n_seconds_and_each_line_after_its_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    clock = [0.0]
    portal = ScriptedPortal(clock, steps=60)
    monkeypatch.setattr(cli.out, "width", 200)

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    code = cli._follow(portal, 7, cli.Output.TEXT, progress_every=10, clock=lambda: clock[0], sleep=sleep)  # type: ignore[arg-type]
    printed = capsys.readouterr().out.splitlines()
    assert code == 0
    progress = [line for line in printed if "samples/s" in line]
    assert len(progress) == 6, progress  # at 1, 11, ... 51 s of 60: every 10 s, not every step
    assert progress[1] == "job 7: step 11/60 (18%), loss 0.0833, 1,234 samples/s, 2 workers"
    assert any(line.endswith("[1.1] step 11") for line in printed)
    assert any(line.endswith("[1.0] step 12") for line in printed)


def test_login_asks_token_with_a_space_and_the_readme_gives_the_flag(tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BUNGEE_")}
    done = subprocess.run(
        [sys.executable, "-c", "from bungee_cli.main import main; main()", "login", "http://127.0.0.1:9"],
        input="bng_x\n", capture_output=True, text=True, cwd=ROOT, timeout=60, start_new_session=True,
        env={**environ, "BUNGEE_CONFIG": str(tmp_path / "config.json")},
    )
    assert done.stderr.startswith("Token: ") and "unreachable" in done.stderr, (done.stdout, done.stderr)
    assert done.stdout == ""
    assert "--token" in (ROOT / "README.md").read_text()


class EndedJobPortal:
    """A job in `state` whose artifacts reach the portal at `arrive_at` on the test's clock
    (None: never)."""

    def __init__(self, clock: list[float], state: str, arrive_at: float | None) -> None:
        self.clock, self.state, self.arrive_at = clock, state, arrive_at
        self.asked: list[str] = []

    def arrived(self) -> bool:
        return self.arrive_at is not None and self.clock[0] >= self.arrive_at

    def get(self, path: str, **params: Any) -> Any:
        self.asked.append(path)
        if path.endswith("/artifacts"):
            assert self.arrived(), "listed before they arrived (the API says 404)"
            return {"step": 60, "files": []}
        kept = {"step": 60, "ended": "stopped" if self.state == "running" else self.state}
        return {"id": 7, "state": self.state, "artifacts": kept if self.arrived() else None}


@pytest.mark.parametrize(
    ("state", "arrive_at", "wait", "said"),
    [
        ("succeeded", 3.0, 120.0, None),
        ("succeeded", 3.0, 0.0, "job 7 succeeded, but its files did not reach the portal within 0 s"),
        ("cancelled", None, 10.0, "job 7 cancelled, but its files did not reach the portal within 10 s"),
        ("running", None, 120.0, "job 7 is running: its files come when it ends (`bungee logs -f 7` follows it)"),
        ("running", 0.0, 120.0, "given, with a line saying they are not its last"),
    ],
)
def test_download_waits_for_an_ended_jobs_files_on_their_way(
    capsys: pytest.CaptureFixture[str], state: str, arrive_at: float | None, wait: float, said: str | None
) -> None:
    # Rank 0's agent uploads them after the job's last step, and its exit can be reported first.
    clock = [0.0]
    portal = EndedJobPortal(clock, state, arrive_at)

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    def listing() -> Any:
        return cli.artifacts_listing(portal, 7, wait, clock=lambda: clock[0], sleep=sleep)  # type: ignore[arg-type]

    if said is None:
        assert listing()["step"] == 60 and clock[0] == arrive_at
        assert "job 7 succeeded; waiting up to 120 s for its files to reach the portal" in capsys.readouterr().err
        return
    if said.startswith("given"):  # a running job that stopped once (a drain, its node stopped) and resumed
        assert listing()["step"] == 60 and clock[0] == 0.0
        assert "job 7 is running: these files are of step 60, when it stopped; its last ones come when it ends" in (
            " ".join(capsys.readouterr().err.split())
        )
        return
    with pytest.raises(CliError) as refused:
        listing()
    assert said in str(refused.value)
    assert clock[0] == (wait if state != "running" else 0.0)
