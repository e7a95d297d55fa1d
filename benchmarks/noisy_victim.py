"""`fairbatch bench serve --workload noisy-victim`: one noisy tenant beside one quiet tenant.

The simplest multi-tenant case a user meets, against the server they would otherwise run:

* `noisy` keeps `--concurrency` (default 48) streaming completions in flight for `--duration`
  seconds, lengths from `--input-len` (default uniform:12-96) and `--output-len` (default
  uniform:16-128: seats free one at a time; `fixed:N` frees them in waves);
* `victim` sends short requests (48 tokens in, 16 out) as a Poisson stream of `--rate`
  (default 0.3) per second over the same time.

Servers (replay_bench.server_plans): `fairbatch serve --replicas 1`, the two tenants keyed, equal
weights, no labels; with `--peer vllm`, `vllm serve` with `fcfs` and with `priority` (the victim
labelled to run first). Same checkpoint, dtype, seats, token budget and KV capacity. On each:
a warm-up, the victim's idle latency (three requests alone), then the run. `--rounds N` starts
every server N times, the order alternated, and reports medians.

Per server: the victim's TTFT idle and under load (p50, p90, max), its end-to-end p50, the share
of its requests within the SLO (TTFT and TPOT within `--slo-factor` times the lowest idle values
any server showed), and the total output tokens/s of completed requests over the run, with its
ratio to the first server's. OUT/result.json holds every round's rows and the medians.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fairbatch.benchmarks.serve_bench import tenant_key
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec
from fairbatch.benchmarks.serve_workload import LengthDist, TextMaker, gap_sampler

NOISY, VICTIM = "noisy", "victim"
VICTIM_PROMPT, VICTIM_OUTPUT = 48, 16
DRAIN_S = 300.0  # the longest a request started before the end may still run


@dataclasses.dataclass(frozen=True)
class Workload:
    duration_s: float
    noisy_streams: int
    noisy_input: LengthDist
    noisy_output: LengthDist
    victim_rate: float
    seed: int = 0

    @staticmethod
    def from_args(args: argparse.Namespace) -> Workload:
        from fairbatch.benchmarks.serve_workload import parse_lengths

        return Workload(
            duration_s=args.duration,
            noisy_streams=args.concurrency or 48,
            noisy_input=args.input_len or parse_lengths("uniform:12-96"),
            noisy_output=args.output_len or parse_lengths("uniform:16-128"),
            victim_rate=args.rate or 0.3,
            seed=args.seed,
        )

    def victim_specs(self) -> list[RequestSpec]:
        """The victim's Poisson arrivals in [0, duration), each VICTIM_PROMPT in, VICTIM_OUTPUT
        out. The same for a seed."""
        rng = random.Random(f"victim-{self.seed}")
        maker, next_gap = TextMaker(), gap_sampler(self.victim_rate, "poisson", 1.0, rng)
        specs, t = [], next_gap()
        while t < self.duration_s:
            prompt = maker.make(VICTIM_PROMPT, rng)
            specs.append(RequestSpec(len(specs), VICTIM, t, prompt, VICTIM_PROMPT, VICTIM_OUTPUT))
            t += next_gap()
        return specs

    def noisy_spec(self, k: int) -> RequestSpec:
        """The noisy tenant's k-th request (its lengths and text depend only on k and the seed)."""
        rng = random.Random(f"noisy-{self.seed}-{k}")
        n_in, n_out = self.noisy_input.sample(rng), self.noisy_output.sample(rng)
        return RequestSpec(k, NOISY, 0.0, TextMaker().make(n_in, rng), n_in, n_out)


