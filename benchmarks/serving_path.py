"""`fairbatch bench serve --compare serving-path`: one workload down every path to the client.

The same requests (token-id prompts, greedy, `ignore_eos`, a fixed number of streams) go
  * `offline`: `LLM("tiny", max_num_seqs=replicas x seats).generate(...)` in this process;
  * `engines`: the replicas' engines alone, one process each (`LLM("tiny", max_num_seqs=seats)`
    on its share of the cores, as a replica runs it), side by side, request i on engine
    i % replicas: what the replicas could deliver here if nothing else ran;
  * `local_http`: the local HTTP server (`serve_server`, one engine, no Ray) and a streaming
    HTTP client;
  * `serve_http@<ms>`: the Ray Serve app (`build_app`: ingress + controller + replica actors)
    as `fairbatch serve` runs it (Serve's direct ingress; `--proxy`: behind Serve's HTTP proxy),
    once per stream interval (`--intervals`, default 50 and 0);
  * `handle@<ms>`: the same app through its handle API (`generate`, streamed) from this driver.

`--sim-time-scale S` (S > 0) puts simulated replicas paced like a GPU (`model: sim`, `engine:
{time_scale: S}`) in place of the tiny model: a step then costs the modelled GPU time and next
to no CPU, as on a GPU node, so what the Serve paths lose is replica time the plane leaves
idle. `offline` is then one such engine (the seats of one replica, its share of the requests)
stepped back to back in this process, its rate times the replicas: what the replicas would
deliver with nothing between them and the client. `--model DIR` puts a Hugging Face checkpoint
in place of the tiny model in `offline` and the Serve paths (its tokenizer must cover the tiny
tokenizer's ids: the prompts are token ids drawn from them). `engines` and `local_http` run the
tiny model only.

For each: output tokens/s and its ratio to offline; TTFT, TPOT and ITL p50/p99 (ITL: the gaps
between the chunks a client receives, so coalescing lengthens it while TPOT stays); and the CPU
seconds each process role spent per 1,000 output tokens, read with psutil from every process on
the machine before and after the timed run (roles from Ray's process titles: replicas,
controller, ingress, proxy; `client` is this process; `ray_system` everything else Ray runs;
`server` the local HTTP server). `replica_share` is the replicas' CPU over the machine's
(cores x wall time): how much of the machine went to the model while requests were queued.
`preemptions_per_s` counts, per role, how often a process's threads were taken off a core for
another's (involuntary context switches of every thread, from /proc).

`--rounds N` runs every path N times in turn and reports each number's median over the rounds,
with the range of the ratio to offline (taken within each round): on a shared machine one
round's ratios move by about +-0.15.

Writes OUT/result.json (the table's rows; with rounds, every round's rows too) and
OUT/serving_path.png, prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

from fairbatch.benchmarks.serve_metrics import request_metrics
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec

ROLES = (  # process title prefix -> role (Ray sets the titles of its workers)
    ("ray::ClusterReplica", "replicas"),
    ("ray::ClusterController", "controller"),
    ("ray::ServeReplica", "ingress"),
    ("ray::ProxyActor", "proxy"),
)
PATHS = ("offline", "engines", "local_http", "serve_http", "handle")
PATHS_DEFAULT = ",".join(PATHS)
WARMUP_REQUESTS = 8
ENGINE_TIMEOUT_S = 900.0  # an `engines` process that sends nothing this long has hung


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Deterministic token-id prompts, all distinct (no prefix-cache hits between them)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(n)]


# ---- CPU per process role -----------------------------------------------------------------------


def _role(proc: Any, own_pid: int, roles: dict[int, str]) -> str:
    if proc.pid == own_pid:
        return "client"
    if proc.pid in roles:
        return roles[proc.pid]
    try:
        title = " ".join(proc.cmdline())
    except Exception:
        return "other"
    for prefix, role in ROLES:
        if title.startswith(prefix):
            return role
    if "ray" in title:
        return "ray_system"
    return "other"


def cpu_snapshot(roles: dict[int, str] | None = None) -> dict[int, tuple[str, float, int]]:
    """pid -> (role, user + system CPU seconds, involuntary context switches) for every
    process we may read. `roles` names processes the titles do not (pid -> role)."""
    import psutil

    own = os.getpid()
    snap: dict[int, tuple[str, float, int]] = {}
    for proc in psutil.process_iter():
        try:
            t = proc.cpu_times()
            switches = _involuntary_switches(proc)
            snap[proc.pid] = (_role(proc, own, roles or {}), t.user + t.system, switches)
        except Exception:  # gone, or not ours to read
            continue
    return snap


def _involuntary_switches(proc: Any) -> int:
    """Times the kernel took a core from any of the process's threads for another's. psutil's
    count (/proc/PID/status) is the main thread's alone; Linux lists every thread's."""
    try:
        tasks = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:  # not Linux
        return proc.num_ctx_switches().involuntary
    total = 0
    for tid in tasks:
        try:
            with open(f"/proc/{proc.pid}/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("nonvoluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except OSError:  # the thread ended meanwhile
            continue
    return total


def by_role(before: dict, after: dict, field: int = 1) -> dict[str, float]:
    """Per role, how much of a snapshot's `field` (1: CPU seconds, 2: involuntary context
    switches) was spent between two snapshots (a process born in between counts whole)."""
    out: dict[str, float] = {}
    for pid, now in after.items():
        spent = now[field] - before[pid][field] if pid in before else now[field]
        if spent > 0:
            out[now[0]] = out.get(now[0], 0.0) + spent
    out.pop("other", None)  # not ours (the shell, an editor): left out of every figure
    return {k: round(v, 3) for k, v in sorted(out.items())}


# ---- clients ------------------------------------------------------------------------------------


def _result(i: int, wl: dict, send: float, chunks: list[float], tokens: int, reason: str, error):
    spec = RequestSpec(i, "default", 0.0, "", wl["prompt_len"], wl["output_len"])
    r = RequestResult(spec, send_s=send, end_s=time.perf_counter())
    r.chunk_times_s = chunks
    r.first_token_s = chunks[0] if chunks else None
    r.completion_tokens, r.prompt_tokens = tokens, wl["prompt_len"]
    r.finish_reason = reason
    r.ok = error is None and reason == "length" and tokens == wl["output_len"]
    r.error = "" if r.ok else (error or f"finish {reason!r} after {tokens} tokens")
    return r


async def _closed_loop(one, n: int, concurrency: int) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(concurrency)

    async def guarded(i: int) -> RequestResult:
        async with sem:
            return await one(i)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(guarded(i) for i in range(n)))
    return list(results), time.perf_counter() - t0


async def http_run(url: str, model: str, ids: list[list[int]], wl: dict, n_tokens: int):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as client:

        async def one(i: int) -> RequestResult:
            body = {
                "model": model,
                "prompt": ids[i],
                "max_tokens": n_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            send, chunks, tokens, reason, error = time.perf_counter(), [], 0, "", None
            try:
                async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
                    if resp.status_code != 200:
                        return _result(i, wl, send, [], 0, "", f"HTTP {resp.status_code}")
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        data = json.loads(line[6:])
                        if "error" in data:
                            error = str(data["error"].get("message"))
                            continue
                        for c in data.get("choices") or ():
                            if c.get("text"):
                                chunks.append(time.perf_counter())
                            reason = c.get("finish_reason") or reason
                        if data.get("usage"):
                            tokens = data["usage"]["completion_tokens"]
            except httpx.HTTPError as e:
                error = repr(e)
            return _result(i, wl, send, chunks, tokens, reason, error)

        return await _closed_loop(one, len(ids), wl["concurrency"])


async def handle_run(handle: Any, ids: list[list[int]], wl: dict, n_tokens: int):
    stream = handle.options(stream=True)

    async def one(i: int) -> RequestResult:
        req = {"prompt_token_ids": ids[i], "max_tokens": n_tokens, "temperature": 0.0}
        req["ignore_eos"] = True
        send, chunks, tokens, reason, error = time.perf_counter(), [], 0, "", None
        try:
            async for chunk in stream.generate.remote(req):
                if chunk["token_ids"]:
                    chunks.append(time.perf_counter())
                    tokens += len(chunk["token_ids"])
                if chunk["finished"]:
                    reason = chunk["finish_reason"]
        except Exception as e:
            error = repr(e)
        return _result(i, wl, send, chunks, tokens, reason, error)

    return await _closed_loop(one, len(ids), wl["concurrency"])


# ---- one row per path ---------------------------------------------------------------------------


def measure(label: str, fn, wl: dict, roles: dict[int, str] | None = None) -> dict:
    """Run `fn()` -> (results, duration) between two CPU snapshots; the row for `label`."""
    before = cpu_snapshot(roles)
    results, duration = fn()
    after = cpu_snapshot(roles)
    cpu = by_role(before, after)
    switches = by_role(before, after, field=2)
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.completion_tokens for r in ok)
    lat = request_metrics(results) if results and results[0].chunk_times_s else {}
    per_k = {k: round(1000 * v / max(out_tokens, 1), 4) for k, v in cpu.items()}
    cores = os.cpu_count() or 1
    row = {
        "path": label,
        "requests": len(results),
        "ok": len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": round(duration, 3),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / duration, 1),
        "cpu_s": cpu,
        "cpu_ms_per_token": per_k,  # CPU s per 1,000 tokens = CPU ms per token
        "replica_share": round(cpu.get("replicas", 0.0) / (cores * duration), 3),
        # how often the kernel took a core from each role's threads for another's, per second:
        # each time, the thread comes back to caches and predictors the other one used
        "preemptions_per_s": {k: round(v / duration) for k, v in switches.items()},
        "plane_cpu_ms_per_token": round(
            sum(cpu.get(k, 0.0) for k in ("ingress", "proxy", "controller"))
            * 1000
            / max(out_tokens, 1),
            4,
        ),
    }
    for name in ("ttft", "tpot", "itl"):
        s = lat.get(name) or {}
        for q in ("p50", "p99"):
            v = s.get(q)
            row[f"{name}_{q}_ms"] = None if v is None else round(1000 * v, 2)
    print(f"  {label}: {row['output_tok_s']} tok/s, {row['ok']}/{row['requests']} ok, cpu {cpu}",
          flush=True)  # fmt: skip
    return row


def engine_settings(wl: dict, seats: int) -> dict:
    """The engine settings of every path: `seats` seats, the workload's KV blocks, and no
    prefix caching. The paths send the same prompts to one server in turn (warm-up, then
    serve_http and handle on one app), so a cache would serve the later sends."""
    return {
        "max_num_seqs": seats,
        "num_gpu_blocks": wl["num_gpu_blocks"],
        "enable_prefix_caching": False,
    }


def _tiny_engine(
    seats: int, wl: dict, warm_on: list[list[int]], model: str = "tiny"
) -> tuple[Any, Any]:
    """The tiny model (or `model`) with `seats` seats, warmed up on a few prompts, and the
    workload's sampling parameters (greedy, `output_len` tokens, `ignore_eos`)."""
    from fairbatch.engine import LLM, SamplingParams

    llm = LLM(model, **engine_settings(wl, seats))
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    llm.generate(warm_on[:WARMUP_REQUESTS], warm, use_tqdm=False)
    params = SamplingParams(max_tokens=wl["output_len"], temperature=0.0, ignore_eos=True)
    return llm, params


