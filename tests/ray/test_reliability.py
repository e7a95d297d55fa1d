"""Reliability through the served app (issue 7, first part): faults under streaming load and a
bounded overload, all over loopback HTTP.

One Ray (3 fake GPUs, no dashboard) and one Serve app for the whole module: 3 paced `sim`
replicas (2 seats each, no local queue, so the controller's global queue holds the rest), two
tenants, ingress bounds of 10 requests in flight per tenant and 16 in total. The sim's tokens
are a pure function of the history (`sim_tokens`), so greedy streams are compared with an
undisturbed run exactly: no gap, no repeat.

Order matters: the first test kills a replica (max_restarts=0: the app runs on 2 from then on),
the second the fairness controller (Ray restarts it). After each, every live replica's pool
passes `check_integrity()` and is all-free and the controller holds nothing (`replica_check`).

Every wait is bounded; nothing asserts on wall-clock time (latencies are recorded, not judged).
`FAIRBATCH_OVERLOAD_S` (default 15) sets the overload phase's length (60 for the issue's soak).
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
from ray import serve  # noqa: E402
from ray.exceptions import RayActorError  # noqa: E402

from fairbatch.deployments.api_testing import free_port, wait_for  # noqa: E402
from fairbatch.deployments.app import build_app  # noqa: E402
from fairbatch.deployments.serve_cluster import NAMESPACE  # noqa: E402
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


def app_args() -> dict:
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
    }


@pytest.fixture(scope="module")
def served():
    http_port = free_port()
    ray.init(
        num_cpus=2,
        num_gpus=REPLICAS,
        include_dashboard=False,
        _temp_dir=os.environ["RAY_TMPDIR"],
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        failure: list[BaseException] = []

        def deploy() -> None:  # serve.run has no timeout: run it aside and bound the wait
            try:
                serve.run(build_app(app_args()), name="fairbatch", route_prefix="/")
            except BaseException as e:  # noqa: BLE001 - reported below
                failure.append(e)

        threading.Thread(target=deploy, daemon=True).start()

        def running():
            if failure:
                pytest.fail(f"deploy failed: {failure[0]!r}")
            app = serve.status().applications.get("fairbatch")
            if app is not None and app.status == "DEPLOY_FAILED":
                pytest.fail(f"deploy failed: {app.message}")
            return app is not None and app.status == "RUNNING"

        wait_for(running, DEPLOY_TIMEOUT_S, "the fairbatch app to be RUNNING", every=1.0)
        base = f"http://127.0.0.1:{http_port}"
        wait_for(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 60, "/health")
        handle = serve.get_app_handle("fairbatch")
        reps = handle.replica_handles.remote().result(timeout_s=30)
        ctrl_name = next(iter(reps)).rsplit("-r", 1)[0] + "-controller"
        controller = ray.get_actor(ctrl_name, namespace=NAMESPACE)
        cluster = SimpleNamespace(name=ctrl_name, replicas=reps, controller=controller)
        yield SimpleNamespace(base=base, cluster=cluster)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


# ---- helpers --------------------------------------------------------------------------------


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
        text, finish, usage = "", None, None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].text or ""
                progress[i] += 1
                finish = ch.choices[0].finish_reason or finish
            if ch.usage is not None:
                usage = ch.usage
        return {"text": text, "finish_reason": finish, "tokens": usage and usage.completion_tokens}
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
        text, finish, usage = "", None, None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                progress[i] += 1
                finish = ch.choices[0].finish_reason or finish
            if ch.usage is not None:
                usage = ch.usage
        return {"text": text, "finish_reason": finish, "tokens": usage and usage.completion_tokens}
    finally:
        await c.close()


def replica_stats(cluster) -> dict[str, dict]:
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
        return await asyncio.wait_for(asyncio.gather(*jobs([0] * 6)), 2 * STREAM_TIMEOUT_S)

    reference = asyncio.run(undisturbed())
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
    assert len(stats["replicas"]) == len(replica_stats(cluster))  # rebuilt from live reports
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
    controller's queue stays within the ingress bound; normal requests succeed afterwards."""
    base, cluster = served.base, served.cluster
    seats = SEATS * len(replica_stats(cluster))
    rejected_before = admin_view(base)["rejected"]

    t0 = time.monotonic()
    before = asyncio.run(normal_load(base, 2 * seats, seats, 0))
    capacity = len(before) / (time.monotonic() - t0)  # requests/s with every seat busy
    assert [o for o, _, _ in before] == ["completed"] * len(before), before
    rate = OVERLOAD_FACTOR * capacity

    over = asyncio.run(overload(base, rate, OVERLOAD_S, cluster.controller))
    after = asyncio.run(normal_load(base, 2 * seats, seats, 10_000))

    counts: dict[str, int] = {}
    codes: dict[str, int] = {}
    for o, _, detail in over["outcomes"]:
        counts[o] = counts.get(o, 0) + 1
        if o == "rejected":
            codes[detail] = codes.get(detail, 0) + 1
    completed, rejected = counts.get("completed", 0), counts.get("rejected", 0)
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
        "p50_s_after": round(p50(after), 3),
        "after_completed": sum(1 for o, _, _ in after if o == "completed"),
        "after_offered": len(after),
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
    assert [o for o, _, _ in after] == ["completed"] * len(after), after  # recovered
    view = wait_for(lambda: (v := admin_view(base))["in_flight"] == 0 and v, 30, "in_flight 0")
    assert view["rejected"] - rejected_before == rejected, (view, figures)  # server agrees
    replica_check([cluster])
