"""Multi-LoRA throughput: the base model alone vs the same requests under 1, 8 and 64 adapters.

The model is a random-weight checkpoint of a real shape (`benchmarks/checkpoints.py`; by
default Qwen2.5-0.5B's) or a checkpoint directory. The adapters are random PEFT LoRA adapters
on every linear of the decoder layers (q, k, v, o, gate, up, down), ranks alternating 8 and
16, written once with `peft` beside the cached checkpoints (`lora_adapters/`).

Workload: N requests of a fixed prompt length and a fixed number of new tokens (greedy,
ignore_eos), all submitted at once. Cases:
  * base: an engine without LoRA (max_loras=0), every request on the base model;
  * lora-K (K = 1, 8, 64): an engine with `max_loras` slots (default 8), request i under
    adapter i % K. With K > max_loras adapters go in and out of the slots; a request runs only
    while its adapter holds a slot, so K distinct adapters in flight also cap the batch at
    `max_loras` requests.
Every case runs once per round, the cases alternating, after a warm-up that reads each
adapter from disk (so the timed runs load adapters into slots, not from disk). Reported per
case: the median over rounds of output tokens/s, of tokens per CPU-second (all threads of
this process: steadier than wall time on a shared machine), of TTFT p50 (from the submission of
the batch to a request's first token, measured in the engine's step loop: the offline `LLM`
does not record it) and the ratio to the base model's tokens/s of the same round.
"""

from __future__ import annotations

import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fairbatch.benchmarks.checkpoints import cache_root, resolve_model

VOCAB = 2048  # every shape of benchmarks/checkpoints.py has the shipped tokenizer's vocabulary
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANKS = (8, 16)  # adapter i has rank RANKS[i % 2]
ADAPTER_COUNTS = (1, 8, 64)


def _peft():
    try:
        import peft
    except ImportError:
        raise SystemExit(
            "fairbatch bench lora needs `peft` to write its adapters: pip install peft "
            "(or the package's test extra)"
        ) from None
    return peft


def ensure_adapters(model_path: Path, count: int, root: Path | None = None) -> list[Path]:
    """`count` random PEFT adapter directories for the checkpoint at `model_path`, written once
    (cached by checkpoint and count; a temporary directory renamed into place)."""
    root = Path(root) if root is not None else cache_root().parent / "lora_adapters"
    final = root / f"{model_path.name}-n{count}-r{'-'.join(map(str, RANKS))}"
    dirs = [final / f"adapter{i:03d}" for i in range(count)]
    if all((d / "adapter_model.safetensors").is_file() for d in dirs):
        return dirs
    peft = _peft()
    from transformers import AutoModelForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    try:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        g = torch.Generator().manual_seed(0)
        for rank in RANKS:  # one PEFT wrapping per rank; each adapter re-randomises its A, B
            cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
            model = peft.get_peft_model(base, cfg)
            with torch.no_grad():
                for i in range(RANKS.index(rank), count, len(RANKS)):
                    for name, p in model.named_parameters():
                        if "lora_" in name:
                            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                    model.save_pretrained(str(tmp / dirs[i].name))
            base = model.unload()  # the base model back, without the LoRA layers
        if final.exists():  # an incomplete leftover of an interrupted build
            shutil.rmtree(final)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return dirs


def make_prompts(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(prompt_len)] for _ in range(n)]


