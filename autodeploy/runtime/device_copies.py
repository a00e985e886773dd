"""Small host→device copies that never wait for the device.

A blocking ``tensor.to("cuda")`` synchronises with the stream: it waits for every kernel queued before
it, which is the running forward when the host prepares the next step. Copies from pinned memory are
queued like kernels instead, so the host runs ahead.
"""

from __future__ import annotations

import torch


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on ``device``, without a host sync on a GPU."""
    return pinned_to_device(torch.tensor(values, dtype=dtype), device)


def pinned_to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device``: through pinned memory and an asynchronous copy on a GPU."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """``tensor`` on its way to the host: the copy is queued now (into pinned memory, an event marking it done, on a
    GPU); ``wait()`` returns it once there."""

    def __init__(self, tensor: torch.Tensor):
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
        self._host.copy_(tensor, non_blocking=tensor.is_cuda)
        self._copied = None
        if tensor.is_cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def wait(self) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        return self._host
