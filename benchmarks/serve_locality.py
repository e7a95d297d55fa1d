"""`fairbatch bench serve --compare locality`: prefix-locality scheduling on one engine.

Tenants (default four, weights 1, 1, 2, 4) each reuse their own long system prompts (several
each) with a short unique question; each tenant sends its first prompt with its own share of
its requests (`HOT`) and picks uniformly among all of them otherwise. The engine's KV pool
holds only part of the prompts (by default a third of their blocks), so what the scheduler
admits next decides what stays cached. The identical requests go, all at once by default (a
backlog from the first instant), to a fresh local server per policy: fcfs, weighted_fair, lpm,
dlpm (Cao et al. 2025, arXiv:2501.14312; policies/dlpm.py).

The default shape is the simulated cluster's (benchmarks/locality_bench.py: 6 prompts of 1024
tokens per tenant, 32-token questions and outputs, about a third of the prompts cached), so
that the engine and the simulation measure the same workload. Shorter prompts cannot show
locality here: with 256-token prompts and 16 output tokens, prefill was under half of
weighted_fair's step time on the tiny CPU model, so even every avoidable prefill saved would
not make any policy 1.5x faster (docs/BENCHMARKS.md). 256 requests reuse each prompt about ten
times: the first computation of each prompt, which no order avoids, is then a tenth of the
prompt tokens rather than a fifth (at 128).

Per policy: output tok/s, prefix-hit rate (the server's prefix-cache hit tokens from GET
/admin/stats before and after, over the prompt tokens its usage reports), per-tenant TTFT
p50/p99, Jain over service / weight while every tenant is still backlogged (up to the first
tenant's last completion: after it the others are served what is left), and the max weighted
service difference against the policy's bound (VTC's for weighted_fair, 2B of policies/dlpm.py
for dlpm; fcfs and lpm have none).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
from pathlib import Path

from fairbatch.benchmarks import serve_bench as B
from fairbatch.benchmarks import serve_report as R
from fairbatch.policies.dlpm import DEFAULT_QUANTUM, service_diff_bound

POLICIES = ("fcfs", "weighted_fair", "lpm", "dlpm")
TENANTS = (("t1", 1.0), ("t2", 1.0), ("t3", 2.0), ("t4", 4.0))
HOT = (0.2, 0.5, 0.3, 0.8)  # the i-th tenant's share of requests on its first prompt (cycled)
SHARED_PREFIX = (6, 1024)  # system prompts per tenant, tokens each
CACHED_SHARE = 3  # the KV pool holds 1 / CACHED_SHARE of the prompts' blocks


def locality_args(args: argparse.Namespace) -> argparse.Namespace:
    """The comparison's defaults for what the command line left unset."""
    a = argparse.Namespace(**vars(args))
    if not a.tenants:
        a.tenants = [dict(name=n, weight=w) for n, w in TENANTS]
    a.shared_prefix = a.shared_prefix or SHARED_PREFIX
    a.input_len = a.input_len or "fixed:32"
    a.output_len = a.output_len or "fixed:32"
    a.num_prompts = a.num_prompts or 256
    if not (a.rate or a.concurrency):
        a.rate = float("inf")  # all at once: every tenant backlogged from the start
    groups, length = a.shared_prefix
    prompt_blocks = len(a.tenants) * groups * math.ceil(length / B.KV_BLOCK_SIZE)
    a.num_gpu_blocks = a.num_gpu_blocks or prompt_blocks // CACHED_SHARE
    a.prefix_hot = {t["name"]: HOT[i % len(HOT)] for i, t in enumerate(a.tenants)}
    return a


def backlogged_window(wl: B.Workload, results: list) -> B.Workload:
    """`wl` with its window ending at the first tenant's last completion (all backlogged)."""
    ends: dict[str, float] = {}
    for r in results:
        ends[r.spec.tenant] = max(ends.get(r.spec.tenant, 0.0), r.end_s)
    return dataclasses.replace(wl, info=dict(wl.info, duration_s=min(ends.values(), default=0)))