async def drive(
    url: str, model: str, w: Workload, priority: Callable[[str], int] | None = None
) -> tuple[list[RequestResult], list[RequestResult], float]:
    """Run the workload against `url`: (victim results, noisy results, seconds from the start
    to the end of the last request). The noisy streams stop sending at `duration_s`; what they
    have in flight then runs to its end. `priority` (tenant -> value): sent as the requests'
    `priority` field; None sends none."""
    import httpx

    from fairbatch.benchmarks.serve_client import send_one

    send_priority = priority is not None
    victims = w.victim_specs()
    if priority is not None:
        victims = [dataclasses.replace(s, priority=priority(VICTIM)) for s in victims]
    keys = {NOISY: tenant_key(NOISY), VICTIM: tenant_key(VICTIM)}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=w.noisy_streams + 16)
    noisy: list[RequestResult] = []
    counter = iter(range(10**9))
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(DRAIN_S)) as client:
        t0 = time.perf_counter()

        def send(spec: RequestSpec):
            return send_one(
                client, url, spec, model=model, api_key=keys[spec.tenant], t0=t0,
                timeout_s=DRAIN_S, send_priority=send_priority, send_deadlines=False,
            )  # fmt: skip

        async def stream() -> None:
            while time.perf_counter() - t0 < w.duration_s:
                spec = w.noisy_spec(next(counter))
                if priority is not None:
                    spec = dataclasses.replace(spec, priority=priority(NOISY))
                noisy.append(await send(spec))

        async def victim(spec: RequestSpec) -> RequestResult:
            await asyncio.sleep(max(0.0, spec.arrival_s - (time.perf_counter() - t0)))
            return await send(spec)

        streams = [asyncio.create_task(stream()) for _ in range(w.noisy_streams)]
        victim_results = await asyncio.gather(*(victim(s) for s in victims))
        await asyncio.gather(*streams)
        duration = time.perf_counter() - t0
    return list(victim_results), noisy, duration


# -- the report ----------------------------------------------------------------------------------


def summarize(
    victim: list[RequestResult],
    noisy: list[RequestResult],
    duration_s: float,
    idle: dict[str, float],
    slo: dict[str, float],
) -> dict[str, Any]:
    """One server's row: the victim's latency against its idle latency and the SLO, and the
    output tokens/s of every completed request over the run."""
    from fairbatch.benchmarks.serve_metrics import output_tokens, percentile, tpot

    ok = [r for r in victim if r.ok and r.ttft_s is not None]
    ttfts = [r.ttft_s for r in ok]
    within = [
        r for r in ok if r.ttft_s <= slo["ttft_s"] and (tpot(r) or 0.0) <= slo["tpot_s"]
    ]  # fmt: skip
    done = [r for r in victim + noisy if r.ok]

    def pct(q: float) -> float | None:
        return percentile(ttfts, q) if ttfts else None

    return {
        "victim_sent": len(victim),
        "victim_ok": len(ok),
        "victim_ttft_idle_s": idle["ttft_s"],
        "victim_ttft_p50_s": pct(50),
        "victim_ttft_p90_s": pct(90),
        "victim_ttft_max_s": max(ttfts) if ttfts else None,
        "victim_e2e_p50_s": statistics.median(r.e2e_s for r in ok) if ok else None,
        "victim_slo_attainment": len(within) / len(victim) if victim else None,
        "noisy_completed": sum(1 for r in noisy if r.ok),
        "failed": sum(1 for r in victim + noisy if not r.ok),
        "output_tokens_per_s": sum(output_tokens(r) for r in done) / duration_s,
        "duration_s": duration_s,
    }


