"""The worker's environment settings: defaults with nothing set, values parsed, and a bad value
refused with the variable and the value quoted."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic.worker.settings import WorkerSettings, WorkerSettingsError


def test_defaults_need_no_environment() -> None:
    assert WorkerSettings.from_env({}) == WorkerSettings(
        threads=1,
        pg_timeout_s=30.0,
        checkpoint_every_s=30.0,
        progress_every_s=0.5,
        rendezvous_timeout_s=10.0,
        membership_poll_s=0.05,
    )
    assert WorkerSettings.from_env({}).state_route == "auto"


def test_values_are_read() -> None:
    settings = WorkerSettings.from_env(
        {
            "OMP_NUM_THREADS": "4",
            "BUNGEE_PG_TIMEOUT_S": "5",
            "BUNGEE_CHECKPOINT_EVERY_S": "0.25",
            "BUNGEE_PROGRESS_EVERY_S": "2",
            "BUNGEE_RECORD_SAMPLES": "/tmp/samples.jsonl",
            "BUNGEE_RENDEZVOUS_TIMEOUT_S": "3",
            "BUNGEE_MEMBERSHIP_POLL_S": "0.1",
            "BUNGEE_SIM_SLOWDOWN": "2.5",
            "BUNGEE_SIM_STEP_PACE": "4",
            "BUNGEE_SHARED_GPU": "1",
            "BUNGEE_STATE_ROUTE": "direct",
            "BUNGEE_BUCKET_MB": "0",
        }
    )
    assert settings == WorkerSettings(
        threads=4, pg_timeout_s=5.0, checkpoint_every_s=0.25, progress_every_s=2.0,
        record_samples=Path("/tmp/samples.jsonl"), rendezvous_timeout_s=3.0, membership_poll_s=0.1,
        simulated_slowdown=2.5, simulated_pace=4.0, shared_gpu=True, bucket_mb=0, state_route="direct",
    )
    assert settings.bucket_bytes == 0
    assert WorkerSettings.from_env({"BUNGEE_BUCKET_MB": "1.5"}).bucket_bytes == 1572864


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("OMP_NUM_THREADS", "many"),
        ("OMP_NUM_THREADS", "0"),
        ("BUNGEE_PG_TIMEOUT_S", "-1"),
        ("BUNGEE_SIM_SLOWDOWN", "0.5"),
        ("BUNGEE_SIM_STEP_PACE", "0.5"),
        ("BUNGEE_SIM_STEP_PACE", "101"),
        ("BUNGEE_SHARED_GPU", "yes"),
        ("BUNGEE_STATE_ROUTE", "chain"),
        ("BUNGEE_BUCKET_MB", "-1"),
        ("BUNGEE_BUCKET_MB", "lots"),
    ],
)
def test_bad_values_are_refused_with_name_and_value(name: str, value: str) -> None:
    with pytest.raises(WorkerSettingsError, match=f"{name}='{value}'"):
        WorkerSettings.from_env({name: value})
