"""`fairbatch bench serve`: a load generator for any OpenAI-compatible endpoint.

One run: build a workload (a named scenario from `serve_scenarios`, or custom arrivals and
lengths), start a local fairbatch server for it (`serve_server.LocalServer`) unless `--url`
names one, calibrate the scenario's capacity, send it (`serve_client.run_requests`), read the
server's counters around the run, and write OUT/result.json (a summary: `serve_metrics.
summarize_run` plus the workload and the command) and PNG plots (`serve_plots`); with
`--raw-out FILE`, one JSON line per request to FILE. Comparisons (`--compare`) are in
`serve_compare`.

result.json of a run: {"kind": "run", "meta": {date_utc, command, loadavg_start, loadavg_end,
cpus, python, machine, target, model, server}, "workload": {scenario or custom settings,
tenants, num_requests, ...}, "summary": summarize_run's dict, "window": who got what while
the arrivals lasted (`window_service`), "plots": [PNG names]}. Floats are kept to 6
significant digits, and a container that fits on one line is written on one, so the file is
small enough to commit. Per-request rows (`request_rows`) never go into result.json.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from fairbatch.benchmarks.serve_client import (
    get_stats,
    measure_capacity,
    probe,
    run_requests,
    send_one,
)
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec

__all__ = ["main", "measure_capacity", "run_requests", "send_one"]


ADMIN_KEY = "bench-admin"  # the local server's admin key (loopback only, one run's lifetime)
DEFAULT_INPUT_LEN, DEFAULT_OUTPUT_LEN = "uniform:32-256", "uniform:16-128"
DEFAULT_NUM_PROMPTS, DEFAULT_RATE = 64, 4.0
KV_BLOCK_SIZE = 16  # build_engine's default block size
SCENARIO_COMPARES = ("policies", "priority", "deadlines")  # comparisons that run a scenario
CUSTOM_FLAGS = (
    "num_prompts", "rate", "process", "burstiness", "concurrency", "input_len", "output_len",
    "sharegpt", "shared_prefix", "tenants",
)  # fmt: skip


@dataclass
class Target:
    """Where requests go, as whom, and how."""

    url: str
    model: str
    keys: dict[str, str | None]
    default_key: str | None = None
    admin_key: str | None = None
    ignore_eos: bool = True
    send_priority: bool = True
    send_deadlines: bool = True  # the specs' timeout / max_queue_time_s (False: measured only)
    timeout_s: float = 300.0
    progress: bool = True
    server: dict | None = None  # the local server's config (keys left out), None for --url


@dataclass
class Workload:
    tenants: list[Any]  # TenantPlan
    specs: list[RequestSpec]
    info: dict  # JSON-ready: what was sent and how it was built
    concurrency: int | None = None  # fixed-concurrency mode


class UsageError(Exception):
    """A bad combination of arguments (exit code 2)."""


def tenant_key(name: str) -> str:
    return f"bench-key-{name}"


def local_config(tenants: Sequence[Any], engine: dict, model: str = "tiny") -> dict:
    """The app config of a local bench server: one key per tenant, the admin key, and limits
    high enough that overload queues in the scheduler (what is measured) rather than being
    refused at the door; quotas (tokens_per_minute) still reject."""
    rows = []
    for t in tenants:
        row: dict[str, Any] = {"name": t.name, "api_key": tenant_key(t.name)}
        row.update(weight=float(t.weight), priority=int(t.priority))
        if t.tokens_per_minute:
            row["tokens_per_minute"] = float(t.tokens_per_minute)
        rows.append(row)
    return {
        "model": model,
        "tenants": rows,
        "allow_anonymous": True,  # capacity calibration runs as the anonymous tenant
        "admin_api_key": ADMIN_KEY,
        "limits": {"max_requests_per_tenant": 100_000, "max_requests_total": 100_000},
        "engine": dict(engine),
    }


def public_config(config: dict) -> dict:
    """`config` without its keys (for result.json)."""
    out = {k: v for k, v in config.items() if k != "admin_api_key"}
    out["tenants"] = [{k: v for k, v in t.items() if k != "api_key"} for t in config["tenants"]]
    return out


def engine_settings(args: Any, *, order_within_tenant: str | None = None, **override: Any) -> dict:
    """The local server's build_engine settings; `order_within_tenant` (default: the
    command line's) goes to the policy as a policy kwarg."""
    eng: dict[str, Any] = {
        "policy": args.policy,
        "max_num_seqs": args.max_num_seqs,
        "num_gpu_blocks": args.num_gpu_blocks or 1024,
        "preemption_mode": args.preemption_mode,
    }
    within = order_within_tenant or getattr(args, "order_within_tenant", None) or "fcfs"
    if within != "fcfs":
        eng["policy_kwargs"] = {"order_within_tenant": within}
    eng.update(override)
    return eng


