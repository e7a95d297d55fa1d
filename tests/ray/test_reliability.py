"""Reliability through the served app (issue 7): faults under streaming load, a bounded
overload and a soak, all over loopback HTTP.

One Ray (3 fake GPUs, no dashboard) and one Serve app for the whole module: 3 paced `sim`
replicas (2 seats each, no local queue, so the controller's global queue holds the rest), two
tenants, ingress bounds of 10 requests in flight per tenant and 16 in total. The sim's tokens
are a pure function of the history (`sim_tokens`), so greedy streams are compared with an
undisturbed run exactly: no gap, no repeat.

Order matters: the first test kills a replica (the app runs on the survivors from then on,
plus the replacement if the controller starts one: the tests find the live replicas by name and
size their load by them), the second the fairness controller (Ray restarts it). After each,
every live replica's pool passes `check_integrity()` and is all-free and the controller holds
nothing (`replica_check`). The last two are the overload and the soak.

Every wait is bounded; nothing asserts on absolute wall-clock time: the overload test judges
recovery by a ratio of latencies measured in the same run (after / before).
`FAIRBATCH_OVERLOAD_S` (default 15) sets the overload phase's length (60 for the issue's);
`FAIRBATCH_SOAK_S` (default 24) the soak's (3600 for an hour: see docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")  # Ray ships it (ray/thirdparty_files, on sys.path now)
from live_actors import live_replicas  # noqa: E402
from loopback import free_port, run_serve_app, wait_for  # noqa: E402
from ray import serve  # noqa: E402
from ray.exceptions import RayActorError  # noqa: E402

from fairbatch.deployments.cluster.launch import NAMESPACE  # noqa: E402
from fairbatch.engine.tokenizer import Tokenizer  # noqa: E402

KEYS = {"a": "sk-rel-a", "b": "sk-rel-b"}
ADMIN = "sk-rel-admin"
MODEL = "fairbatch-sim"
CLUSTER = "fbrel"
REPLICAS, SEATS = 3, 2
PER_TENANT, TOTAL = 10, 16  # ingress bounds: 429 / 503 beyond them
TIME_SCALE = 7.0  # a sim step sleeps 7x the modelled H100's (~50 ms a decode step)
DEPLOY_TIMEOUT_S = 180
STREAM_TIMEOUT_S = 90  # one whole request, per request
OVERLOAD_S = float(os.environ.get("FAIRBATCH_OVERLOAD_S", "15"))
OVERLOAD_FACTOR = 10.0
OVERLOAD_CLIENTS = 64  # concurrent async clients at most
OVERLOAD_CAP = int(80 * OVERLOAD_S) + 200  # hard cap on requests offered
SHORT = 32  # tokens of an overload-phase request (~1.8 s of a seat)
# Recovered: the median latency of a wave of normal load after the overload is at most this
# multiple of the wave's before (same run, same load). A service left at half its seats doubles
# it. Other jobs on the shared 2-core box moved it by up to 1.3x, so a wave above the ratio is
# measured again, up to RECOVERY_WAVES in all: a lasting degradation fails every wave, a passing
# spike of load does not. A leaked ticket or queue entry also fails the idle check before them.
RECOVERY_RATIO, RECOVERY_WAVES = 1.75, 3
SOAK_S = float(os.environ.get("FAIRBATCH_SOAK_S", "24"))  # whole cycles (>= 2) within it
SOAK_OVERLOAD_S = 4.0  # the overload part of each soak cycle (the other: a request per seat)
SOAK_SAMPLE_S = max(0.5, SOAK_S / 600)  # RSS sampling period
# Memory bound (per process): the last third's peak RSS <= the first third's x 1.2 + 16 MiB.
# The soak starts after a warm-up cycle, so the first third already holds every code path's
# imports and buffers; what remains is allocator drift (arenas, fragmentation: the 20%) and
# page granularity of small processes (the 16 MiB). A per-request leak grows with the
# requests served, which the hour-long run multiplies by ~150 over the CI one.
SOAK_GROWTH, SOAK_SLACK_MIB = 1.2, 16.0


def app_args(usage_path: str) -> dict:
    return {
        "model": "sim",
        "num_replicas": REPLICAS,
        "cluster_name": CLUSTER,
        "metrics_interval_s": 0,
        "startup_timeout_s": 120,
        "request_timeout_s": 60,
        "admin_api_key": ADMIN,
        "allow_anonymous": False,
        "engine": {
            "num_gpu_blocks": 64,
            "num_cpu_blocks": 64,
            "max_num_seqs": SEATS,
            "max_num_batched_tokens": 256,
            "max_model_len": 512,
            "device": "cpu",
            "time_scale": TIME_SCALE,
        },
        "controller": {"local_queue": 0},
        "tenants": [{"name": n, "api_key": k} for n, k in KEYS.items()],
        "limits": {"max_requests_per_tenant": PER_TENANT, "max_requests_total": TOTAL},
        "usage": {"path": usage_path},
    }


@pytest.fixture(scope="module")
def served(ray_starter, tmp_path_factory):
    http_port = free_port()
    ray_starter(num_gpus=REPLICAS)
    usage = tmp_path_factory.mktemp("usage") / "usage.jsonl"
    try:
        base = run_serve_app(app_args(str(usage)), http_port, DEPLOY_TIMEOUT_S)
        handle = serve.get_app_handle("fairbatch")
        reps = handle.replica_handles.remote().result(timeout_s=30)
        cid = next(iter(reps)).rsplit("-r", 1)[0]
        controller = ray.get_actor(f"{cid}-controller", namespace=NAMESPACE)
        yield SimpleNamespace(base=base, cluster=ClusterView(cid, controller), usage=usage)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# ---- helpers --------------------------------------------------------------------------------


class ClusterView:
    """The app's cluster as the tests see it: the controller, and the replicas that are alive
    now, found by name (`<cluster id>-r<i>`, and `...~<hex>` for a replacement), not from the
    controller, so the tests can check what the controller believes."""

    def __init__(self, cluster_id: str, controller) -> None:
        self.name = f"{cluster_id}-controller"
        self.prefix = f"{cluster_id}-r"
        self.controller = controller

    @property
    def replicas(self) -> dict:
        return live_replicas(self.prefix)


def prompt_ids(i: int, n: int = 12) -> list[int]:
    return [(i * 37 + j * 11) % 900 + 20 for j in range(n)]


def expected_text(prompt: list[int], n: int, sim_expected) -> str:
    """An undisturbed greedy run's text, computed: the sim's tokens through the tokenizer."""
    tok = Tokenizer.tiny()
    return tok.decode(sim_expected(prompt, n, tok.vocab_size))


async def stream_completion(
    base: str, tenant: str, prompt: list[int], max_tokens: int, progress: list, i: int
) -> dict:
    """One greedy streaming completion over HTTP; `progress[i]` counts text chunks seen."""
    c = openai.AsyncOpenAI(
        base_url=base + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=STREAM_TIMEOUT_S
    )
    try:
        stream = await c.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, usage, rid = "", None, None, None
        async for ch in stream:
            rid = rid or ch.id
            if ch.choices:
                text += ch.choices[0].text or ""
                progress[i] += 1
                finish = ch.choices[0].finish_reason or finish
            if ch.usage is not None:
                usage = ch.usage
        return streamed(rid, text, finish, usage)
    finally:
        await c.close()


async def stream_chat(base: str, tenant: str, content: str, max_tokens: int, progress, i) -> dict:
    c = openai.AsyncOpenAI(
        base_url=base + "/v1", api_key=KEYS[tenant], max_retries=0, timeout=STREAM_TIMEOUT_S
    )
    try:
        stream = await c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, finish, usage, rid = "", None, None, None
        async for ch in stream:
            rid = rid or ch.id
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                progress[i] += 1
                finish = ch.choices[0].finish_reason or finish
            if ch.usage is not None:
                usage = ch.usage
        return streamed(rid, text, finish, usage)
    finally:
        await c.close()


def streamed(rid: str | None, text: str, finish: str | None, usage) -> dict:
    out = {"id": rid, "text": text, "finish_reason": finish, "tokens": None, "usage": None}
    if usage is not None:
        out["tokens"] = usage.completion_tokens
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        out["usage"] = (usage.prompt_tokens, usage.completion_tokens, cached)
    return out


async def two_samples(base: str, tenant: str, prompt: list[int], max_tokens: int) -> dict:
    """A non-streaming completion with n=2: {"id", "usage": (prompt, completion, cached)}."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": 2,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    async with httpx.AsyncClient(base_url=base, timeout=STREAM_TIMEOUT_S) as h:
        r = await h.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    u = r.json()["usage"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    return {"id": r.json()["id"], "usage": (u["prompt_tokens"], u["completion_tokens"], cached)}


async def cancelled_stream(base: str, tenant: str, prompt: list[int]) -> str:
    """A long stream cancelled with DELETE /v1/requests/{id} after its second chunk: its id."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    events: list[dict] = []
    async with httpx.AsyncClient(base_url=base, timeout=STREAM_TIMEOUT_S) as h:
        async with h.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                events.append(json.loads(line[len("data: ") :]))
                if len(events) == 2:
                    d = await h.delete(f"/v1/requests/{events[0]['id']}", headers=headers)
                    assert d.status_code == 200 and d.json()["cancelled"] is True
    assert events[-1]["error"]["code"] == "request_cancelled", events[-1]
    return events[0]["id"]


def replica_stats(cluster) -> dict[str, dict]:
    """Replica id -> stats() of every live replica."""
    out = {}
    for rid, h in cluster.replicas.items():
        try:
            out[rid] = ray.get(h.stats.remote(), timeout=30)
        except RayActorError:
            pass  # killed earlier in the module
    return out


async def until(pred, timeout_s: float, what: str, every: float = 0.05) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await asyncio.to_thread(pred):
        assert loop.time() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        await asyncio.sleep(every)


# ---- 1. a replica dies mid-stream -------------------------------------------------------------


STREAM_TOKENS = 64


def test_replica_killed_during_http_streams(served, sim_expected, replica_check):
    """6 greedy streams (3 completions, 3 chats) fill the 6 seats; the replica with the most
    running sequences is killed once every stream is under way. Every stream still ends with
    finish_reason "length", all 64 tokens, and exactly an undisturbed run's text."""
    base, cluster = served.base, served.cluster
    prompts = [prompt_ids(i) for i in range(3)]
    chats = [f"reliability chat number {i}" for i in range(3)]

    def jobs(progress):
        return [
            *(stream_completion(base, "ab"[i % 2], p, STREAM_TOKENS, progress, i)
              for i, p in enumerate(prompts)),
            *(stream_chat(base, "ab"[i % 2], m, STREAM_TOKENS, progress, 3 + i)
              for i, m in enumerate(chats)),
        ]  # fmt: skip

    async def undisturbed():
        # with two more requests (for the usage records): n=2, and a stream cancelled early
        extra = [two_samples(base, "a", prompt_ids(50), 16),
                 cancelled_stream(base, "b", prompt_ids(51))]  # fmt: skip
        done = asyncio.gather(*jobs([0] * 6), *extra)
        return await asyncio.wait_for(done, 2 * STREAM_TIMEOUT_S)

    *reference, pair, cancelled = asyncio.run(undisturbed())
    for i, p in enumerate(prompts):  # the computed reference agrees with a real run
        assert reference[i]["text"] == expected_text(p, STREAM_TOKENS, sim_expected)

    victim: dict = {}

    async def disturbed():
        progress = [0] * 6
        tasks = [asyncio.create_task(j) for j in jobs(progress)]
        await until(lambda: min(progress) >= 5, 60, "every stream under way")
        stats = await asyncio.to_thread(replica_stats, cluster)
        rid = max(stats, key=lambda r: stats[r]["running"])
        victim.update(id=rid, running=stats[rid]["running"], progress=list(progress))
        ray.kill(cluster.replicas[rid], no_restart=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), 2 * STREAM_TIMEOUT_S)

    results = asyncio.run(disturbed())
    print(f"replica kill: {victim}")
    assert victim["running"] >= 1, victim  # it really held streams when it died
    assert max(victim["progress"]) < STREAM_TOKENS, victim  # ...mid-stream
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r["finish_reason"] == "length", (i, r)
        assert r["tokens"] == STREAM_TOKENS, (i, r)
        assert r["text"] == ref["text"], (i, r["text"], ref["text"])  # no gap, no repeat

    def dropped() -> bool:
        return (
            victim["id"] not in ray.get(cluster.controller.stats.remote(), timeout=30)["replicas"]
        )

    wait_for(dropped, 30, "the controller to drop the dead replica")
    replica_check([cluster])
    check_usage_records(served.usage, [*reference, pair], results, cancelled, victim)


