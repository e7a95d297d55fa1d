"""Dead replicas are replaced (issue 4): the supervisor's logic with a fake launcher (no Ray),
then a plain cluster and a Serve-path cluster (`ensure_cluster`, no Serve app) of paced sim
replicas on one Ray.

A replica killed under load: its requests finish elsewhere exactly, the controller starts a
replacement (same class, config and placement, new id `<slot>~<hex>`), the cluster is back to
N replicas in service and new requests land on the replacement. A replica retired on purpose,
and a cluster shut down, are not replaced. Every wait is bounded; nothing asserts on time.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from fairbatch.deployments.cluster.client import ClusterClient, collect
from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.launch import start_cluster
from fairbatch.deployments.cluster.replica import ReplicaConfig
from fairbatch.deployments.cluster.replica_set import SEP, ReplicaSet, ReplicaSpec, Supervisor
from fairbatch.engine.sampling_params import SamplingParams
from fairbatch.policies import TenantSpec

TENANTS = [TenantSpec("a", weight=3.0), TenantSpec("b", weight=1.0)]
SEATS = 4
CLUSTERS: list = []
NUM_GPUS = 6  # 3 + 2 replicas, and room for a replacement before a death

# ---- the supervisor alone: a fake launcher stands in for Ray ------------------------------


class FakeLauncher:
    """Named "actors" that report (are registered with the supervisor) when started."""

    def __init__(self, fail: int = 0) -> None:
        self.alive: dict[str, str] = {}  # name -> handle (the name itself)
        self.created: list[tuple[str, ReplicaConfig]] = []
        self.killed: list[str] = []
        self.up: set[str] = set()  # in placement, as the controller would say
        self.fail = fail  # the next `fail` starts raise (a constructor that fails)
        self.sup: Supervisor | None = None

    def create(self, name: str, config: ReplicaConfig) -> str:
        if name in self.alive:
            raise ValueError(f"name {name} taken")
        self.alive[name] = name
        self.created.append((name, config))
        return name

    async def start(self, handle: str, timeout_s: float) -> None:
        if self.fail:
            self.fail -= 1
            self.alive.pop(handle, None)
            raise RuntimeError("constructor failed")
        if handle in self.alive and self.sup.register(handle):  # its first report
            self.up.add(handle)

    async def names(self) -> list[str]:
        return list(self.alive)

    async def get(self, name: str) -> str | None:
        return self.alive.get(name)

    def kill(self, handle: str) -> None:
        if self.alive.pop(handle, None) is not None:
            self.killed.append(handle)
        self.up.discard(handle)


def supervisor(launcher: FakeLauncher, n: int = 2, clock=time.monotonic, **kw) -> Supervisor:
    specs = [ReplicaSpec(f"c-r{i}", ReplicaConfig("sim", max_num_seqs=i + 1)) for i in range(n)]
    kw = {"backoff_s": 1.0, "backoff_max_s": 3.0, "grace_s": 0.0, **kw}
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    sup = Supervisor(ReplicaSet("c-controller", specs, **kw), launcher, launcher.up.__contains__,
                     clock=clock, sleep=sleep)  # fmt: skip
    sup.sleeps = sleeps
    launcher.sup = sup
    return sup


def die(launcher: FakeLauncher, sup: Supervisor, rid: str) -> None:
    launcher.kill(rid)  # it died...
    sup.lost(rid)  # ...and the controller confirmed it


async def settle(sup: Supervisor) -> None:
    tasks = [s.task for s in sup.slots.values() if s.task is not None]
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


def test_supervisor_replaces_a_dead_replica_with_the_same_config():
    async def run():
        fl = FakeLauncher()
        sup = supervisor(fl)
        assert await sup.ensure(10)
        assert [n for n, _ in fl.created] == ["c-r0", "c-r1"]  # the slots' own ids first
        die(fl, sup, "c-r0")
        await settle(sup)
        name, config = fl.created[-1]
        assert name.startswith("c-r0" + SEP) and name in fl.up
        assert config == ReplicaConfig("sim", max_num_seqs=1)  # slot c-r0's config
        assert sup.slots["c-r0"].current == name and sup.stats()["replaced"] == 1
        assert not sup.register("c-r0")  # the dead one never serves again
        die(fl, sup, "c-r1-not-current")  # not a slot's replica in service: nothing happens
        assert len(fl.created) == 3

    asyncio.run(run())


def test_supervisor_counts_a_replacement_that_came_up_though_its_start_raised():
    class LateLauncher(FakeLauncher):
        async def start(self, handle: str, timeout_s: float) -> None:
            await super().start(handle, timeout_s)
            if SEP in handle:  # a replacement: it reported, then start() timed out anyway
                raise TimeoutError("start() answered late")

    async def run():
        fl = LateLauncher()
        sup = supervisor(fl)
        assert await sup.ensure(10)
        die(fl, sup, "c-r0")
        await settle(sup)
        name = fl.created[-1][0]
        assert name.startswith("c-r0" + SEP) and sup.slots["c-r0"].current == name
        stats = sup.stats()
        assert stats["replaced"] == 1 and stats["failed_attempts"] == 0
        assert stats["slots"]["c-r0"]["last_error"] is None and name not in fl.killed

    asyncio.run(run())


def test_supervisor_backs_off_then_gives_up_until_retry_after():
    async def run():
        now = [0.0]
        fl = FakeLauncher()
        sup = supervisor(fl, n=1, clock=lambda: now[0], max_attempts=3, retry_after_s=100.0)
        assert await sup.ensure(10)
        fl.fail = 2
        die(fl, sup, "c-r0")
        await settle(sup)
        assert sup.sleeps == [1.0, 2.0] and sup.slots["c-r0"].current in fl.up  # third try
        fl.fail = 5
        die(fl, sup, sup.slots["c-r0"].current)
        await settle(sup)
        assert sup.sleeps[2:] == [1.0, 2.0]  # a fresh bring-up restarts the backoff
        stats = sup.stats()
        assert stats["slots"]["c-r0"]["gave_up"] and stats["failed_attempts"] == 5
        created = len(fl.created)
        await sup.reconcile()  # too soon after giving up: nothing
        assert len(fl.created) == created and sup.slots["c-r0"].task is None
        now[0] += 101.0
        fl.fail = 0
        await sup.reconcile()
        await settle(sup)
        assert sup.slots["c-r0"].current in fl.up and len(fl.created) == created + 1

    asyncio.run(run())


def test_supervisor_retired_and_stopped_slots_stay_down():
    async def run():
        fl = FakeLauncher()
        sup = supervisor(fl, n=3)
        assert await sup.ensure(10)
        assert sup.retire("c-r0")
        fl.kill("c-r0")
        sup.lost("c-r0")  # a late death report changes nothing
        await sup.reconcile()
        assert all(s.task is None for s in sup.slots.values()) and len(fl.created) == 3
        assert await sup.ensure(10)  # every slot not retired is served
        assert await sup.stop() == 2 and not fl.alive
        die(fl, sup, "c-r1")
        await sup.reconcile()
        assert len(fl.created) == 3 and not sup.register("c-r2~late")

    asyncio.run(run())


def test_supervisor_after_a_restart_adopts_an_orphan_and_stops_a_duplicate():
    async def run():
        fl = FakeLauncher()
        fl.alive.update({n: n for n in ("c-r0~aaaaaa", "c-r1", "c-r1~bbbbbb")})
        sup = supervisor(fl)  # a fresh controller: nothing reported yet
        assert sup.register("c-r1")  # c-r1 reports; c-r0~aaaaaa was created, never started
        fl.up.add("c-r1")
        await sup.reconcile()
        await settle(sup)
        assert sup.slots["c-r0"].current == "c-r0~aaaaaa" and not fl.created  # adopted
        assert fl.killed == ["c-r1~bbbbbb"]  # a second live actor of slot c-r1
        assert not sup.register("c-r0~cccccc")  # c-r0 is served: a duplicate is turned away

    asyncio.run(run())


# ---- on Ray: a plain cluster and a Serve-path cluster ----------------------------------------


def sim_config() -> ReplicaConfig:
    return ReplicaConfig(
        engine="sim",
        num_gpu_blocks=256,
        num_cpu_blocks=256,
        max_num_seqs=SEATS,
        max_num_batched_tokens=256,
        tenants=TENANTS,
        time_scale=1.0,
    )


@pytest.fixture(scope="module")
def cluster(ray_session):
    c = start_cluster("repl", [sim_config() for _ in range(3)], ControllerConfig(tenants=TENANTS))
    CLUSTERS.append(c)
    return c


def params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def prompt(i: int, n: int = 16) -> list[int]:
    return [(i * 7 + j) % 997 + 1 for j in range(n)]


def wait_until(pred, timeout_s: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(every)


def in_service(controller, n: int, gone: str, replaced: int | None = None) -> dict | None:
    """The controller's stats once it has n replicas in service, `gone` not among them, and
    (with `replaced`) its supervisor has counted that many replacements: it counts one when
    it next polls the new replica, a moment after the replica reports for service."""
    stats = ray.get(controller.stats.remote(), timeout=30)
    ok = len(stats["replicas"]) == n and gone not in stats["replicas"]
    ok = ok and (replaced is None or stats["replica_set"]["replaced"] == replaced)
    return stats if ok and ray.get(controller.ready.remote(n), timeout=30) else None


async def kill_under_load(controller, victim: str, handle, n: int, first: int) -> tuple:
    """n greedy requests; once every one is mid-generation, kill `victim`."""
    client = ClusterClient(controller, item_timeout_s=60, admit_timeout_s=120)
    progress, where = [0] * n, [""] * n

    async def one(i: int) -> dict:
        tokens, items = [], []
        async for item in client.generate(prompt(first + i), params(80), tenant="ab"[i % 2]):
            tokens.extend(item.token_ids)
            items.append(item)
            progress[i] = len(tokens)
            where[i] = "" if item.finished else item.replica_id
        return {"tokens": tokens, "items": items, "replicas": [x.replica_id for x in items]}

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    deadline = time.monotonic() + 60
    while min(progress) < 8:
        await asyncio.sleep(0.02)
        assert time.monotonic() < deadline, progress
    ray.kill(handle, no_restart=True)
    on_victim = [i for i in range(n) if where[i] == victim]
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120), on_victim


async def fill(controller, n: int, first: int) -> list[dict]:
    client = ClusterClient(controller, item_timeout_s=60, admit_timeout_s=120)
    runs = [collect(client, prompt(first + i), params(24), tenant="ab"[i % 2]) for i in range(n)]
    return await asyncio.wait_for(asyncio.gather(*runs), timeout=120)


def test_killed_replica_is_replaced_and_serves(cluster, sim_expected):
    before = cluster.replicas
    victim = next(iter(before))
    results, on_victim = asyncio.run(
        kill_under_load(cluster.controller, victim, before[victim], 3 * SEATS, 500)
    )
    assert on_victim, "no request was mid-generation on the killed replica"
    for i in on_victim:  # continued on another replica
        assert results[i]["replicas"][0] == victim and results[i]["replicas"][-1] != victim
    for i, r in enumerate(results):  # exactly the undisturbed tokens: no gap, no repeat
        assert r["tokens"] == sim_expected(prompt(500 + i), 80)
        assert r["items"][-1].finish_reason == "length"

    stats = wait_until(lambda: in_service(cluster.controller, 3, victim, 1), 90, "a replacement")
    (new,) = set(stats["replicas"]) - set(before)
    assert new.startswith(victim + SEP)  # same slot, a new incarnation
    assert stats["replica_set"]["slots"][victim]["replica"] == new

    # every seat and local-queue slot of the three taken: the replacement gets its share
    results = asyncio.run(fill(cluster.controller, 3 * (SEATS + 2), 600))
    for i, r in enumerate(results):
        assert r["tokens"] == sim_expected(prompt(600 + i), 24)
    assert new in [r["replicas"][0] for r in results]


class ControllerView:
    """What `replica_check` needs of a cluster, from its controller alone."""

    def __init__(self, name: str, controller) -> None:
        self.name, self.controller = name, controller

    @property
    def replicas(self) -> dict:
        return ray.get(self.controller.replica_handles.remote(), timeout=30)


def test_serve_path_replaces_with_a_cluster_replica(ray_session, sim_expected, replica_check):
    """`ensure_cluster` without Serve: the replacement is a `ClusterReplica` (its sim replica
    has the tiny tokenizer, so items carry text), a second `ensure_cluster` creates nothing,
    and after the last ingress detaches and `kill_cluster` no actor of it is left."""
    from fairbatch.deployments.cluster.launch import ClusterSpec, ensure_cluster, kill_cluster

    spec = ClusterSpec(
        "fbrepl",
        [sim_config(), sim_config()],
        ControllerConfig(tenants=TENANTS),
        metrics_interval_s=0,
    )
    handles = asyncio.run(ensure_cluster(spec, 120))
    ctrl = handles.controller
    view = ControllerView(handles.cluster_id, ctrl)
    try:
        assert set(asyncio.run(ensure_cluster(spec, 120)).replicas) == set(handles.replicas)
        ray.get(ctrl.attach.remote("test"), timeout=30)
        victim = next(iter(handles.replicas))
        ray.kill(handles.replicas[victim], no_restart=True)
        assert ray.get(ctrl.replica_failed.remote(victim), timeout=30)  # as a client reports
        stats = wait_until(lambda: in_service(ctrl, 2, victim), 90, "a replacement")
        (new,) = set(stats["replicas"]) - set(handles.replicas)
        assert new.startswith(victim + SEP)
        results = asyncio.run(fill(ctrl, 2 * (SEATS + 2), 700))
        on_new = [r for r in results if r["replicas"][0] == new]
        assert on_new and all("".join(i.text for i in r["items"]) for r in on_new)
        for i, r in enumerate(results):
            assert r["tokens"] == sim_expected(prompt(700 + i), 24)
        replica_check([view])
    finally:
        assert ray.get(ctrl.detach.remote("test"), timeout=60) == 0  # the last one out
    kill_cluster(handles)

    def none_left() -> bool:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        return not [n for n in names if n.startswith(handles.cluster_id)]

    wait_until(none_left, 60, "the serve-path cluster's actors to stop")


def test_retired_replica_is_not_replaced(cluster, sim_expected):
    stats = ray.get(cluster.controller.stats.remote(), timeout=30)
    rid = stats["replicas"][-1]
    assert ray.get(cluster.controller.retire_replica.remote(rid), timeout=30)
    n0 = stats["replica_set"]["reconciles"]

    def reconciled_twice() -> dict | None:  # full passes over the slots since the retirement
        s = ray.get(cluster.controller.stats.remote(), timeout=30)
        return s if s["replica_set"]["reconciles"] >= n0 + 2 else None

    stats = wait_until(reconciled_twice, 60, "two reconcile passes")
    assert len(stats["replicas"]) == 2 and rid not in stats["replicas"]
    slot = stats["replica_set"]["slots"][rid.split(SEP)[0]]
    assert slot["retired"] and not slot["bringing_up"] and slot["replica"] is None
    results = asyncio.run(fill(cluster.controller, 6, 800))
    for i, r in enumerate(results):
        assert r["tokens"] == sim_expected(prompt(800 + i), 24) and rid not in r["replicas"]


def test_shutdown_replaces_nothing(cluster):
    CLUSTERS.remove(cluster)
    cluster.shutdown()

    def none_left() -> bool:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
        return not [n for n in names if n.startswith("repl-")]

    wait_until(none_left, 60, "the cluster's actors to stop")
