"""engine/lora.py against PEFT itself: adapters made with `peft.get_peft_model`, their lora_B
randomised (PEFT starts B at zero, which would make every delta vanish), saved with
`save_pretrained`, then read by `LoRAAdapter.load` and computed by the pool's batched delta,
row for row against PEFT's own layers on a mixed batch (`adapter_names`, "__base__" rows).

Tiny random Llama (and Phi3, whose adapters target its fused qkv_proj / gate_up_proj), float32.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from fairbatch.engine.config import ModelConfig  # noqa: E402
from fairbatch.engine.lora import (  # noqa: E402
    PROJECTIONS,
    LoRAAdapter,
    LoRAPool,
    LoRAPoolFullError,
    add_lora,
    lora_groups,
)

TOL = dict(atol=1e-5, rtol=1e-5)
SHAPE = dict(  # q 32 = 4 heads x 8, kv 16, hidden 24: every module's shape differs
    vocab_size=64,
    hidden_size=24,
    intermediate_size=40,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Different ranks, alphas, targets; one rsLoRA; one on layer 1 only.
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=ALL),
    "c": dict(
        r=2,
        lora_alpha=3,
        target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"],
        layers_to_transform=[1],
    ),
}
PHI_ADAPTERS = {
    "p": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj"]),
    "q": dict(r=2, lora_alpha=5, use_rslora=True, target_modules=["qkv_proj", "down_proj"]),
}


def _base(arch: str):
    torch.manual_seed(0)
    if arch == "llama":
        hf_config = transformers.LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"])
        model = transformers.LlamaForCausalLM(hf_config)
    else:
        hf_config = transformers.Phi3Config(
            **SHAPE, architectures=["Phi3ForCausalLM"], pad_token_id=0
        )
        model = transformers.Phi3ForCausalLM(hf_config)
    return model.eval(), ModelConfig.from_hf_dict(hf_config.to_dict())


def _make_adapter(base, path: Path, seed: int, **lora_kwargs) -> Path:
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora_kwargs))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(str(path))
    return path


def _setup(arch: str, specs: dict, root: Path):
    base, config = _base(arch)
    dirs = {
        name: _make_adapter(base, root / name, seed, **kw)
        for seed, (name, kw) in enumerate(specs.items())
    }
    names = list(dirs)
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(dirs[names[0]]), names[0])
    for name in names[1:]:
        ref.load_adapter(str(dirs[name]), adapter_name=name)
    ref.eval()
    adapters = {name: LoRAAdapter.load(d, config) for name, d in dirs.items()}
    return base, config, dirs, ref, adapters


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _setup("llama", ADAPTERS, tmp_path_factory.mktemp("lora_llama"))


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return _setup("phi3", PHI_ADAPTERS, tmp_path_factory.mktemp("lora_phi3"))


def _lora_layers(ref):
    """(layer, module name, PEFT lora layer) of every adapted linear in `ref`."""
    for name, mod in ref.named_modules():
        if isinstance(mod, peft.tuners.lora.LoraLayer):
            parts = name.split(".")
            yield int(parts[parts.index("layers") + 1]), parts[-1], mod


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_load_matches_peft_tensors_and_scaling(arch, request) -> None:
    """Every A / B is PEFT's tensor exactly, every (layer, module) PEFT adapted is read and
    nothing else; scaling is PEFT's (alpha / r, alpha / sqrt(r) with rsLoRA)."""
    _, _, _, ref, adapters = request.getfixturevalue(arch)
    expected: dict[str, set] = {name: set() for name in adapters}
    for layer, module, mod in _lora_layers(ref):
        for name in mod.lora_A:
            expected[name].add((layer, module))
            a, b = adapters[name].weights[(layer, module)]
            assert torch.equal(a, mod.lora_A[name].weight)
            assert torch.equal(b, mod.lora_B[name].weight)
            assert b.abs().sum() > 0  # randomised, not PEFT's zero init
            assert adapters[name].scaling == mod.scaling[name]
    for name, adapter in adapters.items():
        assert set(adapter.weights) == expected[name]
    if arch == "llama":
        assert adapters["b"].scaling == 16 / 8**0.5 and adapters["a"].scaling == 2.0
        assert adapters["c"].modules == ("down_proj", "gate_proj", "k_proj", "o_proj")
        assert {layer for layer, _ in adapters["c"].weights} == {1}


def _base_weight(base, layer: int, projection: str) -> torch.Tensor:
    block = base.model.layers[layer]
    parent = block.self_attn if projection in ("qkv_proj", "o_proj") else block.mlp
    if hasattr(parent, projection):  # Phi3: fused in the checkpoint
        return getattr(parent, projection).weight
    return torch.cat([getattr(parent, m).weight for m in PROJECTIONS[projection]])


