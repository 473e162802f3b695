"""A model and its optimiser sharded with torch's `fully_shard` (FSDP2) over a generation's
process group, and re-cut over the next generation's in memory.

`fully_shard` binds a module to one device mesh for good, so a generation's sharded module is
made afresh from a skeleton: a copy of the task's model on the meta device (no memory), sharded
over the new mesh unit by unit, then given real memory for its local shards only. Those local
shards, and the optimiser's (Adam's moments are sharded like their parameters), are filled by
elastic.worker.reshard straight from the old generation's shards: survivors keep the rows they
hold, the rest crosses the group once. Buffers (batch-norm statistics) are not sharded: a
survivor copies its own, a joiner receives them whole (elastic.worker.transfer). The optimiser
stays the same object, its parameter groups pointed at the new parameters, so whatever holds it
(a learning-rate scheduler) goes on.

Units: the task's optional `shard_units(model)`, else every direct child that holds parameters;
then the root. A tied parameter (an embedding shared with the output layer) is one parameter of
the module and is sharded once, in the first unit that holds it.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from elastic.tasks.api import TaskDefinitionError
from elastic.worker.reshard import Membership, ReshardPlan, TensorLayout, execute, plan_reshard, shard_rows
from elastic.worker.transfer import move_state

UnitPicker = Callable[[torch.nn.Module], Sequence[torch.nn.Module]]


def default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every direct child of `model` that holds parameters, in order (the root comes after)."""
    return [child for child in model.children() if any(True for _ in child.parameters())]


