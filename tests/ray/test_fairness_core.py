"""FairnessCore, the controller's logic, driven by hand-made reports (no Ray, no engine)."""

from __future__ import annotations

import dataclasses

from fairbatch.deployments.cluster.fairness import (
    Assign,
    ControllerConfig,
    FairnessCore,
    Migrate,
    Preempt,
)
from fairbatch.deployments.cluster.preemption import Preemption
from fairbatch.deployments.cluster.tickets import Ticket
from fairbatch.deployments.cluster.wire import ReplicaReport, RequestMeta
from fairbatch.engine.sampling_params import LoRARequest, SamplingParams
from fairbatch.policies import FcfsPolicy, TenantSpec


def meta(rid: str, tenant: str = "a", priority: int = 0, n: int = 10, hashes=()) -> RequestMeta:
    return RequestMeta(
        rid,
        list(range(1, n + 1)),
        SamplingParams(max_tokens=n, ignore_eos=True),
        tenant=tenant,
        priority=priority,
        prefix_hashes=list(hashes),
    )


class Reporter:
    """Builds consecutive reports for one replica."""

    def __init__(self, replica_id: str, seats: int = 1) -> None:
        self.replica_id, self.seats, self.seq = replica_id, seats, 0

    def __call__(
        self, finished=(), active=None, service=None, hashes=None, loras=None
    ) -> ReplicaReport:
        self.seq += 1
        return ReplicaReport(
            replica_id=self.replica_id,
            seq=self.seq,
            max_num_seqs=self.seats,
            free_blocks=100,
            total_blocks=100,
            block_size=16,
            num_waiting=0,
            num_running=0,
            num_swapped=0,
            num_steps=0,
            service=service or {},
            finished=list(finished),
            active=active or {},
            prefix_hashes=hashes,
            loras=loras,
        )


def lora_meta(rid: str, lora: str | None) -> RequestMeta:
    m = meta(rid)
    if lora is not None:
        m.params = dataclasses.replace(m.params, lora=LoRARequest(lora, f"/loras/{lora}"))
    return m


def assigned(actions) -> list[tuple[str, str]]:
    return [(a.ticket.request_id, a.replica_id) for a in actions if isinstance(a, Assign)]


def test_least_loaded_then_queue_until_a_slot_frees():
    core = FairnessCore(ControllerConfig(local_queue=1))
    reps = {r: Reporter(r, seats=2) for r in ("r0", "r1", "r2")}
    for rep in reps.values():
        core.report(rep())
    got = []
    for i in range(10):
        got += assigned(core.submit(meta(f"q{i}")))
    per = {r: sum(1 for _, x in got if x == r) for r in reps}
    assert per == {"r0": 3, "r1": 3, "r2": 3}  # 2 seats + 1 local queue each
    assert core.stats()["queued"] == 1
    first_on_r1 = next(rid for rid, r in got if r == "r1")
    actions = core.report(reps["r1"](finished=[(first_on_r1, 10)]))
    assert assigned(actions) == [("q9", "r1")]


def test_global_order_is_weighted_fair_over_cluster_counters():
    core = FairnessCore(
        ControllerConfig(tenants=[TenantSpec("a", 3.0), TenantSpec("b", 1.0)], local_queue=0)
    )
    for i in range(16):  # queued before any replica exists
        core.submit(meta(f"{'ab'[i % 2]}{i}", tenant="ab"[i % 2]))
    rep = Reporter("r0", seats=1)
    order = assigned(core.report(rep()))
    while len(order) < 8:
        order += assigned(core.report(rep(finished=[(order[-1][0], 10)])))
    tenants = [rid[0] for rid, _ in order]
    # each admission prepays 10 prompt + 2 x 10 output = 30: a's counter moves 10, b's 30
    assert tenants.count("a") == 6 and tenants[:2] == ["a", "b"]


def test_refund_of_unused_output_on_finish():
    core = FairnessCore(ControllerConfig())
    rep = Reporter("r0", seats=4)
    core.report(rep())
    core.submit(RequestMeta("x", [1] * 8, SamplingParams(max_tokens=100), tenant="t"))
    assert core.counters()["t"] == 8 + 2 * 100  # prepaid
    core.report(rep(finished=[("x", 10)]))  # stopped early after 10 tokens
    assert core.counters()["t"] == 8 + 2 * 10


