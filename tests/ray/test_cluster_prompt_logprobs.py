"""Prompt log-probs and prefix-cache counts through the cluster, on two tiny-Llama replicas
(CPU): what `ClusterClient.generate` yields equals an in-process `LLM` run of the same prompt,
each field arrives once per request, also after the request moved to the other replica before
its first token, and a repeated prompt reports the whole blocks its replica had cached.
"""

from __future__ import annotations

import asyncio
import pickle

import pytest
import ray
from live_actors import migrate

from fairbatch.deployments.cluster.client import ClusterClient, collect
from fairbatch.deployments.cluster.fairness import ControllerConfig
from fairbatch.deployments.cluster.launch import ClusterHandles, start_cluster
from fairbatch.deployments.cluster.replica import ReplicaConfig
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.deployments.serve.backend import ClusterBackend
from fairbatch.engine import LLM, SamplingParams

CLUSTERS: list = []
BLOCK = 16
TOL = 1e-5
# one running seat per replica: a request sent while both run a long one waits in a queue
CFG = ReplicaConfig(
    engine="tiny",
    num_gpu_blocks=128,
    num_cpu_blocks=64,
    block_size=BLOCK,
    max_num_seqs=1,
    max_num_batched_tokens=256,
    max_model_len=512,
)
SCORED = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
PLAIN = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
HOLD = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)  # occupies a seat
HOLD_SCORED = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def cluster(ray_starter):
    ray_starter(num_gpus=2)
    c = start_cluster("plp", [CFG, CFG], ControllerConfig())
    CLUSTERS.append(c)
    yield c
    c.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", block_size=BLOCK, num_gpu_blocks=64, num_cpu_blocks=64, max_model_len=512)


def prompt(i: int, n: int = 30) -> list[int]:
    return [(i * 53 + j * 17) % 1900 + 20 for j in range(n)]


def client(c) -> ClusterClient:
    return ClusterClient(c.controller, item_timeout_s=60)


def sent(items: list, name: str) -> list:
    """The values of field `name` the items carried (None is not a value)."""
    return [getattr(i, name) for i in items if getattr(i, name) is not None]


def assert_close(got: list, ref: list) -> None:
    assert len(got) == len(ref) and got[0] is None and ref[0] is None
    for g, r in zip(got[1:], ref[1:]):
        assert [t for t, _ in g] == [t for t, _ in r]
        assert all(abs(a - b) <= TOL for (_, a), (_, b) in zip(g, r)), (g, r)


def check_scored(items: list, ref) -> None:
    """Prompt logprobs as in-process, with the first item only; the same tokens first."""
    assert items[0].prompt_logprobs is not None and len(sent(items, "prompt_logprobs")) == 1
    assert_close(items[0].prompt_logprobs, ref.prompt_logprobs)
    assert sent(items, "num_cached_tokens") == [0]  # such requests bypass the prefix cache
    tokens = [t for i in items for t in i.token_ids]
    assert tokens[: len(ref.token_ids)] == ref.token_ids


async def through_backend(c, p: list[int]) -> list:
    """The deltas the API reads from the cluster (`ClusterBackend`)."""
    handles = ClusterHandles(c.name, c.controller, c.replicas, None)
    backend = ClusterBackend(handles, None, CFG.max_model_len, record_metrics=False)
    return [d async for d in backend.generate(p, SCORED, request_id="api", tenant="default")]


def test_prompt_logprobs_once_as_in_process(cluster, llm):
    p = prompt(1)
    ref = llm.generate([p], SCORED, use_tqdm=False)[0]
    assert len(ref.prompt_logprobs) == len(p)
    check_scored(asyncio.run(collect(client(cluster), p, SCORED))["items"], ref)
    check_scored(asyncio.run(through_backend(cluster, p)), ref)


def test_repeated_prompt_counts_cached_whole_blocks(cluster):
    # 48 tokens = 3 full blocks, but one token is always left to compute: 2 blocks cached
    p = prompt(2, 48)
    whole = (len(p) - 1) // BLOCK * BLOCK
    seen: set[str] = set()
    for _ in range(3):  # 2 replicas: at least one run finds the prompt where it ran before
        items = asyncio.run(collect(client(cluster), p, PLAIN))["items"]
        replica = items[0].replica_id
        assert sent(items, "num_cached_tokens") == [whole if replica in seen else 0], replica
        seen.add(replica)


async def moved_before_first_token(c, p: list[int]) -> tuple[list, str | None]:
    """`p` queued behind a long request on one replica, moved to the other (busy too), and
    run there once that one's long request is gone."""
    cc = client(c)
    holds = [cc.generate(prompt(10 + i, 8), HOLD, request_id=f"hold-{i}") for i in range(2)]
    firsts = [await anext(h) for h in holds]  # one after the other: one per replica
    assert len({f.replica_id for f in firsts}) == 2
    task = asyncio.ensure_future(collect(cc, p, SCORED, request_id="moved"))
    dst = None
    for _ in range(500):
        dst = await migrate(c.controller, "moved")
        if dst is not None or task.done():
            break
        await asyncio.sleep(0.01)
    for h in holds:
        await h.aclose()  # frees both seats
    return (await task)["items"], dst


def test_moved_before_first_token_delivers_them_once(cluster, llm):
    p = prompt(3)
    ref = llm.generate([p], SCORED, use_tqdm=False)[0]
    items, dst = asyncio.run(moved_before_first_token(cluster, p))
    assert dst is not None and {i.replica_id for i in items} == {dst}
    check_scored(items, ref)


def test_mid_prefill_state_survives_pickling(llm):
    """What migration ships: a request half through scoring its prompt, in a pickle."""
    core, p = llm.engine, prompt(4, 40)
    budget = core.scheduler.config.max_num_batched_tokens
    core.scheduler.config.max_num_batched_tokens = 16  # the reference in the same chunks
    try:
        ref = llm.generate([p], SCORED, use_tqdm=False)[0]
        core.add_request(p, SCORED, request_id="half")
        core.step()  # 16 of the 40 prompt tokens: the records of tokens 1..16
        assert core.preempt("half", "swap")
        migrated = pickle.loads(pickle.dumps(core.export_request("half")))
        plp = migrated.request.prompt_logprobs
        assert plp.num_missing == len(p) - 1 - 16 and plp.entries[1] is not None and not plp.sent
        core.import_request(migrated)
        deltas = []
        while core.has_unfinished():
            deltas.extend(core.step())
    finally:
        core.scheduler.config.max_num_batched_tokens = budget
    check_scored(deltas, ref)
    assert pickle.loads(pickle.dumps(RequestMeta("r", p, SCORED))).params == SCORED


async def killed_after_first_item(c, p: list[int]) -> list:
    """`p` scored and generating; its replica killed as the first item arrives: the client
    resubmits it to the other one (last test: a replica dies)."""
    items = []
    async for item in client(c).generate(p, HOLD_SCORED):
        if not items:
            ray.kill(c.replicas[item.replica_id], no_restart=True)
        items.append(item)
    return items


def test_resubmitted_after_replica_death_delivers_them_once(cluster, llm):
    p = prompt(5)
    ref = llm.generate([p], SCORED, use_tqdm=False)[0]
    items = asyncio.run(killed_after_first_item(cluster, p))
    replicas = list(dict.fromkeys(i.replica_id for i in items))
    assert len(replicas) == 2, replicas  # it went on elsewhere
    assert items[-1].finish_reason == "length"
    assert len([t for i in items for t in i.token_ids]) == HOLD_SCORED.max_tokens
    check_scored(items, ref)
