"""Admission across controller faults, driven in process (no Ray cluster): the controller tells
a client where its request runs only once the replica holds it; a submission that arrives
under a subscriber id its client has replaced is answered on the new stream; the client's
batcher bounds the wait for a controller that never takes the request, and not the wait of one
that holds it in its queue."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")

from fairbatch.deployments.cluster.admission import (  # noqa: E402
    AdmissionBatcher,
    AdmissionTimeout,
)
from fairbatch.deployments.cluster.controller import Controller  # noqa: E402
from fairbatch.deployments.cluster.fairness import ControllerConfig  # noqa: E402
from fairbatch.deployments.cluster.wire import Assignment, ReplicaReport, RequestMeta  # noqa: E402
from fairbatch.engine.sampling_params import SamplingParams  # noqa: E402


def meta(i: int, consumer: str | None = "c1") -> RequestMeta:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return RequestMeta(f"r{i}", [10 + i, 20 + i, 30 + i], params, consumer=consumer)


def report(replica_id: str, handle, seats: int = 2) -> ReplicaReport:
    return ReplicaReport(replica_id, 1, seats, 64, 64, 16, 0, 0, 0, 0, {}, [], {}, handle=handle)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class _GatedReplica:
    """A replica handle whose `submit` returns once `gate` is set (or raises `error`)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.gate = asyncio.Event()
        self.held: list[str] = []

        async def submit(consumer, metas, owner):
            await self.gate.wait()
            if error is not None:
                raise error
            self.held.extend(m.request_id for m in metas)
            return [None] * len(metas)

        self.submit = _Method(submit)


async def _next(stream, timeout_s: float = 5.0):
    return await asyncio.wait_for(stream.__anext__(), timeout_s)


@pytest.mark.parametrize("dies", [False, True], ids=["holds", "died"])
def test_the_client_hears_where_its_request_runs_once_the_replica_answered(dies):
    """No assignment while the replica's submit is in flight: a controller that died then
    would leave the client reading a replica that never got the request. After the answer,
    the assignment comes; also when the replica died meanwhile (the client's channel to it then
    breaks, and it resubmits)."""

    async def main():
        ctl = Controller(ControllerConfig(local_queue=0))
        rep = _GatedReplica(RuntimeError("replica died") if dies else None)
        await ctl.report(report("ra", rep))
        stream = ctl.assignments("s1", None)
        first = asyncio.ensure_future(_next(stream))
        await asyncio.sleep(0)
        acked = await ctl.submit_many("s1", [meta(0)])
        await asyncio.sleep(0.2)
        early = first.done()
        held_then = list(rep.held)
        rep.gate.set()
        _, batch = await first
        return acked, early, held_then, rep.held, batch

    acked, early, held_then, held, batch = run(main())
    assert acked == ["r0"]
    assert not early and held_then == []
    assert held == ([] if dies else ["r0"])
    assert [(a.request_id, a.replica_id) for a in batch] == [("r0", "ra")]


def test_a_late_submission_under_a_replaced_subscriber_is_answered_on_the_new_stream():
    """A restarted controller hears the client's new stream (replacing the old id) before a
    retried submission the client sent under the old id: the assignment must come on the new
    stream, not into an outbox nobody reads."""

    async def main():
        ctl = Controller(ControllerConfig(local_queue=0))
        rep = _GatedReplica()
        rep.gate.set()
        await ctl.report(report("ra", rep))
        new = ctl.assignments("c.1", None, replaces="c.0")
        first = asyncio.ensure_future(_next(new))
        await asyncio.sleep(0)
        await ctl.submit_many("c.0", [meta(0)])  # the retried call, late
        _, batch = await first
        return batch, set(ctl._outboxes)

    batch, outboxes = run(main())
    assert [(a.request_id, a.replica_id) for a in batch] == [("r0", "ra")]
    assert outboxes == {"c.1"}