def test_prefix_affinity_beats_load():
    core = FairnessCore(ControllerConfig())
    r0, r1 = Reporter("r0", seats=4), Reporter("r1", seats=4)
    core.report(r0())
    core.report(r1(hashes=[b"h1", b"h2"]))
    assert assigned(core.submit(meta("busy")))[0][1] == "r0"  # least loaded: a tie, r0 first
    assert assigned(core.submit(meta("x", hashes=[b"h1", b"h2"]))) == [("x", "r1")]
    assert assigned(core.submit(meta("y", hashes=[b"zz"]))) == [("y", "r0")]


def test_a_cached_prefix_takes_a_free_seat_or_an_equal_queue_only():
    # The holder of a prefix gets its requests while it has a free seat, or while no replica
    # has fewer requests; never a place in its local queue while another replica's seat idles.
    core = FairnessCore(ControllerConfig(local_queue=2))
    r0, r1 = Reporter("r0", seats=2), Reporter("r1", seats=2)
    core.report(r0(hashes=[b"h1"]))
    core.report(r1())
    hit = [b"h1"]
    assert assigned(core.submit(meta("x1", hashes=hit))) == [("x1", "r0")]
    assert assigned(core.submit(meta("x2", hashes=hit))) == [("x2", "r0")]  # r0: 2 of 2 seats
    assert assigned(core.submit(meta("x3", hashes=hit))) == [("x3", "r1")]  # r1 has a free seat
    assert assigned(core.submit(meta("y1"))) == [("y1", "r1")]  # both seats full on both: 2, 2
    assert assigned(core.submit(meta("x4", hashes=hit))) == [("x4", "r0")]  # queues equal: cache
    assert assigned(core.submit(meta("x5", hashes=hit))) == [("x5", "r1")]  # r0 queues more
    assert assigned(core.submit(meta("x6", hashes=hit))) == [("x6", "r0")]  # equal again: 3, 3
    assert core.stats()["assigned"] == {"r0": 4, "r1": 3}


def waiting_on_r0():
    """Two replicas of 2 seats and 2 local places, 2 requests running on each, and "w" sent
    ahead to r0, seen there waiting (r0: 3 assigned, r1: 2)."""
    core = FairnessCore(ControllerConfig(local_queue=2))
    r0, r1 = Reporter("r0", seats=2), Reporter("r1", seats=2)
    core.report(r0())
    core.report(r1())
    for i in range(4):
        core.submit(meta(f"q{i}"))
    assert assigned(core.submit(meta("w"))) == [("w", "r0")]
    running = {"q0": ("a", 0, True, 10, 1), "q2": ("a", 0, True, 10, 1)}
    core.report(r0(active={**running, "w": ("a", 0, False, 10, 0)}))
    core.report(r1(active={"q1": ("a", 0, True, 10, 1), "q3": ("a", 0, True, 10, 1)}))
    return core, r0, r1


def test_a_request_waiting_in_a_local_queue_moves_to_a_seat_freed_elsewhere():
    core, r0, r1 = waiting_on_r0()
    # A seat frees on r1 and nothing is queued: w moves there (if it has not started).
    actions = core.report(r1(finished=[("q1", 10)], active={"q3": ("a", 0, True, 10, 1)}))
    assert actions == [Migrate("w", "r0", "r1", waiting_only=True)]
    assert core.stats()["assigned"] == {"r0": 2, "r1": 2} and core.where("w") == "r1"
    # r0 reports it gone (its stream ended with the move), then the move is done
    assert core.report(r0(finished=[("w", 0)])) == []
    assert core.move_done(actions[0], ok=True) == []
    assert core.where("w") == "r1" and core.stats()["assigned"] == {"r0": 2, "r1": 2}
    core.report(r1(finished=[("w", 10)]))
    assert core.where("w") is None and core.stats()["assigned"] == {"r0": 2, "r1": 1}


