"""Multi-LoRA building blocks: a fixed-size slot pool of adapters (read by
`lora_adapter.py`), and the batched per-token LoRA delta of one projection.

Wired into the offline engine by `attach_lora` (each decoder layer's projection wrapped in a
`LoRALinear`): per decoder layer and engine projection (`qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`), over a step's flattened rows:

    y = linear(x);  y[rows of slot s] += lora_B_s(lora_A_s(x[rows of slot s])) * scaling_s

for each slot s that the step's tokens use (`add_lora`), the rows grouped once per step on the
host (`lora_groups`: a request's tokens are contiguous, so a slot's rows are mostly one range).
Weights are never merged into the base: each adapter's A/B stay separate, so one step can serve
many tenants' adapters.

An adapter's delta on a module is PEFT's `lora_B(lora_A(x)) * scaling` with scaling
`lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`). The engine fuses q/k/v into one
`qkv_proj` and gate/up into one `gate_up_proj` (every architecture; a checkpoint that stores
them fused has adapters that target the fused modules by those names). For a fused projection the
pool holds A stacked per sub-projection and B block-diagonal (`fused_lora_weights`): the
sub-projections' deltas land in their own output rows, exactly, in one delta per fused linear.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from fairbatch.engine.config import ModelConfig
from fairbatch.engine.lora_adapter import LoRAAdapter, module_shape
from fairbatch.engine.models.decoder import PROJECTIONS
from fairbatch.engine.sampling_params import LoRARequest

__all__ = ["LoRAAdapter", "LoRAPool", "LoRARequest", "add_lora", "attach_lora", "lora_groups"]


def projection_shape(config: ModelConfig, projection: str) -> tuple[int, list[int]]:
    """(in_features, the out_features of each stacked sub-projection) of an engine
    projection."""
    shapes = [module_shape(config, m) for m in PROJECTIONS[projection]]
    return shapes[0][0], [out for _, out in shapes]


def fused_lora_weights(
    adapter: LoRAAdapter, layer: int, projection: str, max_rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An adapter's A `[n * max_rank, in]` and B `[out, n * max_rank]` for one engine
    projection stacking n modules (qkv_proj: q, k, v; gate_up_proj: gate, up; n = 1 for
    o_proj and down_proj).

    Sub-projection k's A fills rows `[k * max_rank, k * max_rank + r)` of A, its B the block
    (its output rows, those columns) of B; everything else is zero. So `B @ (A @ x)` is each
    module's `B_k @ (A_k @ x)` in its own output rows: exact (the zero blocks add exact zeros),
    and one delta per fused linear. A module the adapter does not adapt stays zero. A fused
    module an adapter targets by itself (a fused checkpoint's qkv_proj, gate_up_proj) fills
    block 0 of A and the first r columns of B, all its rows.
    """
    if adapter.rank > max_rank:
        raise ValueError(f"adapter rank {adapter.rank} exceeds max_rank {max_rank}")
    parts = PROJECTIONS[projection]
    in_f, outs = projection_shape(adapter.config, projection)
    dtype = next(iter(adapter.weights.values()))[0].dtype
    a_out = torch.zeros(len(parts) * max_rank, in_f, dtype=dtype)
    b_out = torch.zeros(sum(outs), len(parts) * max_rank, dtype=dtype)
    r = adapter.rank
    if (layer, projection) in adapter.weights and len(parts) > 1:  # fused in the checkpoint
        a, b = adapter.weights[(layer, projection)]
        a_out[:r], b_out[:, :r] = a, b
        return a_out, b_out
    row = 0
    for k, (module, out) in enumerate(zip(parts, outs)):
        if (layer, module) in adapter.weights:
            a, b = adapter.weights[(layer, module)]
            a_out[k * max_rank : k * max_rank + r] = a
            b_out[row : row + out, k * max_rank : k * max_rank + r] = b
        row += out
    return a_out, b_out


@dataclass
class LoRAGroup:
    """The rows of a step that run under one slot: `start:end` when contiguous, else `rows`
    (int64 on the device)."""

    slot: int
    scaling: float
    start: int = 0
    end: int = 0
    rows: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.end - self.start if self.rows is None else int(self.rows.numel())


