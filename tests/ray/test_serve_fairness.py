"""Weights and priorities hold end to end on the Ray Serve app, on `fairbatch serve`'s default
settings (tiny model, 2 replicas x 16 seats, a local queue of 2 each, weighted fair inside
priority, Serve's direct ingress): through HTTP, and through the handle API.

Two tenants with weights 3:1 each keep more requests outstanding than the app has seats plus
local-queue places (36; 64 and 40), so both stay backlogged at the controller (checked: its
queue per tenant is sampled); the tokens each is served (from every request's `usage`) over a
30 s window after warm-up must be 3:1 within 15%. The load's clients run in a process of their
own (in CI's one pytest process, a thousand tests after its start, they took 0.36 core against
~0.2 alone, and the queues ran dry in 15% of the samples). Four of each tenant's clients
stream (their TTFT is the backlogged tenants'); the others take whole responses. Streaming all
104 cost the client ~0.5 core and the ingress as much, which starved the probe (2.7x idle) and
let the queues run dry (backlogged 0.86); whole responses cost the client ~0.13-0.26 core.
A priority-10 tenant sends one request at a time meanwhile, from a process of its own: every
one of its requests must get its first token from the first engine step that starts after it
reaches its replica's engine (counted in steps from the trace, so the machine's load cannot
change it), and its median TTFT must stay under a quarter of the backlogged tenants'. Its
median TTFT under load against its median TTFT on the idle app (the goal: within 2x where steps
run at a GPU's pace) is printed, not asserted: on 2 shared cores it moves with whatever else
runs (2.04x once in CI, with the same step counts).

Twice: with the tiny model, where the two engine threads and the serving plane share 2 cores
and a CPU step is long against a first token, and with replicas paced like a GPU (`model:
sim`, `time_scale: 2`: a step takes twice its modelled GPU time and next to no CPU). Twice the
modelled time halves the tokens the 2 cores must carry to this test's load, whose client work
would otherwise starve the serving plane and the probe. The result prints the cores each role
used over the window (`cores`), so a slow run says what competed for them.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from loopback import ServerLoop, free_port, run_serve_app  # noqa: E402

KEYS = {"a": "sk-fair-a", "b": "sk-fair-b", "p": "sk-fair-p", "q": "sk-fair-q"}
WEIGHTS = {"a": 3.0, "b": 1.0}
# Clients per backlogged tenant, one request outstanding each: each tenant keeps more
# outstanding than the app's 2 x (16 seats + 2 local places), and the heavier one up to its
# in-flight limit (64), since its clients between two requests are 3x as many as the other's.
STREAMS = {"a": 64, "b": 40}
# Of each tenant's clients, this many stream their tokens (their TTFT is the backlogged
# tenants' TTFT); the others take the whole response at once, which costs the load's process
# and the ingress a fraction of the CPU per token, so that the load does not starve the app
# and the probe it measures.
STREAMED = 4
PROMPT_LEN, MAX_TOKENS = 32, 32
WARMUP_S, WINDOW_S = 8.0, 30.0
PROBE_MAX_TOKENS = 4
MODEL = "fairbatch-tiny"


# the replicas behind the app: `fairbatch serve`'s tiny model, or simulated and GPU-paced
REPLICAS = {
    "tiny": {},
    "paced": {"model": "sim", "served_model_name": MODEL, "engine": {"time_scale": 2.0}},
}


def app_args(replicas: str = "tiny") -> dict:
    return {  # `fairbatch serve` defaults, plus three tenants with keys
        "model": "tiny",
        "num_replicas": 2,
        "cluster_name": "fairtest",
        "metrics_interval_s": 0,
        "allow_anonymous": False,
        "tenants": [
            {"name": "a", "api_key": KEYS["a"], "weight": WEIGHTS["a"]},
            {"name": "b", "api_key": KEYS["b"], "weight": WEIGHTS["b"]},
            {"name": "p", "api_key": KEYS["p"], "priority": 10},
            {"name": "q", "api_key": KEYS["q"], "max_requests": 1},  # the refusal probe
        ],
        # bounds the overload test reaches (the defaults are far higher)
        "limits": {"max_requests_per_tenant": 64, "max_requests_total": 256},
        **REPLICAS[replicas],
    }


@pytest.fixture(scope="module")
def app(request, ray_starter, tmp_path_factory):
    """The app, on the replicas `REPLICAS[param]` (tests pick them with `indirect`)."""
    from fairbatch.deployments.serve.cli import serve_env

    replicas = request.param
    saved = dict(os.environ)
    port = free_port()
    serve_env(port)  # as `fairbatch serve` starts Ray: direct ingress on `port`
    traces = str(tmp_path_factory.mktemp("trace"))  # the priority tenant's hops, every process
    os.environ.update(FAIRBATCH_TRACE_DIR=traces, FAIRBATCH_TRACE_TENANT="p")
    ray_starter(num_gpus=2)
    loop = ServerLoop()
    try:
        base = run_serve_app(app_args(replicas), port, timeout_s=240)
        yield {"base": base, "loop": loop, "traces": traces, "replicas": replicas}
    finally:
        from ray import serve

        loop.close()
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            os.environ.clear()
            os.environ.update(saved)


def prompt(tenant: str, i: int) -> list[int]:
    seed = {"a": 11, "b": 23, "p": 37}[tenant] * 1000 + i  # distinct: no prefix-cache hits
    return [(seed * 7 + j * 13) % 1900 + 20 for j in range(PROMPT_LEN)]


class HttpTransport:
    def __init__(self, base: str) -> None:
        self.base = base
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(120.0),
            # every stream keeps its connection (httpx keeps 20 by default: the others would
            # open a new one per request, which costs this process and the ingress)
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def one(
        self, tenant: str, ids: list[int], max_tokens: int, stream: bool = True
    ) -> tuple[float | None, int]:
        """(TTFT s, completion tokens from usage) of one request; TTFT None unless streamed."""
        body = {
            "model": MODEL,
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
        headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
        url = f"{self.base}/v1/completions"
        if not stream:
            r = await self.client.post(url, json=body, headers=headers)
            assert r.status_code == 200, r.text
            tokens = r.json()["usage"]["completion_tokens"]
            assert tokens == max_tokens, r.text
            return None, tokens
        t0, ttft, tokens = time.monotonic(), None, 0
        async with self.client.stream("POST", url, json=body, headers=headers) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                data = json.loads(line[6:])
                assert "error" not in data, data
                if ttft is None and any(c.get("text") for c in data["choices"]):
                    ttft = time.monotonic() - t0
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
        assert ttft is not None and tokens == max_tokens
        return ttft, tokens

    async def close(self) -> None:
        await self.client.aclose()


class HandleTransport:
    def __init__(self) -> None:
        from ray import serve

        self.plain = serve.get_app_handle("fairbatch")
        self.handle = self.plain.options(stream=True)

    async def one(
        self, tenant: str, ids: list[int], max_tokens: int, stream: bool = True
    ) -> tuple[float | None, int]:
        req = {
            "prompt_token_ids": ids,
            "tenant": tenant,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if not stream:
            out = await self.plain.complete.remote(req)
            assert out["usage"]["completion_tokens"] == max_tokens, out
            return None, max_tokens
        t0, ttft, usage = time.monotonic(), None, None
        async for chunk in self.handle.generate.remote(req):
            if ttft is None and chunk["token_ids"]:
                ttft = time.monotonic() - t0
            if chunk["finished"]:
                usage = chunk["usage"]
        assert ttft is not None and usage["completion_tokens"] == max_tokens
        return ttft, usage["completion_tokens"]

    async def close(self) -> None:
        pass


# The priority tenant's TTFT, measured from a process of its own (as the refusal probe below):
# the load streams keep this test's process busy, and its event-loop lag would otherwise be
# part of what is measured. One request at a time, `count` of them, or as many as fit in
# `seconds` with a 0.2 s pause between them; prints the TTFTs (s). Through HTTP, or through a
# Serve handle from a Ray driver of its own.
PRIORITY_PROBE = r"""
import json, sys, time
transport, target, key, first, count, seconds, prompt_len, max_tokens = sys.argv[1:9]
first, count, seconds = int(first), int(count), float(seconds)
prompt_len, max_tokens = int(prompt_len), int(max_tokens)