def test_a_refused_move_puts_the_request_back_and_is_not_tried_again():
    core, r0, r1 = waiting_on_r0()
    [move] = core.report(r1(finished=[("q1", 10)], active={"q3": ("a", 0, True, 10, 1)}))
    assert move.waiting_only and core.move_done(move, ok=False) == []  # it had started at r0
    assert core.where("w") == "r0" and core.stats()["assigned"] == {"r0": 3, "r1": 1}
    assert core.dispatch() == []  # seen started: no candidate any more


def test_a_request_that_ends_at_its_source_during_a_refused_move_ends_its_ticket():
    core, r0, r1 = waiting_on_r0()
    [move] = core.report(r1(finished=[("q1", 10)], active={"q3": ("a", 0, True, 10, 1)}))
    before = core.counters()["a"]
    core.report(r0(finished=[("w", 4)]))  # it started and ended at r0 meanwhile
    assert core.move_done(move, ok=False) == []
    assert core.where("w") is None and core.stats()["assigned"] == {"r0": 2, "r1": 1}
    assert core.counters()["a"] == before - 2 * (10 - 4)  # its unused output refunded


def test_no_move_while_the_global_queue_can_fill_the_seat():
    core, r0, r1 = waiting_on_r0()
    for i in range(4):  # r0 and r1 full (4 places each): 1 queued at the controller
        core.submit(meta(f"more{i}"))
    assert core.stats()["queued"] == 1
    actions = core.report(r1(finished=[("q1", 10)], active={"q3": ("a", 0, True, 10, 1)}))
    assert assigned(actions) == [("more3", "r1")]
    assert not [a for a in actions if isinstance(a, Migrate)]
    off = FairnessCore(ControllerConfig(local_queue=2, rebalance_local_queues=False))
    o0, o1 = Reporter("r0", seats=2), Reporter("r1", seats=2)
    off.report(o0())
    off.report(o1())
    for i in range(4):
        off.submit(meta(f"q{i}"))
    off.submit(meta("w"))
    off.report(o0(active={"w": ("a", 0, False, 10, 0)}))
    assert off.report(o1(finished=[("q1", 10)])) == []  # turned off: w waits at r0


def test_coordinated_preemption_picks_the_cluster_wide_victim():
    tenants = [TenantSpec("light"), TenantSpec("heavy")]
    core = FairnessCore(ControllerConfig(tenants=tenants, local_queue=0))
    r0, r1 = Reporter("r0"), Reporter("r1")
    core.report(r0())
    core.report(r1())
    core.submit(meta("L", tenant="light"))  # -> r0
    core.submit(meta("H", tenant="heavy", n=50))  # -> r1, a bigger counter
    core.report(r0(active={"L": ("light", 0, True, 10, 1)}))
    core.report(r1(active={"H": ("heavy", 0, True, 50, 1)}))
    actions = core.submit(meta("vip", tenant="light", priority=5))
    assert [a for a in actions if isinstance(a, Preempt)] == [Preempt("r1", "H", "auto", "vip")]
    assert assigned(actions) == [("vip", "r1")]
    # an equal-priority request: light already holds both seats, more than its share
    assert core.submit(meta("same", tenant="light")) == []
    # a slot frees on r0: the displaced request moves there before the queue is served
    actions = core.report(r0(finished=[("L", 10)]))
    assert [a for a in actions if isinstance(a, Migrate)] == [Migrate("H", "r1", "r0")]


def test_a_moved_request_that_never_reaches_its_destination_leaves_its_slot():
    """A displaced request moves r1 -> r0, but its client dies holding the move's marker, so
    r0 never gets it: once stale_assignment_s has passed without r0 reporting it, the ticket
    and its slot go, as for a request whose client never reached its first replica."""
    now = [0.0]
    tenants = [TenantSpec("light"), TenantSpec("heavy")]
    config = ControllerConfig(tenants=tenants, local_queue=0, stale_assignment_s=30.0)
    core = FairnessCore(config, clock=lambda: now[0])
    r0, r1 = Reporter("r0"), Reporter("r1")
    core.report(r0())
    core.report(r1())
    core.submit(meta("L", tenant="light"))
    core.submit(meta("H", tenant="heavy", n=50))
    core.report(r0(active={"L": ("light", 0, True, 10, 1)}))
    core.report(r1(active={"H": ("heavy", 0, True, 50, 1)}))
    core.submit(meta("vip", tenant="light", priority=5))  # displaces H on r1
    [move] = [a for a in core.report(r0(finished=[("L", 10)])) if isinstance(a, Migrate)]
    assert move == Migrate("H", "r1", "r0")
    core.report(r1(finished=[("H", 1)], active={"vip": ("light", 5, True, 10, 0)}))
    assert core.move_done(move, ok=True) == []
    assert core.where("H") == "r0" and core.stats()["assigned"] == {"r0": 1, "r1": 1}
    now[0] = 29.0
    core.report(r0())  # r0 has not seen it yet: still in flight
    assert core.where("H") == "r0"
    now[0] = 31.0
    core.report(r0())
    assert core.where("H") is None and core.stats()["assigned"] == {"r0": 0, "r1": 1}


