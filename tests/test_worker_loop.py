"""The worker's training loop (elastic.worker.loop) with a fake trainer, without processes or a
process group: it trains to the end, or to the step at which a stop or a switch is agreed; rank
0 saves the checkpoint (at the end, at a stop, and periodically in the background) and every rank
waits for it; rank 0 measures the pause of a switch from the step ends around it."""

from __future__ import annotations

import io
import math
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from elastic.spec import JobSpec
from elastic.wire import WorkerEvent
from elastic.worker import COMPLETED_EXIT_CODE, STOPPED_EXIT_CODE
from elastic.worker.checkpoint import checkpoint_path, load_checkpoint
from elastic.worker.event_codec import decode
from elastic.worker.events import EventWriter, ProgressReporter
from elastic.worker.loop import PAUSE_STEPS, CheckpointSaver, ResizeMeter, SwitchAgreed, TrainingLoop
from elastic.worker.position import WorkerPosition
from elastic.worker.step_clock import StepClock
from elastic.worker.stop import StoppedStarting, StopRequest
from elastic.worker.trainer import CollectiveError, StepOutcome, SwitchVote, vote
from tests.membership_support import record
from tests.test_worker_events import CONFIG

TOTAL_STEPS = 10
SPEC = JobSpec(name="loop", workload="digits-mlp", steps=TOTAL_STEPS, seed=3)
BATCH = 8


class FakeTrainer:
    """Steps without computing. What the group agrees on at each step is what this rank asks
    for, or what the test scripts another rank to ask for (`stop_after`, `switch_after`)."""

    def __init__(
        self,
        stop_after: int | None = None,
        switch_after: dict[int, int] | None = None,
        fail_at: int | None = None,
        skip: set[int] | None = None,
    ) -> None:
        self.batch_size = BATCH
        self.skip = skip or set()
        self.lr = 0.1
        self.metrics = {"accuracy": 0.5}
        self.stop_after = stop_after
        self.switch_after = switch_after or {}
        self.fail_at = fail_at
        self.steps: list[tuple[int, bool, int]] = []
        self.context = torch.zeros(3)

    def step(self, step: int, stop_requested: bool, switch_to: SwitchVote = 0) -> StepOutcome:
        if step == self.fail_at:
            raise CollectiveError(f"the all-reduce of step {step} failed: a peer is gone")
        switch_to = vote(switch_to)
        self.steps.append((step, stop_requested, switch_to))
        self.context += 1
        done = step + 1
        return StepOutcome(
            step=done,
            loss=math.nan if done in self.skip else 1.0 / done,
            samples=BATCH,
            stop=stop_requested or done == self.stop_after,
            switch_to=switch_to or self.switch_after.get(done, 0),
            skipped=done in self.skip,
        )

    def batch_start(self, step: int) -> int:
        return step * BATCH

    def small_state(self) -> dict[str, Any]:
        return {"steps_seen": len(self.steps)}

    def bulk_state(self) -> list[torch.Tensor]:
        return [self.context]


