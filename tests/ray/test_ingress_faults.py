"""The ingress tier: an ingress replica killed while it streams, prefix-cache sharing groups,
and tenants' limits that hold for the app, not per ingress replica, through the served app over
loopback HTTP.

One Ray (1 fake GPU, no dashboard) and one Serve app for the module: TWO ingress replicas
(`ingress_replicas: 2`, the Serve proxy spreads requests over them) in front of one paced
`sim` replica with 6 seats, no local queue (the controller's global queue holds the rest) and
`stale_assignment_s: 5` (an assignment nobody picks up is dropped after 5 s). Tenants `a` and
`b` share a prefix-cache group; `c` is in none; `m` may have 3 requests in flight and `q` has a
quota of 600 tokens per minute, for the app as a whole.

An ingress replica that dies takes its `ClusterClient`s with it, and Ray does not stop an
actor's streaming generator when its caller dies: without the replicas' owner check
(`Replica._watch_owners`) the orphaned requests would run to max_tokens, holding seats and KV
blocks. The test tells the orphans apart from the rest by that: once the clients of the dead
ingress have seen their streams end, the model replica must hold no more requests than
clients still stream.

Every wait is bounded; nothing asserts on wall-clock time except as an upper bound on a wait.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

ray = pytest.importorskip("ray")
from loopback import free_port, run_serve_app, wait_for  # noqa: E402
from ray import serve  # noqa: E402
from serve_actors import sigkill  # noqa: E402

from fairbatch.deployments.cluster.launch import NAMESPACE  # noqa: E402
from fairbatch.engine.tokenizer import Tokenizer  # noqa: E402

KEYS = {"a": "sk-ing-a", "b": "sk-ing-b", "c": "sk-ing-c", "m": "sk-ing-m", "q": "sk-ing-q"}
MAX_REQUESTS = 3  # tenant m's in-flight bound
QUOTA = 600  # tenant q's tokens per minute
ADMIN = "sk-ing-admin"
MODEL = "fairbatch-sim"
SEATS = 6
INGRESSES = 2
DEPLOY_TIMEOUT_S = 180
REQUEST_TIMEOUT_S = 90  # one whole request
LONG = 360  # tokens of a stream in the kill test (~18 s of a seat at ~50 ms a step)
# Once a client of the dead ingress has seen its stream end, its orphaned request must leave
# the replica within this (the owner check runs every second). Left alone, an orphan runs on
# for the rest of its LONG tokens (>= 17 s).
ORPHANS_GONE_S = 6
USAGE_GRACE_S = 3.0


def app_args(usage_path: str) -> dict:
    return {
        "model": "sim",
        "num_replicas": 1,
        "ingress_replicas": INGRESSES,
        "cluster_name": "fbing",
        "metrics_interval_s": 0,
        "startup_timeout_s": 120,
        "request_timeout_s": 60,
        "admin_api_key": ADMIN,
        "allow_anonymous": False,
        "engine": {
            "num_gpu_blocks": 512,
            "num_cpu_blocks": 64,
            "max_num_seqs": SEATS,
            "max_num_batched_tokens": 512,
            "max_model_len": 1024,
            "device": "cpu",
            "time_scale": 7.0,
        },
        # a request whose ingress died is recorded by the controller after USAGE_GRACE_S
        "controller": {"local_queue": 0, "stale_assignment_s": 5.0, "usage_grace_s": USAGE_GRACE_S},
        "usage": {"path": usage_path},
        "tenants": [
            {"name": "a", "api_key": KEYS["a"], "prefix_cache_group": "ab"},
            {"name": "b", "api_key": KEYS["b"], "prefix_cache_group": "ab"},
            {"name": "c", "api_key": KEYS["c"]},
            {"name": "m", "api_key": KEYS["m"], "max_requests": MAX_REQUESTS},
            {"name": "q", "api_key": KEYS["q"], "tokens_per_minute": QUOTA},
        ],
    }


def ingress_actors() -> dict[str, object]:
    """Actor id -> handle of the live ingress replicas (Serve names them in its namespace)."""
    out = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == "serve" and "FairbatchIngress" in a["name"]:
            try:
                h = ray.get_actor(a["name"], namespace="serve")
            except ValueError:
                continue  # died meanwhile
            out[h._actor_id.hex()] = h
    return out


def ingress_running() -> int:
    app = serve.status().applications.get("fairbatch")
    if app is None:
        return 0
    dep = app.deployments.get("FairbatchIngress")
    return 0 if dep is None else dep.replica_states.get("RUNNING", 0)


@pytest.fixture(scope="module")
def served(ray_starter, tmp_path_factory):
    http_port = free_port()
    ray_starter(num_gpus=1)
    usage = tmp_path_factory.mktemp("usage") / "usage.jsonl"
    try:
        base = run_serve_app(app_args(str(usage)), http_port, DEPLOY_TIMEOUT_S)
        handle = serve.get_app_handle("fairbatch")
        reps = handle.replica_handles.remote().result(timeout_s=30)
        ctrl_name = next(iter(reps)).rsplit("-r", 1)[0] + "-controller"
        controller = ray.get_actor(ctrl_name, namespace=NAMESPACE)
        cluster = SimpleNamespace(name=ctrl_name, replicas=reps, controller=controller)
        wait_for(lambda: len(ingress_actors()) == INGRESSES, 60, "both ingress actors")
        yield SimpleNamespace(
            base=base, cluster=cluster, replica=next(iter(reps.values())), usage=usage
        )
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def prompt_ids(i: int, n: int = 12) -> list[int]:
    return [(i * 41 + j * 13) % 900 + 20 for j in range(n)]


def auth(tenant: str) -> dict:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


# ---- 1. an ingress replica dies while it streams ----------------------------------------------


async def stream(base: str, i: int, tenant: str, max_tokens: int, progress: list) -> dict:
    """One greedy streaming completion; `progress[i]` counts the text chunks received. Ends as
    completed (finish_reason, [DONE]), or with what
    ended it: an HTTP status, a cut connection, a stream without [DONE], or a timeout."""
    body = {
        "model": MODEL,
        "prompt": prompt_ids(i),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    out = {"i": i, "tenant": tenant, "text": "", "finish": None, "done": False, "error": None}
    out["id"] = None
    try:
        async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as h:
            async with h.stream("POST", "/v1/completions", json=body, headers=auth(tenant)) as r:
                if r.status_code != 200:
                    out["error"] = f"status {r.status_code}"
                    return out
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out["done"] = True
                        continue
                    data = json.loads(line[6:])
                    out["id"] = out["id"] or data.get("id")
                    if "error" in data:
                        out["error"] = f"error event {data['error'].get('code')}"
                        continue
                    choice = data["choices"][0]
                    out["text"] += choice["text"]
                    out["finish"] = choice["finish_reason"] or out["finish"]
                    progress[i] += 1
        if out["error"] is None and not out["done"]:
            out["error"] = "ended without [DONE]"
    except httpx.TimeoutException:
        out["error"] = "hung"
    except httpx.HTTPError as e:  # the connection was cut: a clean end for the client
        out["error"] = type(e).__name__
    finally:
        out["ended"] = time.monotonic()
    return out


async def short(base: str, i: int) -> str:
    """A small non-streaming completion: "200", another status, or how the connection ended."""
    body = {"model": MODEL, "prompt": prompt_ids(200 + i), "max_tokens": 8, "ignore_eos": True}
    try:
        async with httpx.AsyncClient(base_url=base, timeout=REQUEST_TIMEOUT_S) as h:
            r = await h.post("/v1/completions", json=body, headers=auth("abc"[i % 3]))
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError as e:
        return type(e).__name__
    ok = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    return "200" if ok else str(r.status_code)


def expected_text(prompt: list[int], n: int, sim_expected) -> str:
    tok = Tokenizer.tiny()
    return tok.decode(sim_expected(prompt, n, tok.vocab_size))


def replica_stats(served) -> dict:
    return ray.get(served.replica.stats.remote(), timeout=30)


def test_ingress_replica_killed_during_streams(served, sim_expected, replica_check):
    """8 long greedy streams (6 seats: 6 stream, 2 wait at the controller) through the two
    ingress replicas; the one driving the most streams is killed. Its clients see a clean end
    (cut connection or error), never a hang; the others' streams complete exactly; the
    orphaned requests leave the model replica within a bounded time (they would otherwise run
    to max_tokens); new requests succeed; the pool ends all-free and the controller idle."""
    base, cluster = served.base, served.cluster
    n = SEATS + 2
    tenants = ["abc"[i % 3] for i in range(n)]
    seen: dict = {}

    async def run() -> tuple[list[dict], float]:
        progress = [0] * n
        tasks = [asyncio.create_task(stream(base, i, tenants[i], LONG, progress)) for i in range(n)]

        def under_way() -> bool:
            return sum(1 for p in progress if p >= 5) >= SEATS

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not under_way():
            assert loop.time() < deadline, f"streams not under way: {progress}"
            await asyncio.sleep(0.05)
        stats = await asyncio.to_thread(replica_stats, served)
        ingresses = await asyncio.to_thread(ingress_actors)
        owners = stats["owners"]  # ingress actor id -> streams it drives on the replica
        assert set(owners) <= set(ingresses), (owners, list(ingresses))
        victim = max(ingresses, key=lambda a: owners.get(a, 0))
        seen.update(owners=dict(owners), victim=victim, progress=list(progress))
        ray.kill(ingresses[victim], no_restart=True)
        killed_at = time.monotonic()
        # New requests while Serve has not replaced it yet: served, or a clean 5xx.
        during = [asyncio.create_task(short(base, k)) for k in range(4)]

        # The dead ingress's clients see their streams end (a cut, or a 5xx before the first
        # token); from then on the replica may hold no more requests than the clients still
        # waiting for theirs: the orphans must have been aborted, not left to run to the end.
        deadline = loop.time() + 30
        while not any(t.done() for t in tasks):
            assert loop.time() < deadline, f"no client noticed the dead ingress: {progress}"
            await asyncio.sleep(0.05)
        seen["first_cut_s"] = round(time.monotonic() - killed_at, 1)

        def orphans_gone() -> bool:
            ended = sum(1 for t in tasks if t.done())
            waiting = n - ended + sum(1 for t in during if not t.done())
            s = replica_stats(served)
            seen.update(after=dict(running=s["running"], waiting=s["waiting"],
                                   owners=s["owners"], ended=ended))  # fmt: skip
            return s["running"] + s["waiting"] <= waiting and victim not in s["owners"]

        deadline = loop.time() + ORPHANS_GONE_S
        while not await asyncio.to_thread(orphans_gone):
            assert loop.time() < deadline, f"orphans still on the replica: {seen}"
            await asyncio.sleep(0.2)
        seen["orphans_gone_s"] = round(time.monotonic() - killed_at, 1)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 3 * REQUEST_TIMEOUT_S)
        seen["during"] = await asyncio.wait_for(asyncio.gather(*during), 2 * REQUEST_TIMEOUT_S)
        return results, killed_at

    results, killed_at = asyncio.run(run())
    completed = [r for r in results if r["error"] is None]
    cut = [r for r in results if r["error"] is not None]
    seen["completed"], seen["cut"] = len(completed), len(cut)
    seen["cut_errors"] = sorted({r["error"] for r in cut})
    seen["cut_after_s"] = max((round(r["ended"] - killed_at, 1) for r in cut), default=None)
    print(f"ingress kill: {seen}")

    assert seen["owners"].get(seen["victim"], 0) >= 1, seen  # it really drove streams
    assert cut, seen  # ...and its clients noticed
    assert not [r for r in cut if r["error"] == "hung"], seen  # never a hang
    clean = [x for x in seen["during"] if x == "200" or x[0] == "5" or x.endswith("Error")]
    assert clean == seen["during"], seen  # nor for requests sent meanwhile: 200, 5xx or a cut
    for r in completed:  # the other ingress's streams: undisturbed, exactly
        assert (r["finish"], r["done"]) == ("length", True), r
        assert r["text"] == expected_text(prompt_ids(r["i"]), LONG, sim_expected), r["i"]
    check_usage_records(served.usage, completed, cut, seen["progress"])

    # New requests: Serve replaces the dead ingress; then every request is served.
    wait_for(lambda: ingress_running() == INGRESSES, 120, "Serve to replace the ingress")
    wait_for(lambda: len(ingress_actors()) == INGRESSES, 60, "the new ingress actor")
    body = {"model": MODEL, "prompt": prompt_ids(99), "max_tokens": 8, "ignore_eos": True}
    for i in range(6):
        r = httpx.post(f"{base}/v1/completions", json=body, headers=auth("abc"[i % 3]), timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    replica_check([cluster])  # all-free, and the controller forgot the orphans
    assert replica_stats(served)["owners"] == {}  # no owner entry outlives its streams
    users = ray.get(cluster.controller.__ray_call__.remote(lambda c: len(c.users)), timeout=30)
    print(f"ingress kill: controller attach count {users} for {INGRESSES} live ingresses")
    # A detach (here of a name never attached) stops counting ingresses that died attached, so
    # the last live ingress to detach will still stop the cluster.
    live = ray.get(cluster.controller.detach.remote("probe-never-attached"), timeout=60)
    assert live == INGRESSES, (users, live)


def check_usage_records(path, completed: list[dict], cut: list[dict], progress: list) -> None:
    """Every stream has one usage record: the surviving ingress wrote its own streams'; the
    controller wrote the dead ingress's (none of its records reached the log), "ingress_lost",
    with at least the tokens its client had seen and fewer than the stream asked for."""

    def read() -> list[dict]:
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def lost() -> list[dict]:
        return [r for r in read() if r["recorded_by"] == "controller"]

    def all_in() -> bool:
        ids = {r["response_id"] for r in read()}
        return len(lost()) >= len(cut) and all(s["id"] in ids for s in completed)

    wait_for(all_in, 10 * USAGE_GRACE_S, "every stream's usage record")
    records = read()
    by_response = {}
    for r in records:
        assert r["response_id"] not in by_response, r  # one record per request
        by_response[r["response_id"]] = r
    for s in completed:
        r = by_response[s["id"]]
        assert (r["recorded_by"], r["finish_reason"], r["output_tokens"]) == (
            "ingress",
            "length",
            LONG,
        )
    for s in cut:
        if s["id"] is None:  # cut before its first token: not known by id here
            continue
        r = by_response[s["id"]]
        assert (r["recorded_by"], r["finish_reason"]) == ("controller", "ingress_lost"), r
        assert max(1, progress[s["i"]]) <= r["output_tokens"] < LONG, (r, progress[s["i"]])
    assert len(lost()) == len(cut), (lost(), cut)


# ---- 2. prefix-cache groups through the app -------------------------------------------------


def test_prefix_cache_group_shares_blocks_through_the_ray_app(served, replica_check):
    """a then b (one group) send the same prompt: b hits every full block but the last
    token's; c (no group) then hits nothing of theirs. Counted by GET /admin/stats."""
    base = served.base
    admin = {"Authorization": f"Bearer {ADMIN}"}
    prompt = prompt_ids(7, 70)

    def hits() -> int:
        r = httpx.get(f"{base}/admin/stats", headers=admin, timeout=30)
        return r.json()["engine"]["prefix_hit_tokens"]

    def send(tenant: str) -> int:
        before = hits()
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        r = httpx.post(f"{base}/v1/completions", json=body, headers=auth(tenant), timeout=60)
        assert r.status_code == 200, r.text
        return hits() - before

    got = [send(t) for t in ("a", "b", "c")]
    print(f"prefix group through Ray: hits a, b, c = {got}")
    assert got == [0, (len(prompt) - 1) // 16 * 16, 0]
    replica_check([served.cluster])


# ---- 3. limits hold for the app, not per ingress replica --------------------------------------


async def _post(client: httpx.AsyncClient, base: str, tenant: str, i: int, max_tokens: int):
    body = {"model": MODEL, "prompt": prompt_ids(i), "max_tokens": max_tokens, "temperature": 0}
    return await client.post(f"{base}/v1/completions", json=body, headers=auth(tenant))


def test_in_flight_bound_holds_across_both_ingresses(served, replica_check):
    """10 requests of m at once, spread over both ingresses by the proxy: exactly MAX_REQUESTS
    run (each ingress alone would have let MAX_REQUESTS of its own through), the rest are
    429 tenant_queue_full with a Retry-After."""

    async def run() -> list:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            return await asyncio.gather(
                *(_post(client, served.base, "m", i, 60) for i in range(10))
            )

    got = asyncio.run(run())
    ok = [r for r in got if r.status_code == 200]
    refused = [r for r in got if r.status_code == 429]
    assert len(ok) == MAX_REQUESTS and len(refused) == 10 - MAX_REQUESTS, [
        (r.status_code, r.text[:200]) for r in got
    ]
    for r in refused:
        assert r.json()["error"]["code"] == "tenant_queue_full"
        assert int(r.headers["retry-after"]) >= 1
    replica_check([served.cluster])


def test_quota_holds_across_both_ingresses(served, replica_check):
    """6 clients send q's requests (12 prompt + 8 output tokens) back to back for 10 s, over
    both ingresses: the app admits the bucket (QUOTA) plus its refill while they run, plus at
    most one request per client admitted while the bucket was still positive (charged its
    output after) - not a bucket per ingress."""
    per_request = 12 + 8
    clients, seconds = 6, 10.0

    async def client_loop(client: httpx.AsyncClient, k: int, t_end: float, out: list) -> None:
        i = 0
        while time.monotonic() < t_end:
            r = await _post(client, served.base, "q", 1000 * k + i, 8)
            out.append(r)
            i += 1
            if r.status_code == 429:
                await asyncio.sleep(0.05)

    async def run() -> tuple[list, float]:
        out: list = []
        t0 = time.monotonic()
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            await asyncio.gather(
                *(client_loop(client, k, t0 + seconds, out) for k in range(clients))
            )
        return out, time.monotonic() - t0

    got, elapsed = asyncio.run(run())
    ok = [r for r in got if r.status_code == 200]
    admitted = sum(r.json()["usage"]["total_tokens"] for r in ok)
    refused = [r for r in got if r.status_code == 429]
    bound = QUOTA + QUOTA / 60 * elapsed + clients * per_request
    print(f"quota through 2 ingresses: {admitted} tokens admitted in {elapsed:.1f} s "
          f"(bound {bound:.0f}), {len(refused)} refused")  # fmt: skip
    assert {r.status_code for r in got} <= {200, 429}
    assert QUOTA <= admitted <= bound
    assert refused and all(r.json()["error"]["code"] == "quota_exceeded" for r in refused)
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    replica_check([served.cluster])


# ---- 4. admin changes reach every ingress and outlive restarts ----------------------------------


def _tenant_views(base: str, name: str, n: int = 16) -> list[tuple]:
    """(weight, max_requests) of `name` as n GET /admin/tenants calls through the proxy (which
    spreads them over both ingresses) answer."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    views = []
    for _ in range(n):
        r = httpx.get(f"{base}/admin/tenants", headers=admin, timeout=30)
        assert r.status_code == 200, r.text
        t = next(t for t in r.json()["data"] if t["name"] == name)
        views.append((t["weight"], t["max_requests"]))
    return views


def test_admin_change_reaches_every_ingress_and_outlives_restarts(served, replica_check):
    """PATCH c through one ingress: within a sync period both ingresses show it; after the
    controller is killed (Ray restarts it) its queue weighs c by it and its bound holds;
    an ingress that starts later (a replacement for a killed one) shows it too."""
    base, controller = served.base, served.cluster.controller
    admin = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.patch(f"{base}/admin/tenants/c", json={"weight": 2.5, "max_requests": 2},
                    headers=admin, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    wait_for(lambda: set(_tenant_views(base, "c")) == {(2.5, 2)}, 10, "the change on both")

    sigkill(controller)
    wait_for(lambda: ray.get(controller.tenants.remote(), timeout=10)["c"][0] == 2.5, 60,
             "the restarted controller's weight for c")  # fmt: skip

    async def three() -> list[int] | None:
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as client:
            got = await asyncio.gather(*(_post(client, base, "c", i, 60) for i in range(3)))
        codes = sorted(r.status_code for r in got)
        return codes if set(codes) <= {200, 429} else None  # (5xx: still restarting)

    codes = wait_for(lambda: asyncio.run(three()), 60, "c served after the restart")
    assert codes == [200, 200, 429], codes  # the bound of 2, from the kept change

    victim = sorted(ingress_actors())[0]
    sigkill(ingress_actors()[victim])
    wait_for(lambda: victim not in ingress_actors() and len(ingress_actors()) == INGRESSES, 120,
             "a replacement ingress")  # fmt: skip
    wait_for(lambda: ingress_running() == INGRESSES, 120, "both ingresses running")
    assert set(_tenant_views(base, "c")) == {(2.5, 2)}
    replica_check([served.cluster])
