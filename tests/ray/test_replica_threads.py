"""A CPU replica's torch threads by default: its share of the node's cores, by the share of the
node's (fake) GPUs it holds, so the replicas on a node split the cores between them."""

from __future__ import annotations

import os

import pytest

ray = pytest.importorskip("ray")

from fairbatch.deployments.cluster.replica_config import (  # noqa: E402
    ReplicaConfig,
    build_core,
    cpu_threads,
)

NODE_GPUS = 4


@pytest.fixture(scope="module")
def node(ray_starter):
    ray_starter(num_gpus=NODE_GPUS)
    yield
    ray.shutdown()


def expected(gpus: float) -> int:
    cores = len(os.sched_getaffinity(0))
    return 1 if gpus == 0 else max(1, int(cores * gpus / NODE_GPUS))


def test_outside_ray_a_model_gets_every_core(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    assert cpu_threads() == len(os.sched_getaffinity(0))


def test_a_driver_with_ray_up_gets_every_core(node):
    assert cpu_threads() == len(os.sched_getaffinity(0))


def test_a_replica_gets_its_gpu_share_of_the_cores(node):
    @ray.remote(num_cpus=0)
    def threads() -> int:
        return cpu_threads()

    shares = (4, 2, 1, 0.5, 0)
    got = [ray.get(threads.options(num_gpus=g).remote()) for g in shares]
    assert got == [expected(g) for g in shares]


def test_build_core_sets_the_default_and_an_explicit_count(node):
    @ray.remote(num_cpus=0, num_gpus=2)
    def threads(torch_threads: int) -> int:
        import torch

        build_core(ReplicaConfig(engine="tiny", num_gpu_blocks=16, torch_threads=torch_threads))
        return torch.get_num_threads()

    assert ray.get(threads.remote(0)) == expected(2)
    assert ray.get(threads.remote(3)) == 3


def test_a_replica_actor_steps_its_model_with_its_share(node):
    from fairbatch.deployments.cluster.replica import Replica

    @ray.remote(num_cpus=0, num_gpus=NODE_GPUS, max_concurrency=100)
    class Probe(Replica):
        async def threads(self) -> int:
            import torch

            return await self.engine.call(torch.get_num_threads)  # on the engine thread

    rep = Probe.remote("probe", ReplicaConfig(engine="tiny", num_gpu_blocks=16))
    assert ray.get(rep.threads.remote()) == expected(NODE_GPUS)  # every core here
    ray.kill(rep)
