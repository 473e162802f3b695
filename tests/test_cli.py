"""The `bungee` command: its commands and flags pinned, and the installed console script used as a
new user would, against the real platform: log in, submit your own code and follow it to the
end, fetch the model, list, status, logs, resize, unpin, cancel, and a refusal that names the
field and the value."""

from __future__ import annotations

import json
import os
import queue
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import typer
from typer.testing import CliRunner

from bungee_cli.main import app

ROOT = Path(__file__).resolve().parent.parent
BUNGEE = Path(sys.executable).parent / "bungee"


def test_the_commands_and_flags() -> None:
    group = typer.main.get_command(app)
    flags = {
        name: sorted(option for param in command.params for option in [*param.opts, *param.secondary_opts])
        for name, command in group.commands.items()  # type: ignore[attr-defined]
    }
    assert flags == {
        "login": ["--output", "--token", "-o", "url"],
        "submit": ["--code", "--follow", "--output", "--progress-every", "-f", "-o", "spec_file"],
        "list": ["--limit", "--output", "--owner", "--state", "-o"],
        "status": ["--output", "-o", "job_id"],
        "logs": ["--follow", "--output", "--progress-every", "-f", "-o", "job_id"],
        "resize": ["--output", "-o", "job_id", "workers"],
        "unpin": ["--output", "-o", "job_id"],
        "cancel": ["--output", "-o", "job_id"],
        "download": ["--output", "--output-dir", "--wait", "-d", "-o", "job_id"],
        "node": [],
    }
    node = group.commands["node"]  # type: ignore[attr-defined]
    assert {name: sorted(o for p in c.params for o in [*p.opts, *p.secondary_opts])
            for name, c in node.commands.items()} == {
        "list": ["--output", "-o"],
        "drain": ["--deadline", "--output", "-o", "name"],
    }


def test_the_help_reads_as_written() -> None:
    """The command list gives each command's first sentence on a line of its own, and a help
    text keeps its brackets: `[generation.rank]` was read as rich markup and vanished, and a
    docstring's line breaks cut the list's entries mid-sentence."""
    runner = CliRunner()
    listing = runner.invoke(app, ["--help"], terminal_width=100).output
    assert "Submit a job; print its number and page." in listing
    assert "POST /api/jobs/validate" not in listing, "the details stay on the command's own page"
    logs = runner.invoke(app, ["logs", "--help"], terminal_width=100).output
    assert "each prefixed with [generation.rank]." in logs
    assert "With -f, new ones as they come, across resizes and restarts" in " ".join(logs.split())


def test_not_logged_in_says_how(tmp_path: Path) -> None:
    done = bungee(tmp_path, "list")
    assert done.returncode == 1 and "bungee login" in done.stderr and "Traceback" not in done.stderr


