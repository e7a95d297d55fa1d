"""`fairbatch bench engine --peer vllm`: fairbatch's engine against vLLM's offline `LLM`.

Both engines get the same checkpoint directory, the same prompts (token ids), the same greedy
settings (temperature 0, ignore_eos, max_tokens), the same max_num_seqs and token budget per
step, prefix caching off in both (every round repeats the prompts), and the same KV capacity in
tokens (each in its own block size: vLLM's CPU attention
takes multiples of 32). vLLM runs in a Python of its own (`vllm_offline.py`, see process.py).
Both load and warm up first; then the rounds alternate (fairbatch, vLLM, fairbatch, ...), so
load from other jobs on the machine falls on both alike.

Reported per engine: output tok/s of every round and their median, TTFT and TPOT percentiles
over the requests of all rounds (for vLLM from its RequestOutput.metrics), the ratio of the
medians fairbatch / vLLM, and how many requests' greedy tokens are identical between the two
(first round of each), with the first differing position of the others.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fairbatch.benchmarks.peer.process import PeerError, PeerProcess, check_peer_python, peer_env

PEER_SCRIPT = Path(__file__).resolve().parent / "vllm_offline.py"
FAIRBATCH_BLOCK = 16  # build_engine's default
PEER_BLOCK = 128  # vLLM's CPU default (its CPU attention needs a multiple of 32)
READY_TIMEOUT_S = 1800.0  # the first torch.compile of a large shape takes minutes on 2 cores
ROUND_TIMEOUT_S = 3600.0


# Pause before each round. After its last step vLLM's worker keeps polling its shared-memory
# queue for a while (`busy_loop_s`, 1 s, in vllm/distributed/device_communicators/
# shm_broadcast.py): on a machine of few cores that poll took a core from the start of the
# round that followed, fairbatch's prefill step; the pause lets it go idle first.
SETTLE_S = 2.0


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random ids, past the shipped tokenizer's special ids 0-3."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def kv_tokens_for(max_num_seqs: int, seq_len: int, *blocks: int) -> int:
    """Room for max_num_seqs whole sequences, rounded up to every engine's block size."""
    unit = math.lcm(*blocks)
    return -(-max_num_seqs * seq_len // unit) * unit


def settings_for(args: Any, model_dir: Path) -> dict[str, Any]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    seq_len = args.prompt_len + args.max_tokens
    kv_tokens = args.kv_tokens or kv_tokens_for(
        args.max_num_seqs, seq_len, FAIRBATCH_BLOCK, args.peer_block_size
    )
    for block in (FAIRBATCH_BLOCK, args.peer_block_size):
        if kv_tokens % block:
            raise ValueError(f"--kv-tokens {kv_tokens} is not a multiple of block size {block}")
    return {
        "model": str(model_dir),
        "dtype": args.dtype,
        "prompts": make_prompts(args.num_requests, args.prompt_len, vocab, args.seed),
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": seq_len,
        "kv_tokens": kv_tokens,
        "block_size": args.peer_block_size,
        "warmup_tokens": 4,
        "threads": getattr(args, "threads", None),
    }


class FairbatchSide:
    """fairbatch's `LLM` on the settings, stepped by hand so each token's time is known."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import torch

        from fairbatch.engine import LLM, SamplingParams

        if settings.get("threads"):
            torch.set_num_threads(settings["threads"])
        t0 = time.perf_counter()
        self.llm = LLM(
            settings["model"],
            dtype=getattr(torch, settings["dtype"]),
            block_size=FAIRBATCH_BLOCK,
            num_gpu_blocks=settings["kv_tokens"] // FAIRBATCH_BLOCK,
            max_num_seqs=settings["max_num_seqs"],
            max_num_batched_tokens=settings["max_num_batched_tokens"],
            max_model_len=settings["max_model_len"],
            enable_prefix_caching=False,  # every round repeats the prompts
        )
        self.prompts = settings["prompts"]
        self.params = SamplingParams(
            temperature=0, max_tokens=settings["max_tokens"], ignore_eos=True
        )
        warm = SamplingParams(temperature=0, max_tokens=settings["warmup_tokens"], ignore_eos=True)
        self.llm.generate(self.prompts[: settings["max_num_seqs"]], warm, use_tqdm=False)
        self.load_s = time.perf_counter() - t0

    def round(self) -> dict[str, Any]:
        engine = self.llm.engine
        t0 = time.perf_counter()
        ids = [engine.add_request(p, self.params).request_id for p in self.prompts]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        first: dict[str, float] = {}
        last: dict[str, float] = {}
        while engine.has_unfinished():
            for d in engine.step():
                if d.token_ids:
                    now = time.perf_counter()
                    first.setdefault(d.request_id, now)
                    last[d.request_id] = now
                    tokens[d.request_id].extend(d.token_ids)
        wall = time.perf_counter() - t0
        count = sum(len(t) for t in tokens.values())
        return {
            "tok_s": count / wall,
            "wall_s": wall,
            "tokens": count,
            "ttft_s": [first[r] - t0 for r in ids if r in first],
            "tpot_s": [
                (last[r] - first[r]) / (len(tokens[r]) - 1) for r in ids if len(tokens[r]) > 1
            ],
            "outputs": [tokens[r] for r in ids],
        }


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def engine_summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """tok/s per round and median; TTFT / TPOT (ms) p50 and p99 over all rounds' requests."""
    out: dict[str, Any] = {
        "tok_s": [round(r["tok_s"], 2) for r in rounds],
        "median_tok_s": round(statistics.median(r["tok_s"] for r in rounds), 2),
        "tokens_per_round": rounds[0]["tokens"],
    }
    for key in ("ttft_s", "tpot_s"):
        values = [v for r in rounds for v in (r.get(key) or [])]
        name = key[:4]
        out[f"{name}_ms"] = (
            {p: round(1000 * _percentile(values, q), 2) for p, q in (("p50", 50), ("p99", 99))}
            if values
            else None
        )
    return out


def greedy_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many requests' tokens are identical; where the others first differ."""
    if len(a) != len(b):
        raise PeerError(f"the engines returned {len(a)} and {len(b)} outputs")
    first_diff = []
    for x, y in zip(a, b):
        if x != y:
            first_diff.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None))
    same = len(a) - len(first_diff)
    return {"identical": same, "requests": len(a), "first_difference_at": first_diff}


