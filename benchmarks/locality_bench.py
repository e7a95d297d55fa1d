"""`fairbatch bench cluster --workload shared_prefix`: locality-aware fairness on sim replicas.

Four tenants (weights 1, 1, 2, 4) each reuse their own long system prompts (several per
tenant, more than a replica's cache holds) with a short unique question, closed loop, all
backlogged; tenants pick their prompts with different skews (the hot one reuses one prompt
most of the time). On the simulated cluster of sim_cluster.py, as cluster_bench.py (the
controller is the real `FairnessCore`; replicas are EngineCores on the simulated runner).

Systems (global policy / routing, the replicas' local policy the same as the global one):
fcfs, weighted_fair, lpm, dlpm with "fair" routing (least loaded + prefix affinity);
prefix_affinity (weighted fair, every request routed at once to the longest cached prefix);
d2lpm (dlpm over the cluster, d2lpm routing). Per system: output tok/s (virtual), prefix-hit
rate (prompt tokens served from cache), per-tenant TTFT p50/p99, Jain over service / weight,
max weighted service difference after the warm-up and, for the fair policies, its bound.

Closed loop (the default) keeps every tenant backlogged: it measures throughput and whether the
bound holds, but the cluster is saturated, so a request leaves the global queue the moment one
replica frees a slot and the routing never has a choice. The open loop (`load`): Poisson
arrivals, each tenant at a rate proportional to its weight, `load` x the capacity measured as
weighted_fair's closed-loop throughput, for TTFT when replicas have room to choose from (the
workload "shared_prefix_open"). There tenants are not backlogged throughout, so the service
difference is reported but the bound does not apply.

The popularity shift (`shift_s`, workload "..._shift"): at that time each tenant's hot share
moves from its first system prompt to its second, one that was cold until then. Stationary
popularity flatters locality-first routing here: before the first replica reports its cache the
controller knows no prefix, so the opening burst spreads the hot prompts over many replicas
(t4's: 9 of 16), and prefix affinity then balances among those holders. Real prefix popularity
moves (a tenant ships a new prompt version, one of its agents or documents starts trending), and
a prompt that was cold sits on one or two replicas. From the shift on, the hot tenant t4 (half
the traffic, 0.8 of it on one prompt) sends that prompt a few times what one replica can serve
while the cluster as a whole has room, and prefix affinity piles it all onto that prompt's
holders: the trade-off D2LPM is for (Cao et al., arXiv:2501.14312, balance fairness, locality
and load across workers, and report up to 7.18x lower per-client latency than a state-of-the-art
distributed serving system). `peak_replica_waiting`, the longest local queue seen, shows the
overload.
"""

from __future__ import annotations

import json
import random
import time

from fairbatch.benchmarks.sim_cluster import ServiceWindow, SimCluster, Workload, pct, vtc_bound
from fairbatch.deployments.cluster.fairness import ControllerConfig, FairnessCore
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.kv.block_pool import hash_block
from fairbatch.policies import TenantSpec
from fairbatch.policies.dlpm import DEFAULT_QUANTUM, service_diff_bound

SYSTEMS = {  # name -> (controller settings, local policy)
    "fcfs": (dict(routing="fair", policy="fcfs"), "fcfs"),
    "weighted_fair": (dict(routing="fair", policy="weighted_fair"), "weighted_fair"),
    "lpm": (dict(routing="fair", policy="lpm"), "lpm"),
    "dlpm": (dict(routing="fair", policy="dlpm"), "dlpm"),
    "prefix_affinity": (dict(routing="prefix_affinity", policy="weighted_fair"), "weighted_fair"),
    "d2lpm": (dict(routing="d2lpm", policy="dlpm"), "dlpm"),
}
# name, weight, system prompts, the share of requests going to its first (hot) prompt
TENANTS = (("t1", 1.0, 6, 0.2), ("t2", 1.0, 6, 0.5), ("t3", 2.0, 6, 0.3), ("t4", 4.0, 6, 0.8))
PROMPT, QUESTION, OUT = 1024, 32, 32  # system prompt, unique question, output tokens
AFFINITY_BLOCKS = 64


def workload(duration_s: float) -> Workload:
    # 512 blocks of 16 per replica: about 7 of the 24 system prompts fit
    return Workload(
        tenants=tuple((n, w, PROMPT + QUESTION, OUT) for n, w, _, _ in TENANTS),
        duration_s=duration_s,
        warmup_s=min(2.0, duration_s / 3),
        num_gpu_blocks=512,
        outstanding_per_slot=1.25,
    )


