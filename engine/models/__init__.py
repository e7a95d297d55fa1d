"""Model families, one module each, registered by their Hugging Face architecture name.

One decoder (`decoder.CausalLM`) runs every family. A family module reads its `config.json`
into a `ModelConfig` (defaults, biases, windows, the RoPE types it knows), subclasses `CausalLM`
where its model differs, and registers both with `@register(architecture, model_type, model)` on
its config reader. Every module here but the shared layers (`decoder`, `rope`) is a family,
imported with the package.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import NamedTuple

from fairbatch.engine.config import ModelConfig
from fairbatch.engine.models.decoder import CausalLM

__all__ = ["CausalLM", "architectures", "build_model", "model_class", "read_config", "register"]


class Family(NamedTuple):
    model_type: str  # HF's: names the family of a dict without `architectures`
    read_config: Callable[[dict, str], ModelConfig]  # (config.json, architecture)
    model: type[CausalLM]


_FAMILIES: dict[str, Family] = {}  # by architecture name


def register(architecture: str, model_type: str, model: type[CausalLM] = CausalLM):
    def add(read: Callable[[dict, str], ModelConfig]) -> Callable[[dict, str], ModelConfig]:
        assert architecture not in _FAMILIES, f"{architecture} is registered twice"
        _FAMILIES[architecture] = Family(model_type, read, model)
        return read

    return add


def architectures() -> list[str]:
    return sorted(_FAMILIES)


def _family(architecture: str) -> Family:
    if architecture not in _FAMILIES:
        supported = ", ".join(architectures())
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {supported}")
    return _FAMILIES[architecture]


def read_config(d: dict) -> ModelConfig:
    """A parsed `config.json` as its family reads it (`ModelConfig.from_hf_dict`)."""
    if d.get("architectures"):
        architecture = d["architectures"][0]
    else:  # a config built in code (not from a model) has no `architectures`
        by_type = {f.model_type: a for a, f in _FAMILIES.items()}
        architecture = by_type.get(d.get("model_type"), f"model_type={d.get('model_type')}")
    return _family(architecture).read_config(d, architecture)


def model_class(config: ModelConfig) -> type[CausalLM]:
    """`config`'s family's model; the plain decoder for a config without architecture."""
    return CausalLM if config.architecture is None else _family(config.architecture).model


def build_model(config: ModelConfig, attn_backend: str | None = "torch") -> CausalLM:
    return model_class(config)(config, attn_backend=attn_backend)


for _module in pkgutil.iter_modules(__path__):
    if _module.name not in ("decoder", "rope"):
        importlib.import_module(f"{__name__}.{_module.name}")
