"""Qwen3, Qwen3-MoE and Llama 3.2 against transformers on the same random-weight checkpoints.

Each checkpoint is a scaled-down copy of a published configuration that keeps what makes it
itself: Qwen3-0.6B's per-head q/k norms, explicit head_dim (not hidden / heads) and tied
embeddings; Qwen3-30B-A3B's sparse MoE layers (here 8 experts, top-2, renormalised) mixed with a
dense one through `mlp_only_layers`, untied; Llama-3.2-1B's tied embeddings and llama3 RoPE
scaling. They are built with benchmarks/checkpoints.py (weights at initializer_range 0.2, so
greedy tokens do not hinge on rounding; the shipped tokenizer's files), then every RMSNorm weight
is moved off 1, so a norm whose weight were not loaded or not applied would show.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fairbatch.benchmarks import checkpoints
from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.attention import AttentionMetadata
from fairbatch.engine.config import SUPPORTED_ARCHITECTURES, ModelConfig
from fairbatch.engine.loader import load_hf_model
from fairbatch.engine.mlp import SparseMoeBlock
from fairbatch.engine.model import LlamaForCausalLM
from fairbatch.tests.engine.test_generate import fb_greedy, hf_greedy, make_prompts

VOCAB = checkpoints.VOCAB

QWEN3 = dict(  # Qwen3-0.6B: hidden 1024, 16 / 8 heads of 128, intermediate 3072, tied
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # 4 * 32 != 64, as 16 * 128 != 1024
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    attention_bias=False,
    use_sliding_window=False,
    sliding_window=None,
    max_window_layers=28,
)
QWEN3_MOE = dict(  # Qwen3-30B-A3B: 128 experts, top-8, moe_intermediate 768, untied
    QWEN3,
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    num_hidden_layers=4,
    tie_word_embeddings=False,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[1],  # layers 0, 2, 3 sparse; 1 dense
)
LLAMA32 = dict(  # Llama-3.2-1B's shape (benchmarks' "llama-3.2-1b"), narrower and shorter
    checkpoints.SHAPES["llama-3.2-1b"],
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=16,
    # A short original context, so all three frequency bands of the llama3 scaling occur.
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
)
SHAPES = {"qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "llama3.2": LLAMA32}
# Checked on logits only: Qwen3's attention_bias puts a bias on q, k, v and o alike.
LOGITS_ONLY = {"qwen3_bias": dict(QWEN3, attention_bias=True, tie_word_embeddings=False)}
ALL_SHAPES = {**SHAPES, **LOGITS_ONLY}


def _perturb_norms(path: Path, seed: int) -> None:
    file = path / "model.safetensors"
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.3 * torch.randn(t.shape, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("new_archs")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            path = checkpoints.build_checkpoint(
                root / name, checkpoints.hf_config(ALL_SHAPES[name])
            )
            _perturb_norms(path, seed=list(ALL_SHAPES).index(name))
            built[name] = path
        return built[name]

    return get


@pytest.fixture(scope="module")
def hf_models(ckpts):
    from transformers import AutoModelForCausalLM

    cache: dict[str, torch.nn.Module] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = AutoModelForCausalLM.from_pretrained(
                ckpts(name), attn_implementation="eager", dtype=torch.float32
            ).eval()
        return cache[name]

    return get


def test_checkpoints_keep_the_structure(ckpts) -> None:
    qwen3 = ModelConfig.from_hf_dict(json.loads((ckpts("qwen3") / "config.json").read_text()))
    assert qwen3.architecture == "Qwen3ForCausalLM" and qwen3.qk_norm
    assert qwen3.head_dim * qwen3.num_attention_heads != qwen3.hidden_size
    assert qwen3.tie_word_embeddings and not qwen3.attention_bias and not qwen3.o_proj_bias
    moe = ModelConfig.from_hf_dict(json.loads((ckpts("qwen3_moe") / "config.json").read_text()))
    assert (moe.num_experts, moe.num_experts_per_tok, moe.norm_topk_prob) == (8, 2, True)
    assert [moe.is_moe_layer(i) for i in range(4)] == [True, False, True, True]
    assert moe.qk_norm and not moe.tie_word_embeddings
    llama = ModelConfig.from_hf_dict(json.loads((ckpts("llama3.2") / "config.json").read_text()))
    assert llama.tie_word_embeddings and llama.rope_scaling["rope_type"] == "llama3"
    assert (ckpts("qwen3") / "tokenizer.json").is_file()


@pytest.mark.parametrize("name", sorted(ALL_SHAPES))
def test_logits_match_transformers(name: str, ckpts, hf_models) -> None:
    """One paged prefill of several prompts: every position's logits equal HF's."""
    model, config, _ = load_hf_model(ckpts(name))
    if name == "qwen3_bias":
        assert config.attention_bias and config.o_proj_bias
    hf = hf_models(name)
    rng = random.Random(0)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(n)] for n in (5, 1, 23, 40)]
    lens = [len(p) for p in prompts]
    block_size, free = 4, list(range(64))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil(n / block_size))] for n in lens]
    caches = [
        torch.zeros(model.kv_cache_shape(64, block_size)) for _ in range(config.num_hidden_layers)
    ]
    meta, positions = AttentionMetadata.build(lens, lens, tables, block_size)
    logits = model.compute_logits(model(torch.tensor(sum(prompts, [])), positions, caches, meta))
    start = 0
    for p in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(logits[start : start + len(p)], ref, atol=1e-4, rtol=1e-4)
        start += len(p)


# The knobs of tests/engine/test_generate.py: each must leave the greedy tokens as HF's.
SCENARIOS = {
    "plain": dict(block_size=4, num_gpu_blocks=512),
    "chunked_prefill": dict(block_size=4, num_gpu_blocks=512, max_num_batched_tokens=7),
    "recompute": dict(block_size=4, num_gpu_blocks=40, preemption_mode="recompute"),
    "swap": dict(block_size=4, num_gpu_blocks=40, num_cpu_blocks=400, preemption_mode="swap"),
    "prefix_cache": dict(block_size=4, num_gpu_blocks=512, max_num_batched_tokens=48),
}


def _prompts() -> list[list[int]]:
    # Varied lengths, two prompts sharing a 24-token prefix, and one prompt asked twice: the
    # repeat and the sharer come late, after the first one's blocks are cached.
    shared = make_prompts(n=2, vocab=VOCAB, shared_prefix=24, seed=8)
    return [shared[0], *make_prompts(n=7, vocab=VOCAB, seed=7), shared[1], shared[0]]


@pytest.fixture(scope="module")
def greedy_refs(ckpts):
    refs: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in refs:
            refs[name] = hf_greedy(ckpts(name), _prompts())
        return refs[name]

    return get


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("name", sorted(SHAPES))
def test_greedy_matches_transformers(name: str, scenario: str, ckpts, greedy_refs) -> None:
    got, engine = fb_greedy(ckpts(name), _prompts(), **SCENARIOS[scenario])
    if scenario in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions[scenario] > 0
    if scenario == "prefix_cache":
        assert engine.scheduler.num_prefix_hit_tokens >= 2 * 24
    assert got == greedy_refs(name)


def test_seeded_sampling_is_batch_and_preemption_independent(ckpts) -> None:
    """test_generate.py's seeded-sampling pattern on Qwen3-MoE: a seeded request samples the
    same tokens alone, in a mixed batch, and under recompute preemption."""
    path = str(ckpts("qwen3_moe"))
    prompts = make_prompts(n=6, vocab=VOCAB, seed=11)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    others = SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)
    llm = LLM(path, block_size=4, num_gpu_blocks=512)
    alone = llm.generate([prompts[0]], seeded, use_tqdm=False)[0].token_ids
    mixed = llm.generate(prompts, [seeded] + [others] * 5, use_tqdm=False)
    assert mixed[0].token_ids == alone
    tight = LLM(path, block_size=4, num_gpu_blocks=24, preemption_mode="recompute")
    got = tight.generate(prompts, [seeded] * 6, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions["recompute"] > 0
    assert got[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=16)
    assert llm.generate([prompts[0]], other_seed, use_tqdm=False)[0].token_ids != alone


def test_router_choices_match_transformers(ckpts, hf_models) -> None:
    """Each sparse layer picks the experts (and weights) HF's router picks, on the hidden
    states HF's router saw; and each expert runs once, on exactly the rows routed to it."""
    model, config, _ = load_hf_model(ckpts("qwen3_moe"))
    hf = hf_models("qwen3_moe")
    seen: dict[int, tuple[torch.Tensor, tuple]] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda _m, args, out, i=i: seen.__setitem__(i, (args[0].detach(), out))
        )
        for i, layer in enumerate(hf.model.layers)
        if config.is_moe_layer(i)
    ]
    rng = random.Random(3)
    with torch.no_grad():
        hf(torch.tensor([[rng.randrange(4, VOCAB) for _ in range(48)]]))
    for hook in hooks:
        hook.remove()
    assert sorted(seen) == [0, 2, 3]

    rows: Counter[int] = Counter()  # expert -> rows it ran on, in one block call
    for i, (hidden, (_, hf_weights, hf_experts)) in seen.items():
        block = model.model.layers[i].mlp
        assert isinstance(block, SparseMoeBlock)
        weights, experts = block.route(hidden)
        assert torch.equal(experts, hf_experts), f"layer {i}"
        torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-6)
        rows.clear()
        calls = [
            expert.register_forward_pre_hook(
                lambda _m, args, e=e: rows.update({e: args[0].shape[0]})
            )
            for e, expert in enumerate(block.experts)
        ]
        block(hidden)
        for call in calls:
            call.remove()
        counts = torch.bincount(experts.flatten(), minlength=config.num_experts).tolist()
        assert rows == {e: n for e, n in enumerate(counts) if n}
        assert sum(rows.values()) == hidden.shape[0] * config.num_experts_per_tok

    model.pack_for_cpu()  # the engine's CPU fast path: the same choices
    for i, (hidden, (_, _, hf_experts)) in seen.items():
        assert torch.equal(model.model.layers[i].mlp.route(hidden)[1], hf_experts)