def _peft_out(ref, layer: int, projection: str, x, names: list[str]) -> torch.Tensor:
    block = ref.base_model.model.model.layers[layer]
    parent = block.self_attn if projection in ("qkv_proj", "o_proj") else block.mlp
    modules = [projection] if hasattr(parent, projection) else PROJECTIONS[projection]
    outs = []
    for m in modules:
        mod = getattr(parent, m)
        if isinstance(mod, peft.tuners.lora.LoraLayer):
            outs.append(mod(x, adapter_names=names))  # PEFT's mixed-batch forward
        else:
            outs.append(mod(x))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_mixed_batch_delta_matches_peft_row_for_row(arch, request) -> None:
    """Base + several adapters in one batch, on every layer's four engine projections (the
    fused qkv_proj / gate_up_proj from the per-module adapters, or Phi3's fused targets): base
    linear + pool delta equals PEFT's layer output for each row's adapter."""
    base, config, _, ref, adapters = request.getfixturevalue(arch)
    pool = LoRAPool(config, max_loras=len(adapters) + 1, max_rank=8)
    slot = {name: pool.load(name, adapter) for name, adapter in adapters.items()}
    names = ["__base__", *adapters] * 3 + list(adapters)
    g = torch.Generator().manual_seed(1)
    names = [names[i] for i in torch.randperm(len(names), generator=g).tolist()]
    slots = torch.tensor([slot.get(n, -1) for n in names])
    groups = pool.groups([(s, 1) for s in slots.tolist()])  # rows of a slot scattered
    changed = 0
    with torch.no_grad():
        for layer in range(config.num_hidden_layers):
            for projection in PROJECTIONS:
                w = _base_weight(base, layer, projection)
                x = torch.randn(len(names), w.shape[1], generator=g)
                ours = pool.add_delta(layer, projection, x @ w.T, x, groups)
                expected = _peft_out(ref, layer, projection, x, names)
                torch.testing.assert_close(ours, expected, **TOL)
                base_rows = slots < 0
                torch.testing.assert_close(ours[base_rows], x[base_rows] @ w.T, **TOL)
                changed += int(((expected - x @ w.T).abs() > 1e-3).any(dim=1).sum())
    assert changed > 0.5 * len(names) * config.num_hidden_layers  # the deltas are not zero


def test_delta_reads_only_the_slots_present() -> None:
    """Groups only: slots no token uses are never read (NaN there changes nothing), base rows
    are left as they are; a slot's rows are one range when contiguous, an index otherwise."""
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, 3, 5, generator=g), torch.randn(4, 6, 3, generator=g)
    a[1], b[3] = float("nan"), float("nan")
    scalings = [0.5, 1.0, 2.0, 3.0]
    x = torch.randn(8, 5, generator=g)
    slots = [2, -1, 0, 0, 2, 2, -1, 0]
    spans = [(2, 1), (-1, 1), (0, 2), (2, 2), (-1, 1), (0, 1)]  # as a step's requests
    groups = lora_groups(spans, scalings)
    assert [(gr.slot, gr.start, gr.end) for gr in groups if gr.rows is None] == []
    assert {gr.slot: gr.rows.tolist() for gr in groups} == {2: [0, 4, 5], 0: [2, 3, 7]}
    one = lora_groups([(-1, 3), (0, 2), (0, 3)], scalings)  # one range: a slice, no index
    assert [(gr.slot, gr.start, gr.end, gr.rows) for gr in one] == [(0, 3, 8, None)]
    y = torch.randn(8, 6, generator=g)
    out = add_lora(y.clone(), x, groups, a, b)
    assert torch.isfinite(out).all()
    for t, s in enumerate(slots):
        want = y[t] if s < 0 else y[t] + (x[t] @ a[s].T) @ b[s].T * scalings[s]
        torch.testing.assert_close(out[t], want, **TOL)
    assert torch.equal(add_lora(y.clone(), x, lora_groups([(-1, 8)], scalings), a, b), y)


def _slot_tensors(pool: LoRAPool, slot: int) -> list[torch.Tensor]:
    return [t[:, slot].clone() for d in (pool.a, pool.b) for t in d.values()] + [
        torch.tensor(pool.scalings[slot])
    ]


