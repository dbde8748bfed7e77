"""Host tensors moved to the device without a wait: the values arrive as they were (any device)."""

import torch

from kvcore.transfers import to_device


def test_a_host_tensor_arrives_as_it_was_and_a_device_tensor_stays_put():
    host = torch.arange(12, dtype=torch.int64).view(3, 4)
    moved = to_device(host, "cpu")
    assert torch.equal(moved, host) and moved.device.type == "cpu"
    assert to_device(moved, "cpu") is moved  # already there: no copy
