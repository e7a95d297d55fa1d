"""`fairbatch bench cluster`: the fairness controller at scale, on simulated replicas.

Runs in one process, without Ray, on the simulated cluster of sim_cluster.py: N replicas that
are EngineCores on the simulated runner (virtual time) under the very `FairnessCore` the Ray
actor wraps.

Measured per (N, system):
  * admissions_per_s: admissions / wall time spent inside the controller (submit, report and
    dispatch calls): the rate one controller core could sustain.
  * admit_latency_ms_p50/p99: wall time of the controller call that admitted a request (its
    share of the control plane's latency; queueing for a turn is separate: queue_wait_s_*).
  * jain_index over weighted service (service / weight per tenant, served after a warm-up of
    `warmup_s` virtual seconds), and max_service_diff: the largest |service_i/w_i -
    service_j/w_j| between tenants (all stay backlogged) over the window, sampled at every report,
    against vtc_bound = 2 * max(input_weight * max prompt, output_weight * M), M = the tokens the
    cluster's running batches can hold (Sheng et al., OSDI'24, Thm 4.3, the cluster as one
    server).

Systems: fairbatch (global weighted-fair queue over cluster-wide counters, least-loaded routing
with prefix affinity), fairbatch_limits (the same, with every tenant's quota and in-flight bound
checked at admission and charged from reports, never refusing), fairbatch_usage (the same as
fairbatch, plus the controller's usage ledger: each request opened at admission, its end noted
from reports, its ingress's record written to a JSON-lines file, a sweep per second),
rr_local_wfq (tenant-blind round robin, per-replica weighted fair queues), p2c_fcfs
(power-of-two-choices routing, per-replica FCFS).

Workload: tenants with weights 1, 2, 3, 4 (and a fifth of weight 1 with 4x longer outputs), each
closed-loop with enough requests outstanding to stay backlogged; submitted in a fixed repeating
order, as a load balancer in front would see them.
"""

from __future__ import annotations

import json
import random
import time

from fairbatch.benchmarks.sim_cluster import ServiceWindow, SimCluster, Workload, pct, vtc_bound
from fairbatch.deployments.cluster.fairness import ControllerConfig, FairnessCore
from fairbatch.deployments.cluster.limits import LimitsSpec, TenantLimit
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies import TenantSpec

SYSTEMS = {
    "fairbatch": (dict(routing="fair", policy="weighted_fair"), "weighted_fair"),
    # the same, every admission and report also through cluster-wide limits (quotas and
    # bounds too high to refuse): what enforcing them costs the controller
    "fairbatch_limits": (
        dict(routing="fair", policy="weighted_fair", quotas=True),
        "weighted_fair",
    ),
    # the same, with the controller's usage ledger: every admission opened, every end noted from
    # reports, every ingress record written to a log file, a sweep each virtual second
    "fairbatch_usage": (
        dict(routing="fair", policy="weighted_fair", usage=True),
        "weighted_fair",
    ),
    "rr_local_wfq": (dict(routing="round_robin", policy="weighted_fair"), "weighted_fair"),
    "p2c_fcfs": (dict(routing="power_of_two", policy="fcfs"), "fcfs"),
}