def offline_run(ids: list[list[int]], wl: dict, seats: int) -> dict:
    llm, params = _tiny_engine(seats, wl, ids, wl["model"])

    def go():
        t0 = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        duration = time.perf_counter() - t0
        results = []
        for i, o in enumerate(outs):
            results.append(_result(i, wl, t0, [], len(o.token_ids), o.finish_reason, None))
        return results, duration

    return measure("offline", go, wl)


def _engine_process(seats: int, wl: dict, share: list[list[int]], conn: Any) -> None:
    """One engine of `engines`: the tiny model with one replica's seats and its share of the
    cores (as a replica runs it), warmed up; runs `share` when told, sends back what it made."""
    import torch

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // wl["replicas"]))
    llm, params = _tiny_engine(seats, wl, share)
    conn.send("ready")
    conn.recv()  # go
    outs = llm.generate(share, params, use_tqdm=False)
    conn.send([(list(o.token_ids), o.finish_reason) for o in outs])
    conn.recv()  # the CPU was read: exit


@contextlib.contextmanager
def engine_processes(ids: list[list[int]], wl: dict):
    """`wl["replicas"]` engine processes, started and warmed up, request i on engine
    i % replicas. Yields (their pids, `go`): `go()` starts them all at once and returns
    (the outputs in `ids` order, seconds from the start to the last engine's end). They stay
    alive until the block ends, so their CPU can still be read after `go()`."""
    import multiprocessing as mp

    n = wl["replicas"]
    ctx = mp.get_context("spawn")  # a fresh interpreter, as each replica is
    pipes, procs = [], []
    try:
        for k in range(n):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_engine_process, args=(wl["seats"], wl, ids[k::n], theirs))
            proc.start()
            pipes.append(mine)
            procs.append(proc)
        for conn, proc in zip(pipes, procs):
            _recv(conn, proc, "start")

        def go():
            t0 = time.perf_counter()
            for conn in pipes:
                conn.send("go")
            # in order; the last one ends the timing
            shares = [_recv(conn, proc, "generate") for conn, proc in zip(pipes, procs)]
            duration = time.perf_counter() - t0
            outs: list[Any] = [None] * len(ids)
            for k, share in enumerate(shares):
                outs[k::n] = share
            return outs, duration

        yield [p.pid for p in procs], go
    finally:
        for conn in pipes:
            try:
                conn.send("exit")
            except OSError:
                pass
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def _recv(conn: Any, proc: Any, what: str, timeout_s: float = ENGINE_TIMEOUT_S) -> Any:
    """The engine process's next message, or a clear error if it died or hangs."""
    if conn.poll(timeout_s):
        try:
            return conn.recv()
        except EOFError:
            pass
    proc.join(timeout=1)
    state = "hung" if proc.is_alive() else f"exited with code {proc.exitcode}"
    raise RuntimeError(f"an engine process failed to {what}: {state}")


