"""d2lpm routing and the prefix_affinity baseline: FairnessCore driven by hand-made reports.

Every request below costs 10 prompt + 2 x 10 output = 30 weighted tokens (meta(n=10))."""

from __future__ import annotations

import pytest

from fairbatch.deployments.cluster.fairness import ControllerConfig, FairnessCore
from fairbatch.deployments.cluster.tickets import Ticket
from fairbatch.policies import TenantSpec
from tests.ray.test_fairness_core import Reporter, assigned, meta

H = [b"h1", b"h2", b"h3", b"h4"]  # a prompt's four leading block hashes


def cluster(names=("r0", "r1", "r2"), seats=4, hashes=None, **kw):
    core = FairnessCore(ControllerConfig(routing="d2lpm", **kw))
    reps = {name: Reporter(name, seats=seats) for name in names}
    for name, rep in reps.items():
        core.report(rep(hashes=(hashes or {}).get(name)))
    return core, reps


def test_longest_match_wins_and_a_short_match_is_no_match():
    core, _ = cluster(hashes={"r1": H[:2], "r2": H})
    assert assigned(core.submit(meta("full", hashes=H))) == [("full", "r2")]
    # r1 holds 2 of 3 blocks (>= min_match 0.5): a match; r2's longer one still wins
    assert assigned(core.submit(meta("x", hashes=H[:3]))) == [("x", "r2")]
    # an equal match: the lower load
    assert assigned(core.submit(meta("y", hashes=H[:2]))) == [("y", "r1")]
    # 1 of 4 blocks cached is below min_match: least loaded (r0 has nothing)
    assert assigned(core.submit(meta("short", hashes=[b"h1", b"z2", b"z3", b"z4"]))) == [
        ("short", "r0")
    ]
    assert assigned(core.submit(meta("none", hashes=[b"zz"]))) == [("none", "r0")]


def test_the_tenant_deficit_per_replica_caps_locality_and_grows_back():
    # quantum 60: tenant a (weight 1) may hold 60 = two requests on r1 for locality, b
    # (weight 2) four
    tenants = [TenantSpec("a"), TenantSpec("b", weight=2.0)]
    core, reps = cluster(hashes={"r1": H}, seats=8, tenants=tenants, d2lpm_quantum=60.0)
    core.config.d2lpm_load_slack = 100  # (the load slack is tested apart)
    core.placement.locality.load_slack = 100
    got = [assigned(core.submit(meta(f"a{i}", tenant="a", hashes=H)))[0] for i in range(3)]
    assert got == [("a0", "r1"), ("a1", "r1"), ("a2", "r0")]  # a's deficit on r1 is spent
    got = [assigned(core.submit(meta(f"b{i}", tenant="b", hashes=H)))[0] for i in range(5)]
    assert [r for _, r in got] == ["r1"] * 4 + ["r2"]
    r1 = core.replicas["r1"]
    assert r1.locality == {"a": 60.0, "b": 120.0}
    core.report(reps["r1"](finished=[("a0", 10)], hashes=H))  # deficit comes back on its end
    assert r1.locality == {"a": 30.0, "b": 120.0}
    assert assigned(core.submit(meta("a3", tenant="a", hashes=H))) == [("a3", "r1")]
    # a request placed for load takes no deficit; one that moves away gives its deficit back
    assert core.tickets["a2"].locality == 0.0
    core.migrate("a3", "r0")
    assert r1.locality == {"a": 30.0, "b": 120.0}
    core.cancel("a1")  # never reached its replica: its slot and deficit come back at once
    assert r1.locality == {"b": 120.0}
    b0 = core.tickets["b0"]
    assert core.remove_replica("r1") and b0.locality == 0.0


def test_a_replica_over_the_load_slack_is_no_locality_choice():
    core, _ = cluster(hashes={"r1": H}, seats=8, d2lpm_load_slack=1, d2lpm_quantum=1e9)
    got = [assigned(core.submit(meta(f"q{i}", hashes=H)))[0][1] for i in range(6)]
    # r1 may be at most one above the least loaded replica when it is chosen
    assert got == ["r1", "r1", "r0", "r2", "r1", "r0"]
    loads = core.stats()["assigned"]
    assert max(loads.values()) - min(loads.values()) <= 1 + 1


def test_admission_order_is_the_global_policys_whatever_the_routing():
    tenants = [TenantSpec("a", 3.0), TenantSpec("b", 1.0)]
    orders = {}
    for routing in ("fair", "d2lpm"):
        core = FairnessCore(ControllerConfig(routing=routing, tenants=tenants, local_queue=0))
        for i in range(16):  # a's prompts all cached on r1, b's nowhere
            tenant = "ab"[i % 2]
            core.submit(meta(f"{tenant}{i}", tenant=tenant, hashes=H if tenant == "a" else ()))
        r0, r1 = Reporter("r0"), Reporter("r1")
        order = assigned(core.report(r0())) + assigned(core.report(r1(hashes=H)))
        while len(order) < 10:
            done = order[-2:]
            order += assigned(core.report(r0(finished=[(d, 10) for d, r in done if r == "r0"])))
            fin = [(d, 10) for d, r in done if r == "r1"]
            order += assigned(core.report(r1(finished=fin, hashes=H)))
        orders[routing] = [rid for rid, _ in order]
    assert orders["d2lpm"] == orders["fair"]
    assert [rid[0] for rid in orders["fair"]].count("a") >= 7  # 3:1 by the cluster counters