def _load_keys(path: str) -> dict[str, str]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))  # JSON is YAML too
    except (OSError, yaml.YAMLError) as e:
        raise UsageError(f"--keys {path}: {e}") from None
    if not isinstance(data, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in data.items()
    ):
        raise UsageError(f"--keys {path}: expected a mapping of tenant name -> key")
    return data


@contextlib.contextmanager
def open_target(args: Any, tenants: Sequence[Any], engine: dict) -> Iterator[Target]:
    """A `Target`: the server at --url, or a fresh local server for `tenants` and `engine`."""
    from fairbatch.benchmarks.serve_server import LocalServer

    common = dict(
        ignore_eos=not args.no_ignore_eos,
        send_priority=not args.no_priority_field,
        timeout_s=args.timeout,
        progress=not args.no_progress,
    )
    if args.url:
        keys: dict[str, str | None] = dict(_load_keys(args.keys)) if args.keys else {}
        # Always probe: an unreachable server fails here, in one line, not once per request.
        listed = asyncio.run(probe(args.url, args.api_key or next(iter(keys.values()), None)))
        model = args.model or listed
        if model is None:
            raise RuntimeError(
                f"{args.url}/v1/models lists no model (or refused the key): give --model"
            )
        yield Target(args.url.rstrip("/"), model, keys, args.api_key, args.admin_key, **common)
        return
    model_dir = "tiny"
    if getattr(args, "checkpoint", None):
        from fairbatch.benchmarks.checkpoints import resolve_model

        model_dir = str(resolve_model(args.checkpoint))
    config = local_config(tenants, engine, model_dir)
    print(f"starting a local server ({engine})", file=sys.stderr, flush=True)
    with LocalServer(config) as url:
        model = args.model or asyncio.run(probe(url, None)) or "fairbatch-tiny"
        keys = {t.name: tenant_key(t.name) for t in tenants}
        yield Target(url, model, keys, None, ADMIN_KEY, server=public_config(config), **common)


async def calibrate(
    target: Target, scale: float, concurrency: int, tenants: Sequence[Any] = ()
) -> float:
    """The scenarios' capacity_rps: a closed loop at `base_lengths(scale)` mean lengths.

    On a local server it runs as the anonymous tenant (no scenario tenant is charged for it);
    on --url with the --api-key, else the key of a scenario tenant without a quota."""
    from fairbatch.benchmarks.serve_workload import base_lengths

    inp, out = base_lengths(scale)
    key = None
    if target.server is None:
        unlimited = [t.name for t in tenants if not t.tokens_per_minute]
        key = target.default_key or next(
            (target.keys[n] for n in unlimited if n in target.keys),
            next(iter(target.keys.values()), None),
        )
    return await measure_capacity(
        target.url,
        model=target.model,
        api_key=key,
        prompt_len=round(inp.mean),
        output_len=round(out.mean),
        concurrency=concurrency,
        timeout_s=target.timeout_s,
        ignore_eos=target.ignore_eos,
    )


def scenario_workload(name: str, capacity: float, args: Any) -> Workload:
    from fairbatch.benchmarks.serve_scenarios import build_scenario

    scn = build_scenario(
        name, capacity_rps=capacity, duration_s=args.duration, seed=args.seed, scale=args.scale
    )
    info = {
        "scenario": scn.name,
        "description": scn.description,
        "expect": scn.expect,
        "capacity_rps": round(capacity, 4),
        "duration_s": scn.duration_s,
        "scale": args.scale,
        "seed": args.seed,
        "num_requests": len(scn.requests),
        "tenants": [dataclasses.asdict(t) for t in scn.tenants],
    }
    return Workload(scn.tenants, scn.requests, info)


