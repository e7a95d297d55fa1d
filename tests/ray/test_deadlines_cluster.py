"""Deadlines end to end on two tiny-Llama replicas (CPU) through `ClusterClient`: a request
past its `max_queue_time_s` while every seat is taken leaves the controller's queue with
"timeout" and no tokens, never assigned; a running request past its `timeout` ends with
"timeout" and the tokens it produced, its blocks freed; a request moved to the other replica
keeps the deadline it had (wall-clock time, set once at the client).
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
from fairbatch.engine import SamplingParams

CLUSTERS: list = []
# one running seat per replica and no local queue: a request sent while both seats are taken
# waits at the controller; 2048 positions leave room for requests that outlast their deadline
CFG = ReplicaConfig(
    engine="tiny",
    num_gpu_blocks=160,
    num_cpu_blocks=160,
    block_size=16,
    max_num_seqs=1,
    max_num_batched_tokens=256,
    max_model_len=2048,
)
LONG = 2000  # output tokens: several seconds of the tiny model on a CPU


def params(**deadlines) -> SamplingParams:
    return SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True, **deadlines)


@pytest.fixture(scope="module")
def cluster(ray_starter):
    ray_starter(num_gpus=2)
    c = start_cluster("deadlines", [CFG, CFG], ControllerConfig(local_queue=0))
    CLUSTERS.append(c)
    yield c
    c.shutdown()
    ray.shutdown()


def prompt(i: int, n: int = 8) -> list[int]:
    return [(i * 53 + j * 17) % 1900 + 20 for j in range(n)]


def client(c) -> ClusterClient:
    return ClusterClient(c.controller, item_timeout_s=60)


async def queued_past_its_queue_deadline(c) -> tuple[dict, list]:
    cc = client(c)
    holds = [cc.generate(prompt(10 + i), params(), request_id=f"hold-{i}") for i in range(2)]
    firsts = [await anext(h) for h in holds]  # both seats taken
    assert len({f.replica_id for f in firsts}) == 2
    assignments: list = []
    try:
        out = await collect(
            cc, prompt(1), params(max_queue_time_s=0.3), on_assign=assignments.append
        )
    finally:
        for h in holds:
            await h.aclose()  # frees both seats
    return out, assignments


def test_a_request_queued_past_its_queue_deadline_ends_unassigned_without_tokens(cluster):
    out, assignments = asyncio.run(queued_past_its_queue_deadline(cluster))
    assert out["finish_reason"] == "timeout"
    assert out["tokens"] == [] and out["replicas"] == []
    assert assignments == []  # the controller never gave it a replica


def test_a_running_request_past_its_timeout_keeps_its_tokens_and_frees_its_blocks(
    cluster, replica_check
):
    start = time.monotonic()
    out = asyncio.run(collect(client(cluster), prompt(2), params(timeout=1.0)))
    took = time.monotonic() - start
    assert out["finish_reason"] == "timeout"
    assert 0 < len(out["tokens"]) < LONG and len(out["replicas"]) == 1
    assert 1.0 <= took < 3.0, took
    replica_check(CLUSTERS)  # every block free again, nothing left at the controller


async def moved_while_running(c, timeout: float, move_after: float) -> tuple[dict, float, float]:
    """A request running on one replica, moved to the other `move_after` s after its submit;
    returns its result, when it was moved and when it ended (s from the submit)."""
    cc = client(c)
    start = time.monotonic()
    task = asyncio.ensure_future(collect(cc, prompt(3), params(timeout=timeout), request_id="mv"))
    await asyncio.sleep(move_after)
    dst = await migrate(c.controller, "mv")
    moved = time.monotonic() - start
    out = await task
    assert dst is not None and out["replicas"][-1] == dst
    return out, moved, time.monotonic() - start


def test_a_moved_request_keeps_its_original_deadline(cluster):
    timeout = 2.0
    out, moved, ended = asyncio.run(moved_while_running(cluster, timeout, move_after=1.0))
    assert out["finish_reason"] == "timeout" and len(out["replicas"]) == 2
    assert 0 < len(out["tokens"]) < LONG
    # a deadline restarted at the move would end it at moved + timeout (>= 3 s) or later
    assert ended < moved + timeout - 0.5, (moved, ended)
    assert ended >= timeout - 0.05, ended
