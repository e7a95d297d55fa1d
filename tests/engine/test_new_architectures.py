"""Qwen3, Qwen3-MoE, Llama 3.2, Phi-4-mini and Gemma 3 against transformers on the same
random-weight checkpoints.

Each checkpoint is a scaled-down copy of a published configuration that keeps what makes it
itself: Qwen3-0.6B's per-head q/k norms, explicit head_dim (not hidden / heads) and tied
embeddings; Qwen3-30B-A3B's sparse MoE layers (here 8 experts, top-2, renormalised) mixed with a
dense one through `mlp_only_layers`, untied; Llama-3.2-1B's tied embeddings and llama3 RoPE
scaling; Phi-4-mini-instruct's fused qkv_proj / gate_up_proj, partial rotary (0.75), longrope
(short and long factors, a 32x max/original length ratio, so an attention factor on cos/sin),
GQA 3:1, tied embeddings and a sliding window that never binds; gemma-3-1b's 5:1 sliding /
global layers with a window shorter than the prompts, two RoPE bases, (1 + w) and sandwich
norms, q/k norms, scaled embeddings, GELU-tanh and tied embeddings (see GEMMA3). Built with
benchmarks/checkpoints.py (weights at initializer_range 0.2, so greedy tokens do not hinge on
rounding; the shipped tokenizer's files), then every RMSNorm weight is moved off 1, so a norm
whose weight were not loaded or not applied would show.
"""

from __future__ import annotations

