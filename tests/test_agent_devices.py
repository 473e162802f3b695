"""The agent's device backends: simulated CPU slots measured from real processes, the pure
parts of the NVML backend, and the registry that picks a backend by name."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from agent.devices import (
    BackendUnavailableError,
    DeviceError,
    NotSupportedError,
    UnknownBackendError,
    UnknownDeviceError,
    backend_names,
    make_backend,
    registry,
)
from agent.devices.nvml import GpuProcess, NvmlBackend, classify_processes, with_descendants
from agent.devices.simulated import (
    PACE_ENV,
    SLOWDOWN_ENV,
    SimulatedBackend,
    simulated_power_w,
    simulated_temperature_c,
)
from elastic.wire import DeviceSample

SLEEPY = "import time\ntime.sleep(600)\n"
BURNS = (
    "import sys, time\n"
    "for _ in sys.stdin:\n"
    "    end = time.process_time() + 0.1\n"
    "    while time.process_time() < end:\n"
    "        pass\n"
    "    print('burnt', flush=True)\n"
)
"""Burns 0.1 s of CPU for each line it reads, then says so; idle in between, gone at EOF."""


def _spawn(code: str, piped: bool = False) -> subprocess.Popen[bytes]:
    pipe = subprocess.PIPE if piped else None
    return subprocess.Popen([sys.executable, "-c", code], stdin=pipe, stdout=pipe)


def _burn(process: subprocess.Popen[bytes]) -> None:
    """Has a BURNS process (or one whose child it is) burn 0.1 s of CPU, and waits until it did."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(b"burn\n")
    process.stdin.flush()
    assert process.stdout.readline() == b"burnt\n"


def _cpu_s(pids: list[int]) -> float:
    """The CPU time (user and system) these processes used so far, as /proc counts it."""
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _sample_around_a_burn(
    backend: SimulatedBackend, workers: dict[int, tuple[int, int]], burner: subprocess.Popen[bytes], pids: list[int]
) -> tuple[list[DeviceSample], float, float]:
    """Samples `backend` twice with a burn of `burner` between, and returns the second sample
    with the bounds of the CPU percent of `pids` over the backend's window, measured here from
    their CPU times and the clock read on either side of each sample: whatever share of a core
    the machine gave them, the backend must report a value between the two."""
    before_first, cpu_before_first = time.monotonic(), _cpu_s(pids)
    backend.sample(workers)  # psutil measures between two readings
    after_first, cpu_after_first = time.monotonic(), _cpu_s(pids)
    _burn(burner)
    before_second, cpu_before_second = time.monotonic(), _cpu_s(pids)
    samples = backend.sample(workers)
    after_second, cpu_after_second = time.monotonic(), _cpu_s(pids)
    low = 100 * (cpu_before_second - cpu_after_first) / (after_second - before_first)
    high = 100 * (cpu_after_second - cpu_before_first) / (before_second - after_first)
    return samples, min(100.0, low), min(100.0, high)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                pipe.close()  # a BURNS child of it reads EOF and ends


def _nvml_works() -> bool:
    try:
        NvmlBackend().close()
    except BackendUnavailableError:
        return False
    return True


# --- simulated -------------------------------------------------------------------------------


def test_simulated_slots_are_numbered_cpu_slots_with_a_share_of_memory() -> None:
    backend = SimulatedBackend(slots=3, node_name="node-x")
    devices = backend.devices()
    assert [d.index for d in devices] == [0, 1, 2]
    assert {d.kind for d in devices} == {"cpu-slot"}
    assert len({d.uuid for d in devices}) == 3
    share = psutil.virtual_memory().total // 3
    assert {d.memory_total_bytes for d in devices} == {share}
    assert backend.name == "simulated"


def test_simulated_uuids_are_stable_per_node_and_differ_between_nodes() -> None:
    first = [d.uuid for d in SimulatedBackend(slots=2, node_name="node-x").devices()]
    again = [d.uuid for d in SimulatedBackend(slots=2, node_name="node-x").devices()]
    other = [d.uuid for d in SimulatedBackend(slots=2, node_name="node-y").devices()]
    assert first == again
    assert not set(first) & set(other)


def test_simulated_defaults_to_one_slot_per_cpu() -> None:
    assert len(SimulatedBackend().devices()) == os.cpu_count()