def test_the_controller_and_a_replica_choose_victims_by_one_rule():
    counters = {"a": 5.0, "b": 10.0}
    preemption, tickets = Preemption(), []
    for rid, tenant, seq, priority in [("r1", "a", 1, 1), ("r2", "a", 2, 0), ("r3", "b", 3, 0)]:
        t = Ticket(None, rid, tenant, priority)
        t.seq, t.seen, t.running = seq, True, True
        preemption.assigned(t)
        tickets.append(t)
    policy = FcfsPolicy()
    policy.set_counters(counters)
    for below in (1, 2):  # b is the most served in class 0: r3, whichever classes may yield
        replica_choice = policy.pick_victim(tickets, below_priority=below)
        assert preemption.victim(below, counters) is replica_choice is tickets[2]
    assert preemption.victim(0, counters) is None
    tickets[2].running = False  # waiting on its replica: it frees no seat, so r2 goes first
    assert preemption.victim(1, counters) is tickets[1]


def fair_core(seats: int = 4, **tenants: float) -> tuple[FairnessCore, Reporter]:
    specs = [TenantSpec(name, weight) for name, weight in tenants.items()]
    core = FairnessCore(ControllerConfig(tenants=specs, local_queue=0))
    rep = Reporter("r0", seats=seats)
    core.report(rep())
    return core, rep


def running(*rids: str, tenant: str) -> dict:
    return {rid: (tenant, 0, True, 10, 1) for rid in rids}


def preempted(actions: list) -> list[tuple[str, str | None]]:
    return [(a.request_id, a.seat_for) for a in actions if isinstance(a, Preempt)]


def test_fair_preemption_gives_a_tenant_under_its_share_of_the_seats_a_seat():
    core, rep = fair_core(seats=4, noisy=1.0, quiet=1.0)
    for i in range(6):  # N0-N3 run, N4 and N5 wait
        core.submit(meta(f"N{i}", tenant="noisy"))
    core.report(rep(active=running("N0", "N1", "N2", "N3", tenant="noisy")))
    # quiet is lifted to noisy's counter, so noisy's older N4 heads the queue; still, quiet
    # holds 0 of its 2 seats and noisy 4: noisy's latest running request gives way to Q0
    actions = core.submit(meta("Q0", tenant="quiet"))
    assert preempted(actions) == [("N3", "Q0")]
    assert assigned(actions) == [("Q0", "r0")]
    assert preempted(core.submit(meta("Q1", tenant="quiet"))) == [("N2", "Q1")]
    # 2 seats each now: quiet at its share, and noisy would fall below it
    assert core.submit(meta("Q2", tenant="quiet")) == []
    # noisy's N4 at the head is at its share too: nobody is preempted back
    assert core.report(rep(active={**running("N0", "N1", tenant="noisy"),
                                   **running("Q0", "Q1", tenant="quiet")})) == []  # fmt: skip
    assert core.stats()["preemptions"] == 2


def test_a_backlogged_tenant_never_preempts_for_its_share():
    """quiet asks for more than its 2 seats: the queue's order gives it its share as seats
    free; preempting would only move seats back and forth."""
    core, rep = fair_core(seats=4, noisy=1.0, quiet=1.0)
    for i in range(4):
        core.submit(meta(f"N{i}", tenant="noisy"))
    for i in range(3):
        core.submit(meta(f"Q{i}", tenant="quiet"))  # noisy's are not seen running yet
    assert preempted(core.report(rep(active=running("N0", "N1", "N2", "N3", tenant="noisy")))) == []
    assert core.stats()["queued_by_tenant"] == {"quiet": 3}


