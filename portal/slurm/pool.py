"""One pass of the Slurm pool: read the pool's agent jobs from squeue and the demand from the
database, decide (portal.slurm.sizing), cancel and submit, and record what it did and what
failed for the Scheduler page. A Slurm command that fails ends the pass with an error event; the
next pass starts again from what squeue says, so nothing is done twice.

An agent job is a batch script that execs `PYTHON -m agent --slurm --portal URL --token-file
FILE [--devices N] ARGS...`: the agent is the batch shell itself, so `--signal=B:TERM@GRACE`
reaches it, and its node is named from the Slurm node and the job (elastic.wire.slurm_node_name),
which is how a pass finds each agent job's node. `--requeue` puts an agent killed by a
preemption back in the queue; one that drained and left within its grace has ended (COMPLETED),
and the pool submits again for the demand that is left."""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.db import transaction
from django.db.models import Count, Max
from django.utils import timezone

from elastic.wire import SLURM_GIVE_BACK_COMMENT, DrainNotice, slurm_node_name
from portal.cluster import drain
from portal.cluster.models import Node
from portal.jobs.models import Allocation, Job, Worker
from portal.jobs.services import usable_devices
from portal.jobs.states import ACTIVE_STATES
from portal.slurm.commands import SlurmCommandError, SlurmCommands, SlurmJob
from portal.slurm.config import PoolConfig
from portal.slurm.models import SlurmAgentJob, SlurmPoolEvent, SlurmPoolPass
from portal.slurm.sizing import AgentJob, Phase, PoolDecision, PoolLimits, size_pool

log = logging.getLogger(__name__)

EVENTS_KEPT = 200
LEAVING_NODE_STATES = frozenset({Node.State.DRAINING, Node.State.DRAINED})


@dataclass
class PassResult:
    decision: PoolDecision | None = None
    submitted: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    error: str | None = None


def wanted_devices() -> int:
    """The devices the active jobs want: each its pin if pinned, else its maximum."""
    bounds = Job.objects.filter(state__in=ACTIVE_STATES).values_list("pinned_workers", "max_workers")
    return sum(pin if pin is not None else maximum for pin, maximum in bounds)


def sbatch_options(config: PoolConfig) -> list[str]:
    """The options of an agent job's sbatch."""
    options = [
        f"--job-name={config.job_name}",
        f"--gres={config.gres}",
        f"--signal=B:TERM@{config.grace_s}",
        "--requeue",
        "--nodes=1",
        "--ntasks=1",
        f"--output={config.output}",
        f"--chdir={config.workdir}",
        f"--export={config.export}",
    ]
    for flag, value in (("--partition", config.partition), ("--account", config.account),
                        ("--qos", config.qos), ("--time", config.time_limit)):
        if value:
            options.append(f"{flag}={value}")
    return [*options, *config.sbatch_args]


def agent_script(config: PoolConfig) -> str:
    """The batch script of an agent job. With a gres other than gpu the agent is told its device
    count: Slurm 22.05 puts no count of such a gres in the job's environment (a gpu's are in
    SLURM_JOB_GPUS, which the agent reads). Its data directory is set whatever --export passes:
    without it the agent's state would land under the work directory."""
    command = [config.python, "-m", "agent", "--slurm", "--portal", config.portal_url, "--token-file", config.token_file]
    if config.gres_name != "gpu":
        command += ["--devices", str(config.devices_per_agent)]
    command += config.agent_args
    return (
        "#!/bin/bash\n# A Bungee agent of the portal's Slurm pool (portal.slurm.pool).\n"
        f"export BUNGEE_SLURM_POOL={shlex.quote(config.pool)} BUNGEE_SLURM_SIGNAL_S={config.grace_s} "
        f"BUNGEE_DATA_DIR={shlex.quote(config.agent_data_dir)}\n"
        "exec " + shlex.join(command) + "\n"
    )


def record(kind: str, message: str, slurm_job_id: int | None = None) -> None:
    """Keeps an event for the Scheduler page (a SlurmPoolEvent.Kind) and logs it."""
    SlurmPoolEvent.objects.create(kind=kind, message=message[:2000], slurm_job_id=slurm_job_id)
    (log.warning if kind == SlurmPoolEvent.Kind.ERROR else log.info)("slurm pool: %s", message)


def _when(seconds: float | None) -> datetime | None:
    return datetime.fromtimestamp(seconds, tz=UTC) if seconds else None


def _idle_since(names: list[str]) -> dict[str, datetime]:
    """When each of the nodes `names` last had a worker of a job: its last worker's exit, by
    node name (nodes that never held one are not listed)."""
    return {
        name: at for name, at in Worker.objects.filter(node__name__in=names).values("node__name")
        .annotate(last=Max("exited_at")).values_list("node__name", "last") if at is not None
    }