def test_pool_lru_pins_full_error_and_reload(llama) -> None:
    _, config, _, _, adapters = llama
    a, b, c = adapters["a"], adapters["b"], adapters["c"]
    fresh = LoRAPool(config, max_loras=1, max_rank=8)
    fresh.load("a", a)
    a_weights = _slot_tensors(fresh, 0)

    pool = LoRAPool(config, max_loras=2, max_rank=8)
    assert pool.load("a", a) == 0 and pool.load("b", b) == 1
    assert pool.load("a", a) == 0  # already loaded: pinned twice, not reread
    pool.release("a")
    pool.release("b")
    pool.release("a")
    # Least recently used first: b was released before a's last release.
    assert pool.load("c", c) == 1
    assert pool.slot_of("b") is None and pool.slot_of("c") == 1 and pool.slot_of("a") == 0
    # c is pinned, a is not: loading b evicts a even though c is older.
    assert pool.load("b", b) == 0 and pool.slot_of("a") is None
    with pytest.raises(LoRAPoolFullError, match="all 2 LoRA slots .*in use"):
        pool.load("a", a)
    assert pool.slot_of("b") == 0 and pool.slot_of("c") == 1  # the failed load changed nothing
    pool.release("c")
    assert pool.load("a", a) == 1  # c evicted; a reloaded over c's weights
    for got, want in zip(_slot_tensors(pool, 1), a_weights):
        assert torch.equal(got, want)  # identical to a first load: nothing of c remains
    x, width = torch.randn(3, config.hidden_size), pool.b["qkv_proj"].shape[2]
    out = pool.add_delta(0, "qkv_proj", torch.zeros(3, width), x, pool.groups([(1, 3)]))
    ref = fresh.add_delta(0, "qkv_proj", torch.zeros(3, width), x, fresh.groups([(0, 3)]))
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="'c' is not held"):
        pool.release("c")
    with pytest.raises(ValueError, match="rank 8 > max_rank 4"):
        LoRAPool(config, max_loras=1, max_rank=4).load("b", b)
    other = dataclasses.replace(config, intermediate_size=48)
    with pytest.raises(ValueError, match="another model.*intermediate_size"):
        LoRAPool(other, max_loras=1, max_rank=8).load("a", a)
    # A refused load evicts nothing: the LRU adapter stays and its slot stays usable.
    small = LoRAPool(config, max_loras=1, max_rank=4)
    small.load("a", a)
    small.release("a")
    with pytest.raises(ValueError, match="rank 8 > max_rank 4"):
        small.load("b", b)
    assert small.slot_of("a") == 0 and small.load("c", c) == 0 and small.slot_of("a") is None


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg.update(changes)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    (dst / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes()
    )
    return dst


def test_bad_adapter_directories_fail_naming_the_problem(llama, tmp_path) -> None:
    base, config, dirs, _, _ = llama
    good = dirs["c"]  # r=2, layer 1 only

    def bad(path, match, cfg=config):
        with pytest.raises(ValueError, match=match):
            LoRAAdapter.load(path, cfg)

    bad(tmp_path / "nowhere", "is not a directory")
    (tmp_path / "empty").mkdir()
    bad(tmp_path / "empty", "has no adapter_config.json")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text("{}")
    (no_weights / "adapter_model.bin").write_bytes(b"")
    bad(no_weights, r"has no adapter_model.safetensors \(adapter_model.bin is not read\)")

    # Real PEFT adapters with what the engine cannot serve exactly.
    def made(name, **kw):
        kw.setdefault("target_modules", ["q_proj"])
        return _make_adapter(base, tmp_path / name, 0, r=2, **kw)

    bad(
        made("embed", target_modules=["q_proj", "embed_tokens"]),
        r"target_modules \['embed_tokens'\]",
    )
    bad(made("head", target_modules=["lm_head"]), r"target_modules \['lm_head'\]")
    bad(made("bias", bias="all"), "bias='all' is not supported")
    bad(made("dora", use_dora=True), r"DoRA \(use_dora\) is not supported")
    bad(made("save", modules_to_save=["lm_head"]), "modules_to_save .* is not supported")
    bad(made("pattern", rank_pattern={"q_proj": 4}), r"per-module ranks \(rank_pattern\)")
    # A regex target list: the tensors themselves name the unsupported module.
    embed = tmp_path / "embed_regex"
    bad(
        _edit_config(tmp_path / "embed", embed, target_modules=".*"),
        "not a LoRA A/B weight: it replaces the base model's 'embed_tokens'",
    )

    bad(_edit_config(good, tmp_path / "loha", peft_type="LOHA"), "only LORA adapters")
    pissa = _edit_config(good, tmp_path / "pissa", init_lora_weights="pissa_niter_4")
    bad(pissa, "init_lora_weights='pissa_niter_4' is not supported: .* base weights")
    bad(_edit_config(good, tmp_path / "rank", r=4), "do not have the config's rank r=4")
    other = dataclasses.replace(config, intermediate_size=48)
    bad(
        good,
        r"layer 1 down_proj: .* do not match the base model's down_proj \(in 48, out 24\)",
        other,
    )
    bad(good, "layer 1 >= the model's 1", dataclasses.replace(config, num_hidden_layers=1))
    moe = dataclasses.replace(config, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    bad(dirs["b"], "mlp.* layer 0 is a mixture-of-experts layer", moe)  # experts: no LoRA yet

    half = _edit_config(good, tmp_path / "half")
    tensors = load_file(str(half / "adapter_model.safetensors"))
    del tensors["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
    save_file(tensors, str(half / "adapter_model.safetensors"))
    bad(half, "layer 1 o_proj has no lora_B weight")