def bungee(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs the installed console script with its config under `home`."""
    assert BUNGEE.exists(), f"{BUNGEE}: the project is not installed (make install runs pip install -e .)"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("BUNGEE_")}
    environ.update(BUNGEE_CONFIG=str(home / "bungee" / "config.json"), COLUMNS="200", **(env or {}))
    return subprocess.run([str(BUNGEE), *args], capture_output=True, text=True, env=environ, timeout=300)


def as_json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.slow
def test_a_new_user_trains_their_code_and_takes_the_model_home(browser_platform: Any, tmp_path: Path) -> None:
    token = browser_platform.tokens["alice"]
    logged = bungee(tmp_path, "login", browser_platform.base_url, "--token", token)
    assert logged.returncode == 0, logged.stderr
    config = tmp_path / "bungee" / "config.json"
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and json.loads(config.read_text())["token"] == token
    assert bungee(tmp_path, "login", browser_platform.base_url, "--token", "bng_wrong").returncode == 1

    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: cli-digits\nentrypoint: task:DigitsMLP\nmin_workers: 1\nmax_workers: 2\nsteps: 150\n"
        "hyperparameters: {batch_size: 32, hidden: 32}\n"
    )
    followed = bungee(tmp_path, "submit", str(spec), "--code", str(ROOT / "examples" / "digits"), "--follow")
    assert followed.returncode == 0, followed.stdout + followed.stderr
    assert "uploaded" in followed.stderr and "/jobs/" in followed.stdout
    assert "succeeded" in followed.stdout, followed.stdout
    job_id = int(followed.stdout.split("submitted job ")[1].split()[0])

    fetched = as_json(bungee(tmp_path, "download", str(job_id), "-d", str(tmp_path / "model"), "-o", "json"))
    # -d: the files under their own names, as the README says (they were once job-N-model.pt).
    model = tmp_path / "model" / "model.pt"
    assert {Path(f["path"]).name for f in fetched["files"]} == {"model.pt", "checkpoint.pt", "manifest.json"}
    assert fetched["step"] == 150
    weights = torch.load(model, map_location="cpu", weights_only=True)
    assert any(isinstance(value, torch.Tensor) for value in weights.values())

    listed = as_json(bungee(tmp_path, "list", "--owner", "alice", "-o", "json"))
    assert job_id in [job["id"] for job in listed]
    assert as_json(bungee(tmp_path, "status", str(job_id), "-o", "json"))["state"] == "succeeded"
    assert "step" in bungee(tmp_path, "logs", str(job_id)).stdout

    # A running job: pin, lift the pin, cancel; a refusal names the field and the value.
    spec.write_text("name: cli-endless\nworkload: digits-mlp\nmax_workers: 2\nsteps: 1000000\n")
    endless = as_json(bungee(tmp_path, "submit", str(spec), "-o", "json"))["id"]
    assert as_json(bungee(tmp_path, "resize", str(endless), "1", "-o", "json"))["pinned_workers"] == 1
    refused = bungee(tmp_path, "resize", str(endless), "3")
    assert refused.returncode == 1 and "workers" in refused.stderr and "(value: 3)" in refused.stderr
    assert as_json(bungee(tmp_path, "unpin", str(endless), "-o", "json"))["pinned_workers"] is None
    # The README's socket example follows it as a script does: a bearer token and no Origin.
    follower = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "follow_job.py"), browser_platform.base_url, token, str(endless)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    stdout = follower.stdout
    assert stdout is not None

    def read() -> None:
        for line in stdout:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # It trains: a step comes (after any state change it was told of first, such as the unpin's).
        said: list[str] = []
        while not said or not said[-1].startswith("step "):
            try:
                said.append(lines.get(timeout=120))
            except queue.Empty:
                pytest.fail(f"the example printed no step in 120 s; it printed {said}")
        assert as_json(bungee(tmp_path, "cancel", str(endless), "-o", "json"))["state"] == "cancelled"
        follower.wait(timeout=30)
        reader.join(timeout=30)
    finally:
        follower.kill()
    out = "".join(said + list(lines.queue))
    err = follower.stderr.read() if follower.stderr is not None else ""
    assert follower.returncode == 0 and out.rstrip().endswith("cancelled"), out + err
    spec.write_text("name: cli-bad\nworkload: digits-mlp\nmax_workers: two\n")
    bad = bungee(tmp_path, "submit", str(spec))
    assert bad.returncode == 1 and "max_workers" in bad.stderr and "'two'" in bad.stderr, bad.stderr
    assert "Traceback" not in bad.stderr
    usage = bungee(tmp_path, "resize", str(endless), "zero")
    assert usage.returncode == 2 and "'workers'" in usage.stderr, usage.stderr


def test_status_says_where_a_job_stands() -> None:
    """`bungee status` words the API's progress and queue as the board does."""
    import time

    from bungee_cli.main import standing

    now = time.time()
    running = {"state": "running", "progress": 0.42, "finish_estimate_at": now + 185}
    assert standing(running) == [("progress", "42%, about 3 min left")]
    queued = {"state": "queued", "progress": 0.0, "queue": {
        "position": 2, "waiting": 3, "start_estimate_at": None, "no_estimate": "it waits on jobs whose speed is not known yet (#4)",
        "holders": [{"id": 4, "name": "hog", "owner": "alice", "devices": 4, "pinned": True, "finish_estimate_at": None}]}}
    assert standing(queued) == [
        ("queue", "2 of 3 waiting; no start estimate: it waits on jobs whose speed is not known yet (#4)"),
        ("waits for", "#4 hog (alice, 4 devices, pinned, end not known)"),
    ]


def test_following_a_job_words_each_change() -> None:
    """`--follow`'s lines: the size while it runs (one worker, not "1 workers"); once it ended,
    where it stopped, and why unless it succeeded (not "succeeded on 0 workers")."""
    from bungee_cli.main import _follow_line

    job = {"id": 3, "state": "running", "workers": 1, "generation": 2, "steps_done": 40, "total_steps": 2000,
           "message": "running on 1 worker"}  # fmt: skip
    assert _follow_line(job) == "job 3: running on 1 worker (generation 2), step 40"
    assert _follow_line({**job, "workers": 2}) == "job 3: running on 2 workers (generation 2), step 40"
    done = {**job, "state": "succeeded", "workers": 0, "steps_done": 2000, "message": "completed"}
    assert _follow_line(done) == "job 3: succeeded at step 2000 of 2000"
    failed = {**job, "state": "failed", "workers": 0, "message": "the job's code failed on worker rank 0: [bug]"}
    assert _follow_line(failed) == "job 3: failed at step 40 of 2000: the job's code failed on worker rank 0: [bug]"


def test_a_download_without_a_directory_names_its_files_after_the_job() -> None:
    from bungee_cli.main import download_target

    assert download_target(7, "model.pt", None) == Path("job-7-model.pt")
    assert download_target(7, "model.pt", Path("out")) == Path("out/model.pt")
