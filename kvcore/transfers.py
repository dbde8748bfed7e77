"""Host tensors moved to the serving device without making the host wait.

A copy from pageable host memory to a GPU returns only once the device has taken the bytes, so it first waits for
every kernel and copy queued before it on the stream: inside an engine step, for the step's uploads and writes
so far. Through page-locked memory the copy is only queued (the caching host allocator keeps the pinned buffer
until the copy is done), and the host goes on launching the step. Off CUDA it is a plain copy.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` on `device`, queued behind the stream's work on CUDA rather than waited for."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