def engines_run(ids: list[list[int]], wl: dict) -> dict:
    """The replicas' engines without anything around them: what the app's replicas could
    deliver on this machine if the serving plane cost nothing (CPU or interruptions)."""
    with engine_processes(ids, wl) as (pids, go):

        def timed():
            outs, duration = go()
            t0 = time.perf_counter() - duration
            results = [
                _result(i, wl, t0, [], len(tokens), reason, None)
                for i, (tokens, reason) in enumerate(outs)
            ]
            return results, duration

        return measure("engines", timed, wl, roles=dict.fromkeys(pids, "replicas"))


def sim_offline_run(ids: list[list[int]], wl: dict) -> dict:
    """One paced simulated engine with one replica's seats and its share of the requests,
    stepped back to back; the row's rate is that times the replicas (independent GPUs)."""
    from fairbatch.deployments.cluster.replica_config import ReplicaConfig, build_core, pace_step
    from fairbatch.engine import SamplingParams
    from fairbatch.engine.tokenizer import Tokenizer

    cfg = ReplicaConfig(
        engine="sim", sim_vocab=Tokenizer.tiny().vocab_size, **engine_settings(wl, wl["seats"])
    )
    core = build_core(cfg)
    params = SamplingParams(max_tokens=wl["output_len"], temperature=0.0, ignore_eos=True)
    share = ids[: max(1, len(ids) // wl["replicas"])]

    def go():
        t0 = time.perf_counter()
        for i, prompt in enumerate(share):
            core.add_request(prompt, params, request_id=str(i))
        tokens: dict[str, int] = dict.fromkeys(map(str, range(len(share))), 0)
        reasons: dict[str, str] = {}
        while core.has_unfinished():
            for d in core.step():
                tokens[d.request_id] += len(d.token_ids)
                if d.finished:
                    reasons[d.request_id] = d.finish_reason or ""
            pace_step(core, wl["time_scale"])
        duration = time.perf_counter() - t0
        one = [
            _result(i, wl, t0, [], tokens[str(i)], reasons[str(i)], None) for i in range(len(share))
        ]
        return one * wl["replicas"], duration  # the replicas run side by side, each its share

    return measure("offline", go, wl)


def local_http_run(ids: list[list[int]], wl: dict, seats: int) -> dict:
    from fairbatch.benchmarks.serve_server import LocalServer

    config = {
        "model": "tiny",
        "engine": engine_settings(wl, seats),
        "stream_interval_ms": wl["intervals"][0],
    }
    server = LocalServer(config)
    with server as url:
        model = "fairbatch-tiny"
        asyncio.run(http_run(url, model, ids[:WARMUP_REQUESTS], wl, 8))
        fn = functools.partial(_sync, http_run, url, model, ids, wl, wl["output_len"])
        return measure("local_http", fn, wl, roles={server.proc.pid: "server"})


def serve_runs(ids: list[list[int]], wl: dict, paths: list[str]) -> list[dict]:
    from fairbatch.deployments.serve.cli import serve_env

    port = _free_port()
    serve_env(port, wl["proxy"])  # as `fairbatch serve` starts Ray
    import ray
    from ray import serve

    from fairbatch.deployments.serve.cli import cuda_available

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    init: dict[str, Any] = {"address": "local", "include_dashboard": False}
    if not cuda_available():
        init["num_gpus"] = wl["replicas"]  # fake GPUs, one per replica
    ray.init(**init)
    try:
        with _Loop() as loop:  # one event loop throughout: Serve handles bind to theirs
            rows = _serve_paths(loop, ids, wl, paths, port)
        serve.shutdown()
    finally:
        ray.shutdown()
    return rows


def _serve_paths(loop: _Loop, ids: list[list[int]], wl: dict, paths: list[str], port: int):
    from ray import serve

    from fairbatch.deployments.serve.app import APP_NAME, build_app, ingress_url

    rows: list[dict] = []
    n_out = wl["output_len"]
    proxy_port = port if wl["proxy"] else _free_port()  # the idle proxy gets a spare one
    serve.start(http_options={"host": "127.0.0.1", "port": proxy_port})
    model_dir = wl["model"] not in ("tiny", "sim")
    for interval in wl["intervals"]:
        engine = engine_settings(wl, wl["seats"])
        if wl["model"] == "sim":
            engine["time_scale"] = wl["time_scale"]
        args = {
            "model": wl["model"],
            "num_replicas": wl["replicas"],
            "engine": engine,
            "stream_interval_ms": interval,
        }
        if model_dir:
            args["served_model_name"] = "bench"
        handle = serve.run(build_app(args), name=APP_NAME, route_prefix="/")
        url = ingress_url(APP_NAME, f"http://127.0.0.1:{proxy_port}")
        model = "bench" if model_dir else f"fairbatch-{wl['model']}"
        if "serve_http" in paths:
            loop.run(http_run(url, model, ids[:WARMUP_REQUESTS], wl, 8))
            run = functools.partial(loop.run, http_run(url, model, ids, wl, n_out))
            rows.append(measure(f"serve_http@{interval:g}ms", run, wl))
        if "handle" in paths:
            loop.run(handle_run(handle, ids[:WARMUP_REQUESTS], wl, 8))
            run = functools.partial(loop.run, handle_run(handle, ids, wl, n_out))
            rows.append(measure(f"handle@{interval:g}ms", run, wl))
    return rows


def _sync(fn, *args: Any):
    return asyncio.run(fn(*args))


class _Loop:
    """An event loop running in a background thread for the whole Serve phase: a Serve handle
    binds to the loop it first runs on and needs it running for controller updates."""

    def __enter__(self) -> _Loop:
        import threading

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self

    def run(self, coro: Any, timeout_s: float = 1800.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the command --------------------------------------------------------------------------------


def workload(args: argparse.Namespace) -> dict:
    def fixed(spec: str | None, default: int) -> int:
        if spec is None:
            return default
        if not spec.startswith("fixed:"):
            raise SystemExit("--compare serving-path takes --input-len/--output-len fixed:N")
        return int(spec.split(":", 1)[1])

    replicas = args.replicas
    time_scale = getattr(args, "sim_time_scale", 0.0) or 0.0
    if time_scale < 0:
        raise SystemExit(f"--sim-time-scale must be >= 0, got {time_scale}")
    model = getattr(args, "model", None) or "tiny"
    if model != "tiny" and not os.path.isdir(model):
        raise SystemExit(f"--model {model!r}: --compare serving-path takes a model directory")
    if time_scale > 0 and model != "tiny":
        raise SystemExit("--sim-time-scale replaces the model: not with --model")
    return {
        "model": "sim" if time_scale > 0 else model,
        "time_scale": time_scale,
        "num_requests": args.num_prompts or 128,
        "prompt_len": fixed(args.input_len, 64),
        "output_len": fixed(args.output_len, 128),
        "concurrency": args.concurrency or 32,
        "replicas": replicas,
        "seats": args.max_num_seqs,
        "num_gpu_blocks": args.num_gpu_blocks or 1024,
        "intervals": [float(x) for x in args.intervals.split(",")],
        "proxy": bool(getattr(args, "proxy", False)),  # Serve's HTTP proxy, not direct ingress
        "greedy": True,
        "ignore_eos": True,
        "prompt": "token ids",
        "rounds": getattr(args, "rounds", 1),  # all paths again each round; medians reported
    }


def summarize(rounds: list[list[dict]]) -> list[dict]:
    """One row per path from several rounds of the same paths: the median of every number
    (per role for the CPU dicts), and the range of `x_offline`, the ratio taken within each
    round (each round measures offline and the other paths on the machine as it was then)."""
    import statistics

    def median(values: list) -> Any:
        if all(isinstance(v, dict) for v in values):
            keys = {k for v in values for k in v}
            return {k: median([v.get(k, 0.0) for v in values]) for k in sorted(keys)}
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            return statistics.median(values)
        return values[0]

    rows = []
    for first in rounds[0]:
        same = [r for rnd in rounds for r in rnd if r["path"] == first["path"]]
        row = {k: median([r.get(k) for r in same]) for k in first}
        if "x_offline" in first:
            ratios = [r["x_offline"] for r in same]
            row["x_offline_range"] = [min(ratios), max(ratios)]
        row["rounds"] = len(same)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    offline = next((r for r in rows if r["path"] == "offline"), None)
    base = offline["output_tok_s"] if offline else None
    head = (
        "| path | tok/s | x offline | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms "
        "| CPU ms/token: replicas, ingress, proxy, controller, client | replica share "
        "| replicas preempted /s |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        ratio = f"{r['output_tok_s'] / base:.2f}" if base else "-"
        if "x_offline_range" in r:  # medians of rounds: the ratio as measured in each round
            lo, hi = r["x_offline_range"]
            ratio = f"{r['x_offline']:.2f} ({lo:.2f}-{hi:.2f})"
        per = r["cpu_ms_per_token"]

        def pair(name: str, r: dict = r) -> str:
            a, b = r.get(f"{name}_p50_ms"), r.get(f"{name}_p99_ms")
            return "-" if a is None else f"{a:g} / {b:g}"

        cpu = ", ".join(
            f"{per.get(k, 0):.3f}" for k in ("replicas", "ingress", "proxy", "controller", "client")
        )
        if "server" in per:
            cpu += f" (server {per['server']:.3f})"
        replicas = r.get("preemptions_per_s", {}).get("replicas")
        preempted = "-" if replicas is None else f"{replicas:,.0f}"
        lines.append(
            f"| {r['path']} | {r['output_tok_s']:,.0f} | {ratio} | {pair('ttft')} | "
            f"{pair('tpot')} | {pair('itl')} | {cpu} | {r['replica_share']:.2f} | {preempted} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["path"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    a.bar(labels, [r["output_tok_s"] for r in rows], color="#4477aa")
    a.set_ylabel("output tokens/s")
    a.set_title("throughput by path")
    roles = ("replicas", "ingress", "proxy", "controller", "client", "ray_system", "server")
    bottom = [0.0] * len(rows)
    for role in roles:
        vals = [r["cpu_ms_per_token"].get(role, 0.0) for r in rows]
        if any(vals):
            b.bar(labels, vals, bottom=bottom, label=role)
            bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_ylabel("CPU ms per output token")
    b.set_title("where the CPU goes")
    b.legend(fontsize=8)
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def choose_paths(chosen: str | None, wl: dict) -> list[str]:
    """The paths `--paths` names (None: every path that runs with the workload's model)."""
    paths = (chosen or PATHS_DEFAULT).split(",")
    unknown = sorted(set(paths) - set(PATHS))
    if unknown:
        raise SystemExit(f"--paths: unknown {', '.join(unknown)}; known: {', '.join(PATHS)}")
    for tiny_only in ("engines", "local_http"):
        if wl["model"] != "tiny" and tiny_only in paths:
            if chosen:
                why = "runs the tiny model only, not --sim-time-scale or --model"
                raise SystemExit(f"--paths {tiny_only} {why}")
            paths.remove(tiny_only)
    return paths


def run(args: argparse.Namespace, result: dict, out: Path) -> str:
    wl = workload(args)
    paths = choose_paths(getattr(args, "paths", None), wl)
    from fairbatch.engine.tokenizer import Tokenizer

    ids = prompts(wl["num_requests"], wl["prompt_len"], Tokenizer.tiny().vocab_size, args.seed)
    seats = wl["replicas"] * wl["seats"]
    print(f"serving-path: {wl}", flush=True)
    rounds: list[list[dict]] = []
    for k in range(wl["rounds"]):
        if wl["rounds"] > 1:
            print(f"round {k + 1} of {wl['rounds']}", flush=True)
        rows: list[dict] = []
        if "offline" in paths:
            sim = wl["model"] == "sim"
            rows.append(sim_offline_run(ids, wl) if sim else offline_run(ids, wl, seats))
        if "engines" in paths:
            rows.append(engines_run(ids, wl))
        if "local_http" in paths:
            rows.append(local_http_run(ids, wl, seats))
        if "serve_http" in paths or "handle" in paths:
            rows.extend(serve_runs(ids, wl, paths))
        offline = next((r for r in rows if r["path"] == "offline"), None)
        if offline:
            for r in rows:
                r["x_offline"] = round(r["output_tok_s"] / offline["output_tok_s"], 3)
        rounds.append(rows)
    result["workload"] = wl
    if len(rounds) > 1:
        result["rounds"] = rounds
        rows = summarize(rounds)
    result["table"] = rows
    if not args.no_plots and rows:
        plot(rows, out / "serving_path.png")
        result["plots"] = ["serving_path.png"]
    return table(rows)