def lora_groups(
    spans: list[tuple[int, int]], scalings: list[float], device: torch.device | str = "cpu"
) -> list[LoRAGroup]:
    """A step's rows grouped by slot, from its consecutive `(slot, num_rows)` spans (slot -1:
    the base model, no group). Built once per step on the host; the projections then read no
    slot on the device (no sync per projection)."""
    ranges: dict[int, list[tuple[int, int]]] = {}
    row = 0
    for slot, n in spans:
        if slot >= 0 and n > 0:
            mine = ranges.setdefault(slot, [])
            if mine and mine[-1][1] == row:
                mine[-1] = (mine[-1][0], row + n)
            else:
                mine.append((row, row + n))
        row += n
    groups = []
    for slot, parts in ranges.items():
        if len(parts) == 1:
            groups.append(LoRAGroup(slot, scalings[slot], *parts[0]))
        else:
            rows = torch.tensor([i for s, e in parts for i in range(s, e)], device=device)
            groups.append(LoRAGroup(slot, scalings[slot], rows=rows))
    return groups


def add_lora(
    y: torch.Tensor, x: torch.Tensor, groups: list[LoRAGroup], a: torch.Tensor, b: torch.Tensor
) -> torch.Tensor:
    """Add the LoRA delta of one projection to its base output `y [T, out]`, in place, and
    return `y`. x `[T, in]`; a `[S, r, in]`, b `[S, out, r]` the slots' stacked weights (ranks
    zero-padded to r). Each group runs PEFT's `(x @ A.T) @ B.T * scaling` on its rows only and
    adds it as PEFT adds it: no merged weights, no all-slots product, nothing for base rows.

    A loop over the adapters present: on CUDA a punica-style kernel (SGMV over the segments
    for prefill, BGMV per token for decode) would run them all at once."""
    for g in groups:
        if g.rows is None:
            part = x[g.start : g.end]
            delta = (part @ a[g.slot].T) @ b[g.slot].T * g.scaling
            y[g.start : g.end] += delta.to(y.dtype)
        else:
            delta = (x[g.rows] @ a[g.slot].T) @ b[g.slot].T * g.scaling
            y.index_add_(0, g.rows, delta.to(y.dtype))
    return y


class LoRAPoolFullError(RuntimeError):
    """Every slot of a LoRAPool holds an adapter that a running request holds."""