def check_usage_records(
    path, before: list[dict], disturbed: list[dict], cancelled: str, victim: dict
) -> None:
    """The usage log of that mixed run (the first thing this app served): one record per
    request, each reply's usage the sum of its records' token for token, the requests the
    killed replica held moved and finished elsewhere, the cancelled one "abort"."""

    def read() -> list[dict]:
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    n = 6 + 2 + 1 + 6  # the reference streams, the n=2 reply, the cancelled one, the streams again
    got = wait_for(lambda: len(read()) >= n and read(), 30, f"{n} usage records")
    assert len(got) == n and len({r["request_id"] for r in got}) == n
    rows: dict[str, list[dict]] = {}
    for r in got:
        rows.setdefault(r["response_id"], []).append(r)
        assert r["recorded_by"] == "ingress" and r["model"] == MODEL
    for reply in [*before, *disturbed]:
        mine = rows.pop(reply["id"])
        sums = tuple(sum(r[k] for r in mine) for k in ("prompt_tokens", "output_tokens",
                                                       "cached_tokens"))  # fmt: skip
        assert sums == reply["usage"], (reply, mine)
        assert {r["finish_reason"] for r in mine} == {"length"}
    [gone] = rows.pop(cancelled)
    assert not rows
    assert gone["finish_reason"] == "abort" and 1 <= gone["output_tokens"] < 400
    after_kill = [r for r in got if r["response_id"] in {d["id"] for d in disturbed}]
    assert all(r["replica"] and r["replica"] != victim["id"] for r in after_kill), after_kill
    # each request the dead replica held was resubmitted (a fair preemption may move others)
    moved = [r for r in after_kill if r["moves"]]
    assert len(moved) >= victim["running"], (after_kill, victim)