class Harness:
    """A loop of one rank, the parts it drives, and what it did."""

    def __init__(
        self,
        tmp_path: Path,
        trainer: FakeTrainer,
        rank: int = 0,
        step: int = 0,
        pending: int = 0,
        checkpoint_every_s: float = 3600.0,
        barrier_fails: bool = False,
        eval_every_steps: int | None = None,
    ) -> None:
        self.stream = io.StringIO()
        self.events = EventWriter(CONFIG, self.stream)
        self.trainer = trainer
        self.position = WorkerPosition(rank=rank, step=step, holds_state=True, membership=record(1, [0, 1]))
        self.stop = StopRequest()
        self.model = torch.nn.Linear(2, 1)
        self.path = checkpoint_path(str(tmp_path))
        self.saver = CheckpointSaver(
            self.path,
            SPEC,
            self.model,
            torch.optim.SGD(self.model.parameters(), lr=0.1),
            trainer,  # type: ignore[arg-type]
            self.events,
        )
        self.resizes = ResizeMeter(self.events, TOTAL_STEPS)
        self.barriers = 0
        self._barrier_fails = barrier_fails
        self.calls: list[tuple[Any, ...]] = []
        """Evaluations and exports, in order, with the barriers passed by then."""
        self.loop = TrainingLoop(
            trainer,  # type: ignore[arg-type]
            self.position,
            StepClock(self.events, every_s=3600.0),
            ProgressReporter(self.events, TOTAL_STEPS, BATCH, samples_per_epoch=80, every_s=3600.0),
            self.events,
            self.stop,
            self.saver,
            self.resizes,
            TOTAL_STEPS,
            checkpoint_every_s,
            pending=lambda: pending,
            barrier=self._barrier,
            export=lambda step, ended, loss: self.calls.append(("export", step, ended, self.barriers)),
            evaluate=lambda step: self.calls.append(("evaluate", step)),
            eval_every_steps=eval_every_steps,
        )

    def _barrier(self) -> None:
        self.barriers += 1
        if self._barrier_fails:
            raise RuntimeError("a peer is gone")

    def emitted(self, kind: str | None = None) -> list[WorkerEvent]:
        key = {"job_id": CONFIG.job_id, "generation": CONFIG.generation, "rank": CONFIG.rank}
        events = [decode(key, line) for line in self.stream.getvalue().splitlines()]
        return [event for event in events if kind is None or event.kind == kind]

    def logs(self) -> list[str]:
        return [event.message or "" for event in self.emitted("log")]


def test_rank_0_trains_to_the_end_saves_and_waits_for_every_rank(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer())
    assert run.loop.train() == COMPLETED_EXIT_CODE
    assert [step for step, _, _ in run.trainer.steps] == list(range(TOTAL_STEPS))
    assert run.position.step == TOTAL_STEPS
    assert run.position.last_step_end is not None
    saved = load_checkpoint(run.path)
    assert saved is not None
    assert (saved.step, saved.workload, saved.seed) == (TOTAL_STEPS, "digits-mlp", 3)
    assert saved.trainer == {"steps_seen": TOTAL_STEPS}
    assert torch.equal(saved.trainer_tensors[0], torch.full((3,), float(TOTAL_STEPS)))
    assert run.barriers == 1
    progress = run.emitted("progress")
    assert progress[0].step == 1
    assert progress[-1].step == TOTAL_STEPS
    assert run.logs() == [f"completed all {TOTAL_STEPS} steps"]


def test_rank_0_evaluates_on_schedule_and_exports_once_every_rank_has_the_checkpoint(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(), eval_every_steps=4)
    assert run.loop.train() == COMPLETED_EXIT_CODE
    evaluations = [call[1] for call in run.calls if call[0] == "evaluate"]
    assert evaluations == list(range(4, TOTAL_STEPS, 4)), "every 4 steps; the end's is the export's"
    assert run.calls[-1] == ("export", TOTAL_STEPS, "completed", 1), "after the barrier"
    assert run.emitted("progress")[-1].metrics == {"accuracy": 0.5}
    other = Harness(tmp_path / "other", FakeTrainer(), rank=1, eval_every_steps=4)
    assert other.loop.train() == COMPLETED_EXIT_CODE and other.calls == []


def test_another_rank_trains_to_the_end_and_waits_for_rank_0(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(), rank=1)
    assert run.loop.train() == COMPLETED_EXIT_CODE
    assert run.barriers == 1
    assert load_checkpoint(run.path) is None
    assert run.emitted() == []


def test_the_loop_goes_on_from_the_step_it_holds(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(), step=8)
    assert run.loop.train() == COMPLETED_EXIT_CODE
    assert [step for step, _, _ in run.trainer.steps] == [8, 9]


def test_a_stop_asked_here_ends_the_loop_after_the_step_and_saves_it(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer())
    run.stop.signal_number = signal.SIGTERM
    assert run.loop.train() == STOPPED_EXIT_CODE
    assert run.trainer.steps == [(0, True, 0)]
    saved = load_checkpoint(run.path)
    assert saved is not None and saved.step == 1
    assert run.barriers == 1
    assert "stopping at step 1" in run.logs()


def test_a_stop_agreed_by_another_rank_ends_the_loop_too(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(stop_after=3), rank=1)
    assert run.loop.train() == STOPPED_EXIT_CODE
    assert run.position.step == 3
    assert run.barriers == 1


