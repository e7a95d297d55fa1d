"""`fairbatch bench serve --compare NAME`: comparisons, each in one command.

* `policies`: one scenario (default vtc_overload), one fresh local server per policy (fcfs,
  round_robin, weighted_fair, priority), the identical request list for each (capacity is
  calibrated once, on the first server). Who gets what while the arrivals last, at what
  latency, and the max weighted service difference against VTC's bound.
* `priority`: one server config (policy priority) and the priority_burst scenario: the
  high-priority requests alone on an idle server ("unloaded"), then the whole scenario with
  its saturating low-priority load ("saturated"); for reference the same scenario on an fcfs
  server. High-priority TTFT in each.
* `preemption`: swap vs recompute vs auto on a memory-tight engine (few KV blocks, so running
  requests must give way): an all-at-once burst, preemptions and swapped bytes from the
  server's /admin/stats, throughput and latency.
* `deadlines`: the deadlines scenario (2x overload, a timeout and max_queue_time_s per
  request), one fresh local server each for fcfs, weighted_fair and weighted_fair + edf with
  the deadlines sent, and for weighted_fair + edf without them (no eviction); goodput within
  deadline, measured client-side against the same deadlines in every run.
* `serving-path`: one workload offline, through the local HTTP server, through the Ray Serve
  app over HTTP and through its handle API; tokens/s against offline, latency, and CPU per
  output token per process role (`serving_path.py`).
* `locality`: tenants reusing their own long system prompts on an engine whose KV pool holds
  part of them, one fresh local server per policy (fcfs, weighted_fair, lpm, dlpm): throughput,
  prefix-hit rate, per-tenant TTFT, fairness (`serve_locality.py`).
* `summary`: the engine benchmark (`fairbatch bench engine --json`) and the cluster benchmark
  (`fairbatch bench cluster --json`) from their JSON files, in one table each.

Each writes OUT/result.json ({"kind": "compare", "compare", "meta", "workload", "table": rows,
"plots"}: the printed tables' rows, a summary to commit) and prints Markdown tables. The
per-run records (`runs`: {label: {"engine", "summary", "window", "errors", "requests"}}) are
what the tables are made from; they stay out of result.json, and with `--raw-out FILE` their
request rows go to FILE, each with its run's label.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fairbatch.benchmarks import serve_bench as B
from fairbatch.benchmarks import serve_report as R

POLICIES = ("fcfs", "round_robin", "weighted_fair", "priority")
PREEMPTION_MODES = ("swap", "recompute", "auto")
TIGHT_KV_BLOCKS = 64  # x 16 tokens: a quarter of what 16 seqs of 128 + 128 tokens need


def run(args: argparse.Namespace) -> int:
    compare = {
        "policies": compare_policies,
        "priority": compare_priority,
        "preemption": compare_preemption,
        "deadlines": compare_deadlines,
        "locality": compare_locality,
        "summary": compare_summary,
        "serving-path": compare_serving_path,
        "quota": compare_quota,
    }[args.compare]
    result: dict[str, Any] = {"kind": "compare", "compare": args.compare, "meta": B.meta(args)}
    out = B.out_dir(args)
    text = compare(args, result, out)
    result["meta"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    wrote = B.write_results(args, out, result)
    print(text)
    print(f"\nwrote {wrote}" + "".join(f", {p}" for p in result.get("plots", [])))
    return 0


def compare_quota(args: argparse.Namespace, result: dict, out: Path) -> str:
    from fairbatch.benchmarks import quota_bench

    return quota_bench.run(args, result, out)


def compare_serving_path(args: argparse.Namespace, result: dict, out: Path) -> str:
    from fairbatch.benchmarks import serving_path

    return serving_path.run(args, result, out)


def compare_locality(args: argparse.Namespace, result: dict, out: Path) -> str:
    from fairbatch.benchmarks import serve_locality

    return serve_locality.run(args, result, out)


def _phase_record(engine: dict | None, phase: dict, wl: B.Workload) -> dict:
    return {
        "engine": engine,
        "summary": phase["summary"],
        "window": B.window_service(phase["results"], wl),
        "errors": B.error_counts(phase["results"]),
        "requests": B.request_rows(phase["results"]),  # for --raw-out only
    }


def _p(summary_part: dict | None, key: str) -> float | None:
    return (summary_part or {}).get(key)


# ---- policies ---------------------------------------------------------------------------------


def _scenario_runs(
    args: argparse.Namespace,
    result: dict,
    name: str,
    runs: dict[str, tuple[dict, dict]],
    max_drain_s: Callable[[B.Workload], float | None] | None = None,
) -> tuple[B.Workload, dict[str, dict]]:
    """Scenario `name`, the identical requests to a fresh local server per run: label ->
    (engine settings, Target fields to set, e.g. send_deadlines). Capacity is calibrated once,
    on the first server (unless --capacity). `max_drain_s(workload)` (default: --max-drain)
    bounds each run. Returns the workload and each run's phase, with its "engine"."""
    tenants = B.scenario_tenants(name, args)
    capacity, wl, phases, drain = args.capacity, None, {}, args.max_drain
    for label, (engine, target_fields) in runs.items():
        with B.open_target(args, tenants, engine) as target:
            if capacity is None:
                capacity = asyncio.run(B.calibrate(target, args.scale, args.max_num_seqs, tenants))
            if wl is None:
                wl = B.scenario_workload(name, capacity, args)
                drain = max_drain_s(wl) if max_drain_s else args.max_drain
                result["meta"].update(model=target.model, server=target.server)
                result["workload"] = dict(wl.info, max_drain_s=drain)
            target = dataclasses.replace(target, **target_fields)
            phases[label] = asyncio.run(
                B.run_phase(target, wl, slo=B.slo_of(args), max_drain_s=drain)
            )
        phases[label]["engine"] = engine
    assert wl is not None
    return wl, phases


