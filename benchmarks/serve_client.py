"""The async client of `fairbatch bench serve`, for any OpenAI-compatible endpoint.

A workload (`serve_workload`) is a list of `RequestSpec`s with arrival times; `run_requests`
sends each at its time (or keeps a fixed number in flight), streams it through
POST /v1/completions and records what happened in a `RequestResult`: when it was sent, when
each chunk with text arrived, the server's usage numbers, or why it failed. Also here: the
server's counters (`get_stats`, GET /admin/stats), `probe` (is it up, which model) and
`measure_capacity` (the request rate a server sustains, for the scenarios' loads).

Streaming: `stream: true` with `stream_options.include_usage`, so the token counts are the
server's own. `ignore_eos: true` (a vLLM extension fairbatch honours) makes every request
generate exactly its `max_tokens`; pass `ignore_eos=False` for peers that refuse the field.
A chunk is about one token, but not exactly: the server holds text back at an incomplete
UTF-8 character (byte-level BPE) or a possible stop string, so chunks <= completion tokens and
an ITL spanning a held-back token is the gap of two tokens. TPOT uses the usage count.

Nothing here raises for a failed request or hangs: a 429/503 is a rejection (its Retry-After
kept), any other failure an error message, and every request has a deadline.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec

REJECT_STATUSES = (429, 503)
ERROR_BODY_LIMIT = 2000  # bytes of an error body kept for the message
CUT_OFF = "cut off: still running at the run's deadline"


# ---- one request -----------------------------------------------------------------------------


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_message(status: int, raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        msg = err.get("message") if isinstance(err, dict) else str(err)
    except (ValueError, KeyError, TypeError):
        msg = raw[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {msg}"


def _retry_after(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:  # an HTTP date: not worth parsing for a benchmark
        return None


async def send_one(
    client: httpx.AsyncClient,
    base_url: str,
    spec: RequestSpec,
    *,
    model: str,
    api_key: str | None,
    t0: float,
    timeout_s: float,
    ignore_eos: bool = True,
    send_priority: bool = True,
    send_deadlines: bool = True,
) -> RequestResult:
    """Stream one completion; never raises (except on cancellation), ends within `timeout_s`.
    `send_deadlines`: the spec's `timeout` / `max_queue_time_s` go as fairbatch's extension
    fields (False: they are left out, and only measured against).

    Times in the result are `time.perf_counter() - t0`.
    """
    res = RequestResult(spec=spec)
    body: dict[str, Any] = {
        "model": model,
        "prompt": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if send_priority and spec.priority:
        body["priority"] = spec.priority
    if send_deadlines:
        for name in ("timeout", "max_queue_time_s"):
            if getattr(spec, name) is not None:
                body[name] = getattr(spec, name)
    res.send_s = time.perf_counter() - t0
    try:
        async with asyncio.timeout(timeout_s):
            await _stream(client, base_url.rstrip("/") + "/v1/completions", body, api_key, t0, res)
    except TimeoutError:
        res.ok, res.error = False, f"timed out after {timeout_s:g}s"
    except httpx.HTTPError as e:
        res.ok, res.error = False, f"{type(e).__name__}: {e}"[:500]
    except Exception as e:  # a malformed stream, or anything else: recorded, never raised
        res.ok, res.error = False, f"{type(e).__name__}: {e}"[:500]
    res.end_s = time.perf_counter() - t0
    if res.ok and not res.completion_tokens:
        res.completion_tokens = len(res.chunk_times_s)  # no usage from this server: estimate
    return res


async def _stream(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    api_key: str | None,
    t0: float,
    res: RequestResult,
) -> None:
    async with client.stream("POST", url, json=body, headers=_headers(api_key)) as resp:
        res.status = resp.status_code
        if resp.status_code != 200:
            raw = b""
            async for part in resp.aiter_bytes():
                raw += part
                if len(raw) > ERROR_BODY_LIMIT:
                    break
            res.error = _error_message(resp.status_code, raw)
            if resp.status_code in REJECT_STATUSES:
                res.retry_after_s = _retry_after(resp.headers.get("retry-after"))
            return
        done = False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments, `event:` lines
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            now = time.perf_counter() - t0
            event = json.loads(payload)
            if "error" in event:
                err = event["error"]
                res.error = "stream error: " + str(
                    err.get("message") if isinstance(err, dict) else err
                )
                continue
            for choice in event.get("choices") or ():
                text = choice.get("text")
                if text is None:  # a chat chunk
                    text = (choice.get("delta") or {}).get("content")
                if text:
                    res.chunk_times_s.append(now)
                    if res.first_token_s is None:
                        res.first_token_s = now
                if choice.get("finish_reason"):
                    res.finish_reason = choice["finish_reason"]
            usage = event.get("usage")
            if usage:
                res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                res.completion_tokens = int(usage.get("completion_tokens") or 0)
        if not res.error and not res.finish_reason:
            res.error = "the stream ended without a finish_reason" + ("" if done else " or [DONE]")
        res.ok = not res.error


# ---- a workload ------------------------------------------------------------------------------


def _progress_bar(total: int, enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # optional: no bar
        return None
    return tqdm(total=total, unit="req", desc="requests", leave=False)


async def run_requests(
    base_url: str,
    specs: Sequence[RequestSpec],
    *,
    model: str,
    keys: dict[str, str | None],
    default_key: str | None = None,
    max_concurrency: int | None = None,
    timeout_s: float = 300.0,
    progress: bool = True,
    ignore_eos: bool = True,
    send_priority: bool = True,
    send_deadlines: bool = True,
    deadline_s: float | None = None,
) -> tuple[list[RequestResult], float]:
    """Send every spec; returns the results (in spec order) and the run's duration.

    Open loop (`max_concurrency` None): each request is sent at its `arrival_s` after one t0.
    Fixed concurrency: arrivals are ignored, requests go in spec order, at most
    `max_concurrency` in flight. `keys[tenant]` (else `default_key`) is the bearer key.
    `deadline_s` (from t0): requests still running then are cut off (closed, which aborts them
    on the server) and recorded with an error saying so. The duration runs from t0 to the end
    of the last request.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    bar = _progress_bar(len(specs), progress)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s)) as client:
        t0 = time.perf_counter()

        async def send(spec: RequestSpec) -> RequestResult:
            left = timeout_s
            if deadline_s is not None:
                left = min(timeout_s, deadline_s - (time.perf_counter() - t0))
                if left <= 0:
                    now = time.perf_counter() - t0
                    return RequestResult(spec, error=CUT_OFF, send_s=now, end_s=now)
            res = await send_one(
                client,
                base_url,
                spec,
                model=model,
                api_key=keys.get(spec.tenant, default_key),
                t0=t0,
                timeout_s=left,
                ignore_eos=ignore_eos,
                send_priority=send_priority,
                send_deadlines=send_deadlines,
            )
            if left < timeout_s and res.error.startswith("timed out"):
                res.error = CUT_OFF
            return res

        async def one(spec: RequestSpec) -> RequestResult:
            if sem is None:
                delay = spec.arrival_s - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                res = await send(spec)
            else:
                async with sem:
                    res = await send(spec)
            if bar is not None:
                bar.update(1)
            return res

        try:
            results = await asyncio.gather(*(one(s) for s in specs))
        finally:
            if bar is not None:
                bar.close()
        duration = time.perf_counter() - t0
    return list(results), duration


