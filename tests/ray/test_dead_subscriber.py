"""A client process that dies with requests queued at the controller - an actor (an ingress), or
a Ray driver: its queued requests are cancelled there rather than placed and run unread to
their last token, its assignment stream ends, and its requests already running end on the
replica (which the controller told whom to watch, also for requests it forwarded before the
client opened its channel there). Both are known dead by the GCS: an actor by its entry in the
actor table, a driver by its job's. Another client is served throughout. Every wait is bounded."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest
import ray

from fairbatch.deployments.cluster.channel import ActorOwner, DriverOwner, owner_is_dead
from fairbatch.deployments.cluster.client import ClusterClient
from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.launch import NAMESPACE, start_cluster
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


# A driver of its own: floods the cluster through its ClusterClient, prints its token count
# every 0.2 s, and runs until it is killed.
FLOOD_DRIVER = r"""
import asyncio, sys
import ray
from fairbatch.deployments.cluster.client import ClusterClient
from fairbatch.engine.sampling_params import SamplingParams

address, controller, namespace, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
ray.init(address=address, log_to_driver=False)
params = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)
tokens = 0

async def one(client, i):
    global tokens
    async for item in client.generate([5 + i, 6, 7], params, tenant="flood"):
        tokens += len(item.token_ids)

async def main():
    ctl = ray.get_actor(controller, namespace=namespace)
    client = ClusterClient(ctl, item_timeout_s=600, admit_timeout_s=600)
    tasks = [asyncio.ensure_future(one(client, i)) for i in range(n)]
    while True:
        print(tokens, flush=True)
        await asyncio.sleep(0.2)

asyncio.run(main())
"""


def a_client_dies(cluster, tokens_so_far, kill) -> None:
    """With a client flooding the cluster (`SEATS` running, 4 queued): once tokens reach it,
    `kill()` it; then nothing of it is left at the controller or on the replica, and another
    client is served."""
    ctl = cluster.controller
    (rep,) = cluster.replicas.values()

    def stats() -> tuple[dict, dict]:
        return ray.get(ctl.stats.remote(), timeout=30), ray.get(rep.stats.remote(), timeout=30)

    def flooding():  # (the client's assignment stream, which names its owner, may start last)
        c, r = stats()
        full = c["queued_by_tenant"].get("flood", 0) == 4 and r["running"] == SEATS
        return full and c["watched_subscribers"] >= 1, (c, r)

    before, _ = wait_until(flooding, 60, "the flood never filled the seats and the queue")

    def tokens():
        n = tokens_so_far()
        return n > 0, n

    wait_until(tokens, 60, "no tokens reached the client")
    kill()

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


@ray.remote(num_cpus=0)
class Idle:
    def ready(self) -> str:
        return ray.get_runtime_context().get_actor_id()


def test_the_gcs_tells_a_dead_owner_from_a_live_one(cluster):
    """`owner_is_dead` reads the GCS: a live actor and this driver's job are not dead; a
    killed actor is, and so is an id the GCS does not know (it forgets dead actors past a
    count); no answer in time is not proof, even for a dead one."""
    actor = Idle.remote()
    owner = ActorOwner(ray.get(actor.ready.remote(), timeout=30))
    job = DriverOwner(ray.get_runtime_context().get_job_id())

    def dead(o, timeout_s: float = 10.0) -> bool:
        return asyncio.run(owner_is_dead(o, timeout_s))

    assert not dead(owner) and not dead(job)
    ray.kill(actor, no_restart=True)
    wait_until(lambda: (dead(owner), owner), 30, "the killed actor is not dead in the GCS")
    assert not dead(owner, timeout_s=0.0)  # no answer in time
    assert dead(ActorOwner("ff" * 16))  # a well-formed id the GCS never had


def test_a_dead_clients_queued_requests_are_cancelled_and_its_running_ones_end(cluster):
    flood = Flood.remote(cluster.controller)
    ray.get(flood.start.remote(SEATS + 4), timeout=60)
    progress = lambda: ray.get(flood.progress.remote(), timeout=30)  # noqa: E731
    try:
        a_client_dies(cluster, progress, lambda: ray.kill(flood, no_restart=True))
    finally:  # (also when it failed: the next test starts from an idle cluster)
        ray.kill(flood, no_restart=True)


def test_a_dead_drivers_queued_requests_are_cancelled_and_its_running_ones_end(cluster):
    address = ray.get_runtime_context().gcs_address
    args = [address, f"{cluster.name}-controller", NAMESPACE, str(SEATS + 4)]
    proc = subprocess.Popen(
        [sys.executable, "-c", FLOOD_DRIVER, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        last = [0]

        def progress() -> int:  # its latest printed count (it prints every 0.2 s)
            line = proc.stdout.readline()
            assert line, f"the driver exited: {proc.wait(5)}"
            last[0] = int(line)
            return last[0]

        a_client_dies(cluster, progress, proc.kill)
        assert proc.wait(10) != 0 and last[0] > 0
    finally:
        proc.kill()
        proc.wait(10)
