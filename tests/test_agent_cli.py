"""The agent's command line, pinned: its flags, their environment variables and defaults,
and the exit codes of a bad start. Changing any of these is a decision, not an accident."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.devices import BackendUnavailableError
from agent.devices.nvml import NvmlBackend
from agent.main import ExitCode
from agent.settings import AgentConfig, command_line, parse_config

ROOT = Path(__file__).resolve().parent.parent


def test_the_flags() -> None:
    command = command_line(print)
    flags = {option for parameter in command.get_params(command.make_context("agent", ["--token", "t"])) for option in parameter.opts}
    assert flags == {
        "-h",
        "--help",
        "--portal",
        "--token-file",
        "--token",
        "--name",
        "--address",
        "--backend",
        "--devices",
        "--sim-pace",
        "--redis-url",
        "--report-interval",
        "--stop-grace",
        "--on-term",
        "--drain-deadline",
        "--worker-module",
        "--state-dir",
        "--log-level",
        "--standbys",
        "--prepared-standbys",
        "--standby-start",
        "--slurm",
        "--env-dir",
        "--env-find-links",
        "--env-build-deadline",
        "--env-cache-gb",
        "--env-index-options",
        "--data-dir",
        "--slurm-pool",
        "--slurm-signal",
        "--liveness-file",
        "--isolation",
        "--job-uid-base",
    }


def test_the_exit_codes() -> None:
    assert {code.name: int(code) for code in ExitCode} == {
        "OK": 0,
        "FAILURE": 1,
        "USAGE_OR_TOKEN_REFUSED": 2,
        "REGISTRATION_REJECTED": 3,
        "DEVICES_UNAVAILABLE": 4,
    }


def test_defaults_need_only_a_token() -> None:
    config = parse_config(["--token", "t"], {})
    # auto: what this machine allows (tests/test_agent_isolation.py pins how it is chosen)
    assert config.isolation in ("uid", "namespaces", "none")
    assert config == AgentConfig(
        portal_url="http://127.0.0.1:8000",
        token="t",
        node_name=socket.gethostname(),
        address="127.0.0.1",
        backend="auto",
        sim_devices=None,
        redis_url=None,
        report_interval_s=None,
        stop_grace_s=30.0,
        worker_module="elastic.worker",
        log_level="INFO",
        state_dir=ROOT / "var" / "agent" / socket.gethostname(),
        standbys=8,
        prepared_standbys=2,
        isolation=config.isolation,
        data_dir=ROOT / "var",
    )


def test_the_state_dir_defaults_to_the_data_dir() -> None:
    config = parse_config(["--token", "t", "--name", "n-1"], {"BUNGEE_DATA_DIR": "/srv/bungee"})
    assert config.state_dir == Path("/srv/bungee/agent/n-1")
    assert parse_config(["--token", "t", "--name", "n-1", "--data-dir", "/data"], {}).state_dir == Path("/data/agent/n-1")
    given = parse_config(["--token", "t", "--state-dir", "/state"], {"BUNGEE_DATA_DIR": "/srv/bungee"})
    assert given.state_dir == Path("/state")


ENVIRONMENT = {
    "BUNGEE_PORTAL_URL": "http://portal:8000",
    "BUNGEE_AGENT_TOKEN": "env-token",
    "BUNGEE_NODE_NAME": "gpu-01",
    "BUNGEE_NODE_ADDRESS": "10.0.0.7",
    "BUNGEE_DEVICE_BACKEND": "simulated",
    "BUNGEE_SIM_DEVICES": "4",
    "BUNGEE_AGENT_REDIS_URL": "redis://redis:6379/0",
    "BUNGEE_REPORT_INTERVAL_S": "0.5",
    "BUNGEE_STOP_GRACE_S": "10",
    "BUNGEE_WORKER_MODULE": "my.worker",
    "BUNGEE_LOG_LEVEL": "DEBUG",
    "BUNGEE_AGENT_STATE_DIR": "/var/lib/agent-state",
    "BUNGEE_STANDBYS": "off",
    "BUNGEE_PREPARED_STANDBYS": "0",
    "BUNGEE_STANDBY_START": "exec",
    "BUNGEE_SIM_PACE": "2.5",
    "BUNGEE_SLURM": "off",
    "BUNGEE_SLURM_SIGNAL_S": "90",
    "BUNGEE_LIVENESS_FILE": "/tmp/bungee/alive",
    "BUNGEE_AGENT_ISOLATION": "none",
    "BUNGEE_AGENT_JOB_UID_BASE": "300000",
    "BUNGEE_DATA_DIR": "/srv/bungee",
}


def test_every_flag_falls_back_to_its_environment_variable() -> None:
    assert parse_config([], ENVIRONMENT) == AgentConfig(
        portal_url="http://portal:8000",
        token="env-token",
        node_name="gpu-01",
        address="10.0.0.7",
        backend="simulated",
        sim_devices=4,
        redis_url="redis://redis:6379/0",
        report_interval_s=0.5,
        stop_grace_s=10.0,
        worker_module="my.worker",
        log_level="DEBUG",
        state_dir=Path("/var/lib/agent-state"),
        standbys=0,
        prepared_standbys=0,
        standby_start="exec",
        sim_pace=2.5,
        slurm_signal_s=90.0,
        liveness_file=Path("/tmp/bungee/alive"),
        isolation="none",
        job_uid_base=300_000,
        data_dir=Path("/srv/bungee"),
    )


def test_flags_win_over_the_environment() -> None:
    config = parse_config(["--token", "flag-token", "--devices", "2", "--name", "n-2"], ENVIRONMENT)
    assert (config.token, config.sim_devices, config.node_name) == ("flag-token", 2, "n-2")


@pytest.mark.parametrize(("value", "kept"), [("on", 8), ("off", 0), ("3", 3), ("0", 0)])
def test_standbys_are_on_off_or_a_number(value: str, kept: int) -> None:
    assert parse_config(["--token", "t", "--standbys", value], {}).standbys == kept


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        ([], {}, "an agent token is required: pass --token-file (or set BUNGEE_AGENT_TOKEN_FILE"),
        (["--token-file", "/nonexistent/agent.token"], {}, "cannot read the agent token from --token-file"),
        (["--token", "t", "--devices", "0"], {}, "--devices='0': Input should be greater than or equal to 1"),
        (["--token", "t"], {"BUNGEE_SIM_DEVICES": "many"}, "BUNGEE_SIM_DEVICES='many': Input should be a valid integer"),
        (["--token", "t", "--report-interval", "0"], {}, "--report-interval='0': Input should be greater than 0"),
        (["--token", "t", "--backend", "tpu"], {}, "--backend='tpu': is not one of auto, nvml, simulated"),
        (["--token", "t", "--name", "bad name"], {}, "invalid node name 'bad name'"),
        (["--token", "t", "--standbys", "many"], {}, "--standbys='many': is not on, off or a number of standbys"),
        (["--token", "t"], {"BUNGEE_STANDBYS": "-1"}, "BUNGEE_STANDBYS='-1': Input should be greater than or equal to 0"),
        (["--token", "t", "--prepared-standbys", "two"], {}, "--prepared-standbys='two': Input should be a valid integer"),
        (["--token", "t", "--sim-pace", "0.5"], {}, "--sim-pace='0.5': Input should be greater than or equal to 1"),
        (["--token", "t"], {"BUNGEE_SIM_PACE": "nan"}, "BUNGEE_SIM_PACE='nan': Input should be"),
        (["--token", "t", "--sim-pace", "fast"], {}, "--sim-pace='fast': Input should be a valid number"),
        (["--token", "t", "--standby-start", "spawn"], {}, "--standby-start='spawn': Input should be 'fork' or 'exec'"),
        (["--token", "t"], {"BUNGEE_STANDBY_START": "FORK"}, "BUNGEE_STANDBY_START='FORK': Input should be 'fork' or 'exec'"),
        (["--token", "t", "--on-term", "pause"], {}, "--on-term='pause': Input should be 'drain' or 'stop'"),
        (["--token", "t"], {"BUNGEE_ENV_CACHE_GB": "0"}, "BUNGEE_ENV_CACHE_GB='0': Input should be greater than 0"),
        (["--token", "t"], {"BUNGEE_SLURM_SIGNAL_S": "soon"}, "BUNGEE_SLURM_SIGNAL_S='soon': Input should be a valid number"),
        (["--token", "t", "--slurm-signal", "-5"], {}, "--slurm-signal='-5': Input should be greater than or equal to 0"),
        (["--token", "t", "--no-such-flag"], {}, "No such option: --no-such-flag"),
    ],
)
def test_a_bad_start_exits_2_saying_what_is_wrong(
    argv: list[str], environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_config(argv, environ)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def _has_gpu() -> bool:
    try:
        NvmlBackend().close()
    except BackendUnavailableError:
        return False
    return True


@pytest.mark.skipif(_has_gpu(), reason="this machine has a GPU")
def test_nvml_without_a_gpu_exits_4() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "--token",
            "t",
            "--backend",
            "nvml",
            "--portal",
            "http://127.0.0.1:9",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 4
    assert "device backend 'nvml' cannot start: NVML did not initialise" in result.stderr


def test_the_token_comes_from_a_file_and_never_reaches_a_worker(tmp_path: Path, monkeypatch: Any) -> None:
    from agent.spawn import process_environment

    token_file = tmp_path / "agent.token"
    token_file.write_text("bng_secret\n")
    assert parse_config(["--token-file", str(token_file)], {}).token == "bng_secret"
    assert parse_config([], {"BUNGEE_AGENT_TOKEN_FILE": str(token_file)}).token == "bng_secret"
    monkeypatch.setenv("BUNGEE_AGENT_TOKEN", "bng_secret")
    monkeypatch.setenv("BUNGEE_AGENT_TOKEN_FILE", str(token_file))
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    environment = process_environment()
    assert "BUNGEE_AGENT_TOKEN" not in environment and "BUNGEE_AGENT_TOKEN_FILE" not in environment
    assert environment["OMP_PROC_BIND"] == "true"