def _observe(listed: list[SlurmJob], now: datetime, pool: str) -> list[AgentJob]:
    """The pool's agent jobs as the sizing sees them, and their rows brought up to date (rows of
    jobs no longer listed deleted).

    An agent's node is leaving (never an idle give-back) once it drains, for whatever reason:
    draining or drained while its Slurm job still runs, or lost mid-drain (a registration
    clears the cause). Its idle clock starts when its node really became idle, not at the pass
    that noticed: the last exit of a worker there, else when its Slurm job started; a pass that
    sees a job there (an allocation or a running worker) restarts it."""
    names = {job.job_id: slurm_node_name(job.batch_host, job.job_id, pool) for job in listed if job.batch_host}
    known = {name: (state, cause) for name, state, cause in Node.objects.filter(name__in=names.values())
             .values_list("name", "state", "drain_cause")}
    busy = set(Allocation.objects.filter(device__node__name__in=names.values()).values_list("device__node__name", flat=True))
    busy |= set(Worker.objects.filter(node__name__in=names.values(), state=Worker.State.RUNNING)
                .values_list("node__name", flat=True))
    last_exit = _idle_since(list(names.values()))
    usable = dict(
        usable_devices().filter(node__name__in=names.values()).values("node__name")
        .annotate(count=Count("id")).values_list("node__name", "count")
    )
    rows = {row.slurm_job_id: row for row in SlurmAgentJob.objects.all()}
    agents: list[AgentJob] = []
    with transaction.atomic():
        SlurmAgentJob.objects.exclude(slurm_job_id__in=[job.job_id for job in listed]).delete()
        for job in listed:
            name = names.get(job.job_id, "")
            node_state, drain_cause = known.get(name, ("", ""))
            if job.pending:
                phase = Phase.PENDING
            elif job.started and (node_state in LEAVING_NODE_STATES or drain_cause):
                phase = Phase.LEAVING  # its agent said it leaves: Slurm preempts it, or its time is up
            elif job.started:
                phase = Phase.ONLINE if name in known else Phase.STARTING
            else:
                phase = Phase.LEAVING
            row = rows.get(job.job_id) or SlurmAgentJob(
                slurm_job_id=job.job_id, submitted_at=_when(job.submit_time) or now
            )
            row.state, row.phase, row.node_name = job.state, phase, name
            row.started_at = _when(job.start_time) if job.started else None
            if phase != Phase.ONLINE:
                row.busy_at = None
            elif name in busy:
                row.busy_at = now
            else:
                # The latest of: a pass that saw a job there, its last worker's exit, its start.
                row.busy_at = max([at for at in (row.busy_at, last_exit.get(name), row.started_at) if at is not None],
                                  default=now)
            row.save()
            if phase == Phase.ONLINE and row.busy_at is not None:
                idle_for = max(0.0, (now - row.busy_at).total_seconds())
            elif phase == Phase.STARTING and row.started_at is not None:
                idle_for = max(0.0, (now - row.started_at).total_seconds())
            else:
                idle_for = 0.0
            agents.append(AgentJob(job.job_id, phase, idle_for, usable.get(name, 0) if phase == Phase.ONLINE else 0))
    return agents


def _giving_back(node_name: str, config: PoolConfig) -> None:
    """The node of an agent job the pool cancels drains for that reason (its agent's own notice,
    which reads the job's comment to say the same, comes after and changes nothing)."""
    node = Node.objects.filter(name=node_name).first() if node_name else None
    if node is not None:
        deadline_at = (timezone.now() + timedelta(seconds=config.grace_s)).timestamp()
        drain.draining(node, DrainNotice(cause="slurm_pool_idle", deadline_at=deadline_at))


def run_pass(config: PoolConfig, commands: SlurmCommands, user: str, now: datetime | None = None) -> PassResult:
    """Sizes the pool once; returns what it did (and the error that ended it, if one did)."""
    now = now or timezone.now()
    result = PassResult()
    try:
        agents = _observe(commands.jobs(config.job_name, user), now, config.pool)
        wanted, usable = wanted_devices(), usable_devices().count()
        limits = PoolLimits(config.devices_per_agent, config.max_agents, config.idle_s, config.start_timeout_s)
        decision = result.decision = size_pool(wanted, usable, agents, limits)
        counts = {phase: sum(1 for a in agents if a.phase == phase) for phase in Phase}
        SlurmPoolPass.objects.update_or_create(pk=1, defaults={
            "at": now, "wanted_devices": wanted, "usable_devices": usable, "unmet_devices": decision.unmet_devices,
            "pending": counts[Phase.PENDING], "starting": counts[Phase.STARTING], "online": counts[Phase.ONLINE],
        })
        nodes = dict(SlurmAgentJob.objects.filter(slurm_job_id__in=list(decision.cancel)).values_list(
            "slurm_job_id", "node_name"))
        for job_id, why in decision.cancel.items():
            _giving_back(nodes.get(job_id, ""), config)
            commands.scancel([job_id], comment=SLURM_GIVE_BACK_COMMENT if job_id in decision.idle else "")
            result.cancelled.append(job_id)
            record(SlurmPoolEvent.Kind.CANCELLED, f"cancelled agent job {job_id}: {why}", job_id)
        if decision.submit:
            try:
                Path(config.output).parent.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                record(SlurmPoolEvent.Kind.ERROR, f"cannot make the folder of BUNGEE_SLURM_OUTPUT={config.output!r}: {err}")
        options, script = sbatch_options(config), agent_script(config)
        for _ in range(decision.submit):
            job_id = commands.sbatch(options, script)
            result.submitted.append(job_id)
            SlurmAgentJob.objects.create(slurm_job_id=job_id, state="PENDING", phase=Phase.PENDING, submitted_at=now)
            record(
                SlurmPoolEvent.Kind.SUBMITTED,
                f"submitted agent job {job_id} ({config.gres}) for {decision.unmet_devices} devices wanted "
                f"beyond the {usable} usable",
                job_id,
            )
    except SlurmCommandError as err:
        result.error = str(err)
        record(SlurmPoolEvent.Kind.ERROR, result.error)
    finally:
        stale = SlurmPoolEvent.objects.values_list("id", flat=True)[EVENTS_KEPT:]
        SlurmPoolEvent.objects.filter(id__in=list(stale)).delete()
    return result
