"""The CPU fast paths (engine/ops.py: oneDNN linears with prepacked weights; the MLP in row
slices) against Hugging Face transformers in float32, and bfloat16 against float32 within a
stated tolerance."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from torch import nn

import fairbatch.engine.models.decoder as decoder_module
import fairbatch.engine.ops as ops_module
from fairbatch.engine.attention import AttentionMetadata
from fairbatch.engine.loader import default_dtype, load_hf_model
from fairbatch.engine.ops import PackedLinear, onednn_usable, pack_linears

pytestmark = pytest.mark.skipif(
    not onednn_usable("cpu", torch.float32), reason="this torch build has no oneDNN"
)

CKPTS = ["llama_ckpt", "qwen2_ckpt", "mistral_ckpt"]
VOCAB = 512
# bfloat16 keeps 8 bits of mantissa: on these checkpoints (large logits, 3 layers) a bf16
# model's log-probs stay within this of float32's on every token the float32 model gives at
# least 1e-3 probability (measured worst: 0.37-0.47), and its top token is one float32 scores
# within this of its own top.
BF16_LOGPROB_ATOL = 0.6


def _logits(model, prompts: list[list[int]]) -> torch.Tensor:
    """Every prompt position's float32 logits, all prompts prefilled in one paged step."""
    lens = [len(p) for p in prompts]
    block_size = 4
    free = list(range(64))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(n / block_size))] for n in lens]
    dtype = next(model.parameters()).dtype
    caches = [
        torch.zeros(model.kv_cache_shape(64, block_size), dtype=dtype)
        for _ in range(model.config.num_hidden_layers)
    ]
    meta, positions = AttentionMetadata.build(lens, lens, tables, block_size)
    hidden = model(torch.tensor(sum(prompts, [])), positions, caches, meta)
    return model.compute_logits(hidden)


def _hf_logits(path, prompts: list[list[int]]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 1, 23, 40, 17)]


def test_packed_linear_is_the_linear() -> None:
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(48, 80)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(80, 48, generator=gen))
        lin.bias.copy_(torch.randn(80, generator=gen))
    packed = PackedLinear(lin)
    for rows in (0, 1, 7, 300):
        x = torch.randn(rows, 48, generator=gen)
        torch.testing.assert_close(packed(x), lin(x), atol=1e-4, rtol=1e-5)
    x = torch.randn(5, 96, generator=gen)[:, ::2]  # a strided input
    torch.testing.assert_close(packed(x), lin(x), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("ckpt", CKPTS)
def test_packed_model_matches_hf(ckpt: str, request, monkeypatch) -> None:
    path = request.getfixturevalue(ckpt)
    model, _, _ = load_hf_model(path)
    model.pack_for_cpu()
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    # Slices of 7 rows, so the sliced MLP runs (and a last, shorter slice) on small prompts.
    monkeypatch.setattr(decoder_module, "CPU_MLP_ROWS", 7)
    prompts = _prompts()
    torch.testing.assert_close(
        _logits(model, prompts), _hf_logits(path, prompts), atol=1e-4, rtol=1e-4
    )


@pytest.mark.parametrize("ckpt", CKPTS)
def test_bf16_logprobs_close_to_hf_float32(ckpt: str, request) -> None:
    path = request.getfixturevalue(ckpt)
    model, _, _ = load_hf_model(path, dtype=torch.bfloat16)
    # packed where oneDNN has a bfloat16 path on this CPU (AVX-512), torch's kernels elsewhere
    assert (pack_linears(model) > 0) == onednn_usable("cpu", torch.bfloat16)
    prompts = _prompts()
    ours = _logits(model, prompts).log_softmax(-1)
    ref = _hf_logits(path, prompts).log_softmax(-1)
    likely = ref > math.log(1e-3)
    worst = (ours - ref).abs()[likely].max().item()
    assert worst <= BF16_LOGPROB_ATOL
    picked = ref.gather(1, ours.argmax(-1, keepdim=True)).squeeze(1)
    assert (ref.max(-1).values - picked).max().item() <= BF16_LOGPROB_ATOL


@pytest.mark.parametrize("native_bf16", [True, False])
def test_default_dtype_is_the_checkpoints_where_the_cpu_computes_it(
    native_bf16: bool, monkeypatch
) -> None:
    monkeypatch.setattr(ops_module, "_BF16", native_bf16)  # oneDNN's bf16 path, as detected
    low = torch.bfloat16 if native_bf16 else torch.float32
    assert default_dtype("cpu", "bfloat16") == low
    assert default_dtype("cpu", "float16") == low  # no fast float16 on CPU: bf16's range
    assert default_dtype("cpu", "float32") == torch.float32
    assert default_dtype("cpu", None) == torch.float32
    assert default_dtype("cuda", "float32") == torch.bfloat16


def test_a_bfloat16_checkpoint_runs_in_bfloat16_by_default(llama_ckpt, tmp_path) -> None:
    """Saved in bfloat16 (as most published checkpoints are), a model loaded without a dtype
    runs in bfloat16 where the CPU has the path, and its log-probs stay within the bf16
    tolerance of transformers' float32 on the same (bf16-rounded) weights."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "bf16"
    shutil.copytree(llama_ckpt, path)
    weights = path / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights)
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))

    model, _, _ = load_hf_model(path)
    expected = torch.bfloat16 if onednn_usable("cpu", torch.bfloat16) else torch.float32
    assert {p.dtype for p in model.parameters()} == {expected}
    model.pack_for_cpu()
    prompts = _prompts()
    ours = _logits(model, prompts).log_softmax(-1)
    ref = _hf_logits(path, prompts).log_softmax(-1)  # float32 over the bf16 weights
    likely = ref > math.log(1e-3)
    assert (ours - ref).abs()[likely].max().item() <= BF16_LOGPROB_ATOL