def test_simulated_refuses_zero_slots() -> None:
    with pytest.raises(DeviceError, match="slots=0"):
        SimulatedBackend(slots=0)


def test_a_pace_paces_every_slot_and_a_played_slowdown_stretches_one_slots_compute_on_top() -> None:
    backend = SimulatedBackend(slots=2, pace=4.0)
    backend.set_slowdown(1, 2.5)
    assert [backend.placement(i).env for i in (0, 1)] == [
        {PACE_ENV: "4.0"}, {PACE_ENV: "4.0", SLOWDOWN_ENV: "2.5"}]
    assert SimulatedBackend(slots=1).placement(0).env == {}, "no pace: the worker runs flat out"


@pytest.mark.parametrize("pace", [0.5, 101.0, float("nan")])
def test_a_pace_outside_1_to_100_is_refused(pace: float) -> None:
    with pytest.raises(DeviceError, match="pace is from 1 to 100"):
        SimulatedBackend(slots=1, pace=pace)


def test_a_pace_is_for_simulated_slots_only() -> None:
    with pytest.raises(DeviceError, match="is for simulated slots"):
        make_backend("nvml", pace=2.0)


def test_idle_slots_read_zero_with_the_model_at_idle() -> None:
    samples = SimulatedBackend(slots=2).sample({})
    assert [s.index for s in samples] == [0, 1]
    for sample in samples:
        assert sample.utilization_pct == 0
        assert sample.memory_used_bytes == 0
        assert sample.processes == []
        assert not sample.owner_present
        assert sample.temperature_c == simulated_temperature_c(0)
        assert sample.power_w == simulated_power_w(0)


def test_utilisation_rises_while_a_busy_process_runs_on_its_slot(processes: list) -> None:
    busy = _spawn(BURNS, piped=True)
    processes.append(busy)
    backend = SimulatedBackend(slots=2)
    workers = {busy.pid: (7, 1)}
    (idle, loaded), low, high = _sample_around_a_burn(backend, workers, busy, [busy.pid])
    assert idle.utilization_pct == 0 and idle.processes == []
    assert low - 0.1 <= loaded.utilization_pct <= high + 0.1, (low, loaded.utilization_pct, high)
    assert loaded.utilization_pct > idle.utilization_pct
    assert loaded.temperature_c is not None and loaded.temperature_c > simulated_temperature_c(0)
    assert loaded.power_w is not None and loaded.power_w > simulated_power_w(0)
    assert loaded.memory_used_bytes > 0
    [process] = loaded.processes
    assert (process.pid, process.ours, process.job_id) == (busy.pid, True, 7)
    assert process.memory_bytes == loaded.memory_used_bytes
    assert not loaded.owner_present


def test_utilisation_counts_the_children_of_a_worker(processes: list) -> None:
    parent = _spawn(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {BURNS!r}])\n", piped=True)
    processes.append(parent)
    _burn(parent)  # its child answers: it runs
    [child] = psutil.Process(parent.pid).children()
    backend = SimulatedBackend(slots=1)
    [sample], low, high = _sample_around_a_burn(backend, {parent.pid: (1, 0)}, parent, [parent.pid, child.pid])
    assert low - 0.1 <= sample.utilization_pct <= high + 0.1, (low, sample.utilization_pct, high)
    assert sample.utilization_pct > 0, "the child's CPU counts"
    assert [p.pid for p in sample.processes] == [parent.pid]


def test_a_worker_that_is_gone_is_left_out(processes: list) -> None:
    gone = _spawn("pass")
    gone.wait()
    [sample] = SimulatedBackend(slots=1).sample({gone.pid: (1, 0)})
    assert sample.processes == [] and sample.utilization_pct == 0


def test_owner_comes_back_and_leaves_again() -> None:
    backend = SimulatedBackend(slots=2)
    backend.set_owner_present(1, True)
    free, taken = backend.sample({})
    assert not free.owner_present and free.processes == []
    assert taken.owner_present
    [owner] = taken.processes
    assert (owner.name, owner.ours, owner.pid) == ("owner", False, 0)
    backend.set_owner_present(1, False)
    assert not any(s.owner_present for s in backend.sample({}))


