"""The cluster on three simulated-runner replicas: fairness, priority, migration, recovery.

Sim replicas are paced (`time_scale=1`: a step sleeps as long as the modelled H100 would take,
~7 ms for Llama-3-8B decode), so they behave like GPUs with real step times. The sim's tokens are
a pure function of the history (`sim_tokens`), so every stream is checked token for token: no
gap, no repeat, after preemption, migration, a replica's death or the controller's.

Order matters: the last two tests kill replicas of the shared cluster.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from live_actors import migrate

from fairbatch.deployments.cluster.client import ClusterClient, collect
from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.launch import start_cluster
from fairbatch.deployments.cluster.replica import ReplicaConfig
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies import TenantSpec

TENANTS = [TenantSpec("a", weight=3.0), TenantSpec("b", weight=1.0), TenantSpec("c")]
SEATS = 4
CLUSTERS: list = []
NUM_GPUS = 8


def sim_config(policy: str = "priority", **kw) -> ReplicaConfig:
    base = dict(
        engine="sim",
        num_gpu_blocks=256,
        num_cpu_blocks=256,
        max_num_seqs=SEATS,
        max_num_batched_tokens=256,
        policy=policy,
        tenants=TENANTS,
        time_scale=1.0,
    )
    base.update(kw)
    return ReplicaConfig(**base)


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = start_cluster("sim", [sim_config() for _ in range(3)], ControllerConfig(tenants=TENANTS))
    CLUSTERS.append(c)
    return c


def wait_until(probe, done, timeout_s: float, what: str, every: float = 0.1):
    """Poll `state = probe()` until `done(state)` and return that state; after `timeout_s`,
    AssertionError naming `what` and the last state. Every wait for a state is this (or
    `until`), never a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while not done(state := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {state!r}")
        time.sleep(every)
    return state


async def until(probe, done, timeout_s: float, what: str, every: float = 0.02):
    """`wait_until` in a coroutine: `probe` runs in a thread (so blocking Ray calls leave the
    streams on this loop flowing)."""
    deadline = time.monotonic() + timeout_s
    while not done(state := await asyncio.to_thread(probe)):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}: {state!r}")
        await asyncio.sleep(every)
    return state


def replica_stats(c) -> list[dict]:
    return ray.get([h.stats.remote() for h in c.replicas.values()], timeout=30)


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt(i: int, n: int = 16) -> list[int]:
    return [(i * 7 + j) % 997 + 1 for j in range(n)]


def cluster_service(c) -> dict[str, float]:
    total: dict[str, float] = {}
    for stats in ray.get([h.stats.remote() for h in c.replicas.values()], timeout=30):
        for tenant, value in stats["service"].items():
            total[tenant] = total.get(tenant, 0.0) + value
    return total


def max_tokens(i: int) -> int:
    return 16 + (i * 13) % 33  # 16..48, varied so that requests do not finish in waves


WARMUP, TARGET = 2000.0, 18000.0  # weighted tokens, cluster-wide


async def measure_fairness(c) -> dict:
    """Backlog tenants a (weight 3) and b (weight 1), submitted at once in the repeating order
    a, a, b, and sample the cluster-wide weighted service from WARMUP to TARGET (the start,
    before the queues fill, is no contention and not fairness). The client's one admission
    queue sends them to the controller in that order, so a baseline router (no global queue)
    sees exactly a, a, b, ..."""
    client = ClusterClient(c.controller, item_timeout_s=60, admit_timeout_s=120)
    order = ["a", "a", "b"] * 140
    tasks = [
        asyncio.create_task(collect(client, prompt(i), params(max_tokens(i)), tenant=t))
        for i, t in enumerate(order)
    ]
    max_diff = 0.0
    start = None
    deadline = time.monotonic() + 120
    while True:
        await asyncio.sleep(0.1)  # the sampling period of the measurement, not a wait for state
        svc = await asyncio.to_thread(cluster_service, c)
        a, b = svc.get("a", 0.0), svc.get("b", 0.0)
        if start is None:
            if a + b >= WARMUP:
                start = (a, b)
            continue
        a, b = a - start[0], b - start[1]
        max_diff = max(max_diff, abs(a / 3.0 - b / 1.0))
        if a + b >= TARGET - WARMUP:
            break
        assert time.monotonic() < deadline, f"service stalled at {svc}"
    unfinished = {
        x: sum(1 for i, t in enumerate(tasks) if order[i] == x and not t.done()) for x in "ab"
    }
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {"a": a, "b": b, "max_diff": max_diff, "unfinished": unfinished}


