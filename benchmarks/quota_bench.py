"""`fairbatch bench serve --compare quota`: a tenant's quota holds for the app, however many
ingress replicas admit its requests.

For each count in `--ingresses` (default 1,2,4): the Serve app with that many ingress replicas
behind Serve's HTTP proxy (which spreads requests over them), one paced `sim` replica, and
tenant `q` with a quota of `--quota` tokens per minute (default 6,000). An open loop of q's
requests (40 prompt tokens, 10 output tokens, Poisson arrivals) offers `--over` (default 3)
times the quota for `--duration` seconds (default 60). Per count:

* admitted: the tokens of the requests answered 200 (their `usage`), and that per minute;
* allowed: what one bucket lets through in the run: the full bucket plus its refill,
  Q x (1 + t / 60), and the ratio admitted / allowed;
* bound: allowed plus the output of the requests in flight when the bucket emptied (the most
  in flight at once x 10: charged as produced, after their admission), the over-admission one
  server has too;
* refused: 429s, how many carried a Retry-After, and any other failure.

With the limits counted per ingress replica the ratio grows with the count (two buckets let
twice the tokens through); counted for the app it stays at one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from typing import Any

PROMPT, OUTPUT = 40, 10
TENANT, KEY = "q", "sk-quota-bench"


async def offer(url: str, model: str, rate: float, duration_s: float, seed: int) -> dict:
    """Poisson arrivals at `rate`/s for `duration_s`; every request waited for."""
    import httpx

    rng = random.Random(seed)
    ok_tokens = refused = with_retry = failed = in_flight = most = 0
    body = {"model": model, "max_tokens": OUTPUT, "ignore_eos": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal ok_tokens, refused, with_retry, failed, in_flight, most
        prompt = [(i * 37 + j * 11) % 900 + 20 for j in range(PROMPT)]
        in_flight += 1
        most = max(most, in_flight)
        try:
            r = await client.post(f"{url}/v1/completions", json={**body, "prompt": prompt},
                                  headers=headers)  # fmt: skip
        except httpx.HTTPError:
            failed += 1
            return
        finally:
            in_flight -= 1
        if r.status_code == 200:
            ok_tokens += r.json()["usage"]["total_tokens"]
        elif r.status_code == 429:
            refused += 1
            with_retry += int(r.headers.get("retry-after", "0")) >= 1
        else:
            failed += 1

    tasks = []
    async with httpx.AsyncClient(timeout=120.0) as client:
        t0 = time.monotonic()
        t, i = rng.expovariate(rate), 0
        while t < duration_s:
            await asyncio.sleep(max(0.0, t0 + t - time.monotonic()))
            tasks.append(asyncio.create_task(one(client, i)))
            t, i = t + rng.expovariate(rate), i + 1
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
    return {
        "sent": len(tasks),
        "admitted_tokens": ok_tokens,
        "refused": refused,
        "refused_with_retry_after": with_retry,
        "failed": failed,
        "most_in_flight": most,
        "elapsed_s": elapsed,
    }


def run_one(ingresses: int, args: argparse.Namespace) -> dict:
    import ray
    from ray import serve

    from fairbatch.deployments.serve.app import APP_NAME, build_app
    from fairbatch.deployments.serve.cli import serve_env

    port = _free_port()
    serve_env(port, True)  # Serve's proxy in front: it spreads requests over the ingresses
    ray.init(address="local", include_dashboard=False, num_gpus=1)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = {
            "model": "sim",
            "num_replicas": 1,
            "ingress_replicas": ingresses,
            "metrics_interval_s": 0,
            "engine": {"max_num_seqs": 32, "time_scale": 1.0, "device": "cpu"},
            "tenants": [{"name": TENANT, "api_key": KEY, "tokens_per_minute": args.quota}],
            "allow_anonymous": False,
        }
        serve.run(build_app(app), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        rate = args.over * args.quota / 60.0 / (PROMPT + OUTPUT)
        got = asyncio.run(offer(url, "fairbatch-sim", rate, args.duration, args.seed))
        serve.shutdown()
    finally:
        ray.shutdown()
    allowed = args.quota * (1 + got["elapsed_s"] / 60.0)
    got.update(
        ingresses=ingresses,
        offered_tokens_per_min=args.over * args.quota,
        admitted_tokens_per_min=got["admitted_tokens"] / got["elapsed_s"] * 60.0,
        allowed_tokens=allowed,
        admitted_over_allowed=got["admitted_tokens"] / allowed,
        bound_tokens=allowed + got["most_in_flight"] * OUTPUT,
    )
    return got


def run(args: argparse.Namespace, result: dict[str, Any], out: Any) -> str:
    """The table; `result` gets the settings and a row per ingress count."""
    from fairbatch.benchmarks.serve_report import table

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    counts = [int(x) for x in args.ingresses.split(",")]
    rows = [run_one(n, args) for n in counts]
    result.update(
        quota_tokens_per_min=args.quota, over=args.over, request=[PROMPT, OUTPUT], rows=rows
    )
    head = ["ingresses", "admitted tok/min", "admitted / allowed", "within bound", "429s",
            "with Retry-After", "failed"]  # fmt: skip
    text = table(
        head,
        [
            [
                r["ingresses"],
                f"{r['admitted_tokens_per_min']:.0f}",
                f"{r['admitted_over_allowed']:.2f}",
                "yes" if r["admitted_tokens"] <= r["bound_tokens"] else "no",
                r["refused"],
                r["refused_with_retry_after"],
                r["failed"],
            ]  # fmt: skip
            for r in rows
        ],
    )
    return text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