def combine(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per server, the median of each number over the rounds (None where every round had
    none), and the output tokens/s ratio to the first server taken within each round."""
    first = next(iter(rounds[0]))
    out: dict[str, dict[str, Any]] = {}
    for server in rounds[0]:
        rows = [r[server] for r in rounds]
        med = {}
        for key in rows[0]:
            values = [row[key] for row in rows if row[key] is not None]
            med[key] = statistics.median(values) if values else None
        ratios = [
            r[server]["output_tokens_per_s"] / r[first]["output_tokens_per_s"] for r in rounds
        ]
        med["throughput_ratio"] = statistics.median(ratios)
        med["throughput_ratio_range"] = [min(ratios), max(ratios)]
        out[server] = med
    return out


def format_table(combined: dict[str, dict[str, Any]], first: str) -> str:
    from fairbatch.benchmarks.serve_report import table

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    head = [
        "server", "victim TTFT idle s", "p50 s", "p90 s", "max s", "victim e2e p50 s",
        "victim in SLO %", "output tok/s", f"x {first}", "failed",
    ]  # fmt: skip
    rows = []
    for name, r in combined.items():
        att = r["victim_slo_attainment"]
        rows.append([
            name, s(r["victim_ttft_idle_s"]), s(r["victim_ttft_p50_s"]), s(r["victim_ttft_p90_s"]),
            s(r["victim_ttft_max_s"]), s(r["victim_e2e_p50_s"]),
            "-" if att is None else f"{100 * att:.0f}", f"{r['output_tokens_per_s']:.1f}",
            f"{r['throughput_ratio']:.2f}", f"{r['failed']:g}",
        ])  # fmt: skip
    return table(head, rows)


# -- the command ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import replay_bench as rb
    from fairbatch.benchmarks import serve_bench as B
    from fairbatch.benchmarks.peer.serve import round_order

    w = Workload.from_args(args)
    out = B.out_dir(args)
    result: dict[str, Any] = {"kind": "noisy_victim", "meta": B.meta(args)}
    result["workload"] = {
        "duration_s": w.duration_s,
        "noisy_streams": w.noisy_streams,
        "noisy_input": dataclasses.asdict(w.noisy_input),
        "noisy_output": dataclasses.asdict(w.noisy_output),
        "victim_rate": w.victim_rate,
        "victim_lengths": [VICTIM_PROMPT, VICTIM_OUTPUT],
        "seed": w.seed,
    }
    raw: list[dict[str, dict]] = []  # per round: server -> (victim, noisy, duration, idle)
    with tempfile.TemporaryDirectory(prefix="fairbatch-noisy-") as tmp:
        plans, result["engine"] = rb.server_plans(args, [NOISY, VICTIM], [NOISY], Path(tmp))
        names = [p.label for p in plans]
        for k in range(args.rounds):
            by_label = {p.label: p for p in plans}
            raw.append({})
            for label in round_order(names, k):
                plan = by_label[label]
                print(f"round {k + 1}: {label}", file=sys.stderr, flush=True)
                raw[-1][label] = measure(plan, w, args)
    idle_best = {
        key: min(r[s]["idle"][key] for r in raw for s in r) for key in ("ttft_s", "tpot_s")
    }
    slo = {key: args.slo_factor * v for key, v in idle_best.items()}
    rounds = [
        {
            s: summarize(r[s]["victim"], r[s]["noisy"], r[s]["duration_s"], r[s]["idle"], slo)
            for s in names
        }
        for r in raw
    ]
    result["slo"] = slo
    result["rounds"] = rounds
    result["servers"] = combine(rounds)
    text = format_table(result["servers"], names[0])
    wrote = B.write_results(args, out, result)
    print(text)
    print(f"\nwrote {wrote}")
    return 0


def measure(plan: Any, w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Start the server, warm it up, probe the victim's idle latency, run the workload."""
    from fairbatch.benchmarks import replay_bench as rb

    with plan.start() as url:
        model = asyncio.run(rb.served_model(url, args))
        warm = [dataclasses.replace(w.noisy_spec(-1 - k), arrival_s=0.0) for k in range(4)]
        asyncio.run(rb.replay_once(url, model, warm, send_priority=False, drain_s=600))
        idle = asyncio.run(rb.idle_latency(url, model, w.victim_specs(), [VICTIM]))[VICTIM]
        victim, noisy, duration = asyncio.run(drive(url, model, w, plan.priority))
    print(
        f"  {plan.label}: victim TTFT p50 "
        f"{statistics.median([r.ttft_s for r in victim if r.ok] or [float('nan')]):.2f} s, "
        f"{sum(1 for r in victim + noisy if r.ok)} ok, {duration:.0f} s",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return {"victim": victim, "noisy": noisy, "duration_s": duration, "idle": idle}
