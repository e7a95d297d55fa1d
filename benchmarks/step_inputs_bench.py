"""Host time of a decode step's inputs, without a GPU.

A decode step replayed from a CUDA graph needs its inputs in the graph's static buffer: token
ids, positions, slots, query starts, lengths, and block tables as wide as one max_model_len
sequence. The runner builds them on the host (`graph_step_inputs`, each table an array kept
across steps by `IntRows`) and packs them into one pinned buffer (`Staging.upload`), whose
copy to the device then runs without the host. Build and pack are host work every decode step
pays before the GPU can start; this measures them (packing into pageable memory) for batch
sizes and context limits of real models, with sequences of ~1K and ~16K tokens on average (at
most max_model_len).

With penalties (repetition, presence, frequency) the sampler stages each penalized row's prompt
and output as well: `penalties` rows time `_penalty_inputs` as the sampler calls it (prompts
kept as arrays across steps), every row penalized, prompts of the context's length and 256
output tokens.
"""

from __future__ import annotations

import json
import random
import statistics
import time

BATCHES = (1, 8, 32, 128, 256)
MAX_MODEL_LENS = (8192, 32768, 131072)  # Llama-3-8B, Qwen2.5-0.5B, Llama-3.2-1B
CONTEXTS = (1024, 16384)  # mean tokens a sequence


def time_inputs(batch: int, max_model_len: int, context: int, block_size: int, reps: int) -> dict:
    import torch

    from fairbatch.engine.cuda_graphs import graph_batch_sizes, graph_step_inputs, padded_batch_size
    from fairbatch.engine.staging import IntRows

    rng = random.Random(batch * 7919 + max_model_len)
    lens = [min(rng.randint(context // 2, context * 3 // 2), max_model_len) for _ in range(batch)]
    tables = [rng.sample(range(1 << 20), -(-n // block_size)) for n in lens]
    ids = [rng.randrange(32000) for _ in range(batch)]
    width = -(-max_model_len // block_size)
    padded = padded_batch_size(batch, graph_batch_sizes(batch))
    rows = IntRows()
    buf = torch.empty(0, dtype=torch.int32)  # the pack's buffer, reused as the runner's is
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step_tables = [rows.row(str(i), t) for i, t in enumerate(tables)]
        host = graph_step_inputs(ids, lens, step_tables, padded, width, block_size, 0)
        arrays = [a.reshape(-1).to(torch.int32) for a in host]
        numel = sum(a.numel() for a in arrays)
        if buf.numel() < numel:
            buf = torch.empty(numel, dtype=torch.int32)
        torch.cat(arrays, out=buf[:numel])
        times.append(time.perf_counter() - t0)
    med = statistics.median(times) * 1e3
    return {
        "batch": batch,
        "max_model_len": max_model_len,
        "table_width": width,
        "context_mean": context,
        "inputs_ms_median": round(med, 4),
        "inputs_ms_p99": round(sorted(times)[int(0.99 * (reps - 1))] * 1e3, 4),
        "share_of_10ms_step": round(med / 10.0, 4),
    }


def time_penalties(batch: int, context: int, reps: int) -> dict:
    from fairbatch.engine.sampler import _penalty_inputs
    from fairbatch.engine.sampling_params import SamplingParams
    from fairbatch.engine.staging import IntRows

    rng = random.Random(batch * 104729 + context)
    vocab = 151_936  # Qwen2.5's
    params = [SamplingParams(temperature=0, repetition_penalty=1.05)] * batch
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    outputs = [[rng.randrange(vocab) for _ in range(256)] for _ in range(batch)]
    kept = IntRows()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        _penalty_inputs(params, prompts, outputs, vocab, kept)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times) * 1e3
    return {"batch": batch, "context_mean": context, "penalties_ms_median": round(med, 4)}


def main(
    json_path: str | None = None,
    contexts: tuple[int, ...] = CONTEXTS,
    block_size: int = 16,
    reps: int = 200,
) -> list[dict]:
    rows = []
    print("decode-step inputs on the CUDA-graph path, ms median / p99")
    for context in contexts:
        for max_model_len in MAX_MODEL_LENS:
            for batch in BATCHES:
                row = time_inputs(batch, max_model_len, context, block_size, reps)
                rows.append(row)
                print(
                    f"contexts ~{context:>6} max_model_len {max_model_len:>6} "
                    f"(width {row['table_width']:>4}) batch {batch:>3}: "
                    f"{row['inputs_ms_median']:.3f} / {row['inputs_ms_p99']:.3f}"
                )
    penalties = []
    for context in contexts:
        for batch in BATCHES[1:4]:
            row = time_penalties(batch, context, max(reps // 4, 1))
            penalties.append(row)
            print(
                f"penalties: {batch:>3} rows, prompts of {context:>6}, 256 outputs: "
                f"{row['penalties_ms_median']:.3f}"
            )
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"graph_inputs": rows, "penalties": penalties}, f, indent=1)
    return rows
