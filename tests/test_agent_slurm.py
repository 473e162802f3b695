"""The agent inside a Slurm allocation (agent.slurm): its node is named from the Slurm node and
the job, its devices are the allocation's (the GPUs Slurm gave it, or a count of slots), and a
flag given on the command line still wins. The last tests read the environment of real batch
jobs of the suite's Slurm."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent import slurm as agent_slurm
from agent.devices import BackendUnavailableError, DeviceError, GpuSelection, make_backend
from agent.devices.nvml import selected_gpus
from agent.settings import parse_config
from tests.slurm_support import PROJECT_ROOT, SlurmCluster, slurm, slurm_clean

__all__ = ["slurm", "slurm_clean"]  # fixtures, used by name

JOB = {"SLURM_JOB_ID": "4211", "SLURMD_NODENAME": "gpu-07", "SLURM_CPUS_ON_NODE": "6"}


def test_outside_slurm_auto_is_an_ordinary_agent() -> None:
    assert agent_slurm.detect("auto", {}) is None
    config = parse_config(["--token", "t"], {})
    assert (config.node_name, config.backend, config.gpus) == (socket.gethostname(), "auto", None)
    assert config.slurm_job_id is None


def test_off_ignores_a_slurm_job() -> None:
    assert agent_slurm.detect("off", JOB) is None
    config = parse_config(["--token", "t", "--slurm", "off"], JOB)
    assert config.node_name == socket.gethostname()
    assert config.slurm_job_id is None, "a TERM is then not Slurm's to explain"


def test_inside_a_job_the_node_is_the_allocation() -> None:
    config = parse_config(["--token", "t"], JOB)
    assert config.node_name == "gpu-07-job4211"
    assert config.backend == "simulated"  # no GPU in the allocation: never the machine's
    assert config.sim_devices == 6  # the allocation's CPUs
    assert config.address == socket.gethostname()
    assert config.state_dir.name == "gpu-07-job4211"
    assert config.slurm_job_id == "4211", "the job whose squeue entry explains a TERM"


def test_an_agent_of_a_pool_is_named_behind_the_pool(capsys: pytest.CaptureFixture[str]) -> None:
    """The pool's batch script sets BUNGEE_SLURM_POOL: the node is then POOL-NODE-jobID, the only
    names the pool's token may register. A name no pool token can have (elastic.wire.
    POOL_NAME_PATTERN, which the portal checks too) is refused."""
    assert parse_config(["--token", "t"], JOB | {"BUNGEE_SLURM_POOL": "slurm"}).node_name == "slurm-gpu-07-job4211"
    for pool in ("a-b", "x" * 41):
        with pytest.raises(SystemExit) as refused:
            parse_config(["--token", "t"], JOB | {"BUNGEE_SLURM_POOL": pool})
        assert refused.value.code == 2
        assert (f"BUNGEE_SLURM_POOL={pool!r}: is not a pool's name (1 to 40 letters, digits, _ or ., no -)"
                in capsys.readouterr().err)


def test_two_jobs_on_one_machine_are_two_nodes() -> None:
    names = {parse_config(["--token", "t"], JOB | {"SLURM_JOB_ID": job}).node_name for job in ("1", "2")}
    assert names == {"gpu-07-job1", "gpu-07-job2"}


def test_the_command_line_wins_and_the_environment_keeps_what_it_set() -> None:
    config = parse_config(["--token", "t", "--slurm", "--devices", "2", "--name", "mine"],
                          JOB | {"BUNGEE_NODE_ADDRESS": "10.0.0.7"})
    assert (config.node_name, config.sim_devices, config.address) == ("mine", 2, "10.0.0.7")
    # One BUNGEE_NODE_NAME for every agent job would make them one node: the job's name wins.
    assert parse_config(["--token", "t"], JOB | {"BUNGEE_NODE_NAME": "shared"}).node_name == "gpu-07-job4211"


def test_gpus_come_from_slurm_job_gpus_first() -> None:
    environ = JOB | {"SLURM_JOB_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0,1"}
    config = parse_config(["--token", "t"], environ)
    assert config.backend == "nvml"
    assert config.gpus == GpuSelection(minors=frozenset({2, 3}))
    assert parse_config(["--token", "t", "--backend", "simulated"], environ).gpus is None


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"SLURM_JOB_GPUS": "0-2,5"}, GpuSelection(minors=frozenset({0, 1, 2, 5}))),
        ({"CUDA_VISIBLE_DEVICES": "1,3"}, GpuSelection(minors=frozenset({1, 3}))),
        ({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}, GpuSelection(uuids=frozenset({"GPU-aa", "GPU-bb"}))),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, None),
        ({"CUDA_VISIBLE_DEVICES": ""}, None),
        ({}, None),
    ],
)
def test_the_allocations_gpus(environ: dict[str, str], expected: GpuSelection | None) -> None:
    assert agent_slurm.gpus_of(environ) == expected


@given(st.sets(st.integers(min_value=0, max_value=4096), min_size=1))
def test_any_list_of_gpu_ids_reads_back(ids: set[int]) -> None:
    text = ",".join(str(i) for i in sorted(ids))
    assert agent_slurm.gpus_of({"SLURM_JOB_GPUS": text}) == GpuSelection(minors=frozenset(ids))


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--slurm", "on"], {}, "--slurm on, but SLURM_JOB_ID is not set"),
        ([], {"SLURM_JOB_ID": "12"}, "SLURM_JOB_ID=12 but SLURMD_NODENAME is not set"),
        ([], {"SLURM_JOB_ID": "12", "SLURMD_NODENAME": "a b"}, "SLURMD_NODENAME='a b' cannot be part of a node name"),
        ([], JOB | {"SLURM_JOB_GPUS": "0,x"}, "SLURM_JOB_GPUS='0,x' is not a list of GPU numbers"),
        (["--backend", "nvml"], JOB, "--backend nvml, but Slurm job 4211 has no GPU"),
    ],
)
def test_a_job_the_agent_cannot_serve_is_a_usage_error(
    argv: list[str], environ: dict[str, str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        parse_config(["--token", "t", *argv], environ)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_nvml_keeps_the_selected_gpus_in_its_order() -> None:
    found = [(0, "GPU-a"), (1, "GPU-b"), (2, "GPU-c"), (None, "GPU-d")]
    assert selected_gpus(found, GpuSelection(minors=frozenset({2, 0}))) == [0, 2]
    assert selected_gpus(found, GpuSelection(uuids=frozenset({"GPU-d", "GPU-b"}))) == [1, 3]
    with pytest.raises(BackendUnavailableError, match=r"asked for \(minor 1, minor 7\)"):
        selected_gpus(found, GpuSelection(minors=frozenset({1, 7})))


def test_a_gpu_selection_is_never_served_by_slots() -> None:
    with pytest.raises(DeviceError, match="a GPU selection"):
        make_backend("simulated", gpus=GpuSelection(minors=frozenset({0})))
    # auto falls back to slots only where no GPU was named (this machine has no NVML GPU).
    with pytest.raises(BackendUnavailableError):
        make_backend("auto", gpus=GpuSelection(minors=frozenset({0})))


PROBE = (
    ".venv/bin/python -c 'import os; from agent.settings import parse_config; "
    'c = parse_config(["--slurm", "--token", "t", "--devices", "2"], os.environ); '
    "print(c.node_name, c.backend, c.sim_devices)'"
)


@pytest.mark.slow
def test_agents_in_two_real_allocations_on_one_machine_are_two_nodes(slurm_clean: SlurmCluster) -> None:
    outputs = [slurm_clean.directory / f"probe-{i}.out" for i in range(2)]
    jobs = [
        slurm_clean.sbatch("-p", slurm_clean.pool, f"--gres={slurm_clean.gres}:2", "--export=NONE",
                           f"--chdir={PROJECT_ROOT}", f"--output={out}", wrap=PROBE)
        for out in outputs
    ]
    seen = []
    for job_id, out in zip(jobs, outputs, strict=True):
        slurm_clean.wait_for_state(job_id, ["COMPLETED", "FAILED"], timeout_s=60)
        assert slurm_clean.state(job_id) == "COMPLETED", Path(out).read_text()
        seen.append(out.read_text().split())
    assert seen == [[f"{slurm_clean.nodes[0]}-job{job_id}", "simulated", "2"] for job_id in jobs]