def run_case(llm, prompts, output_len: int, loras) -> dict:
    """Generate `output_len` tokens for each prompt (request i under `loras[i]`), driving the
    engine's step loop as `LLM.generate` does, to time each request's first token."""
    from fairbatch.engine import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    pool = engine.runner.lora.pool if engine.runner.lora is not None else None
    loads0 = pool.num_loads if pool is not None else 0
    t0, c0 = time.perf_counter(), time.process_time()
    ids = [engine.add_request(p, params, lora=lo).request_id for p, lo in zip(prompts, loras)]
    tokens = {rid: 0 for rid in ids}
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for d in engine.step():
            if d.token_ids:
                tokens[d.request_id] += len(d.token_ids)
                first.setdefault(d.request_id, time.perf_counter() - t0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    total = sum(tokens.values())
    return {
        "tok_s": total / wall,
        "tok_per_cpu_s": total / cpu,
        "ttft_p50_ms": 1000 * statistics.median(first[r] for r in ids),
        "wall_s": wall,
        "tokens": [tokens[r] for r in ids],
        "adapter_loads": (pool.num_loads - loads0) if pool is not None else 0,
    }


def main(
    json_path: str | None = None,
    model: str = "qwen2.5-0.5b",
    num_requests: int = 64,
    prompt_len: int = 64,
    output_len: int = 64,
    adapter_counts=ADAPTER_COUNTS,
    max_loras: int = 8,
    max_lora_rank: int = 16,
    max_num_seqs: int = 32,
    rounds: int = 2,
    device: str = "cpu",
    adapter_root: str | Path | None = None,
    verbose: bool = True,
) -> dict:
    from fairbatch.engine import LLM
    from fairbatch.engine.lora import LoRARequest

    path = resolve_model(model)
    dirs = ensure_adapters(path, max(adapter_counts), adapter_root)
    adapters = [LoRARequest(d.name, str(d)) for d in dirs]
    prompts = make_prompts(num_requests, prompt_len)
    blocks = max_num_seqs * -(-(prompt_len + output_len) // 16) + 16  # no preemption
    common = dict(
        device=device,
        block_size=16,
        num_gpu_blocks=blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,  # every round and case prefills its prompts in full
    )
    base_llm = LLM(str(path), **common)
    lora_llm = LLM(str(path), max_loras=max_loras, max_lora_rank=max_lora_rank, **common)
    cases = {"base": (base_llm, [None] * num_requests)}
    for k in adapter_counts:
        cases[f"lora-{k}"] = (lora_llm, [adapters[i % k] for i in range(num_requests)])
    # Warm-up: every adapter read from disk once, every engine path run once.
    warm = make_prompts(2, prompt_len, seed=1)
    run_case(base_llm, warm, 2, [None, None])
    used = adapters[: max(adapter_counts)]
    run_case(lora_llm, make_prompts(len(used), 8, seed=2), 2, used)

    runs: dict[str, list[dict]] = {name: [] for name in cases}
    ratios: dict[str, list[float]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        order = names if r % 2 == 0 else names[::-1]  # alternate, so drift hits all cases
        for name in order:
            llm, loras = cases[name]
            res = run_case(llm, prompts, output_len, loras)
            runs[name].append(res)
            if verbose:
                print(
                    f"round {r + 1} {name:8s} {res['tok_s']:8.1f} tok/s  "
                    f"TTFT p50 {res['ttft_p50_ms']:8.1f} ms  ({res['wall_s']:.1f} s, "
                    f"{res['adapter_loads']} adapter loads)"
                )
        for name in names:
            ratios[name].append(runs[name][r]["tok_s"] / runs["base"][r]["tok_s"])

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in runs[name])

    summary = {}
    for name in names:
        k = 0 if name == "base" else int(name.split("-")[1])
        summary[name] = {
            "adapters": k,
            "tok_s": round(med(name, "tok_s"), 2),
            "tok_per_cpu_s": round(med(name, "tok_per_cpu_s"), 2),
            "ttft_p50_ms": round(med(name, "ttft_p50_ms"), 1),
            "ratio_to_base": round(statistics.median(ratios[name]), 3),
            "adapter_loads_per_run": runs[name][-1]["adapter_loads"],
            "all_tokens_generated": all(
                x["tokens"] == [output_len] * num_requests for x in runs[name]
            ),
            "rounds": [
                {k2: round(v, 3) for k2, v in x.items() if k2 != "tokens"} for x in runs[name]
            ],
        }
    result = {
        "model": model,
        "device": device,
        "num_requests": num_requests,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "max_loras": max_loras,
        "max_lora_rank": max_lora_rank,
        "max_num_seqs": max_num_seqs,
        "adapter_ranks": list(RANKS),
        "adapter_targets": TARGETS,
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "cases": summary,
    }
    if verbose:
        print(f"\n{'case':8s} {'tok/s':>9s} {'ratio':>6s} {'tok/cpu-s':>10s} {'TTFT p50':>10s}")
        for name, s in summary.items():
            print(
                f"{name:8s} {s['tok_s']:9.1f} {s['ratio_to_base']:6.3f} "
                f"{s['tok_per_cpu_s']:10.1f} {s['ttft_p50_ms']:8.1f}ms"
            )
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
    return result
