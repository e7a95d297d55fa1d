"""The ServeGen replay on simulated GPU replicas: real tenants' arrivals across a cluster.

`fairbatch bench serve --workload servegen --sim-replicas 4,8,16` replays the same tenants as the
served replay (replay_bench.py) at their real request rates (`--sim-rate-scale`, default 1), on
the simulated cluster of sim_cluster.py: replicas are EngineCores on the roofline runner
(Llama-3-8B on an H100, virtual time), under the very `FairnessCore` the controller actor wraps.
Nothing is paced: a minute of the trace takes as long as the simulation does.

Systems:
  * `fairbatch`: the global weighted-fair queue, least-loaded placement, fair preemption;
  * `fairbatch-nofp`: the same, fair preemption off;
  * `p2c_fcfs`: what a load balancer in front of independent FCFS servers (vLLM's default)
    does: power-of-two-choices routing, each replica first come, first served.

Each request's TTFT, TPOT and service are read off virtual time, into the same per-tenant report
as a served run (tenant_slo.py); a tenant's idle latency, which its SLO is a multiple of, is its
median prompt alone on an idle simulated replica.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
from typing import Any

from fairbatch.benchmarks import servegen as sg
from fairbatch.benchmarks import tenant_slo
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec
from fairbatch.benchmarks.sim_cluster import SimCluster, SimReplica, Workload
from fairbatch.deployments.cluster.fairness import ControllerConfig, FairnessCore
from fairbatch.deployments.cluster.replica_config import ReplicaConfig
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies import TenantSpec

SYSTEMS: dict[str, tuple[dict[str, Any], str]] = {
    "fairbatch": (dict(routing="fair", policy="weighted_fair"), "weighted_fair"),
    "fairbatch-nofp": (
        dict(routing="fair", policy="weighted_fair", fair_preemption=False),
        "weighted_fair",
    ),
    "p2c_fcfs": (dict(routing="power_of_two", policy="fcfs"), "fcfs"),
}
SEATS = 64  # per replica
BUDGET = ReplicaConfig.max_num_batched_tokens  # a step's tokens: a served replica's default
DRAIN_S = 60.0  # virtual seconds after the last arrival before what still runs is cut off
VOCAB = 32000


@dataclasses.dataclass
class SimRun:
    results: list[RequestResult]  # one per spec
    preempted: dict[str, int]  # tenant -> its requests the controller preempted
    migrations: int  # requests moved between replicas


def simulate(
    specs: list[RequestSpec],
    tenants: list[str],
    system: str,
    num_replicas: int,
    seed: int = 0,
    seats: int = SEATS,
) -> SimRun:
    """Every spec through a simulated cluster of `num_replicas`."""
    ctrl_kw, local_policy = SYSTEMS[system]
    wl = Workload(max_num_seqs=seats, max_num_batched_tokens=BUDGET, num_gpu_blocks=8192, seed=seed)
    specs_t = [TenantSpec(t) for t in tenants]
    core = FairnessCore(ControllerConfig(tenants=specs_t, **ctrl_kw), rng=random.Random(seed))
    sim = SimCluster(core, wl)
    for i in range(num_replicas):
        sim.add(f"r{i}", local_policy, specs_t)
    for r in sim.replicas.values():
        core.report(r.report())
    results = {f"q{s.index}": RequestResult(s, send_s=s.arrival_s) for s in specs}
    rng = random.Random(seed)

    def submit(spec: RequestSpec) -> None:
        prompt = [rng.randrange(4, VOCAB) for _ in range(spec.prompt_len)]
        params = SamplingParams(max_tokens=spec.max_tokens, ignore_eos=True)
        sim.apply(core.submit(RequestMeta(f"q{spec.index}", prompt, params, spec.tenant)))

    pending = sorted(specs, key=lambda s: s.arrival_s)
    k, end = 0, (pending[-1].arrival_s if pending else 0.0) + DRAIN_S
    while True:
        t_next = sim.next_time()
        if k < len(pending) and pending[k].arrival_s <= t_next:
            sim.now = pending[k].arrival_s
            submit(pending[k])
            k += 1
            continue
        r = sim.next_replica()
        if r is None or sim.now > end:
            break
        if (rep := sim.due_report(r)) is not None:
            sim.apply(core.report(rep))
        idle = k >= len(pending) and not any(x.core.has_unfinished() for x in sim.replicas.values())
        if idle:
            break
        for d in sim.step(r):
            res = results[d.request_id]
            now = r.runner.clock
            if d.token_ids:
                if res.first_token_s is None:
                    res.first_token_s = now
                res.chunk_times_s.append(now)
            if d.finished:
                res.ok, res.status, res.end_s = True, 200, now
                res.finish_reason = d.finish_reason or ""
                res.prompt_tokens = res.spec.prompt_len
                res.completion_tokens = len(res.chunk_times_s)
                r.finished.append((d.request_id, len(res.chunk_times_s)))
    for res in results.values():
        if not res.ok:
            res.end_s, res.error = max(sim.now, res.send_s), "cut off"
    return SimRun(list(results.values()), sim.preempted, sim.migrations)


def idle_latency(prompt_len: int) -> dict[str, float]:
    """TTFT and TPOT of one request (`prompt_len` tokens, 8 out) alone on a fresh replica."""
    rep = SimReplica(
        "idle",
        Workload(max_num_seqs=SEATS, max_num_batched_tokens=BUDGET, num_gpu_blocks=8192),
        "fcfs",
        [],
    )
    rep.core.add_request(
        list(range(4, 4 + prompt_len)), SamplingParams(max_tokens=8, ignore_eos=True)
    )
    times = []
    while rep.core.has_unfinished():
        if any(d.token_ids for d in rep.core.step()):
            times.append(rep.runner.clock)
    return {"ttft_s": times[0], "tpot_s": (times[-1] - times[0]) / (len(times) - 1)}


def run(
    mix: Any, sizes: list[int], rate_scale: float, slo_factor: float, systems=tuple(SYSTEMS)
) -> dict:
    """The replay at `rate_scale` x the trace's rates on each cluster size and system."""
    replay = dataclasses.replace(mix.replay, rate_scale=rate_scale)
    specs = sg.build_replay(mix.clients, replay, with_text=False)
    slos = {}
    idle = {}
    for t in mix.tenants:
        lens = sorted(s.prompt_len for s in specs if s.tenant == t) or [64]
        idle[t] = idle_latency(lens[len(lens) // 2])
        slos[t] = tenant_slo.Slo(slo_factor * idle[t]["ttft_s"], slo_factor * idle[t]["tpot_s"])
    out: dict[str, Any] = {
        "requests": len(specs),
        "rate_scale": rate_scale,
        "offered_cost_per_s": sg.offered_cost_per_s(mix.clients, replay),
        "idle": idle,
        "runs": {},
    }
    for n in sizes:
        for system in systems:
            sim = simulate(specs, mix.tenants, system, n)
            results = sim.results
            rep = tenant_slo.tenant_slos(results, slos, replay.duration_s)
            for t, x in rep["tenants"].items():
                x["preempted"] = sim.preempted.get(t, 0)
            rep["preempted"], rep["migrations"] = sum(sim.preempted.values()), sim.migrations
            served = [r for r in results if r.ok]
            rep["completed"] = len(served)
            rep["cut_off"] = len(results) - len(served)
            rep["ttft_p50_s"] = statistics.median(r.ttft_s for r in served) if served else None
            out["runs"][f"{n}:{system}"] = rep
            print(f"  {n} replicas, {system}: {rep['attainment']:.3f} in SLO", flush=True)
    return out


def format_table(result: dict, mix: Any) -> str:
    from fairbatch.benchmarks.serve_report import table

    heavy = set(mix.heavy)
    runs = result["runs"]
    head = ["replicas", "system", "SLO %", "goodput req/s", "cut off", "preempted"]
    head += ["Jain (backlogged)"]
    head += [f"{t} TTFT p99 s" for t in mix.tenants]
    rows = []
    for key, rep in runs.items():
        n, system = key.split(":")
        row = [n, system, f"{100 * rep['attainment']:.1f}", f"{rep['goodput_rps']:.1f}"]
        row += [
            rep["cut_off"],
            rep.get("preempted", "-"),
            "-" if rep["jain_backlogged"] is None else f"{rep['jain_backlogged']:.3f}",
        ]
        for t in mix.tenants:
            p99 = rep["tenants"].get(t, {}).get("ttft_p99_s")
            row.append("-" if p99 is None else f"{p99:.2f}")
        rows.append(row)
    note = "heavy: " + ", ".join(t for t in mix.tenants if t in heavy)
    return table(head, rows) + "\n" + note