# ---- 2. the fairness controller dies ----------------------------------------------------------


def test_controller_killed_with_queued_and_streaming_requests(served, sim_expected, replica_check):
    """12 greedy streams on the 4 seats left: 4 stream, 8 wait in the controller's queue. The
    controller is killed (Ray restarts it); every request completes exactly, none is lost."""
    base, cluster = served.base, served.cluster
    n, tokens = 12, 40
    prompts = [prompt_ids(100 + i) for i in range(n)]
    before = ray.get(cluster.controller.stats.remote(), timeout=30)["incarnation"]
    seen: dict = {}

    async def run():
        progress = [0] * n
        tasks = [
            asyncio.create_task(stream_completion(base, "ab"[i % 2], p, tokens, progress, i))
            for i, p in enumerate(prompts)
        ]

        def queued_and_streaming() -> bool:
            stats = ray.get(cluster.controller.stats.remote(), timeout=30)
            streaming = sum(1 for x in progress if x >= 3)
            seen.update(queued=stats["queued"], streaming=streaming)
            return stats["queued"] > 0 and streaming >= 2

        await until(queued_and_streaming, 60, "requests both queued and streaming")
        ray.kill(cluster.controller, no_restart=False)  # max_restarts=-1: Ray restarts it
        return await asyncio.wait_for(asyncio.gather(*tasks), 3 * STREAM_TIMEOUT_S)

    results = asyncio.run(run())
    print(f"controller kill: {seen}")
    for i, (r, p) in enumerate(zip(results, prompts)):
        assert r["finish_reason"] == "length", (i, r)
        assert r["tokens"] == tokens, (i, r)
        assert r["text"] == expected_text(p, tokens, sim_expected), i
    stats = ray.get(cluster.controller.stats.remote(), timeout=30)
    assert stats["incarnation"] != before  # it really was restarted
    assert set(stats["replicas"]) == set(replica_stats(cluster))  # rebuilt from live reports
    replica_check([cluster])