def run_one(num_replicas: int, system: str, wl: Workload) -> dict:
    ctrl_kw, local_policy = SYSTEMS[system]
    specs = [TenantSpec(name, weight=w) for name, w, _, _ in wl.tenants]
    ctrl_kw = dict(ctrl_kw)
    if ctrl_kw.pop("quotas", False):
        unlimited = TenantLimit(tokens_per_minute=1e15)
        ctrl_kw["limits"] = LimitsSpec({s.name: unlimited for s in specs}, 10**9, 10**9)
    ledger = usage_ledger() if ctrl_kw.pop("usage", False) else None
    core = FairnessCore(ControllerConfig(tenants=specs, **ctrl_kw), rng=random.Random(wl.seed))
    sim = SimCluster(core, wl)
    for i in range(num_replicas):
        sim.add(f"r{i}", local_policy, specs)
    shape = {name: (p, m) for name, _, p, m in wl.tenants}
    weights = {name: w for name, w, _, _ in wl.tenants}
    rng = random.Random(wl.seed)
    ctrl_time = 0.0
    admit_lat: list[float] = []
    queue_wait: list[float] = []
    submitted_at: dict[str, float] = {}
    tenant_of: dict[str, str] = {}
    out_len: dict[str, int] = {}
    ids = iter(range(1 << 62))

    def control(call, *args) -> None:
        """A controller call, timed, and its actions carried out."""
        nonlocal ctrl_time
        t0 = time.perf_counter()
        actions = call(*args)
        dt = time.perf_counter() - t0
        ctrl_time += dt
        for t in sim.apply(actions):
            admit_lat.append(dt)
            queue_wait.append(sim.now - submitted_at.pop(t.request_id))

    def submit(tenant: str) -> None:
        rid = f"q{next(ids)}"
        p, m = shape[tenant]
        prompt = [rng.randrange(1, 32000) for _ in range(p)]
        meta = RequestMeta(rid, prompt, SamplingParams(max_tokens=m, ignore_eos=True), tenant)
        submitted_at[rid] = sim.now
        tenant_of[rid] = tenant
        control(core.submit, meta)
        if ledger is not None:
            timed(ledger.submitted, meta)

    def timed(call, *args) -> None:
        """A call the controller makes besides FairnessCore's, in its time."""
        nonlocal ctrl_time
        t0 = time.perf_counter()
        call(*args)
        ctrl_time += time.perf_counter() - t0

    for r in sim.replicas.values():  # every replica registers before the first request
        core.report(r.report())
    seats = num_replicas * wl.max_num_seqs
    slots = num_replicas * (wl.max_num_seqs + ControllerConfig().local_queue)
    per_tenant = int(wl.outstanding_per_slot * slots) + 1
    order = [name for name, *_ in wl.tenants for _ in range(per_tenant)]
    # interleave: t1, t2, ..., t1, t2, ... (a fixed repeating arrival order)
    order = sorted(order, key=lambda n: [x[0] for x in wl.tenants].index(n))
    order = [order[j * per_tenant + i] for i in range(per_tenant) for j in range(len(wl.tenants))]
    for name in order:
        submit(name)

    window = ServiceWindow(weights, min(wl.warmup_s, wl.duration_s / 2))
    swept = 0.0
    while (r := sim.next_replica()) is not None and sim.now <= wl.duration_s:
        if (rep := sim.due_report(r)) is not None:
            if ledger is not None:
                timed(note_ends, ledger, rep)
            control(core.report, rep)
            window.sample(sim.now, sim.replicas)
        records = []
        for d in sim.step(r):
            out_len[d.request_id] = out_len.get(d.request_id, 0) + len(d.token_ids)
            if d.finished:
                n_out = out_len.pop(d.request_id, 0)
                r.finished.append((d.request_id, n_out))
                tenant = tenant_of.pop(d.request_id)
                records.append(usage_record(d.request_id, tenant, n_out, sim.now))
                submit(tenant)
        if ledger is not None and records:  # their ingress's records, in one call
            timed(ledger.record, records)
        if ledger is not None and sim.now - swept >= 1.0:
            swept = sim.now
            timed(ledger.sweep, core.tickets)
    norm, jain = window.result(sim.replicas)
    max_prompt = max(p for _, _, p, _ in wl.tenants)
    max_len = max(p + m for _, _, p, m in wl.tenants)
    admissions = len(admit_lat)
    return {
        "replicas": num_replicas,
        "system": system,
        "admissions": admissions,
        "admissions_per_s": admissions / ctrl_time if ctrl_time else 0.0,
        "admit_latency_ms_p50": 1e3 * pct(admit_lat, 50),
        "admit_latency_ms_p99": 1e3 * pct(admit_lat, 99),
        "queue_wait_s_p50": pct(queue_wait, 50),
        "queue_wait_s_p99": pct(queue_wait, 99),
        "jain_index": jain,
        "max_service_diff": window.max_diff,
        "vtc_bound": vtc_bound(max_prompt, max_len, seats),
        "weighted_service": {n: round(x, 1) for n, x in zip(weights, norm)},
        "virtual_s": wl.duration_s,
    }


def usage_ledger():
    """A usage ledger writing to a fresh file (the controller's, usage_ledger.py)."""
    import tempfile

    from fairbatch.deployments.cluster.usage_ledger import UsageLedger
    from fairbatch.deployments.usage import UsageSpec

    path = tempfile.mkdtemp(prefix="fbusage-") + "/usage.jsonl"
    return UsageLedger(UsageSpec(path), "bench")