def compare_policies(args: argparse.Namespace, result: dict, out: Path) -> str:
    from fairbatch.benchmarks import serve_plots

    name = args.scenario or "vtc_overload"
    runs = {p: (B.engine_settings(args, policy=p), {}) for p in POLICIES}
    wl, phases = _scenario_runs(args, result, name, runs)
    result["runs"] = {p: _phase_record(ph["engine"], ph, wl) for p, ph in phases.items()}
    rows = []
    for policy, rec in result["runs"].items():
        s, w = rec["summary"], rec["window"]
        for tenant, t in s["tenants"].items():
            rows.append(
                {
                    "policy": policy,
                    "tenant": tenant,
                    "weight": t["weight"],
                    "completed": t["completed"],
                    "sent": t["sent"],
                    "window_share": w["share"].get(tenant),
                    "window_normalized_service": w["normalized_service"].get(tenant),
                    "ttft_p50_s": _p(t["ttft"], "p50"),
                    "ttft_p90_s": _p(t["ttft"], "p90"),
                    "e2e_p50_s": _p(t["e2e"], "p50"),
                    "e2e_p90_s": _p(t["e2e"], "p90"),
                    "window_jain": w["jain_index"],
                    "max_service_difference": s["max_service_difference"],
                    "vtc_bound": s["vtc_bound"],
                    "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
                }
            )
    result["table"] = rows
    weights = {t.name: float(t.weight) for t in wl.tenants}
    if not args.no_plots:
        names = [t.name for t in wl.tenants]
        result["plots"] = [
            serve_plots.service_panels(
                {p: ph["results"] for p, ph in phases.items()},
                weights,
                out / "policies_service.png",
                f"{name}: service / weight per tenant, by policy",
                wl.info["duration_s"],
            ),
            serve_plots.grouped_bars(
                list(POLICIES),
                {n: [r["window_share"] for r in rows if r["tenant"] == n] for n in names},
                out / "policies_share.png",
                title=f"{name}: share of service until t = {wl.info['duration_s']:g} s",
                ylabel="share of weighted tokens",
            ),
            serve_plots.grouped_bars(
                list(POLICIES),
                {n: [r["ttft_p90_s"] for r in rows if r["tenant"] == n] for n in names},
                out / "policies_ttft_p90.png",
                title=f"{name}: TTFT p90 per tenant",
                ylabel="seconds (log)",
                log=True,
            ),
        ]
    return _policies_text(result, name)