def scenario_tenants(name: str, args: Any) -> list[Any]:
    from fairbatch.benchmarks.serve_scenarios import build_scenario

    return build_scenario(
        name, capacity_rps=1.0, duration_s=args.duration, scale=args.scale
    ).tenants


def custom_workload(args: Any) -> Workload:
    from fairbatch.benchmarks.serve_workload import (
        TenantPlan,
        build_workload,
        parse_lengths,
        sharegpt_lengths,
    )

    if args.sharegpt:
        inp, out = sharegpt_lengths(args.sharegpt)
    else:
        inp = parse_lengths(args.input_len or DEFAULT_INPUT_LEN)
        out = parse_lengths(args.output_len or DEFAULT_OUTPUT_LEN)
    tenants = [TenantPlan(**t) for t in args.tenants] if args.tenants else [TenantPlan("default")]
    rate = args.rate or DEFAULT_RATE
    process = args.process or "poisson"
    if args.concurrency or rate == float("inf"):
        process = "all-at-once"
    n = args.num_prompts or DEFAULT_NUM_PROMPTS
    specs = build_workload(
        n,
        rate=rate if rate != float("inf") else 1.0,
        process=process,
        burstiness=args.burstiness or 1.0,
        input_lens=inp,
        output_lens=out,
        tenants=tenants,
        shared_prefix=args.shared_prefix,
        prefix_hot=getattr(args, "prefix_hot", None),  # set by --compare locality
        seed=args.seed,
    )
    info = {
        "scenario": None,
        "num_requests": n,
        "process": process,
        "rate": None if process == "all-at-once" else rate,
        "burstiness": args.burstiness or 1.0,
        "concurrency": args.concurrency,
        "input_len": str(inp),
        "output_len": str(out),
        "shared_prefix": list(args.shared_prefix) if args.shared_prefix else None,
        "prefix_hot": getattr(args, "prefix_hot", None),
        "seed": args.seed,
        "tenants": [dataclasses.asdict(t) for t in tenants],
    }
    return Workload(tenants, specs, info, args.concurrency)


def slo_of(args: Any) -> dict | None:
    """The goodput SLOs in seconds (given in ms on the command line)."""
    given = (("ttft_s", args.slo_ttft), ("tpot_s", args.slo_tpot), ("e2e_s", args.slo_e2e))
    slo = {name: ms / 1e3 for name, ms in given if ms}
    return slo or None


async def sync_tenants(target: Target, tenants: Sequence[Any]) -> None:
    """Give a local server's tenants the settings of `tenants` (PATCH /admin/tenants/NAME).

    A scenario's quotas are fractions of the measured capacity, known only once the server it
    was measured on runs; its config was written from a stand-in. Servers we did not start
    (--url) are left alone: their tenants are their operator's."""
    if target.server is None:
        return
    configured = {t["name"]: t for t in target.server["tenants"]}
    async with httpx.AsyncClient(timeout=30.0) as client:
        for t in tenants:
            want = {
                "weight": float(t.weight),
                "priority": int(t.priority),
                "tokens_per_minute": float(t.tokens_per_minute) if t.tokens_per_minute else None,
            }
            row = configured[t.name]
            if all(row.get(k) == v for k, v in want.items()):
                continue
            # A resized bucket keeps its level: clear the quota first, so the new one starts
            # full, as on a server started with it.
            for body in ({"tokens_per_minute": None}, want):
                r = await client.patch(
                    f"{target.url}/admin/tenants/{t.name}",
                    json=body,
                    headers={"Authorization": f"Bearer {target.admin_key}"},
                )
                if r.status_code != 200:
                    raise RuntimeError(f"could not configure tenant {t.name}: {r.text[:200]}")
            row.update({k: v for k, v in want.items() if v is not None})
            if want["tokens_per_minute"] is None:
                row.pop("tokens_per_minute", None)


