"""`fairbatch bench conversation`: the host KV tier on Mooncake's conversation trace.

The trace (`--trace`: Mooncake's `conversation_trace.jsonl`, FAST'25, Apache-2.0): one hour of
a production chat service's arrivals; a prompt is a list of ids of 512-token blocks, and a
conversation's next turn resends its history, so it repeats the ids. Each block id becomes a
deterministic run of tokens (seeded by the id): shared ids are shared prefixes.

Conversations are sampled (those whose first own block id is a multiple of `--every`), keeping
each one whole: its turns, their arrival times and their prefix structure. Two replays, each a
run without the host tier and one with it (same requests, same device pool):

* `model`: a real engine on this machine (the Qwen2.5-0.5B shape, random weights, float32),
  each 512-token block scaled to `tokens_per_block` tokens, outputs scaled alike, arrivals
  compressed by `time_scale`, a device pool far below the sample's working set. Arrivals
  follow the wall clock; a gap with nothing to do is skipped, not slept. Reports prefix hit
  tokens (device, host), prefill tokens computed, TTFT p50 / p99, tokens/s, and whether both
  runs gave the same tokens.
* `sim`: the trace unscaled on simulated H100 replicas of Llama-3-8B (sim_cluster.py) under the
  real controller with D2LPM placement; replicas report their device and host prefixes.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass

from fairbatch.benchmarks.sim_cluster import pct

TRACE_BLOCK = 512  # tokens per hash id in the trace


@dataclass
class TraceRequest:
    arrival_s: float
    prompt: list[int]
    output_len: int
    conversation: int  # its first own block id (the tenant of the sim replay derives from it)


def load_trace(path: str, every: int) -> list[dict]:
    """The trace's rows of the sampled conversations, in arrival order."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if conversation_of(r) % every == 0]


def conversation_of(row: dict) -> int:
    """The conversation's key: its first block after the shared system prompt (id 0)."""
    ids = row["hash_ids"]
    return ids[1] if len(ids) > 1 else ids[0]


def block_tokens(block_id: int, n: int, vocab: int) -> list[int]:
    """Block `block_id`'s `n` tokens: the same for every request that names it (ids 0-3 are
    special tokens and left out)."""
    rng = random.Random(block_id)
    return [rng.randrange(4, vocab) for _ in range(n)]


def make_requests(
    rows: list[dict], tokens_per_block: int, vocab: int, time_scale: float
) -> list[TraceRequest]:
    """Requests with each block of 512 tokens as `tokens_per_block`, lengths scaled alike
    (outputs at least 1), arrivals divided by `time_scale`."""
    scale = tokens_per_block / TRACE_BLOCK
    cache: dict[int, list[int]] = {}
    out = []
    for r in rows:
        tokens: list[int] = []
        for h in r["hash_ids"]:
            if h not in cache:
                cache[h] = block_tokens(h, tokens_per_block, vocab)
            tokens += cache[h]
        n = min(len(tokens), max(1, math.ceil(r["input_length"] * scale)))
        out.append(
            TraceRequest(
                r["timestamp"] / 1000 / time_scale,
                tokens[:n],
                max(1, round(r["output_length"] * scale)),
                conversation_of(r),
            )
        )
    return out


