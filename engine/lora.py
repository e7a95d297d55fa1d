"""Multi-LoRA building blocks: PEFT LoRA adapters, a fixed-size slot pool, and the batched
per-token LoRA delta of one projection (issue 46).

Wired into the offline engine by `attach_lora` (each decoder layer's projection wrapped in a
`LoRALinear`): per decoder layer and engine projection (`qkv_proj`, `o_proj`, `gate_up_proj`,
`down_proj`), over a step's flattened rows:

    y = linear(x) + pool.delta(layer, "qkv_proj", x, slots)

where `slots [T]` holds each token's pool slot (-1: the base model). Weights are never merged
into the base: each adapter's A/B stay separate, so one step can serve many tenants' adapters.

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

__all__ = ["LoRAAdapter", "LoRAPool", "LoRARequest", "attach_lora", "lora_delta"]

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


def lora_delta(
    x: torch.Tensor,
    slots: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scalings: torch.Tensor,
) -> torch.Tensor:
    """The LoRA delta `[T, out]` of one projection over a flattened step.

    x `[T, in]`; slots `[T]` each token's adapter slot (-1: none, its row of the delta is
    zero); a `[S, r, in]`, b `[S, out, r]` the slots' stacked weights (ranks zero-padded to r);
    scalings `[S]`. Tokens are grouped by slot and each slot present runs PEFT's
    `(x @ A.T) @ B.T * scaling` on its rows only: no merged weights, no all-slots product.

    The group sizes are read on the host (one sync), so this cannot be captured in a CUDA
    graph. A punica-style kernel (SGMV over the sorted segments for prefill, BGMV per token for
    decode) would replace the loop below, reading the slot of each row on the device.
    """
    out = x.new_zeros(x.shape[0], b.shape[1])
    order = slots.argsort(stable=True)
    present, counts = torch.unique_consecutive(slots[order], return_counts=True)
    start = 0
    for slot, n in zip(present.tolist(), counts.tolist()):
        if slot >= 0:
            rows = order[start : start + n]
            out[rows] = ((x[rows] @ a[slot].T) @ b[slot].T * scalings[slot]).to(out.dtype)
        start += n
    return out


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
        self.scalings = torch.zeros(max_loras, dtype=torch.float32, device=device)
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

    def delta(self, layer: int, projection: str, x: torch.Tensor, slots: torch.Tensor):
        """`lora_delta` of rows `x` through this pool's adapters on one projection."""
        a, b = self.weights(layer, projection)
        return lora_delta(x, slots, a, b, self.scalings)

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
        self.scalings[slot] = adapter.scaling


class LoRAContext:
    """A model's LoRA state for one step: the pool, and `slots [T]` (each token's slot, -1 for
    the base model) while a step has adapters; None otherwise, and nothing extra runs."""

    def __init__(self, pool: LoRAPool) -> None:
        self.pool = pool
        self.slots: torch.Tensor | None = None


class LoRALinear(nn.Module):
    """A decoder layer's projection plus the pool's delta for the step's tokens. `base` is
    the `nn.Linear` (or the CPU's `PackedLinear` that `pack_linears` puts in its place)."""

    def __init__(self, base: nn.Module, layer: int, projection: str, ctx: LoRAContext) -> None:
        super().__init__()
        self.base, self.layer, self.projection, self.ctx = base, layer, projection, ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        slots = self.ctx.slots
        if slots is None:
            return y
        return y + self.ctx.pool.delta(self.layer, self.projection, x, slots).to(y.dtype)


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
