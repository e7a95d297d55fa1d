"""The replica side of the serving plane, driven directly (a `Replica` on a sim engine, no Ray
cluster): one consumer's requests come out as one message per engine step, a consumer that
stops reading is dropped with a clear error before the replica's memory grows without bound,
and what the controller submits for a consumer reaches it once."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from fairbatch.deployments.cluster.channel import ActorOwner  # noqa: E402
from fairbatch.deployments.cluster.replica import Replica, ReplicaConfig  # noqa: E402
from fairbatch.deployments.cluster.wire import RequestMeta  # noqa: E402
from fairbatch.engine.sampling_params import SamplingParams  # noqa: E402


def meta(i: int, max_tokens: int) -> RequestMeta:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return RequestMeta(f"r{i}", [10 + i, 20 + i, 30 + i, 40 + i], params)


def replica(**kw) -> Replica:
    cfg = ReplicaConfig(engine="sim", num_gpu_blocks=64, max_num_seqs=4, **kw)
    return Replica("rep", cfg)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def read_until_finished(channel, n: int) -> list:
    """The channel's items up to the n-th finished one; then the channel is closed."""
    items = []
    async for msg in channel:
        items.extend(msg)
        if sum(1 for it in items if it.finished) == n:
            break
    await channel.aclose()
    return items


def test_one_message_per_step_carries_every_request_of_the_consumer():
    async def main():
        rep = replica()
        channel = rep.channel("c1")
        assert await rep.submit("c1", [meta(i, 12) for i in range(4)]) == [None] * 4
        messages = []
        async for msg in channel:
            messages.append(msg)
            await asyncio.sleep(0.002)  # a reader slower than the engine: batches grow
            if sum(1 for m in messages for it in m if it.finished) == 4:
                break
        await channel.aclose()
        await rep.engine.shutdown()
        return messages, rep

    messages, rep = run(main())
    items = [it for m in messages for it in m]
    for i in range(4):  # every request's tokens, in order, ending with its finish
        mine = [it for it in items if it.request_id == f"r{i}"]
        assert sum(len(it.token_ids) for it in mine) == 12 and mine[-1].finish_reason == "length"
    steps = {it.step for it in items}
    # all four running: from r3's first token to the first finish
    both = range(min(it.step for it in items if it.request_id == "r3"),
                 min(it.step for it in items if it.finished) + 1)  # fmt: skip
    assert len(both) >= 5
    for step in steps:  # a step's deltas never span two messages...
        holders = [k for k, m in enumerate(messages) if any(it.step == step for it in m)]
        assert len(holders) == 1, step
        if step in both:  # ...and carry every running request of the consumer
            assert len({it.request_id for it in messages[holders[0]] if it.step == step}) == 4
    assert len(messages) <= len(steps) and len(messages) < len(items)
    assert rep.core.scheduler.kv.all_free()


def test_the_engine_is_built_on_the_thread_that_steps_it(monkeypatch):
    """All of a replica's model work is on its engine thread: on CPU a model built on the
    actor's thread, which lives on, leaves a second OpenMP team that slows every step."""
    import threading

    from fairbatch.deployments.cluster import replica as replica_module

    built_on, paced_on = [], set()
    build_core, pace_step = replica_module.build_core, replica_module.pace_step

    def recording_build(cfg):
        built_on.append(threading.get_ident())
        return build_core(cfg)

    def recording_pace(core, scale):
        paced_on.add(threading.get_ident())
        pace_step(core, scale)

    monkeypatch.setattr(replica_module, "build_core", recording_build)
    monkeypatch.setattr(replica_module, "pace_step", recording_pace)

    async def main():
        rep = replica()
        items = read_until_finished(rep.channel("c1"), 2)
        assert await rep.submit("c1", [meta(i, 5) for i in range(2)]) == [None] * 2
        items = await items
        await rep.engine.shutdown()
        return items

    items = run(main())
    assert sum(len(it.token_ids) for it in items) == 10
    assert len(built_on) == 1 and built_on[0] != threading.get_ident()
    assert paced_on == set(built_on)


def test_a_consumer_that_stops_reading_is_dropped_with_an_error():
    async def main():
        rep = replica()
        rep.unread_items_per_seat = 5  # an outbox of 20 items at most (4 seats)
        channel = rep.channel("slow")
        assert await rep.submit("slow", [meta(i, 400) for i in range(4)]) == [None] * 4
        box = rep._boxes["slow"]
        largest = 0
        for _ in range(400):  # the engine runs; nobody reads
            largest = max(largest, len(box.items))
            if not box.requests:
                break
            await asyncio.sleep(0.005)
        assert not box.requests, "the stalled consumer's requests were not dropped"
        got = await channel.__anext__()  # what it finds when it reads again
        await channel.aclose()
        await rep.engine.shutdown()
        return rep, box, got, largest

    rep, box, got, largest = run(main())
    assert largest <= box.limit == 20  # bounded: never more than the limit held
    assert sorted(it.request_id for it in got) == ["r0", "r1", "r2", "r3"]  # unread dropped
    for it in got:
        assert it.finished and it.finish_reason == "error"
        assert "stopped reading" in it.error and "20 unread items" in it.error
    rep.core.check_integrity()
    assert rep.core.scheduler.kv.all_free()  # aborted: every block back
    assert rep.core.scheduler.num_waiting == 0 and not rep.core.scheduler.running


