"""The trace-driven simulator on tiny workloads whose answers we can work out by hand, the trace
reader, and the bench script's public surface (flags and the final JSON line)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from elastic.scheduling import ThroughputModel, get_policy
from elastic.simulator.engine import Simulation, SimulationConfig, SimulationResult
from elastic.simulator.experiment import run_experiment
from elastic.simulator.metrics import summarise
from elastic.simulator.traces import (
    Application,
    MeasuredSteps,
    TraceError,
    ValidationCurve,
    load_applications,
)
from elastic.simulator.workload import TraceJob, read_workload

MODEL = ThroughputModel(0.01, 0.001, 0.005, 0.001, 0.05, 0.002, 2.0)
TARGET = 30000.0


def application(name: str = "toy") -> Application:
    progress = np.array([100.0, 1000.0, TARGET])
    curves = tuple(
        ValidationCurve(batch, progress, np.array([4.0, 2.0, 1.0]), np.array([4.0, 8.0, 16.0]))
        for batch in (32, 512)
    )
    return Application(name, MODEL, 0.0, 32, 512, 4, 128, TARGET, curves)


APPS = {"toy": application()}
SMALL = SimulationConfig(nodes=2, devices_per_node=4, resize_cost_s=30.0)


def run(jobs: list[TraceJob], policy: str, config: SimulationConfig = SMALL) -> SimulationResult:
    return Simulation(jobs, APPS, get_policy(policy, resize_cost_s=config.resize_cost_s), config).run()


def test_a_lone_job_takes_its_work_over_its_throughput_plus_the_start() -> None:
    result = run([TraceJob("a", 0.0, "toy", 2, 32)], "fifo")
    job = result.jobs[0]
    expected = 30.0 + TARGET * MODEL.step_time(2, 1, 16)
    assert job.finish_s == pytest.approx(expected, rel=1e-9)
    assert job.resizes == 0 and result.unfinished == 0


def test_a_job_submitted_between_rounds_waits_for_the_next() -> None:
    job = run([TraceJob("a", 10.0, "toy", 1, 32)], "fifo").jobs[0]
    assert job.first_start_s == 60.0
    assert job.finish_s - job.spec.submitted_at == pytest.approx(
        50.0 + 30.0 + TARGET * MODEL.step_time(1, 1, 32)
    )


def test_fifo_runs_a_second_full_cluster_job_after_the_first() -> None:
    first, second = run([TraceJob("a", 0.0, "toy", 8, 32), TraceJob("b", 0.0, "toy", 8, 32)], "fifo").jobs
    assert first.finish_s is not None and second.first_start_s is not None
    assert second.first_start_s == pytest.approx(np.ceil(first.finish_s / 60.0) * 60.0)


def test_elastic_policies_finish_everything_and_beat_fifo_on_a_busy_cluster() -> None:
    jobs = [TraceJob("wide", 0.0, "toy", 8, 64)] + [
        TraceJob(f"j{i}", 60.0 * i, "toy", 1, 64) for i in range(1, 6)
    ]
    fifo = summarise(run(jobs, "fifo"))
    for policy in ("bungee", "saxena", "optimus", "tiresias"):
        summary = summarise(run(jobs, policy))
        assert summary.unfinished == 0, policy
        assert 0 < summary.useful_utilization <= summary.allocated_utilization <= 1.0 + 1e-9, policy
    assert summarise(run(jobs, "bungee")).avg_jct_s < fifo.avg_jct_s


def test_resizes_pause_the_job_and_are_counted() -> None:
    jobs = [TraceJob("big", 0.0, "toy", 1, 64), TraceJob("late", 90.0, "toy", 1, 64)]
    cheap = run(jobs, "saxena", SimulationConfig(nodes=1, devices_per_node=4, resize_cost_s=0.0))
    costly = run(jobs, "saxena", SimulationConfig(nodes=1, devices_per_node=4, resize_cost_s=30.0))
    assert cheap.jobs[0].resizes >= 1
    assert costly.jobs[0].finish_s > cheap.jobs[0].finish_s


def test_strict_consistency_keeps_the_batch() -> None:
    result = run(
        [TraceJob("a", 0.0, "toy", 2, 64)],
        "bungee",
        SimulationConfig(nodes=2, devices_per_node=4, consistency="strict"),
    )
    assert result.jobs[0].batch_size == 64
    hybrid = run([TraceJob("a", 0.0, "toy", 2, 64)], "bungee")
    assert hybrid.jobs[0].batch_size != 64


def test_learning_the_curve_online_still_finishes_every_job() -> None:
    jobs = [TraceJob(f"j{i}", 30.0 * i, "toy", 2, 64) for i in range(4)]
    config = SimulationConfig(nodes=2, devices_per_node=4, learn_throughput=True)
    simulation = Simulation(jobs, APPS, get_policy("bungee"), config)
    result = simulation.run()
    assert result.unfinished == 0
    assert all(learner.observations >= 1 for learner in simulation.learners.values())


def test_measured_steps_are_interpolated_by_shape_and_scaled_outside_their_range() -> None:
    measured = MeasuredSteps.from_rows(
        [((2,), 8.0, 1.0), ((2,), 16.0, 2.0), ((2,), 16.0, 4.0), ((2, 1), 8.0, 5.0), ((0, 6, 24), 8.0, 7.0)]
    )
    assert measured.lookup((2,), 12.0, MODEL) == pytest.approx(2.0)
    assert measured.lookup((1, 2), 8.0, MODEL) == 5.0, "node order does not matter"
    assert measured.lookup((4, 4, 4, 4, 4, 4), 8.0, MODEL) == 7.0, "beyond four nodes: nodes and replicas"
    scaled = measured.lookup((2,), 64.0, MODEL)
    assert scaled == pytest.approx(3.0 * MODEL.step_time(2, 1, 64.0) / MODEL.step_time(2, 1, 16.0))
    assert measured.lookup((3,), 8.0, MODEL) is None
    toy = Application("toy", MODEL, 0.0, 32, 512, 4, 128, TARGET, APPS["toy"].curves, measured)
    assert toy.step_time((3,), 8.0) == MODEL.step_time(3, 1, 8.0), "unmeasured shapes use the model"


def write_traces(root: Path) -> Path:
    folder = root / "traces" / "toy"
    folder.mkdir(parents=True)
    rows = ["placement,local_bsz,step_time,sync_time"]
    for placement in ("1", "2", "4", "11", "22", "44"):
        per_node = [int(c) for c in placement]
        for batch in (4, 16, 64, 128):
            rows.append(f"{placement},{batch},{MODEL.step_time(sum(per_node), len(per_node), batch)},0.0")
    (folder / "placements.csv").write_text("\n".join(rows) + "\n")
    rows = ["num_nodes,num_replicas,local_bsz,step_time,sync_time"]
    for nodes, replicas in ((4, 8), (4, 16)):
        for batch in (16, 128):
            rows.append(f"{nodes},{replicas},{batch},{MODEL.step_time(replicas, nodes, batch)},0.0")
    (folder / "scalability.csv").write_text("\n".join(rows) + "\n")
    for batch in (32, 512):
        lines = [
            "progress,iteration,metric,grad_sqr,grad_var",
            "100,100,0.1,4.0,4.0",
            f"{TARGET},{TARGET},0.9,1.0,16.0",
        ]
        (folder / f"validation-{batch}.csv").write_text("\n".join(lines) + "\n")
    workloads = root / "workloads"
    workloads.mkdir()
    jobs = ["name,time,application,num_replicas,batch_size"] + [
        f"toy-{i},{30 * i},toy,2,64" for i in range(4)
    ]
    (workloads / "workload-1.csv").write_text("\n".join(jobs) + "\n")
    return root


def test_traces_are_read_and_fitted(tmp_path: Path) -> None:
    apps = load_applications(write_traces(tmp_path))
    toy = apps["toy"]
    assert (toy.base_batch_size, toy.max_batch_size, toy.max_local_batch, toy.target_progress) == (
        32,
        512,
        128,
        TARGET,
    )
    assert toy.fit_error < 0.02
    middle = toy.gradient_noise(TARGET, 128)
    assert middle.grad_sqr == pytest.approx(1.0) and middle.grad_var == pytest.approx(16.0)
    with pytest.raises(TraceError, match="no trace folder"):
        load_applications(tmp_path / "nowhere")


def test_workload_files_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "w.csv"
    path.write_text("name,time,application\nx,1,toy\n")
    with pytest.raises(TraceError, match="lacks columns"):
        read_workload(path)
    path.write_text("name,time,application,num_replicas,batch_size\nx,soon,toy,1,8\n")
    with pytest.raises(TraceError, match="line 2"):
        read_workload(path)


def test_experiment_summarises_every_policy(tmp_path: Path) -> None:
    root = write_traces(tmp_path)
    results = run_experiment(
        [root / "workloads" / "workload-1.csv"], ["bungee", "fifo"], SMALL, root, processes=1
    )
    assert set(results) == {"bungee", "fifo"}
    assert all(s[0].jobs == 4 and s[0].unfinished == 0 for s in results.values())


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "bench" / "simulate.py"
    spec = importlib.util.spec_from_file_location("bench_simulate", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_prints_one_json_line_with_the_issue_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = write_traces(tmp_path)
    bench = _bench()
    assert (
        bench.main(
            [
                "--workload",
                str(root / "workloads" / "workload-1.csv"),
                "--traces",
                str(root),
                "--processes",
                "1",
            ]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(line) == ["bench", "avg_jct_s", "p99_jct_s", "utilization", "resizes_per_job"]
    assert line["bench"] == "simulate"
    assert set(line["avg_jct_s"]) == {"bungee", "fifo", "tiresias", "optimus", "saxena"}


def test_bench_decision_time_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = write_traces(tmp_path)
    bench = _bench()
    assert (
        bench.main(
            ["--decision-time", "--traces", str(root), "--policies", "bungee", "--decision-sizes", "8,16"]
        )
        == 0
    )
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["bench"] == "decision_time"
    assert set(line["p50_ms"]) == set(line["p95_ms"]) == {"8", "16"}


def test_bench_flags_are_pinned() -> None:
    bench = _bench()
    parser_flags = set()
    for action in bench.build_parser()._actions:
        parser_flags.update(action.option_strings)
    assert parser_flags == {
        "-h",
        "--help",
        "--workload",
        "--load",
        "--resize-cost",
        "--start-cost",
        "--round",
        "--policies",
        "--strict",
        "--learn-throughput",
        "--no-remaining-work",
        "--remaining-error",
        "--traces",
        "--processes",
        "--quick",
        "--decision-time",
        "--decision-sizes",
    }