def _policies_text(result: dict, name: str) -> str:
    wl = result["workload"]
    table = R.table(
        [
            "policy", "tenant", "weight", "ok / sent", f"share until {wl['duration_s']:g} s",
            "TTFT p50 ms", "TTFT p90 ms", "e2e p50 ms", "e2e p90 ms",
        ],
        [
            [
                r["policy"], r["tenant"], f"{r['weight']:g}", f"{r['completed']} / {r['sent']}",
                "-" if r["window_share"] is None else f"{100 * r['window_share']:.1f}%",
                R.ms(r["ttft_p50_s"]), R.ms(r["ttft_p90_s"]), R.ms(r["e2e_p50_s"]),
                R.ms(r["e2e_p90_s"]),
            ]
            for r in result["table"]
        ],
    )  # fmt: skip
    per_policy = R.table(
        ["policy", "output tok/s", "Jain (window)", "max weighted service diff", "VTC bound"],
        [
            [
                p,
                R.num(rec["summary"]["throughput"]["output_tokens_per_s"]),
                f"{rec['window']['jain_index']:.4f}",
                R.num(rec["summary"]["max_service_difference"], 0),
                R.num(rec["summary"]["vtc_bound"], 0),
            ]
            for p, rec in result["runs"].items()
        ],
    )
    head = (
        f"## policies on {name}: {wl['num_requests']} requests over {wl['duration_s']:g} s, "
        f"capacity {wl['capacity_rps']:.2f} req/s, {result['meta']['date_utc']} UTC"
    )
    return "\n\n".join([head, wl.get("description", ""), table, per_policy])


# ---- deadlines --------------------------------------------------------------------------------

DEADLINE_RUNS = (  # label, policy, order_within_tenant, deadlines sent
    ("fcfs", "fcfs", "fcfs", True),
    ("weighted_fair", "weighted_fair", "fcfs", True),
    ("weighted_fair+edf", "weighted_fair", "edf", True),
    ("weighted_fair+edf, no deadlines sent", "weighted_fair", "edf", False),
)
DEADLINE_GOAL = 1.5  # edf with eviction vs the same run without: goodput ratio (issue 18)


def _drain_past_deadlines(wl: B.Workload) -> float:
    """Past the last arrival plus the longest timeout no request can meet its deadline: runs
    stop there (1 s later) instead of draining a backlog that no longer counts."""
    return max(s.timeout or 0.0 for s in wl.specs) + 1.0


def compare_deadlines(args: argparse.Namespace, result: dict, out: Path) -> str:
    from fairbatch.benchmarks import serve_plots
    from fairbatch.benchmarks.serve_metrics import deadline_report

    name = "deadlines"
    runs = {
        label: (
            B.engine_settings(args, policy=policy, order_within_tenant=within),
            {"send_deadlines": send},
        )
        for label, policy, within, send in DEADLINE_RUNS
    }
    drain = None if args.max_drain else _drain_past_deadlines
    wl, phases = _scenario_runs(args, result, name, runs, drain)
    window = wl.info["duration_s"]
    result["runs"] = {label: _phase_record(ph["engine"], ph, wl) for label, ph in phases.items()}
    rows = []
    for label, policy, within, send in DEADLINE_RUNS:
        res = phases[label]["results"]
        dl = deadline_report(res, window)
        by_tenant = {
            t.name: deadline_report([r for r in res if r.spec.tenant == t.name], window)
            for t in wl.tenants
        }
        rows.append(
            {
                "run": label,
                "policy": policy,
                "order_within_tenant": within,
                "deadlines_sent": send,
                **{k: dl[k] for k in ("with_deadline", "met", "timed_out", "timed_out_running")},
                "late": dl["late"],
                "goodput_rps": dl["goodput_rps"],
                "goodput_rps_by_tenant": {n: d["goodput_rps"] for n, d in by_tenant.items()},
                "output_tokens_per_s": phases[label]["summary"]["throughput"][
                    "output_tokens_per_s"
                ],
            }
        )
    result["table"] = rows
    good = {r["run"]: r["goodput_rps"] for r in rows}
    base = good["weighted_fair+edf, no deadlines sent"]
    ratio = good["weighted_fair+edf"] / base if base else None
    result["goal"] = {
        "edf_vs_no_eviction": ratio,
        "target": DEADLINE_GOAL,
        "met": ratio is not None and ratio >= DEADLINE_GOAL,
    }
    if not args.no_plots:
        result["plots"] = [
            serve_plots.grouped_bars(
                [r["run"].replace(", ", ",\n") for r in rows],
                {t.name: [r["goodput_rps_by_tenant"][t.name] for r in rows] for t in wl.tenants},
                out / "deadlines_goodput.png",
                title=f"{name}: goodput within deadline per tenant",
                ylabel="requests / s",
            )
        ]
    table = R.table(
        ["run", "met / with deadline", "timed out (while running)", "late", "goodput req/s",
         "output tok/s"],
        [
            [r["run"], f"{r['met']} / {r['with_deadline']}",
             f"{r['timed_out']} ({r['timed_out_running']})", r["late"],
             f"{r['goodput_rps']:.2f}", R.num(r["output_tokens_per_s"])]
            for r in rows
        ],
    )  # fmt: skip
    info = result["workload"]
    head = (
        f"## deadlines on {name}: {info['num_requests']} requests over {window:g} s, capacity "
        f"{info['capacity_rps']:.2f} req/s, each run cut off {info['max_drain_s']:g} s after "
        f"the last arrival, {result['meta']['date_utc']} UTC"
    )
    verdict = (
        "edf with eviction vs without: "
        + ("-" if ratio is None else f"{ratio:.2f}x")
        + f" the goodput (goal >= {DEADLINE_GOAL:g}x)"
    )
    return "\n\n".join([head, info.get("description", ""), table, verdict])


