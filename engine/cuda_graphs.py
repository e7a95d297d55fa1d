"""CUDA graphs for decode steps: capture the model forward once per padded batch size, replay.

A decode step's forward is many small kernels; launching them from Python costs more than
running them at small batches. A graph replays the whole forward as one launch. It reads its
inputs from fixed addresses, so each captured batch size `b` owns fixed views of one static
int32 device buffer, laid out as `Staging.upload` packs them:

    ids [b] | positions [b] | slot_mapping [b] | query_start_loc [b + 1] | seq_lens [b]
    | block_tables [b, width]        (width = blocks of one max_model_len sequence)

A step of `n <= b` decode rows is padded to the next captured size: padding rows are
one-token sequences in the cache engine's pad block (their K/V land there; their outputs are
ignored). Capture fixes `max_seq_len` at `max_model_len`; the kernel reads each row's true
length from `seq_lens`. Prefill and mixed steps, and batches above the largest size, run
eagerly.
"""

from __future__ import annotations

import torch

from fairbatch.engine.attention import AttentionMetadata
from fairbatch.engine.staging import host_ints

INPUT_NAMES = ("ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Captured batch sizes: 1, 2, 4, 8, then steps of 8, up to the first that holds
    `max_num_seqs` rows."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes, b = [], 1
    while True:
        sizes.append(b)
        if b >= max_num_seqs:
            return sizes
        b = b * 2 if b < 8 else b + 8


def padded_batch_size(num_rows: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `num_rows` rows; None if none does."""
    for b in sizes:
        if b >= num_rows:
            return b
    return None


def input_shapes(batch: int, width: int) -> list[tuple[int, ...]]:
    """Shapes of the graph inputs of one batch size, in INPUT_NAMES order."""
    return [(batch,), (batch,), (batch,), (batch + 1,), (batch,), (batch, width)]


def pad_decode_rows(
    ids: list[int], seq_lens: list[int], tables: list[list[int]], batch: int, pad_block: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """A decode batch grown to `batch` rows with one-token sequences in `pad_block`."""
    extra = batch - len(ids)
    return ids + [0] * extra, seq_lens + [1] * extra, tables + [[pad_block]] * extra


def graph_step_inputs(
    ids: list[int],
    seq_lens: list[int],
    tables: list,
    batch: int,
    width: int,
    block_size: int,
    pad_block: int,
) -> list[torch.Tensor]:
    """The host tensors a decode step stages for the graph of `batch` rows, in INPUT_NAMES
    order: its rows padded (`pad_decode_rows`), block tables `width` columns wide."""
    ids, lens, tables = pad_decode_rows(ids, seq_lens, tables, batch, pad_block)
    host = AttentionMetadata.host_inputs([1] * batch, lens, tables, block_size, width)
    host["ids"] = host_ints(ids)
    return [host[k] for k in INPUT_NAMES]


class DecodeGraphs:
    """Captured decode forwards of one model over one KV cache, by padded batch size."""

    def __init__(
        self,
        model,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        pad_block: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pad_block = pad_block
        self.width = -(-max_model_len // block_size)
        self.sizes = graph_batch_sizes(max_num_seqs)
        largest = self.sizes[-1]
        # Room for the largest layout, plus what a step stages behind it: per row at most its
        # sample row, and a prompt-logprob row and target (a one-token prompt chunk).
        numel = sum(_numel(s) for s in input_shapes(largest, self.width)) + 3 * largest
        device = kv_caches[0].device
        self.static = torch.zeros(numel, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, int]] = {}

    def views(self, batch: int) -> dict[str, torch.Tensor]:
        """The static input views of batch size `batch` (what a staged copy fills)."""
        out, start = {}, 0
        for name, shape in zip(INPUT_NAMES, input_shapes(batch, self.width)):
            n = _numel(shape)
            out[name] = self.static[start : start + n].view(shape)
            start += n
        return out

    def _forward(self, batch: int) -> torch.Tensor:
        v = self.views(batch)
        meta, positions = AttentionMetadata.from_device(
            v, [1] * batch, [1] * batch, max_seq_len=self.max_model_len
        )
        return self.model(v["ids"].long(), positions, self.kv_caches, meta)

    def _fill_padding(self, batch: int) -> None:
        # Valid inputs for capture: `batch` padding rows (the sizes' views overlap, so each
        # size is filled right before it is captured).
        v = self.views(batch)
        v["ids"].zero_()
        v["positions"].zero_()
        v["slot_mapping"].fill_(self.pad_block * self.block_size)
        v["query_start_loc"].copy_(torch.arange(batch + 1, dtype=torch.int32))
        v["seq_lens"].fill_(1)
        v["block_tables"].fill_(self.pad_block)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first (the smaller graphs then fit in its memory pool).
        Capture runs padding rows only, so it writes nothing but the pad block."""
        device = self.static.device
        pool = None
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for batch in reversed(self.sizes):
                self._fill_padding(batch)
                self._forward(batch)  # warm-up: lazy initialisation stays out of the graph
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=side):
                    hidden = self._forward(batch)
                pool = graph.pool()
                self._graphs[batch] = (graph, hidden, self.views(batch)["ids"].data_ptr())
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)

    def replay(self, batch: int, staged_ids: torch.Tensor) -> torch.Tensor:
        """Run the graph of `batch` on the inputs staged into its views; the hidden states
        `[batch, hidden]` (a static buffer: valid until the next replay)."""
        graph, hidden, ids_ptr = self._graphs[batch]
        if staged_ids.data_ptr() != ids_ptr:
            raise RuntimeError("decode inputs were not staged into the graph's static buffer")
        graph.replay()
        return hidden


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
