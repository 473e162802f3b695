"""The pool's Slurm client (portal.slurm.commands) against the suite's real Slurm: a job it
submits is listed (by name and user: 22.05's `squeue --json` ignores its filters) and cancelled;
a failing or hanging command is one SlurmCommandError with the command, exit code and stderr."""

from __future__ import annotations

import getpass

import pytest

from portal.slurm.commands import SlurmCommandError, SlurmCommands
from tests.slurm_support import SlurmCluster, slurm, slurm_clean, wait_until

__all__ = ["slurm", "slurm_clean"]  # fixtures, used by name

pytestmark = pytest.mark.slow

SCRIPT = "#!/bin/bash\nsleep 600\n"


def test_a_submitted_job_is_listed_then_cancelled(slurm_clean: SlurmCluster) -> None:
    commands = SlurmCommands(timeout_s=20, environ=slurm_clean.env)
    user = getpass.getuser()
    ours = commands.sbatch(["--job-name=bungee-agent", "-p", slurm_clean.pool, f"--gres={slurm_clean.gres}:2",
                            f"--output={slurm_clean.directory}/%j.out"], SCRIPT)
    other = commands.sbatch(["--job-name=someone-else", "-p", slurm_clean.pool, "--output=/dev/null"], SCRIPT)
    listed = wait_until(lambda: [j for j in commands.jobs("bungee-agent", user) if j.started], 60, "our job running")
    assert isinstance(listed, list)
    (job,) = listed
    assert (job.job_id, job.name, job.user, job.state) == (ours, "bungee-agent", user, "RUNNING")
    assert job.batch_host == slurm_clean.nodes[0] and job.start_time is not None and job.start_time >= job.submit_time
    assert commands.jobs("bungee-agent", "nobody-here") == []
    assert [j.job_id for j in commands.jobs("someone-else", user)] == [other]

    commands.scancel([ours])
    wait_until(lambda: commands.jobs("bungee-agent", user) == [], 60, "our job gone from the queue")
    assert slurm_clean.state(ours) == "CANCELLED"
    commands.scancel([ours])  # already gone: no error
    assert [j.job_id for j in commands.jobs("someone-else", user)] == [other]


def test_a_pending_job_is_listed_as_pending(slurm_clean: SlurmCluster) -> None:
    commands = SlurmCommands(timeout_s=20, environ=slurm_clean.env)
    held = commands.sbatch(["--job-name=bungee-agent", "-p", slurm_clean.pool, "--hold", "--output=/dev/null"], SCRIPT)
    (job,) = commands.jobs("bungee-agent", getpass.getuser())
    assert (job.job_id, job.pending, job.started, job.batch_host, job.start_time) == (held, True, False, "", None)


def test_a_refused_submission_is_an_error_with_its_command_code_and_stderr(slurm: SlurmCluster) -> None:
    commands = SlurmCommands(timeout_s=20, environ=slurm.env)
    with pytest.raises(SlurmCommandError) as failed:
        commands.sbatch(["--job-name=bungee-agent", "-p", "no-such-partition"], SCRIPT)
    assert failed.value.command[:3] == ["sbatch", "--parsable", "--job-name=bungee-agent"]
    assert failed.value.returncode == 1
    assert "invalid partition" in failed.value.stderr.lower()
    assert "exited 1" in str(failed.value)


def test_a_command_that_does_not_answer_in_time_is_an_error(slurm: SlurmCluster) -> None:
    with pytest.raises(SlurmCommandError) as failed:
        SlurmCommands(timeout_s=0.001, environ=slurm.env).jobs("bungee-agent", getpass.getuser())
    assert failed.value.returncode is None and "no answer within 0.001 s" in str(failed.value)


def test_a_command_that_cannot_run_is_an_error(slurm: SlurmCluster) -> None:
    without_slurm = {**slurm.env, "PATH": "/nonexistent"}
    with pytest.raises(SlurmCommandError) as failed:
        SlurmCommands(timeout_s=5, environ=without_slurm).scancel([1])
    assert failed.value.returncode is None and failed.value.command == ["scancel", "1"]
