"""The points of three noisy concentric rings, read from the CSV file shipped beside this module:
the first 600 rows train, the last 120 are held out."""

from __future__ import annotations

import csv
from pathlib import Path

import torch
from torch.utils.data import Dataset

POINTS = Path(__file__).with_name("points.csv")
TRAIN_ROWS = 600


class Rings(Dataset):
    def __init__(self, held_out: bool) -> None:
        with POINTS.open(newline="") as source:
            rows = list(csv.DictReader(source))
        self.rows = rows[TRAIN_ROWS:] if held_out else rows[:TRAIN_ROWS]
        self.reads = 0
        """How many items were read: the runtime reads only what a step needs."""

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        row = self.rows[index]
        point = torch.tensor([float(row["x"]), float(row["y"])])
        return {"point": point, "ring": torch.tensor(int(row["ring"]))}