def prompt(i):  # the test's prompt("p", i)
    seed = 37 * 1000 + i
    return [(seed * 7 + j * 13) % 1900 + 20 for j in range(prompt_len)]

if transport == "http":
    import httpx
    client = httpx.Client(timeout=120)
    def one(i):
        body = {"model": "fairbatch-tiny", "prompt": prompt(i), "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": True}
        t0, ttft = time.monotonic(), None
        with client.stream("POST", target + "/v1/completions", json=body,
                           headers={"Authorization": "Bearer " + key}) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if ttft is None and line.startswith("data: {"):
                    if any(c.get("text") for c in json.loads(line[6:])["choices"]):
                        ttft = time.monotonic() - t0
        return ttft
else:
    import ray
    from ray import serve
    ray.init(address=target, log_to_driver=False)
    handle = serve.get_app_handle("fairbatch").options(stream=True)
    def one(i):
        req = {"prompt_token_ids": prompt(i), "tenant": "p", "max_tokens": max_tokens,
               "temperature": 0.0, "ignore_eos": True}
        t0, ttft = time.monotonic(), None
        for chunk in handle.generate.remote(req):
            if ttft is None and chunk["token_ids"]:
                ttft = time.monotonic() - t0
        return ttft
    one(first - 1)  # the first call through a new handle sets it up: not a sample