async def run_phase(
    target: Target,
    wl: Workload,
    *,
    slo: dict | None = None,
    max_drain_s: float | None = None,
    specs: Sequence[RequestSpec] | None = None,
) -> dict:
    """Send the workload (or `specs`, a part of it); read the server's counters around it.
    `max_drain_s`: cut requests off that long after the last arrival (open loop only).
    Returns {"results", "duration_s", "summary"}."""
    from fairbatch.benchmarks.serve_metrics import summarize_run

    specs = wl.specs if specs is None else specs
    await sync_tenants(target, wl.tenants)
    deadline_s = None
    if max_drain_s is not None and wl.concurrency is None and specs:
        deadline_s = max(s.arrival_s for s in specs) + max_drain_s
    before = await get_stats(target.url, target.admin_key)
    results, duration = await run_requests(
        target.url,
        specs,
        model=target.model,
        keys=target.keys,
        default_key=target.default_key,
        max_concurrency=wl.concurrency,
        timeout_s=target.timeout_s,
        progress=target.progress,
        ignore_eos=target.ignore_eos,
        send_priority=target.send_priority,
        send_deadlines=target.send_deadlines,
        deadline_s=deadline_s,
    )
    after = await get_stats(target.url, target.admin_key)
    weights = {t.name: float(t.weight) for t in wl.tenants}
    summary = summarize_run(
        results,
        duration_s=duration,
        weights=weights,
        slo=slo,
        server_before=before,
        server_after=after,
        max_batch_tokens=batch_tokens(target, specs),
        window_s=wl.info.get("duration_s"),  # a scenario's arrivals (deadline goodput)
    )
    return {"results": results, "duration_s": duration, "summary": summary}


def window_service(results: Sequence[RequestResult], wl: Workload) -> dict | None:
    """Service per tenant up to the end of the arrivals (a scenario's duration, else the last
    arrival), and Jain's index over it per unit of weight. Over a whole run that drains, every
    tenant is eventually served all it sent, so the run's totals measure offered load; while
    the arrivals last, the tenants compete, and this is who got what."""
    from fairbatch.benchmarks.serve_metrics import jain_index, service_events

    t_end = wl.info.get("duration_s") or max((r.spec.arrival_s for r in results), default=0.0)
    if t_end <= 0:  # all at once, or fixed concurrency: no arrival window to speak of
        return None
    service = {t.name: 0.0 for t in wl.tenants}
    for r in results:
        service[r.spec.tenant] = service.get(r.spec.tenant, 0.0) + sum(
            x for t, x in service_events(r) if t <= t_end
        )
    weights = {t.name: float(t.weight) for t in wl.tenants}
    norm = {n: x / weights.get(n, 1.0) for n, x in service.items()}
    total = sum(service.values())
    return {
        "t_end_s": round(t_end, 3),
        "service": {n: round(x, 1) for n, x in service.items()},
        "share": {n: round(x / total, 4) if total else None for n, x in service.items()},
        "normalized_service": {n: round(x, 1) for n, x in norm.items()},
        "jain_index": jain_index(list(norm.values())) if norm else None,
    }


