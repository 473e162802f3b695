"""An item's way back from a reader process (elastic.tasks.readers): its tensors travel as numpy
arrays, and come back with the same dtype, shape, strides' values and bytes; what numpy cannot
hold travels as torch pickles it."""

from __future__ import annotations

import pickle

import torch

from elastic.tasks import readers


def _round_trip(item: object) -> object:
    return readers._inbound(pickle.loads(pickle.dumps(readers._outbound(item), protocol=pickle.HIGHEST_PROTOCOL)))


def test_an_items_tensors_come_back_the_same_whatever_their_kind() -> None:
    image = torch.randn(3, 8, 8)
    item = {
        "image": image,
        "crop": image[:, 1:5, ::2],  # not contiguous
        "label": torch.tensor(7),
        "mask": torch.rand(4) > 0.5,
        "half": torch.randn(5, dtype=torch.bfloat16),  # numpy has no bfloat16
        "pair": (torch.arange(3, dtype=torch.int16), [torch.zeros(2, dtype=torch.uint8), "name", 3.5]),
    }
    back = _round_trip(item)
    assert isinstance(back, dict) and back.keys() == item.keys()

    def same(a: object, b: object) -> None:
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)
            b.zero_()  # writable: a task's collate may write into its items
        elif isinstance(a, (tuple, list)):
            assert type(a) is type(b) and len(a) == len(b)  # type: ignore[arg-type]
            for x, y in zip(a, b, strict=True):  # type: ignore[call-overload]
                same(x, y)
        else:
            assert a == b

    for key in item:
        same(item[key], back[key])


def test_a_tensor_numpy_holds_travels_as_an_array_not_as_torch_pickles_it() -> None:
    sent = readers._outbound((torch.ones(2), torch.ones(2, dtype=torch.bfloat16)))
    assert isinstance(sent[0], readers._Array) and isinstance(sent[1], torch.Tensor)