def poisson_arrivals(rate: float, until_s: float, seed: int = 0) -> list[tuple[float, str]]:
    """(time, tenant) arrivals up to `until_s`: `rate` requests/s in all, each tenant an
    independent Poisson process at rate x its weight share."""
    total = sum(w for _, w, _, _ in TENANTS)
    out = []
    for name, w, _, _ in TENANTS:
        rng, t = random.Random(f"{seed}:{name}"), 0.0
        while (t := t + rng.expovariate(rate * w / total)) <= until_s:
            out.append((t, name))
    return sorted(out)


def pick_prompt(rng: random.Random, hot_share: float, num_prompts: int, shifted: bool) -> int:
    """Which of its system prompts a tenant's request uses: the hot one (the first, or after
    the shift the second) with probability `hot_share`, else one at random."""
    if rng.random() < hot_share:
        return 1 if shifted else 0
    return rng.randrange(num_prompts)


def run_one(
    num_replicas: int,
    system: str,
    duration_s: float,
    seed: int = 0,
    rate: float | None = None,
    shift_s: float | None = None,
) -> dict:
    """One system; `rate` (requests/s) makes it open loop, else closed loop. From `shift_s`
    (virtual seconds) on, each tenant's hot share goes to its second prompt instead of its
    first (the popularity shift of the module doc)."""
    wl = workload(duration_s)
    ctrl_kw, local = SYSTEMS[system]
    specs = [TenantSpec(n, weight=w) for n, w, _, _ in TENANTS]
    core = FairnessCore(ControllerConfig(tenants=specs, **ctrl_kw), rng=random.Random(seed))
    sim = SimCluster(core, wl)
    for i in range(num_replicas):
        sim.add(f"r{i}", local, specs)
    rng = random.Random(seed)
    prompts = {
        n: [[rng.randrange(1, 32000) for _ in range(PROMPT)] for _ in range(k)]
        for n, _, k, _ in TENANTS
    }
    hot = {n: h for n, _, _, h in TENANTS}
    weights = {n: w for n, w, _, _ in TENANTS}
    submitted: dict[str, float] = {}
    tenant_of: dict[str, str] = {}
    ttft: dict[str, list[float]] = {n: [] for n in weights}
    out_tokens = 0
    prompt_tokens = 0
    ids = iter(range(1 << 62))

    def apply(actions: list) -> None:
        nonlocal prompt_tokens
        for t in sim.apply(actions):  # salted by its tenant (meta)
            prompt_tokens += len(t.meta.prompt_ids)

    def submit(tenant: str) -> None:
        rid = f"q{next(ids)}"
        shifted = shift_s is not None and sim.now >= shift_s
        pick = pick_prompt(rng, hot[tenant], len(prompts[tenant]), shifted)
        prompt = prompts[tenant][pick] + [rng.randrange(1, 32000) for _ in range(QUESTION)]
        hashes, parent = [], None
        for i in range(min(len(prompt) // wl.block_size, AFFINITY_BLOCKS)):
            parent = hash_block(parent, prompt[i * 16 : (i + 1) * 16], tenant)
            hashes.append(parent)
        params = SamplingParams(max_tokens=OUT, ignore_eos=True)
        meta = RequestMeta(rid, prompt, params, tenant, cache_salt=tenant, prefix_hashes=hashes)
        submitted[rid], tenant_of[rid] = sim.now, tenant
        apply(core.submit(meta))

    replicas = sim.replicas
    for r in replicas.values():
        core.report(r.report())
    slots = num_replicas * (wl.max_num_seqs + ControllerConfig().local_queue)
    arrivals = [] if rate is None else poisson_arrivals(rate, duration_s, seed)
    if rate is None:
        for _ in range(int(wl.outstanding_per_slot * slots) + 1):
            for n in weights:
                submit(n)
    next_arrival = 0
    window = ServiceWindow(weights, wl.warmup_s)
    start_hits, start_out, start_prompt = 0, 0, 0
    reports, peak_waiting = 0, 0
    wall0 = time.perf_counter()
    while True:
        if next_arrival < len(arrivals) and arrivals[next_arrival][0] <= sim.next_time():
            sim.now, tenant = arrivals[next_arrival]
            next_arrival += 1
            submit(tenant)
            continue
        r = sim.next_replica()
        if r is None or sim.now > duration_s:
            break
        if (rep := sim.due_report(r)) is not None:
            reports += 1
            peak_waiting = max(peak_waiting, rep.num_waiting)
            if reports % 5 == 1:  # the cached hashes, now and then (as replicas do)
                rep.prefix_hashes = list(r.core.scheduler.kv.gpu_pool.cached)[-4096:]
            apply(core.report(rep))
            if window.sample(sim.now, replicas):
                start_out, start_prompt = out_tokens, prompt_tokens
                start_hits = sum(x.core.scheduler.num_prefix_hit_tokens for x in replicas.values())
        for d in sim.step(r):
            out_tokens += len(d.token_ids)
            rid = d.request_id
            if rid in submitted and d.token_ids:
                ttft[tenant_of[rid]].append(sim.now - submitted.pop(rid))
            if d.finished:
                r.finished.append((rid, OUT))
                tenant = tenant_of.pop(rid)
                if rate is None:
                    submit(tenant)
    _, jain = window.result(replicas)
    hits = sum(x.core.scheduler.num_prefix_hit_tokens for x in replicas.values()) - start_hits
    window_s = duration_s - wl.warmup_s
    # bounds on |service_i/w_i - service_j/w_j| over the window: VTC's (cluster_bench.py) for
    # weighted_fair, 2B of policies/dlpm.py for dlpm (S: the cluster's slots)
    seats = num_replicas * wl.max_num_seqs
    bound = {
        "weighted_fair": vtc_bound(PROMPT + QUESTION, PROMPT + QUESTION + OUT, seats),
        "dlpm": service_diff_bound(
            DEFAULT_QUANTUM, slots, PROMPT + QUESTION, OUT, min(weights.values())
        ),
    }.get(ctrl_kw["policy"])
    return {
        "system": system,
        "workload": ("shared_prefix" if rate is None else "shared_prefix_open")
        + ("" if shift_s is None else "_shift"),
        "replicas": num_replicas,
        "throughput_tok_s": (out_tokens - start_out) / window_s,
        "prefix_hit_rate": hits / max(1, prompt_tokens - start_prompt),
        "ttft_s": {
            n: {"p50": round(pct(v, 50), 3), "p99": round(pct(v, 99), 3)} for n, v in ttft.items()
        },
        "worst_ttft_p99_s": max(pct(v, 99) for v in ttft.values()),
        "jain": jain,
        "max_service_diff": window.max_diff,
        "bound": bound,
        "peak_replica_waiting": peak_waiting,  # the longest local queue seen (overload)
        "rate_rps": rate,
        "shift_s": shift_s,
        "virtual_s": duration_s,
        "wall_s": round(time.perf_counter() - wall0, 1),
    }


def main(
    json_path: str | None,
    replicas=(16,),
    systems=None,
    duration_s: float = 6.0,
    load: float | None = None,
    shift_s: float | None = None,
) -> list:
    """Closed loop, or with `load` open loop at load x weighted_fair's closed-loop request
    throughput (measured first, on the same cluster size, without a shift, and reported as a
    row); `shift_s`: the hot prompts change then (`run_one`)."""
    rows = []
    for n in replicas:
        rate = None
        if load is not None:
            cap = run_one(n, "weighted_fair", duration_s)
            rows.append(_printed(cap))
            rate = load * cap["throughput_tok_s"] / OUT
        for system in systems or list(SYSTEMS):
            rows.append(_printed(run_one(n, system, duration_s, rate=rate, shift_s=shift_s)))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)
        plot_ttft(rows, json_path.removesuffix(".json") + "_ttft_p99.png")
    return rows


def plot_ttft(rows: list[dict], path: str) -> str:
    """Per-tenant TTFT p99 per system (log scale), for the rows of the last cluster size and
    workload (not the closed-loop capacity row an open-loop run starts with)."""
    from pathlib import Path

    from fairbatch.benchmarks.serve_plots import grouped_bars

    last = rows[-1]
    key = (last["workload"], last["replicas"])
    rows = [r for r in rows if (r["workload"], r["replicas"]) == key]
    load = "closed loop" if last["rate_rps"] is None else f"{last['rate_rps']:.0f} req/s"
    shift = "" if last["shift_s"] is None else f", hot prompts shift at {last['shift_s']:g} s"
    return grouped_bars(
        [r["system"] for r in rows],
        {n: [r["ttft_s"][n]["p99"] for r in rows] for n, *_ in TENANTS},
        Path(path),
        title=f"TTFT p99 per tenant, N={last['replicas']}, {load}{shift}",
        ylabel="seconds (log)",
        log=True,
    )


def _printed(row: dict) -> dict:
    rate = "" if row["rate_rps"] is None else f" rate={row['rate_rps']:.1f}/s"
    if row["shift_s"] is not None:
        rate += f" shift@{row['shift_s']:g}s"
    print(
        f"N={row['replicas']} {row['system']:15s}{rate} tok/s={row['throughput_tok_s']:8.0f} "
        f"hit={row['prefix_hit_rate']:.3f} worst_p99={row['worst_ttft_p99_s']:.2f}s "
        f"jain={row['jain']:.3f} diff={row['max_service_diff']:.0f} "
        f"bound={row['bound']} peak_queue={row['peak_replica_waiting']} wall={row['wall_s']}s",
        flush=True,
    )
    return row
