"""Deadlines under 2x overload: goodput with and without eviction, for fcfs, weighted_fair and
weighted_fair + edf (order_within_tenant).

One replica in simulated time: the scheduler's clock is a `SimRunner`'s (Llama-3-8B on an H100,
roofline step times), so a run is exact, seeded and fast on a small CPU. Two tenants of equal
weight each offer 1x capacity (2x in all) of requests with a deadline: `timeout` tight (3 s) or
loose (12 s), half each, and `max_queue_time_s` half the timeout. Goodput = requests that end
normally (stop or length) within their deadline, per second of arrivals. "no eviction" runs the
same workload with the deadlines only measured, never enforced.

    python -m fairbatch.benchmarks.deadline_bench --duration 60 --out docs/results/deadlines.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

from fairbatch.engine import gpu_profiles
from fairbatch.engine.core import EngineCore
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.engine.sim_runner import SimRunner
from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Scheduler, SchedulerConfig

RUNS = [  # (label, policy, order_within_tenant, evict)
    ("fcfs", "fcfs", "fcfs", True),
    ("weighted_fair", "weighted_fair", "fcfs", True),
    ("weighted_fair+edf", "weighted_fair", "edf", True),
    ("weighted_fair+edf, no eviction", "weighted_fair", "edf", False),
    ("fcfs, no eviction", "fcfs", "fcfs", False),
]
TIMEOUTS_S = (3.0, 12.0)


@dataclass
class Arrival:
    at: float
    tenant: str
    prompt: list[int]
    max_tokens: int
    timeout: float


def make_engine(policy: str, within: str) -> tuple[EngineCore, SimRunner]:
    shape = gpu_profiles.llama3_8b()
    runner = SimRunner(shape, "H100", vocab_size=32000)
    cfg = SchedulerConfig(
        max_num_seqs=64, max_num_batched_tokens=2048, kv_bytes_per_token=shape.kv_bytes_per_token
    )
    kv = KVCacheManager(4096, 16, 0)
    tenants = [TenantSpec("a"), TenantSpec("b")]
    pol = make_policy(policy, tenants, clock=lambda: runner.clock, order_within_tenant=within)
    return EngineCore(Scheduler(cfg, kv, pol), runner), runner


def lengths(rng: random.Random) -> tuple[list[int], int]:
    return [rng.randrange(1, 32000) for _ in range(rng.randint(64, 256))], rng.randint(32, 128)


def capacity_rps(seed: int, n: int = 1024) -> float:
    """Requests per simulated second one replica finishes when it is always backlogged."""
    engine, runner = make_engine("fcfs", "fcfs")
    rng = random.Random(seed)
    for i in range(n):
        prompt, out = lengths(rng)
        engine.add_request(
            prompt, SamplingParams(max_tokens=out, ignore_eos=True), request_id=str(i)
        )
    while engine.has_unfinished():
        engine.step()
    return n / runner.clock


def workload(rate: float, duration: float, seed: int) -> list[Arrival]:
    rng = random.Random(seed + 1)
    arrivals = []
    for tenant in ("a", "b"):
        t = rng.expovariate(rate)
        while t < duration:
            prompt, out = lengths(rng)
            arrivals.append(Arrival(t, tenant, prompt, out, rng.choice(TIMEOUTS_S)))
            t += rng.expovariate(rate)
    return sorted(arrivals, key=lambda a: a.at)


def run(arrivals: list[Arrival], policy: str, within: str, evict: bool) -> dict:
    engine, runner = make_engine(policy, within)
    deadline: dict[str, float] = {}
    ended: dict[str, tuple[float, str]] = {}
    i = 0
    while i < len(arrivals) or engine.has_unfinished():
        while i < len(arrivals) and arrivals[i].at <= runner.clock:
            a = arrivals[i]
            rid = f"{a.tenant}{i}"
            deadline[rid] = a.at + a.timeout
            # from the arrival, not from when the loop saw it: given as wall-clock times
            wall = time.time() - runner.clock
            deadlines = (wall + a.at + a.timeout, wall + a.at + a.timeout / 2)
            params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
            engine.add_request(
                a.prompt, params, request_id=rid, tenant=a.tenant, deadlines=deadlines
            )
            if not evict:  # edf still orders by the deadlines; nobody is evicted
                engine.scheduler._deadlines.clear()
            i += 1
        if not engine.has_unfinished():
            runner.idle_until(arrivals[i].at)
            continue
        for d in engine.step():
            if d.finished:
                ended[d.request_id] = (runner.clock, d.finish_reason)
    duration = arrivals[-1].at
    good = {"a": 0, "b": 0}
    timed_out = 0
    for rid, (at, reason) in ended.items():
        if reason == "timeout":
            timed_out += 1
        elif at <= deadline[rid]:
            good[rid[0]] += 1
    return {
        "goodput_rps": round(sum(good.values()) / duration, 3),
        "goodput_rps_by_tenant": {t: round(n / duration, 3) for t, n in good.items()},
        "finished_in_deadline": sum(good.values()),
        "timed_out": timed_out,
        "requests": len(arrivals),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="simulated seconds of arrivals")
    ap.add_argument("--overload", type=float, default=2.0, help="offered load / capacity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the summary JSON here")
    args = ap.parse_args(argv)
    cap = capacity_rps(args.seed)
    arrivals = workload(cap * args.overload / 2, args.duration, args.seed)
    results = {label: run(arrivals, p, w, e) for label, p, w, e in RUNS}
    base = results["weighted_fair+edf, no eviction"]["goodput_rps"]
    summary = {
        "bench": "deadlines",
        "command": "python -m fairbatch.benchmarks.deadline_bench " + " ".join(argv or []),
        "capacity_rps": round(cap, 3),
        "overload": args.overload,
        "duration_s": args.duration,
        "timeouts_s": list(TIMEOUTS_S),
        "runs": results,
        "edf_goodput_vs_no_eviction": round(results["weighted_fair+edf"]["goodput_rps"] / base, 2)
        if base
        else None,
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
