"""benchmarks/checkpoints.py: the random-weight checkpoints of real shapes load in fairbatch and
generate the same greedy tokens as transformers on the same directory.

The two real shapes are built scaled down (fewer layers, a narrower model) but keep what makes
them themselves: Qwen2.5's q/k/v bias, tied embeddings and rope_theta 1e6; Llama-3.2's explicit
head_dim, tied embeddings and llama3 RoPE scaling with rope_theta 500000."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fairbatch.benchmarks import checkpoints
from fairbatch.engine.config import ModelConfig
from fairbatch.engine.loader import load_hf_model

SCALED = {
    "qwen2.5-0.5b": dict(
        hidden_size=112, intermediate_size=256, num_hidden_layers=2, num_attention_heads=14,
        num_key_value_heads=2,
    ),
    "llama-3.2-1b": dict(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64,
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SCALED))
def scaled_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    shape = request.param
    path = tmp_path_factory.mktemp("shapes") / shape
    checkpoints.build_checkpoint(path, checkpoints.hf_config(shape, **SCALED[shape]))
    return shape, path


def test_files_and_config_keep_the_shape(scaled_ckpt) -> None:
    shape, path = scaled_ckpt
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    written = json.loads((path / "config.json").read_text())
    config = ModelConfig.from_hf_dict(written)
    assert config.vocab_size == 2048 and config.tie_word_embeddings
    assert written["rope_theta"] == checkpoints.SHAPES[shape]["rope_theta"]  # transformers 4.x
    if shape == "qwen2.5-0.5b":
        assert config.attention_bias and config.rope_theta == 1e6
        assert config.architecture == "Qwen2ForCausalLM"
    else:
        assert config.head_dim == 64 and config.rope_theta == 500000.0
        assert config.rope_scaling["rope_type"] == "llama3"
        assert written["rope_scaling"]["factor"] == 32.0
    _, _, generation = load_hf_model(path)
    assert generation["eos_token_ids"] == checkpoints.EOS_IDS


def test_greedy_tokens_match_transformers(scaled_ckpt) -> None:
    from transformers import AutoModelForCausalLM

    from fairbatch.engine import LLM, SamplingParams

    _, path = scaled_ckpt
    prompts = [[5, 900, 17, 44, 1203, 7], [300 + i for i in range(21)], [2000, 4]]
    new = 8
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for p in prompts:
            out = hf.generate(
                torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                pad_token_id=0, attention_mask=torch.ones(1, len(p), dtype=torch.long),
            )  # fmt: skip
            expected.append(out[0, len(p) :].tolist())
    llm = LLM(str(path), num_gpu_blocks=64, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected


def test_full_shapes_parse_in_fairbatch() -> None:
    """The published configurations themselves, not only the scaled ones, are ones fairbatch's
    loader accepts (no weights needed to check that)."""
    qwen = ModelConfig.from_hf_dict(checkpoints.hf_config("qwen2.5-0.5b"))
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.intermediate_size) == (896, 24, 4864)
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim) == (14, 2, 64)
    assert qwen.attention_bias and qwen.tie_word_embeddings and qwen.sliding_window is None
    llama = ModelConfig.from_hf_dict(checkpoints.hf_config("llama-3.2-1b"))
    assert (llama.hidden_size, llama.num_hidden_layers, llama.intermediate_size) == (2048, 16, 8192)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim) == (32, 8, 64)
    assert llama.rope_scaling["original_max_position_embeddings"] == 8192
    assert llama.tie_word_embeddings and not llama.attention_bias


def test_ensure_checkpoint_builds_once_and_resolves(tmp_path: Path) -> None:
    first = checkpoints.ensure_checkpoint("tiny", "bfloat16", root=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = checkpoints.ensure_checkpoint("tiny", "bfloat16", root=tmp_path)
    assert again == first and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind
    assert json.loads((first / "config.json").read_text())["dtype"] == "bfloat16"
    assert checkpoints.resolve_model(str(first)) == first
    with pytest.raises(ValueError, match="neither a known shape"):
        checkpoints.resolve_model(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="unknown shape"):
        checkpoints.ensure_checkpoint("gpt-5", root=tmp_path)