def bound(policy: str, summary: dict, a: argparse.Namespace, wl: B.Workload) -> float | None:
    if policy == "weighted_fair":
        return summary["vtc_bound"]
    if policy == "dlpm":
        longest = max(s.prompt_len for s in wl.specs) + 1  # BOS
        weights = [t.weight for t in wl.tenants]
        return service_diff_bound(
            DEFAULT_QUANTUM, a.max_num_seqs, longest, max(s.max_tokens for s in wl.specs),
            min(weights),
        )  # fmt: skip
    return None


def run(args: argparse.Namespace, result: dict, out: Path) -> str:
    a = locality_args(args)
    wl = B.custom_workload(a)
    result["workload"] = dict(wl.info, num_gpu_blocks=a.num_gpu_blocks)
    rows = []
    for policy in POLICIES:
        engine = B.engine_settings(a, policy=policy)
        with B.open_target(a, wl.tenants, engine) as target:
            phase = asyncio.run(B.run_phase(target, wl, max_drain_s=args.max_drain))
            result["meta"].update(model=target.model)
        s, results = phase["summary"], phase["results"]
        window = B.window_service(results, backlogged_window(wl, results)) or {}
        eng = (s.get("server") or {}).get("engine") or {}
        prompt = sum(r.prompt_tokens for r in results if r.ok)
        hits = eng.get("prefix_hit_tokens")
        rows.append(
            {
                "system": policy,
                "workload": "shared_prefix",
                "replicas": 1,
                "throughput_tok_s": s["throughput"]["output_tokens_per_s"],
                "prefix_hit_rate": None if hits is None or not prompt else hits / prompt,
                "ttft_s": {
                    n: {"p50": t["ttft"]["p50"], "p99": t["ttft"]["p99"]}
                    for n, t in s["tenants"].items()
                },
                "worst_ttft_p99_s": max(
                    (t["ttft"]["p99"] or 0.0 for t in s["tenants"].values()), default=None
                ),
                "jain": window.get("jain_index"),
                "window_s": window.get("t_end_s"),
                "max_service_diff": s["max_service_difference"],
                "bound": bound(policy, s, a, wl),
                "completed": s["throughput"]["completed"],
                "num_gpu_blocks": a.num_gpu_blocks,
            }
        )
    result["table"] = rows
    result["plots"] = []
    table = R.table(
        ["policy", "output tok/s", "prefix hits", "worst TTFT p99 ms", "Jain (backlogged)",
         "max diff", "bound", "ok"],
        [
            [r["system"], R.num(r["throughput_tok_s"]),
             "-" if r["prefix_hit_rate"] is None else f"{r['prefix_hit_rate']:.3f}",
             R.ms(r["worst_ttft_p99_s"]), "-" if r["jain"] is None else f"{r['jain']:.3f}",
             R.num(r["max_service_diff"], 0), R.num(r["bound"], 0), r["completed"]]
            for r in rows
        ],
    )  # fmt: skip
    ttft = R.table(
        ["policy", *[f"{n} p50 / p99 ms" for n in rows[0]["ttft_s"]]],
        [
            [r["system"], *[f"{R.ms(t['p50'])} / {R.ms(t['p99'])}" for t in r["ttft_s"].values()]]
            for r in rows
        ],
    )
    info = wl.info
    groups, length = a.shared_prefix
    head = (
        f"## locality: {info['num_requests']} requests ({info['process']}), {len(wl.tenants)} "
        f"tenants x {groups} system prompts of {length} tokens (hot shares {a.prefix_hot}), "
        f"questions {info['input_len']}, outputs {info['output_len']}, {a.num_gpu_blocks} KV "
        f"blocks of 16, max_num_seqs {a.max_num_seqs}, {result['meta']['date_utc']} UTC"
    )
    return "\n\n".join([head, table, ttft])
