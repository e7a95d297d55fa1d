"""`fairbatch bench serve --workload servegen`: real tenants' traffic against fairbatch and vLLM.

One command replays the same ServeGen tenants (benchmarks/servegen.py) against each server, at
one or more loads, and reports per tenant what it got (benchmarks/tenant_slo.py):

1. Servers: `fairbatch serve --replicas 1` on --checkpoint (its tenants keyed, equal weights,
   no labels, the default limits a user gets); with --without-fair-preemption, also the same
   server with the controller's fair preemption off ("fairbatch-nofp"); with `--peer vllm`,
   also `vllm serve` with its
   `fcfs` policy and with its `priority` policy (the tail tenants labelled: priority 0, the
   heavy ones 1; vLLM runs lower first). Same checkpoint, dtype, seats, token budget and KV
   capacity (benchmarks/peer/serve.py); each server alone on the machine. With --url: that
   server only.
2. On each server: a warm-up, then each tenant's idle latency (three requests one at a time,
   the tenant's median prompt, 16 output tokens), then the replay at each --loads multiple.
3. Capacity: the first server's (vLLM fcfs with --peer), from a closed loop of the replay's own
   requests at --max-num-seqs in flight, in VTC cost per second, unless --capacity gives it
   (requests/s of the replay's mix). `rate_scale` then makes the replay offer load x capacity.
4. SLO per tenant: TTFT <= --slo-factor x its idle TTFT and TPOT <= the factor x the idle
   TPOT, the idle figures the lowest any server showed (one objective for every server);
   --slo-ttft / --slo-tpot (ms) override.

OUT/result.json: the command, the replay (clients, span, scales), capacity, each server's idle
latency, and per load and server `tenant_slo.tenant_slos` plus throughput; PNG plots per load.
OUT/runs.jsonl keeps every request's result as each run ends; `--reanalyze` rebuilds the report
from it without the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fairbatch.benchmarks import servegen as sg
from fairbatch.benchmarks import tenant_slo
from fairbatch.benchmarks.serve_bench import tenant_key
from fairbatch.benchmarks.serve_types import RequestResult, RequestSpec

IDLE_REPS, IDLE_OUTPUT = 3, 16
CALIBRATION_REQUESTS = 96
WARMUP = 4
HEAVY_PRIORITY, TAIL_PRIORITY = 1, 0  # vLLM's priority policy runs lower values first


@dataclasses.dataclass
class Mix:
    """The replay at rate_scale 1: its clients, their class, and its expected mean cost."""

    clients: dict[str, sg.Client]
    replay: sg.Replay
    heavy: list[str]
    tail: list[str]

    @property
    def tenants(self) -> list[str]:
        return self.heavy + self.tail

    def at(self, cost_per_s: float) -> sg.Replay:
        """The replay rescaled to offer `cost_per_s` (VTC cost per replay second)."""
        base = sg.offered_cost_per_s(self.clients, self.replay)
        return dataclasses.replace(self.replay, rate_scale=cost_per_s / base)

    def sample(self, n: int, seed: str) -> list[RequestSpec]:
        """About `n` requests of the mix (a replay of its own seed, not the measured one's)."""
        replay = self.at(n * self.mean_cost() / self.replay.duration_s)
        return sg.build_replay(self.clients, dataclasses.replace(replay, seed=seed))

    def mean_cost(self) -> float:
        """Expected VTC cost of one request of the mix."""
        n = sum(self.clients[c].requests_in(self.replay.span) for c in self.tenants)
        cost = sum(
            self.clients[c].cost_in(self.replay.span, self.replay.caps) for c in self.tenants
        )
        return cost / n


def build_mix(args: argparse.Namespace) -> Mix:
    """The clients, span and scales of the command line (rate_scale 1)."""
    caps = sg.LengthCaps(args.max_input_len, args.max_output_len)
    clients = sg.load_clients(args.servegen_dir)
    if args.servegen_span:
        start, _, n = args.servegen_span.partition(":")
        span = range(int(start), int(start) + int(n or 6))
    else:
        span = sg.busiest_span(clients, 6, caps)
    if args.servegen_clients:
        names = args.servegen_clients.split(",")
        unknown = [n for n in names if n not in clients]
        if unknown:
            raise ValueError(f"unknown clients {unknown}; the directory has {sorted(clients)}")
        ranked = sorted(names, key=lambda n: -clients[n].cost_in(span, caps))
        heavy, tail = ranked[: args.heavy], ranked[args.heavy :]
    else:
        heavy, tail = sg.pick_clients(
            clients, span, caps, heavy=args.heavy, tail=args.tail, seed=args.seed
        )
    time_scale = len(span) * sg.WINDOW_S / args.duration
    replay = sg.Replay(tuple(heavy + tail), span, time_scale, 1.0, caps, args.seed)
    return Mix(clients, replay, heavy, tail)


# -- measuring one server ------------------------------------------------------------------------


async def idle_latency(
    url: str, model: str, specs: Sequence[RequestSpec], tenants: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Per tenant: median TTFT and TPOT of IDLE_REPS requests sent one at a time, each the
    tenant's median prompt length with IDLE_OUTPUT tokens out."""
    from fairbatch.benchmarks.serve_client import run_requests
    from fairbatch.benchmarks.serve_metrics import tpot
    from fairbatch.benchmarks.serve_workload import TextMaker

    maker, rng, out = TextMaker(), random.Random("idle"), {}
    for t in tenants:
        lens = sorted(s.prompt_len for s in specs if s.tenant == t) or [64]
        n = lens[len(lens) // 2]
        probes = [
            RequestSpec(k, t, 0.0, maker.make(n, rng), n, IDLE_OUTPUT) for k in range(IDLE_REPS)
        ]
        results, _ = await run_requests(
            url, probes, model=model, keys={t: tenant_key(t)}, max_concurrency=1, progress=False
        )
        ok = [r for r in results if r.ok and r.ttft_s is not None]
        if not ok:
            raise RuntimeError(f"idle probe of {t} failed: {results[0].error}")
        out[t] = {
            "prompt_len": n,
            "ttft_s": statistics.median(r.ttft_s for r in ok),
            "tpot_s": statistics.median(tpot(r) or 0.0 for r in ok),
        }
    return out


async def capacity_cost(url: str, model: str, specs: Sequence[RequestSpec], seats: int) -> float:
    """VTC cost per second the server sustains on `specs` in a closed loop of `seats`:
    the cost of what completed before the last send, over the time of the last send."""
    from fairbatch.benchmarks.serve_client import run_requests
    from fairbatch.benchmarks.serve_workload import OUTPUT_WEIGHT, PROMPT_WEIGHT

    keys = {s.tenant: tenant_key(s.tenant) for s in specs}
    results, _ = await run_requests(
        url, specs, model=model, keys=keys, max_concurrency=seats, progress=False
    )
    last_send = max(r.send_s for r in results)
    done = [r for r in results if r.ok and r.end_s <= last_send]
    if not done or last_send <= 0:
        raise RuntimeError("capacity calibration: nothing completed before the last send")
    cost = sum(PROMPT_WEIGHT * r.spec.prompt_len + OUTPUT_WEIGHT * r.spec.max_tokens for r in done)
    return cost / last_send


async def replay_once(
    url: str, model: str, specs: Sequence[RequestSpec], *, send_priority: bool, drain_s: float
) -> tuple[list[RequestResult], float]:
    from fairbatch.benchmarks.serve_client import run_requests

    keys = {s.tenant: tenant_key(s.tenant) for s in specs}
    deadline = max((s.arrival_s for s in specs), default=0.0) + drain_s
    return await run_requests(
        url, specs, model=model, keys=keys, send_priority=send_priority, send_deadlines=False,
        deadline_s=deadline, progress=False,
    )  # fmt: skip


# -- servers -------------------------------------------------------------------------------------


@dataclasses.dataclass
class ServerPlan:
    label: str
    start: Callable[[], contextlib.AbstractContextManager[str]]  # -> its base URL
    priority: Callable[[str], int] | None  # tenant -> the `priority` field, None: not sent


def server_plans(
    args: argparse.Namespace, tenants: Sequence[str], heavy: Sequence[str], work: Path
) -> tuple[list[ServerPlan], dict]:
    """The servers of this command and the engine settings they share. `heavy`: the tenants
    vLLM's priority policy gets labelled to run after the others."""
    if args.url:
        url = args.url.rstrip("/")
        return [ServerPlan("target", lambda: contextlib.nullcontext(url), None)], {}
    from fairbatch.benchmarks.checkpoints import resolve_model
    from fairbatch.benchmarks.peer import serve as peer

    model_dir = resolve_model(args.checkpoint or peer.DEFAULT_CHECKPOINT, args.dtype)
    eng = peer.engine_settings(args, model_dir)
    keys = {t: tenant_key(t) for t in tenants}

    def fairbatch(**controller: Any) -> Callable[[], contextlib.AbstractContextManager[str]]:
        return lambda: peer.fairbatch_server(
            model_dir, eng, peer.free_port(), work, tenants=keys, controller=controller
        )

    plans = [ServerPlan("fairbatch", fairbatch(), None)]
    if args.without_fair_preemption:
        plans.append(ServerPlan("fairbatch-nofp", fairbatch(fair_preemption=False), None))
    if args.peer:
        from fairbatch.benchmarks.peer.process import check_peer_python

        python = check_peer_python(args.peer_python)
        heavy_set = set(heavy)

        def vllm(policy: str) -> Callable[[], contextlib.AbstractContextManager[str]]:
            log = work / f"vllm-{policy}.log"
            return lambda: peer.vllm_server(
                python, model_dir, eng, peer.free_port(), log, policy=policy
            )

        plans = [
            ServerPlan("vllm-fcfs", vllm("fcfs"), None),
            ServerPlan(
                "vllm-priority",
                vllm("priority"),
                lambda t: HEAVY_PRIORITY if t in heavy_set else TAIL_PRIORITY,
            ),
            *plans,
        ]
    return plans, {"checkpoint": str(model_dir), **eng}


def prioritized(specs: Sequence[RequestSpec], priority: Callable[[str], int] | None):
    if priority is None:
        return list(specs)
    return [dataclasses.replace(s, priority=priority(s.tenant)) for s in specs]


# -- the command ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import serve_bench as B

    mix = build_mix(args)
    result: dict[str, Any] = {"kind": "replay", "meta": B.meta(args)}
    result["replay"] = {
        "dir": str(args.servegen_dir),
        "heavy": mix.heavy,
        "tail": mix.tail,
        "span_windows": [mix.replay.span.start, mix.replay.span.stop],
        "duration_s": mix.replay.duration_s,
        "time_scale": mix.replay.time_scale,
        "caps": dataclasses.asdict(mix.replay.caps),
        "seed": args.seed,
        "mean_cost": mix.mean_cost(),
    }
    if args.sim_replicas:
        return run_sim(args, mix, result)
    out = B.out_dir(args)
    if args.reanalyze:
        capacity, idle, runs = load_runs(out)
    else:
        capacity, idle, runs = measure(args, mix, result, out)
    result["capacity_cost_per_s"] = capacity
    result["capacity_rps"] = capacity / mix.mean_cost()
    result["idle"] = idle
    slos = slos_for(args, idle, mix.tenants)
    result["slo"] = {t: dataclasses.asdict(s) for t, s in slos.items()}
    result["loads"] = {
        load: {
            label: report(run["results"], run["duration_s"], slos, mix.replay.duration_s)
            for label, run in by_server.items()
        }
        for load, by_server in runs.items()
    }
    result["plots"] = [] if args.no_plots else plots(runs, mix, out)
    text = format_tables(result, mix)
    rows = [
        {"load": load, "server": label, **row}
        for load, by_server in runs.items()
        for label, run in by_server.items()
        for row in B.request_rows(run["results"])
    ]
    result["requests"] = rows
    wrote = B.write_results(args, out, result)
    print(text)
    print(f"\nwrote {wrote}")
    return 0


def measure(
    args: argparse.Namespace, mix: Mix, result: dict, out: Path
) -> tuple[float, dict, dict]:
    """Start each server, calibrate (once), probe idle latency, replay each load. Each run's
    results are appended to OUT/runs.jsonl as it ends (`--reanalyze` reads them back)."""
    capacity = args.capacity * mix.mean_cost() if args.capacity else None
    runs: dict[str, dict] = {}
    idle: dict[str, dict] = {}
    saved = out / RUNS_FILE
    saved.write_text("")
    with tempfile.TemporaryDirectory(prefix="fairbatch-replay-") as tmp:
        plans, engine = server_plans(args, mix.tenants, mix.heavy, Path(tmp))
        result["engine"] = engine
        for plan in plans:
            print(f"starting {plan.label}", file=sys.stderr, flush=True)
            with plan.start() as url:
                model = asyncio.run(served_model(url, args))
                warm = [
                    dataclasses.replace(s, arrival_s=0.0) for s in mix.sample(4 * WARMUP, "warm-up")
                ]
                asyncio.run(
                    replay_once(url, model, warm[:WARMUP], send_priority=False, drain_s=600)
                )
                if capacity is None:
                    capacity = asyncio.run(_calibrate(url, model, mix, args.max_num_seqs))
                    print(f"capacity {capacity:.0f} cost/s on {plan.label}", file=sys.stderr)
                idle[plan.label] = asyncio.run(
                    idle_latency(url, model, sg.build_replay(mix.clients, mix.at(capacity)),
                                 mix.tenants)
                )  # fmt: skip
                _append(saved, {"capacity": capacity, "idle": {plan.label: idle[plan.label]}})
                for load in loads_of(args):
                    specs = prioritized(
                        sg.build_replay(mix.clients, mix.at(load * capacity)), plan.priority
                    )
                    t = time.monotonic()
                    results, duration = asyncio.run(
                        replay_once(url, model, specs, send_priority=plan.priority is not None,
                                    drain_s=args.max_drain or 60.0)
                    )  # fmt: skip
                    runs.setdefault(f"{load:g}", {})[plan.label] = {
                        "results": results,
                        "duration_s": duration,
                    }
                    _append(saved, {"load": f"{load:g}", "server": plan.label,
                                    "duration_s": duration,
                                    "results": [_result_row(r) for r in results]})  # fmt: skip
                    print(f"  {plan.label} at {load:g}x: {len(specs)} requests, "
                          f"{time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    assert capacity is not None
    return capacity, idle, runs


RUNS_FILE = "runs.jsonl"


def loads_of(args: argparse.Namespace) -> list[float]:
    return [float(x) for x in args.loads.split(",")]


def _append(path: Path, record: dict) -> None:
    import json

    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def _result_row(r: RequestResult) -> dict:
    """A result as JSON, its spec without the prompt text."""
    row = dataclasses.asdict(r)
    row["spec"] = {k: v for k, v in row["spec"].items() if k != "prompt"}
    return row


def load_runs(out: Path) -> tuple[float, dict, dict]:
    """What `measure` saved in OUT/runs.jsonl: capacity, idle latency, runs."""
    import json

    capacity, idle, runs = None, {}, {}
    path = out / RUNS_FILE
    if not path.exists():
        raise FileNotFoundError(f"--reanalyze: no {path} (run without --reanalyze first)")
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "capacity" in rec:
            capacity = rec["capacity"]
            idle.update(rec["idle"])
            continue
        results = []
        for row in rec["results"]:
            spec = RequestSpec(prompt="", **row.pop("spec"))
            results.append(RequestResult(spec=spec, **row))
        runs.setdefault(rec["load"], {})[rec["server"]] = {
            "results": results,
            "duration_s": rec["duration_s"],
        }
    if capacity is None:
        raise ValueError(f"{path} holds no capacity record")
    return capacity, idle, runs


def run_sim(args: argparse.Namespace, mix: Mix, result: dict) -> int:
    """The replay on simulated GPU replicas (replay_sim.py), at the trace's own rates."""
    from fairbatch.benchmarks import replay_sim
    from fairbatch.benchmarks import serve_bench as B

    sizes = [int(x) for x in args.sim_replicas.split(",")]
    result["kind"] = "replay_sim"
    result["sim"] = replay_sim.run(mix, sizes, args.sim_rate_scale, args.slo_factor)
    text = replay_sim.format_table(result["sim"], mix)
    wrote = B.write_results(args, B.out_dir(args), result)
    print(text)
    print(f"\nwrote {wrote}")
    return 0


async def served_model(url: str, args: argparse.Namespace) -> str:
    from fairbatch.benchmarks.serve_client import probe

    return args.model or await probe(url, args.api_key) or "bench-model"


async def _calibrate(url: str, model: str, mix: Mix, seats: int) -> float:
    pool = mix.sample(2 * CALIBRATION_REQUESTS, "calibration")
    sample = random.Random("calibration").sample(pool, min(CALIBRATION_REQUESTS, len(pool)))
    if len(sample) < 2 * seats:
        raise RuntimeError(f"the mix gave {len(sample)} requests to calibrate on")
    return await capacity_cost(url, model, sample, seats)


def slos_for(
    args: argparse.Namespace, idle: dict[str, dict], tenants: Sequence[str]
) -> dict[str, tenant_slo.Slo]:
    """Each tenant's objective: the factor times the lowest idle latency any server showed."""
    out = {}
    best_tpot = min(v[t]["tpot_s"] for v in idle.values() for t in tenants)
    for t in tenants:
        best_ttft = min(v[t]["ttft_s"] for v in idle.values())
        ttft = args.slo_ttft / 1e3 if args.slo_ttft else args.slo_factor * best_ttft
        tpot = args.slo_tpot / 1e3 if args.slo_tpot else args.slo_factor * best_tpot
        out[t] = tenant_slo.Slo(ttft, tpot)
    return out


def report(
    results: list[RequestResult], duration_s: float, slos: dict, t_end: float
) -> dict[str, Any]:
    from fairbatch.benchmarks.serve_metrics import throughput

    return {
        **tenant_slo.tenant_slos(results, slos, t_end),
        "throughput": throughput(results, duration_s),
        "duration_s": duration_s,
    }


def format_tables(result: dict, mix: Mix) -> str:
    from fairbatch.benchmarks.serve_report import table

    lines = []
    heavy = set(mix.heavy)
    for load, by_server in result["loads"].items():
        servers = list(by_server)
        lines.append(f"\n## load {load}x capacity ({result['capacity_rps']:.2f} req/s of the mix)")
        head = ["tenant", "class", "sent"] + [
            f"{s} {c}" for s in servers for c in ("TTFT p99 s", "SLO %", "refused", "share")
        ]
        rows = []
        for t in mix.tenants:
            first = by_server[servers[0]]["tenants"].get(t, {})
            row = [t, "heavy" if t in heavy else "tail", first.get("sent", 0)]
            for s in servers:
                r = by_server[s]["tenants"].get(t)
                if r is None:
                    row += ["-"] * 4
                    continue
                row += [
                    _f(r["ttft_p99_s"], 2),
                    _f(None if r["attainment"] is None else 100 * r["attainment"], 0),
                    r["refused"],
                    _f(r["share_ratio"], 2),
                ]
            rows.append(row)
        lines.append(table(head, rows))
        summary = [
            ["goodput req/s"] + [_f(by_server[s]["goodput_rps"], 2) for s in servers],
            ["SLO attainment %"]
            + [_f(100 * (by_server[s]["attainment"] or 0), 1) for s in servers],
            ["output tok/s"]
            + [_f(by_server[s]["throughput"]["output_tokens_per_s"], 1) for s in servers],
            ["total tok/s"]
            + [_f(by_server[s]["throughput"]["total_tokens_per_s"], 1) for s in servers],
            ["Jain (backlogged)"] + [_f(by_server[s]["jain_backlogged"], 3) for s in servers],
            ["max service diff, 60 s"]
            + [_f(by_server[s]["max_service_difference_window"], 0) for s in servers],
            ["refused"] + [by_server[s]["throughput"]["rejected"] for s in servers],
            ["failed / cut off"] + [by_server[s]["throughput"]["failed"] for s in servers],
        ]
        lines.append("")
        lines.append(table(["run"] + servers, summary))
    return "\n".join(lines)


def _f(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plots(runs: dict[str, dict[str, dict]], mix: Mix, out: Path) -> list[str]:
    """Per load: each tenant's TTFT p99 per server (log scale)."""
    from fairbatch.benchmarks.serve_metrics import percentile
    from fairbatch.benchmarks.serve_plots import grouped_bars

    paths = []
    for load, by_server in runs.items():
        series = {}
        for label, run in by_server.items():
            series[label] = []
            for t in mix.tenants:
                ttfts = [
                    r.ttft_s
                    for r in run["results"]
                    if r.spec.tenant == t and r.ok and r.ttft_s is not None
                ]
                series[label].append(percentile(ttfts, 99) if ttfts else None)
        paths.append(
            grouped_bars(
                mix.tenants,
                series,
                out / f"ttft_p99_load{load}.png",
                title=f"TTFT p99 per tenant at {load}x capacity",
                ylabel="s",
                log=True,
            )  # fmt: skip
        )
    return paths