# ---- 3. overload --------------------------------------------------------------------------------


async def one_request(h: httpx.AsyncClient, tenant: str, i: int) -> tuple[str, float, str]:
    """(outcome, latency seconds, detail); outcome: completed | rejected | bad | hung | error."""
    body = {
        "model": MODEL,
        "prompt": prompt_ids(1000 + i, 8),
        "max_tokens": SHORT,
        "temperature": 0,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    try:
        r = await asyncio.wait_for(
            h.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEYS[tenant]}"}
            ),
            STREAM_TIMEOUT_S,
        )
    except (asyncio.TimeoutError, httpx.TimeoutException):
        return "hung", time.monotonic() - t0, ""
    except Exception as e:  # connection errors: neither tokens nor a clean refusal
        return "error", time.monotonic() - t0, repr(e)
    dt = time.monotonic() - t0
    if r.status_code == 200:
        try:
            data = r.json()
            ok = data["usage"]["completion_tokens"] == SHORT and bool(data["choices"][0]["text"])
        except (ValueError, KeyError, IndexError, TypeError):
            ok = False
        return ("completed" if ok else "bad"), dt, "" if ok else r.text[:200]
    retry_after = r.headers.get("Retry-After", "")
    if r.status_code in (429, 503) and retry_after.isdigit() and int(retry_after) >= 1:
        try:
            code = r.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            return "bad", dt, f"{r.status_code} not OpenAI's error shape: {r.text[:200]}"
        return "rejected", dt, f"{r.status_code}:{code}"
    return "bad", dt, f"{r.status_code} {r.headers.get('Retry-After')} {r.text[:200]}"