import dataclasses
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
from fairbatch.engine.config import ModelConfig
from fairbatch.engine.loader import load_hf_model
from fairbatch.engine.models import CausalLM, architectures, build_model
from fairbatch.engine.models.decoder import SparseMoeBlock
from fairbatch.engine.models.gemma3 import Gemma3ForCausalLM
from fairbatch.tests.engine.test_generate import (
    GREEDY,
    NEW_TOKENS,
    fb_greedy,
    hf_greedy,
    make_prompts,
)

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
# Phi-4-mini-instruct: hidden 3072, 24 / 8 heads of 128 (rotary 96: factors of 48), original
# length 4096 of 131072, window 262144. Here the original length is 64: every sequence of
# _prompts() stays within it (the longest prompt has 52 tokens, plus 12 generated), and
# _phi_long_prompts() go past it.
PHI_ORIGINAL = 64
PHI4_MINI = dict(
    architectures=["Phi3ForCausalLM"],
    model_type="phi3",
    hidden_size=96,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,  # head_dim 16, rotary_dim 12: factors of 6
    max_position_embeddings=32 * PHI_ORIGINAL,
    original_max_position_embeddings=PHI_ORIGINAL,
    partial_rotary_factor=0.75,
    rope_theta=10000.0,
    rope_scaling={
        "type": "longrope",  # the key Phi-4-mini's config.json uses
        "short_factor": [1.0, 1.05, 1.2, 1.5, 2.0, 2.6],
        "long_factor": [1.0, 1.4, 3.0, 7.5, 18.0, 40.0],
    },
    rms_norm_eps=1e-5,
    sliding_window=64 * PHI_ORIGINAL,  # past max_position_embeddings, as 262144 > 131072
    tie_word_embeddings=True,
    attention_bias=False,
    mlp_bias=False,
    lm_head_bias=False,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attention_dropout=0.0,
    pad_token_id=checkpoints.EOS_IDS[0],  # Phi-4-mini pads with its EOS
)
# gemma-3-1b-it: hidden 1152, 26 layers (5 sliding : 1 global, `sliding_window_pattern` 6),
# 4 / 1 heads of 256, intermediate 6912, window 512, local / global RoPE bases 1e4 / 1e6, q/k
# norms, tied. Here 6 layers (layer 5 global), a window of 16 that binds on most prompts
# (up to 52 tokens + 12 generated), gemma-3-4b's linear RoPE scaling (factor 8, global layers
# only), a query_pre_attn_scalar other than head_dim (gemma-3-27b's kind) and a final logit
# soft-cap, which the published configs leave unset, so that its tanh is exercised.
GEMMA_WINDOW = 16
GEMMA3 = dict(
    architectures=["Gemma3ForCausalLM"],
    model_type="gemma3_text",
    hidden_size=64,
    intermediate_size=192,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=32,  # 4 * 32 != 64, as 4 * 256 != 1152
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    query_pre_attn_scalar=24,
    sliding_window=GEMMA_WINDOW,
    sliding_window_pattern=6,
    rope_theta=1000000.0,
    rope_local_base_freq=10000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
    final_logit_softcapping=15.0,  # top raw logits ~11: it bends them without saturating
    attn_logit_softcapping=None,
    tie_word_embeddings=True,
    attention_bias=False,
    pad_token_id=0,
)
SHAPES = {
    "qwen3": QWEN3,
    "qwen3_moe": QWEN3_MOE,
    "llama3.2": LLAMA32,
    "phi4_mini": PHI4_MINI,
    "gemma3": GEMMA3,
}
LOGITS_ONLY = {
    # Qwen3's attention_bias puts a bias on q, k, v and o alike.
    "qwen3_bias": dict(QWEN3, attention_bias=True, tie_word_embeddings=False),
    # Phi-3-mini-4k's kind: plain RoPE (still partial here), a window that binds, untied.
    "phi3_window": dict(PHI4_MINI, rope_scaling=None, sliding_window=16, tie_word_embeddings=False),
}
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
    if name == "phi3_window":
        assert config.sliding_window == 16 and config.rotary_dim == 12
        assert config.rope_scaling is None and not config.tie_word_embeddings
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
        ours = build_model(config)
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
    assert all(name in str(e.value) for name in architectures())
    assert {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"} <= set(architectures())

    windowed = {**config, "use_sliding_window": True, "sliding_window": 16}
    (alien / "config.json").write_text(json.dumps(windowed))
    with pytest.raises(NotImplementedError, match="use_sliding_window"):
        LLM(str(alien), num_gpu_blocks=16)


def _phi_config(ckpts, name: str = "phi4_mini") -> dict:
    return json.loads((ckpts(name) / "config.json").read_text())


def test_phi4_mini_checkpoint_and_rope_match_transformers(ckpts, hf_models) -> None:
    """The checkpoint keeps Phi-4-mini's structure (fused tensors loaded as they are, tied, no
    bias), and the engine's RoPE equals transformers' Phi3RotaryEmbedding: both factor sets'
    inverse frequencies bit for bit, the attention factor, and cos/sin at every position,
    below the original length (short factors) and past it (long factors)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    names = set(load_file(ckpts("phi4_mini") / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith(("q_proj.weight", ".bias")) for n in names)
    assert "lm_head.weight" not in names  # tied
    model, config, _ = load_hf_model(ckpts("phi4_mini"))
    assert config.architecture == "Phi3ForCausalLM" and config.tie_word_embeddings
    assert (config.head_dim, config.rotary_dim, config.sliding_window) == (16, 12, None)
    assert config.rope_scaling["original_max_position_embeddings"] == PHI_ORIGINAL
    assert max(len(p) for p in _prompts()) + NEW_TOKENS == PHI_ORIGINAL

    hf = hf_models("phi4_mini")
    rotary = model.model.rotary
    short, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu")
    long, scaling = ROPE_INIT_FUNCTIONS["longrope"](hf.config, "cpu", seq_len=PHI_ORIGINAL + 1)
    assert torch.equal(rotary.inv_freq, short) and torch.equal(rotary.long_inv_freq, long)
    assert rotary.attention_scaling == scaling == hf.model.rotary_emb.attention_scaling > 1
    positions = torch.arange(3 * PHI_ORIGINAL)
    cos, sin = rotary(positions, torch.float32)
    x = torch.zeros(1, 1, config.hidden_size)
    for end in (PHI_ORIGINAL, 3 * PHI_ORIGINAL):  # as a short, then a long call sees them
        with torch.no_grad():
            ref_cos, ref_sin = hf.model.rotary_emb(x, positions[None, end - 1 : end])
        assert torch.equal(cos[end - 1, 0], ref_cos[0, 0])
        assert torch.equal(sin[end - 1, 0], ref_sin[0, 0])


def _hf_per_call(hf, prompt: list[int], new_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' Phi3 run one call at a time on its cache, without generate's recompute
    at the original length: the prompt's first `original` tokens in one call, every later
    token alone. Returns the prompt's logits `[len, vocab]` and the greedy tokens."""
    ids = torch.tensor([prompt])
    logits, tokens, cache = [], [], None
    with torch.no_grad():
        calls = [ids[:, :PHI_ORIGINAL]] + [
            ids[:, i : i + 1] for i in range(PHI_ORIGINAL, len(prompt))
        ]
        for chunk in calls:
            out = hf(chunk, cache=cache, use_cache=True)
            logits.append(out.logits[0])
            cache = out.cache
        for _ in range(new_tokens):
            tokens.append(int(logits[-1][-1].argmax()))
            if len(tokens) < new_tokens:
                out = hf(torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
                logits.append(out.logits[0])
                cache = out.cache
    return torch.cat(logits)[: len(prompt)], tokens


def test_phi4_mini_prompt_past_original_length(ckpts, hf_models) -> None:
    """A prompt longer than original_max_position_embeddings: flagged long (as the runner
    flags a long sequence's tokens), every position turns with the long factors, as in
    transformers' one-shot forward of the whole prompt (and so its generate). Unflagged, each
    position turns with the factors of its own position: transformers' logits when it is fed
    the first `original` tokens in one call and the rest one at a time."""
    model, config, _ = load_hf_model(ckpts("phi4_mini"))
    hf = hf_models("phi4_mini")
    prompt = _phi_long_prompts()[0]
    n, block_size = len(prompt), 4
    table = list(range(31, 31 - math.ceil(n / block_size), -1))

    def forward(long_tokens):
        layers = config.num_hidden_layers
        caches = [torch.zeros(model.kv_cache_shape(32, block_size)) for _ in range(layers)]
        meta, positions = AttentionMetadata.build([n], [n], [table], block_size)
        model.model.rotary.long_tokens = long_tokens
        try:
            return model.compute_logits(model(torch.tensor(prompt), positions, caches, meta))
        finally:
            model.model.rotary.long_tokens = None

    with torch.no_grad():
        one_shot = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(
        forward(torch.ones(n, dtype=torch.bool)), one_shot, atol=1e-4, rtol=1e-4
    )
    per_position = forward(None)
    per_call, _ = _hf_per_call(hf, prompt, 1)
    torch.testing.assert_close(per_position, per_call, atol=1e-4, rtol=1e-4)
    assert (per_position[1:] - one_shot[1:]).abs().amax(dim=-1).min() > 1e-3  # the flags matter


def _phi_long_prompts() -> list[list[int]]:
    # 80 and 77 tokens: past the original length from the prompt on; 58: it crosses while
    # generating; 48: stays within. The first one again, last, hits the prefix cache. All
    # share their first 40 tokens: the short one must not read the long ones' blocks.
    prompts = make_prompts(n=4, vocab=VOCAB, shared_prefix=40, seed=9)
    return [*prompts, prompts[0]]


@pytest.fixture(scope="module")
def phi_long_refs(ckpts) -> list[list[int]]:
    return hf_greedy(ckpts("phi4_mini"), _phi_long_prompts())


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_phi4_mini_past_original_length_under_scheduling(scenario, ckpts, phi_long_refs) -> None:
    """Past the original length the engine's tokens are transformers' `generate`'s: a long
    prompt turns long from its first token, and a sequence that grows past the original
    length while generating is recomputed long there (a recompute preemption), as Phi3's
    generate drops its cache at that point; chunked, preempted (recompute, swap) or served
    from the prefix cache (salted long or short, so the short sequence never reads a long
    one's blocks), every sequence generates the same tokens."""
    got, engine = fb_greedy(ckpts("phi4_mini"), _phi_long_prompts(), **SCENARIOS[scenario])
    if scenario == "swap":
        assert engine.scheduler.num_preemptions["swap"] > 0
    # the crossing sequence (58 tokens) was recomputed at least once
    assert engine.scheduler.num_preemptions["recompute"] > 0
    if scenario == "prefix_cache":
        assert engine.scheduler.num_prefix_hit_tokens >= PHI_ORIGINAL
    assert got == phi_long_refs
    assert len({tuple(t) for t in got[:4]}) == 4


def test_the_cluster_client_hashes_a_long_prompt_as_its_replica_caches_it(ckpts) -> None:
    """The controller routes by the client's prompt hashes against the replicas' cached ones:
    a prompt past longrope's original length is cached under a salt of its own, so the client
    (given the model's salt rule, from the checkpoint's config as the ingress reads it) salts
    and hashes it as the engine does; a short prompt keeps the plain salt."""
    pytest.importorskip("ray")  # the client module imports it
    from fairbatch.deployments.cluster.client import ClusterClient
    from fairbatch.deployments.serve.ingress import model_salt_rule

    path = ckpts("phi4_mini")
    client = ClusterClient(None, block_size=4, salt_rule=model_salt_rule(str(path)))
    plain = ClusterClient(None, block_size=4)  # a model without such a salt
    assert model_salt_rule("tiny") is None
    long_prompt, short_prompt = max(_phi_long_prompts(), key=len), min(_phi_long_prompts(), key=len)
    assert len(long_prompt) > PHI_ORIGINAL >= len(short_prompt)
    _, engine = fb_greedy(path, [long_prompt, short_prompt], block_size=4, num_gpu_blocks=128)
    cached = engine.scheduler.kv.gpu_pool.cached

    def hashes(client, prompt):
        return client.prefix_hashes(prompt, client.salt_of(prompt, "default", None))

    for prompt in (long_prompt, short_prompt):
        salt = client.salt_of(prompt, "default", None)
        assert salt == engine.make_request(prompt, tenant="default").cache_salt
        assert (salt != "default") == (prompt is long_prompt)
        got = hashes(client, prompt)
        assert got and all(h in cached for h in got)
    assert not set(hashes(client, long_prompt)) & set(hashes(plain, long_prompt))


def test_gemma3_config_reads_as_transformers_does(ckpts, hf_models) -> None:
    """The checkpoint keeps gemma-3-1b's structure, and both config.json layouts read as
    transformers reads them: the published 4.x one (`sliding_window_pattern`,
    `rope_local_base_freq`, `rope_theta` + `rope_scaling`) and the 5.x one this checkpoint
    has (`layer_types`, `rope_parameters` per layer type); the engine's two RoPE tables equal
    HF's per layer type."""
    from transformers import Gemma3TextConfig

    written = json.loads((ckpts("gemma3") / "config.json").read_text())
    names = set(load_file(ckpts("gemma3") / "model.safetensors"))
    assert "lm_head.weight" not in names  # tied
    assert "model.layers.0.pre_feedforward_layernorm.weight" in names
    model, config, _ = load_hf_model(ckpts("gemma3"))
    hf = hf_models("gemma3")
    published = {  # the 4.x layout of google/gemma-3-1b-it's config.json, shape cut down
        k: v for k, v in GEMMA3.items() if k not in ("layer_types", "rope_parameters")
    }
    published = checkpoints.hf_config(published)
    for d in (written, published):
        c = ModelConfig.from_hf_dict(d)
        assert dataclasses.replace(c, dtype=config.dtype) == config
    pattern = ["sliding_attention"] * 5 + ["full_attention"]
    assert list(config.layer_types) == hf.config.layer_types == pattern
    assert list(Gemma3TextConfig(**published).layer_types) == pattern
    assert [config.layer_window(i) for i in range(6)] == [GEMMA_WINDOW] * 5 + [None]
    assert config.attention_windows == (GEMMA_WINDOW, None)
    assert (config.rope_local_theta, config.rope_theta) == (10000.0, 1000000.0)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert config.tie_word_embeddings and config.qk_norm
    assert isinstance(model, Gemma3ForCausalLM)
    assert config.hidden_act == "gelu_pytorch_tanh" and written["hidden_act"] == "silu"
    assert model.model.layers[0].self_attn.scale == 24**-0.5 == hf.model.layers[0].self_attn.scaling

    positions = torch.arange(200)
    x = torch.zeros(1, 1, config.hidden_size)
    for ours, kind in ((model.model.local_rotary, "sliding"), (model.model.rotary, "full")):
        cos, sin = ours(positions, torch.float32)
        with torch.no_grad():
            ref_cos, ref_sin = hf.model.rotary_emb(x, positions[None], f"{kind}_attention")
        assert torch.equal(cos[:, 0], ref_cos[0]) and torch.equal(sin[:, 0], ref_sin[0])
    assert max(len(p) for p in _prompts()) > 3 * GEMMA_WINDOW  # the window binds


def test_gemma3_window_and_softcap_bind(ckpts, hf_models) -> None:
    """The settings the logits test checks all matter on this checkpoint: without the
    sliding window, or without the final soft-cap, the logits of a long prompt move far
    past the test's tolerance (so matching HF proves each is applied)."""
    model, config, _ = load_hf_model(ckpts("gemma3"))
    prompt = make_prompts(n=1, vocab=VOCAB, shared_prefix=48, seed=5)[0]
    n, block_size = len(prompt), 4
    table = list(range(math.ceil(n / block_size)))

    def run(m: CausalLM) -> torch.Tensor:
        caches = [torch.zeros(m.kv_cache_shape(32, block_size)) for _ in range(6)]
        meta, positions = AttentionMetadata.build([n], [n], [table], block_size)
        return m.compute_logits(m(torch.tensor(prompt), positions, caches, meta))

    ours = run(model)
    with torch.no_grad():
        ref = hf_models("gemma3")(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    assert (run(model) - ref)[GEMMA_WINDOW:].abs().amax() > 1e-2
    uncapped = build_model(
        dataclasses.replace(config, final_logit_softcapping=None), attn_backend="torch"
    )
    uncapped.load_state_dict(model.state_dict())
    assert (run(uncapped) - ref).abs().amax() > 1e-1


def test_gemma3_staged_step_plans_every_window_once(ckpts, monkeypatch) -> None:
    """The CUDA code path on CPU tensors (staged inputs): each step stages one plan per
    window (sliding, full) in its one copy, no layer plans again, and the tokens are the
    plain CPU path's."""
    from fairbatch.engine.attention import TorchAttentionBackend
    from fairbatch.engine.staging import Staging

    path, prompts = str(ckpts("gemma3")), _prompts()
    kwargs = dict(block_size=4, num_gpu_blocks=512, max_num_batched_tokens=48)
    ref = LLM(path, **kwargs).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(path, **kwargs)
    runner = llm.engine.runner
    runner.staging = Staging("cpu")
    windows: list = []
    plan = TorchAttentionBackend.step_plan
    monkeypatch.setattr(
        TorchAttentionBackend,
        "step_plan",
        lambda self, *a: windows.append(a[-1]) or plan(self, *a),
    )
    got = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert runner.staging.num_uploads == runner.num_steps
    assert windows == [GEMMA_WINDOW, None] * runner.num_steps


def test_gemma3_attn_softcapping_is_read_not_applied(ckpts, hf_models, caplog) -> None:
    """transformers' Gemma3 reads `attn_logit_softcapping` but never passes it to its
    attention functions (eager, sdpa or flash): a config that sets it gives the same logits.
    The engine follows transformers, and warns."""
    from transformers import AutoModelForCausalLM

    hf = hf_models("gemma3")
    capped = AutoModelForCausalLM.from_pretrained(
        ckpts("gemma3"), attn_implementation="eager", dtype=torch.float32,
        attn_logit_softcapping=0.5,
    ).eval()  # fmt: skip
    assert capped.config.attn_logit_softcapping == 0.5
    ids = torch.tensor([make_prompts(n=1, vocab=VOCAB, seed=4)[0]])
    with torch.no_grad():
        assert torch.equal(capped(ids).logits, hf(ids).logits)
    config = ModelConfig.from_hf_dict({**capped.config.to_dict(), "architectures": None})
    assert config.attn_logit_softcapping == 0.5
    with caplog.at_level("WARNING"):
        with torch.device("meta"):
            build_model(config)
    assert "attn_logit_softcapping=0.5 is not applied" in caplog.text


def test_gemma3_unsupported_settings_fail_at_load(ckpts) -> None:
    config = json.loads((ckpts("gemma3") / "config.json").read_text())
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        ModelConfig.from_hf_dict({**config, "use_bidirectional_attention": True})
    with pytest.raises(NotImplementedError, match="hidden_act='gelu'"):
        ModelConfig.from_hf_dict({**config, "hidden_activation": "gelu"})
    rope = {**config["rope_parameters"], "sliding_attention": {"rope_type": "linear"}}
    with pytest.raises(NotImplementedError, match="sliding-layer rope_type='linear'"):
        ModelConfig.from_hf_dict({**config, "rope_parameters": rope})


def test_phi3_unsupported_rope_fails_at_load(ckpts, tmp_path) -> None:
    bad = tmp_path / "phi"
    shutil.copytree(ckpts("phi4_mini"), bad)
    config = _phi_config(ckpts)
    for rope_type in ("dynamic", "llama3"):
        rope = {**config["rope_parameters"], "rope_type": rope_type, "type": rope_type}
        written = {**config, "rope_parameters": rope, "rope_scaling": rope}
        (bad / "config.json").write_text(json.dumps(written))
        with pytest.raises(NotImplementedError, match=f"rope_type='{rope_type}'.*Phi3.*longrope"):
            LLM(str(bad), num_gpu_blocks=16)
    rope = {**config["rope_parameters"], "short_factor": [1.0] * 5}
    (bad / "config.json").write_text(json.dumps({**config, "rope_parameters": rope}))
    with pytest.raises(ValueError, match="short_factor has 5 entries; rotary_dim // 2 = 6"):
        LLM(str(bad), num_gpu_blocks=16)
    # Phi3Config's old name of longrope still loads as longrope.
    rope = {**config["rope_parameters"], "rope_type": "su", "type": "su"}
    su = ModelConfig.from_hf_dict({**config, "rope_parameters": rope})
    assert su.rope_scaling["rope_type"] == "longrope"
    # Partial rotary stays Phi3's: on Llama it still fails.
    with pytest.raises(NotImplementedError, match="partial_rotary_factor"):
        ModelConfig.from_hf_dict({**checkpoints.hf_config(LLAMA32), "partial_rotary_factor": 0.5})