def test_cluster_fairness_3_to_1_and_baseline_worse(cluster, replica_check):
    fair = asyncio.run(measure_fairness(cluster))
    assert min(fair["unfinished"].values()) > 3  # both still backlogged when measured
    ratio = fair["a"] / fair["b"]
    assert abs(ratio / 3.0 - 1.0) < 0.05, fair
    # VTC bound (Sheng et al. OSDI'24, Thm 4.3) with the cluster as one server: 2 * max(
    # input_weight * max prompt, output_weight * M), M = tokens the cluster can hold in its
    # running batches (3 replicas x 4 seats x (16 prompt + 48 output) tokens).
    bound = 2 * max(1.0 * 16, 2.0 * 3 * SEATS * (16 + 48))
    assert fair["max_diff"] <= bound, fair

    # The baseline: per-replica weighted fair queues, tenant-blind round-robin routing. The
    # a, a, b arrival order aliases with 3 replicas, so replica 0 sees only b and the other two
    # only a: each replica is "fair" locally, and the cluster serves 2:1, not 3:1.
    base = start_cluster(
        "rr",
        [sim_config(policy="weighted_fair") for _ in range(3)],
        ControllerConfig(routing="round_robin", policy="weighted_fair", tenants=TENANTS),
    )
    CLUSTERS.append(base)
    rr = asyncio.run(measure_fairness(base))
    assert min(rr["unfinished"].values()) > 3
    base_err = abs(rr["a"] / rr["b"] / 3.0 - 1.0)
    print(f"fairbatch a:b = {ratio:.3f} {fair}; round robin a:b = {rr['a'] / rr['b']:.3f} {rr}")
    assert base_err > 0.10 and base_err > 2 * abs(ratio / 3.0 - 1.0), (fair, rr)
    replica_check([base])
    CLUSTERS.remove(base)
    base.shutdown()


async def fill_and_jump(c) -> tuple[dict, list[dict], dict]:
    client = ClusterClient(c.controller, item_timeout_s=60)
    low = [
        asyncio.create_task(collect(client, prompt(100 + i), params(120), tenant="c"))
        for i in range(3 * (SEATS + 2) + 3)
    ]
    await until(
        lambda: [s["running"] for s in replica_stats(c)],
        lambda running: running == [SEATS] * 3,
        60,
        "every seat of every replica to be busy with low-priority work (running per replica)",
    )
    # ... and the controller to know it from their reports (every seat's request seen
    # running), so that it has a running victim to preempt for the priority request. Run in
    # the controller actor (a lambda travels by value).
    await until(
        lambda: ray.get(
            c.controller.__ray_call__.remote(
                lambda ctrl: sum(
                    t.seen and t.running
                    for r in ctrl.core.replicas.values()
                    for t in r.assigned.values()
                )
            ),
            timeout=30,
        ),
        lambda seen_running: seen_running == 3 * SEATS,
        30,
        "the controller to see every seat taken (requests it knows are running)",
    )
    before = await asyncio.to_thread(
        lambda: {s["replica_id"]: s["num_steps"] for s in replica_stats(c)}
    )
    high = await collect(client, prompt(999), params(8), tenant="a", priority=5)
    lows = await asyncio.gather(*low)
    return high, lows, before


