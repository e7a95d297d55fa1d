"""Multi-LoRA building blocks: PEFT LoRA adapters, a fixed-size slot pool, and the batched
per-token LoRA delta of one projection (issue 46).

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
`qkv_proj` and gate/up into one `gate_up_proj` (every architecture; Phi3 checkpoints store them
fused, and Phi3 adapters target the fused modules by those names). For a fused projection the
pool holds A stacked per sub-projection and B block-diagonal (`fused_lora_weights`): the
sub-projections' deltas land in their own output rows, exactly, in one delta per fused linear.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from fairbatch.engine.config import FUSED_CHECKPOINTS, ModelConfig
from fairbatch.engine.sampling_params import LoRARequest

__all__ = ["LoRAAdapter", "LoRAPool", "LoRARequest", "add_lora", "attach_lora", "lora_groups"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# Engine projection -> the modules (HF names) whose rows it stacks, in row order.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
# Config keys of LoRA variants and extras whose computation is not plain `B(A(x)) * scaling`
# (or that change more than the targeted linears); each is rejected when set.
UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "velora_config": "VeLoRA (velora_config)",
    "monteclora_config": "MonteCLoRA (monteclora_config)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "kasa_config": "KaSA (kasa_config)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "lora_bias": "a bias on lora_B (lora_bias)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts)",
    "layer_replication": "layer_replication",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
    "megatron_config": "Megatron parallel layers (megatron_config)",
}


# Name parts that are not the module a saved tensor belongs to.
_NOT_MODULES = {"base_model", "model", "layers", "base_layer", "weight", "bias"}
_NOT_MODULES |= {"modules_to_save", "original_module", "default"}

# init_lora_weights values after which the adapter applies to the unchanged base model.
PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")


def target_modules(config: ModelConfig) -> tuple[str, ...]:
    """The HF module names an adapter for `config` may target: the checkpoint's own linears in
    the decoder layers (Phi3's are fused)."""
    if config.architecture in FUSED_CHECKPOINTS:
        return ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    return ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of HF module `module` in a decoder layer of `config`."""
    h, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, inter),
        "up_proj": (h, inter),
        "down_proj": (inter, h),
        "qkv_proj": (h, q + 2 * kv),
        "gate_up_proj": (h, 2 * inter),
    }[module]


@dataclass(frozen=True)
class LoRAAdapter:
    """One PEFT LoRA adapter, validated against a base model's config.

    `weights[(layer, module)] = (A [r, in], B [out, r])` in the stored dtype, for every
    (layer, HF module) the adapter adapts; the others are the base model's.
    """

    path: str
    config: ModelConfig
    rank: int
    alpha: float
    use_rslora: bool
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def scaling(self) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def modules(self) -> tuple[str, ...]:
        """The HF modules this adapter adapts (in any layer), sorted."""
        return tuple(sorted({m for _, m in self.weights}))

    @classmethod
    def load(cls, path: str | Path, base_config: ModelConfig) -> LoRAAdapter:
        """Read a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`);
        a `ValueError` names whatever this engine cannot serve exactly."""
        path = Path(path)
        if not path.is_dir():
            raise ValueError(f"LoRA adapter {str(path)!r} is not a directory")
        if not (path / CONFIG_FILE).is_file():
            raise ValueError(f"LoRA adapter {str(path)!r} has no {CONFIG_FILE}")
        if not (path / WEIGHTS_FILE).is_file():
            hint = (
                " (adapter_model.bin is not read)" if (path / "adapter_model.bin").exists() else ""
            )
            raise ValueError(f"LoRA adapter {str(path)!r} has no {WEIGHTS_FILE}{hint}")
        try:
            cfg = json.loads((path / CONFIG_FILE).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"LoRA adapter {str(path)!r}: {CONFIG_FILE} is not JSON: {e}") from e
        rank, alpha, use_rslora = _check_config(cfg, base_config, where=str(path))
        weights = _read_weights(load_file(str(path / WEIGHTS_FILE)), base_config, rank, str(path))
        return cls(str(path), base_config, rank, alpha, use_rslora, weights)


def _check_config(cfg: dict, base: ModelConfig, where: str) -> tuple[int, float, bool]:
    def fail(msg: str) -> ValueError:
        return ValueError(f"LoRA adapter {where!r}: {msg}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type is {cfg['peft_type']!r}; only LORA adapters are supported")
    if cfg.get("bias", "none") != "none":
        raise fail(f"bias={cfg['bias']!r} is not supported (trained biases); only 'none'")
    for key, what in UNSUPPORTED_OPTIONS.items():
        if cfg.get(key):
            raise fail(f"{what} is not supported ({key}={cfg[key]!r})")
    init = cfg.get("init_lora_weights", True)
    if init not in PLAIN_INITS:
        raise fail(
            f"init_lora_weights={init!r} is not supported: such an adapter is relative to base "
            "weights its initialisation changed (PiSSA, OLoRA, CorDA, LoRA-GA, LoftQ) or is a "
            "LoRA variant (MiCA); save it converted to plain LoRA "
            "(save_pretrained(path_initial_model_for_weight_conversion=...))"
        )
    rank = cfg.get("r", 8)
    if not isinstance(rank, int) or rank < 1:
        raise fail(f"rank r={rank!r} must be a positive integer")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):  # a str is a regex or "all-linear": the tensors decide
        allowed = target_modules(base)
        bad = [t for t in targets if t not in allowed]
        if bad:
            raise fail(
                f"unsupported target_modules {bad} for {base.architecture}; LoRA is supported "
                f"on {list(allowed)} only"
            )
    return rank, float(cfg.get("lora_alpha", 8)), bool(cfg.get("use_rslora", False))


def _read_weights(
    tensors: dict[str, torch.Tensor], base: ModelConfig, rank: int, where: str
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    def fail(msg: str) -> ValueError:
        return ValueError(f"LoRA adapter {where!r}: {msg}")

    allowed = target_modules(base)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    # PEFT's names (adapter name stripped on save):
    # base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight
    for key, tensor in tensors.items():
        parts = key.split(".")
        lora = next((j for j, p in enumerate(parts) if p.startswith("lora_")), None)
        if not lora:  # a base-model weight saved beside the adapter (save_embedding_layers)
            owner = [p for p in parts if p not in _NOT_MODULES and not p.isdigit()]
            raise fail(
                f"tensor {key!r} is not a LoRA A/B weight: it replaces the base model's "
                f"{'.'.join(owner)!r} weights, which is not supported"
            )
        module = parts[lora - 1]
        if module not in allowed:
            raise fail(
                f"unsupported LoRA target {module!r} (tensor {key!r}); LoRA is supported on "
                f"{list(allowed)} only"
            )
        if "experts" in parts:
            raise fail(f"tensor {key!r}: LoRA on mixture-of-experts experts is not supported")
        parent = "self_attn" if module in ATTN_MODULES else "mlp"
        if (
            len(parts) != 9
            or parts[:4] != ["base_model", "model", "model", "layers"]
            or not parts[4].isdigit()
            or parts[5] != parent
            or parts[7] not in ("lora_A", "lora_B")
            or parts[8] != "weight"
        ):
            raise fail(
                f"unexpected tensor {key!r}; expected base_model.model.model.layers.<i>."
                f"{parent}.{module}.lora_A.weight / lora_B.weight"
            )
        layer = int(parts[4])
        if layer >= base.num_hidden_layers:
            raise fail(f"tensor {key!r}: layer {layer} >= the model's {base.num_hidden_layers}")
        if parent == "mlp" and base.is_moe_layer(layer):
            raise fail(f"tensor {key!r}: layer {layer} is a mixture-of-experts layer")
        found.setdefault((layer, module), {})[parts[7]] = tensor
    if not found:
        raise fail("adapter_model.safetensors holds no LoRA weights")
    weights = {}
    for (layer, module), ab in sorted(found.items()):
        name = f"layer {layer} {module}"
        for half in ("lora_A", "lora_B"):
            if half not in ab:
                raise fail(f"{name} has no {half} weight")
        a, b = ab["lora_A"], ab["lora_B"]
        in_f, out_f = module_shape(base, module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise fail(
                f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have the "
                f"config's rank r={rank} (expected [r, in] and [out, r])"
            )
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise fail(
                f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not match the "
                f"base model's {module} (in {in_f}, out {out_f}): expected "
                f"[{rank}, {in_f}] / [{out_f}, {rank}]"
            )
        weights[(layer, module)] = (a, b)
    return weights


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
    module an adapter targets by itself (Phi3's qkv_proj, gate_up_proj) fills block 0 of A and
    the first r columns of B, all its rows.
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
    """Wrap every decoder layer's projections of an engine model (`LlamaForCausalLM`) in
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