def note_ends(ledger, rep) -> None:
    for rid, num_out in rep.finished:
        ledger.left_replica(rid, rep.replica_id, num_out)


def usage_record(rid: str, tenant: str, num_out: int, now: float) -> tuple[str, str]:
    """As an ingress sends it: (request id, JSON line), encoded there."""
    from fairbatch.deployments.usage import UsageRecord

    r = UsageRecord(rid, rid, tenant, "bench", 0, 0, num_out, 0, "length", now, now, now)
    return rid, r.to_json()


def ray_admissions(num_replicas: int = 4, sizes: tuple[int, ...] = (1000, 4000)) -> list[dict]:
    """The same controller as a Ray actor: admissions/s through batches (`submit_many` + the
    `assignments` stream), with sim replicas that have room for every request. The controller
    submits each to its replica before answering, as for any client; no stream is read."""
    import asyncio
    import os
    import tempfile

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    from fairbatch.deployments.cluster.admission import AdmissionBatcher
    from fairbatch.deployments.cluster.launch import start_cluster
    from fairbatch.deployments.cluster.replica import ReplicaConfig

    tmp = tempfile.mkdtemp(prefix="fbbench-")
    ray.init(
        num_cpus=2,
        num_gpus=num_replicas,
        include_dashboard=False,
        _temp_dir=tmp,
        log_to_driver=False,
        configure_logging=False,
    )
    rows = []
    try:
        # room for every request of every run (each runs its one token for a consumer nobody
        # reads): admission never waits for a slot
        seats = 2 * sum(sizes) + num_replicas
        cfg = ReplicaConfig("sim", max_num_seqs=seats // num_replicas, num_gpu_blocks=4096)
        cluster = start_cluster("bench", [cfg] * num_replicas)
        params = SamplingParams(max_tokens=1, ignore_eos=True)

        async def run(n: int) -> dict:
            metas = [
                RequestMeta(f"{n}-{i}", [1] * 16, params, "ab"[i % 2], consumer=f"bench-{n}")
                for i in range(n)
            ]
            lat: list[float] = []
            batcher = AdmissionBatcher(lambda: cluster.controller)

            async def one(meta: RequestMeta) -> None:
                t0 = time.perf_counter()
                await batcher.admit(meta, 120.0, 120.0)
                lat.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(m) for m in metas))
            wall = time.perf_counter() - t0
            return {
                "replicas": num_replicas,
                "system": "fairbatch_ray_batched",
                "admissions": n,
                "admissions_per_s": n / wall,
                "admit_latency_ms_p50": 1e3 * pct(lat, 50),
                "admit_latency_ms_p99": 1e3 * pct(lat, 99),
                "note": f"{n} requests submitted at once; latency includes waiting behind them",
            }

        for n in sizes:
            rows.append(asyncio.run(run(n)))
            r = rows[-1]
            print(
                f"ray N={num_replicas} {r['system']:22s} n={n:5d} "
                f"adm/s={r['admissions_per_s']:7.0f} p50={r['admit_latency_ms_p50']:.1f}ms "
                f"p99={r['admit_latency_ms_p99']:.1f}ms",
                flush=True,
            )
        cluster.shutdown()
    finally:
        ray.shutdown()
    return rows


def main(
    json_path: str | None,
    replicas: list[int] = (4, 16, 64),
    systems: list[str] | None = None,
    duration_s: float = 12.0,
    with_ray: bool = False,
) -> list[dict]:
    rows = []
    for n in replicas:
        for system in systems or list(SYSTEMS):
            t0 = time.perf_counter()
            row = run_one(n, system, Workload(duration_s=duration_s))
            row["wall_s"] = round(time.perf_counter() - t0, 2)
            rows.append(row)
            print(
                f"N={n:3d} {system:13s} adm/s={row['admissions_per_s']:9.0f} "
                f"p50={row['admit_latency_ms_p50']:.3f}ms p99={row['admit_latency_ms_p99']:.3f}ms "
                f"jain={row['jain_index']:.4f} diff={row['max_service_diff']:.0f} "
                f"bound={row['vtc_bound']:.0f} wall={row['wall_s']}s",
                flush=True,
            )
    if with_ray:
        rows.extend(ray_admissions())
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main(None, replicas=[4], duration_s=6.0)