def test_rank_0_asks_for_the_pending_generation_and_the_group_switches_after_the_step(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(), pending=5)
    assert run.loop.train() == SwitchAgreed(5)
    assert run.trainer.steps == [(0, False, 5)]
    assert run.position.step == 1
    assert run.resizes.switch_started is not None
    assert run.barriers == 0
    assert load_checkpoint(run.path) is None


def test_the_first_step_of_each_generation_is_reported_at_once(tmp_path: Path) -> None:
    # The progress period is an hour: only forced reports are written. After the switch, the
    # next generation's first step is one of them (its new batch and rate show at once).
    run = Harness(tmp_path, FakeTrainer(switch_after={3: 2}))
    assert run.loop.train() == SwitchAgreed(2)
    reported, switched_at = len(run.emitted("progress")), run.position.step
    assert run.loop.train() == COMPLETED_EXIT_CODE
    after = [event.step for event in run.emitted("progress")][reported:]
    assert after == [switched_at + 1, TOTAL_STEPS], after


def test_a_switch_asked_by_rank_0_ends_the_loop_of_another_rank(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(switch_after={4: 2}), rank=1)
    assert run.loop.train() == SwitchAgreed(2)
    assert run.position.step == 4


def test_rank_0_saves_the_checkpoint_in_the_background_when_it_is_due(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(switch_after={3: 2}), checkpoint_every_s=1e-9)
    assert run.loop.train() == SwitchAgreed(2)
    run.saver.finish()
    saved = load_checkpoint(run.path)
    assert saved is not None and saved.step == 2  # the step of the switch is not saved


def test_a_failed_step_leaves_the_state_of_the_last_completed_one(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(fail_at=4))
    with pytest.raises(CollectiveError, match="step 4"):
        run.loop.train()
    assert run.position.step == 4


def test_a_failed_barrier_after_saving_is_a_collective_error(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(), barrier_fails=True)
    with pytest.raises(CollectiveError, match="the barrier after saving failed: a peer is gone"):
        run.loop.train()


# --- resize measurement ----------------------------------------------------------------------


def _meter() -> tuple[ResizeMeter, io.StringIO]:
    stream = io.StringIO()
    return ResizeMeter(EventWriter(CONFIG, stream), TOTAL_STEPS), stream


def _events(stream: io.StringIO) -> list[WorkerEvent]:
    key = {"job_id": CONFIG.job_id, "generation": CONFIG.generation, "rank": CONFIG.rank}
    return [decode(key, line) for line in stream.getvalue().splitlines()]


def test_the_pause_of_a_switch_is_the_gap_around_it_less_a_normal_step() -> None:
    meter, stream = _meter()
    meter.announce(
        record(3, [0, 1, 2], joiners=[2]),
        "memory",
        ["node-t/0", "node-t/1"],
        step=7,
        rank=0,
        bytes_moved=2048,
        phases={"rendezvous": 0.25, "exchange": 0.125, "transfer": 0.125},
        last_step_end=100.0,
        sources=2,
    )
    ends = [102.0, 103.0, 104.0, 105.0, 105.5, 106.5]
    assert len(ends) == PAUSE_STEPS + 1
    for end in ends[:-1]:
        meter.step_ended(end, now=False)
    assert [event.kind for event in _events(stream)] == ["log"]
    meter.step_ended(ends[-1], now=False)
    log, resized = _events(stream)
    assert (
        log.message == "generation 3: 2 -> 3 workers at step 7 of 10, world size 3; 2.0 kB from 2 holder(s)"
    )
    assert resized.kind == "resized"
    assert (resized.step, resized.members_before, resized.members_after) == (
        7,
        ["node-t/0", "node-t/1"],
        ["node-t/0", "node-t/1", "node-t/2"],
    )
    assert resized.pause_s == 1.0  # 2 s between the steps, less the median step of 1 s
    assert resized.bytes_moved == 2048
    assert resized.phases == {"rendezvous": 0.25, "exchange": 0.125, "transfer": 0.125, "first_step": 1.5}
    # Sent after the pace is known, dated when the resize landed: the first step's end.
    assert resized.at == 102.0 and log.at > 106.5
    meter.report()
    assert len(_events(stream)) == 2  # reported once