async def normal_load(base: str, n: int, concurrency: int, offset: int) -> list[tuple]:
    """`n` requests, at most `concurrency` at once (the seats): no refusals expected."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=STREAM_TIMEOUT_S) as h:

        async def go(i: int):
            async with sem:
                return await one_request(h, "ab"[i % 2], offset + i)

        return await asyncio.gather(*(go(i) for i in range(n)))


async def overload(base: str, rate: float, duration_s: float, controller) -> dict:
    """Open-loop arrivals at `rate` per second for `duration_s`, at most OVERLOAD_CLIENTS in
    flight and OVERLOAD_CAP in all; samples the controller's queue meanwhile."""
    outcomes: list[tuple] = []
    slots = asyncio.Semaphore(OVERLOAD_CLIENTS)
    max_queued = 0
    stop = asyncio.Event()

    async def sample():
        nonlocal max_queued
        while not stop.is_set():
            stats = await asyncio.to_thread(lambda: ray.get(controller.stats.remote(), timeout=30))
            max_queued = max(max_queued, stats["queued"])
            await asyncio.sleep(0.5)

    limits = httpx.Limits(max_connections=OVERLOAD_CLIENTS, max_keepalive_connections=16)
    async with httpx.AsyncClient(base_url=base, timeout=STREAM_TIMEOUT_S, limits=limits) as h:

        async def go(i: int):
            try:
                outcomes.append(await one_request(h, "ab"[i % 2], 5000 + i))
            finally:
                slots.release()

        sampler = asyncio.create_task(sample())
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks, offered = [], 0
        while offered < OVERLOAD_CAP and loop.time() - t0 < duration_s:
            await asyncio.wait_for(slots.acquire(), STREAM_TIMEOUT_S)
            tasks.append(asyncio.create_task(go(offered)))
            offered += 1
            next_at = t0 + offered / rate
            await asyncio.sleep(max(0.0, next_at - loop.time()))
        elapsed = loop.time() - t0
        await asyncio.wait_for(asyncio.gather(*tasks), 2 * STREAM_TIMEOUT_S)
        stop.set()
        await asyncio.wait_for(sampler, 60)
    return {"offered": offered, "elapsed": elapsed, "outcomes": outcomes, "max_queued": max_queued}