# ---- priority ---------------------------------------------------------------------------------


def compare_priority(args: argparse.Namespace, result: dict, out: Path) -> str:
    from fairbatch.benchmarks import serve_plots

    name = args.scenario or "priority_burst"
    tenants = B.scenario_tenants(name, args)
    if not any(t.priority > 0 for t in tenants):
        raise B.UsageError(f"scenario {name!r} has no tenant with priority > 0")
    engine = B.engine_settings(args, policy="priority")
    phases: dict[str, dict] = {}
    with B.open_target(args, tenants, engine) as target:
        capacity = args.capacity or asyncio.run(
            B.calibrate(target, args.scale, args.max_num_seqs, tenants)
        )
        wl = B.scenario_workload(name, capacity, args)
        result["meta"].update(model=target.model, server=target.server)
        high = [s for s in wl.specs if s.priority > 0]
        # The same high-priority requests, at the same gaps, on an otherwise idle server.
        first = min(s.arrival_s for s in high)
        alone = [dataclasses.replace(s, arrival_s=s.arrival_s - first + 0.5) for s in high]
        phases["unloaded (priority)"] = asyncio.run(B.run_phase(target, wl, specs=alone))
        phases["saturated (priority)"] = asyncio.run(
            B.run_phase(target, wl, max_drain_s=args.max_drain)
        )
    fcfs_engine = B.engine_settings(args, policy="fcfs")
    with B.open_target(args, tenants, fcfs_engine) as target:
        phases["saturated (fcfs)"] = asyncio.run(
            B.run_phase(target, wl, max_drain_s=args.max_drain)
        )
    engines = {"saturated (fcfs)": fcfs_engine}
    result["workload"] = dict(wl.info, max_drain_s=args.max_drain)
    result["runs"] = {
        label: _phase_record(engines.get(label, engine), ph, wl) for label, ph in phases.items()
    }
    rows = []
    for label, rec in result["runs"].items():
        for tenant, t in rec["summary"]["tenants"].items():
            if not t["sent"]:
                continue
            rows.append(
                {
                    "phase": label,
                    "tenant": tenant,
                    "priority": next(p.priority for p in tenants if p.name == tenant),
                    "completed": t["completed"],
                    "sent": t["sent"],
                    **{f"ttft_{q}_s": _p(t["ttft"], q) for q in ("p50", "p90", "p99")},
                    **{f"e2e_{q}_s": _p(t["e2e"], q) for q in ("p50", "p90")},
                }
            )
    result["table"] = rows
    hi = [r for r in rows if r["priority"] > 0]
    if not args.no_plots:
        result["plots"] = [
            serve_plots.grouped_bars(
                [r["phase"] for r in hi],
                {q: [r[f"ttft_{q}_s"] for r in hi] for q in ("p50", "p90", "p99")},
                out / "priority_ttft.png",
                title=f"{name}: high-priority TTFT",
                ylabel="seconds (log)",
                log=True,
            ),
            serve_plots.cdf_panels(
                {
                    label: [r.ttft_s for r in ph["results"] if r.ok and r.spec.priority > 0]
                    for label, ph in phases.items()
                },
                out / "priority_ttft_cdf.png",
                xlabel="high-priority TTFT (s)",
                title=f"{name}: high-priority TTFT CDF",
            ),
        ]
    table = R.table(
        ["phase", "tenant", "priority", "ok / sent", "TTFT p50 ms", "TTFT p90 ms",
         "TTFT p99 ms", "e2e p50 ms", "e2e p90 ms"],
        [
            [r["phase"], r["tenant"], r["priority"], f"{r['completed']} / {r['sent']}",
             R.ms(r["ttft_p50_s"]), R.ms(r["ttft_p90_s"]), R.ms(r["ttft_p99_s"]),
             R.ms(r["e2e_p50_s"]), R.ms(r["e2e_p90_s"])]
            for r in rows
        ],
    )  # fmt: skip
    head = (
        f"## priority on {name}: {len(wl.specs)} requests "
        f"({len(high)} high priority) over {wl.info['duration_s']:g} s, capacity "
        f"{capacity:.2f} req/s, {result['meta']['date_utc']} UTC"
    )
    return "\n\n".join([head, wl.info.get("description", ""), table])