ttfts, i, end = [], first, time.monotonic() + seconds
while len(ttfts) < count or time.monotonic() < end:
    ttfts.append(one(i))
    i += 1
    if seconds:
        time.sleep(0.2)
print(json.dumps(ttfts))
"""


async def priority_probe(transport: str, target: str, first: int, count: int, seconds: float):
    args = [transport, target, KEYS["p"], first, count, seconds, PROMPT_LEN, PROBE_MAX_TOKENS]
    cmd = [sys.executable, "-c", PRIORITY_PROBE, *map(str, args)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), seconds + 120)
    assert proc.returncode == 0, out
    ttfts = json.loads(out)
    assert None not in ttfts, ttfts
    return ttfts


async def load(kind: str, target: str) -> None:
    """The backlogged tenants' clients, each with one request outstanding at a time, from their
    start until a line on stdin; then every client ends its request. Prints what each tenant
    was served ((end time, tokens) per request; `time.monotonic`, one clock for all processes
    on a machine) and the streamed requests' TTFTs, as JSON. The test runs this in a process
    of its own (`python <this file> KIND TARGET`), through HTTP or a Serve handle."""
    if kind == "handle":
        ray.init(address=target, log_to_driver=False)
    transport = HttpTransport(target) if kind == "http" else HandleTransport()
    served: dict[str, list[tuple[float, int]]] = {t: [] for t in WEIGHTS}
    ttfts: list[float] = []
    counter = dict.fromkeys(WEIGHTS, 0)
    stop = asyncio.Event()

    async def client(tenant: str, streamed: bool) -> None:
        while not stop.is_set():
            counter[tenant] += 1
            ids = prompt(tenant, counter[tenant])
            ttft, tokens = await transport.one(tenant, ids, MAX_TOKENS, streamed)
            served[tenant].append((time.monotonic(), tokens))
            if streamed:
                ttfts.append(ttft)

    clients = [
        asyncio.create_task(client(t, streamed=i < STREAMED))
        for t in WEIGHTS
        for i in range(STREAMS[t])
    ]
    await asyncio.to_thread(sys.stdin.readline)
    stop.set()
    await asyncio.wait_for(asyncio.gather(*clients), 120)  # every client ends its request
    await transport.close()
    print(json.dumps({"served": served, "ttfts": ttfts}), flush=True)


async def scenario(kind: str, target: str, traces: str) -> dict:
    from fairbatch.benchmarks.serving_path import by_role, cpu_snapshot
    from fairbatch.deployments.cluster import trace

    # The priority tenant on the idle app first.
    idle_start = time.monotonic()
    idle = await priority_probe(kind, target, 1, 12, 0)
    idle_end = time.monotonic()

    backlog: list[dict[str, int]] = []  # the controller's queue per tenant, sampled
    stop = asyncio.Event()

    async def sample_backlog() -> None:
        from ray import serve

        handle = serve.get_app_handle("fairbatch")
        while not stop.is_set():
            stats = await handle.cluster_stats.remote()
            backlog.append(stats["controller"]["queued_by_tenant"])
            await asyncio.sleep(0.5)

    support = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    path = os.pathsep.join(p for p in (support, os.environ.get("PYTHONPATH")) if p)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, os.path.abspath(__file__), kind, target,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": path},
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        await asyncio.sleep(WARMUP_S)
        assert proc.returncode is None, "the load's process ended before the window"
        sampler = asyncio.create_task(sample_backlog())
        roles = {proc.pid: "load"}
        cpu0 = cpu_snapshot(roles)
        start = time.monotonic()
        loaded = await priority_probe(kind, target, 100, 1, WINDOW_S)  # meanwhile
        end = time.monotonic()
        cpu1 = cpu_snapshot(roles)
        stop.set()
        out, _ = await asyncio.wait_for(proc.communicate(b"stop\n"), 150)
        assert proc.returncode == 0, out
        await sampler
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    result = json.loads(out.decode().strip().splitlines()[-1])
    served, ttfts = result["served"], result["ttfts"]
    cores = {role: round(s / (end - start), 2) for role, s in by_role(cpu0, cpu1).items()}
    window = {t: sum(n for at, n in rows if start <= at < end) for t, rows in served.items()}
    return {
        "window": window,
        "window_s": round(end - start, 1),
        "warmup_s": round(start - t0, 1),
        "idle_ttft_ms": round(1000 * statistics.median(idle), 1),
        "loaded_ttft_ms": round(1000 * statistics.median(loaded), 1),
        "backlogged_ttft_ms": round(1000 * statistics.median(ttfts), 1),
        "probes": len(loaded),
        # where the probe's TTFT went, hop by hop (median ms; deployments/cluster/trace.py)
        "hops_idle": trace.summarize(traces, idle_start, idle_end),
        "hops_loaded": trace.summarize(traces, start, end),
        "requests": {t: len(rows) for t, rows in served.items()},
        # the share of samples in which the tenant had requests queued at the controller
        "backlogged": {
            t: round(sum(q.get(t, 0) > 0 for q in backlog) / len(backlog), 2) for t in WEIGHTS
        },  # fmt: skip
        # and how many it had queued there, median over the samples (the premise's margin)
        "queued": {t: statistics.median(q.get(t, 0) for q in backlog) for t in WEIGHTS},
        # cores each role used over the window ("load": the load's clients; "client": this
        # process, the sampler; "other": the probe's process, and whatever else ran)
        "cores": dict(sorted(cores.items(), key=lambda kv: -kv[1])),
    }


@pytest.mark.parametrize("app", ["tiny", "paced"], indirect=True)
@pytest.mark.parametrize("transport", ["http", "handle"])
def test_weights_and_priority_hold_end_to_end(app, transport):
    loop: ServerLoop = app["loop"]

    target = app["base"] if transport == "http" else ray.get_runtime_context().gcs_address
    got = loop.run(scenario(transport, target, app["traces"]), timeout=WARMUP_S + WINDOW_S + 300)
    print(f"fairness via {transport}: {got}")
    # The premise: both tenants stayed backlogged at the controller (else weights cannot show).
    assert min(got["backlogged"].values()) >= 0.9, got
    ratio = got["window"]["a"] / got["window"]["b"]
    want = WEIGHTS["a"] / WEIGHTS["b"]
    assert abs(ratio - want) <= 0.15 * want, got
    # Every probe request was traced from the ingress's client to its first token (through a
    # handle, the probe's first call sets its handle up: traced, not a sample).
    assert got["hops_loaded"]["n"] == got["probes"] + (transport == "handle"), got
    assert "total" in got["hops_loaded"] and "step_cpu" in got["hops_loaded"], got
    # The priority shows: its requests skip the queue the backlogged tenants wait in; on its
    # replica, each runs in the first step after it arrives, past the backlogged ones there.
    assert got["loaded_ttft_ms"] <= 0.25 * got["backlogged_ttft_ms"], got
    assert got["hops_loaded"]["steps_waited_max"] == 0, got
    # Within 2x of idle where steps run at a GPU's pace; on 2 shared cores a request waits out
    # the step running when it arrives and shares the cores with the load: reported only.
    to_idle = got["loaded_ttft_ms"] / got["idle_ttft_ms"]
    print(f"priority TTFT via {transport} on {app['replicas']}: {to_idle:.2f}x idle")


# ---- overload -----------------------------------------------------------------------------------

# The refusal latency a client sees, measured from a process of its own: the 360 load streams
# saturate this test's own process (one Python thread running httpx), whose event-loop lag
# would otherwise be what is measured. Tenant "q" may hold one request in flight: the probe
# keeps a long one streaming, then sends one request at a time, each refused at once (429).
PROBE = r"""
import json, sys, time, httpx
base, key, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
auth = {"Authorization": "Bearer " + key}
body = {"model": "fairbatch-tiny", "prompt": [20, 21, 22, 23], "max_tokens": 1}
hold = dict(body, max_tokens=900, ignore_eos=True, stream=True)
rows, end = [], time.monotonic() + seconds
with httpx.Client(timeout=120) as c, httpx.Client(timeout=120) as h:
    with h.stream("POST", base + "/v1/completions", json=hold, headers=auth) as held:
        assert held.status_code == 200, held.status_code
        while time.monotonic() < end:
            t0 = time.monotonic()
            r = c.post(base + "/v1/completions", json=body, headers=auth)
            rows.append((r.status_code, time.monotonic() - t0, r.headers.get("retry-after")))
            time.sleep(0.05)