def summarize(
    fb_rounds: list[dict], peer_rounds: list[dict], settings: dict, extra: dict | None = None
) -> dict[str, Any]:
    fb, peer = engine_summary(fb_rounds), engine_summary(peer_rounds)
    workload = {
        "num_requests": len(settings["prompts"]),
        "prompt_len": len(settings["prompts"][0]) if settings["prompts"] else 0,
        "max_tokens": settings["max_tokens"],
        "max_num_seqs": settings["max_num_seqs"],
        "max_num_batched_tokens": settings["max_num_batched_tokens"],
        "kv_tokens": settings["kv_tokens"],
        "dtype": settings["dtype"],
        "rounds": len(fb_rounds),
        "threads": settings.get("threads"),
    }
    return {
        "kind": "peer_engine",
        "workload": workload,
        "fairbatch": fb,
        "vllm": peer,
        "ratio_fairbatch_to_vllm": round(fb["median_tok_s"] / peer["median_tok_s"], 3),
        "greedy": greedy_agreement(fb_rounds[0]["outputs"], peer_rounds[0]["outputs"]),
        **(extra or {}),
    }


def _ms(d: dict | None, p: str) -> str:
    return f"{d[p]:.1f}" if d else "-"


def format_table(summary: dict[str, Any]) -> str:
    rounds = summary["workload"]["rounds"]
    head = (
        f"{'engine':<10}"
        + "".join(f"{'round ' + str(i + 1):>10}" for i in range(rounds))
        + f"{'median':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
    )
    lines = [head + "   (tok/s; ms)"]
    for name in ("fairbatch", "vllm"):
        s = summary[name]
        lines.append(
            f"{name:<10}"
            + "".join(f"{v:>10.1f}" for v in s["tok_s"])
            + f"{s['median_tok_s']:>10.1f}"
            + f"{_ms(s['ttft_ms'], 'p50'):>10}{_ms(s['ttft_ms'], 'p99'):>10}"
            + f"{_ms(s['tpot_ms'], 'p50'):>10}{_ms(s['tpot_ms'], 'p99'):>10}"
        )
    g = summary["greedy"]
    lines.append(f"ratio fairbatch / vllm (median tok/s): {summary['ratio_fairbatch_to_vllm']:.3f}")
    lines.append(f"identical greedy tokens: {g['identical']} of {g['requests']} requests")
    return "\n".join(lines)


