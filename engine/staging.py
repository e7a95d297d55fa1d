"""A step's integer inputs to the device in one copy.

`Staging.upload` packs several small CPU integer tensors (token ids, positions, slots, block
tables, ...) into one pinned int32 host buffer and copies it to the device with one
non-blocking copy; the results are int32 views of one device buffer, in the order given. With
`out=` the copy lands in a buffer the caller owns (the CUDA graphs' static inputs): views of
the same shapes then always sit at the same addresses.
"""

from __future__ import annotations

import torch


class Staging:
    def __init__(self, device: torch.device | str, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=self.device)
        self._copied = None  # CUDA event: the last copy has read the host buffer

    def _grow(self, numel: int, need_dev: bool) -> None:
        size = max(numel, 2 * self._host.numel(), 4096)
        if self._host.numel() < numel:
            self._wait()
            self._host = torch.empty(size, dtype=torch.int32, pin_memory=self.pin)
        if need_dev and self._dev.numel() < numel:
            self._dev = torch.empty(size, dtype=torch.int32, device=self.device)

    def _wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # nearly always done: the step's sampled tokens synced
            self._copied = None

    def upload(
        self, arrays: list[torch.Tensor], out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """int32 device views of `arrays` (CPU integer tensors), copied in one transfer into
        `out` (flat int32 on the device) or into the staging's own device buffer."""
        sizes = [a.numel() for a in arrays]
        numel = sum(sizes)
        self._grow(numel, out is None)
        self._wait()  # the previous copy may still read the host buffer
        host = self._host[:numel]
        torch.cat([a.reshape(-1).to(torch.int32) for a in arrays], out=host)
        dev = (self._dev if out is None else out)[:numel]
        dev.copy_(host, non_blocking=self.pin)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        views, start = [], 0
        for a, n in zip(arrays, sizes):
            views.append(dev[start : start + n].view(a.shape))
            start += n
        return views