def test_one_bad_request_in_a_batch_is_refused_alone():
    """A bad request (its prompt over the limit), and a second copy of one in the same batch,
    are refused; the others run. The refused one ends with one error item in its consumer's
    channel; the copy adds nothing (the one running is its request)."""

    async def main():
        rep = replica(time_scale=1.0)  # steps of modelled length: r0 still runs for the 3rd
        channel = rep.channel("c")
        too_long = RequestMeta("long", list(range(10, 2010)), SamplingParams(max_tokens=4))
        errors = await rep.submit("c", [meta(0, 6), too_long, meta(0, 6), meta(1, 6)])
        items = await read_until_finished(channel, 3)
        await rep.engine.shutdown()
        return rep, errors, items

    rep, errors, items = run(main())
    assert errors[0] is None and errors[3] is None
    assert errors[1].startswith("ValueError") and "r0" in errors[2] and "duplicate" in errors[2]
    done = [(it.request_id, it.finish_reason) for it in items if it.finished]
    assert sorted(done) == [("long", "error"), ("r0", "length"), ("r1", "length")]
    assert [len(it.token_ids) for it in items if it.request_id == "long"] == [0]
    assert sum(len(it.token_ids) for it in items if it.request_id == "r0") == 6
    assert "long" not in rep._routes and rep.core.scheduler.kv.all_free()


def test_a_submission_refused_or_repeated_reaches_its_consumer_once():
    """The controller submits for the consumer: nobody waits for the answer, so a refused
    request ends with an error item in the consumer's channel, and the same request submitted
    again (a restarted controller placing it anew) is the one already running."""

    async def main():
        rep = replica(time_scale=1.0)  # steps of modelled length: r0 still runs for the 3rd
        channel = rep.channel("c")
        too_long = RequestMeta("long", list(range(10, 2010)), SamplingParams(max_tokens=4))
        first = await rep.submit("c", [meta(0, 6), too_long])
        again = await rep.submit("c", [meta(0, 6)])
        elsewhere = await rep.submit("other", [meta(0, 6)])  # another consumer
        items = await read_until_finished(channel, 2)
        other = rep._boxes["other"].take()
        await rep.engine.shutdown()
        return rep, first, again, elsewhere, items, other

    rep, first, again, elsewhere, items, other = run(main())
    assert first[0] is None and first[1].startswith("ValueError") and again == [None]
    assert "duplicate" in elsewhere[0]
    refused = [it for it in items if it.request_id == "long"]
    assert len(refused) == 1 and refused[0].finished and refused[0].finish_reason == "error"
    assert "refused: ValueError" in refused[0].error
    r0 = [it for it in items if it.request_id == "r0"]
    assert sum(len(it.token_ids) for it in r0) == 6 and r0[-1].finish_reason == "length"
    assert [(it.request_id, it.finish_reason) for it in other] == [("r0", "error")]
    assert rep.core.scheduler.kv.all_free()


def test_a_dead_consumers_late_submissions_are_refused_not_run(monkeypatch):
    """Once the owner check finds a consumer dead, its requests are aborted, and what the
    controller still forwards for it (its requests queued there) is refused: an orphan would
    otherwise run to its last token with nobody reading. Other consumers are served."""
    from fairbatch.deployments.cluster import channel as channel_module
    from fairbatch.deployments.cluster import replica as replica_module

    async def dead(owner, timeout_s):
        return owner == ActorOwner("dead-owner")

    monkeypatch.setattr(channel_module, "owner_is_dead", dead)

    async def main():
        rep = replica()
        first = await rep.submit("c", [meta(0, 400)], owner=ActorOwner("dead-owner"))
        await rep._check_owner(rep._boxes["c"])
        late = await rep.submit("c", [meta(1, 400), meta(2, 400)])
        moved = await rep.adopt("c", object())
        left = await rep.engine.call(rep.core.has_unfinished)
        other = rep.channel("d")
        served = await rep.submit("d", [meta(3, 5)])
        items = await read_until_finished(other, 1)
        await rep.engine.shutdown()
        return rep, first, late, moved, left, served, items

    rep, first, late, moved, left, served, items = run(main())
    assert first == [None] and late == [replica_module.DEAD_CONSUMER] * 2
    assert moved == replica_module.DEAD_CONSUMER and "c" not in rep._boxes and not left
    assert served == [None] and sum(len(it.token_ids) for it in items) == 5
    assert rep.core.scheduler.kv.all_free()


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Handle:
    """A `Replica` in this process dressed as its actor handle, for `ReplicaLink`."""

    def __init__(self, rep: Replica) -> None:
        async def channel(consumer, owner):
            async for msg in rep.channel(consumer, owner):
                ref = asyncio.get_running_loop().create_future()
                ref.set_result(msg)
                yield ref

        self.channel = _Method(channel)


