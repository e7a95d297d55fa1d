"""The metadata of one flattened step, a backend's per-step plan, and the backend contract
(the package docstring, engine/attention/__init__.py, describes the step and the cache)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32: context length incl. this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # CPU copies of the lengths, so backends plan the step without a device sync.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # The block tables on the host too (backends that plan on the CPU read these, not a copy
    # back from the device); None: read `block_tables`.
    block_tables_cpu: torch.Tensor | None = None
    # Per-step derived tensors, built once by the first layer and reused by the others.
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.query_lens_cpu) != len(self.seq_lens_cpu):
            raise ValueError("query_lens_cpu and seq_lens_cpu must have one entry per sequence")
        for q, n in zip(self.query_lens_cpu, self.seq_lens_cpu):
            if not 0 < q <= n:
                raise ValueError(f"need 0 < query_len <= seq_len, got {q} and {n}")

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @staticmethod
    def host_inputs(
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        width: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """The step's integer inputs as CPU tensors: `positions`, `slot_mapping` (int64,
        `[num_tokens]`), `query_start_loc`, `seq_lens` and `block_tables` (int32; the tables
        padded with 0 to `width` columns, by default the longest table's).

        Built with numpy, whose calls cost a fraction of torch's on small arrays. The tables may
        be lists or int32 arrays (the runner's `IntRows`: copied in C, not element by
        element); the cost follows the blocks they hold, not `width` (a CUDA graph's tables
        are as wide as a max_model_len sequence, 2,048 columns for a 32K context)."""
        num_seqs = len(seq_lens)
        q = np.fromiter(query_lens, np.int64, num_seqs)
        lens = np.fromiter(seq_lens, np.int64, num_seqs)
        counts = np.fromiter(map(len, block_tables), np.int64, num_seqs)
        width = width or int(counts.max(initial=0)) or 1
        bad = np.flatnonzero((counts * block_size < lens) | (counts > width))
        if bad.size:  # the first sequence whose table cannot serve it
            s = int(bad[0])
            n, need = int(counts[s]), int(lens[s])
            if n > width:
                raise ValueError(f"sequence {s}: {n} blocks do not fit a table {width} wide")
            raise ValueError(f"sequence {s}: {n} blocks of {block_size} cannot hold {need}")
        tables = np.zeros((num_seqs, width), np.int32)
        for s, table in enumerate(block_tables):  # (a C copy each for the runner's arrays)
            tables[s, : len(table)] = table
        starts = np.zeros(num_seqs + 1, np.int64)
        np.cumsum(q, out=starts[1:])
        seq_of_token = np.repeat(np.arange(num_seqs), q)  # [num_tokens]
        # position = (seq_len - q_len) + index within this step's tokens of the sequence
        positions = (lens - q - starts[:-1])[seq_of_token] + np.arange(starts[-1])
        blocks = tables[seq_of_token, positions // block_size].astype(np.int64)
        return {
            "positions": torch.from_numpy(positions),
            "slot_mapping": torch.from_numpy(blocks * block_size + positions % block_size),
            "query_start_loc": torch.from_numpy(starts.astype(np.int32)),
            "seq_lens": torch.from_numpy(lens.astype(np.int32)),
            "block_tables": torch.from_numpy(tables),
        }

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and positions `[num_tokens]` for one step, from per-sequence counts.

        `query_lens[s]` new tokens are computed for sequence `s`, whose context is then
        `seq_lens[s]` tokens; `block_tables[s]` lists its block ids in order and must cover
        `seq_lens[s]` positions.
        """
        host = cls.host_inputs(query_lens, seq_lens, block_tables, block_size)
        dev = {k: v.to(device) for k, v in host.items()}
        return cls.from_device(dev, list(query_lens), list(seq_lens), host["block_tables"])

    @classmethod
    def from_device(
        cls,
        inputs: dict[str, torch.Tensor],
        query_lens: list[int],
        seq_lens: list[int],
        block_tables_cpu: torch.Tensor | None = None,
        max_seq_len: int | None = None,
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        """Metadata and int64 positions from `host_inputs`' tensors already on the device (of
        any integer type: int32 views of one staged copy work)."""
        meta = cls(
            slot_mapping=inputs["slot_mapping"].long(),
            query_start_loc=inputs["query_start_loc"].int(),
            seq_lens=inputs["seq_lens"].int(),
            block_tables=inputs["block_tables"].int(),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0) if max_seq_len is None else max_seq_len,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            block_tables_cpu=block_tables_cpu,
        )
        return meta, inputs["positions"].long()


class StepPlan:
    """A backend's per-step plan, host half: `arrays` (CPU integer tensors) go to the device
    with the step's other inputs; `attach(meta, views)` then builds the device half from their
    device views, in order, and keeps it in `meta` for every layer."""

    arrays: list[torch.Tensor]

    def attach(self, meta: AttentionMetadata, views: list[torch.Tensor]) -> None:
        raise NotImplementedError


class StepPlans(StepPlan):
    """Several plans of one step staged as one (a model whose layers attend with different
    sliding windows: one plan per window); each attaches its own slice of the views."""

    def __init__(self, plans: list[StepPlan]) -> None:
        self.plans = plans
        self.arrays = [a for p in plans for a in p.arrays]

    def attach(self, meta: AttentionMetadata, views: list[torch.Tensor]) -> None:
        start = 0
        for plan in self.plans:
            plan.attach(meta, views[start : start + len(plan.arrays)])
            start += len(plan.arrays)


class AttentionBackend:
    """Base class; see the module docstring for the contract."""

    name: ClassVar[str]
    # Inside a block: [num_kv_heads, block_size, head_dim] if True, else [block_size, heads, dim].
    head_major: ClassVar[bool] = False
    # Whether a decode forward can be captured in a CUDA graph: no host work that depends on
    # the step's lengths (beyond max_seq_len, which capture fixes at max_model_len), no syncs.
    supports_cuda_graphs: ClassVar[bool] = False

    @classmethod
    def kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
    ) -> tuple[int, ...]:
        if cls.head_major:
            return (2, num_blocks, num_kv_heads, block_size, head_dim)
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, head_dim: int | None = None, dtype: torch.dtype | None = None
    ) -> str | None:
        """None if this backend can run with these settings, else why not."""
        return None

    def check_block_size(self, block_size: int) -> None:
        """Raise ValueError if this backend cannot read caches with this block size."""

    def step_plan(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables_cpu: torch.Tensor,
        block_size: int,
        num_kv_heads: int,
        group: int,
        sliding_window: int | None,
    ) -> StepPlan | None:
        """Host-side planning of one step whose integer arrays the runner stages in the step's
        one copy (a StepPlan); None: this backend needs nothing beyond the metadata."""
        return None

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # key, value: [num_tokens, num_kv_heads, head_dim]; kv_cache must be contiguous so the
        # flat view aliases it.
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
        flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
        flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
        flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's K, V [T, Hkv, D]
    ) -> torch.Tensor:
        raise NotImplementedError
