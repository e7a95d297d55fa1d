"""Scheduler overhead: one schedule() + update_from_output() at production queue sizes.

A fake runner (no model) answers every step, so the time measured is the scheduler's alone.
The pool is sized so that `running` requests fit; finished requests are replaced at once so
the waiting queue stays at `waiting`. Reported as median/p99 milliseconds and as a share of a
10 ms GPU step (a typical decode step of a mid-size model on one GPU).
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import time

from fairbatch.kv.manager import KVCacheManager
from fairbatch.policies import TenantSpec, make_policy
from fairbatch.scheduler import Request, Scheduler, SchedulerConfig
from fairbatch.scheduler.fake_runner import FakeRunner

POLICIES = ("fcfs", "round_robin", "weighted_fair", "priority")


def run_one(
    policy_name: str,
    *,
    running: int = 256,
    waiting: int = 5000,
    tenants: int = 100,
    block_size: int = 16,
    steps: int = 2000,
    warmup: int = 200,
    seed: int = 0,
) -> dict:
    rng = random.Random(seed)
    specs = [TenantSpec(f"t{i}", weight=1 + i % 4) for i in range(tenants)]
    policy = make_policy(policy_name, specs)
    prompt_len, max_tokens = 64, 128
    blocks_per_req = -(-(prompt_len + max_tokens) // block_size)
    kv = KVCacheManager(running * blocks_per_req + 64, block_size, enable_prefix_caching=True)
    cfg = SchedulerConfig(
        max_num_seqs=running, max_num_batched_tokens=running + 512, max_model_len=4096
    )
    sched = Scheduler(cfg, kv, policy)
    runner = FakeRunner(vocab_size=32000)
    counter = 0
    intake: list[float] = []  # seconds of each add_request() (it hashes the prompt's blocks)

    def add() -> None:
        nonlocal counter
        counter += 1
        t = rng.randrange(tenants)
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        request = Request(
            f"r{counter}",
            prompt,
            max_tokens=rng.randint(max_tokens // 2, max_tokens),
            tenant=f"t{t}",
            priority=t % 3,
        )
        t0 = time.perf_counter()
        sched.add_request(request)
        intake.append(time.perf_counter() - t0)

    for _ in range(running + waiting):
        add()
    # Fill the running set before measuring.
    while len(sched.running) < running:
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    gc.collect()
    gc.freeze()  # long-lived queued objects out of the collector's way (full collections stall)
    times = []
    for step in range(warmup + steps):
        if step == warmup:
            intake.clear()
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        ro = runner.execute(out)  # the model's work, not the scheduler's: not timed
        t2 = time.perf_counter()
        updates = sched.update_from_output(out, ro)
        t3 = time.perf_counter()
        for _ in updates.finished:
            add()
        if step >= warmup:
            times.append((t1 - t0) + (t3 - t2))
    gc.unfreeze()
    times.sort()
    med = statistics.median(times) * 1e3
    p99 = times[int(0.99 * (len(times) - 1))] * 1e3
    return {
        "policy": policy_name,
        "running": len(sched.running),
        "waiting": sched.num_waiting,
        "tenants": tenants,
        "block_size": block_size,
        "steps": steps,
        "schedule_ms_median": round(med, 4),
        "schedule_ms_p99": round(p99, 4),
        "share_of_10ms_step_median": round(med / 10.0, 4),
        # Intake is not part of the step: add_request() runs as requests arrive. Reported
        # because it does work the step would otherwise do (hashing the prompt's blocks).
        "add_request_us_median": round(statistics.median(intake) * 1e6, 2),
        "add_request_ms_per_step_mean": round(sum(intake) / steps * 1e3, 4),
        "preemptions": dict(sched.num_preemptions),
    }


def machine_speed_ms() -> float:
    """Milliseconds of a fixed pure-Python loop (3M additions): how fast this machine runs
    Python right now. On a shared VM it moves by tens of percent within minutes; recorded next
    to each round so that rounds taken at different speeds can be told apart."""
    t0 = time.perf_counter()
    total = 0
    for i in range(3_000_000):
        total += i
    return (time.perf_counter() - t0) * 1e3


def main(
    json_path: str | None = None, steps: int = 2000, policies=POLICIES, rounds: int = 3
) -> list[dict]:
    """Each policy `rounds` times, round-robin over the policies, so that a slow stretch of a
    shared machine lands on all of them; a policy's figures are the medians over its rounds."""
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    for _ in range(rounds):
        for name in policies:
            speed = machine_speed_ms()
            res = run_one(name, steps=steps)
            res["machine_speed_ms"] = round((speed + machine_speed_ms()) / 2, 1)
            runs[name].append(res)
    results = []
    for name in policies:
        res = dict(runs[name][-1])
        for key in (
            "schedule_ms_median",
            "schedule_ms_p99",
            "share_of_10ms_step_median",
            "add_request_us_median",
            "add_request_ms_per_step_mean",
        ):
            res[key] = round(statistics.median(r[key] for r in runs[name]), 4)
        res["rounds"] = rounds
        res["schedule_ms_median_per_round"] = [r["schedule_ms_median"] for r in runs[name]]
        res["machine_speed_ms_per_round"] = [r["machine_speed_ms"] for r in runs[name]]
        del res["machine_speed_ms"]
        results.append(res)
        print(
            f"{name:14s} running={res['running']} waiting={res['waiting']} "
            f"median={res['schedule_ms_median']:.3f} ms  p99={res['schedule_ms_p99']:.3f} ms  "
            f"({100 * res['share_of_10ms_step_median']:.1f}% of a 10 ms step; "
            f"add_request {res['add_request_us_median']:.1f} us, "
            f"{res['add_request_ms_per_step_mean']:.3f} ms a step; rounds: "
            + " ".join(f"{m:.3f}" for m in res["schedule_ms_median_per_round"])
            + "; machine speed ms: "
            + " ".join(f"{m:.0f}" for m in res["machine_speed_ms_per_round"])
            + ")"
        )
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=2)
    return results
