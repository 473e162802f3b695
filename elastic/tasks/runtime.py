"""A task bound to one job: its validated hyperparameters, the model built from the job's seed
on the worker's device, the training data, and the calls a trainer makes each step. Every call
into the task's code is wrapped so that its failure is a UserCodeError with the traceback."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures.process import BrokenProcessPool
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from torch.utils.data import default_collate

from elastic.tasks.api import Job, TaskDefinitionError, UserCodeError
from elastic.tasks.hyperparameters import hyperparameter, validate_hyperparameters
from elastic.tasks.loader import construct_task, load_task_class
from elastic.tasks.missing import missing_module_advice
from elastic.tasks.readers import ItemReaders, Stacked


@contextmanager
def blaming_the_task(what: str) -> Iterator[None]:
    """Turns any exception raised inside into a UserCodeError saying `what` failed."""
    try:
        yield
    except UserCodeError:
        raise
    except Exception as err:
        raise UserCodeError(
            f"{what} raised {type(err).__name__}: {err}{missing_module_advice(err)}", traceback.format_exc()
        ) from err


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` with every tensor in it (nested in lists, tuples and dicts) moved to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def _scalar_metric(name: Any, value: Any) -> torch.Tensor:
    """A metric the task's loss returned, as a detached one-element tensor (a number becomes a
    CPU tensor; a tensor stays where it is, unread). Raises UserCodeError for anything else."""
    try:
        tensor = torch.as_tensor(value).detach()
    except (TypeError, ValueError, RuntimeError) as err:
        raise UserCodeError(f"loss() returned metric {name!r} = {value!r:.80}, not a number or a scalar tensor") from err
    if tensor.numel() != 1 or tensor.is_complex():
        raise UserCodeError(f"loss() returned metric {name!r} = {value!r:.80}, not a number or a scalar tensor")
    return tensor.reshape(())


class BoundTask:
    """The task `task_class` built for one job on `device`: the model's initial weights depend
    only on `seed`. The task is given the job's `steps` and `seed` as its `job` (api.Job); with
    `steps` None (a task bound outside a job, in a test) it gets no `job`. Raises
    TaskDefinitionError or UserCodeError if the task's code fails."""

    def __init__(
        self,
        task_class: type[Any],
        hyperparameters: dict[str, Any],
        seed: int,
        device: torch.device,
        source: tuple[Path, str] | None = None,
        precision: str = "fp32",
        steps: int | None = None,
    ):
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, not {precision!r}")
        self.precision = precision
        """bf16: `loss` runs the task's forward and loss under torch.autocast in bfloat16."""
        self.hyperparameters = validate_hyperparameters(task_class, hyperparameters)
        self.device = device
        self.data_workers = getattr(task_class, "data_workers", 0)
        """Reader processes for the training items (elastic.tasks.readers); 0: read here."""
        if not isinstance(self.data_workers, int) or isinstance(self.data_workers, bool) or not 0 <= self.data_workers <= 64:
            raise TaskDefinitionError(f"data_workers must be an integer in 0..64, not {self.data_workers!r}")
        if self.data_workers and source is None:
            raise TaskDefinitionError("data_workers needs the task's directory and entrypoint (bind_task gives them)")
        self._source = source
        self._given_hyperparameters = dict(hyperparameters)
        self.job = None if steps is None else Job(steps=steps, seed=seed)
        self._readers: ItemReaders | None = None
        with blaming_the_task(f"{task_class.__name__}(hyperparameters)"):
            self.task = construct_task(task_class, self.hyperparameters, self.job)
        torch.manual_seed(seed)
        with blaming_the_task("model()"):
            model = self.task.model()
        if not isinstance(model, torch.nn.Module):
            raise TaskDefinitionError(f"model() returned {type(model).__name__}, not a torch.nn.Module")
        self.model: torch.nn.Module = model.to(device)
        self.model.train()
        with blaming_the_task("train_data()"):
            self.dataset = self.task.train_data()
            self.num_samples = len(self.dataset)
        if self.num_samples < 1:
            raise TaskDefinitionError("train_data() returned an empty data set")
        self._collate: Callable[[list[Any]], Any] = getattr(self.task, "collate", None) or default_collate
        self.metric_values: dict[str, torch.Tensor] = {}
        """The named metrics of the last `loss` call, if the task returns any, as the task gave
        them (scalar tensors, on the device when the task computed them there): nothing reads
        them back to the host until asked (`metrics`), so that a step needs no extra sync."""

    def load_initial_model(self, path: Path, source: str) -> None:
        """Loads the state dict at `path` (the final model of `source`) into the model, before
        any training: a job's init_from. Raises UserCodeError if it does not fit the model."""
        try:
            state = torch.load(path, map_location=self.device, weights_only=True)
            self.model.load_state_dict(state)
        except Exception as err:  # a file torch cannot read, missing or unexpected keys, shapes
            raise UserCodeError(
                f"init_from: the final model of {source} does not load into this task's model: "
                f"{type(err).__name__}: {str(err)[:1500]}"
            ) from err

    @property
    def batch_size(self) -> int:
        """The global batch size."""
        return int(hyperparameter(self.hyperparameters, "batch_size"))

    @property
    def lr(self) -> float:
        """The task's `lr` hyperparameter (hybrid mode scales it). Raises TaskDefinitionError."""
        lr = hyperparameter(self.hyperparameters, "lr")
        if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
            raise TaskDefinitionError(f"hybrid mode needs a positive hyperparameter lr, not {lr!r}")
        return float(lr)

    def make_optimizer(self) -> torch.optim.Optimizer:
        """A fresh optimiser over the model's current parameters."""
        with blaming_the_task("optimizer(model)"):
            optimizer = self.task.optimizer(self.model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TaskDefinitionError(f"optimizer() returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        return optimizer

    def make_scheduler(self, optimizer: torch.optim.Optimizer) -> LRScheduler | None:
        """The task's learning-rate scheduler over `optimizer`, or None if it defines none."""
        make = getattr(self.task, "scheduler", None)
        if make is None:
            return None
        with blaming_the_task("scheduler(optimizer)"):
            scheduler = make(optimizer)
        if scheduler is None:
            return None
        if not isinstance(scheduler, LRScheduler) or scheduler.optimizer is not optimizer:
            raise TaskDefinitionError(
                f"scheduler() returned {type(scheduler).__name__}, not a torch.optim.lr_scheduler.LRScheduler "
                "over the optimiser it was given"
            )
        if isinstance(scheduler, ReduceLROnPlateau):
            raise TaskDefinitionError(
                "scheduler() returned a ReduceLROnPlateau, which steps on a metric; Bungee steps the scheduler "
                "once per global step with no argument"
            )
        return scheduler

    def batch(self, indices: torch.Tensor | Sequence[int], seeds: Sequence[int] | None = None) -> Any:
        """The batch of the training samples `indices`, read one by one, collated, on the
        device. With `seeds` (one per item) and the task's data_workers, the items are read by
        the reader processes, each right after its generators are seeded with its seed."""
        listed = indices.tolist() if isinstance(indices, torch.Tensor) else list(indices)
        if seeds is None or not self.data_workers:
            return self._collated(self.dataset, listed)
        return to_device(self.start_reading(listed, seeds)(), self.device)

    def start_reading(self, indices: Sequence[int], seeds: Sequence[int]) -> Callable[[], Any]:
        """Hands the items `indices` (item i seeded with `seeds[i]`) to the reader processes at
        once and returns the call that waits for them and gives their batch, collated, on the
        CPU (in pinned memory where the readers stacked it for a GPU) (the task must have
        data_workers). Dropping the call without calling it cancels what is not read yet.
        The call raises UserCodeError for the task's error, RuntimeError if a reader died."""
        if self._readers is None:
            assert self._source is not None
            self._readers = ItemReaders(
                self.data_workers, *self._source, self._given_hyperparameters, self.job,
                stack=self._collate is default_collate,
            )  # fmt: skip
        try:
            pending = self._readers.start(list(indices), list(seeds), pin=self.device.type == "cuda")
        except BrokenProcessPool as err:  # a reader was killed: the node's trouble, not the code's
            raise RuntimeError(f"a data reader process died: {err}") from err

        def collect() -> Any:
            try:
                read = pending.result()
            except BrokenProcessPool as err:
                raise RuntimeError(f"a data reader process died: {err}") from err
            except Exception as err:
                remote = getattr(err.__cause__, "tb", "")  # the reader's traceback, as text
                raise UserCodeError(
                    f"reading the data set (in a data reader) raised {type(err).__name__}: {err}", str(remote)
                ) from err
            return read.batch if isinstance(read, Stacked) else self.collate(read)

        return collect

    def read_items(self, indices: Sequence[int]) -> list[Any]:
        """The training items `indices`, read here (drawing from this process's generators)."""
        with blaming_the_task("reading the data set"):
            return [self.dataset[index] for index in indices]

    def collate(self, items: list[Any]) -> Any:
        """`items` collated by the task, still on the CPU. Raises UserCodeError."""
        with blaming_the_task("collate(items)"):
            return self._collate(items)

    def close(self) -> None:
        """Stops the task's reader processes, if it has any."""
        if self._readers is not None:
            self._readers.close()
            self._readers = None

    def _collated(self, dataset: Any, indices: Sequence[int]) -> Any:
        with blaming_the_task("reading the data set"):
            items = [dataset[index] for index in indices]
        return self._collate_items(items)

    def _collate_items(self, items: list[Any]) -> Any:
        with blaming_the_task("collate(items)"):
            return to_device(self._collate(items), self.device)

    def loss(self, batch: Any, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The task's mean loss over `batch` with its model (or `model`, a wrapper of it such
        as DDP's); its named metrics go to `metrics`. Raises UserCodeError if the task raises
        or returns no scalar tensor."""
        with self._autocast(), blaming_the_task("loss(model, batch)"):
            result = self.task.loss(self.model if model is None else model, batch)
        metrics: dict[str, Any] = {}
        if isinstance(result, tuple) and len(result) == 2:
            result, metrics = result
        if not isinstance(result, torch.Tensor) or result.numel() != 1:
            raise UserCodeError(f"loss() must return a scalar tensor (or a pair of it and a dict), not {result!r:.80}")
        if not isinstance(metrics, dict):
            raise UserCodeError(f"loss() returned metrics of type {type(metrics).__name__}, not a dict")
        self.metric_values = {str(name): _scalar_metric(name, value) for name, value in metrics.items()}
        return result.reshape(())

    def _autocast(self) -> AbstractContextManager[Any]:
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    @property
    def metrics(self) -> dict[str, float]:
        """The named metrics of the last `loss` call as floats: one read from the device each."""
        return {name: float(value) for name, value in self.metric_values.items()}

    def evaluate(self, batch_size: int | None = None) -> dict[str, float]:
        """The task's metrics over its whole evaluation data, in eval mode and without
        gradients; each batch's metrics weighted by its size. Empty if the task has no
        evaluation. Leaves the model in the mode it found it in."""
        eval_data = getattr(self.task, "eval_data", None)
        evaluate = getattr(self.task, "evaluate", None)
        if eval_data is None or evaluate is None:
            return {}
        with blaming_the_task("eval_data()"):
            dataset = eval_data()
        if dataset is None:
            return {}
        size = batch_size or self.batch_size
        totals: dict[str, float] = {}
        count = 0
        training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for start in range(0, len(dataset), size):
                    indices = range(start, min(start + size, len(dataset)))
                    batch = self._collated(dataset, indices)
                    with blaming_the_task("evaluate(model, batch)"):
                        metrics = evaluate(self.model, batch)
                    for name, value in metrics.items():
                        totals[name] = totals.get(name, 0.0) + float(value) * len(indices)
                    count += len(indices)
        finally:
            self.model.train(training)
        return {name: total / count for name, total in totals.items()} if count else {}


def bind_task(
    directory: Path,
    entrypoint: str,
    hyperparameters: dict[str, Any],
    seed: int,
    device: torch.device | None = None,
    steps: int | None = None,
) -> BoundTask:
    """Imports the task `entrypoint` from `directory` and binds it to one job of `steps` steps
    (on the CPU unless `device` says otherwise). Raises TaskDefinitionError or UserCodeError."""
    task_class = load_task_class(directory, entrypoint)
    device = device or torch.device("cpu")
    return BoundTask(task_class, hyperparameters, seed, device, source=(directory, entrypoint), steps=steps)
