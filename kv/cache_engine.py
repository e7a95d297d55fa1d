"""The K/V tensors: the device cache, the CPU swap space, and the copies between them.

Layout (both pools): one tensor `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`;
layer l's view `cache[l]` is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (K, V), the
paged layout flash-attn reads. One tensor for all layers means a swap of n blocks is one gather
and one scatter over dim 2, not a loop of 2 * layers * n small copies.

Block copies inside the device cache (a forked sample's copy of its parent's partial block)
run on the compute stream. On CUDA the swap copies run on a dedicated stream with events: the
compute stream waits for a swap-in before it reads the blocks, and for a swap-out's gather
before it overwrites the freed blocks; the device-to-host half of a swap-out finishes in the
background and is settled before anything reads the CPU blocks. On CPU the copies are plain
index operations.

The host tier's copies are the same two copies: `store` (device -> host) as a swap-out, and
`load` (host -> device) as a swap-in whose wait the compute stream makes only at the next step
(`wait_loads`): the loading request computes from then on, so the step in between overlaps
the load. Host memory is pinned where it can be; if pinning fails it is pageable (copies then
synchronous), with a warning.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # Inside a block [num_kv_heads, block_size, head_dim] (the torch attention backend's order)
    # rather than [block_size, num_kv_heads, head_dim] (flash's); copies never look inside.
    head_major: bool = False

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        inner = (self.block_size, self.num_kv_heads)
        if self.head_major:
            inner = inner[::-1]
        return (self.num_layers, 2, num_blocks, *inner, self.head_dim)


def num_blocks_for_budget(layout: KVLayout, budget_bytes: int) -> int:
    return max(int(budget_bytes // layout.bytes_per_block), 0)


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Zeroed host memory, pinned if `pin` and the system lets it be pinned; else pageable,
    with a warning (device copies from and to it then make the host wait)."""
    if pin:
        try:
            return torch.zeros(shape, dtype=dtype, pin_memory=True)
        except RuntimeError as e:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            warnings.warn(
                f"host KV memory ({size / 2**30:.2f} GiB) could not be pinned ({e}); using "
                "pageable memory: swap and host-tier copies will not overlap compute",
                stacklevel=2,
            )
    return torch.zeros(shape, dtype=dtype)


class PinnedPool:
    """Flat host buffers of one dtype, reused once the copies that read or wrote them finish.

    `take(numel)` returns a free buffer of at least `numel` elements (or a new one);
    `give(buf, event)` returns it, reusable once `event` (None: at once) has completed.
    At most `keep` idle buffers stay; the smallest finished ones are dropped first.
    """

    def __init__(self, dtype: torch.dtype, pin: bool = True, keep: int = 4) -> None:
        self.dtype = dtype
        self.pin = pin
        self.keep = keep
        self._idle: list[tuple[torch.Tensor, object]] = []
        self.num_allocated = 0

    @staticmethod
    def _done(event) -> bool:
        return event is None or event.query()

    def take(self, numel: int) -> torch.Tensor:
        best = None
        for i, (buf, event) in enumerate(self._idle):
            if buf.numel() >= numel and self._done(event):
                if best is None or buf.numel() < self._idle[best][0].numel():
                    best = i
        if best is not None:
            return self._idle.pop(best)[0]
        self.num_allocated += 1
        return torch.empty(numel, dtype=self.dtype, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, event=None) -> None:
        self._idle.append((buf, event))
        while len(self._idle) > self.keep:
            done = [i for i, (_, ev) in enumerate(self._idle) if self._done(ev)]
            if not done:
                break
            smallest = min(done, key=lambda i: self._idle[i][0].numel())
            # torch's pinned allocator keeps the memory until its recorded copies finish
            del self._idle[smallest]


