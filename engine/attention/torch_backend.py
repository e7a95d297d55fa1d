"""The reference attention backend in plain torch (CPU and CUDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fairbatch.engine.attention.base import AttentionBackend, AttentionMetadata, StepPlan
from fairbatch.engine.staging import Staging, host_ints


class TorchAttentionBackend(AttentionBackend):
    """Reference backend in plain torch (CPU and CUDA).

    Decode sequences (q_len == 1) run in length-sorted groups, one padded, masked SDPA call per
    group; prefill chunks run one call each. Three choices keep it quick on CPU, where moving
    K/V dominates:
    * The cache is head-major, so K/V are gathered as whole `[block_size, head_dim]` tiles of
      the cache viewed as `[num_blocks * kv_heads, block_size, dim]`, straight into SDPA's
      contiguous `[..., kv_heads, len, dim]` order: one copy of large chunks, no transpose
      (SDPA over a transposed, strided K/V view measured ~2x slower on CPU).
    * Each layer reuses one scratch buffer for the gathered K/V (no page faults per layer).
    * GQA folds the query heads sharing a KV head into the query-length axis
      (`[kv_heads, group * q_len, dim]`), so K/V are never repeated per query head (and no
      reliance on SDPA's `enable_gqa`, absent from older torch).
    * Decode sequences whose tables start with the same blocks (a cached prompt prefix) form
      a group: its shared blocks are gathered once, then each member's own blocks, and a mask
      lets each member see the shared keys and its own (cascade attention). Its tokens are
      then queries of one sequence, like a prefill chunk's: the read of the shared prefix, the
      bulk of decode time on CPU, is paid once per group instead of per sequence. All groups
      of a step run as one padded call.

    The step's plan (which rows and tiles each call reads) is made on the host from the
    metadata's CPU lengths and tables; its integer arrays ride in the runner's one staged copy
    of the step (`step_plan`), and the masks are built on the device from the staged lengths,
    so on CUDA the plan costs no copy of its own and no wait.
    """

    name = "torch"
    head_major = True

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None  # decode gather scratch, grown on demand

    def _buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buf
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = self._buf = torch.empty(int(numel * 1.25), dtype=like.dtype, device=like.device)
        return buf[:numel]

    def step_plan(
        self,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables_cpu: torch.Tensor,
        block_size: int,
        num_kv_heads: int,
        group: int,
        sliding_window: int | None,
    ) -> _TorchStepPlan:
        return _TorchStepPlan.make(
            query_lens, seq_lens, block_tables_cpu, block_size, num_kv_heads, group,
            sliding_window,
        )  # fmt: skip

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        # key, value: [num_tokens, num_kv_heads, head_dim] -> cache[0|1][block, :, offset]
        block_size = kv_cache.shape[3]
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
        kv_cache[0][blocks, :, offsets] = key.to(kv_cache.dtype)
        kv_cache[1][blocks, :, offsets] = value.to(kv_cache.dtype)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, num_kv_heads, block_size, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's K, V [T, Hkv, D]
    ) -> torch.Tensor:
        _, num_blocks, num_kv_heads, block_size, head_dim = kv_cache.shape
        tiles_k = kv_cache[0].view(-1, block_size, head_dim)  # [num_blocks * Hkv, bs, D]
        tiles_v = kv_cache[1].view(-1, block_size, head_dim)
        group = q.shape[1] // num_kv_heads
        key = _TorchStepPlan.key(block_size, num_kv_heads, group, sliding_window)
        plan = meta._cache.get(key)
        if plan is None:  # not staged with the step's inputs (a direct caller, or on CPU)
            tables = meta.block_tables if meta.block_tables_cpu is None else meta.block_tables_cpu
            host = self.step_plan(
                meta.query_lens_cpu, meta.seq_lens_cpu, tables.cpu(), block_size,
                num_kv_heads, group, sliding_window,
            )  # fmt: skip
            arrays = host.arrays  # on CPU the host's arrays serve as they are; else one copy
            if q.device.type != "cpu":
                arrays = Staging(q.device, pin=False).upload(arrays)
            host.attach(meta, arrays)
            plan = meta._cache[key]
        plan = meta._cache[key] = plan.to(q.dtype)  # (a no-op after the first layer)
        out = torch.empty_like(q)

        for rows, tiles, mask in plan.decode_groups:
            b, span = rows.numel(), mask.shape[-1]
            kd, vd = self._gather(tiles_k, tiles_v, tiles, q)
            kd = kd.view(b, num_kv_heads, span, head_dim)  # [b, Hkv, L, D], contiguous
            vd = vd.view(b, num_kv_heads, span, head_dim)
            qd = _fold(q[rows].unsqueeze(1), num_kv_heads, group)  # [b, Hkv, G, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, mask, scale=scale)
            out[rows] = _unfold(od, 1).squeeze(1)  # [b, H, D]

        if plan.fresh and new_kv is None:  # callers without new_kv: read them back by slot
            blocks = meta.slot_mapping // block_size
            offsets = meta.slot_mapping % block_size
            new_kv = (kv_cache[0][blocks, :, offsets], kv_cache[1][blocks, :, offsets])
        for start, q_len in plan.fresh:
            # A prompt's first chunk attends only to itself: use this step's K/V as computed
            # (causal) instead of gathering them back out of the cache.
            qf = q[start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            kf = new_kv[0][start : start + q_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, q, D]
            vf = new_kv[1][start : start + q_len].transpose(0, 1).unsqueeze(0)
            if group > 1:
                kf, vf = kf.repeat_interleave(group, 1), vf.repeat_interleave(group, 1)
            of = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True, scale=scale)
            out[start : start + q_len] = of[0].transpose(0, 1)  # [q_len, H, D]

        for rows, dest, sel, tiles, mask in plan.shared:
            # Each group's decode tokens as the queries of one sequence, over its shared blocks
            # and every member's own; the mask keeps each member to the shared and its own keys.
            n, m = rows.shape
            qg = q[rows.view(-1)].view(n, m, -1, head_dim)  # [n, m, H, D]
            qg = _fold(qg, num_kv_heads, group)  # [n, Hkv, G * m, D]
            kg, vg = self._gather(tiles_k, tiles_v, tiles, q)
            kg = kg.view(n, num_kv_heads, -1, head_dim)  # [n, Hkv, L, D]
            vg = vg.view(n, num_kv_heads, -1, head_dim)
            og = F.scaled_dot_product_attention(qg, kg, vg, mask, scale=scale)
            out[dest] = _unfold(og, m).reshape(n * m, -1, head_dim)[sel]  # [members, H, D]

        for start, q_len, tiles, mask in plan.prefills:
            qp = _fold(q[start : start + q_len].unsqueeze(0), num_kv_heads, group)  # [1,Hkv,G*q,D]
            kp, vp = self._gather(tiles_k, tiles_v, tiles, q)
            kp = kp.view(1, num_kv_heads, -1, head_dim)  # [1, Hkv, L, D]
            vp = vp.view(1, num_kv_heads, -1, head_dim)
            op = F.scaled_dot_product_attention(qp, kp, vp, mask, scale=scale)
            out[start : start + q_len] = _unfold(op, q_len)[0]  # [q_len, H, D]
        return out

    def _gather(
        self, tiles_k: torch.Tensor, tiles_v: torch.Tensor, tiles: torch.Tensor, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V tiles named by `tiles`, `[n, block_size, head_dim]` each, copied into
        the reused scratch buffer (valid until the next call)."""
        n, block_size, head_dim = tiles.numel(), tiles_k.shape[1], tiles_k.shape[2]
        size = n * block_size * head_dim
        buf = self._buffer(2 * size, like)
        kb = buf[:size].view(n, block_size, head_dim)
        vb = buf[size:].view(n, block_size, head_dim)
        torch.index_select(tiles_k, 0, tiles, out=kb)
        torch.index_select(tiles_v, 0, tiles, out=vb)
        return kb, vb


def _fold(q: torch.Tensor, num_kv_heads: int, group: int) -> torch.Tensor:
    # [B, q_len, H, D] -> [B, Hkv, G * q_len, D]; query head h uses KV head h // G (HF repeat_kv)
    b, q_len, _, d = q.shape
    q = q.view(b, q_len, num_kv_heads, group, d).permute(0, 2, 3, 1, 4)
    return q.reshape(b, num_kv_heads, group * q_len, d)


def _unfold(o: torch.Tensor, q_len: int) -> torch.Tensor:
    # [B, Hkv, G * q_len, D] -> [B, q_len, H, D]
    b, num_kv_heads, gq, d = o.shape
    o = o.view(b, num_kv_heads, gq // q_len, q_len, d).permute(0, 3, 1, 2, 4)
    return o.reshape(b, q_len, -1, d)


DECODE_GROUP = 32  # decode sequences per padded call: sorted by length, so little padding


@dataclass
class _TorchPlan:
    """Gather indices and masks of one step on the device, built once and shared by every
    layer.

    A tile is one (block, KV head) pair: row `block * num_kv_heads + head` of the cache viewed
    as `[num_blocks * num_kv_heads, block_size, head_dim]`. A sequence's tiles are listed head
    by head, its blocks in order within each head, so the gathered tiles read as
    `[kv_heads, num_blocks * block_size, head_dim]`.
    """

    # per decode group: batch rows [b], tiles [b * Hkv * nb] (blocks padded with each sequence's
    # own last block: finite data the mask hides), key mask [b, 1, 1, nb * block_size]
    decode_groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # the groups of decode sequences with shared leading blocks, n groups padded to m members
    # (copies of the first) and nb blocks (the shared ones, then each member's own), or none:
    # batch rows [n, m], the members' rows [k] and their places in the n * m [k], tiles
    # [n * Hkv * nb], key mask [n, 1, G * m, nb * block_size]
    shared: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    # per prefill chunk with earlier context: first batch row, q_len, tiles [Hkv * nb],
    # mask [G * q_len, nb * block_size]
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]
    # per prompt chunk with no earlier context (and no window): first batch row, q_len
    fresh: list[tuple[int, int]]
    mask_dtype: torch.dtype = torch.float32  # every mask's (`_additive` makes float32)

    def to(self, dtype: torch.dtype) -> _TorchPlan:
        """This plan with its additive masks in `dtype`, the queries' (CUDA's SDPA wants them
        alike); itself when they are (every layer after the first)."""
        if dtype == self.mask_dtype:
            return self
        return _TorchPlan(
            [(*g, m.to(dtype)) for *g, m in self.decode_groups],
            [(*g, m.to(dtype)) for *g, m in self.shared],
            [(*p, m.to(dtype)) for *p, m in self.prefills],
            self.fresh,
            dtype,
        )


@dataclass
class _TorchStepPlan(StepPlan):
    """The host half of a `_TorchPlan`: the rows, tiles and lengths as CPU integer tensors
    (staged in the step's one copy); the masks are built on the device from the lengths, so
    no boolean tensor and no per-group copy crosses to the device."""

    # the shared groups' (`_shared_arrays`), if any; per decode group: rows [b], tiles
    # [b * Hkv * nb], seq lens [b]; per prefill: tiles
    arrays: list[torch.Tensor]
    shared: tuple[int, int, int] | None  # the shared groups' n, m, nb (see `_TorchPlan`)
    decode_blocks: list[int]  # per decode group: nb, the blocks read per sequence
    prefills: list[tuple[int, int, int, int]]  # first row, q_len, seq_len, nb
    fresh: list[tuple[int, int]]
    block_size: int
    group: int
    window: int | None
    cache_key: tuple

    @staticmethod
    def key(block_size: int, num_kv_heads: int, group: int, window: int | None) -> tuple:
        """Where the device plan sits in `AttentionMetadata._cache` (one step, one device)."""
        return ("torch", block_size, num_kv_heads, group, window)

    @classmethod
    def make(
        cls,
        query_lens: list[int],
        lens: list[int],
        block_tables_cpu: torch.Tensor,
        block_size: int,
        num_kv_heads: int,
        group: int,
        window: int | None,
    ) -> _TorchStepPlan:
        starts = [0]
        for q_len in query_lens:
            starts.append(starts[-1] + q_len)
        decode = [s for s, q in enumerate(query_lens) if q == 1]
        tables = block_tables_cpu.to(torch.int64)
        heads = torch.arange(num_kv_heads)[None, :, None]  # [1, Hkv, 1]

        def tiles_of(seqs: list[int], seq_lens: torch.Tensor) -> tuple[torch.Tensor, int]:
            # [b * Hkv * nb] tiles of `seqs` over nb blocks each (short ones repeat their last)
            nb = -(-int(seq_lens.max()) // block_size)
            last_block = (seq_lens - 1) // block_size  # [b]
            col = torch.minimum(torch.arange(nb)[None, :], last_block[:, None])  # [b, nb]
            blocks = torch.gather(tables[host_ints(seqs)], 1, col)  # [b, nb]
            tiles = blocks[:, None, :] * num_kv_heads + heads  # [b, Hkv, nb]
            return tiles.reshape(-1), nb

        arrays: list[torch.Tensor] = []
        shared = None
        if window is None and len(decode) > 1:  # (a window would hide part of a prefix)
            rows = block_tables_cpu.tolist()
            groups, decode = _shared_prefix_groups(decode, rows, lens, block_size)
            if groups:
                arrays, shared = _shared_arrays(groups, rows, starts, lens, block_size, heads)

        decode.sort(key=lens.__getitem__)
        decode_blocks = []
        for g in range(0, len(decode), DECODE_GROUP):
            seqs = decode[g : g + DECODE_GROUP]
            glens = host_ints(lens[s] for s in seqs)  # [b]
            tiles, nb = tiles_of(seqs, glens)
            arrays += [host_ints(starts[s] for s in seqs), tiles, glens]
            decode_blocks.append(nb)

        prefills, fresh = [], []
        for s, q_len in enumerate(query_lens):
            if q_len == 1:
                continue
            if lens[s] == q_len and window is None:
                fresh.append((starts[s], q_len))
                continue
            tiles, nb = tiles_of([s], host_ints([lens[s]]))
            arrays.append(tiles)
            prefills.append((starts[s], q_len, lens[s], nb))
        key = cls.key(block_size, num_kv_heads, group, window)
        return cls(arrays, shared, decode_blocks, prefills, fresh, block_size, group, window, key)

    def attach(self, meta: AttentionMetadata, views: list[torch.Tensor]) -> None:
        bs, window = self.block_size, self.window
        it = iter(views)
        shared = []
        if self.shared is not None:
            n, m, nb = self.shared
            rows, sel, tiles, owner, valid, member = (next(it) for _ in range(6))
            offset = torch.arange(bs, device=rows.device)
            key_ok = (offset < valid.view(n, nb, 1)).view(n, 1, nb * bs)  # written keys
            key_owner = owner.view(n, nb).repeat_interleave(bs, dim=1)[:, None, :]  # [n, 1, L]
            mine = (key_owner == member.view(n, m, 1)) | (key_owner < 0)  # [n, m, L]
            mask = (key_ok & mine).repeat(1, self.group, 1)[:, None]  # [n, 1, G * m, L]
            rows, sel = rows.long(), sel.long()  # (folded row g * m + i is member i)
            shared.append((rows.view(n, m), rows[sel], sel, tiles, _additive(mask)))
        decode_groups = []
        for nb in self.decode_blocks:
            rows, tiles, glens = next(it), next(it), next(it)
            key_pos = torch.arange(nb * bs, device=rows.device)
            mask = _visible(key_pos[None, :], (glens - 1)[:, None], window)[:, None, None, :]
            decode_groups.append((rows.long(), tiles, _additive(mask)))
        prefills = []
        for start, q_len, seq_len, nb in self.prefills:
            tiles = next(it)
            key_pos = torch.arange(nb * bs, device=tiles.device)  # whole blocks; causal hides
            q_pos = torch.arange(seq_len - q_len, seq_len, device=tiles.device)[:, None]
            mask = _visible(key_pos[None, :], q_pos, window)  # [q_len, nb * bs]
            mask = mask.repeat(self.group, 1)  # [G * q_len, L]: folded row g * q_len + i is query i
            prefills.append((start, q_len, tiles, _additive(mask)))
        meta._cache[self.cache_key] = _TorchPlan(decode_groups, shared, prefills, self.fresh)


def _shared_prefix_groups(
    decode: list[int], tables: list[list[int]], lens: list[int], block_size: int
) -> tuple[list[tuple[list[int], int]], list[int]]:
    """Decode sequences that start with the same blocks (prefix-cache hits of one prompt, or
    forked samples), as (members, number of shared blocks) groups; and the others.

    A group shares only blocks before each member's last one (which holds the key it writes
    now), so every member sees all of the shared keys. Its members' own blocks together are at
    most its shared blocks: each query then also scores the other members' keys (masked), which
    at most doubles the group's arithmetic, while its reads of K/V drop to about 2 / m."""
    by_first: dict[int, list[int]] = {}
    for s in decode:
        by_first.setdefault(tables[s][0], []).append(s)
    groups, rest = [], []
    for seqs in by_first.values():
        # The tables' common prefix is that of the lexicographically first and last of them.
        lo, hi = min(tables[s] for s in seqs), max(tables[s] for s in seqs)
        limit = min((lens[s] - 1) // block_size for s in seqs)
        num_shared = 0
        while num_shared < limit and lo[num_shared] == hi[num_shared]:
            num_shared += 1
        chunks, own = [[]], 0  # own: the last chunk's own blocks
        for s in sorted(seqs, key=lens.__getitem__):
            n = (lens[s] - 1) // block_size + 1 - num_shared
            if chunks[-1] and (own + n > num_shared or len(chunks[-1]) == DECODE_GROUP):
                chunks.append([])
                own = 0
            chunks[-1].append(s)
            own += n
        for chunk in chunks:
            if len(chunk) > 1:
                groups.append((chunk, num_shared))
            else:
                rest.extend(chunk)
    return groups, rest


def _shared_arrays(
    groups: list[tuple[list[int], int]],
    tables: list[list[int]],
    starts: list[int],
    lens: list[int],
    block_size: int,
    heads: torch.Tensor,  # [1, Hkv, 1]: 0 .. Hkv - 1
) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
    """The shared groups as one padded batch of n groups of m members over nb blocks: batch
    rows [n * m] (padded with the group's first member: a copy whose output is dropped), the
    members' places in it [k], tiles [n * Hkv * nb] (the shared blocks, then each member's own,
    padded with the last), each block's owner [n * nb] (member, -1: all) and written keys
    (0 in padding), each row's member [n * m]; and (n, m, nb)."""
    per = []  # per group: blocks, owners, valid keys
    for members, num_shared in groups:
        blocks, owner = tables[members[0]][:num_shared], [-1] * num_shared
        valid = [block_size] * num_shared
        for i, s in enumerate(members):
            last = (lens[s] - 1) // block_size
            blocks += tables[s][num_shared : last + 1]
            owner += [i] * (last + 1 - num_shared)
            valid += [block_size] * (last - num_shared) + [lens[s] - last * block_size]
        per.append((blocks, owner, valid))
    n, m, nb = len(groups), max(len(g) for g, _ in groups), max(len(b) for b, _, _ in per)
    rows, sel, member, blocks, owner, valid = [], [], [], [], [], []
    for k, ((members, _), (b, o, v)) in enumerate(zip(groups, per)):
        pad, pad_blocks = m - len(members), nb - len(b)
        rows += [starts[s] for s in members] + [starts[members[0]]] * pad
        sel += range(k * m, k * m + len(members))
        member += [*range(len(members)), *([0] * pad)]
        blocks += b + b[-1:] * pad_blocks
        owner += o + [-1] * pad_blocks
        valid += v + [0] * pad_blocks
    tiles = host_ints(blocks).view(n, 1, nb) * heads.shape[1] + heads  # [n, Hkv, nb]
    arrays = [host_ints(rows), host_ints(sel), tiles.reshape(-1)]
    return arrays + [host_ints(owner), host_ints(valid), host_ints(member)], (n, m, nb)


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    # Causal, plus HF's sliding window: key j visible to query p iff p - window < j <= p.
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    return mask


def _additive(mask: torch.Tensor) -> torch.Tensor:
    # SDPA turns a boolean mask into this (0 where visible, -inf elsewhere) on every call, so
    # the step's masks are made additive once for all layers (float32; `_TorchPlan.to` casts).
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))