def test_a_slot_that_does_not_exist_is_refused() -> None:
    backend = SimulatedBackend(slots=2)
    with pytest.raises(UnknownDeviceError, match="index 2"):
        backend.set_owner_present(2, True)
    with pytest.raises(UnknownDeviceError, match="index 5"):
        backend.placement(5)


def test_a_slot_is_placed_on_cpu_and_pinned_to_its_core() -> None:
    cores = sorted(os.sched_getaffinity(0))
    backend = SimulatedBackend(slots=len(cores) + 1)
    placement = backend.placement(0)
    assert placement.device == "cpu"
    assert placement.cpu_affinity == frozenset({cores[0]})
    # A slot beyond the cores this process may use is not pinned.
    assert backend.placement(len(cores)).cpu_affinity is None


# --- nvml: the parts that need no GPU --------------------------------------------------------


def test_processes_of_our_workers_are_ours_and_any_other_means_the_owner_is_back() -> None:
    names = {10: "python", 11: "python", 99: "blender"}.__getitem__
    found = [GpuProcess(10, 2**30), GpuProcess(11, None)]
    processes, owner = classify_processes(found, {10: 3, 11: 3}, names)
    assert not owner
    assert [(p.pid, p.ours, p.job_id, p.memory_bytes) for p in processes] == [
        (10, True, 3, 2**30),
        (11, True, 3, 0),
    ]
    processes, owner = classify_processes([*found, GpuProcess(99, 5)], {10: 3, 11: 3}, names)
    assert owner
    assert [(p.pid, p.name, p.ours, p.job_id) for p in processes][-1] == (99, "blender", False, None)


def test_a_process_with_compute_and_graphics_contexts_is_listed_once() -> None:
    found = [GpuProcess(10, 100), GpuProcess(10, 300)]
    processes, owner = classify_processes(found, {}, lambda pid: "x")
    assert [(p.pid, p.memory_bytes) for p in processes] == [(10, 300)]
    assert owner


def test_an_empty_gpu_has_no_owner() -> None:
    assert classify_processes([], {}, str) == ([], False)


def test_children_of_workers_count_as_ours(processes: list) -> None:
    parent = _spawn(f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {SLEEPY!r}])\n")
    processes.append(parent)
    deadline = time.monotonic() + 10
    while not psutil.Process(parent.pid).children() and time.monotonic() < deadline:
        time.sleep(0.05)
    [child] = psutil.Process(parent.pid).children()
    try:
        assert with_descendants({parent.pid: (4, 0)}) == {parent.pid: 4, child.pid: 4}
    finally:
        child.kill()


@pytest.mark.skipif(_nvml_works(), reason="this machine has a GPU")
def test_nvml_without_a_gpu_is_unavailable() -> None:
    with pytest.raises(BackendUnavailableError, match="NVML"):
        make_backend("nvml")


def test_nvml_refuses_simulated_options() -> None:
    with pytest.raises(DeviceError, match="slots=4"):
        make_backend("nvml", slots=4)


# --- registry --------------------------------------------------------------------------------


def test_backends_by_name() -> None:
    assert backend_names() == ["auto", "nvml", "simulated"]
    backend = make_backend("simulated", slots=2)
    assert isinstance(backend, SimulatedBackend) and len(backend.devices()) == 2


def test_an_unknown_backend_names_the_known_ones() -> None:
    with pytest.raises(UnknownBackendError, match=r"'tpu'.*auto, nvml, simulated"):
        make_backend("tpu")


def test_auto_simulates_where_nvml_finds_no_gpu() -> None:
    backend = make_backend("auto", slots=3)
    if _nvml_works():
        assert backend.name == "nvml"
    else:
        assert backend.name == "simulated" and len(backend.devices()) == 3
    backend.close()


def test_a_name_cannot_be_registered_twice() -> None:
    with pytest.raises(ValueError, match="'simulated'"):
        registry.register("simulated", SimulatedBackend)


def test_real_hardware_cannot_play_an_owner() -> None:
    # NotSupportedError is what set_owner_present raises on NVML; without a GPU, check the
    # method on an instance whose NVML setup is skipped.
    backend = object.__new__(NvmlBackend)
    backend._devices = SimulatedBackend(slots=1).devices()  # type: ignore[attr-defined]
    with pytest.raises(NotSupportedError, match="real GPU"):
        backend.set_owner_present(0, True)
