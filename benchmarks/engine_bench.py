"""Engine throughput: fairbatch vs transformers on the same weights, in one run.

The model is a random-weight checkpoint of a real shape (`benchmarks/checkpoints.py`; by
default Qwen2.5-0.5B's) or any checkpoint directory; `--model tiny` is the quick 4-layer one.

Three systems generate the same greedy tokens for the same requests (mixed prompt and output
lengths):
  * fairbatch: continuous batching over the paged KV cache (`LLM.generate`);
  * transformers `generate` in padded static batches of 16 (each batch runs to its longest
    output; only each request's own tokens count as useful);
  * transformers continuous batching (its `ContinuousBatchingManager`, what `generate_batch`
    runs), per-request output lengths.
Reported: useful tokens/s of each, the ratios, and the share of fairbatch's wall time spent in
the model forward.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from fairbatch.benchmarks.checkpoints import resolve_model

VOCAB = 2048  # every shape of benchmarks/checkpoints.py has the shipped tokenizer's vocabulary


def make_workload(n: int, prompt_range, output_range, seed: int = 0):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, VOCAB) for _ in range(rng.randint(*prompt_range))] for _ in range(n)
    ]
    outputs = [rng.randint(*output_range) for _ in range(n)]
    return prompts, outputs


def run_fairbatch(path: Path, prompts, outputs, max_num_seqs: int = 128) -> dict:
    from fairbatch.engine import LLM, SamplingParams

    llm = LLM(
        str(path),
        block_size=16,
        num_gpu_blocks=4096,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
    )
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    runner = llm.engine.runner
    runner.forward_time = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "tok_s": tokens / wall,
        "tok_per_cpu_s": tokens / cpu,
        "wall_s": wall,
        "tokens": tokens,
        "forward_share": runner.forward_time / wall,
        "outputs": [o.token_ids for o in outs],
    }


def _hf_model(path: Path, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def run_hf_static(path: Path, prompts, outputs, batch: int = 16) -> dict:
    model = _hf_model(path)
    results: list[list[int]] = []
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ps, ns = prompts[i : i + batch], outputs[i : i + batch]
            width = max(len(p) for p in ps)
            ids = torch.zeros((len(ps), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(ps):  # left padding, as decoder-only generation needs
                ids[r, width - len(p) :] = torch.tensor(p)
                mask[r, width - len(p) :] = 1
            gen = model.generate(
                ids, attention_mask=mask, max_new_tokens=max(ns), do_sample=False, pad_token_id=0
            )
            results.extend(gen[r, width : width + n].tolist() for r, n in enumerate(ns))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(outputs)
    return {
        "tok_s": tokens / wall,
        "tok_per_cpu_s": tokens / cpu,
        "wall_s": wall,
        "tokens": tokens,
        "outputs": results,
    }


def run_hf_cb(path: Path, prompts, outputs) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _hf_model(path, attn="sdpa")
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(outputs), eos_token_id=None)
    cb_cfg = ContinuousBatchingConfig(block_size=16, num_blocks=4096, max_batch_tokens=2048)
    manager = model.init_continuous_batching(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg
    )
    manager.start()
    results: dict[str, list[int]] = {}
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for i, (p, n) in enumerate(zip(prompts, outputs)):
            manager.add_request(p, request_id=f"r{i}", max_new_tokens=n)
        while len(results) < len(prompts):
            out = manager.get_result(timeout=600)
            if out is None:
                raise TimeoutError("transformers continuous batching returned no result")
            if out.is_finished():
                results[out.request_id] = list(out.generated_tokens)
    finally:
        manager.stop(block=True)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(v) for v in results.values())
    ordered = [results[f"r{i}"] for i in range(len(prompts))]
    return {
        "tok_s": tokens / wall,
        "tok_per_cpu_s": tokens / cpu,
        "wall_s": wall,
        "tokens": tokens,
        "outputs": ordered,
    }


def main(
    json_path: str | None = None,
    model: str = "qwen2.5-0.5b",
    num_requests: int = 128,
    prompt_range=(16, 512),
    output_range=(8, 256),
    skip_cb: bool = False,
) -> dict:
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    prompts, outputs = make_workload(num_requests, prompt_range, output_range)
    path = resolve_model(model, "float32")  # transformers' runs below are float32
    fb = run_fairbatch(path, prompts, outputs)
    print(f"fairbatch        {fb['tok_s']:9.1f} tok/s  ({fb['wall_s']:.1f} s)")
    st = run_hf_static(path, prompts, outputs)
    print(f"hf static (16)   {st['tok_s']:9.1f} tok/s  ({st['wall_s']:.1f} s)")
    cb = None
    if not skip_cb:
        try:
            cb = run_hf_cb(path, prompts, outputs)
            print(f"hf cont. batch   {cb['tok_s']:9.1f} tok/s  ({cb['wall_s']:.1f} s)")
        except Exception as e:  # report, don't hide: the JSON says why it is missing
            print(f"hf cont. batch   failed: {type(e).__name__}: {e}")
            cb = {"error": f"{type(e).__name__}: {e}"}
    agree_static = sum(a == b for a, b in zip(fb["outputs"], st["outputs"]))
    result = {
        "model": model,
        "num_requests": num_requests,
        "prompt_range": list(prompt_range),
        "output_range": list(output_range),
        "fairbatch_tok_s": round(fb["tok_s"], 2),
        "hf_static_tok_s": round(st["tok_s"], 2),
        "hf_cb_tok_s": round(cb["tok_s"], 2) if cb and "tok_s" in cb else None,
        "speedup_vs_static": round(fb["tok_s"] / st["tok_s"], 3),
        "speedup_vs_cb": round(fb["tok_s"] / cb["tok_s"], 3) if cb and "tok_s" in cb else None,
        "forward_share": round(fb["forward_share"], 3),
        # Tokens per CPU-second (all threads of this process): less sensitive than wall time
        # to other jobs on a shared machine.
        "fairbatch_tok_per_cpu_s": round(fb["tok_per_cpu_s"], 2),
        "hf_static_tok_per_cpu_s": round(st["tok_per_cpu_s"], 2),
        "hf_cb_tok_per_cpu_s": round(cb["tok_per_cpu_s"], 2) if cb and "tok_s" in cb else None,
        "outputs_equal_static": f"{agree_static}/{num_requests}",
        "hf_cb_error": cb.get("error") if cb else "skipped",
        "torch_threads": torch.get_num_threads(),
    }
    if cb and "outputs" in cb:
        result["outputs_equal_cb"] = (
            f"{sum(a == b for a, b in zip(fb['outputs'], cb['outputs']))}/{num_requests}"
        )
    print(json.dumps(result, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))
    return result