def test_dlpm_in_the_controller_reads_cached_prefixes_as_hit_lengths():
    core, reps = cluster(names=("r0",), seats=1, local_queue=0, policy="dlpm")
    core.report(reps["r0"](hashes=H))
    core.submit(meta("cold", hashes=[b"zz"]))  # takes the only seat
    core.submit(meta("cold2", hashes=[b"zz"]))
    core.submit(meta("hot", hashes=H))
    # no replica has room: a cached prefix is a hit only where the request could go
    assert core.placement.cached_prefix_tokens(core.tickets["hot"]) == 0
    core.replicas["r0"].slots = 2
    core.placement.touch(core.replicas["r0"])
    assert core.placement.cached_prefix_tokens(core.tickets["hot"]) == 4 * 16
    assert core.placement.cached_prefix_tokens(core.tickets["cold2"]) == 0
    core.replicas["r0"].slots = 1
    core.placement.touch(core.replicas["r0"])
    actions = core.report(reps["r0"](finished=[("cold", 10)], hashes=H))
    assert assigned(actions) == [("hot", "r0")]  # the longer hit first, within credit


@pytest.mark.parametrize("routing", ["fair", "d2lpm"])
def test_the_hit_length_is_the_match_on_the_replicas_with_room(routing):
    # r0 caches G, r1 caches H; both full. r1 frees a seat: the request whose prefix r1 holds
    # goes first, though it came later and r0 caches the other one as long a prefix
    G = [b"g1", b"g2", b"g3", b"g4"]
    core = FairnessCore(ControllerConfig(routing=routing, policy="dlpm", local_queue=0))
    reps = {name: Reporter(name, seats=1) for name in ("r0", "r1")}
    core.report(reps["r0"](hashes=G))
    core.report(reps["r1"](hashes=H))
    busy = assigned(core.submit(meta("b0"))) + assigned(core.submit(meta("b1")))
    assert busy == [("b0", "r0"), ("b1", "r1")]
    core.submit(meta("on_r0", hashes=G))
    core.submit(meta("on_r1", hashes=H))
    where = dict(assigned(core.report(reps["r1"](finished=[("b1", 10)], hashes=H))))
    assert where == {"on_r1": "r1"}


def test_prefix_affinity_routes_at_once_to_the_holder_whatever_its_load():
    core = FairnessCore(ControllerConfig(routing="prefix_affinity", policy="fcfs"))
    for name in ("r0", "r1"):
        core.report(Reporter(name, seats=1)(hashes=H if name == "r1" else None))
    got = [assigned(core.submit(meta(f"q{i}", hashes=H)))[0][1] for i in range(4)]
    assert got == ["r1"] * 4  # one seat, four requests: no slot limit
    assert assigned(core.submit(meta("other", hashes=[b"zz"]))) == [("other", "r0")]


@pytest.mark.parametrize(
    "kw",
    [
        dict(routing="d3lpm"),
        dict(d2lpm_quantum=0.0),
        dict(d2lpm_min_match=0.0),
        dict(d2lpm_min_match=1.5),
        dict(d2lpm_load_slack=-1),
    ],
)
def test_config_is_checked(kw):
    with pytest.raises(ValueError):
        ControllerConfig(**kw)


@pytest.mark.parametrize(
    "routing, expected",
    [
        # locality first: every request of the hot prefix joins its one holder's queue
        ("prefix_affinity", ["r1"] * 8),
        # r1 is chosen while its load <= the least load + 2; past that the least loaded
        # replica takes the request (r0, r2, r3 in index order), and r1 again once they caught up
        ("d2lpm", ["r1", "r1", "r1", "r0", "r2", "r3", "r1", "r0"]),
    ],
)
def test_a_cold_prefix_turning_hot_piles_up_only_under_prefix_affinity(routing, expected):
    # the popularity shift of benchmarks/locality_bench.py: H was cold, so only r1 caches it;
    # now a burst of requests for it arrives (none ends meanwhile)
    core = FairnessCore(ControllerConfig(routing=routing, d2lpm_quantum=1e9))
    for name in ("r0", "r1", "r2", "r3"):
        core.report(Reporter(name, seats=4)(hashes=H if name == "r1" else None))
    got = [assigned(core.submit(meta(f"q{i}", hashes=H)))[0][1] for i in range(8)]
    assert got == expected


def ticket(rid, hashes):
    m = meta(rid, hashes=hashes)
    return Ticket(m, rid, m.tenant, m.priority)


def test_hit_lengths_are_matched_once_per_prefix_and_follow_caches_and_loads():
    core, reps = cluster(names=("r0", "r1"), seats=1, local_queue=0, hashes={"r1": H})
    hits = core.placement.cached_prefix_tokens
    # requests sharing a prefix share one match; another prefix gets its own
    assert hits(ticket("x", H)) == hits(ticket("y", H)) == 4 * 16
    assert hits(ticket("z", H[:2])) == 2 * 16
    core.report(reps["r1"](hashes=H[:1]))  # r1 evicted most of H
    assert hits(ticket("x2", H)) == 16
    core.submit(meta("busy0"))
    core.submit(meta("busy1"))  # both replicas full: a cached prefix is no hit
    assert hits(ticket("x3", H)) == 0
