"""The cluster on two replicas running the tiny Llama (CPU, float32): migration with K/V through
the object store and a replica's death, checked token for token (and text) against undisturbed
runs on the same cluster - greedy, and seeded sampling, which is keyed on the output index -
and the killed replica's replacement (same config: the same tiny model) serving exactly so too.

Order matters: the last test kills a replica.
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
from fairbatch.engine.sampling_params import SamplingParams

CLUSTERS: list = []


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
    )
    c = start_cluster("tiny", [cfg, cfg], ControllerConfig())
    CLUSTERS.append(c)
    yield c
    c.shutdown()
    ray.shutdown()


def prompt(i: int) -> list[int]:
    return [(i * 37 + j * 11) % 2000 + 10 for j in range(24)]


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=40, temperature=1.0, seed=11, ignore_eos=True)


def text(result: dict) -> str:
    return "".join(item.text for item in result["items"])


async def migrate_after(c, p: list[int], params: SamplingParams, n: int) -> tuple[dict, str]:
    client = ClusterClient(c.controller, item_timeout_s=60)
    items, dst = [], None
    rid = f"mig-{params.seed}-{p[0]}"
    async for item in client.generate(p, params, request_id=rid):
        items.append(item)
        if dst is None and sum(len(i.token_ids) for i in items) >= n:
            dst = await migrate(c.controller, rid)
    tokens = [t for i in items for t in i.token_ids]
    replicas = list(dict.fromkeys(i.replica_id for i in items))
    return {"tokens": tokens, "items": items, "replicas": replicas}, dst


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_migration_with_kv_matches_undisturbed(cluster, params):
    client = ClusterClient(cluster.controller, item_timeout_s=60)
    ref = asyncio.run(collect(client, prompt(1), params))
    moved, dst = asyncio.run(migrate_after(cluster, prompt(1), params, 12))
    assert dst is not None and moved["replicas"][-1] == dst and len(moved["replicas"]) == 2
    assert moved["tokens"] == ref["tokens"] and len(ref["tokens"]) == 40
    assert text(moved) == text(ref)
    stats = ray.get(cluster.replicas[dst].stats.remote(), timeout=30)
    assert stats["imported_kv_blocks"] > 0  # K/V travelled (swap-in), not a recompute


def test_controller_submits_for_the_client_the_tokens_of_the_offline_engine(cluster):
    """The controller submits each assigned request to its replica for the client, which only
    reads the items: across both replicas, token for token what the tiny model makes offline
    (the same requests through `LLM.generate` in this process)."""
    from fairbatch.engine import LLM

    prompts = [prompt(30 + i) for i in range(6)]
    offline = LLM("tiny", num_gpu_blocks=64, max_model_len=512).generate(
        prompts, GREEDY, use_tqdm=False
    )

    async def run() -> list[dict]:
        client = ClusterClient(cluster.controller, item_timeout_s=60)
        return list(await asyncio.gather(*(collect(client, p, GREEDY) for p in prompts)))

    served = asyncio.run(run())
    assert len({r["replicas"][0] for r in served}) == 2  # both replicas took some
    for r, ref in zip(served, offline):
        assert r["tokens"] == list(ref.token_ids) and len(r["tokens"]) == 40
        assert r["finish_reason"] == "length"


def test_a_request_cancelled_before_its_client_heard_the_assignment_ends_on_its_replica(cluster):
    """The controller submitted it for a client that gives up before the assignment reaches
    it (so the client knows no replica to abort on): the controller's cancel aborts it there,
    and the consumer's channel gets its "abort" instead of 400 tokens run for nobody."""
    from fairbatch.deployments.cluster.channel import ReplicaLink
    from fairbatch.deployments.cluster.wire import RequestMeta

    rid, consumer = "cancel-early", "consumer-cancel-early"
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    meta = RequestMeta(rid, prompt(50), params, consumer=consumer)

    async def main() -> list:
        links = [
            ReplicaLink(r, h, consumer, None, expected={rid}) for r, h in cluster.replicas.items()
        ]
        await cluster.controller.submit_many.remote("subscriber-cancel-early", [meta])
        await cluster.controller.cancel.remote(rid)
        queues = [link.open(rid) for link in links]
        items: list = []
        deadline = time.monotonic() + 60
        while not any(i.finished for i in items):
            assert time.monotonic() < deadline, items
            for q in queues:
                while not q.empty():
                    items.append(q.get_nowait())
            await asyncio.sleep(0.01)
        for link in links:
            link.shutdown()
        return items

    items = asyncio.run(main())
    assert items[-1].finish_reason == "abort"
    assert sum(len(i.token_ids) for i in items) < 400