class _FakeController:
    """The controller as the batcher calls it: `submit_many` answers (or raises while `down`),
    `assignments` streams what `assign()` puts out, and `restart()` breaks the stream."""

    def __init__(self, ack: bool = True) -> None:
        self.down = False
        self.ack = ack
        self.submitted: list[tuple[str, list[str]]] = []
        self.ended: list[tuple[str, int]] = []  # end notices, as submissions carried them
        self.streams: list[asyncio.Queue] = []

        async def submit_many(subscriber, metas, ended=()):
            if self.down:
                raise ConnectionError("controller down")
            self.submitted.append((subscriber, [m.request_id for m in metas]))
            self.ended.extend(ended)
            return [m.request_id for m in metas] if self.ack else []

        self.submit_many = _Method(submit_many)
        self.assignments = self

    def options(self, **_):
        return self

    def remote(self, subscriber, owner, previous):
        queue: asyncio.Queue = asyncio.Queue()
        self.streams.append(queue)

        async def gen():
            if self.down:  # as a dead actor's stream: it fails at once
                raise ConnectionError("controller down")
            while True:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield asyncio.sleep(0, result=item)

        return gen()

    def assign(self, rid: str) -> None:
        self.streams[-1].put_nowait(({}, [Assignment(rid, "ra", None)]))

    def restart(self) -> None:
        self.streams[-1].put_nowait(ConnectionError("controller died"))


def test_admission_fails_when_no_controller_takes_the_request_in_time():
    """The controller is down for good (every submission and every re-subscription fails at
    once): the request ends with AdmissionTimeout after the acknowledgement bound, long before
    its overall bound; the failed re-subscriptions do not extend it."""

    async def main():
        fake = _FakeController()
        fake.down = True
        batcher = AdmissionBatcher(lambda: fake)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(AdmissionTimeout, match="did not take the request"):
            await batcher.admit(meta(0, None), timeout_s=30.0, ack_timeout_s=0.5)
        return loop.time() - t0

    waited = run(main())
    assert 0.5 <= waited < 5.0


def test_a_request_the_controller_holds_waits_in_its_queue_past_the_bound():
    """Acknowledged (queued at the controller): it waits for its turn beyond the
    acknowledgement bound and gets its assignment."""

    async def main():
        fake = _FakeController()
        batcher = AdmissionBatcher(lambda: fake)
        admit = asyncio.ensure_future(batcher.admit(meta(0, None), 30.0, ack_timeout_s=0.3))
        await asyncio.sleep(1.0)  # its turn comes later than the bound
        fake.assign("r0")
        return await admit, fake.submitted

    assignment, submitted = run(main())
    assert assignment.request_id == "r0" and assignment.replica_id == "ra"
    assert [rids for _, rids in submitted] == [["r0"]]


def test_a_controller_restart_voids_the_acknowledgement_and_the_request_is_sent_again():
    """Acknowledged, then the controller dies: the client re-subscribes and submits it again;
    while the restarted controller is down the bound runs again and ends the wait; when it
    comes back in time and takes it, the request is placed."""

    async def main(comes_back: bool):
        fake = _FakeController()
        batcher = AdmissionBatcher(lambda: fake)
        admit = asyncio.ensure_future(batcher.admit(meta(0, None), 30.0, ack_timeout_s=0.6))
        await asyncio.sleep(1.0)  # acknowledged: waiting past the bound is fine
        assert not admit.done()
        fake.down = True
        fake.restart()
        if comes_back:
            await asyncio.sleep(0.3)
            fake.down = False
            while len(fake.submitted) < 2:
                await asyncio.sleep(0.01)
            fake.assign("r0")
        try:
            return await admit, fake.submitted
        except AdmissionTimeout as e:
            return e, fake.submitted

    timed_out, _ = run(main(False))
    assert isinstance(timed_out, AdmissionTimeout)
    assignment, submitted = run(main(True))
    assert assignment.request_id == "r0"
    assert [rids for _, rids in submitted] == [["r0"], ["r0"]]
    assert submitted[0][0] != submitted[1][0]  # sent again under the new subscriber id


def test_ended_streams_ride_along_with_the_next_submission_and_survive_a_failed_one():
    """`end(rid, n)` is told to the controller with the next `submit_many` (not a call of its
    own); a submission that fails keeps the notices for the one that succeeds."""

    async def main():
        fake = _FakeController()
        batcher = AdmissionBatcher(lambda: fake)
        first = asyncio.ensure_future(batcher.admit(meta(0, None), 30.0, ack_timeout_s=5.0))
        while not fake.submitted:
            await asyncio.sleep(0.01)
        fake.assign("r0")
        await first
        batcher.end("r0", 7)
        await asyncio.sleep(0.05)
        assert fake.ended == []  # nothing to submit: nothing sent
        fake.down = True
        second = asyncio.ensure_future(batcher.admit(meta(1, None), 30.0, ack_timeout_s=5.0))
        await asyncio.sleep(0.2)  # (its submission fails, retried)
        fake.down = False
        while len(fake.submitted) < 2:
            await asyncio.sleep(0.01)
        fake.assign("r1")
        await second
        return fake.ended

    assert run(main()) == [("r0", 7)]