def set_time_scale(c, scale: float) -> None:
    """Pace the sim replicas' steps anew (a test's knob, set on the live actors)."""

    def pace(replica, s: float) -> None:
        replica.time_scale = s

    ray.get([h.__ray_call__.remote(pace, scale) for h in c.replicas.values()], timeout=30)


def test_priority_request_starts_within_a_few_steps(cluster, sim_expected):
    # Steps of ~20 ms (3x the modelled H100): "a few steps" then means a few steps of GPU
    # work, not a race against this shared 2-core box's scheduling of the control plane.
    set_time_scale(cluster, 3.0)
    try:
        high, lows, before = asyncio.run(fill_and_jump(cluster))
    finally:
        set_time_scale(cluster, 1.0)
    assert high["tokens"] == sim_expected(prompt(999), 8)
    first = high["items"][0]
    # steps of its replica from submission to the step that sampled its first token
    waited = first.step - (len(first.token_ids) - 1) - before[first.replica_id]
    assert waited <= 8, (waited, first)
    stats = ray.get(cluster.controller.stats.remote(), timeout=30)
    print(
        f"priority: first token after {waited} steps; controller {stats['preemptions']} "
        f"preemptions, {stats['migrations']} migrations"
    )
    assert stats["preemptions"] >= 1
    for i, r in enumerate(lows):  # the preempted ones resumed and finished exactly
        assert r["tokens"] == sim_expected(prompt(100 + i), 120)


def test_bad_request_ends_with_an_error_not_a_hang(cluster):
    client = ClusterClient(cluster.controller, item_timeout_s=30)
    r = asyncio.run(collect(client, prompt(1, n=2000), params(4)))  # over max_model_len
    assert r["finish_reason"] == "error" and "max_model_len" in (r["items"][-1].error or "")
    ok = asyncio.run(collect(client, prompt(2), params(4)))  # its slot was given back
    assert ok["finish_reason"] == "length"


async def migrate_midway(c, rid: str, tokens_before: int) -> tuple[dict, str | None]:
    client = ClusterClient(c.controller, item_timeout_s=60)
    seen: list[int] = []
    items = []
    dst = None
    async for item in client.generate(prompt(7), params(200), tenant="b", request_id=rid):
        items.append(item)
        seen.extend(item.token_ids)
        if dst is None and len(seen) >= tokens_before:
            dst = await migrate(c.controller, rid)
    replicas = list(dict.fromkeys(i.replica_id for i in items))
    return {"tokens": seen, "replicas": replicas, "items": items}, dst


def test_migration_moves_the_stream_exactly(cluster, sim_expected):
    """The move comes in the channel's message (its destination's handle and the ObjectRef of
    the request); the client adopts it there and reads on, with no gap and no repeat."""
    result, dst = asyncio.run(migrate_midway(cluster, "mig", 20))
    assert dst is not None
    assert result["tokens"] == sim_expected(prompt(7), 200)
    assert len(result["replicas"]) == 2 and result["replicas"][-1] == dst
    assert result["items"][-1].finish_reason == "length"


async def run_and_kill_controller(c) -> list[dict]:
    client = ClusterClient(c.controller, item_timeout_s=60, admit_timeout_s=120)
    n = 3 * (SEATS + 2) * 2  # twice what the replicas hold: half wait at the controller
    tasks = [
        asyncio.create_task(collect(client, prompt(300 + i), params(60), tenant="ab"[i % 2]))
        for i in range(n)
    ]
    # Kill it while it holds both kinds: requests queued at it and every seat running.
    await until(
        lambda: (
            ray.get(c.controller.stats.remote(), timeout=30)["queued"],
            [r["running"] for r in replica_stats(c)],
        ),
        lambda state: state[0] > 0 and state[1] == [SEATS] * 3,
        60,
        "requests queued at the controller while every replica seat runs (queued, running)",
    )
    assert not all(t.done() for t in tasks)
    ray.kill(c.controller, no_restart=False)  # Ray restarts it (max_restarts=-1)
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)