def test_the_assignment_stream_sends_each_replica_handle_once(cluster):
    """`Controller.assignments` sends a replica's actor handle once per stream, not in every
    Assignment (each one is deserialized where the stream is read); a new stream (the client
    re-subscribed) sends them again. The client's batcher puts them back: every Assignment it
    resolves holds its replica's handle."""
    from fairbatch.deployments.cluster.admission import AdmissionBatcher
    from fairbatch.deployments.cluster.wire import RequestMeta

    ctl = cluster.controller
    # long enough to stay placed while the streams are read (nobody reads their items; the
    # cancels at the end abort them on their replicas)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    metas = [
        RequestMeta(f"once-{i}", prompt(60 + i), params, consumer="consumer-once") for i in range(6)
    ]

    async def stream(subscriber: str) -> list[tuple[dict, list]]:
        """One message per request: each submitted after the last one's assignment came (the
        second stream's: re-sent, the requests being placed already)."""
        gen = ctl.assignments.options(num_returns="streaming").remote(subscriber)
        messages = []
        for m in metas:
            await ctl.submit_many.remote(subscriber, [m])
            messages.append(await asyncio.wait_for(await gen.__anext__(), 30))
        return messages

    def check(messages: list[tuple[dict, list]]) -> dict[str, str]:
        seen: set[str] = set()
        for handles, batch in messages:
            (a,) = batch
            assert a.replica is None and a.finish_reason is None
            first = a.replica_id not in seen
            assert handles == ({a.replica_id: cluster.replicas[a.replica_id]} if first else {})
            seen.add(a.replica_id)
        assert seen == set(cluster.replicas)  # both took some (of 6: most came with no handle)
        return {batch[0].request_id: batch[0].replica_id for _, batch in messages}

    async def admit_twice() -> list:
        batcher = AdmissionBatcher(lambda: ctl)
        got = []
        for _ in range(2):  # the second time every handle came before
            got += await asyncio.gather(*(batcher.admit(m, 30, 30) for m in metas))
        batcher.flusher.cancel()
        batcher.reader.cancel()
        return got

    async def cancel_all() -> None:
        await asyncio.gather(*(ctl.cancel.remote(m.request_id) for m in metas))

    try:
        where = check(asyncio.run(stream("subscriber-once-1")))
        assert check(asyncio.run(stream("subscriber-once-2"))) == where  # all sent again
        for a in asyncio.run(admit_twice()):
            assert a.replica_id == where[a.request_id]
            assert a.replica == cluster.replicas[a.replica_id]
    finally:
        asyncio.run(cancel_all())


def test_a_request_of_a_higher_class_does_not_wait_for_a_batch(cluster):
    """The batcher holds admissions for `linger_s` so that a burst goes in one call, but not
    one of a class above 0: with a 3 s linger, a class-1 admission is assigned within a 1.5 s
    timeout, where a class-0 one is still held when its timeout ends."""
    from fairbatch.deployments.cluster.admission import AdmissionBatcher
    from fairbatch.deployments.cluster.wire import RequestMeta

    ctl = cluster.controller
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    urgent = RequestMeta("hurry-1", prompt(90), params, priority=1, consumer="consumer-hurry")
    normal = RequestMeta("hurry-0", prompt(91), params, consumer="consumer-hurry")

    async def admit(meta: RequestMeta):
        batcher = AdmissionBatcher(lambda: ctl, linger_s=3.0)
        try:
            return await batcher.admit(meta, 1.5, 1.5)
        except asyncio.TimeoutError:
            return None
        finally:
            batcher.flusher.cancel()
            batcher.reader.cancel()

    try:
        got = asyncio.run(admit(urgent))
        assert (
            got is not None and got.request_id == "hurry-1" and got.replica_id in cluster.replicas
        )
        assert asyncio.run(admit(normal)) is None
    finally:
        for m in (urgent, normal):
            ray.get(ctl.cancel.remote(m.request_id))


async def run_and_kill(
    c, prompts, params, kill: bool, tenant: str = "default"
) -> tuple[list[dict], list[int], str | None]:
    """Run the requests; with `kill`, once every one has 6 tokens, kill the replica streaming
    the most of them (chosen then: how the controller spread them depends on timing). Returns
    the results, the requests that were mid-generation on the killed replica, and its id."""
    client = ClusterClient(c.controller, item_timeout_s=60, admit_timeout_s=120)
    progress = [0] * len(prompts)
    where = [""] * len(prompts)  # the replica each request is streaming from

    async def one(i: int) -> dict:
        items = []
        async for item in client.generate(prompts[i], params[i], tenant=tenant):
            items.append(item)
            progress[i] += len(item.token_ids)
            where[i] = "" if item.finished else item.replica_id
        tokens = [t for x in items for t in x.token_ids]
        return {"tokens": tokens, "items": items, "replicas": [x.replica_id for x in items]}

    tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
    on_victim: list[int] = []
    victim = None
    if kill:
        deadline = time.monotonic() + 60
        while min(progress) < 6:  # every request has started (the last one is mid-generation)
            await asyncio.sleep(0.01)
            assert time.monotonic() < deadline, progress
        streaming = [r for r in where if r]
        victim = max(set(streaming), key=streaming.count)
        ray.kill(c.replicas[victim], no_restart=True)
        on_victim = [i for i in range(len(prompts)) if where[i] == victim]
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=120)
    return results, on_victim, victim


def test_replica_death_streams_continue_exactly(cluster):
    prompts = [prompt(10 + i) for i in range(6)]
    params = [GREEDY if i % 2 else SEEDED for i in range(6)]
    ref, _, _ = asyncio.run(run_and_kill(cluster, prompts, params, False))
    got, on_victim, victim = asyncio.run(run_and_kill(cluster, prompts, params, True))
    assert on_victim, "no request was mid-generation on the killed replica"
    for i in on_victim:  # continued on the other replica
        assert got[i]["replicas"][0] == victim and got[i]["replicas"][-1] != victim
    for r, e in zip(got, ref):
        assert r["tokens"] == e["tokens"] and len(e["tokens"]) == 40
        assert text(r) == text(e)
        assert r["items"][-1].finish_reason == "length"

    # The controller replaced it (same config, a new id), and the replacement serves exactly.
    deadline = time.monotonic() + 120
    while True:
        stats = ray.get(cluster.controller.stats.remote(), timeout=30)
        if len(stats["replicas"]) == 2 and victim not in stats["replicas"]:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
    (new,) = [r for r in stats["replicas"] if r.startswith(victim + "~")]
    # another tenant: its prefix hashes (salted) match nothing cached, so placement is by load
    again, _, _ = asyncio.run(run_and_kill(cluster, prompts, params, False, tenant="other"))
    assert any(r["replicas"][0] == new for r in again)
    for r, e in zip(again, ref):
        assert r["tokens"] == e["tokens"] and text(r) == text(e)