def admin_view(base: str) -> dict:
    r = httpx.get(base + "/admin/tenants", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def p50(outcomes: list[tuple]) -> float:
    return statistics.median(dt for o, dt, _ in outcomes if o == "completed")


def test_overload_every_request_ends_and_service_recovers(served, replica_check, tmp_path):
    """Offered load ~10x what the seats serve, for OVERLOAD_S, then normal load. Every request
    ends with its tokens or a 429/503 carrying Retry-After; none hangs, none is lost; the
    controller's queue stays within the ingress bound; afterwards the service is idle again
    (controller queue 0, pools all-free, nothing in flight) and serves normal load at the
    latency it had before (a wave's p50 <= RECOVERY_RATIO x the p50 before; up to
    RECOVERY_WAVES waves)."""
    base, cluster = served.base, served.cluster
    seats = SEATS * len(replica_stats(cluster))
    rejected_before = admin_view(base)["rejected"]

    t0 = time.monotonic()
    before = asyncio.run(normal_load(base, 2 * seats, seats, 0))
    capacity = len(before) / (time.monotonic() - t0)  # requests/s with every seat busy
    assert [o for o, _, _ in before] == ["completed"] * len(before), before
    rate = OVERLOAD_FACTOR * capacity

    over = asyncio.run(overload(base, rate, OVERLOAD_S, cluster.controller))
    # Structurally back to idle before any new load: nothing queued or assigned at the
    # controller, every pool all-free, nothing in flight at the ingress.
    replica_check([cluster])
    idle = wait_for(lambda: (v := admin_view(base))["in_flight"] == 0 and v, 30, "in_flight 0")
    ctrl = ray.get(cluster.controller.stats.remote(), timeout=30)
    waves: list[list[tuple]] = []
    while len(waves) < RECOVERY_WAVES:
        waves.append(asyncio.run(normal_load(base, 2 * seats, seats, 10_000 + 100 * len(waves))))
        served_all = all(o == "completed" for o, _, _ in waves[-1])
        if not served_all or p50(waves[-1]) <= RECOVERY_RATIO * p50(before):
            break
    after = waves[-1]

    counts: dict[str, int] = {}
    codes: dict[str, int] = {}
    for o, _, detail in over["outcomes"]:
        counts[o] = counts.get(o, 0) + 1
        if o == "rejected":
            codes[detail] = codes.get(detail, 0) + 1
    completed, rejected = counts.get("completed", 0), counts.get("rejected", 0)
    after_ok = all(o == "completed" for w in waves for o, _, _ in w)
    figures = {
        "replicas": len(replica_stats(cluster)),
        "seats": seats,
        "capacity_req_per_s": round(capacity, 2),
        "offered_rate_req_per_s": round(over["offered"] / over["elapsed"], 2),
        "overload_s": round(over["elapsed"], 1),
        "offered": over["offered"],
        "completed": completed,
        "rejected": rejected,
        "rejected_by_code": codes,
        "hung": counts.get("hung", 0),
        "bad": counts.get("bad", 0),
        "errors": counts.get("error", 0),
        "lost": over["offered"] - completed - rejected,
        "max_controller_queue": over["max_queued"],
        "p50_s_before": round(p50(before), 3),
        "p50_s_during": round(p50(over["outcomes"]), 3) if completed else None,
        "p50_s_after": round(p50(after), 3) if after_ok else None,
        "recovery_ratio": round(p50(after) / p50(before), 3) if after_ok else None,
        "p50_s_after_waves": [
            round(p50(w), 3) if any(o == "completed" for o, _, _ in w) else None for w in waves
        ],
        "after_completed": sum(1 for o, _, _ in after if o == "completed"),
        "after_offered": len(after),
        "idle_after_overload": {
            "ingress_in_flight": idle["in_flight"],
            "controller_queued": ctrl["queued"],
            "controller_assigned": sum(ctrl["assigned"].values()),
        },
    }
    (tmp_path / "overload.json").write_text(json.dumps(figures, indent=2))
    if os.environ.get("FAIRBATCH_RELIABILITY_JSON"):
        with open(os.environ["FAIRBATCH_RELIABILITY_JSON"], "w") as f:
            json.dump(figures, f, indent=2)
    print(f"overload figures ({tmp_path / 'overload.json'}): {json.dumps(figures)}")

    problems = [x for x in over["outcomes"] if x[0] not in ("completed", "rejected")]
    assert not problems, problems[:5]
    assert figures["lost"] == 0 and len(over["outcomes"]) == over["offered"], figures
    assert rejected > 0 and completed > 0, figures  # it really was overloaded, and still served
    assert figures["offered_rate_req_per_s"] > 3 * capacity, figures  # far beyond capacity
    assert over["max_queued"] <= TOTAL, figures  # the queue is bounded by the ingress limit
    assert after_ok, waves  # recovered: every normal request served...
    assert figures["recovery_ratio"] <= RECOVERY_RATIO, figures  # ...at the latency of before
    view = wait_for(lambda: (v := admin_view(base))["in_flight"] == 0 and v, 30, "in_flight 0")
    assert view["rejected"] - rejected_before == rejected, (view, figures)  # server agrees
    replica_check([cluster])


# ---- 4. soak: normal and overload in turn, memory sampled --------------------------------------


def actor_pids(cluster) -> dict[str, int]:
    """Role -> pid of every live replica, the controller and the ingress replica(s)."""

    def pid(h) -> int:
        return ray.get(h.__ray_call__.remote(lambda self: os.getpid()), timeout=30)

    roles = {f"replica {rid.rsplit('-', 1)[-1]}": pid(h) for rid, h in cluster.replicas.items()}
    roles["controller"] = pid(cluster.controller)
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve" and "FairbatchIngress" in a["name"]:
            roles[f"ingress {a['name'].rsplit('#', 1)[-1]}"] = pid(
                ray.get_actor(a["name"], namespace="serve")
            )
    return roles


class RssSampler(threading.Thread):
    """Samples the RSS (MiB) of each pid every `period` s until stopped."""

    def __init__(self, pids: dict[str, int], period: float) -> None:
        super().__init__(daemon=True)
        self.procs = {role: psutil.Process(pid) for role, pid in pids.items()}
        self.period = period
        self.samples: list[tuple[float, dict[str, float | None]]] = []
        self.halt = threading.Event()

    def sample(self) -> None:
        row: dict[str, float | None] = {}
        for role, proc in self.procs.items():
            try:
                row[role] = proc.memory_info().rss / 2**20
            except psutil.Error:
                row[role] = None  # gone: reported as a failure
        self.samples.append((time.monotonic(), row))

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.period)
        self.sample()