def test_items_of_an_expected_request_wait_for_its_queue():
    """Items of a request the controller submitted can come before its client has opened the
    request's queue (it has not heard the assignment yet): the link keeps those of the
    requests its client expects until `open`, and drops the rest."""
    from fairbatch.deployments.cluster.channel import ReplicaLink

    async def main():
        rep = replica()
        link = ReplicaLink("rep", _Handle(rep), "c", None, expected={"r0"})
        assert await rep.submit("c", [meta(0, 5), meta(1, 5)]) == [None] * 2
        for _ in range(2000):
            if not rep._routes:  # both finished and sent
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # the link reads the last message
        queue = link.open("r0")
        got = [queue.get_nowait() for _ in range(queue.qsize())]
        late = link.open("r1")
        link.shutdown()
        await rep.engine.shutdown()
        return got, late

    got, late = run(main())
    assert sum(len(it.token_ids) for it in got) == 5 and got[-1].finish_reason == "length"
    assert all(it.request_id == "r0" for it in got) and late.empty()


# ---- the controller's side: a subscriber's process that dies ------------------------------------


class _Recorder:
    """A replica actor handle for an in-process controller: records `submit` calls."""

    def __init__(self, calls: list) -> None:
        async def submit(consumer, metas, owner):
            calls.append((self, consumer, [m.request_id for m in metas], owner))
            return [None] * len(metas)

        self.submit = _Method(submit)


class _Preemptible:
    """A replica actor handle for an in-process controller: `preempt` on the `Replica`."""

    def __init__(self, rep: Replica) -> None:
        self.preempt = _Method(rep.preempt)


def test_the_controllers_preemption_preempts_its_request_on_the_replica_once():
    from fairbatch.deployments.cluster.controller import Controller
    from fairbatch.deployments.cluster.fairness import ControllerConfig
    from fairbatch.deployments.cluster.tickets import Preempt

    async def main():
        rep = replica(time_scale=1.0)
        ctl = Controller(ControllerConfig(local_queue=0))
        channel = rep.channel("c")
        assert await rep.submit("c", [meta(0, 400)]) == [None]
        while not rep.core.scheduler.running:  # it started
            await asyncio.sleep(0.01)
        await ctl._preempt(Preempt("rep", "r0", "recompute"), _Preemptible(rep))
        preempted = dict(rep.core.scheduler.num_preemptions)
        await rep.abort("r0")
        await read_until_finished(channel, 1)
        await rep.engine.shutdown()
        return preempted

    preempted = run(main())
    assert preempted.get("recompute") == 1 and sum(preempted.values()) == 1


def report(replica_id: str, handle, seats: int):
    from fairbatch.deployments.cluster.wire import ReplicaReport

    return ReplicaReport(replica_id, 1, seats, 64, 64, 16, 0, 0, 0, 0, {}, [], {}, handle=handle)


