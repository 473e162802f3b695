"""The NVML backend against a real NVIDIA GPU: what it reads, and whose processes it sees.

Skipped where NVML finds no GPU (the CI machine has none). Run on a GPU machine with
`python -m pytest tests/test_nvml_gpu.py`; the figures from the last such run are in
bench/results/.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from agent.devices.api import BackendUnavailableError
from agent.devices.nvml import NvmlBackend
from elastic.wire import DeviceSample


def _backend_or_none() -> NvmlBackend | None:
    try:
        return NvmlBackend()
    except BackendUnavailableError:
        return None


pytestmark = pytest.mark.skipif(
    (probe := _backend_or_none()) is None, reason="NVML finds no GPU on this machine"
)
if probe is not None:
    probe.close()

# Holds 1 GiB on GPU 0 and keeps it busy with matrix products until stdin closes.
_GPU_LOAD = """
import sys, threading, torch
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
held = torch.empty(1 << 28, dtype=torch.float32, device="cuda:0")
a = torch.randn(4096, 4096, device="cuda:0")
print("ready", flush=True)
while not stop.is_set():
    for _ in range(20):
        a = torch.tanh(a @ a)
    torch.cuda.synchronize()
"""


@pytest.fixture
def backend() -> Iterator[NvmlBackend]:
    b = NvmlBackend()
    yield b
    b.close()


@pytest.fixture
def gpu_load() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _GPU_LOAD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


def _sample_until(backend: NvmlBackend, workers: dict[int, tuple[int, int]], pid: int) -> DeviceSample:
    """GPU 0's first sample that lists `pid` and shows it busy (NVML's counters lag a little)."""
    deadline = time.monotonic() + 20
    while True:
        sample = backend.sample(workers)[0]
        if any(p.pid == pid for p in sample.processes) and sample.utilization_pct > 0:
            return sample
        assert time.monotonic() < deadline, f"NVML never showed pid {pid} busy: {sample}"
        time.sleep(0.5)


def test_devices_are_described_from_nvml(backend: NvmlBackend) -> None:
    devices = backend.devices()
    assert devices
    for d in devices:
        assert d.kind == "gpu"
        assert d.uuid.startswith("GPU-"), d.uuid
        assert d.memory_total_bytes > 1 << 30
        assert d.name
        print(f"GPU {d.index}: {d.name} {d.uuid} {d.memory_total_bytes / 2**30:.1f} GiB")


def test_a_workers_process_is_ours_and_the_owner_absent(
    backend: NvmlBackend, gpu_load: subprocess.Popen[str]
) -> None:
    sample = _sample_until(backend, {gpu_load.pid: (7, 0)}, gpu_load.pid)
    (process,) = [p for p in sample.processes if p.pid == gpu_load.pid]
    assert process.ours and process.job_id == 7
    assert process.memory_bytes >= 1 << 30
    assert not sample.owner_present
    assert sample.memory_used_bytes >= 1 << 30
    assert sample.temperature_c is None or 0 < sample.temperature_c < 120
    assert sample.power_w is None or sample.power_w > 0
    print(
        f"utilisation {sample.utilization_pct}%, memory {sample.memory_used_bytes / 2**30:.2f} GiB, "
        f"{sample.temperature_c} C, {sample.power_w} W, process {process}"
    )


def test_a_process_the_agent_did_not_start_means_the_owner_is_back(
    backend: NvmlBackend, gpu_load: subprocess.Popen[str]
) -> None:
    sample = _sample_until(backend, {}, gpu_load.pid)
    (process,) = [p for p in sample.processes if p.pid == gpu_load.pid]
    assert not process.ours and process.job_id is None
    assert sample.owner_present