def error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    """How many requests failed with each error message (rejections included)."""
    counts: dict[str, int] = {}
    for r in results:
        if not r.ok:
            counts[r.error] = counts.get(r.error, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def batch_tokens(target: Target, specs: Sequence[RequestSpec]) -> int | None:
    """M in VTC's bound: the most tokens the local server's running batch can hold (seats x
    the longest request, at most the KV cache); None for a server we did not configure."""
    engine = (target.server or {}).get("engine")
    if not engine or not specs:
        return None
    longest = max(s.prompt_len + s.max_tokens for s in specs)
    return min(engine["max_num_seqs"] * longest, engine["num_gpu_blocks"] * KV_BLOCK_SIZE)


def request_rows(results: Sequence[RequestResult]) -> list[dict]:
    """One compact row per request for --raw-out (no prompt text, no chunk times)."""
    rows = []
    for r in results:
        s = r.spec
        ttft = r.ttft_s
        rows.append(
            {
                "index": s.index,
                "tenant": s.tenant,
                "arrival_s": round(s.arrival_s, 4),
                "send_s": round(r.send_s, 4),
                "end_s": round(r.end_s, 4),
                "ok": r.ok,
                "status": r.status,
                "error": r.error or None,
                "retry_after_s": r.retry_after_s,
                "ttft_s": None if ttft is None else round(ttft, 4),
                "e2e_s": round(r.e2e_s, 4),
                "prompt_len": s.prompt_len,
                "max_tokens": s.max_tokens,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
                "chunks": len(r.chunk_times_s),
                "finish_reason": r.finish_reason or None,
                "shared_prefix": s.shared_prefix,
                "timeout": s.timeout,
            }
        )
    return rows


def command_line(args: Any) -> str:
    """The command that reproduces this run: the options that differ from their defaults."""
    parts = ["fairbatch", "bench", "serve"]
    for action in args.parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest, None)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:
            parts.append(flag)
        elif action.dest == "tenants":
            parts += [flag, ",".join(_tenant_arg(t) for t in value)]
        elif action.dest == "shared_prefix":
            parts += [flag, f"{value[0]},{value[1]}"]
        else:
            parts += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    return shlex.join(parts)


def _tenant_arg(t: dict) -> str:
    fields = [t["name"], t.get("weight"), t.get("priority"), t.get("tokens_per_minute")]
    while fields[-1] is None:
        fields.pop()
    return ":".join(
        "" if f is None else f"{f:g}" if isinstance(f, float) else str(f) for f in fields
    )


def meta(args: Any) -> dict:
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": command_line(args),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def out_dir(args: Any) -> Path:
    if args.out:
        path = Path(args.out)
    else:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
        path = Path("serve-bench") / stamp
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_json(path: Path, data: dict) -> None:
    path.write_text(compact_json(json.loads(json.dumps(data, default=_json_default))) + "\n")


def compact_json(x: Any, level: int = 0, width: int = 100) -> str:
    """JSON with floats to 6 significant digits; a container that fits in `width` columns
    stays on one line, a longer one has one item per line."""
    x = _rounded(x)
    one = json.dumps(x)
    if not isinstance(x, (dict, list)) or not x or level + len(one) <= width:
        return one
    pad = " " * (level + 1)
    if isinstance(x, dict):
        items = [f"{pad}{json.dumps(k)}: {compact_json(v, level + 1, width)}" for k, v in x.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
    items = [pad + compact_json(v, level + 1, width) for v in x]
    return "[\n" + ",\n".join(items) + "\n" + " " * level + "]"


def _rounded(x: Any) -> Any:
    if isinstance(x, float) and x == x and abs(x) != float("inf"):
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return x


def _json_default(x: Any) -> Any:
    if dataclasses.is_dataclass(x):
        return dataclasses.asdict(x)
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def write_results(args: Any, out: Path, result: dict) -> str:
    """OUT/result.json gets the summary. The per-request rows (`requests`, or each compared
    run's under `runs`) are taken out of it: they go to `--raw-out` as JSON lines (a
    comparison's rows carry their run's label) or nowhere. Returns what was written, for the
    closing line."""
    rows = result.pop("requests", None) or []
    for label, run in (result.pop("runs", None) or {}).items():
        rows += [{"run": label, **r} for r in run.get("requests", ())]
    write_json(out / "result.json", result)
    wrote = str(out / "result.json")
    if args.raw_out:
        raw = Path(args.raw_out)
        raw.parent.mkdir(parents=True, exist_ok=True)
        with raw.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, default=_json_default) + "\n")
        wrote += f", {len(rows)} request rows to {raw}"
    return wrote