def test_soak_memory_stays_bounded(served, replica_check, tmp_path):
    """Normal load and ~10x overload in turn for SOAK_S (after one warm-up cycle), the RSS of
    every replica, the controller and the ingress sampled throughout. Every request ends (tokens
    or 429/503 with Retry-After), none is lost; the controller's queue stays within the ingress
    bound; no process's peak RSS in the last third exceeds its first third's by more than the
    bound (SOAK_GROWTH, SOAK_SLACK_MIB); the pools end all-free."""
    base, cluster = served.base, served.cluster
    seats = SEATS * len(replica_stats(cluster))
    offset = [20_000]

    def cycle(over_s: float) -> tuple[list, dict]:
        """One wave of normal load (a request per seat), then overload for `over_s` at 10x
        the rate that wave was served at (its capacity now)."""
        t0 = time.monotonic()
        normal = asyncio.run(normal_load(base, seats, seats, offset[0]))
        offset[0] += seats
        capacity = len(normal) / (time.monotonic() - t0)
        over = asyncio.run(overload(base, OVERLOAD_FACTOR * capacity, over_s, cluster.controller))
        over["capacity"] = capacity
        return normal, over

    # Warm-up, not sampled: every path (served, queued, refused) runs once before the first
    # third, so imports and buffers that come on first use are not counted as growth.
    warm_normal, warm_over = cycle(2.0)
    sampler = RssSampler(actor_pids(cluster), SOAK_SAMPLE_S)
    sampler.start()
    normal_out: list[tuple] = []
    over_out: list[tuple] = []
    offered, cycles, max_queued, over_s, capacities = 0, 0, warm_over["max_queued"], 0.0, []
    t0 = time.monotonic()
    try:
        while True:  # whole cycles, at least 2, within SOAK_S
            c0 = time.monotonic()
            normal, over = cycle(SOAK_OVERLOAD_S)
            normal_out += normal
            over_out += over["outcomes"]
            offered += len(normal) + over["offered"]
            over_s += over["elapsed"]
            capacities.append(over["capacity"])
            max_queued = max(max_queued, over["max_queued"])
            cycles += 1
            now = time.monotonic()
            if cycles >= 2 and now - t0 + (now - c0) > SOAK_S:
                break
    finally:
        sampler.halt.set()
        sampler.join(60)
    elapsed = time.monotonic() - t0
    warm = warm_normal + warm_over["outcomes"]
    assert len(warm) == len(warm_normal) + warm_over["offered"], "warm-up requests lost"

    outcomes = normal_out + over_out
    counts: dict[str, int] = {}
    for o, _, _ in outcomes:
        counts[o] = counts.get(o, 0) + 1
    completed, rejected = counts.get("completed", 0), counts.get("rejected", 0)
    t_start, t_end = sampler.samples[0][0], sampler.samples[-1][0]
    third = (t_end - t_start) / 3
    memory = {}
    for role in sampler.procs:
        first = [r[role] for t, r in sampler.samples if t <= t_start + third]
        last = [r[role] for t, r in sampler.samples if t >= t_end - third]
        every = [r[role] for _, r in sampler.samples]
        memory[role] = {
            "first_third_peak_mib": round(max(x or 0 for x in first), 1),
            "last_third_peak_mib": round(max(x or 0 for x in last), 1),
            "max_mib": round(max(x or 0 for x in every), 1),
            "vanished": any(x is None for x in every),
        }
    figures = {
        "soak_s": round(elapsed, 1),
        "cycles": cycles,
        "warm_up_requests": len(warm),
        "seats": seats,
        "capacity_req_per_s": round(statistics.median(capacities), 2),
        "overload_rate_req_per_s": round(len(over_out) / over_s, 2),
        "offered": offered,
        "completed": completed,
        "rejected": rejected,
        "hung": counts.get("hung", 0),
        "bad": counts.get("bad", 0),
        "errors": counts.get("error", 0),
        "lost": offered - completed - rejected,
        "normal_completed": sum(1 for o, _, _ in normal_out if o == "completed"),
        "normal_offered": len(normal_out),
        "max_controller_queue": max_queued,
        "rss_samples": len(sampler.samples),
        "memory": memory,
    }
    (tmp_path / "soak.json").write_text(json.dumps(figures, indent=2))
    if os.environ.get("FAIRBATCH_SOAK_JSON"):
        with open(os.environ["FAIRBATCH_SOAK_JSON"], "w") as f:
            json.dump(figures, f, indent=2)
    print(f"soak figures ({tmp_path / 'soak.json'}): {json.dumps(figures)}")

    problems = [x for x in outcomes + warm if x[0] not in ("completed", "rejected")]
    assert not problems, problems[:5]
    assert figures["lost"] == 0 and len(outcomes) == offered, figures
    assert figures["normal_completed"] == len(normal_out), figures  # normal load: all served
    assert all(o == "completed" for o, _, _ in warm_normal), warm_normal
    assert rejected > 0, figures  # the overload halves really overloaded
    assert max_queued <= TOTAL, figures
    assert len(sampler.samples) >= 10, figures
    for role, m in memory.items():
        assert not m["vanished"], (role, m)
        bound = m["first_third_peak_mib"] * SOAK_GROWTH + SOAK_SLACK_MIB
        assert m["last_third_peak_mib"] <= bound, (role, m, figures)
    replica_check([cluster])