def test_controller_death_loses_nothing(cluster, sim_expected):
    before = ray.get(cluster.controller.stats.remote(), timeout=30)["incarnation"]
    results = asyncio.run(run_and_kill_controller(cluster))
    for i, r in enumerate(results):
        assert r["finish_reason"] == "length", (i, r["items"][-1])
        assert r["tokens"] == sim_expected(prompt(300 + i), 60)
    # the new incarnation rebuilt its replica table from reports and keeps admitting
    # (a replica's first report to it may still be on its way when the streams end: bounded wait)
    stats = wait_until(
        lambda: ray.get(cluster.controller.stats.remote(), timeout=30),
        lambda s: len(s["replicas"]) == 3,
        15,
        "all 3 replicas to report to the restarted controller",
    )
    assert stats["incarnation"] != before  # it really was restarted
    r = asyncio.run(collect(ClusterClient(cluster.controller), prompt(5), params(5)))
    assert r["tokens"] == sim_expected(prompt(5), 5)


async def run_and_kill_replica(c) -> tuple[list[dict], str]:
    client = ClusterClient(c.controller, item_timeout_s=60, admit_timeout_s=120)
    n = 3 * SEATS
    progress = [0] * n
    where = [""] * n  # the replica each request is streaming from
    victim_id = next(iter(c.replicas))

    async def one(i: int) -> dict:
        tokens, items = [], []
        async for item in client.generate(prompt(500 + i), params(80), tenant="ab"[i % 2]):
            tokens.extend(item.token_ids)
            items.append(item)
            progress[i] = len(tokens)
            where[i] = "" if item.finished else item.replica_id
        return {
            "tokens": tokens,
            "items": items,
            "replicas": list(dict.fromkeys(x.replica_id for x in items)),
        }

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await until(
        lambda: list(progress),
        lambda p: min(p) >= 8,
        60,
        "every request mid-generation (tokens so far per request)",
    )
    ray.kill(c.replicas[victim_id], no_restart=True)
    on_victim = [i for i in range(n) if where[i] == victim_id]  # mid-generation there
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    return results, victim_id, on_victim


def test_replica_death_requests_finish_elsewhere(cluster, sim_expected):
    results, victim, on_victim = asyncio.run(run_and_kill_replica(cluster))
    assert on_victim, "no request was mid-generation on the killed replica"
    for i in on_victim:
        replicas = results[i]["replicas"]
        assert replicas[0] == victim and len(replicas) == 2, replicas
    for i, r in enumerate(results):  # no gap, no repeat: exactly the undisturbed tokens
        assert r["tokens"] == sim_expected(prompt(500 + i), 80)
        assert r["items"][-1].finish_reason == "length"


def test_idle_dead_replica_is_dropped_by_the_watchdog(cluster, sim_expected):
    """A replica that dies holding nothing: no client notices, the controller's watchdog does
    (silent > 5 s, then a failed ping), and new requests go only to the living."""
    alive = ray.get(cluster.controller.stats.remote(), timeout=30)["replicas"]
    victim = alive[-1]
    ray.kill(cluster.replicas[victim], no_restart=True)
    wait_until(
        lambda: ray.get(cluster.controller.stats.remote(), timeout=30)["replicas"],
        lambda replicas: victim not in replicas,
        30,
        f"the watchdog to drop the dead replica {victim} (the controller's replicas)",
    )
    client = ClusterClient(cluster.controller, item_timeout_s=30)

    async def run() -> list[dict]:
        runs = (collect(client, prompt(700 + i), params(5)) for i in range(6))
        return await asyncio.gather(*runs)

    for i, r in enumerate(asyncio.run(run())):
        assert r["tokens"] == sim_expected(prompt(700 + i), 5)
        assert r["replicas"] and victim not in r["replicas"]
