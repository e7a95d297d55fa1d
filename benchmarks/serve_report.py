"""Text tables for `fairbatch bench serve` results: Markdown, so the terminal output of a run
can be pasted into docs/BENCHMARKS.md as it is. Reads the dicts `serve_metrics.summarize_run`
returns; a missing field shows as "-" (a peer without /admin/stats, a tenant without a
completed request)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; cells are str() of the values."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def ms(seconds: float | None) -> str:
    return (
        "-"
        if seconds is None
        else f"{1e3 * seconds:,.0f}"
        if seconds >= 1
        else f"{1e3 * seconds:.1f}"
    )


def num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}" if isinstance(x, float) else f"{x:,}"


def mib(nbytes: float | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:,.1f} MiB"


def latency_table(summary: dict) -> str:
    lat = summary.get("requests", {})
    rows = []
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = lat.get(name) or {}
        rows.append(
            [name.upper()] + [ms(s.get(k)) for k in ("mean", "p50", "p90", "p99")] + [s.get("n", 0)]
        )
    return table(["latency (ms)", "mean", "p50", "p90", "p99", "n"], rows)


def tenant_table(summary: dict) -> str:
    rows = []
    for name, t in summary.get("tenants", {}).items():
        ttft, e2e = t.get("ttft") or {}, t.get("e2e") or {}
        rows.append(
            [
                name,
                num(t.get("weight"), 1),
                t.get("sent"),
                t.get("completed"),
                t.get("rejected"),
                num(t.get("service"), 0),
                num(t.get("normalized_service"), 0),
                ms(ttft.get("p50")),
                ms(ttft.get("p90")),
                ms(e2e.get("p50")),
            ]
        )
    headers = ["tenant", "weight", "sent", "ok", "rejected", "service", "service/weight"]
    return table(headers + ["TTFT p50 ms", "TTFT p90 ms", "e2e p50 ms"], rows)


def server_line(summary: dict) -> str:
    """The server's counters over the run (fairbatch's /admin/stats), one line."""
    server = summary.get("server") or {}
    eng = server.get("engine")
    if not eng:
        return "server counters: not available (no /admin/stats or no admin key)"
    pre = eng.get("preemptions") or {}
    swapped = eng.get("swapped_bytes") or {}
    return (
        f"server: preemptions swap {pre.get('swap', 0)} / recompute {pre.get('recompute', 0)}; "
        f"swapped out {mib(swapped.get('out'))}, in {mib(swapped.get('in'))}; "
        f"prefix-cache hits {num(eng.get('prefix_hit_tokens'))} tokens; "
        f"rejected {server.get('rejected', '-')}"
    )


def fairness_line(summary: dict) -> str:
    jain = summary.get("jain_index")
    # M in the bound is the tokens a running batch holds; a remote server's is unknown, and
    # the longest output stands in for it (a lower estimate of the bound)
    estimate = (
        ", M = the longest output: a lower estimate"
        if summary.get("vtc_bound_m") == "longest output"
        else ""
    )
    return (
        f"whole run: Jain's index (service/weight) {'-' if jain is None else f'{jain:.4f}'}; "
        f"max weighted service difference between backlogged tenants: "
        f"{num(summary.get('max_service_difference'), 0)} (VTC bound "
        f"{num(summary.get('vtc_bound'), 0)}{estimate})"
    )


def throughput_line(summary: dict) -> str:
    tp = summary.get("throughput", {})
    line = (
        f"{tp.get('completed', 0)} completed, {tp.get('rejected', 0)} rejected, "
        f"{tp.get('failed', 0)} failed in {summary.get('duration_s', 0):.1f} s: "
        f"{num(tp.get('requests_per_s'), 2)} req/s, {num(tp.get('output_tokens_per_s'))} output "
        f"tok/s, {num(tp.get('total_tokens_per_s'))} total tok/s"
    )
    good = summary.get("goodput")
    if good:
        slo = ", ".join(f"{k.removesuffix('_s')} <= {ms(v)} ms" for k, v in good["slo"].items())
        line += f"\ngoodput: {num(good['requests_per_s'], 2)} req/s ({slo})"
    dl = summary.get("deadlines")
    if dl:
        line += (
            f"\nwithin deadline: {dl['met']} of {dl['with_deadline']} "
            f"({dl['timed_out']} timed out, {dl['late']} late): "
            f"{num(dl['goodput_rps'], 2)} req/s over {dl['window_s']:g} s"
        )
    return line


def window_line(window: dict | None) -> str:
    if not window:
        return ""
    shares = ", ".join(f"{n} {100 * x:.1f}%" for n, x in window["share"].items() if x is not None)
    jain = window.get("jain_index")
    return (
        f"until t = {window['t_end_s']:g} s (the arrivals): service shares {shares}; "
        f"Jain's index (service/weight) {'-' if jain is None else f'{jain:.4f}'}"
    )


def format_run(result: dict) -> str:
    meta, wl, summary = result["meta"], result["workload"], result["summary"]
    what = wl.get("scenario") or f"{wl.get('process')} workload"
    if wl.get("concurrency"):
        what = f"fixed-concurrency ({wl['concurrency']}) workload"
    head = (
        f"## {what}: {wl.get('num_requests')} requests, {meta.get('date_utc')} UTC, "
        f"{meta.get('target')} {meta.get('model')}"
    )
    if wl.get("capacity_rps"):
        head += f", capacity {wl['capacity_rps']:.2f} req/s"
    return "\n\n".join(
        [
            head,
            throughput_line(summary),
            latency_table(summary),
            tenant_table(summary),
            fairness_line(summary),
            window_line(result.get("window")),
            server_line(summary),
        ]
    )