class _Counting:
    """The runner, counting the prompt tokens each step computes (prefill, not decode)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.prefill_tokens = 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, out):
        for req in out.scheduled:
            n = out.num_scheduled_tokens[req.request_id]
            self.prefill_tokens += max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
        return self.runner.execute(out)


def replay_model(
    requests: list[TraceRequest], model: str, tier_blocks: int, **engine_kwargs
) -> dict:
    """One replay on a real engine (`tier_blocks` host-tier blocks; 0: no tier)."""
    from fairbatch.engine.llm import build_engine
    from fairbatch.engine.sampling_params import SamplingParams

    engine = build_engine(model, num_cpu_cache_blocks=tier_blocks, **engine_kwargs)
    engine.runner = counting = _Counting(engine.runner)
    pending = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    arrived: dict[str, float] = {}
    ttft: list[float] = []
    tokens: dict[str, list[int]] = {}
    skipped = 0.0  # idle gaps skipped: the clock is wall time less these
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(pending) or engine.has_unfinished():
        now = time.perf_counter() - t0 - skipped
        if not engine.has_unfinished() and requests[pending[nxt]].arrival_s > now:
            skipped -= requests[pending[nxt]].arrival_s - now  # jump to the next arrival
            now = requests[pending[nxt]].arrival_s
        while nxt < len(pending) and requests[pending[nxt]].arrival_s <= now:
            i = pending[nxt]
            req = requests[i]
            rid = f"c{i}"
            params = SamplingParams(temperature=0.0, max_tokens=req.output_len, ignore_eos=True)
            engine.add_request(req.prompt, params, request_id=rid)
            arrived[rid], tokens[rid] = req.arrival_s, []
            nxt += 1
        for d in engine.step():
            if d.token_ids and not tokens[d.request_id]:
                ttft.append(time.perf_counter() - t0 - skipped - arrived[d.request_id])
            tokens[d.request_id] += d.token_ids
    wall = time.perf_counter() - t0 + skipped
    engine.check_integrity()
    s = engine.scheduler
    prompt_tokens = sum(len(r.prompt) for r in requests)
    out_tokens = sum(len(t) for t in tokens.values())
    host = s.num_host_hit_tokens
    return {
        "tier": bool(tier_blocks),
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "device_hit_rate": round((s.num_prefix_hit_tokens - host) / prompt_tokens, 4),
        "host_hit_rate": round(host / prompt_tokens, 4),
        "prefill_tokens_computed": counting.prefill_tokens,
        "ttft_p50_s": round(pct(ttft, 50), 3),
        "ttft_p99_s": round(pct(ttft, 99), 3),
        "output_tok_s": round(out_tokens / wall, 2),
        "total_tok_s": round((out_tokens + counting.prefill_tokens) / wall, 1),
        "busy_s": round(wall, 1),
        "preemptions": dict(s.num_preemptions),
        "host_tier": engine.stats()["host_tier"],
        "_tokens": tokens,
    }


def main_model(args) -> list[dict]:
    from fairbatch.benchmarks.checkpoints import resolve_model

    rows = load_trace(args.trace, args.every)
    model = str(resolve_model(args.model, "float32"))
    reqs = make_requests(rows, args.tokens_per_block, 2048, args.time_scale)
    bs = args.block_size
    distinct = len({h for r in rows for h in r["hash_ids"]}) * args.tokens_per_block // bs
    longest = max(-(-len(r.prompt) // bs) + -(-r.output_len // bs) for r in reqs)
    gpu_blocks = args.gpu_blocks or max(longest + 8, distinct // 8)
    kwargs = dict(
        dtype=__import__("torch").float32,
        block_size=bs,
        num_gpu_blocks=gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=longest * bs + bs,
    )
    print(
        f"conversation trace: {len(reqs)} requests of {len(rows)} sampled (every {args.every}), "
        f"{sum(len(r.prompt) for r in reqs)} prompt tokens; working set {distinct} blocks, "
        f"device pool {gpu_blocks} blocks of {bs}"
    )
    results = []
    for tier in (0, distinct):
        row = replay_model(reqs, model, tier, **kwargs)
        print({k: v for k, v in row.items() if not k.startswith("_")})
        results.append(row)
    base, tiered = results
    same = base.pop("_tokens") == tiered.pop("_tokens")
    summary = {
        "setup": {
            "model": args.model,
            "dtype": "float32",
            "requests": len(reqs),
            "every": args.every,
            "tokens_per_block": args.tokens_per_block,
            "time_scale": args.time_scale,
            "device_blocks": gpu_blocks,
            "block_size": bs,
            "working_set_blocks": distinct,
            "host_tier_blocks": distinct,
        },
        "runs": results,
        "prefill_ratio": round(
            tiered["prefill_tokens_computed"] / base["prefill_tokens_computed"], 3
        ),
        "outputs_identical": same,
    }
    print(
        f"prefill tokens computed, tier / none: {summary['prefill_ratio']}; "
        f"outputs identical: {same}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return results


def replay_sim(
    rows: list[dict],
    num_replicas: int,
    host_blocks: int,
    time_scale: float,
    device_blocks: int,
    num_tenants: int = 4,
    seed: int = 0,
) -> dict:
    """The sampled trace unscaled on simulated replicas (Llama-3-8B on H100s) under the
    real controller, D2LPM placement and dlpm local order; `host_blocks` host-tier blocks per
    replica (0: none). A conversation belongs to one of `num_tenants` tenants (its key
    modulo). Replicas report all their device and host prefixes every REPORT_HASHES_EVERY
    reports; requests carry the hashes of all their full blocks for placement."""
    from fairbatch.benchmarks.sim_cluster import SimCluster, Workload
    from fairbatch.deployments.cluster.fairness import ControllerConfig, FairnessCore
    from fairbatch.deployments.cluster.placement import report_hashes
    from fairbatch.deployments.cluster.wire import RequestMeta
    from fairbatch.engine import gpu_profiles
    from fairbatch.engine.core import EngineCore
    from fairbatch.engine.sampling_params import SamplingParams
    from fairbatch.kv.block_pool import BlockPool
    from fairbatch.kv.manager import KVCacheManager
    from fairbatch.policies import TenantSpec, make_policy
    from fairbatch.scheduler import Scheduler, SchedulerConfig

    bs = 16
    wl = Workload(num_gpu_blocks=device_blocks, max_num_seqs=32, max_num_batched_tokens=8192)
    specs = [TenantSpec(f"t{i}") for i in range(num_tenants)]
    # one tenant's conversations are several requests of ~12k tokens: a deficit of a few
    # requests' worth per replica, else no request would ever be placed for its match
    ctrl = ControllerConfig(tenants=specs, routing="d2lpm", policy="dlpm", d2lpm_quantum=2e5)
    core = FairnessCore(ctrl, rng=random.Random(seed))
    sim = SimCluster(core, wl)
    shape = gpu_profiles.llama3_8b()
    longest = max(r["input_length"] + r["output_length"] for r in rows)
    counters: list[_Counting] = []
    for i in range(num_replicas):
        r = sim.add(f"r{i}", "dlpm", specs)
        cfg = SchedulerConfig(
            max_num_seqs=wl.max_num_seqs,
            max_num_batched_tokens=wl.max_num_batched_tokens,
            max_model_len=longest + bs,
            kv_bytes_per_token=shape.kv_bytes_per_token,
        )
        kv = KVCacheManager(device_blocks, bs, 512 + host_blocks, host_tier=host_blocks > 0)
        counted = _Counting(r.runner)
        r.core = EngineCore(Scheduler(cfg, kv, make_policy("dlpm", specs)), counted)
        counters.append(counted)
    reqs = make_requests(rows, TRACE_BLOCK, 32000, time_scale)
    hasher = BlockPool(1, bs)
    arrivals = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
    submitted: dict[str, float] = {}  # request id -> arrival, until its first token
    num_out: dict[str, int] = {}  # request id -> output tokens, while it is open
    ttft: list[float] = []
    out_tokens = 0
    reports = 0
    for r in sim.replicas.values():
        core.report(r.report())
    nxt = 0
    wall0 = time.perf_counter()
    while nxt < len(arrivals) or num_out:
        if nxt < len(arrivals) and reqs[arrivals[nxt]].arrival_s <= sim.next_time():
            i = arrivals[nxt]
            req = reqs[i]
            nxt += 1
            sim.now = req.arrival_s
            tenant = f"t{req.conversation % num_tenants}"
            hashes: list[bytes] = []
            hasher.extend_chain(req.prompt, hashes, [], len(req.prompt) // bs, tenant)
            params = SamplingParams(max_tokens=req.output_len, ignore_eos=True)
            rid = f"c{i}"
            meta = RequestMeta(rid, req.prompt, params, tenant, cache_salt=tenant)
            meta.prefix_hashes = hashes
            submitted[rid], num_out[rid] = sim.now, 0
            sim.apply(core.submit(meta))
            continue
        r = sim.next_replica()
        if r is None:
            break
        if (rep := sim.due_report(r)) is not None:
            reports += 1
            if reports % REPORT_HASHES_EVERY == 1:
                kv = r.core.scheduler.kv
                rep.prefix_hashes = report_hashes(kv.gpu_pool.cached, kv.host_cached_hashes())
            sim.apply(core.report(rep))
        for d in sim.step(r):
            out_tokens += len(d.token_ids)
            num_out[d.request_id] += len(d.token_ids)
            if d.request_id in submitted and d.token_ids:
                ttft.append(sim.now - submitted.pop(d.request_id))
            if d.finished:
                r.finished.append((d.request_id, num_out.pop(d.request_id)))
    scheds = [x.core.scheduler for x in sim.replicas.values()]
    prompt_tokens = sum(len(q.prompt) for q in reqs)
    hits = sum(s.num_prefix_hit_tokens for s in scheds)
    host = sum(s.num_host_hit_tokens for s in scheds)
    computed = sum(c.prefill_tokens for c in counters)
    return {
        "replicas": num_replicas,
        "tier": bool(host_blocks),
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "device_hit_rate": round((hits - host) / prompt_tokens, 4),
        "host_hit_rate": round(host / prompt_tokens, 4),
        "prefill_tokens_computed": computed,
        "ttft_p50_s": round(pct(ttft, 50), 3),
        "ttft_p99_s": round(pct(ttft, 99), 3),
        "output_tok_s": round(out_tokens / sim.now, 1),
        "preemptions": {
            m: sum(s.num_preemptions[m] for s in scheds) for m in ("swap", "recompute")
        },
        "virtual_s": round(sim.now, 1),
        "wall_s": round(time.perf_counter() - wall0, 1),
    }


REPORT_HASHES_EVERY = 25  # reports (of 0.02 virtual s each) between two prefix reports


def main_sim(args) -> list[dict]:
    rows = load_trace(args.trace, args.every)
    results = []
    for n in args.replicas:
        for host in (0, args.host_blocks):
            row = replay_sim(rows, n, host, args.time_scale, args.gpu_blocks or 8192)
            print(row)
            results.append(row)
    if args.json:
        setup = {
            "engine": "sim (Llama-3-8B, H100)",
            "every": args.every,
            "time_scale": args.time_scale,
            "device_blocks": args.gpu_blocks or 8192,
            "host_tier_blocks": args.host_blocks,
            "block_size": 16,
        }
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "runs": results}, f, indent=2)
    return results