def test_fair_shares_of_the_seats_follow_the_weights():
    core, rep = fair_core(seats=4, noisy=1.0, quiet=3.0)
    for i in range(5):
        core.submit(meta(f"N{i}", tenant="noisy"))
    core.report(rep(active=running("N0", "N1", "N2", "N3", tenant="noisy")))
    got = [preempted(core.submit(meta(f"Q{i}", tenant="quiet"))) for i in range(4)]
    # quiet's share is 3 seats, noisy's 1
    assert got == [[("N3", "Q0")], [("N2", "Q1")], [("N1", "Q2")], []]


def test_fair_preemption_off_leaves_the_seats_to_whoever_holds_them():
    core = FairnessCore(ControllerConfig(local_queue=0, fair_preemption=False))
    rep = Reporter("r0", seats=2)
    core.report(rep())
    core.submit(meta("N0", tenant="noisy"))
    core.submit(meta("N1", tenant="noisy"))
    core.report(rep(active=running("N0", "N1", tenant="noisy")))
    assert core.submit(meta("Q0", tenant="quiet")) == []


def test_restarted_controller_rebuilds_from_reports():
    core = FairnessCore(ControllerConfig(tenants=[TenantSpec("a", 2.0)], local_queue=0))
    rep = Reporter("r0", seats=2)
    active = {"q1": ("a", 0, True, 10, 4), "q2": ("a", 0, True, 10, 0)}
    core.report(rep(active=active, service={"a": (20, 4)}))
    assert core.stats()["assigned"] == {"r0": 2}
    # served so far (20 + 2 x 4) plus the remaining output prepaid (2 x (6 + 10)), weight 2
    assert core.counters()["a"] == (20 + 8 + 32) / 2
    assert core.submit(meta("q3", tenant="a")) == []  # both seats taken: it waits
    assert assigned(core.report(rep(finished=[("q1", 10)]))) == [("q3", "r0")]


def test_dead_replica_is_dropped_and_its_requests_orphaned():
    core = FairnessCore(ControllerConfig(local_queue=0))
    r0, r1 = Reporter("r0"), Reporter("r1")
    core.report(r0())
    core.report(r1())
    core.submit(meta("a"))
    core.submit(meta("b"))
    orphans = core.remove_replica("r0")
    assert [t.request_id for t in orphans] == ["a"]
    resubmit = meta("a")
    resubmit.output_ids, resubmit.attempt = [5, 6], 1
    counters = core.counters()
    assert core.submit(resubmit) == []  # r1 is full: queued
    assert core.counters() == counters  # a resubmission is not charged twice
    assert assigned(core.report(r1(finished=[("b", 10)]))) == [("a", "r1")]


def test_round_robin_and_power_of_two_route_at_once():
    for routing in ("round_robin", "power_of_two"):
        core = FairnessCore(ControllerConfig(routing=routing, policy="fcfs"))
        for r in ("r0", "r1", "r2"):
            core.report(Reporter(r, seats=1)())
        got = []
        for i in range(9):
            got += assigned(core.submit(meta(f"q{i}")))
        assert len(got) == 9  # no global queue, no slot limit
        if routing == "round_robin":
            assert [r for _, r in got] == ["r1", "r2", "r0"] * 3


def test_cancel_queued_and_unseen_refunds_but_held_waits_for_the_report():
    core = FairnessCore(ControllerConfig(local_queue=0))
    rep = Reporter("r0", seats=2)
    core.report(rep())
    core.submit(meta("held", tenant="t"))
    core.submit(meta("unseen", tenant="t"))
    core.submit(meta("queued", tenant="t"))
    core.report(rep(active={"held": ("t", 0, True, 10, 3)}))
    prepaid = core.counters()["t"]
    assert prepaid == 2 * (10 + 2 * 10)  # two admitted, one queued (not charged)
    core.cancel("queued")
    core.cancel("unseen")  # its client never attached: slot, prompt and output come back
    assert core.counters()["t"] == prepaid - (10 + 2 * 10)
    core.cancel("held")  # still on its replica: nothing changes until the replica reports
    assert core.stats()["assigned"] == {"r0": 1}
    core.report(rep(finished=[("held", 3)]))
    assert core.counters()["t"] == (10 + 2 * 3)
    assert core.stats()["assigned"] == {"r0": 0} and core.stats()["queued"] == 0


