"""vLLM's offline `LLM` as the peer of `fairbatch bench engine --peer vllm`.

Runs in the peer's own Python (a venv with vLLM; fairbatch is not installed there), so it
imports only the standard library and vllm. Usage:

    PEER_PYTHON vllm_offline.py SETTINGS_JSON RESULT_FD

SETTINGS_JSON: {"model", "dtype", "prompts" (lists of token ids), "max_tokens",
"max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_tokens", "block_size",
"warmup_tokens"}. The process loads the model, runs a short warm-up, then writes one JSON line
to the file descriptor RESULT_FD ({"ready": true, ...}) and waits on stdin: every line "round"
runs the whole workload once and writes one JSON line of results (`round_result`); "quit" or
end of input ends it. Results go to their own descriptor because vLLM logs on stdout and
stderr, from child processes too.
"""

from __future__ import annotations

import json
import os
import sys
import time


def kv_bytes_per_token(hf_config: dict, dtype: str) -> int:
    """K and V of every layer for one token, in bytes."""
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    size = 4 if dtype == "float32" else 2
    return 2 * hf_config["num_hidden_layers"] * kv_heads * head_dim * size


def peer_kv_bytes(kv_tokens: int, block_size: int, hf_config: dict, dtype: str) -> int:
    """The KV bytes that give vLLM `kv_tokens` usable tokens: one block more, since its block
    pool keeps a null block out of use."""
    return (kv_tokens + block_size) * kv_bytes_per_token(hf_config, dtype)


def build_llm(settings: dict):
    from vllm import LLM

    with open(os.path.join(settings["model"], "config.json")) as f:
        hf_config = json.load(f)
    kv_bytes = peer_kv_bytes(
        settings["kv_tokens"], settings["block_size"], hf_config, settings["dtype"]
    )
    return LLM(
        model=settings["model"],
        dtype=settings["dtype"],
        seed=0,
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        max_model_len=settings["max_model_len"],
        block_size=settings["block_size"],
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=False,  # every round repeats the prompts
        disable_log_stats=False,  # else RequestOutput.metrics (TTFT, token times) stay None
    )


def round_result(outputs: list, wall: float, started: float) -> dict:
    """tok/s of the round plus per-request TTFT / TPOT (from vLLM's request metrics, when it
    gives them) and the generated token ids, in prompt order. TTFT counts from `started`, the
    wall-clock time the round submitted its batch, as fairbatch's side counts it: vLLM's own
    `first_token_latency` counts from each request's arrival, which leaves out the time
    `generate` takes to add the requests before it."""
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttft, tpot = [], []
    for o in outputs:
        m = getattr(o, "metrics", None)
        if m is None or not getattr(m, "first_token_ts", 0.0):
            continue
        ttft.append(m.arrival_time + m.first_token_latency - started)
        n = m.num_generation_tokens
        if n > 1:
            tpot.append((m.last_token_ts - m.first_token_ts) / (n - 1))
    return {
        "tok_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "ttft_s": ttft or None,
        "tpot_s": tpot or None,
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
    }


def main(argv: list[str]) -> int:
    settings_path, result_fd = argv[0], int(argv[1])
    with open(settings_path) as f:
        settings = json.load(f)
    out = os.fdopen(result_fd, "w", buffering=1)
    import vllm
    from vllm import SamplingParams

    t0 = time.perf_counter()
    llm = build_llm(settings)
    prompts = [{"prompt_token_ids": p} for p in settings["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=settings["max_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=settings["warmup_tokens"], ignore_eos=True)
    llm.generate(prompts[: settings["max_num_seqs"]], warm, use_tqdm=False)
    cache = llm.llm_engine.vllm_config.cache_config
    ready = {
        "ready": True,
        "engine": "vllm",
        "version": vllm.__version__,
        "load_s": time.perf_counter() - t0,
        "kv_blocks": cache.num_gpu_blocks - 1 if cache.num_gpu_blocks else None,  # usable
        "block_size": cache.block_size,
    }
    out.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command != "round":
            out.write(json.dumps({"error": f"unknown command {command!r}"}) + "\n")
            continue
        started, t = time.time(), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        out.write(json.dumps(round_result(outputs, time.perf_counter() - t, started)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
