"""A client process (an ingress) that dies with requests queued at the controller: its queued
requests are cancelled there rather than placed and run unread to their last token, its
assignment stream ends, and its requests already running end on the replica (which the
controller told whom to watch, also for requests it forwarded before the client opened its
channel there). Another client is served throughout. Every wait is bounded."""

from __future__ import annotations

import asyncio
import time

import pytest
import ray

from fairbatch.deployments.cluster.client import ClusterClient
from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.launch import start_cluster
from fairbatch.deployments.cluster.replica import ReplicaConfig
from fairbatch.engine.sampling_params import SamplingParams

SEATS = 2
LONG = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_starter):
    ray_starter(num_gpus=1)
    # a sim replica paced at 20x its modelled GPU time: a long request takes minutes
    cfg = ReplicaConfig(engine="sim", num_gpu_blocks=512, max_num_seqs=SEATS, time_scale=20.0)
    c = start_cluster("deadsub", [cfg], ControllerConfig(local_queue=0))
    yield c
    c.shutdown()
    ray.shutdown()


@ray.remote(num_cpus=0)
class Flood:
    """A client process: keeps `n` long requests going through its own ClusterClient."""

    def __init__(self, controller) -> None:
        self.client = ClusterClient(controller, item_timeout_s=600, admit_timeout_s=600)
        self.tokens = 0
        self.tasks: list = []

    async def start(self, n: int) -> None:
        async def one(i: int) -> None:
            async for item in self.client.generate([5 + i, 6, 7], LONG, tenant="flood"):
                self.tokens += len(item.token_ids)

        self.tasks = [asyncio.ensure_future(one(i)) for i in range(n)]

    async def progress(self) -> int:
        return self.tokens


def wait_until(pred, timeout_s: float, what: str):
    """`pred()` -> (done, what it saw); returns what it saw once done."""
    deadline = time.monotonic() + timeout_s
    while True:
        done, seen = pred()
        if done:
            return seen
        assert time.monotonic() < deadline, f"{what}: {seen}"
        time.sleep(0.2)


def test_a_dead_clients_queued_requests_are_cancelled_and_its_running_ones_end(cluster):
    ctl = cluster.controller
    (rep,) = cluster.replicas.values()
    flood = Flood.remote(ctl)
    ray.get(flood.start.remote(SEATS + 4), timeout=60)

    def stats() -> tuple[dict, dict]:
        return ray.get(ctl.stats.remote(), timeout=30), ray.get(rep.stats.remote(), timeout=30)

    def flooding():
        c, r = stats()
        return c["queued_by_tenant"].get("flood", 0) == 4 and r["running"] == SEATS, (c, r)

    before, _ = wait_until(flooding, 60, "the flood never filled the seats and the queue")
    assert before["watched_subscribers"] >= 1

    def tokens():
        n = ray.get(flood.progress.remote(), timeout=30)
        return n > 0, n

    wait_until(tokens, 60, "no tokens reached the client")
    ray.kill(flood, no_restart=True)

    def cleaned():
        c, r = stats()
        ok = not c["queued_by_tenant"].get("flood") and r["running"] + r["waiting"] == 0
        ok = ok and c["watched_subscribers"] == before["watched_subscribers"] - 1
        return ok, (c["queued_by_tenant"], c["watched_subscribers"], r["running"], r["waiting"])

    wait_until(cleaned, 30, "the dead client's requests are still there")
    after, _ = stats()
    assert after["subscribers"] == before["subscribers"] - 1  # its stream ended, its box gone

    async def served() -> int:  # the cluster serves another client at once
        client = ClusterClient(ctl, item_timeout_s=60)
        n = 0
        async for item in client.generate([1, 2, 3], SamplingParams(max_tokens=5), tenant="x"):
            n += len(item.token_ids)
        return n

    assert asyncio.run(asyncio.wait_for(served(), 60)) == 5