def test_a_sibling_sample_goes_to_its_parents_replica_and_is_not_charged_the_prompt():
    core = FairnessCore(ControllerConfig(local_queue=0))
    reps = {r: Reporter(r, seats=2) for r in ("r0", "r1")}
    for rep in reps.values():
        core.report(rep())
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    assert assigned(core.submit(RequestMeta("p", [1] * 8, params, tenant="t"))) == [("p", "r0")]
    assert core.counters()["t"] == 8 + 2 * 5  # prompt + prepaid output
    # least loaded would be r1; the sibling follows its parent to r0 (it has a free seat)
    sib = RequestMeta("p-1", [1] * 8, params, tenant="t", fork_of="p")
    assert assigned(core.submit(sib)) == [("p-1", "r0")]
    assert core.counters()["t"] == 8 + 2 * 5 + 2 * 5  # its prompt is not charged again
    # no room there: it goes wherever there is some, still without the prompt
    sib2 = RequestMeta("p-2", [1] * 8, params, tenant="t", fork_of="p")
    assert assigned(core.submit(sib2)) == [("p-2", "r1")]
    assert core.counters()["t"] == 8 + 3 * 2 * 5
    # a sibling that never ran gets its prepaid output back, and no prompt refund
    sib3 = RequestMeta("p-3", [1] * 8, params, tenant="t", fork_of="p")
    core.submit(sib3)  # queued: every seat is taken
    core.cancel("p-3")
    assert core.counters()["t"] == 8 + 3 * 2 * 5


def test_stats_count_each_tenants_queued_requests():
    core = FairnessCore(ControllerConfig(policy="weighted_fair"))  # no replica: all wait
    for rid, tenant in [("a1", "a"), ("a2", "a"), ("b1", "b"), ("a3", "a"), ("b2", "b")]:
        core.submit(meta(rid, tenant=tenant))
    assert core.stats()["queued_by_tenant"] == {"a": 3, "b": 2}
    core.cancel("b1")
    core.cancel("b2")
    core.cancel("a2")
    assert core.stats()["queued_by_tenant"] == {"a": 2}


def test_a_lora_request_goes_where_its_adapter_is_resident_while_it_would_not_wait():
    core = FairnessCore(ControllerConfig(local_queue=1))
    reps = {r: Reporter(r, seats=2) for r in ("r0", "r1", "r2")}
    for rid, rep in reps.items():
        core.report(rep(loras=["x"] if rid == "r1" else None))
    # x is in r1's slots: its requests go there, past r0 (first of the least loaded) ...
    assert assigned(core.submit(lora_meta("x1", "x"))) == [("x1", "r1")]
    # ... base-model requests and an adapter resident nowhere go to the least loaded
    assert assigned(core.submit(lora_meta("b1", None))) == [("b1", "r0")]
    assert assigned(core.submit(lora_meta("y1", "y"))) == [("y1", "r2")]
    # r1 has 1 of 2 seats taken: x still goes there; then its seats are full and it has more
    # requests than the least loaded replica (1): x waits nowhere, it goes to r0
    assert assigned(core.submit(lora_meta("x2", "x"))) == [("x2", "r1")]
    assert assigned(core.submit(lora_meta("x3", "x"))) == [("x3", "r0")]
    # r1 evicted x and r2 holds it now; b1 ended, so r0 is the least loaded again (1 request,
    # as r2): x goes to r2, where it is resident
    core.report(reps["r1"](loras=[]))
    core.report(reps["r2"](loras=["y", "x"]))
    core.report(reps["r0"](finished=[("b1", 10)]))
    assert assigned(core.submit(lora_meta("x4", "x"))) == [("x4", "r2")]
    assert assigned(core.submit(lora_meta("b2", None))) == [("b2", "r0")]
