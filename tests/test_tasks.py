"""The task interface (elastic.tasks): a task is imported from its own directory with nothing of
another task on the path, bound to a job's hyperparameters and seed, read item by item, and its
failures are the user's errors, with the user's traceback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from elastic.tasks.api import TaskDefinitionError, UserCodeError
from elastic.tasks.loader import load_task_class
from elastic.tasks.runtime import bind_task
from elastic.worker.data import SampleStream
from elastic.worker.trainer import Trainer

RINGS = Path(__file__).parent / "tasks" / "rings"


def write_task(directory: Path, **files: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / f"{name}.py").write_text(textwrap.dedent(text))
    return directory


MINIMAL = """
    import torch
    from helper import WIDTH

    class Task:
        def __init__(self, hyperparameters):
            self.hp = hyperparameters
        def model(self):
            return torch.nn.Linear(WIDTH, 1)
        def optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.1)
        def train_data(self):
            return [(torch.ones(WIDTH), torch.zeros(1)) for _ in range(10)]
        def loss(self, model, batch):
            x, y = batch
            return ((model(x) - y) ** 2).mean()
"""


def test_each_task_imports_its_own_modules_even_when_names_clash(tmp_path: Path) -> None:
    one = write_task(tmp_path / "one", task=MINIMAL, helper="WIDTH = 3\n")
    two = write_task(tmp_path / "two", task=MINIMAL, helper="WIDTH = 5\n")
    assert bind_task(one, "task:Task", {"batch_size": 2}, seed=0).model.in_features == 3
    assert bind_task(two, "task:Task", {"batch_size": 2}, seed=0).model.in_features == 5
    assert bind_task(one, "task:Task", {"batch_size": 2}, seed=0).model.in_features == 3


def test_the_model_depends_only_on_the_seed() -> None:
    first = bind_task(RINGS, "task:RingsTask", {}, seed=11)
    torch.manual_seed(99)
    again = bind_task(RINGS, "task:RingsTask", {}, seed=11)
    other = bind_task(RINGS, "task:RingsTask", {}, seed=12)
    pairs = list(zip(first.model.state_dict().values(), again.model.state_dict().values(), strict=True))
    assert all(torch.equal(a, b) for a, b in pairs)
    assert not torch.equal(first.model[0].weight, other.model[0].weight)


def test_items_are_read_only_when_a_step_needs_them_and_collated_by_the_task() -> None:
    task = bind_task(RINGS, "task:RingsTask", {}, seed=0)
    assert task.dataset.reads == 0 and task.num_samples == 600
    features, rings = task.batch(torch.tensor([5, 1, 7]))
    assert task.dataset.reads == 3
    assert features.shape == (3, 3) and rings.shape == (3,)
    assert torch.allclose(features[:, 2], features[:, :2].norm(dim=1))


def test_metrics_of_loss_and_of_the_evaluation() -> None:
    task = bind_task(RINGS, "task:RingsTask", {}, seed=0)
    task.loss(task.batch(range(24)))
    assert set(task.metrics) == {"accuracy"} and 0 <= task.metrics["accuracy"] <= 1
    whole = task.evaluate(batch_size=1000)
    assert set(whole) == {"accuracy", "loss"}
    assert task.evaluate(batch_size=7)["accuracy"] == pytest.approx(whole["accuracy"])
    assert task.model.training, "evaluation leaves the model training"


def test_the_test_task_trains_through_the_runtime_trainer() -> None:
    task = bind_task(RINGS, "task:RingsTask", {"batch_size": 30}, seed=1)
    trainer = Trainer(
        task,
        task.make_optimizer(),
        SampleStream(task.num_samples, 1),
        batch_size=30,
        seed=1,
        rank=0,
        world_size=1,
        reduce=lambda buffer: None,
    )
    before = task.evaluate()["accuracy"]
    for step in range(200):
        trainer.step(step, stop_requested=False)
    assert task.evaluate()["accuracy"] > max(0.9, before)


@pytest.mark.parametrize(
    ("files", "entrypoint", "message"),
    [
        ({"task": "import not_installed_anywhere\n"}, "task:Task", "No module named 'not_installed_anywhere'"),
        ({"task": "raise RuntimeError('at import')\n"}, "task:Task", "RuntimeError: at import"),
        ({"task": "X = 1\n"}, "task:Task", "defines no class 'Task'"),
        ({"task": "class Task:\n    def model(self): pass\n"}, "task:Task", "does not define optimizer, train_data, loss"),
        ({"task": MINIMAL, "helper": "WIDTH = 1\n"}, "task", "not of the form module:ClassName"),
        ({"task": MINIMAL, "helper": "WIDTH = 1\n"}, "missing:Task", "importing 'missing'"),
    ],
)
def test_a_task_that_cannot_be_loaded_says_why(
    tmp_path: Path, files: dict[str, str], entrypoint: str, message: str
) -> None:
    directory = write_task(tmp_path / "bad", **files)
    with pytest.raises(TaskDefinitionError) as caught:
        load_task_class(directory, entrypoint)
    assert message in str(caught.value)


def test_a_module_outside_the_task_directory_is_not_the_task(tmp_path: Path) -> None:
    directory = write_task(tmp_path / "task", task=MINIMAL, helper="WIDTH = 1\n")
    with pytest.raises(TaskDefinitionError, match="is not in the job's code"):
        load_task_class(directory, "json:JSONDecoder")


def test_hyperparameters_are_checked_by_the_tasks_schema() -> None:
    with pytest.raises(TaskDefinitionError) as caught:
        bind_task(RINGS, "task:RingsTask", {"hidden": 0, "colour": "red"}, seed=0)
    assert "hidden" in str(caught.value) and "colour" in str(caught.value)


def test_a_task_without_a_schema_still_needs_a_batch_size(tmp_path: Path) -> None:
    directory = write_task(tmp_path / "plain", task=MINIMAL, helper="WIDTH = 2\n")
    with pytest.raises(TaskDefinitionError, match="batch_size must be a positive integer, not None"):
        bind_task(directory, "task:Task", {}, seed=0)


def test_an_exception_in_loss_is_the_users_error_with_their_traceback() -> None:
    task = bind_task(RINGS, "task:RingsTask", {"fail_at_call": 2}, seed=0)
    task.loss(task.batch(range(4)))
    with pytest.raises(UserCodeError) as caught:
        task.loss(task.batch(range(4)))
    assert "loss(model, batch) raised ValueError: the task's own bug, at call 2" in str(caught.value)
    assert f"{RINGS / 'task.py'}" in caught.value.traceback_text


def test_a_loss_that_is_no_scalar_is_refused(tmp_path: Path) -> None:
    directory = write_task(
        tmp_path / "vector",
        task=MINIMAL.replace("return ((model(x) - y) ** 2).mean()", "return (model(x) - y) ** 2"),
        helper="WIDTH = 2\n",
    )
    task = bind_task(directory, "task:Task", {"batch_size": 2}, seed=0)
    with pytest.raises(UserCodeError, match="must return a scalar tensor"):
        task.loss(task.batch([0, 1]))


def test_a_job_starts_from_another_jobs_model_only_if_it_fits(tmp_path: Path) -> None:
    trained = bind_task(RINGS, "task:RingsTask", {"hidden": 8}, seed=1)
    torch.nn.init.constant_(trained.model[0].weight, 0.5)
    torch.save(trained.model.state_dict(), tmp_path / "model.pt")
    fresh = bind_task(RINGS, "task:RingsTask", {"hidden": 8}, seed=2)
    fresh.load_initial_model(tmp_path / "model.pt", "job 4")
    for name, value in trained.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], value), name
    wider = bind_task(RINGS, "task:RingsTask", {"hidden": 9}, seed=2)
    with pytest.raises(UserCodeError, match="(?s)init_from: the final model of job 4 does not load .*size mismatch"):
        wider.load_initial_model(tmp_path / "model.pt", "job 4")


def test_the_resnet_example_reads_seeded_augmented_items_and_trains() -> None:
    resnet = Path(__file__).parent.parent / "examples" / "resnet"
    full = load_task_class(resnet, "task:ResNetTask")
    with torch.device("meta"):  # the shapes alone
        assert 11.1e6 < sum(p.numel() for p in full(full.Hyperparameters()).model().parameters()) < 11.3e6
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a narrow model's many small kernels: threads only wait for each other
    try:
        _train_two_resnet_steps(resnet)
    finally:
        torch.set_num_threads(threads)


def _train_two_resnet_steps(resnet: Path) -> None:
    task = bind_task(resnet, "task:ResNetTask", {"batch_size": 8, "width": 2, "images": 64}, seed=1)
    reads = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        reads.append(task.dataset[3][0])
    assert torch.equal(reads[0], reads[1]) and not torch.equal(reads[0], reads[2])  # crop and flip from torch's generator
    trainer = Trainer(task, task.make_optimizer(), SampleStream(task.num_samples, 1), batch_size=8, seed=1, rank=0,
                      world_size=1, reduce=lambda buffer: None)  # fmt: skip
    outcomes = [trainer.step(step, stop_requested=False) for step in range(2)]
    assert all(torch.isfinite(torch.tensor(outcome.loss)) for outcome in outcomes)
    assert 0 <= trainer.metrics["accuracy"] <= 1