class CacheEngine:
    def __init__(
        self,
        layout: KVLayout,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        device: torch.device | str = "cpu",
        pad_block: bool = False,
    ) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        # With `pad_block`, one block past the pool's last (id `num_gpu_blocks`, never handed
        # out): the padding rows of a CUDA graph's batch write their K/V there.
        self.pad_block = num_gpu_blocks if pad_block else None
        self.gpu_cache = torch.zeros(
            layout.shape(num_gpu_blocks + int(pad_block)), dtype=layout.dtype, device=device
        )
        # Pinned host memory makes device<->host copies truly asynchronous; pinning needs CUDA.
        self.cpu_cache = host_tensor(
            layout.shape(max(num_cpu_blocks, 0)), layout.dtype, pin=self.is_cuda
        )
        self.swap_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        # Pinned staging buffers for the swaps: a swap-in gathers its CPU blocks straight into
        # one (a single host copy), a swap-out lands in one until it is settled.
        self.host_buffers = PinnedPool(layout.dtype) if self.is_cuda else None
        # Swap-outs whose device-to-host copy may still be in flight:
        # (done event, cpu block ids, pinned host buffer, device buffer kept alive until done)
        self._pending_out: list[tuple[torch.cuda.Event, torch.Tensor, torch.Tensor, object]] = []
        self._loads: list[torch.cuda.Event] = []  # host-tier loads the next step waits for
        self.bytes_swapped = {"in": 0, "out": 0}
        self.bytes_host_tier = {"store": 0, "load": 0}

    def layer_caches(self) -> list[torch.Tensor]:
        """Per layer `[2, num_gpu_blocks, ...]` views (block inner order: see KVLayout)."""
        return list(self.gpu_cache.unbind(0))

    def _device_index(self, ids: list[int]) -> torch.Tensor:
        """Block ids as an int64 device tensor; on CUDA a non-blocking copy from pinned memory
        (a pageable copy would make the host wait for the device)."""
        if not self.is_cuda:
            return torch.tensor(ids, dtype=torch.long)
        idx = torch.tensor(ids, dtype=torch.long, pin_memory=True).to(
            self.device, non_blocking=True
        )
        idx.record_stream(self.swap_stream)  # also read there: not reused before it is done
        return idx

    # ---- copies within the device cache ------------------------------------------------------

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy (src, dst) device blocks, all layers, K and V, on the compute stream (so the
        swaps issued after it, which wait for that stream, see it done). All sources are read
        before any destination is written."""
        if not pairs:
            return
        src = self._device_index([s for s, _ in pairs])
        dst = self._device_index([d for _, d in pairs])
        self.gpu_cache.index_copy_(2, dst, self.gpu_cache.index_select(2, src))

    # ---- swaps ------------------------------------------------------------------------------

    def swap_in(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (cpu block, gpu block) pairs host -> device before the next forward reads them."""
        self.bytes_swapped["in"] += len(mapping) * self.layout.bytes_per_block
        self._to_device(mapping, wait_now=True)

    def load(self, mapping: list[tuple[int, int]]) -> None:
        """Copy host-tier (cpu block, gpu block) pairs host -> device; the compute stream waits
        for them at the next step (`wait_loads`), the first that reads the blocks."""
        self.bytes_host_tier["load"] += len(mapping) * self.layout.bytes_per_block
        self._to_device(mapping, wait_now=False)

    def wait_loads(self) -> None:
        """Make the compute stream wait for the loads issued by the last step."""
        if self._loads:
            compute = torch.cuda.current_stream(self.device)
            for done in self._loads:
                compute.wait_event(done)
            self._loads.clear()

    def _to_device(self, mapping: list[tuple[int, int]], wait_now: bool) -> None:
        if not mapping:
            return
        cpu_ids = [c for c, _ in mapping]
        self._settle_for(cpu_ids)  # the CPU blocks may be the target of a copy still in flight
        cpu_idx = torch.tensor(cpu_ids, dtype=torch.long)
        gpu_idx = self._device_index([g for _, g in mapping])
        if not self.is_cuda:
            self.gpu_cache.index_copy_(2, gpu_idx, self.cpu_cache.index_select(2, cpu_idx))
            return
        shape = self.layout.shape(len(mapping))
        buf = self.host_buffers.take(math.prod(shape))
        host = buf[: math.prod(shape)].view(shape)
        torch.index_select(self.cpu_cache, 2, cpu_idx, out=host)  # one gather over all layers
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.swap_stream):
            # Earlier steps may still be reading the target blocks' previous contents.
            self.swap_stream.wait_stream(compute)
            dev = host.to(self.device, non_blocking=True)
            self.gpu_cache.index_copy_(2, gpu_idx, dev)
            done = torch.cuda.Event()
            done.record(self.swap_stream)
        # The step that reads these blocks waits for exactly this copy. `dev` was allocated on
        # the swap stream (not reused before the copy is done); the host buffer goes back to
        # the pool, reusable once `done` has completed.
        if wait_now:
            compute.wait_event(done)
        else:
            self._loads.append(done)
        self.host_buffers.give(buf, done)

    def swap_out(self, mapping: list[tuple[int, int]]) -> None:
        """Copy (gpu block, cpu block) pairs device -> host before the freed blocks are reused."""
        self.bytes_swapped["out"] += len(mapping) * self.layout.bytes_per_block
        self._to_host(mapping)

    def store(self, mapping: list[tuple[int, int]]) -> None:
        """Copy evicted prefix blocks (gpu block, cpu block) device -> host (the host tier),
        before anything overwrites them; the host does not wait for the copy."""
        self.bytes_host_tier["store"] += len(mapping) * self.layout.bytes_per_block
        self._to_host(mapping)

    def _to_host(self, mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        gpu_idx = self._device_index([g for g, _ in mapping])
        cpu_idx = torch.tensor([c for _, c in mapping], dtype=torch.long)
        if not self.is_cuda:
            self.cpu_cache.index_copy_(2, cpu_idx, self.gpu_cache.index_select(2, gpu_idx))
            return
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.swap_stream):
            self.swap_stream.wait_stream(compute)  # the blocks' K/V was written by earlier steps
            dev = self.gpu_cache.index_select(2, gpu_idx)
            gathered = torch.cuda.Event()
            gathered.record(self.swap_stream)
            buf = self.host_buffers.take(dev.numel())
            host = buf[: dev.numel()].view(dev.shape)
            host.copy_(dev, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.swap_stream)
        # The forward may overwrite the freed blocks once they are gathered, not before.
        compute.wait_event(gathered)
        self._pending_out.append((done, cpu_idx, host, (dev, buf)))

    def settle(self) -> None:
        """Finish in-flight swap-outs: wait for their copies, then place them in the CPU pool."""
        self._settle(len(self._pending_out))

    def _settle_for(self, cpu_ids: list[int]) -> None:
        """Settle the in-flight copies to host up to the last that writes one of `cpu_ids`
        (in order: a later copy to the same block must land last)."""
        want = set(cpu_ids)
        last = 0
        for i, (_, cpu_idx, *_) in enumerate(self._pending_out):
            if not want.isdisjoint(cpu_idx.tolist()):
                last = i + 1
        self._settle(last)

    def _settle(self, n: int) -> None:
        for done, cpu_idx, host, (_dev, buf) in self._pending_out[:n]:
            done.synchronize()
            self.cpu_cache.index_copy_(2, cpu_idx, host)
            self.host_buffers.give(buf)
        del self._pending_out[:n]

    def poll(self) -> None:
        """Settle swap-outs that already finished, without waiting (called once per step)."""
        if self._pending_out and all(ev.query() for ev, *_ in self._pending_out):
            self.settle()

    # ---- migration: blocks as numpy arrays (the Ray object store reads those zero-copy) -----

    def export_blocks(self, cpu_block_ids: list[int]) -> np.ndarray:
        """The K/V of the given CPU blocks as `[layers, 2, n, block_size, kv_heads, head_dim]`.

        16-bit float types have no numpy equivalent, so they travel as their raw int16 bits.
        """
        self.settle()
        idx = torch.tensor(cpu_block_ids, dtype=torch.long)
        data = self.cpu_cache.index_select(2, idx)
        if data.element_size() == 2:
            data = data.view(torch.int16)
        return data.numpy()

    def import_blocks(self, cpu_block_ids: list[int], data: np.ndarray) -> None:
        self.settle()
        t = torch.from_numpy(np.ascontiguousarray(data))
        if t.dtype == torch.int16 and self.layout.dtype != torch.int16:
            t = t.view(self.layout.dtype)
        expected = self.layout.shape(len(cpu_block_ids))
        if tuple(t.shape) != expected or t.dtype != self.layout.dtype:
            raise ValueError(
                f"imported K/V has shape {tuple(t.shape)} {t.dtype}; expected {expected} "
                f"{self.layout.dtype} (different model or block size?)"
            )
        idx = torch.tensor(cpu_block_ids, dtype=torch.long)
        self.cpu_cache.index_copy_(2, idx, t)