print(json.dumps(rows))
"""

OVERLOAD_STREAMS = 120  # per tenant, three tenants: over 64 per tenant and 256 in all
OVERLOAD_S = 20.0
OVERLOAD_TOKENS = 16


async def overload(base: str) -> dict:
    """Closed-loop clients that honour Retry-After: each sends a request, reads it to the end,
    and after a 429/503 waits what Retry-After says before the next one."""
    stats = {"accepted": 0, "completed": 0, "cut": [], "refused": [], "bad_refusals": []}
    deadline = time.monotonic() + OVERLOAD_S
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=400)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:

        async def closed_loop(tenant: str, k: int) -> None:
            i = 0
            while time.monotonic() < deadline:
                i += 1
                body = {
                    "model": MODEL,
                    "prompt": prompt(tenant, 10_000 + 1000 * k + i)[:16],
                    "max_tokens": OVERLOAD_TOKENS,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
                t0 = time.monotonic()
                async with client.stream(
                    "POST", f"{base}/v1/completions", json=body, headers=headers
                ) as r:
                    if r.status_code in (429, 503):
                        stats["refused"].append(time.monotonic() - t0)
                        retry = r.headers.get("retry-after")
                        if retry is None or not retry.isdigit():
                            stats["bad_refusals"].append((r.status_code, retry))
                        await r.aread()
                        await asyncio.sleep(float(retry or 1))
                        continue
                    assert r.status_code == 200, (r.status_code, await r.aread())
                    stats["accepted"] += 1
                    usage, reason, error = None, None, None
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            error = data["error"]
                        for c in data.get("choices") or ():
                            reason = c.get("finish_reason") or reason
                        usage = data.get("usage") or usage
                    if error is None and reason == "length" and usage is not None:
                        if usage["completion_tokens"] == OVERLOAD_TOKENS:
                            stats["completed"] += 1
                            continue
                    stats["cut"].append((tenant, reason, usage, error))

        tasks = [closed_loop(t, k) for t in ("a", "b", "p") for k in range(OVERLOAD_STREAMS)]
        await asyncio.wait_for(asyncio.gather(*tasks), OVERLOAD_S + 180)
    return stats


@pytest.mark.parametrize("app", ["tiny"], indirect=True)
def test_overload_refuses_at_once_and_loses_nothing(app):
    probe_s = OVERLOAD_S - 8
    cmd = [sys.executable, "-c", PROBE, app["base"], KEYS["q"], str(probe_s)]

    async def run() -> tuple[dict, list]:
        load = asyncio.ensure_future(overload(app["base"]))
        await asyncio.sleep(4)  # the load is at its bounds
        proc = await asyncio.create_subprocess_exec(*cmd, stdout=subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), probe_s + 120)
        return await load, json.loads(out)

    stats, probes = app["loop"].run(run(), timeout=OVERLOAD_S + 240)
    refused = sorted(s for code, s, _ in probes if code in (429, 503))
    p99 = refused[int(0.99 * (len(refused) - 1))] if refused else None
    summary = {k: v for k, v in stats.items() if k not in ("refused", "cut")}
    summary.update(refusals=len(stats["refused"]), probes=len(probes))
    summary.update(probe_refusals=len(refused), refusal_p99_ms=p99 and round(1000 * p99, 1))
    summary["probe_p50_ms"] = refused and round(1000 * refused[len(refused) // 2], 1)
    summary["cut"] = stats["cut"][:5]
    print(f"overload: {summary}")
    assert stats["refused"] and refused, summary  # the limits were reached
    assert stats["cut"] == [], summary  # every accepted request ended with all its tokens
    assert stats["completed"] == stats["accepted"] > 0, summary
    assert stats["bad_refusals"] == [], summary  # every refusal says when to retry
    assert all(retry and retry.isdigit() for code, _, retry in probes if code != 200), probes
    r = httpx.get(f"{app['base']}/health", timeout=10)  # healthy afterwards, and serving
    assert r.status_code == 200
    body = {"model": MODEL, "prompt": prompt("a", 1)[:16], "max_tokens": 4, "ignore_eos": True}
    r = httpx.post(f"{app['base']}/v1/completions", json=body, timeout=60,
                   headers={"Authorization": f"Bearer {KEYS['a']}"})  # fmt: skip
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    # Not met yet on a 2-core machine (issue 15): a refusal waits behind the streams in Serve's
    # proxy and the ingress's event loop. Reported, not hidden: XFAIL with the numbers.
    if not refused or p99 > 0.050:
        pytest.xfail(f"refusal latency p99 {summary['refusal_p99_ms']} ms > 50 ms: {summary}")


if __name__ == "__main__":  # the load's process (`scenario`)
    asyncio.run(load(*sys.argv[1:3]))