def test_a_switch_reported_early_takes_the_steps_before_it_as_normal() -> None:
    meter, stream = _meter()
    for seconds in (0.5, 0.75, 1.0):
        meter.step_took(seconds)
    meter.announce(
        record(2, [0]), "memory", ["node-t/0", "node-t/1"], 4, 0, 0, {}, last_step_end=10.0, sources=0
    )
    meter.step_ended(12.0, now=True)
    log, resized = _events(stream)
    assert log.message == "generation 2: 2 -> 1 workers at step 4 of 10, world size 1; nothing to move"
    assert resized.pause_s == 1.25


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("fresh", "starting from step 0 of 10, world size 2"),
        ("checkpoint", "resumed from the periodic checkpoint at step 6 of 10, world size 2"),
    ],
)
def test_a_start_without_holders_has_no_pause(how: str, message: str) -> None:
    meter, stream = _meter()
    meter.announce(record(1, [0, 1]), how, [], 6 if how == "checkpoint" else 0, 0, 0, {}, 50.0, 0)
    meter.step_ended(52.0, now=True)
    log, resized = _events(stream)
    assert (log.message or "").startswith(message)
    assert resized.pause_s is None


def test_only_rank_0_measures_a_switch() -> None:
    meter, stream = _meter()
    meter.announce(record(2, [0, 1]), "memory", ["node-t/0"], 4, 1, 0, {}, 10.0, 0)
    meter.step_ended(12.0, now=True)
    meter.report()
    assert _events(stream) == []


def test_skipped_steps_are_logged_and_never_reported_as_a_loss(tmp_path: Path) -> None:
    run = Harness(tmp_path, FakeTrainer(skip={1, 4, 5, 6, 10}))
    assert run.loop.train() == COMPLETED_EXIT_CODE
    assert run.loop.skipped_steps == 5
    skipped = [line for line in run.logs() if "was skipped" in line]
    assert len(skipped) == 3 and skipped[0].startswith("step 1: the loss was not finite"), skipped
    progress = run.emitted("progress")
    assert progress and all(math.isfinite(event.loss) for event in progress if event.loss is not None)
    assert run.calls[-1][:3] == ("export", TOTAL_STEPS, "completed")


@pytest.fixture
def restored_stop_signals() -> Any:
    """The test process's own SIGTERM and SIGINT handlers, put back after the test."""
    saved = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGINT)}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def test_a_stop_while_starting_raises_once_and_after_settling_only_sets_the_flag(restored_stop_signals: Any) -> None:
    stop = StopRequest()
    stop.install(starting=True)
    with pytest.raises(StoppedStarting, match="stopped by SIGTERM while starting"):
        signal.raise_signal(signal.SIGTERM)
    assert stop.requested and stop.signal_number == signal.SIGTERM
    signal.raise_signal(signal.SIGINT)  # a second signal while the start unwinds: the flag only
    assert stop.signal_number == signal.SIGINT

    settled = StopRequest()
    settled.install(starting=True)
    settled.settle()
    signal.raise_signal(signal.SIGTERM)
    assert settled.requested

    plain = StopRequest()
    plain.install()
    signal.raise_signal(signal.SIGINT)
    assert plain.requested and plain.signal_number == signal.SIGINT


class CountingClock(StepClock):
    """The loop's clock, counting the steps it was told were done (where a pace would sleep)."""

    def __init__(self, events: EventWriter) -> None:
        super().__init__(events, every_s=3600.0, pace=10.0)
        self.paced = 0

    def step_done(self) -> None:
        self.paced += 1


@pytest.mark.parametrize(("trainer", "ends"), [
    (FakeTrainer(switch_after={4: 2}), SwitchAgreed(2)), (FakeTrainer(stop_after=4), STOPPED_EXIT_CODE)])
def test_a_paced_loop_paces_every_step_but_the_one_that_switches_or_stops(
    tmp_path: Path, trainer: FakeTrainer, ends: Any
) -> None:
    run = Harness(tmp_path, trainer, rank=1)
    run.loop.clock = clock = CountingClock(run.events)
    assert run.loop.train() == ends
    assert run.position.step == 4 and clock.paced == 3