def test_moe_block_is_bitwise_transformers_in_bfloat16(ckpts) -> None:
    """In bfloat16 the sparse block's output equals HF's bit for bit, packed for the CPU or
    not: routing weights cast back to bf16 as HF casts them, each token's expert outputs added
    in HF's order."""
    from transformers import AutoModelForCausalLM

    path = ckpts("qwen3_moe")
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, experts_implementation="eager"
    ).eval()
    model, _, _ = load_hf_model(path, dtype=torch.bfloat16)
    x = 3 * torch.randn(37, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        ref = hf.model.layers[0].mlp(x[None])[0]
    assert torch.equal(model.model.layers[0].mlp(x), ref)
    model.pack_for_cpu()
    assert torch.equal(model.model.layers[0].mlp(x), ref)


@pytest.mark.parametrize(
    ("layers", "step", "mlp_only"), [(4, 1, [1]), (4, 2, []), (6, 3, [2]), (3, 1, [0, 1, 2])]
)
def test_moe_layer_layout_matches_transformers(layers: int, step: int, mlp_only: list) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_config = Qwen3MoeConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, moe_intermediate_size=4,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
        num_experts=2, num_experts_per_tok=1, decoder_sparse_step=step, mlp_only_layers=mlp_only,
    )  # fmt: skip
    hf = Qwen3MoeForCausalLM(hf_config)
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    with torch.device("meta"):
        ours = LlamaForCausalLM(config)
    expected = [isinstance(layer.mlp, Qwen3MoeSparseMoeBlock) for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers] == expected
    assert [config.is_moe_layer(i) for i in range(layers)] == expected


def test_unsupported_architecture_fails_at_load_naming_the_supported(ckpts, tmp_path) -> None:
    alien = tmp_path / "alien"
    shutil.copytree(ckpts("qwen3"), alien)
    config = json.loads((alien / "config.json").read_text())
    (alien / "config.json").write_text(
        json.dumps({**config, "architectures": ["Qwen3NextForCausalLM"]})
    )
    with pytest.raises(ValueError, match="unsupported architecture 'Qwen3NextForCausalLM'") as e:
        LLM(str(alien), num_gpu_blocks=16)
    assert all(name in str(e.value) for name in SUPPORTED_ARCHITECTURES)
    assert {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} <= set(SUPPORTED_ARCHITECTURES)

    windowed = {**config, "use_sliding_window": True, "sliding_window": 16}
    (alien / "config.json").write_text(json.dumps(windowed))
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        LLM(str(alien), num_gpu_blocks=16)
