"""Host values sent to the device without waiting for it.

A plain copy from the host to a GPU (`torch.tensor(values, device="cuda")`) waits until the device has finished all
the work queued before it, like a read does. [`upload`] copies through page-locked memory without blocking, so the
host goes on queueing work while the copy waits its turn in the stream.
"""

from __future__ import annotations

import torch


def upload(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`values` (nested lists of numbers) as a tensor on `device`, copied without waiting for the device's queue."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
