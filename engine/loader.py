"""Load a Hugging Face model directory into its family's model (weights only; no tokenizer).

Reads `config.json`, the safetensors weights (one `model.safetensors`, or shards listed by
`model.safetensors.index.json`) and, when present, `generation_config.json`. The model is built
on the meta device and materialised directly on the target device in the target dtype, so no
throw-away random initialisation runs; `load_weights` then fails loudly on any tensor the
checkpoint lacks, which is what makes skipping the initialisation safe.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from fairbatch.engine.attention import get_attn_backend
from fairbatch.engine.config import ModelConfig, eos_ids
from fairbatch.engine.models import CausalLM, build_model
from fairbatch.engine.ops import onednn_usable

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attn_backend: str | None = None,
) -> tuple[CausalLM, ModelConfig, dict[str, Any]]:
    """Returns (model in eval mode, its config, generation defaults).

    dtype: `default_dtype` unless given. attn_backend: a registry name, or
    None for flash where it can run and torch elsewhere (checked here, not at the first step).
    The generation dict is `generation_config.json` as written, plus `eos_token_ids`: a list
    built from its `eos_token_id` (an int or a list), else from `config.json`'s.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory {root} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{root} has no config.json")
    config = ModelConfig.from_hf_dict(json.loads(config_file.read_text()))
    generation = _generation_defaults(root, config)

    device = torch.device(device)
    if dtype is None:
        dtype = default_dtype(device, config.dtype)
    # Resolve now so a backend that cannot run here fails before the weights are read.
    backend = get_attn_backend(attn_backend, device, head_dim=config.head_dim, dtype=dtype)

    files = weight_files(root)
    with torch.device("meta"):
        model = build_model(config, attn_backend=backend.name)
    model = model.to(dtype).to_empty(device=device)
    model.load_weights(_iter_tensors(files))
    return model.eval(), config, generation


def default_dtype(device: torch.device | str, checkpoint_dtype: str | None) -> torch.dtype:
    """The dtype a model runs in when none is asked for.

    On CUDA, bfloat16. On the CPU, the checkpoint's own dtype (config.json's `dtype` /
    `torch_dtype`) where the CPU computes it natively: a bfloat16 or float16 checkpoint runs in
    bfloat16 where oneDNN has a bfloat16 path (AVX-512 BF16 or AMX; about 1.7x float32's
    speed on a 0.5B model, docs/BENCHMARKS.md), and float32 elsewhere; float16 has no fast CPU
    path. A float32 checkpoint, or one that names no dtype, runs in float32."""
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    if checkpoint_dtype in ("bfloat16", "float16") and onednn_usable("cpu", torch.bfloat16):
        return torch.bfloat16
    return torch.float32


def weight_files(root: Path) -> list[Path]:
    """The safetensors files of a checkpoint, in a stable order."""
    index = root / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [root / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {root} lists missing shard(s): {missing}")
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(p.name for p in root.glob("*.bin")) + sorted(p.name for p in root.glob("*.pt"))
    hint = f" (found {others}: only safetensors is supported)" if others else ""
    raise FileNotFoundError(f"{root} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    # One tensor at a time, so peak host memory is one tensor, not the checkpoint.
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # safe_open is not a mapping: keys() is the API
                yield name, f.get_tensor(name)


def _generation_defaults(root: Path, config: ModelConfig) -> dict[str, Any]:
    file = root / "generation_config.json"
    generation: dict[str, Any] = json.loads(file.read_text()) if file.is_file() else {}
    eos = eos_ids(generation.get("eos_token_id")) or config.eos_token_ids
    generation["eos_token_ids"] = list(eos)
    return generation
