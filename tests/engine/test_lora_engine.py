"""Multi-LoRA in the offline engine (issue 46) against transformers + PEFT: greedy tokens of
base-model and adapter requests mixed in one batch equal PEFT's `generate` per adapter,
token for token (float32), however the work is sliced: plainly, in chunked prefills, under
swap and recompute preemption, with fewer adapter slots than adapters in use (requests wait
for a slot, adapters are evicted and reloaded). The prefix cache is salted by adapter: a
prompt's blocks are hit again under its adapter only. A bad adapter is a ValueError at
add_request and the engine keeps serving.

Adapters: test_lora.py's (different ranks, alphas, targets, rsLoRA, one layer only), made on
conftest's tiny Llama with lora_B randomised.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")

from fairbatch.engine import LLM  # noqa: E402
from fairbatch.engine.lora import LoRARequest  # noqa: E402
from fairbatch.tests.engine.test_generate import (  # noqa: E402
    GREEDY,
    NEW_TOKENS,
    hf_greedy,
    make_prompts,
)
from fairbatch.tests.engine.test_lora import ADAPTERS, _make_adapter  # noqa: E402

NAMES = [None, *ADAPTERS]  # prompt i runs under NAMES[i % 4] (None: the base model)
MAX_RANK = max(spec["r"] for spec in ADAPTERS.values())


def peft_greedy(base_path, adapter_dir, prompts, new_tokens=NEW_TOKENS):
    """transformers + PEFT (unmerged) greedy tokens of each prompt, a batch of one each."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, torch_dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def reference(base_path, dirs, prompts, names):
    """Each prompt's reference tokens under its adapter name (None: transformers alone)."""
    refs: list = [None] * len(prompts)
    for name in dict.fromkeys(names):
        idx = [i for i, n in enumerate(names) if n == name]
        batch = [prompts[i] for i in idx]
        if name is None:
            got = hf_greedy(base_path, batch)
        else:
            got = peft_greedy(base_path, dirs[name], batch)
        for i, tokens in zip(idx, got):
            refs[i] = tokens
    return refs


