"""`fairbatch bench cluster --autoscale`: fairness-aware autoscaling on simulated replicas.

The simulated cluster of sim_cluster.py (the controller is the real `FairnessCore`; replicas
are EngineCores on the unpaced sim runner, in virtual time), with open-loop Poisson arrivals
shaped like a day: quiet, a ramp to 10x the quiet rate, a peak, a ramp down, quiet again. The
autoscaled system runs the controller's `Autoscaler` on the virtual clock: a new replica costs
replica-seconds from the moment it is asked for and takes work `startup_s` later (its first
report); a scale-down drains (`drain_actions`: running requests migrate with their K/V swapped
out, or recompute when they cannot swap; waiting ones go back to the queue and are resubmitted
with their tokens) and the replica goes once it holds nothing.

Rows: autoscaled, fixed_peak (the replicas the peak needs, all day), fixed_mean (the mean's).
`lost` counts requests that did not end with all their tokens (by the end of the run, which
lets every system finish its backlog) plus any request a drained replica still held.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass

from fairbatch.benchmarks.sim_cluster import SimCluster, Workload, pct
from fairbatch.deployments.cluster.autoscaling import (
    Autoscaler,
    AutoscalingConfig,
    drain_actions,
    drain_choice,
    drained,
    measure,
)
from fairbatch.deployments.cluster.fairness import ControllerConfig, FairnessCore
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies import TenantSpec


@dataclass
class Day:
    duration_s: float = 240.0  # virtual seconds of arrivals (then the backlog drains)
    peak_replicas: int = 64  # the fixed cluster sized for the peak
    quiet_rate: float = 0.0  # requests/s when quiet; 0: a tenth of the peak rate
    peak_rate_per_replica: float = 35.0  # requests/s per replica at the peak (~80% of capacity)
    prompt: int = 128
    max_tokens: int = 96
    slo_ttft_s: float = 2.0
    startup_s: float = 10.0  # asked for -> first report (node boot + model load)
    max_num_seqs: int = 32
    seed: int = 0

    @property
    def peak_rate(self) -> float:
        return self.peak_rate_per_replica * self.peak_replicas

    def rate(self, t: float) -> float:
        """Quiet for the first and last fifth, ramps of a fifth each, the peak in the middle."""
        quiet = self.quiet_rate or self.peak_rate / 10
        x = t / self.duration_s
        rise = min(1.0, max(0.0, (x - 0.2) / 0.2)) if x < 0.5 else min(1.0, (0.8 - x) / 0.2)
        rise = max(0.0, rise)
        return quiet + (self.peak_rate - quiet) * math.sin(rise * math.pi / 2) ** 2

    def mean_rate(self) -> float:
        n = 1000
        return sum(self.rate((i + 0.5) * self.duration_s / n) for i in range(n)) / n


def run_one(day: Day, system: str, scaling: AutoscalingConfig | None = None) -> dict:
    rng = random.Random(day.seed)
    specs = [TenantSpec("a", weight=1.0), TenantSpec("b", weight=2.0)]
    core = FairnessCore(ControllerConfig(tenants=specs, policy="weighted_fair"))
    if system == "fixed_peak":
        n0 = day.peak_replicas
    elif system == "fixed_mean":
        n0 = max(1, round(day.peak_replicas * day.mean_rate() / day.peak_rate))
    else:
        n0 = scaling.min_replicas
    sim = SimCluster(core, Workload(max_num_seqs=day.max_num_seqs, num_gpu_blocks=4096))
    replicas = sim.replicas
    scaler = None
    if scaling is not None:
        scaler = Autoscaler(scaling, n0, clock=lambda: sim.now)
    replica_seconds = 0.0
    most = 0  # replicas at once, at most
    ids = iter(range(1 << 30))

    def add_replica(ready_at: float) -> None:
        nonlocal most
        rid = f"r{next(ids)}"
        most = max(most, len(replicas) + 1)
        sim.add(rid, "weighted_fair", specs, at=ready_at, key=rid)

    for _ in range(n0):
        add_replica(0.0)
    arrivals: list[tuple[float, str]] = []
    t = 0.0
    while True:  # Poisson arrivals by thinning
        t += rng.expovariate(day.peak_rate)
        if t >= day.duration_s:
            break
        if rng.random() < day.rate(t) / day.peak_rate:
            arrivals.append((t, "ab"[rng.random() < 2 / 3]))
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    out_len: dict[str, int] = {}
    done: dict[str, int] = {}
    draining: set[str] = set()
    lost_at_drain = 0
    params = SamplingParams(max_tokens=day.max_tokens, ignore_eos=True)

    def scale() -> None:
        nonlocal lost_at_drain
        for rid in list(draining):
            sim.apply(drain_actions(core, rid))
            r = replicas[rid]
            if drained(core, rid) and not r.core.has_unfinished():
                lost_at_drain += len(core.remove_replica(rid))
                draining.discard(rid)
                sim.remove(rid)
        if scaler is None:
            return
        decision = scaler.observe(measure(core, draining)).replicas
        up = [rid for rid in replicas if rid not in draining]
        if decision > len(up):
            for _ in range(decision - len(up)):
                add_replica(sim.now + day.startup_s)
        elif decision < len(up):
            ready = [rid for rid in up if rid in core.replicas]
            for rid in drain_choice(core, ready, len(up) - decision):
                draining.add(rid)
                sim.apply(drain_actions(core, rid))

    next_tick = 0.0
    interval = scaling.interval_s if scaling is not None else 1.0
    ai = 0
    last = 0.0
    t0 = time.perf_counter()
    end_by = day.duration_s * 3
    while (r := sim.next_replica()) is not None:
        now = sim.now
        replica_seconds += len(replicas) * (now - last)
        last = now
        while ai < len(arrivals) and arrivals[ai][0] <= now:
            at, tenant = arrivals[ai]
            qid = f"q{ai}"
            ai += 1
            arrived[qid] = at
            prompt = [rng.randrange(1, 32000) for _ in range(day.prompt)]
            sim.apply(core.submit(RequestMeta(qid, prompt, params, tenant)))
        if now >= next_tick:
            next_tick = now + interval
            scale()
            if r.replica_id not in replicas:
                continue
        finished_all = ai == len(arrivals) and len(done) == len(arrived)
        if finished_all or now > end_by:
            break
        if (rep := sim.due_report(r)) is not None:
            sim.apply(core.report(rep))
        for d in sim.step(r):
            if d.token_ids and d.request_id not in first_token:
                first_token[d.request_id] = r.runner.clock
            out_len[d.request_id] = out_len.get(d.request_id, 0) + len(d.token_ids)
            if d.finished:
                n = out_len.pop(d.request_id, 0)
                done[d.request_id] = n
                r.finished.append((d.request_id, n))
    ttft = [first_token[q] - arrived[q] for q in arrived if q in first_token]
    met = sum(
        1 for q in arrived if q in first_token and first_token[q] - arrived[q] <= day.slo_ttft_s
    )
    complete = sum(1 for q in arrived if done.get(q) == day.max_tokens)
    return {
        "system": system,
        "requests": len(arrived),
        "completed": complete,
        "lost": len(arrived) - complete + lost_at_drain,
        "replica_seconds": round(replica_seconds, 1),
        "slo_attainment": met / len(arrived) if arrived else 0.0,
        "slo_ttft_s": day.slo_ttft_s,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "start_replicas": n0,
        "max_replicas": most,
        "migrations": sim.migrations,
        "requeues": sim.requeues,
        "virtual_s": round(now, 1),
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def main(json_path: str | None, peak_replicas: int = 64, duration_s: float = 240.0) -> list[dict]:
    day = Day(duration_s=duration_s, peak_replicas=peak_replicas)
    scaling = AutoscalingConfig(
        min_replicas=1,
        max_replicas=peak_replicas,
        target_queued_tokens_per_replica=day.max_num_seqs * (day.prompt + day.max_tokens),
        upscale_delay_s=1.0,
        downscale_delay_s=10.0,
        smoothing_s=1.0,
        interval_s=1.0,
    )
    rows = []
    for system in ("autoscaled", "fixed_peak", "fixed_mean"):
        row = run_one(day, system, scaling if system == "autoscaled" else None)
        rows.append(row)
        print(
            f"{system:11s} replica_s={row['replica_seconds']:9.0f} "
            f"slo={row['slo_attainment']:.3f} ttft_p99={row['ttft_p99_s']:.2f}s "
            f"requests={row['requests']} lost={row['lost']} migrations={row['migrations']} "
            f"requeues={row['requeues']} wall={row['wall_s']}s",
            flush=True,
        )
    peak = rows[1]
    auto = rows[0]
    summary = {
        "system": "summary",
        "slo_vs_fixed_peak": auto["slo_attainment"] - peak["slo_attainment"],
        "replica_seconds_vs_fixed_peak": auto["replica_seconds"] / peak["replica_seconds"],
    }
    rows.append(summary)
    print(summary, flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main(None, peak_replicas=8, duration_s=60.0)