def run_single(args: Any) -> int:
    from fairbatch.benchmarks import serve_plots, serve_report

    result: dict[str, Any] = {"kind": "run", "meta": meta(args)}
    if args.scenario:
        tenants = scenario_tenants(args.scenario, args)
    else:
        wl = custom_workload(args)
        tenants = wl.tenants
    with open_target(args, tenants, engine_settings(args)) as target:
        if args.scenario:
            capacity = args.capacity or asyncio.run(
                calibrate(target, args.scale, args.max_num_seqs, tenants)
            )
            wl = scenario_workload(args.scenario, capacity, args)
        phase = asyncio.run(run_phase(target, wl, slo=slo_of(args), max_drain_s=args.max_drain))
        result["meta"].update(target=args.url or "local", model=target.model, server=target.server)
    result["meta"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["workload"] = dict(wl.info, max_drain_s=args.max_drain)
    result["summary"] = phase["summary"]
    result["window"] = window_service(phase["results"], wl)
    result["requests"] = request_rows(phase["results"])
    out = out_dir(args)
    weights = {t.name: float(t.weight) for t in wl.tenants}
    result["plots"] = (
        []
        if args.no_plots
        else serve_plots.plot_run(
            phase["results"], weights, out, _title(wl), (result["window"] or {}).get("t_end_s")
        )
    )
    wrote = write_results(args, out, result)
    print(serve_report.format_run(result))
    print(f"\nwrote {wrote}" + (f" and {len(result['plots'])} plots" if result["plots"] else ""))
    return 0


def _title(wl: Workload) -> str:
    if wl.info.get("scenario"):
        return f"{wl.info['scenario']} ({wl.info['num_requests']} requests)"
    return f"{wl.info['process']} ({wl.info['num_requests']} requests)"


def check_args(args: Any) -> None:
    """Raise UsageError for combinations argparse cannot see."""
    from fairbatch.benchmarks.serve_scenarios import SCENARIOS

    custom = [f for f in CUSTOM_FLAGS if getattr(args, f) is not None]
    flag = lambda f: "--" + f.replace("_", "-")  # noqa: E731
    if args.compare == "summary":
        return
    if args.scenario is not None and args.scenario not in SCENARIOS:
        raise UsageError(
            f"unknown scenario {args.scenario!r}; choose from {', '.join(sorted(SCENARIOS))}"
        )
    if args.scenario and custom:
        raise UsageError(f"--scenario and {flag(custom[0])} exclude each other")
    if args.compare == "deadlines" and args.scenario not in (None, "deadlines"):
        raise UsageError("--compare deadlines runs the deadlines scenario: drop --scenario")
    if args.compare in SCENARIO_COMPARES and custom:
        raise UsageError(f"--compare {args.compare} runs a scenario: drop {flag(custom[0])}")
    if args.compare in ("preemption", "locality") and args.scenario:
        raise UsageError(f"--compare {args.compare} sends a custom workload: drop --scenario")
    if args.capacity and not args.scenario and args.compare not in SCENARIO_COMPARES:
        raise UsageError("--capacity applies to --scenario runs")
    if args.sharegpt and (args.input_len or args.output_len):
        raise UsageError("--sharegpt and --input-len/--output-len exclude each other")
    if args.burstiness is not None and args.process != "gamma":
        raise UsageError("--burstiness applies to --process gamma")
    if args.concurrency and (args.rate or args.process):
        raise UsageError("--concurrency ignores arrival times: drop --rate/--process")
    if args.compare and args.url:
        raise UsageError(f"--compare {args.compare} starts its own local servers: drop --url")
    if args.keys and not args.url:
        raise UsageError("--keys applies to --url (the local server makes its own keys)")
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise UsageError(f"--out {args.out} exists and is not a directory")
    if args.raw_out and Path(args.raw_out).is_dir():
        raise UsageError(f"--raw-out {args.raw_out} is a directory: name a file")


def main(args: Any) -> int:
    """`fairbatch bench serve` (args from the CLI parser). Exit codes: 0 done, 1 the run failed
    (server did not start, unreachable), 2 bad arguments."""
    try:
        check_args(args)
        if args.compare:
            from fairbatch.benchmarks import serve_compare

            return serve_compare.run(args)
        return run_single(args)
    except UsageError as e:
        args.parser.error(str(e))  # exits with code 2
    except (RuntimeError, ConnectionError) as e:
        print(f"fairbatch bench serve: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fairbatch bench serve: interrupted", file=sys.stderr)
        return 130
    return 2
