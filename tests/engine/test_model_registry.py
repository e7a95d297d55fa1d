"""engine/models: families are registered by architecture name, an unknown one fails listing
them, no family is named outside its own module, and RoPE not outside the engine."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import fairbatch
from fairbatch.engine import models
from fairbatch.engine.config import ModelConfig
from fairbatch.engine.tiny import tiny_config

ROOT = Path(fairbatch.__file__).parent
MODELS = ROOT / "engine" / "models"
# Family module -> what names its family in text or code. "llama3" stays free: the RoPE scaling
# type of that name is a shared rotary variant.
FAMILY_NAMES = {
    "llama": r"\bllama\b",
    "mistral": r"mistral",
    "qwen2": r"qwen(?!3)",
    "qwen3": r"qwen3",
    "phi3": r"\bphi-?\d",
    "gemma3": r"gemma",
}
ARCHITECTURE_NAME = re.compile(r"\b[A-Za-z]\w*For(CausalLM|ConditionalGeneration)\b")
# Engine modules that name published models for what they are not families of the decoder:
# the tokenizer's chat-template and BPE conventions, and the roofline's named shapes.
NOT_DECODER = {"tokenizer.py", "train_tokenizer.py", "detokenizer.py", "gpu_profiles.py"}
NOT_DECODER |= {"sim_runner.py"}
# Outside the product: tests, and the benchmarks' checkpoint builders (their config.json names
# the architecture HF builds).
NOT_PRODUCT = {"tests", "benchmarks", ".venv", "fairbatch.egg-info"}
# What a model's RoPE does to the prefix cache's keys reaches the rest only as the family's
# salt rule (`CausalLM.cache_salt_rule`): these packages never mention RoPE ("property" is fine).
NOT_ENGINE, ROPE = ("deployments", "scheduler", "kv", "policies"), re.compile(r"rope(?!rt)", re.I)


def _product_files() -> list[Path]:
    return [p for p in ROOT.rglob("*.py") if not NOT_PRODUCT & set(p.relative_to(ROOT).parts)]


def _own_module(path: Path) -> str | None:
    return path.stem if path.parent == MODELS and path.stem in FAMILY_NAMES else None


def test_every_family_module_is_known_here() -> None:
    modules = {p.stem for p in MODELS.glob("*.py")} - {"__init__", "decoder", "rope"}
    assert modules == set(FAMILY_NAMES), "a new family module needs its names in FAMILY_NAMES"


def test_no_family_is_named_outside_its_module() -> None:
    found, files = [], _product_files()
    assert MODELS / "decoder.py" in files and ROOT / "deployments" / "cli.py" in files
    for path in files:
        text = path.read_text()
        own = _own_module(path)
        rel = path.relative_to(ROOT)
        if own is None:
            found += [f"{rel}: {m.group(0)}" for m in ARCHITECTURE_NAME.finditer(text)]
        if rel.parts[0] != "engine" or path.name in NOT_DECODER:
            continue
        for family, pattern in FAMILY_NAMES.items():
            if family != own:
                found += [f"{rel}: {m.group(0)}" for m in re.finditer(pattern, text, re.I)]
    assert not found, "family names outside their module:\n" + "\n".join(found)


def test_rope_is_not_named_outside_the_engine() -> None:
    found, files = [], _product_files()
    assert ROOT / "deployments" / "serve" / "ingress.py" in files
    for path in files:
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_ENGINE:
            found += [f"{rel}: {m.group(0)}" for m in ROPE.finditer(path.read_text())]
    assert not found, "RoPE outside the engine:\n" + "\n".join(found)
    text = r"rope_long_from, long_rope_salt, longrope, RoPE, '\x00rope:long', @property"
    assert len(ROPE.findall(text)) == 5


def test_the_grep_sees_a_family_name() -> None:
    # the patterns match what they are meant to match
    text = "Gemma 3, Phi-4-mini, Phi3, Qwen2.5, qwen3_moe, Llama-3, Mistral"
    assert all(re.search(p, text, re.I) for p in FAMILY_NAMES.values())
    assert not re.search(FAMILY_NAMES["llama"], 'rope_type == "llama3"', re.I)
    assert ARCHITECTURE_NAME.search("Qwen3MoeForCausalLM") and not ARCHITECTURE_NAME.search(
        "CausalLM"
    )


def test_each_architecture_is_read_and_built_by_its_module() -> None:
    for name in models.architectures():
        family = models._FAMILIES[name]
        module = family.read_config.__module__.rsplit(".", 1)[-1]
        assert module in FAMILY_NAMES, name
        assert family.model.__module__.endswith(("." + module, ".decoder")), name


def test_an_unknown_architecture_fails_listing_the_registered_ones() -> None:
    registered = models.architectures()
    assert len(registered) >= 7 and registered == sorted(registered)
    for bad in ({"architectures": ["GPT2LMHeadModel"]}, {"model_type": "gpt2"}):
        with pytest.raises(ValueError, match="unsupported architecture") as e:
            ModelConfig.from_hf_dict({**bad, "hidden_size": 8})
        assert all(name in str(e.value) for name in registered)
    config = dataclasses.replace(tiny_config(vocab_size=32), architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'; supported: " + ", ".join(registered)):
        models.build_model(config)
    # A config built in code without an architecture is the plain decoder.
    assert models.model_class(tiny_config(vocab_size=32)) is models.CausalLM