def test_forwards_carry_the_consumers_owner_and_a_dead_subscribers_queue_is_cancelled(
    monkeypatch,
):
    """The controller forwards a subscriber's requests with its process's owner, once per
    (replica, consumer), so a replica watches a consumer that has not opened a channel there;
    once that process is dead, its requests still queued are cancelled, its assignment stream
    ends and nothing is kept for it."""
    from fairbatch.deployments.cluster import channel as channel_module
    from fairbatch.deployments.cluster.controller import Controller
    from fairbatch.deployments.cluster.fairness import ControllerConfig

    owner = ActorOwner("owner-of-s1")

    async def dead(of, timeout_s):
        return of == owner

    monkeypatch.setattr(channel_module, "owner_is_dead", dead)

    def forwarded(i: int, consumer: str) -> RequestMeta:
        m = meta(i, 100)
        m.consumer = consumer
        return m

    async def main():
        ctl = Controller(ControllerConfig(local_queue=0))
        calls: list = []
        handles = {rid: _Recorder(calls) for rid in ("ra", "rb")}
        for rid, handle in handles.items():
            await ctl.report(report(rid, handle, seats=2))
        stream = ctl.assignments("s1", owner)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)  # the stream has registered its owner
        await ctl.submit_many("s1", [forwarded(i, "c1") for i in range(6)])  # 4 seats
        await asyncio.sleep(0.05)  # the forwards' tasks ran
        placed = (await asyncio.wait_for(first, 5))[1]
        queued = ctl.core.stats()["queued_by_tenant"]
        await ctl._check_subscribers()  # s1's process is dead now
        try:
            await asyncio.wait_for(stream.__anext__(), 5)
            ended = False
        except StopAsyncIteration:
            ended = True
        after = ctl.core.stats()["queued_by_tenant"]
        left = (ctl._subscriber_owner, ctl._consumer_owner, ctl._outboxes, ctl._owner)
        return calls, placed, queued, ended, after, left

    calls, placed, queued, ended, after, left = run(main())
    # every placed request was forwarded; the owner went with the first forward to each replica
    assert sorted(r for c in calls for r in c[2]) == sorted(a.request_id for a in placed)
    assert len(placed) == 4 and all(c[1] == "c1" for c in calls)
    owners: dict[int, list] = {}
    for handle, _, _, sent in calls:
        owners.setdefault(id(handle), []).append(sent)
    assert list(owners.values()) == [[owner, None], [owner, None]]
    assert queued == {"default": 2} and after == {}  # the two queued ones were cancelled
    assert ended and left == ({}, {}, {}, {})


def test_a_client_that_subscribes_again_ends_its_old_stream_and_gets_what_was_due_there():
    """A client whose assignment stream broke subscribes under a new id naming the old one:
    the old stream ends and is forgotten, and an assignment still due to the old id (a request
    queued under it) comes on the new stream."""
    from fairbatch.deployments.cluster.controller import Controller
    from fairbatch.deployments.cluster.fairness import ControllerConfig
    from fairbatch.deployments.cluster.wire import ReplicaReport

    async def main():
        ctl = Controller(ControllerConfig(local_queue=0))
        handle = _Recorder([])
        await ctl.report(report("ra", handle, seats=1))
        old = ctl.assignments("c.0", "owner")
        first = asyncio.ensure_future(old.__anext__())
        await asyncio.sleep(0)
        await ctl.submit_many("c.0", [meta(0, 10), meta(1, 10)])  # one seat: r1 waits
        (_, placed) = await asyncio.wait_for(first, 5)
        new = ctl.assignments("c.1", "owner", replaces="c.0")
        later = asyncio.ensure_future(new.__anext__())
        await asyncio.sleep(0)
        try:
            await asyncio.wait_for(old.__anext__(), 5)
            ended = False
        except StopAsyncIteration:
            ended = True
        # r0 leaves the replica: r1 takes the seat, and hears it on the new stream
        done = ReplicaReport(
            "ra", 2, 1, 64, 64, 16, 0, 0, 0, 1, {}, [("r0", 10)], {}, handle=handle
        )
        await ctl.report(done)
        (_, then) = await asyncio.wait_for(later, 5)
        return placed, ended, then, set(ctl._outboxes), dict(ctl._subscriber_owner)

    placed, ended, then, outboxes, owners = run(main())
    assert [a.request_id for a in placed] == ["r0"] and ended
    assert [(a.request_id, a.replica_id) for a in then] == [("r1", "ra")]
    assert outboxes == {"c.1"} and owners == {"c.1": "owner"}


def test_the_report_tells_waiting_from_started_and_a_started_request_is_not_moved_as_waiting():
    # What the controller's local-queue rebalancing reads and relies on: a request waiting
    # for a seat is reported not running; one running, or ended with its last items still on
    # their way, is reported started; a `waiting_only` move of a started request is refused.
    async def main():
        cfg = ReplicaConfig(engine="sim", num_gpu_blocks=64, max_num_seqs=2, time_scale=1.0)
        rep = Replica("rep", cfg)  # paced like its GPU: the requests run for seconds
        rep.channel("c1")
        assert await rep.submit("c1", [meta(i, 2000) for i in range(3)]) == [None] * 3
        while rep.engine.num_steps < 2:
            await asyncio.sleep(0.01)
        rep._meta["gone"] = ("default", 0, 8)  # ended here, its last items not yet delivered
        report = await rep.engine.call(rep._report, None)
        started = {rid: state[2] for rid, state in report.active.items()}
        refused = await rep.migrate_out("r0", "elsewhere", None, waiting_only=True)
        still = "r0" in rep._routes and rep.core.scheduler.requests["r0"].status.name
        del rep._meta["gone"]
        for i in range(3):
            await rep.abort(f"r{i}")
        await rep.engine.shutdown()
        return started, refused, still

    started, refused, still = run(main())
    assert started == {"r0": True, "r1": True, "r2": False, "gone": True}
    assert refused is False and still == "RUNNING"