class LoRAPool:
    """`max_loras` adapter slots for one model's four engine projections, on one device.

    `a[projection] [L, S, n * max_rank, in]` and `b[projection] [L, S, out, n * max_rank]`
    (see `fused_lora_weights`), `scalings [S]`. `load(name, adapter)` puts an adapter in a slot
    (a free one, else the least recently used one no request holds) and pins it for the
    request; `release(name)` unpins. A name is taken to identify its adapter: loading a name
    that is loaded pins its slot again without rereading the weights.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_loras: int,
        max_rank: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_loras < 1 or max_rank < 1:
            raise ValueError(f"max_loras ({max_loras}) and max_rank ({max_rank}) must be >= 1")
        self.config, self.max_loras, self.max_rank = config, max_loras, max_rank
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        layers = config.num_hidden_layers
        for proj, parts in PROJECTIONS.items():
            in_f, outs = projection_shape(config, proj)
            r = len(parts) * max_rank
            self.a[proj] = torch.zeros(layers, max_loras, r, in_f, dtype=dtype, device=device)
            self.b[proj] = torch.zeros(layers, max_loras, sum(outs), r, dtype=dtype, device=device)
        self.scalings = [0.0] * max_loras  # slot -> its adapter's scaling
        self._names: list[str | None] = [None] * max_loras  # slot -> adapter name
        self._pins = [0] * max_loras  # slot -> running requests holding it
        self._recent: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.num_loads = 0  # adapters written into a slot (a reload after eviction counts)

    def resident(self) -> list[str]:
        """The adapters in a slot now (a request for one starts without a load)."""
        return list(self._recent)

    def slot_of(self, name: str) -> int | None:
        """The slot holding adapter `name`, or None."""
        return self._recent.get(name)

    def weights(self, layer: int, projection: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A `[S, r, in]` and B `[S, out, r]` of one layer's projection."""
        return self.a[projection][layer], self.b[projection][layer]

    def groups(self, spans: list[tuple[int, int]], device: torch.device | str = "cpu"):
        """`lora_groups` of a step's `(slot, num_rows)` spans, with these slots' scalings."""
        return lora_groups(spans, self.scalings, device)

    def add_delta(
        self, layer: int, projection: str, y: torch.Tensor, x: torch.Tensor, groups: list
    ) -> torch.Tensor:
        """`add_lora` of rows `x` through this pool's adapters on one projection, into `y`."""
        a, b = self.weights(layer, projection)
        return add_lora(y, x, groups, a, b)

    def load(self, name: str, adapter: LoRAAdapter) -> int:
        """Pin adapter `name` for one request, loading it first if it is not in a slot."""
        slot = self._recent.get(name)
        if slot is None:
            self.check(adapter)
            slot = self._free_slot()
            self._write(slot, adapter)
            self._names[slot] = name
            self.num_loads += 1
        self._pins[slot] += 1
        self._recent[name] = slot
        self._recent.move_to_end(name)
        return slot

    def release(self, name: str) -> None:
        """A request that held `name` is done; it stays loaded until its slot is needed."""
        slot = self._recent.get(name)
        if slot is None or self._pins[slot] == 0:
            raise ValueError(f"LoRA adapter {name!r} is not held by any request")
        self._pins[slot] -= 1
        self._recent.move_to_end(name)

    def evict(self, name: str) -> None:
        """Free `name`'s slot now, if it has one that no request holds."""
        slot = self._recent.get(name)
        if slot is not None and self._pins[slot] == 0:
            del self._recent[name]
            self._names[slot] = None

    def _free_slot(self) -> int:
        if None in self._names:
            return self._names.index(None)
        for name, slot in self._recent.items():  # least recently used first
            if self._pins[slot] == 0:
                del self._recent[name]
                self._names[slot] = None
                return slot
        raise LoRAPoolFullError(
            f"all {self.max_loras} LoRA slots hold adapters in use by running requests "
            f"({sorted(self._recent)}); raise max_loras or wait for one to finish"
        )

    def can_load(self, name: str) -> bool:
        """Whether `load(name, ...)` would find a slot now (loaded, free or evictable)."""
        return name in self._recent or 0 in self._pins

    def check(self, adapter: LoRAAdapter) -> None:
        """ValueError unless `adapter` fits this pool (its model, a rank <= max_rank)."""
        mine, theirs = self.config, adapter.config
        shape = ("hidden_size", "intermediate_size", "num_attention_heads")
        shape += ("num_key_value_heads", "head_dim", "num_hidden_layers", "architecture")
        diff = [k for k in shape if getattr(mine, k) != getattr(theirs, k)]
        if diff:
            raise ValueError(f"LoRA adapter {adapter.path!r} was loaded for another model {diff}")
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"LoRA adapter {adapter.path!r} has rank {adapter.rank} > max_rank {self.max_rank}"
            )

    def _write(self, slot: int, adapter: LoRAAdapter) -> None:
        for proj in PROJECTIONS:
            for layer in range(self.config.num_hidden_layers):
                a, b = fused_lora_weights(adapter, layer, proj, self.max_rank)
                self.a[proj][layer, slot].copy_(a)
                self.b[proj][layer, slot].copy_(b)
        self.scalings[slot] = float(adapter.scaling)


class LoRAContext:
    """A model's LoRA state for one step: the pool, and the step's `groups` (`lora_groups`)
    while a step has adapters; None otherwise, and nothing extra runs."""

    def __init__(self, pool: LoRAPool) -> None:
        self.pool = pool
        self.groups: list[LoRAGroup] | None = None


class LoRALinear(nn.Module):
    """A decoder layer's projection plus the pool's delta for the step's tokens. `base` is
    the `nn.Linear` (or the CPU's `PackedLinear` that `pack_linears` puts in its place)."""

    def __init__(self, base: nn.Module, layer: int, projection: str, ctx: LoRAContext) -> None:
        super().__init__()
        self.base, self.layer, self.projection, self.ctx = base, layer, projection, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = self.ctx.groups
        if groups is None:
            return y
        return self.ctx.pool.add_delta(self.layer, self.projection, y, x, groups)


def attach_lora(model: nn.Module, pool: LoRAPool) -> LoRAContext:
    """Wrap every decoder layer's projections of an engine model (`CausalLM`) in
    `LoRALinear`s reading one context; returns it (the runner sets its slots per step).
    A mixture-of-experts layer's MLP is left alone (adapters may not target it)."""
    ctx = LoRAContext(pool)
    for i, layer in enumerate(model.model.layers):
        layer.lora = ctx
        owners = [(layer.self_attn, ("qkv_proj", "o_proj"))]
        if not model.config.is_moe_layer(i):
            owners.append((layer.mlp, ("gate_up_proj", "down_proj")))
        for owner, names in owners:
            for name in names:
                setattr(owner, name, LoRALinear(getattr(owner, name), i, name, ctx))
    return ctx