# ---- preemption -------------------------------------------------------------------------------


def _tight_args(args: argparse.Namespace) -> argparse.Namespace:
    """The preemption comparison's defaults for what the command line left unset."""
    a = argparse.Namespace(**vars(args))
    a.num_prompts = a.num_prompts or 32
    a.input_len = a.input_len or "fixed:128"
    a.output_len = a.output_len or "fixed:128"
    if not (a.rate or a.concurrency):
        a.rate = float("inf")  # all at once: the most memory pressure
    a.num_gpu_blocks = a.num_gpu_blocks or TIGHT_KV_BLOCKS
    return a


def compare_preemption(args: argparse.Namespace, result: dict, out: Path) -> str:
    from fairbatch.benchmarks import serve_plots

    if args.scenario:
        raise B.UsageError("--compare preemption uses a custom workload: drop --scenario")
    a = _tight_args(args)
    wl = B.custom_workload(a)
    result["workload"] = dict(wl.info, max_drain_s=args.max_drain)
    runs, phases = {}, {}
    for mode in PREEMPTION_MODES:
        engine = B.engine_settings(a, preemption_mode=mode)
        with B.open_target(a, wl.tenants, engine) as target:
            phases[mode] = asyncio.run(
                B.run_phase(target, wl, slo=B.slo_of(args), max_drain_s=args.max_drain)
            )
            result["meta"].update(model=target.model)
        runs[mode] = _phase_record(engine, phases[mode], wl)
    result["runs"] = runs
    rows = []
    for mode, rec in runs.items():
        s = rec["summary"]
        eng = (s.get("server") or {}).get("engine") or {}
        pre, swapped = eng.get("preemptions") or {}, eng.get("swapped_bytes") or {}
        rows.append(
            {
                "mode": mode,
                "num_gpu_blocks": rec["engine"]["num_gpu_blocks"],
                "preemptions_swap": pre.get("swap"),
                "preemptions_recompute": pre.get("recompute"),
                "swapped_out_bytes": swapped.get("out"),
                "swapped_in_bytes": swapped.get("in"),
                "completed": s["throughput"]["completed"],
                "duration_s": s["duration_s"],
                "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
                **{f"ttft_{q}_s": _p(s["requests"]["ttft"], q) for q in ("p50", "p99")},
                **{f"e2e_{q}_s": _p(s["requests"]["e2e"], q) for q in ("p50", "p99")},
                "tpot_p50_s": _p(s["requests"]["tpot"], "p50"),
            }
        )
    result["table"] = rows
    modes = [r["mode"] for r in rows]
    if not args.no_plots:
        result["plots"] = [
            serve_plots.grouped_bars(
                modes,
                {
                    "swap": [r["preemptions_swap"] or 0 for r in rows],
                    "recompute": [r["preemptions_recompute"] or 0 for r in rows],
                },
                out / "preemption_counts.png",
                title="preemptions by kind",
                ylabel="preemptions",
            ),
            serve_plots.grouped_bars(
                modes,
                {"output tok/s": [r["output_tokens_per_s"] for r in rows]},
                out / "preemption_throughput.png",
                title="output throughput",
                ylabel="tokens / s",
            ),
        ]
    table = R.table(
        ["mode", "KV blocks", "preempt swap", "preempt recompute", "swapped out", "swapped in",
         "ok", "time s", "output tok/s", "TTFT p50 ms", "e2e p50 ms", "e2e p99 ms",
         "TPOT p50 ms"],
        [
            [r["mode"], r["num_gpu_blocks"], R.num(r["preemptions_swap"]),
             R.num(r["preemptions_recompute"]), R.mib(r["swapped_out_bytes"]),
             R.mib(r["swapped_in_bytes"]), r["completed"], f"{r['duration_s']:.1f}",
             R.num(r["output_tokens_per_s"]), R.ms(r["ttft_p50_s"]), R.ms(r["e2e_p50_s"]),
             R.ms(r["e2e_p99_s"]), R.ms(r["tpot_p50_s"])]
            for r in rows
        ],
    )  # fmt: skip
    info = wl.info
    head = (
        f"## preemption: {info['num_requests']} requests ({info['process']}, prompts "
        f"{info['input_len']}, outputs {info['output_len']}), max_num_seqs {a.max_num_seqs}, "
        f"{a.num_gpu_blocks} KV blocks of 16 tokens, {result['meta']['date_utc']} UTC"
    )
    return "\n\n".join([head, table])


