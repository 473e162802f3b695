"""The agent as a Slurm batch job (`python -m agent --slurm`, or found from SLURM_JOB_ID): its node
and devices are the allocation's, not the machine's.

- The node is named from the Slurm node and the job (elastic.wire.slurm_node_name), so that two
  allocations on one machine are two Bungee nodes, and the portal's Slurm pool finds the node
  of each agent job it submitted.
- GPUs: only the allocation's, from SLURM_JOB_GPUS (Slurm's GPU ids, the positions of the
  node's gres.conf File= entries, which on the usual configurations, AutoDetect=nvml or
  File=/dev/nvidia[0-N], are the devices' minor numbers), else from CUDA_VISIBLE_DEVICES (UUIDs,
  or numbers taken as minor numbers). The machine's other GPUs belong to other jobs.
- Without GPUs the devices are simulated slots: as many as --devices (BUNGEE_SIM_DEVICES) says;
  Slurm 22.05 puts no count of a gres other than gpu in a job's environment, so the pool passes
  it; without one, the allocation's CPUs (SLURM_CPUS_ON_NODE).
- Workers on other machines reach the node at the machine's host name, unless told otherwise.

Everything here is a pure function of the environment; agent.main applies it by giving the
command line's flags these defaults (a flag given on the command line still wins).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from agent.devices.api import GpuSelection
from elastic.wire import NODE_NAME_PATTERN, slurm_node_name

MODES = ("auto", "on", "off")
"""--slurm: inside a Slurm job if SLURM_JOB_ID is set (auto), always (on), or never (off)."""


class SlurmEnvironmentError(ValueError):
    """The environment does not describe a Slurm job the agent can serve; the message quotes
    the variable and value at fault."""


@dataclass(frozen=True)
class SlurmAllocation:
    """What the agent takes from its Slurm job's environment."""

    job_id: str
    slurm_node: str
    gpus: GpuSelection | None
    """The allocation's GPUs; None where Slurm gave it none."""
    cpus: int | None
    """SLURM_CPUS_ON_NODE, where set."""
    pool: str = ""
    """BUNGEE_SLURM_POOL, which the pool's batch script sets: the pool the agent belongs to."""

    @property
    def node_name(self) -> str:
        return slurm_node_name(self.slurm_node, self.job_id, self.pool)


def _numbers(variable: str, text: str) -> frozenset[int]:
    """ "0,2" or "0-3,6" -> the numbers; raises SlurmEnvironmentError quoting the value."""
    found: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise SlurmEnvironmentError(f"{variable}={text!r} is not a list of GPU numbers")
        found.update(range(int(low), int(high or low) + 1))
    return frozenset(found)


def gpus_of(environ: Mapping[str, str]) -> GpuSelection | None:
    """The job's GPUs from SLURM_JOB_GPUS, else CUDA_VISIBLE_DEVICES; None if neither names
    one. Raises SlurmEnvironmentError for a value it cannot read."""
    job_gpus = environ.get("SLURM_JOB_GPUS", "").strip()
    if job_gpus:
        return GpuSelection(minors=_numbers("SLURM_JOB_GPUS", job_gpus))
    visible = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if not visible or visible == "NoDevFiles":
        return None
    items = [item.strip() for item in visible.split(",")]
    if all(item.startswith("GPU-") for item in items):
        return GpuSelection(uuids=frozenset(items))
    return GpuSelection(minors=_numbers("CUDA_VISIBLE_DEVICES", visible))


def detect(mode: str, environ: Mapping[str, str], pool: str = "") -> SlurmAllocation | None:
    """The allocation the agent serves under `mode` (one of MODES), or None when it is not a
    Slurm job's agent; `pool` is the portal's Slurm pool the job belongs to, if any (the pool's
    batch script sets BUNGEE_SLURM_POOL, which AgentSettings reads). Raises SlurmEnvironmentError when `mode` is "on" outside a Slurm job, or
    when the job's variables are missing or unreadable."""
    if mode not in MODES:
        raise SlurmEnvironmentError(f"--slurm {mode!r} is not one of {', '.join(MODES)}")
    job_id = environ.get("SLURM_JOB_ID", "").strip()
    if mode == "off" or (mode == "auto" and not job_id):
        return None
    if not job_id:
        raise SlurmEnvironmentError("--slurm on, but SLURM_JOB_ID is not set: this is not a Slurm job")
    if not job_id.isdigit():
        raise SlurmEnvironmentError(f"SLURM_JOB_ID={job_id!r} is not a job id")
    slurm_node = environ.get("SLURMD_NODENAME", "").strip()
    if not slurm_node:
        raise SlurmEnvironmentError(f"SLURM_JOB_ID={job_id} but SLURMD_NODENAME is not set: run the agent as the batch script")
    if not re.fullmatch(NODE_NAME_PATTERN, slurm_node):
        raise SlurmEnvironmentError(f"SLURMD_NODENAME={slurm_node!r} cannot be part of a node name ({NODE_NAME_PATTERN})")
    cpus = environ.get("SLURM_CPUS_ON_NODE", "").strip()
    return SlurmAllocation(
        job_id=job_id, slurm_node=slurm_node, gpus=gpus_of(environ), cpus=int(cpus) if cpus.isdigit() else None,
        pool=pool,
    )


def agent_environ(environ: Mapping[str, str], allocation: SlurmAllocation, host_name: str) -> dict[str, str]:
    """`environ` with the defaults of an agent serving `allocation` on the machine `host_name`:
    its node name always (only --name overrides it: one BUNGEE_NODE_NAME for every job would
    make their agents one node), its address and simulated slot count where unset."""
    defaults = dict(environ)
    defaults["BUNGEE_NODE_NAME"] = allocation.node_name
    if not defaults.get("BUNGEE_NODE_ADDRESS"):
        defaults["BUNGEE_NODE_ADDRESS"] = host_name
    if not defaults.get("BUNGEE_SIM_DEVICES") and allocation.cpus:
        defaults["BUNGEE_SIM_DEVICES"] = str(allocation.cpus)
    return defaults


def backend_for(allocation: SlurmAllocation, requested: str) -> str:
    """The device backend of an agent serving `allocation` when `requested` was asked for:
    "auto" is nvml where Slurm gave GPUs, else simulated (never the machine's GPUs, which are
    other jobs'). Raises SlurmEnvironmentError for nvml without a GPU in the allocation."""
    if requested == "nvml" and allocation.gpus is None:
        raise SlurmEnvironmentError(
            f"--backend nvml, but Slurm job {allocation.job_id} has no GPU (neither SLURM_JOB_GPUS nor "
            "CUDA_VISIBLE_DEVICES is set): submit it with --gres=gpu:N, or use --backend simulated"
        )
    if requested == "auto":
        return "nvml" if allocation.gpus is not None else "simulated"
    return requested


def gpu_selection(allocation: SlurmAllocation | None, backend: str) -> GpuSelection | None:
    """The GPUs the nvml backend is limited to: the allocation's; None outside Slurm or for
    another backend."""
    return allocation.gpus if allocation is not None and backend == "nvml" else None