@pytest.fixture(scope="module")
def adapters(llama_ckpt, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(llama_ckpt, torch_dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora_engine")
    return {
        name: _make_adapter(base, root / name, seed, **spec)
        for seed, (name, spec) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def mixed(llama_ckpt, adapters):
    """16 prompts, a quarter each under the base model and adapters a, b, c; their refs."""
    prompts = make_prompts()
    names = [NAMES[i % len(NAMES)] for i in range(len(prompts))]
    refs = reference(llama_ckpt, adapters, prompts, names)
    base = hf_greedy(llama_ckpt, prompts)
    # the adapters matter: under each, some prompt's tokens differ from the base model's
    for name in ADAPTERS:
        assert any(refs[i] != base[i] for i, n in enumerate(names) if n == name), name
    return prompts, names, refs


def lora_requests(dirs, names):
    return [None if n is None else LoRARequest(n, str(dirs[n])) for n in names]


def fb_lora_greedy(path, dirs, prompts, names, **kwargs):
    kwargs.setdefault("max_loras", len(ADAPTERS))
    llm = LLM(str(path), max_lora_rank=MAX_RANK, **kwargs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=lora_requests(dirs, names))
    engine = llm.engine
    engine.check_integrity()
    assert engine.scheduler.kv.all_free()
    assert not any(engine.scheduler.loras.pool._pins)  # every request released its adapter
    return [o.token_ids for o in outs], engine


SLICINGS = {
    "plain": dict(block_size=4, num_gpu_blocks=512),
    "chunked": dict(block_size=4, num_gpu_blocks=512, max_num_batched_tokens=7),
    "swap": dict(block_size=4, num_gpu_blocks=40, preemption_mode="swap"),
    "recompute": dict(block_size=4, num_gpu_blocks=40, preemption_mode="recompute"),
}


@pytest.mark.parametrize("slicing", list(SLICINGS))
def test_mixed_batch_matches_peft(llama_ckpt, adapters, mixed, slicing) -> None:
    """Base and three adapters in one batch: each prompt's tokens are PEFT's under its
    adapter, however the steps are sliced (preemptions release and re-pin adapters)."""
    prompts, names, refs = mixed
    got, engine = fb_lora_greedy(llama_ckpt, adapters, prompts, names, **SLICINGS[slicing])
    assert got == refs
    if slicing in ("swap", "recompute"):
        assert engine.scheduler.num_preemptions[slicing] > 0


def test_fewer_slots_than_adapters(llama_ckpt, adapters, mixed) -> None:
    """max_loras 1 or 2 with three adapters in use: requests wait for a slot (never an
    error), adapters are evicted and reloaded, and every token is still PEFT's, with
    preemptions releasing and re-pinning slots too."""
    prompts, names, refs = mixed
    got, engine = fb_lora_greedy(
        llama_ckpt, adapters, prompts, names, block_size=4, num_gpu_blocks=512, max_loras=1
    )
    assert got == refs
    assert engine.scheduler.loras.pool.num_loads > len(ADAPTERS)  # evicted and reloaded
    # with preemption and two slots too
    for mode in ("recompute", "swap"):
        got, engine = fb_lora_greedy(
            llama_ckpt,
            adapters,
            prompts,
            names,
            block_size=4,
            num_gpu_blocks=16,
            preemption_mode=mode,
            max_loras=2,
        )
        assert got == refs
        assert engine.scheduler.num_preemptions[mode] > 0
        assert engine.scheduler.loras.pool.num_loads > len(ADAPTERS)


def test_prefix_cache_is_salted_by_adapter(llama_ckpt, adapters) -> None:
    """A prompt's blocks computed under adapter a are hit by that prompt under a again, never
    under b or the base model (whose blocks only the base model hits)."""
    prompt = make_prompts(n=1, shared_prefix=24, seed=3)[0]
    llm = LLM(str(llama_ckpt), block_size=4, num_gpu_blocks=256, max_loras=2, max_lora_rank=8)
    a, b = (LoRARequest(n, str(adapters[n])) for n in ("a", "b"))
    refs = {
        "a": peft_greedy(llama_ckpt, adapters["a"], [prompt])[0],
        "b": peft_greedy(llama_ckpt, adapters["b"], [prompt])[0],
        None: hf_greedy(llama_ckpt, [prompt])[0],
    }
    runs = [("a", a, False), ("a", a, True), ("b", b, False), (None, None, False)]
    runs += [(None, None, True), ("b", b, True)]
    for name, lora, hits in runs:
        (out,) = llm.generate([prompt], GREEDY, use_tqdm=False, lora=lora)
        assert out.token_ids == refs[name], name
        expected = (len(prompt) - 1) // 4 * 4 if hits else 0
        assert out.num_cached_tokens == expected, (name, hits)
    llm.engine.check_integrity()


def test_bad_adapter_is_refused_and_the_engine_keeps_serving(
    llama_ckpt, adapters, mixed, tmp_path
) -> None:
    prompts, names, refs = mixed
    llm = LLM(str(llama_ckpt), block_size=4, num_gpu_blocks=256, max_loras=2, max_lora_rank=4)
    engine = llm.engine
    with pytest.raises(ValueError, match="not a directory"):
        engine.add_request(prompts[0], GREEDY, lora=LoRARequest("x", str(tmp_path / "none")))
    with pytest.raises(ValueError, match="max_rank"):  # adapter b has rank 8 > 4
        llm.generate(prompts[:2], GREEDY, lora=LoRARequest("b", str(adapters["b"])))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{")
    (broken / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not JSON"):
        engine.add_request(prompts[0], GREEDY, lora=LoRARequest("broken", str(broken)))
    a = LoRARequest("a", str(adapters["a"]))
    queued = engine.add_request(prompts[1], GREEDY, lora=a)  # (prompt 1 runs under a)
    with pytest.raises(ValueError, match="already"):  # one name, one adapter
        engine.add_request(prompts[1], GREEDY, lora=LoRARequest("a", str(adapters["c"])))
    assert set(engine.scheduler.loras.adapters) == {"a"}  # no bad adapter was kept
    # the engine serves on: the queued request, then a mixed batch, exactly
    while engine.has_unfinished():
        engine.step()
    assert list(queued.output_token_ids) == refs[1]
    keep = [i for i, n in enumerate(names) if n in (None, "a", "c")]
    lora = [
        None if names[i] is None else LoRARequest(names[i], str(adapters[names[i]])) for i in keep
    ]
    outs = llm.generate([prompts[i] for i in keep], GREEDY, use_tqdm=False, lora=lora)
    assert [o.token_ids for o in outs] == [refs[i] for i in keep]
    engine.check_integrity()
    assert engine.scheduler.kv.all_free() and not engine.has_unfinished()
    # an engine without adapter slots refuses adapters
    plain = LLM(str(llama_ckpt), block_size=4, num_gpu_blocks=64)
    with pytest.raises(ValueError, match="max_loras"):
        plain.engine.add_request(prompts[0], GREEDY, lora=a)


def test_pins_follow_running_and_base_steps_skip_the_delta(
    llama_ckpt, adapters, mixed, monkeypatch
) -> None:
    """A running request pins its adapter; abort, preemption and finish unpin it (a resumed
    one pins again). Steps with base-model requests only never compute a delta."""
    prompts, names, refs = mixed
    llm = LLM(str(llama_ckpt), block_size=4, num_gpu_blocks=256, max_loras=2, max_lora_rank=8)
    engine = llm.engine
    pool = engine.scheduler.loras.pool
    a = LoRARequest("a", str(adapters["a"]))
    r1 = engine.add_request(prompts[1], GREEDY, lora=a)
    r2 = engine.add_request(prompts[5], GREEDY, lora=a)  # (prompts 1 and 5 run under a)
    engine.step()
    assert pool._pins[pool.slot_of("a")] == 2
    engine.abort(r2.request_id)
    assert pool._pins[pool.slot_of("a")] == 1
    assert engine.preempt(r1.request_id, "recompute")
    assert pool._pins[pool.slot_of("a")] == 0
    while engine.has_unfinished():
        engine.step()
        assert pool._pins[pool.slot_of("a")] == (0 if r1.is_finished else 1)
    assert list(r1.output_token_ids) == refs[1]

    def no_delta(*args):
        raise AssertionError("a base-only step computed a LoRA delta")

    monkeypatch.setattr(pool, "add_delta", no_delta)
    base = [i for i, n in enumerate(names) if n is None]
    outs = llm.generate([prompts[i] for i in base], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [refs[i] for i in base]
    assert engine.runner.lora.groups is None
