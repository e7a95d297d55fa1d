"""`fairbatch bench cluster --autoscale`: fairness-aware autoscaling on simulated replicas.

The one-process loop of cluster_bench.py (the controller is the real `FairnessCore`; replicas
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

import heapq
import json
import math
import random
import time
from dataclasses import dataclass

from fairbatch.benchmarks.cluster_bench import SimReplica, Workload, pct
from fairbatch.deployments.cluster.autoscaling import (
    Autoscaler,
    AutoscalingConfig,
    Requeue,
    drain_actions,
    drain_choice,
    drained,
    measure,
)
from fairbatch.deployments.cluster.fairness import (
    Assign,
    ControllerConfig,
    FairnessCore,
    Migrate,
    Preempt,
)
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
    wl = Workload(max_num_seqs=day.max_num_seqs, num_gpu_blocks=4096)
    specs = [TenantSpec("a", weight=1.0), TenantSpec("b", weight=2.0)]
    core = FairnessCore(ControllerConfig(tenants=specs, policy="weighted_fair"))
    if system == "fixed_peak":
        n0 = day.peak_replicas
    elif system == "fixed_mean":
        n0 = max(1, round(day.peak_replicas * day.mean_rate() / day.peak_rate))
    else:
        n0 = scaling.min_replicas
    scaler = None
    now = 0.0
    if scaling is not None:
        scaler = Autoscaler(scaling, n0, clock=lambda: now)
    replicas: dict[str, SimReplica] = {}
    replica_seconds = 0.0
    most = 0  # replicas at once, at most
    heap: list = []
    ids = iter(range(1 << 30))

    def add_replica(ready_at: float) -> None:
        nonlocal most
        rid = f"r{next(ids)}"
        most = max(most, len(replicas) + 1)
        r = replicas[rid] = SimReplica(rid, wl, "weighted_fair", specs)
        r.runner.idle_until(ready_at)
        r.next_report = ready_at
        heapq.heappush(heap, (ready_at, rid))

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
    requeued: dict[str, object] = {}  # request id -> its MigratedRequest, until reassigned
    draining: set[str] = set()
    lost_at_drain = 0
    migrations = requeues = 0
    params = SamplingParams(max_tokens=day.max_tokens, ignore_eos=True)

    def apply(actions: list) -> None:
        nonlocal migrations, requeues
        for a in actions:
            if isinstance(a, Assign):
                rep = replicas[a.replica_id]
                held = requeued.pop(a.ticket.request_id, None)
                if held is not None:
                    rep.core.import_request(held)
                    rep.runner.idle_until(now)
                else:
                    rep.assign(a.ticket, now)
            elif isinstance(a, Preempt):
                replicas[a.replica_id].core.preempt(a.request_id, a.mode)
            elif isinstance(a, Migrate):  # as Replica.migrate_out: swap out if it can, export
                src, dst = replicas[a.src], replicas[a.dst]
                req = src.core.scheduler.requests.get(a.request_id)
                if req is None or (a.waiting_only and req.status.name != "WAITING"):
                    apply(core.move_done(a, ok=False))  # ended, or started: it stays
                    continue
                if req.status.name == "RUNNING":
                    swap = src.core.scheduler.kv.can_swap_out(req)
                    src.core.preempt(a.request_id, "swap" if swap else "recompute")
                dst.core.import_request(src.core.export_request(a.request_id))
                dst.runner.idle_until(now)
                migrations += 1
                apply(core.move_done(a, ok=True))
            elif isinstance(a, Requeue):  # the client resubmits it with its tokens
                src = replicas[a.replica_id]
                req = src.core.scheduler.requests.get(a.request_id)
                if req is None:
                    continue
                if req.status.name == "RUNNING":  # started since the report: stops here
                    src.core.preempt(a.request_id, "recompute")
                moved = src.core.export_request(a.request_id)
                src.finished.append((a.request_id, moved.request.num_output_tokens))
                requeued[a.request_id] = moved
                meta = RequestMeta(a.request_id, moved.request.prompt_token_ids, params)
                meta.tenant, meta.attempt = moved.request.tenant, 1
                requeues += 1
                apply(core.submit(meta))

    def scale() -> None:
        nonlocal lost_at_drain
        for rid in list(draining):
            apply(drain_actions(core, rid))
            r = replicas[rid]
            if drained(core, rid) and not r.core.has_unfinished():
                lost_at_drain += len(core.remove_replica(rid))
                draining.discard(rid)
                del replicas[rid]
        if scaler is None:
            return
        decision = scaler.observe(measure(core, draining)).replicas
        up = [rid for rid in replicas if rid not in draining]
        if decision > len(up):
            for _ in range(decision - len(up)):
                add_replica(now + day.startup_s)
        elif decision < len(up):
            ready = [rid for rid in up if rid in core.replicas]
            for rid in drain_choice(core, ready, len(up) - decision):
                draining.add(rid)
                apply(drain_actions(core, rid))

    next_tick = 0.0
    interval = scaling.interval_s if scaling is not None else 1.0
    ai = 0
    last = 0.0
    t0 = time.perf_counter()
    end_by = day.duration_s * 3
    while heap:
        clock, rid = heapq.heappop(heap)
        r = replicas.get(rid)
        if r is None:
            continue  # drained and gone
        now = clock
        replica_seconds += len(replicas) * (now - last)
        last = now
        while ai < len(arrivals) and arrivals[ai][0] <= now:
            at, tenant = arrivals[ai]
            qid = f"q{ai}"
            ai += 1
            arrived[qid] = at
            prompt = [rng.randrange(1, 32000) for _ in range(day.prompt)]
            apply(core.submit(RequestMeta(qid, prompt, params, tenant)))
        if now >= next_tick:
            next_tick = now + interval
            scale()
            if rid not in replicas:
                continue
        finished_all = ai == len(arrivals) and len(done) == len(arrived)
        if finished_all or now > end_by:
            break
        if now >= r.next_report:
            r.next_report = now + wl.report_interval_s
            apply(core.report(r.report()))
        if r.core.has_unfinished():
            for d in r.core.step():
                if d.token_ids and d.request_id not in first_token:
                    first_token[d.request_id] = r.runner.clock
                out_len[d.request_id] = out_len.get(d.request_id, 0) + len(d.token_ids)
                if d.finished:
                    n = out_len.pop(d.request_id, 0)
                    done[d.request_id] = n
                    r.finished.append((d.request_id, n))
            heapq.heappush(heap, (max(r.runner.clock, now + 1e-6), rid))
        else:
            r.runner.idle_until(now + wl.report_interval_s)
            heapq.heappush(heap, (r.runner.clock, rid))
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
        "migrations": migrations,
        "requeues": requeues,
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
