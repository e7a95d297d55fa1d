"""A step's host<->device transfers: small inputs up in one copy, results down with one wait.

`Staging.upload` packs several small CPU tensors (token ids, positions, slots, block tables,
sampling parameters, ...) into one pinned 32-bit host buffer and copies it to the device with
one non-blocking copy; the results are views of one device buffer, in the order given. Integer
tensors arrive as int32, float32 ones as float32 (their bits travel unchanged). With `out=`
the copy lands in a buffer the caller owns (the CUDA graphs' static inputs): views of the same
shapes then always sit at the same addresses.

`host_ints` makes the step's small CPU integer tensors from Python lists (fast); `IntRows`
keeps lists that only grow (block tables, prompts) as int32 arrays across steps, so a step
copies them in C (a long context holds thousands of blocks, and tens of thousands of tokens).

`read_to_host` is the other direction: the values of several device tensors as Python lists,
with one wait for the device however many tensors there are (a step's sampled tokens, its
logprobs and its prompt logprobs come back together).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable

import numpy as np
import torch

_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def host_ints(values: Iterable[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A CPU integer tensor of `values` (an iterable of ints), as `torch.tensor(values)` makes it
    but ~5x faster: torch.tensor converts a list element by element (~15 us for 80 ints), most
    of the host time a step plan takes on CPU; an array is one C loop and shares its memory."""
    values = array(_TYPECODES[dtype], values)
    return torch.frombuffer(values, dtype=dtype) if values else torch.empty(0, dtype=dtype)


class IntRows:
    """Lists of ints that only grow (a request's block table, its prompt) as int32 arrays kept
    across steps: each call copies only what was appended since the last one, instead of
    converting the whole list from Python ints again.

    A row is keyed (a request id; for a list that never changes, `id(list)` does) and tied to
    the list it copies: another list under the same key is copied anew. So the contract is the
    KV manager's for its tables: a list only grows in place, and is replaced, never rewritten,
    when it changes otherwise."""

    def __init__(self) -> None:
        self._rows: dict[Hashable, tuple[list[int], np.ndarray, int]] = {}  # table, copy, len

    def row(self, key: Hashable, table: list[int]) -> np.ndarray:
        """`table` as an int32 array (a view of the kept copy)."""
        n = len(table)
        entry = self._rows.get(key)
        if entry is not None and entry[0] is table and entry[2] <= n:
            _, buf, have = entry
            if n > buf.shape[0]:
                buf = np.concatenate((buf[:have], np.empty(max(n, 2 * have) - have, np.int32)))
        else:
            buf, have = np.empty(max(n, 16), np.int32), 0
        if n > have:
            buf[have:n] = table[have:n]
        self._rows[key] = (table, buf, n)
        return buf[:n]

    def prune(self, live: dict[Hashable, list[int]]) -> None:
        """Forget the rows whose key is gone from `live` (key -> its list now: the KV manager's
        tables) or holds another list; only once they outnumber the live ones, so the cost is
        amortised."""
        if len(self._rows) > 2 * len(live) + 64:
            self._rows = {k: e for k, e in self._rows.items() if live.get(k) is e[0]}

    def check(self, live: dict[Hashable, list[int]]) -> None:
        """Every kept row of a live list holds that list's values (the contract above)."""
        for k, (table, buf, n) in self._rows.items():
            if live.get(k) is table:
                assert buf[:n].tolist() == table[:n], f"{k}: kept row differs from its list"

    def __len__(self) -> int:
        return len(self._rows)


class Staging:
    def __init__(self, device: torch.device | str, pin: bool | None = None) -> None:
        self.device = torch.device(device)
        self.pin = self.device.type == "cuda" if pin is None else pin
        self._host = torch.empty(0, dtype=torch.int32)
        self._dev = torch.empty(0, dtype=torch.int32, device=self.device)
        self._copied = None  # CUDA event: the last copy has read the host buffer
        self.num_uploads = 0  # copies made (tests count them)

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
        """Device views of `arrays` (CPU integer or float32 tensors), copied in one transfer
        into `out` (flat int32 on the device) or into the staging's own device buffer."""
        if not arrays:
            return []
        sizes = [a.numel() for a in arrays]
        numel = sum(sizes)
        self._grow(numel, out is None)
        self._wait()  # the previous copy may still read the host buffer
        host = self._host[:numel]
        torch.cat([_as_int32(a).reshape(-1) for a in arrays], out=host)
        dev = (self._dev if out is None else out)[:numel]
        dev.copy_(host, non_blocking=self.pin)
        self.num_uploads += 1
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        views, start = [], 0
        for a, n in zip(arrays, sizes):
            view = dev[start : start + n]
            if a.dtype == torch.float32:
                view = view.view(torch.float32)
            views.append(view.view(a.shape))
            start += n
        return views


def _as_int32(a: torch.Tensor) -> torch.Tensor:
    if a.dtype == torch.float32:
        return a.view(torch.int32)  # the bits, not a rounded value
    if a.is_floating_point() or a.is_complex():
        raise TypeError(f"staging carries integers and float32, got {a.dtype}")
    return a.to(torch.int32)


def read_to_host(tensors: list[torch.Tensor]) -> list[list]:
    """`t.tolist()` of each tensor, waiting for the device once: on CUDA every tensor is
    copied without blocking into pinned memory, then the host waits for the last copy."""
    if not tensors or tensors[0].device.type != "cuda":
        return [t.tolist() for t in tensors]
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()  # the step's one wait for the device
    return [h.tolist() for h in hosts]