# ---- the server's side -----------------------------------------------------------------------


async def get_stats(base_url: str, admin_key: str | None, timeout_s: float = 10.0) -> dict | None:
    """GET /admin/stats (fairbatch's engine and API counters), or None where the server has no
    such route, refuses the key, or does not answer (peers)."""
    if not admin_key:
        return None
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.get(base_url.rstrip("/") + "/admin/stats", headers=_headers(admin_key))
        data = r.json() if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("object") == "stats" else None


async def probe(base_url: str, api_key: str | None, timeout_s: float = 10.0) -> str | None:
    """The first model id the server lists at /v1/models; raises ConnectionError with a
    readable message when the server cannot be reached at all."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            r = await client.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key))
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach {base_url}: {type(e).__name__}: {e}") from None
    try:
        return r.json()["data"][0]["id"] if r.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


async def measure_capacity(
    base_url: str,
    *,
    model: str,
    api_key: str | None,
    prompt_len: int,
    output_len: int,
    concurrency: int,
    num_requests: int | None = None,
    timeout_s: float = 300.0,
    ignore_eos: bool = True,
    seed: int = 12345,
) -> float:
    """Requests/s the server sustains at these lengths, from a short closed loop.

    `concurrency` requests stay in flight (use the server's batch size); `num_requests`
    (default 3x that) are sent in all. In a closed loop the k-th send happens when the
    (k - concurrency)-th request ends, so until the last send the server is saturated:
    capacity = completions before the last send / the time of the last send (the drain after
    it, with a shrinking batch, is left out).
    """
    from fairbatch.benchmarks.serve_workload import TextMaker

    n = num_requests or 3 * concurrency
    rng = random.Random(seed)
    maker = TextMaker()
    specs = [
        RequestSpec(i, "calibration", 0.0, maker.make(prompt_len, rng), prompt_len, output_len)
        for i in range(n)
    ]
    results, duration = await run_requests(
        base_url,
        specs,
        model=model,
        keys={},
        default_key=api_key,
        max_concurrency=concurrency,
        timeout_s=timeout_s,
        progress=False,
        ignore_eos=ignore_eos,
    )
    ok = [r for r in results if r.ok]
    if not ok:
        errors = {r.error for r in results}
        raise RuntimeError(f"capacity calibration: no request completed ({'; '.join(errors)})")
    last_send = max(r.send_s for r in results)
    done_before = sum(1 for r in ok if r.end_s <= last_send)
    if n <= concurrency or done_before == 0 or last_send <= 0:
        return len(ok) / duration
    return done_before / last_send
