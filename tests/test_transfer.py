"""speculative.transfer off CUDA: the values as a tensor of the dtype on the device (tests/test_cuda.py
checks that the CUDA copy makes no host sync)."""

import torch

from speculative.transfer import to_device


def test_to_device_gives_the_values_in_the_dtype() -> None:
    rows = to_device([[3, 1], [4, 1]], torch.long, "cpu")
    assert rows.dtype == torch.long and rows.tolist() == [[3, 1], [4, 1]]
    flags = to_device(torch.tensor([1, 0]), torch.bool, torch.device("cpu"))
    assert flags.dtype == torch.bool and flags.tolist() == [True, False]