def run(
    settings: dict[str, Any],
    peer_python: str,
    rounds: int,
    peer_script: str | Path = PEER_SCRIPT,
    fairbatch_side: Any = FairbatchSide,
    progress: bool = True,
) -> dict[str, Any]:
    """Start the peer, build fairbatch's engine meanwhile, then alternate `rounds` rounds."""
    python = check_peer_python(peer_python)

    def say(text: str) -> None:
        if progress:
            print(text, flush=True)

    say(f"starting the peer ({python}) and fairbatch's engine on {settings['model']}")
    env = peer_env(threads=settings.get("threads"))
    with PeerProcess(python, peer_script, settings, env=env) as peer:
        fb = fairbatch_side(settings)
        # Wait for the peer before measuring: its compile must not overlap fairbatch's rounds.
        ready = peer.read(READY_TIMEOUT_S)
        say(f"  fairbatch ready in {fb.load_s:.0f} s, vllm in {ready.get('load_s', 0):.0f} s")
        fb_rounds, peer_rounds = [], []
        for i in range(rounds):
            time.sleep(SETTLE_S)
            fb_rounds.append(fb.round())
            say(f"  round {i + 1}: fairbatch {fb_rounds[-1]['tok_s']:.1f} tok/s")
            time.sleep(SETTLE_S)
            peer_rounds.append(peer.command("round", ROUND_TIMEOUT_S))
            say(f"  round {i + 1}: vllm      {peer_rounds[-1]['tok_s']:.1f} tok/s")
    extra = {
        "vllm_version": ready.get("version"),
        "vllm_kv_tokens": (ready["kv_blocks"] * ready["block_size"])
        if ready.get("kv_blocks") and ready.get("block_size")
        else None,
    }
    return summarize(fb_rounds, peer_rounds, settings, extra)


def main(args: Any) -> int:
    """`fairbatch bench engine --peer vllm ...`; returns the exit code."""
    from fairbatch.benchmarks.checkpoints import describe, resolve_model

    load_start = [round(x, 2) for x in os.getloadavg()]
    try:
        python = check_peer_python(args.peer_python)
        model_dir = resolve_model(args.model, args.dtype)
        settings = settings_for(args, model_dir)
        summary = run(settings, python, args.rounds)
    except (PeerError, ValueError) as e:
        print(f"fairbatch bench engine: {e}", flush=True)
        return 1
    summary["command"] = "fairbatch " + shlex.join(sys.argv[1:])
    summary["model"] = args.model if not Path(args.model).is_dir() else str(model_dir)
    summary["shape"] = describe(model_dir)
    summary["machine"] = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        # other jobs on the machine: rounds alternate so both engines share their load
        "loadavg_start": load_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(compact_json(summary) + "\n")
    return 0


def compact_json(summary: dict[str, Any]) -> str:
    """Indented JSON with every list on one line: a results file of a few dozen lines."""
    from fairbatch.benchmarks.serve_bench import compact_json as compact

    return compact(summary)
