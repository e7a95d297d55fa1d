"""The prepared GPU check (run by benchmarks/gpu_check.sh): one JSON report.

Sections, each timed and recorded even when it fails (the report is rewritten after each):
* `gpu_tests`: `pytest -m gpu tests/gpu`.
* `parity`: flash vs torch attention backend on one mixed step (bf16).
* `decode`: decode step time (the runner's forward + logits) of a ~1B-parameter random-weight
  Llama in bf16 at batch 1 / 32 / 128, eager and with CUDA graphs, against the bandwidth bound
  (weight bytes + K/V bytes read per step, over the GPU's datasheet HBM bandwidth). Steps run
  back to back (`{mode}_ms`), and as the engine runs them (`{mode}_synced_ms`: each step's
  tokens read to the host before the next is built, so the host's input work shows);
  `inputs_ms` is that work alone. Graphs are captured for Llama 3.2's 128K context, as a
  deployment serves it by default (block tables 8,192 columns wide).
* `swap`: swap-out / swap-in bandwidth of the cache engine against plain pinned copies of the
  same bytes.
* `generate`: `LLM.generate` on the tiny model with swap and with recompute preemption; greedy
  tokens against an undisturbed run.
* `families`: small random-weight Qwen3 and Qwen3-MoE checkpoints (`benchmarks/checkpoints.py`):
  greedy tokens of float32 on CUDA (no TF32) against float32 on CPU, which the CPU tests tie to
  transformers; and bfloat16 on CUDA (flash where installed) with its agreement reported.

Goals on an H100/H200-class GPU: decode at batch 32 with graphs >= 70% of the bandwidth
bound; swap >= 70% of the plain copy's bandwidth.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

GOAL = 0.7
CONTEXT = 512  # tokens of context per sequence in the decode benchmark
MAX_MODEL_LEN = 131072  # Llama 3.2's context: the width of the graphs' block tables
BATCHES = (1, 32, 128)


def llama_1b_config():
    from fairbatch.engine.config import ModelConfig

    # The shape of Llama 3.2 1B (1.24e9 parameters, tied embeddings).
    return ModelConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def _layout(config, block_size: int, head_major: bool):
    from fairbatch.kv.cache_engine import KVLayout

    return KVLayout(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        block_size,
        torch.bfloat16,
        head_major=head_major,
    )


def _timed(fn, iters: int, warmup: int = 3) -> float:
    """Seconds per call, steady state (the device drained before and after)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def run_gpu_tests(timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/gpu", "-p", "no:cacheprovider"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"pytest ran past {timeout_s:.0f} s"}
    lines = (p.stdout + p.stderr).strip().splitlines()
    return {"ok": p.returncode == 0, "rc": p.returncode, "summary": lines[-1:], "tail": lines[-30:]}


def flash_parity() -> dict:
    from fairbatch.engine.attention import (
        AttentionMetadata,
        FlashAttentionBackend,
        TorchAttentionBackend,
    )

    reason = FlashAttentionBackend.unsupported_reason(torch.device("cuda"), 128, torch.bfloat16)
    if reason is not None:
        return {"ok": False, "skipped": reason}
    q_lens, seq_lens = [1, 1, 37, 16, 1, 100, 5, 130], [1, 300, 37, 80, 17, 100, 260, 130]
    bs, heads, kv_heads, dim = 16, 8, 2, 128
    free = list(range(256))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in seq_lens]
    meta, _ = AttentionMetadata.build(q_lens, seq_lens, tables, bs, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(sum(q_lens), heads, dim, device="cuda", generator=gen).bfloat16()
    cache = torch.randn(2, 256, bs, kv_heads, dim, device="cuda", generator=gen).bfloat16()
    head_major = cache.transpose(2, 3).contiguous()  # the torch backend's block order
    scale = dim**-0.5
    out_flash = FlashAttentionBackend().forward(q, cache, meta, scale).float()
    out_torch = TorchAttentionBackend().forward(q, head_major, meta, scale).float()
    err = (out_flash - out_torch).abs().max().item()
    return {"ok": err < 2e-2, "max_abs_diff": err, "tolerance": 2e-2}


def decode_bench(iters: int) -> dict:
    from fairbatch.engine.cuda_graphs import graph_step_inputs
    from fairbatch.engine.gpu_profiles import profile_for_device
    from fairbatch.engine.models import CausalLM
    from fairbatch.engine.runner import ModelRunner
    from fairbatch.kv.cache_engine import CacheEngine

    config, bs = llama_1b_config(), 16
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = CausalLM(config, attn_backend=None)
    model = model.to(torch.bfloat16).eval()
    backend = model.attn_backend(torch.device("cuda"), torch.bfloat16)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    layout = _layout(config, bs, backend.head_major)
    per_seq = -(-(CONTEXT + 1) // bs)
    cache = CacheEngine(layout, max(BATCHES) * per_seq, 0, "cuda", pad_block=True)
    cache.gpu_cache.normal_()  # random K/V stand in for a prefill
    runner = ModelRunner(model, cache)
    profile = profile_for_device(torch.cuda.get_device_name())
    result = {
        "model_params": sum(p.numel() for p in model.parameters()),
        "backend": backend.name,
        "context": CONTEXT,
        "hbm_bandwidth": profile.hbm_bandwidth if profile else None,
        "batches": {},
    }
    result["max_model_len"] = MAX_MODEL_LEN
    modes = ["eager"]
    if backend.supports_cuda_graphs:
        runner.capture_decode_graphs(max(BATCHES), MAX_MODEL_LEN)
        modes.append("graphs")
    graphs = runner.graphs
    for batch in BATCHES:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
        ids, lens = [1] * batch, [CONTEXT + 1] * batch

        def step(ids=ids, lens=lens, tables=tables):
            rows = [runner.block_rows.row(i, t) for i, t in enumerate(tables)]  # as the runner
            hidden, _ = runner._forward(ids, [1] * len(ids), lens, rows, [])
            return model.compute_logits(hidden)

        def synced_step(step=step):
            step().argmax(dim=-1).tolist()  # the engine's one wait a step: the tokens

        def inputs(ids=ids, lens=lens, tables=tables):
            rows = [runner.block_rows.row(i, t) for i, t in enumerate(tables)]
            width = -(-MAX_MODEL_LEN // bs)
            graph_step_inputs(ids, lens, rows, len(ids), width, bs, cache.pad_block)

        bytes_read = weight_bytes + batch * (CONTEXT + 1) * layout.bytes_per_token
        entry = {"bytes_read": bytes_read, "inputs_ms": _timed(inputs, iters) * 1e3}
        for mode in modes:
            runner.graphs = graphs if mode == "graphs" else None
            seconds = _timed(step, iters)
            entry[f"{mode}_ms"] = seconds * 1e3
            entry[f"{mode}_synced_ms"] = _timed(synced_step, iters) * 1e3
            if profile:
                entry[f"{mode}_of_bound"] = bytes_read / profile.hbm_bandwidth / seconds
        result["batches"][str(batch)] = entry
    b32 = result["batches"]["32"]
    result["goal_batch32_graphs"] = b32.get("graphs_of_bound", 0) >= GOAL if profile else None
    return result


def swap_bench(num_blocks: int = 512, repeats: int = 3) -> dict:
    from fairbatch.kv.cache_engine import CacheEngine

    layout = _layout(llama_1b_config(), 16, False)
    ce = CacheEngine(layout, 4 * num_blocks, num_blocks, "cuda")
    nbytes = num_blocks * layout.bytes_per_block
    rng = random.Random(0)
    out_s, settled_s, in_s = [], [], []
    for _ in range(repeats):
        gpu_blocks = rng.sample(range(4 * num_blocks), num_blocks)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ce.swap_out(list(zip(gpu_blocks, range(num_blocks))))
        ce._pending_out[-1][0].synchronize()  # the device-to-host copy is done
        t1 = time.perf_counter()
        ce.settle()  # placed in the CPU pool (off the step's path in the engine)
        t2 = time.perf_counter()
        ce.swap_in(list(zip(range(num_blocks), rng.sample(range(4 * num_blocks), num_blocks))))
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        out_s.append(t1 - t0)
        settled_s.append(t2 - t0)
        in_s.append(t3 - t2)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    d2h = _timed(lambda: host.copy_(dev, non_blocking=True), repeats, warmup=1)
    h2d = _timed(lambda: dev.copy_(host, non_blocking=True), repeats, warmup=1)
    gbs = 1e-9 * nbytes
    result = {
        "bytes": nbytes,
        "memcpy_d2h_gbs": gbs / d2h,
        "memcpy_h2d_gbs": gbs / h2d,
        "swap_out_gbs": gbs / min(out_s),
        "swap_out_settled_gbs": gbs / min(settled_s),
        "swap_in_gbs": gbs / min(in_s),
    }
    result["out_of_memcpy"] = result["swap_out_gbs"] / result["memcpy_d2h_gbs"]
    result["in_of_memcpy"] = result["swap_in_gbs"] / result["memcpy_h2d_gbs"]
    result["goal"] = min(result["out_of_memcpy"], result["in_of_memcpy"]) >= GOAL
    return result


def generate_check() -> dict:
    from fairbatch.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [f"request {i} on the gpu path" * (1 + i % 3) for i in range(12)]
    ref = [
        o.token_ids
        for o in LLM("tiny", device="cuda", num_gpu_blocks=512).generate(prompts, params)
    ]
    result = {}
    for mode in ("swap", "recompute"):
        llm = LLM(
            "tiny", device="cuda", num_gpu_blocks=10, num_cpu_blocks=256, preemption_mode=mode
        )
        got = [o.token_ids for o in llm.generate(prompts, params)]
        llm.engine.check_integrity()
        result[mode] = {
            "preemptions": llm.engine.scheduler.num_preemptions[mode],
            "graph_steps": llm.engine.runner.num_graph_steps,
            "tokens_equal": got == ref,
            "requests_differing": sum(a != b for a, b in zip(got, ref)),
        }
    result["ok"] = all(r["tokens_equal"] and r["preemptions"] > 0 for r in result.values())
    return result


FAMILIES = {  # scaled-down copies of the real configs; head_dim 128 as flash takes it
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=256,
        intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=128, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True,
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=256,
        intermediate_size=512, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=1e6,
    ),
}  # fmt: skip


def families_check() -> dict:
    import tempfile

    from fairbatch.benchmarks.checkpoints import build_checkpoint, hf_config
    from fairbatch.engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[(i * 37 + j * 11) % 2000 + 4 for j in range(8 + 9 * i)] for i in range(8)]
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, shape in FAMILIES.items():
            path = build_checkpoint(Path(tmp) / name, hf_config(shape))
            cpu = LLM(str(path), device="cpu", dtype=torch.float32)
            ref = [o.token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
            torch.backends.cuda.matmul.allow_tf32 = False
            fp32 = LLM(str(path), device="cuda", dtype=torch.float32, num_gpu_blocks=256)
            got32 = [o.token_ids for o in fp32.generate(prompts, params, use_tqdm=False)]
            del fp32
            bf16 = LLM(str(path), device="cuda", dtype=torch.bfloat16, num_gpu_blocks=256)
            got16 = [o.token_ids for o in bf16.generate(prompts, params, use_tqdm=False)]
            result[name] = {
                "float32_requests_equal": sum(a == b for a, b in zip(got32, ref)),
                "bfloat16_requests_equal": sum(a == b for a, b in zip(got16, ref)),
                "bfloat16_first_tokens_equal": sum(a[0] == b[0] for a, b in zip(got16, ref)),
                "bfloat16_backend": bf16.engine.runner.model._backend.name,
                "requests": len(prompts),
            }
            del bf16
            torch.cuda.empty_cache()
    result["ok"] = all(
        r["float32_requests_equal"] == r["requests"] for k, r in result.items() if k != "ok"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--pytest-timeout", type=float, default=240.0)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing was run", file=sys.stderr)
        return 2
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    sections = [
        ("gpu_tests", lambda: run_gpu_tests(args.pytest_timeout)),
        ("parity", flash_parity),
        ("decode", lambda: decode_bench(args.iters)),
        ("swap", swap_bench),
        ("generate", generate_check),
        ("families", families_check),
    ]
    out = Path(args.out)
    try:
        for name, fn in sections:
            t0 = time.perf_counter()
            try:
                report[name] = fn()
            except Exception as e:  # recorded; the other sections still run
                report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            report[name]["seconds"] = round(time.perf_counter() - t0, 1)
            out.write_text(json.dumps(report, indent=2))
            print(f"gpu_check: {name} done in {report[name]['seconds']} s", file=sys.stderr)
    except KeyboardInterrupt:  # the shell script's time limit
        report["interrupted"] = True
    report["goals"] = {
        "decode_batch32_graphs_70pct": report.get("decode", {}).get("goal_batch32_graphs"),
        "swap_70pct_of_memcpy": report.get("swap", {}).get("goal"),
    }
    checks = ("gpu_tests", "parity", "generate", "families")
    report["ok"] = all(report.get(k, {}).get("ok") for k in checks) and "interrupted" not in report
    out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report["goals"]), f"ok={report['ok']}", f"report: {out}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
