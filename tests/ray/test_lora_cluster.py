"""LoRA adapters across the cluster (issue 46): two replicas of the tiny Llama with 2 adapter
slots each serve base-model and adapter requests mixed, token for token as the offline engine
does under the same adapters (itself held equal to transformers + PEFT in
tests/engine/test_lora_engine.py); a request moved with its K/V to the other replica, and the
requests of a replica killed mid-stream, go on under their adapter there, exactly. Each
replica reads an adapter the first time a request (or a check) names it.

Order matters: the last test kills a replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import ray

pytest.importorskip("peft")

from lora_adapters import make_tiny_adapter  # noqa: E402

from fairbatch.deployments.cluster.client import ClusterClient, collect  # noqa: E402
from fairbatch.deployments.cluster.fairness import ControllerConfig  # noqa: E402
from fairbatch.deployments.cluster.launch import start_cluster  # noqa: E402
from fairbatch.deployments.cluster.replica import ReplicaConfig  # noqa: E402
from fairbatch.engine.sampling_params import LoRARequest, SamplingParams  # noqa: E402
from fairbatch.tests.ray.test_tiny_cluster import (  # noqa: E402
    migrate_after,
    prompt,
    run_and_kill,
)

CLUSTERS: list = []
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
NAMES = [None, "a", "b", "c"]  # request i runs under NAMES[i % 4]: 3 adapters, 2 slots each


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster_loras")
    return {n: LoRARequest(n, make_tiny_adapter(root / n, seed)) for seed, n in enumerate("abc")}


def params_of(loras, i: int) -> SamplingParams:
    name = NAMES[i % len(NAMES)]
    return GREEDY if name is None else dataclasses.replace(GREEDY, lora=loras[name])


@pytest.fixture(scope="module")
def cluster(ray_starter):
    ray_starter(num_gpus=2)
    cfg = ReplicaConfig(
        engine="tiny",
        num_gpu_blocks=64,
        num_cpu_blocks=64,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_model_len=512,
        max_loras=2,
        max_lora_rank=8,
    )
    c = start_cluster("tiny", [cfg, cfg], ControllerConfig())
    CLUSTERS.append(c)
    yield c
    c.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def offline(loras):
    """The offline engine's tokens of prompt(i) under NAMES[i % 4], i < 8."""
    from fairbatch.engine import LLM

    llm = LLM("tiny", num_gpu_blocks=64, max_model_len=512, max_loras=2, max_lora_rank=8)
    params = [params_of(loras, i) for i in range(8)]
    outs = llm.generate([prompt(i) for i in range(8)], params, use_tqdm=False)
    return [list(o.token_ids) for o in outs]


async def run_one(cluster, loras, i: int) -> list[dict]:
    client = ClusterClient(cluster.controller, item_timeout_s=60)
    return [await collect(client, prompt(i), params_of(loras, i))]


def wait_idle(cluster, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any((assigned := ray.get(cluster.controller.stats.remote())["assigned"]).values()):
        assert time.monotonic() < deadline, f"replicas still assigned requests: {assigned}"
        time.sleep(0.05)


def test_mixed_adapters_on_both_replicas_match_the_offline_engine(cluster, loras, offline):
    async def run() -> list[dict]:
        client = ClusterClient(cluster.controller, item_timeout_s=60)
        jobs = [collect(client, prompt(i), params_of(loras, i)) for i in range(8)]
        return list(await asyncio.gather(*jobs))

    served = asyncio.run(run())
    assert len({r["replicas"][0] for r in served}) == 2  # both replicas took some
    for i, (r, want) in enumerate(zip(served, offline)):
        assert r["tokens"] == want and len(want) == 40, i
    # sent again under its adapter, a prompt goes to the replica caching it under that adapter
    # (the client hashes it with the adapter's salt, as the replica's cache does), once the
    # controller knows from the replicas' reports that their seats are free again (a replica
    # it still thinks full takes no request for locality)
    wait_idle(cluster)
    (again,) = asyncio.run(asyncio.wait_for(run_one(cluster, loras, 5), 60))
    assert again["replicas"][0] == served[5]["replicas"][0]
    assert again["items"][0].num_cached_tokens == 16  # its 24-token prompt's full block
    # the adapters matter: each changes the base model's tokens of some prompt
    base = [offline[i] for i in range(8) if NAMES[i % 4] is None]
    assert all(offline[i] not in base for i in range(8) if NAMES[i % 4] is not None)


def test_a_moved_request_keeps_its_adapter(cluster, loras, offline):
    moved, dst = asyncio.run(migrate_after(cluster, prompt(1), params_of(loras, 1), 12))
    assert dst is not None and moved["replicas"][-1] == dst and len(moved["replicas"]) == 2
    assert moved["tokens"] == offline[1]


def test_a_killed_replicas_requests_go_on_under_their_adapters(cluster, loras, offline):
    # 2 base requests and 4 under a and b (the slots hold both: all 6 run at once), so the
    # replica streaming the most when it is killed streams an adapter request
    pick = [0, 1, 2, 4, 5, 6]
    prompts = [prompt(i) for i in pick]
    params = [params_of(loras, i) for i in pick]
    got, on_victim, victim = asyncio.run(run_and_kill(cluster, prompts, params, True))
    assert any(params[j].lora for j in on_victim), "no adapter request was on the victim"
    for j in on_victim:  # continued on the other replica
        assert got[j]["replicas"][0] == victim and got[j]["replicas"][-1] != victim
    for j, i in enumerate(pick):
        assert got[j]["tokens"] == offline[i], i