# ---- summary ----------------------------------------------------------------------------------


def _read_json(path: str | None, what: str) -> Any:
    if not path:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise B.UsageError(f"{what} {path}: {e}") from None


def compare_summary(args: argparse.Namespace, result: dict, out: Path) -> str:
    engine = _read_json(args.engine_json, "--engine-json")
    cluster = _read_json(args.cluster_json, "--cluster-json")
    if engine is None and cluster is None:
        raise B.UsageError("--compare summary needs --engine-json and/or --cluster-json")
    result["engine"], result["cluster"] = engine, cluster
    parts = [f"## engine and cluster benchmarks, summarised ({result['meta']['date_utc']} UTC)"]
    if engine:
        parts.append(
            f"engine (`fairbatch bench engine`, {args.engine_json}): "
            f"{engine.get('num_requests')} requests, prompts {engine.get('prompt_range')}, "
            f"outputs {engine.get('output_range')}, outputs equal to transformers: "
            f"{engine.get('outputs_equal_static')} (static), {engine.get('outputs_equal_cb')} (CB)"
        )
        systems = [
            ("fairbatch", "fairbatch", None),
            ("transformers static batches", "hf_static", "speedup_vs_static"),
            ("transformers continuous batching", "hf_cb", "speedup_vs_cb"),
        ]
        rows = [
            [
                label,
                R.num(engine.get(f"{key}_tok_s")),
                f"{engine.get(ratio, 0):.2f}x" if ratio else "1.00x",
                R.num(engine.get(f"{key}_tok_per_cpu_s")),
            ]
            for label, key, ratio in systems
        ]
        parts.append(
            R.table(["system", "tokens/s", "fairbatch speed-up", "tokens per CPU-s"], rows)
        )
    if cluster:
        rows = [
            [r.get("replicas"), r.get("system"), R.num(r.get("admissions_per_s"), 0),
             f"{r.get('admit_latency_ms_p50', 0):.3f}", f"{r.get('admit_latency_ms_p99', 0):.3f}",
             "-" if r.get("jain_index") is None else f"{r['jain_index']:.4f}",
             R.num(r.get("max_service_diff"), 0), R.num(r.get("vtc_bound"), 0)]
            for r in cluster
        ]  # fmt: skip
        parts.append(f"cluster (`fairbatch bench cluster`, {args.cluster_json}):")
        parts.append(
            R.table(
                [
                    "N",
                    "system",
                    "admissions/s",
                    "admit p50 ms",
                    "admit p99 ms",
                    "Jain",
                    "max diff",
                    "VTC bound",
                ],
                rows,
            )  # fmt: skip
        )
    result["plots"] = []
    return "\n\n".join(parts)