def checked_units(model: torch.nn.Module, units: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    """`units` if each is a submodule of `model` other than the root, once. Raises
    TaskDefinitionError naming shard_units and what was wrong."""
    names = {id(module): name for name, module in model.named_modules()}
    chosen: list[torch.nn.Module] = []
    for index, unit in enumerate(units):
        if not isinstance(unit, torch.nn.Module):
            raise TaskDefinitionError(
                f"shard_units(model) returned {type(unit).__name__} at {index}, not a module"
            )
        if id(unit) not in names:
            raise TaskDefinitionError(
                f"shard_units(model) returned a {type(unit).__name__} at {index} that is not in the model"
            )
        if unit is model or unit in chosen:
            what = (
                "the model itself (the root is always a unit)"
                if unit is model
                else f"{names[id(unit)]} twice"
            )
            raise TaskDefinitionError(f"shard_units(model) returned {what}")
        chosen.append(unit)
    return chosen


def units_for(task: Any) -> UnitPicker:
    """The task's `shard_units` if it defines one, else default_units."""
    picker = getattr(task, "shard_units", None)
    return default_units if picker is None else picker


def tied_groups(units: Sequence[torch.nn.Module]) -> list[list[torch.nn.Module]]:
    """`units` in order, those that share a parameter (tied weights) grouped together: fully_shard
    shards a parameter in one group only, so an embedding and the output layer that reuses its
    weight are sharded as one unit."""
    groups: list[list[torch.nn.Module]] = []
    held: list[set[int]] = []
    for unit in units:
        mine = {id(p) for p in unit.parameters()}
        hits = [index for index, ids in enumerate(held) if ids & mine]
        if not hits:
            groups.append([unit])
            held.append(mine)
            continue
        first = hits[0]
        for index in reversed(hits[1:]):
            groups[first].extend(groups.pop(index))
            held[first] |= held.pop(index)
        groups[first].append(unit)
        held[first] |= mine
    return groups


def shard(model: torch.nn.Module, mesh: DeviceMesh, pick: UnitPicker) -> torch.nn.Module:
    """Shards `model` in place over `mesh`: each unit `pick` returns (checked_units; units that
    share parameters as one, tied_groups), then the root. Returns the model."""
    for group in tied_groups(checked_units(model, pick(model))):
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def mesh_of(group: dist.ProcessGroup | None, device: torch.device) -> DeviceMesh:
    """A one-dimensional device mesh over `group` (the default group if None)."""
    world = dist.group.WORLD
    assert world is not None, "no default process group"
    return DeviceMesh.from_group(group if group is not None else world, device.type)


@dataclass(frozen=True)
class ShardedOutline:
    """What a worker needs to take part in a reshard without holding anything yet: for each
    parameter (in the model's order) its optimiser state, each sharded tensor as a
    TensorLayout of the whole tensor and each other value as itself, and the parameter groups'
    settings. Picklable, small; a holder makes it (outline_of)."""

    state: tuple[dict[str, Any], ...]
    param_groups: tuple[dict[str, Any], ...]


def _cut_like(value: Any, parameter: torch.Tensor) -> bool:
    """Whether optimiser state `value` of `parameter` is cut as the parameter is: a DTensor, or
    (a model not sharded yet: a world of one) a tensor of the parameter's shape."""
    if isinstance(value, DTensor):
        return True
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == parameter.shape


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def outline_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ShardedOutline:
    """The outline of a model's optimiser state (see ShardedOutline): a sharded model's, or a
    whole one's, whose holder then stands for an old world of one."""
    state = []
    for parameter in model.parameters():
        entries = optimizer.state.get(parameter, {})
        state.append(
            {
                name: TensorLayout(tuple(value.shape), value.dtype)
                if _cut_like(value, parameter)
                else (value.detach().clone() if isinstance(value, torch.Tensor) else value)
                for name, value in entries.items()
            }
        )
    groups = tuple({k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups)
    return ShardedOutline(tuple(state), groups)


def full_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimiser's state_dicts with every sharded tensor put back together,
    on the CPU: plain torch state that loads with no mesh (a checkpoint, the job's model.pt). A
    collective over the module's mesh: every member calls it."""
    model_state = {
        name: (value.full_tensor() if isinstance(value, DTensor) else value.detach()).to("cpu", copy=True)
        for name, value in module.state_dict().items()
    }
    saved = optimizer.state_dict()
    saved["state"] = {
        index: {
            name: (value.full_tensor().to("cpu", copy=True) if isinstance(value, DTensor) else value)
            for name, value in entries.items()
        }
        for index, entries in saved["state"].items()
    }
    return model_state, saved


def _sharded_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[list[TensorLayout], list[torch.Tensor]]:
    """The layouts and this rank's local shards of every tensor cut along dim 0: the
    parameters, then each parameter's optimiser tensors cut like it, by name. Of a model not
    sharded, the whole tensors: the one shard of a world of one."""
    layouts, locals_ = [], []
    parameters = list(model.parameters())
    for parameter in parameters:
        layouts.append(TensorLayout(tuple(parameter.shape), parameter.dtype))
        locals_.append(_local(parameter))
    for parameter in parameters:
        entries = optimizer.state.get(parameter, {})
        for name in sorted(entries):
            value = entries[name]
            if _cut_like(value, parameter):
                layouts.append(TensorLayout(tuple(value.shape), value.dtype))
                locals_.append(_local(value))
    return layouts, locals_


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` whose parameters and buffers are on the meta device (no memory), tied
    parameters still tied: each tensor is copied once, as deepcopy's memo does for any object
    met twice. (`.to("meta")` makes a new parameter per module and unties them.)"""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = torch.nn.Parameter(
            torch.empty_like(parameter, device="meta"), requires_grad=parameter.requires_grad
        )
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


@dataclass(frozen=True)
class ReshardResult:
    model: torch.nn.Module | None
    """This rank's module of the new generation; None for a leaver."""
    plan: ReshardPlan
    buffer_bytes: int
    """Bytes of buffers sent whole to joiners."""
    phases: dict[str, float]
    """Seconds this rank spent making the new module and its optimiser state ("build"), moving
    the rows ("move") and the buffers ("buffers")."""


class ShardedModel:
    """A task's model as a skeleton on the meta device, from which each generation's sharded
    module is made (see the module docstring). `full` is the model as the task built it: its
    values are the initial state when no worker holds any."""

    def __init__(self, full: torch.nn.Module, pick: UnitPicker, device: torch.device) -> None:
        self.skeleton = meta_copy(full)
        self.pick = pick
        self.device = device
        checked_units(self.skeleton, pick(self.skeleton))

    def sharded(self, mesh: DeviceMesh) -> torch.nn.Module:
        """A new module of the skeleton's layout sharded over `mesh`, its memory allocated but
        not set (to_empty)."""
        module = shard(copy.deepcopy(self.skeleton), mesh, self.pick)
        return module.to_empty(device=self.device)

    def first(
        self,
        full: torch.nn.Module,
        mesh: DeviceMesh,
        optimizer: torch.optim.Optimizer | None = None,
        optimizer_state: dict[str, Any] | None = None,
    ) -> torch.nn.Module:
        """The first generation's module: `full`'s values sharded over `mesh` (every member
        holds the same `full`, so each takes its own rows). `optimizer`, if given, holds
        `full`'s parameters and ends pointed at the new module's; with `optimizer_state` (a
        plain state_dict of such an optimiser: full_state's, a checkpoint's) its state is cut
        the same way. Raises ValueError if the optimiser holds a tensor that is not one of
        `full`'s parameters."""
        module = self.sharded(mesh)
        size, rank = mesh.size(), mesh.get_local_rank()
        with torch.no_grad():
            values = dict(full.named_parameters())
            for name, parameter in module.named_parameters():
                assert isinstance(parameter, DTensor)
                whole = values[name].detach()
                start, stop = shard_rows(whole.shape[0], size, rank)
                parameter.to_local().copy_(whole[start:stop])
            for mine, given in zip(module.buffers(), full.buffers(), strict=True):
                mine.copy_(given)
        if optimizer is None:
            return module
        parameters = list(full.parameters())
        place = {id(p): index for index, p in enumerate(parameters)}
        held = [place.get(id(p), -1) for group in optimizer.param_groups for p in group["params"]]
        state: list[dict[str, Any]] = [{} for _ in parameters]
        saved = optimizer_state["state"] if optimizer_state is not None else {}
        for index, entries in saved.items():
            whole_parameter = parameters[held[int(index)]]
            state[held[int(index)]] = {
                name: self._cut(value, whole_parameter, mesh) for name, value in entries.items()
            }
        groups = (
            [{k: v for k, v in group.items() if k != "params"} for group in optimizer_state["param_groups"]]
            if optimizer_state is not None
            else [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        )
        self._point(optimizer, full, module, state, groups)
        return module

    def _cut(self, value: Any, parameter: torch.Tensor, mesh: DeviceMesh) -> Any:
        """An optimiser state value of a whole parameter as the sharded optimiser holds it: a
        tensor shaped like the parameter becomes a DTensor of this rank's rows, anything else
        (a step count) is copied."""
        if not isinstance(value, torch.Tensor):
            return value
        if value.shape != parameter.shape or value.dim() == 0:
            return value.detach().clone()
        start, stop = shard_rows(value.shape[0], mesh.size(), mesh.get_local_rank())
        local = value.detach()[start:stop].to(self.device, copy=True).contiguous()
        return DTensor.from_local(
            local, mesh, (Shard(0),), run_check=False, shape=value.shape, stride=value.stride()
        )

    def reshard(
        self,
        bound: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        outline: ShardedOutline,
        membership: Membership,
        rank: int,
        mesh: DeviceMesh | None,
    ) -> ReshardResult:
        """Moves the sharded model and `optimizer`'s state to a new module sharded over `mesh`
        (the new generation's; None for a leaver), over the default process group, which holds
        every member of `membership` (leavers included) at the group ranks it names.
        `optimizer` holds the parameters of `bound`: for a holder its module of the old
        generation, whose shards it gives (or the whole model, held by the one member of an
        old world of one: a restored checkpoint); for a joiner whatever its build made. `outline` comes
        from a holder (outline_of). The optimiser ends pointed at the new module's parameters,
        with the moved state. Every member calls it. Raises ShardsLostError if a crashed worker
        held rows no one else has, and what torch.distributed raises."""
        began = time.perf_counter()
        member = membership.member(rank)
        module = self.sharded(mesh) if member.new_rank is not None and mesh is not None else None
        layouts = [TensorLayout(tuple(p.shape), p.dtype) for p in self.skeleton.parameters()]
        for entries in outline.state:
            layouts.extend(
                entries[name] for name in sorted(entries) if isinstance(entries[name], TensorLayout)
            )
        plan = plan_reshard(layouts, membership)
        old_shards = _sharded_tensors(bound, optimizer)[1] if member.old_rank is not None else []
        new_state: list[dict[str, Any]] = []
        new_shards: list[torch.Tensor] = []
        if module is not None:
            assert mesh is not None
            new_shards = [p.to_local() for p in module.parameters()]  # type: ignore[attr-defined]
            for entries in outline.state:
                new_state.append(self._state_like(entries, mesh, new_shards))
        built = time.perf_counter()
        with torch.no_grad():
            execute(plan, rank, old_shards, new_shards)
            moved = time.perf_counter()
            buffer_bytes = self._move_buffers(
                bound if member.old_rank is not None else None, module, membership, rank
            )
        if module is not None:
            self._point(optimizer, bound, module, new_state, outline.param_groups)
        phases = {"build": built - began, "move": moved - built, "buffers": time.perf_counter() - moved}
        return ReshardResult(module, plan, buffer_bytes, phases)

    def _state_like(
        self, entries: dict[str, Any], mesh: DeviceMesh, shards: list[torch.Tensor]
    ) -> dict[str, Any]:
        """One parameter's optimiser state over `mesh` as `entries` (an outline's) describes it:
        each sharded tensor a DTensor over fresh local memory, which is appended to `shards`
        (in the order reshard's layouts list them), each other value a copy."""
        made: dict[str, Any] = {}
        for name in sorted(entries):
            value = entries[name]
            if not isinstance(value, TensorLayout):
                made[name] = value.clone() if isinstance(value, torch.Tensor) else value
                continue
            local = torch.empty(
                value.local_shape(mesh.size(), mesh.get_local_rank()), dtype=value.dtype, device=self.device
            )
            shards.append(local)
            made[name] = DTensor.from_local(
                local,
                mesh,
                (Shard(0),),
                run_check=False,
                shape=torch.Size(value.shape),
                stride=torch.empty(value.shape, device="meta").stride(),
            )
        return made

    def _move_buffers(
        self, held: torch.nn.Module | None, new: torch.nn.Module | None, membership: Membership, rank: int
    ) -> int:
        """Survivors copy their buffers (`held`'s) into the new module; joiners receive them
        whole from one holder (see below). Returns the bytes sent."""
        if held is not None and new is not None:
            for mine, kept in zip(new.buffers(), held.buffers(), strict=True):
                mine.copy_(kept)
        holders = sorted(
            (m.old_rank, m.new_rank is None, m.rank) for m in membership.members if m.old_rank is not None
        )
        joiners = [m.rank for m in membership.members if m.old_rank is None]
        if not joiners or not holders or not any(True for _ in self.skeleton.buffers()):
            return 0
        # One source: each worker's statistics are its own (as with DDP), and a joiner takes
        # one worker's whole, the lowest old rank's that stays (else the lowest's that leaves).
        survivors = [entry for entry in holders if not entry[1]]
        sources = [(survivors or holders)[0][2]]
        if new is not None:
            buffers = list(new.buffers())
        elif rank in sources and held is not None:
            buffers = list(held.buffers())
        else:  # a leaver that sends nothing takes part in move_state's barrier only
            buffers = [
                torch.empty(b.shape, dtype=b.dtype, device=self.device) for b in self.skeleton.buffers()
            ]
        return move_state(buffers, sources, joiners, rank, relay=False).bytes_moved

    @staticmethod
    def _point(
        optimizer: torch.optim.Optimizer,
        bound: torch.nn.Module,
        module: torch.nn.Module,
        state: list[dict[str, Any]],
        settings: Sequence[dict[str, Any]],
    ) -> None:
        """Points `optimizer` from `bound`'s parameters to the same ones of `module` (by their
        place in the model), with `state` per parameter (by place) and each group's `settings`.
        Raises ValueError if the optimiser holds a tensor that is not one of `bound`'s."""
        place = {id(p): index for index, p in enumerate(bound.parameters())}
        parameters = list(module.parameters())
        for group, given in zip(optimizer.param_groups, settings, strict=True):
            if any(id(p) not in place for p in group["params"]):
                raise ValueError("the optimiser holds a tensor that is not one of the model's parameters")
            group["params"] = [parameters[place[id(p)]] for p in group["params"]]
            group.update(given)
        optimizer.state.clear()
        for parameter, entries in zip(parameters, state, strict=True):
            if entries:
                optimizer.state[parameter] = entries
