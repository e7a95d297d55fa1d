"""PEFT LoRA adapters as the engine reads them: `adapter_config.json` and
`adapter_model.safetensors`, validated against the base model's config (targets among the
decoder layers' linears, one rank and alpha, rsLoRA), with a `ValueError` naming whatever the
engine cannot serve exactly. The slot pool and the per-step delta are in `lora.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from fairbatch.engine.config import ModelConfig
from fairbatch.engine.models import model_class
from fairbatch.engine.models.decoder import PROJECTIONS

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

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
    the decoder layers (split or fused as the checkpoint stores them)."""
    stacked = model_class(config).stacked
    return tuple(name for p in PROJECTIONS for name in stacked.get(p, (p,)))


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
                f"unsupported target_modules {bad} for {base.architecture or 'this model'}; "
                f"LoRA is supported on {list(allowed)} only"
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
