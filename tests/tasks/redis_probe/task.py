"""A job's code that tries what a stranger's job would do with the Redis URL of its worker's
configuration (tests/test_job_confinement.py): before it trains, it tries to write a stop
and a drain to its node's command stream, read and write another job's keys, read and push to
Celery's queue, list the keys and make a user, and prints one line, "redis probe: " and a JSON
object of each try and what Redis answered. Then it trains like any task."""

from __future__ import annotations

import json
import os
from typing import Any

import redis
import torch
from pydantic import BaseModel
from torch import nn
from torch.nn import functional
from torch.utils.data import Dataset, TensorDataset


class Hyperparameters(BaseModel):
    batch_size: int = 8
    victim_key: str
    celery_queue: str


def _attempts(client: redis.Redis, stream: str, victim: str, queue: str) -> dict[str, Any]:
    return {
        "xadd stop": lambda: client.xadd(stream, {"command": json.dumps(
            {"kind": "stop", "job_id": 1, "before_generation": 99, "reason": "cancel"})}),
        "xadd drain": lambda: client.xadd(stream, {"command": json.dumps(
            {"kind": "drain", "cause": "preempted", "deadline_s": 1})}),
        "read the node's stream": lambda: client.xrange(stream),
        "read another job's key": lambda: client.get(victim),
        "write another job's key": lambda: client.set(victim, "999"),
        "read Celery's queue": lambda: client.lrange(queue, 0, -1),
        "push to Celery's queue": lambda: client.lpush(queue, "forged"),
        "scan": lambda: client.scan(0),
        "keys": lambda: client.keys("*"),
        "acl setuser": lambda: client.acl_setuser("probe", enabled=True, nopass=True),
    }


def probe(hp: Hyperparameters) -> dict[str, str]:
    config = json.loads(os.environ["BUNGEE_WORKER_CONFIG"])
    prefix = config["coordination_key"].rsplit(":job:", 1)[0]
    stream = f"{prefix}:node:{config['node']}:commands"
    answers: dict[str, str] = {}
    with redis.Redis.from_url(config["redis_url"], socket_timeout=5) as client:
        for what, attempt in _attempts(client, stream, hp.victim_key, hp.celery_queue).items():
            try:
                answers[what] = f"allowed: {attempt()!r}"[:200]
            except redis.RedisError as err:
                answers[what] = f"{type(err).__name__}: {err}"[:200]
    return answers


class RedisProbeTask:
    Hyperparameters = Hyperparameters

    def __init__(self, hyperparameters: Hyperparameters) -> None:
        self.hp = hyperparameters
        print("redis probe: " + json.dumps(probe(hyperparameters)), flush=True)

    def model(self) -> nn.Module:
        return nn.Linear(2, 2)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=0.1)

    def train_data(self) -> Dataset:
        points = torch.linspace(-1, 1, 128).reshape(64, 2)
        return TensorDataset(points, (points.sum(dim=1) > 0).long())

    def loss(self, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        points, labels = batch
        return functional.cross_entropy(model(points), labels)
