"""`fairbatch bench`: the benchmarks' command line (`add_parser` registers it on the `fairbatch`
CLI, deployments/cli.py). Each subcommand imports its benchmark lazily, so parsing needs only
the standard library (no torch, no ray)."""

from __future__ import annotations

import argparse
import sys


def _bench_scheduler(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import scheduler_bench

    policies = args.policies.split(",") if args.policies else scheduler_bench.POLICIES
    unknown = [p for p in policies if p not in scheduler_bench.POLICIES]
    if unknown:
        print(
            f"fairbatch bench scheduler: unknown policies {unknown}; "
            f"valid: {', '.join(scheduler_bench.POLICIES)}",
            file=sys.stderr,
        )
        return 2
    if args.rounds < 1 or args.steps < 1:
        print("fairbatch bench scheduler: --rounds and --steps must be >= 1", file=sys.stderr)
        return 2
    scheduler_bench.main(args.json, steps=args.steps, policies=policies, rounds=args.rounds)
    return 0


def _bench_inputs(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import step_inputs_bench

    step_inputs_bench.main(args.json, contexts=tuple(args.contexts), reps=args.reps)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    if args.structured:  # the grammar masks' step-time cost instead
        from fairbatch.benchmarks import structured_bench

        structured_bench.main(args.json, device=args.device)
        return 0
    if args.peer:
        from fairbatch.benchmarks.peer import offline

        args.num_requests = args.num_requests or 32
        return offline.main(args)
    from fairbatch.benchmarks import engine_bench

    engine_bench.main(
        args.json,
        model=args.model,
        num_requests=args.num_requests or 128,
        prompt_range=(args.min_prompt, args.max_prompt),
        output_range=(args.min_output, args.max_output),
        skip_cb=args.skip_cb,
    )
    return 0


def _bench_lora(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import lora_bench

    lora_bench.main(
        args.json,
        model=args.model,
        num_requests=args.num_requests,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs,
        rounds=args.rounds,
        device=args.device,
        adapter_counts=args.adapters,
    )
    return 0


def _bench_cluster(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import cluster_bench

    systems = args.systems.split(",") if args.systems else None
    if args.autoscale:
        from fairbatch.benchmarks import autoscale_bench

        duration = args.duration if args.duration != 12.0 else 240.0
        autoscale_bench.main(args.json, max(args.replicas), duration)
        return 0
    if args.workload == "shared_prefix":
        from fairbatch.benchmarks import locality_bench

        locality_bench.main(args.json, args.replicas, systems, args.duration, args.load, args.shift)
        return 0
    cluster_bench.main(
        args.json,
        replicas=args.replicas,
        systems=systems,
        duration_s=args.duration,
        with_ray=args.ray,
    )
    return 0


def _bench_conversation(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import conversation_bench

    if args.engine == "sim":
        conversation_bench.main_sim(args)
    else:
        conversation_bench.main_model(args)
    return 0


def _bench_serve(args: argparse.Namespace) -> int:
    if args.workload == "noisy-victim":
        from fairbatch.benchmarks import noisy_victim

        return noisy_victim.run(args)
    if args.workload == "servegen":
        from fairbatch.benchmarks import replay_bench

        if not args.servegen_dir:
            args.parser.error("--workload servegen needs --servegen-dir DIR (ServeGen's data)")

        try:
            return replay_bench.run(args)
        except (ValueError, FileNotFoundError) as e:
            args.parser.error(str(e))
    if args.peer:
        from fairbatch.benchmarks.peer import serve as peer_serve

        return peer_serve.run(args)
    from fairbatch.benchmarks import serve_bench

    return serve_bench.main(args)


# ---- bench serve: argument types (workload specs are checked by serve_workload, lazily) -------


def _arg_error(fn):
    """Turn a ValueError from `fn` into an argparse error (exit code 2, one line)."""

    def convert(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = fn.__name__  # argparse names the type in its message
    return convert


def _positive(kind: type):
    def positive(text: str):
        value = kind(text)
        if not value > 0:
            raise ValueError(f"must be > 0, got {text}")
        return value

    positive.__name__ = f"positive {kind.__name__}"
    return _arg_error(positive)


@_arg_error
def _length_spec(text: str) -> str:
    from fairbatch.benchmarks.serve_workload import parse_lengths

    parse_lengths(text)
    return text


@_arg_error
def _shared_prefix(text: str) -> tuple[int, int]:
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"expected GROUPS,PREFIX_LEN (two positive integers), got {text!r}")
    return int(parts[0]), int(parts[1])


@_arg_error
def _tenant_list(text: str) -> list[dict]:
    """NAME[:WEIGHT[:PRIORITY[:TOKENS_PER_MINUTE]]],... -> one dict per tenant."""
    tenants = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if not parts[0] or len(parts) > 4:
            raise ValueError(f"expected NAME[:WEIGHT[:PRIORITY[:TPM]]], got {item!r}")
        t: dict = {"name": parts[0]}
        try:
            if len(parts) > 1 and parts[1]:
                t["weight"] = float(parts[1])
            if len(parts) > 2 and parts[2]:
                t["priority"] = int(parts[2])
            if len(parts) > 3 and parts[3]:
                t["tokens_per_minute"] = float(parts[3])
        except ValueError:
            raise ValueError(f"bad number in tenant {item!r}") from None
        if t.get("weight", 1.0) <= 0 or t.get("tokens_per_minute", 1.0) <= 0:
            raise ValueError(f"weight and tokens per minute must be > 0 in {item!r}")
        tenants.append(t)
    names = [t["name"] for t in tenants]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate tenant names in {text!r}")
    return tenants


def _add_bench_serve(bench_sub: argparse._SubParsersAction) -> None:
    srv = bench_sub.add_parser(
        "serve",
        help="load generator against an OpenAI-compatible server (fairbatch or a peer)",
        description="Send a workload to an OpenAI-compatible server (by default a local fairbatch "
        "server started for the run), measure latency, throughput and fairness, write "
        "OUT/result.json and PNG plots. See docs/BENCHMARKS.md.",
    )
    g = srv.add_argument_group("target")
    g.add_argument("--url", help="base URL of a running server (default: start a local one)")
    g.add_argument(
        "--model",
        help="model id to request (default: the server's first model); serving-path: a model "
        "directory to run in place of the tiny model",
    )
    g.add_argument("--api-key", help="bearer key for every tenant (peers, single-tenant runs)")
    g.add_argument("--keys", help="JSON or YAML file mapping tenant name -> API key")
    g.add_argument("--admin-key", help="admin key to read /admin/stats (fairbatch)")
    g.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    g.add_argument(
        "--no-priority-field", action="store_true", help="do not send a request's priority"
    )
    g.add_argument("--timeout", type=_positive(float), default=300.0, help="per request, s")
    g.add_argument(
        "--max-drain",
        type=_positive(float),
        metavar="S",
        help="stop S seconds after the last arrival; requests still running are cut off "
        "(recorded as such) - bounds an overloaded run (default: wait for all)",
    )
    g = srv.add_argument_group("local server (without --url)")
    g.add_argument(
        "--policy",
        choices=["fcfs", "round_robin", "weighted_fair", "priority"],
        default="weighted_fair",
    )
    g.add_argument("--max-num-seqs", type=_positive(int), default=16)
    g.add_argument(
        "--num-gpu-blocks",
        type=_positive(int),
        help="KV blocks of 16 tokens (default 1024; 64 for --compare preemption)",
    )
    g.add_argument("--preemption-mode", choices=["auto", "swap", "recompute"], default="auto")
    g.add_argument(
        "--order-within-tenant",
        choices=["fcfs", "edf"],
        default="fcfs",
        help="order of a tenant's own requests: arrival, or earliest deadline first",
    )
    g = srv.add_argument_group("workload: a named scenario")
    g.add_argument(
        "--scenario",
        help="vtc_overload, vtc_on_off, vtc_length_shift, weighted, "
        "priority_burst, quota_limited, shared_prefix, deadlines",
    )
    g.add_argument("--capacity", type=_positive(float), help="requests/s (default: measured)")
    g.add_argument("--duration", type=_positive(float), default=60.0, help="scenario length, s")
    g.add_argument("--scale", type=_positive(float), default=1.0, help="scenario length scale")
    g = srv.add_argument_group(
        "workload: real tenants (--workload servegen; benchmarks/replay_bench.py)"
    )
    g.add_argument(
        "--workload",
        choices=["servegen", "noisy-victim"],
        help="servegen: replay ServeGen production clients as tenants, against fairbatch serve "
        "(and vllm serve fcfs and priority with --peer vllm), at each of --loads; "
        "noisy-victim: --concurrency streams of one tenant beside another's Poisson --rate of "
        "short requests for --duration s, on the same servers (benchmarks/noisy_victim.py)",
    )
    g.add_argument(
        "--servegen-dir",
        metavar="DIR",
        help="--workload servegen: a ServeGen client directory (chunk-N-trace.csv, "
        "chunk-N-dataset.json), e.g. data/language/m-small of github.com/alibaba/ServeGen",
    )
    g.add_argument(
        "--servegen-span",
        metavar="START[:N]",
        help="the N (default 6) 10-minute windows from START (default: the busiest hour)",
    )
    g.add_argument("--servegen-clients", help="client names, comma-separated (default: picked)")
    g.add_argument("--heavy", type=int, default=3, help="heaviest clients by offered cost")
    g.add_argument("--tail", type=int, default=5, help="clients drawn from the rest")
    g.add_argument(
        "--loads", default="1.5", help="offered load, multiples of capacity (e.g. 0.8,1.5,3)"
    )
    g.add_argument(
        "--slo-factor",
        type=_positive(float),
        default=5.0,
        help="SLO: this many times a tenant's idle TTFT and TPOT",
    )
    g.add_argument(
        "--without-fair-preemption",
        action="store_true",
        help="also run fairbatch with the controller's fair preemption off (fairbatch-nofp)",
    )
    g.add_argument(
        "--reanalyze",
        action="store_true",
        help="rebuild the report from OUT/runs.jsonl of an earlier run (give its --out)",
    )
    g.add_argument(
        "--sim-replicas",
        metavar="N,N,...",
        help="instead of servers: the replay on this many simulated GPU replicas (Llama-3-8B "
        "on an H100, virtual time), fairbatch against per-replica FCFS behind a balancer",
    )
    g.add_argument(
        "--sim-rate-scale",
        type=_positive(float),
        default=1.0,
        help="--sim-replicas: the trace's request rates times this (default 1: as recorded)",
    )
    g.add_argument("--max-input-len", type=_positive(int), default=1024, help="prompt cap")
    g.add_argument("--max-output-len", type=_positive(int), default=256, help="output cap")
    g = srv.add_argument_group("workload: custom (instead of --scenario)")
    g.add_argument("--num-prompts", type=_positive(int), help="requests (default 64)")
    g.add_argument("--rate", type=_positive(float), help="requests/s; inf = all at once")
    g.add_argument("--process", choices=["poisson", "gamma"], help="arrivals (default poisson)")
    g.add_argument("--burstiness", type=_positive(float), help="gamma shape (1 = poisson)")
    g.add_argument(
        "--concurrency", type=_positive(int), help="fixed concurrency (arrival times ignored)"
    )
    g.add_argument(
        "--input-len",
        type=_length_spec,
        help="fixed:N | uniform:LO-HI | lognormal:MEAN,SIGMA (default uniform:32-256)",
    )
    g.add_argument(
        "--output-len", type=_length_spec, help="as --input-len (default uniform:16-128)"
    )
    g.add_argument(
        "--sharegpt", type=_positive(float), metavar="SCALE", help="ShareGPT-like lognormal lengths"
    )
    g.add_argument(
        "--shared-prefix",
        type=_shared_prefix,
        metavar="G,L",
        help="G system prompts of L tokens, each reused by 1/G of the requests",
    )
    g.add_argument("--tenants", type=_tenant_list, help="NAME[:WEIGHT[:PRIORITY[:TPM]]],...")
    g.add_argument("--seed", type=int, default=0)
    g = srv.add_argument_group("metrics and output")
    g.add_argument("--slo-ttft", type=_positive(float), metavar="MS", help="goodput SLO: TTFT")
    g.add_argument("--slo-tpot", type=_positive(float), metavar="MS", help="goodput SLO: TPOT")
    g.add_argument("--slo-e2e", type=_positive(float), metavar="MS", help="goodput SLO: e2e")
    g.add_argument(
        "--out",
        help="output directory for result.json (a summary) and the plots "
        "(default serve-bench/<UTC time>)",
    )
    g.add_argument(
        "--raw-out",
        metavar="FILE",
        help="also write one JSON line per request to FILE (not into result.json)",
    )
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--no-progress", action="store_true")
    g = srv.add_argument_group("comparisons (each in one command)")
    g.add_argument(
        "--compare",
        choices=[
            "policies",
            "priority",
            "preemption",
            "deadlines",
            "locality",
            "summary",
            "serving-path",
            "quota",
        ],
    )
    g.add_argument(
        "--ingresses",
        default="1,2,4",
        help="quota: the app's ingress replica counts to run (default 1,2,4)",
    )
    g.add_argument(
        "--quota",
        type=_positive(float),
        default=6000.0,
        help="quota: the tenant's tokens per minute (default 6000)",
    )
    g.add_argument(
        "--over",
        type=_positive(float),
        default=3.0,
        help="quota: offered load, multiples of the quota (default 3)",
    )
    g.add_argument(
        "--intervals",
        default="50,0",
        help="serving-path: the app's stream_interval_ms values to run (default 50,0)",
    )
    g.add_argument(
        "--replicas", type=_positive(int), default=2, help="serving-path: replica actors"
    )
    g.add_argument(
        "--proxy",
        action="store_true",
        help="serving-path: Serve's HTTP proxy in front of the app (default: direct ingress, "
        "as fairbatch serve runs it)",
    )
    g.add_argument(
        "--paths",
        default=None,
        help="serving-path: which paths to run, comma-separated (default all: offline, "
        "engines, local_http, serve_http, handle)",
    )
    g.add_argument(
        "--rounds",
        type=_positive(int),
        default=1,
        help="serving-path: run every path this many times in turn; --peer: rounds of both "
        "servers, their order alternated; report medians",
    )
    g.add_argument(
        "--sim-time-scale",
        type=float,
        default=0.0,
        metavar="S",
        help="serving-path: simulated replicas paced like their GPU (S real seconds per "
        "modelled one) instead of the tiny model; offline is then one paced engine's rate "
        "times the replicas (default 0: the tiny model)",
    )
    g.add_argument("--engine-json", default="docs/results/engine.json", help="for summary")
    g = srv.add_argument_group("against a peer server (--peer vllm; benchmarks/peer/serve.py)")
    g.add_argument(
        "--peer",
        choices=["vllm"],
        help="run `vllm serve` and `fairbatch serve --replicas 1` on --checkpoint one after "
        "the other with the custom workload; one table",
    )
    g.add_argument(
        "--peer-python",
        metavar="PATH",
        help="the Python of a venv with vLLM (benchmarks/peer/make_vllm_venv.sh)",
    )
    g.add_argument(
        "--checkpoint",
        help="the model of the local server(s): a random-weight shape (qwen2.5-0.5b, "
        "llama-3.2-1b, tiny; built once and cached) or a checkpoint directory (default: "
        "qwen2.5-0.5b with --peer, else the embedded tiny model)",
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="--peer: the dtype both servers compute in (default float32)",
    )
    g.add_argument("--cluster-json", help="for summary: `fairbatch bench cluster --json` output")
    srv.set_defaults(func=_bench_serve, parser=srv)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `fairbatch bench` and its subcommands."""
    bench = sub.add_parser("bench", help="benchmarks (print results, optionally write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    sched = bench_sub.add_parser("scheduler", help="schedule()+update time per policy")
    sched.add_argument("--json", help="write results to this JSON file")
    sched.add_argument("--steps", type=int, default=2000, help="measured steps per policy")
    sched.add_argument("--policies", help="comma-separated subset (default: all)")
    sched.add_argument(
        "--rounds", type=int, default=3, help="runs per policy, interleaved; medians reported"
    )
    sched.set_defaults(func=_bench_scheduler)
    inp = bench_sub.add_parser(
        "inputs", help="host time of a decode step's graph inputs and penalty inputs"
    )
    inp.add_argument("--json", help="write results to this JSON file")
    inp.add_argument(
        "--contexts",
        type=_positive(int),
        nargs="+",
        default=[1024, 16384],
        help="mean tokens a sequence, one run each (default 1024 16384)",
    )
    inp.add_argument("--reps", type=_positive(int), default=200, help="steps timed per case")
    inp.set_defaults(func=_bench_inputs)
    eng = bench_sub.add_parser(
        "engine", help="fairbatch vs transformers, or vs vLLM (--peer vllm), tokens/s"
    )
    eng.add_argument("--json", help="write results to this JSON file")
    eng.add_argument(
        "--model",
        default="qwen2.5-0.5b",
        help="a random-weight shape (qwen2.5-0.5b, llama-3.2-1b, tiny; built once and cached, "
        "benchmarks/checkpoints.py) or a checkpoint directory (default qwen2.5-0.5b)",
    )
    eng.add_argument("--num-requests", type=_positive(int), help="default 128 (32 with --peer)")
    eng.add_argument("--min-prompt", type=int, default=16)
    eng.add_argument("--max-prompt", type=int, default=512)
    eng.add_argument("--min-output", type=int, default=8)
    eng.add_argument("--max-output", type=int, default=256)
    eng.add_argument(
        "--skip-cb", action="store_true", help="skip transformers' continuous batching"
    )
    eng.add_argument(
        "--structured",
        action="store_true",
        help="instead: step time at batch 32 with half the requests JSON-schema constrained, "
        "as a ratio to no constraints",
    )
    eng.add_argument("--device", default="cpu", help="for --structured: cpu or cuda")
    g = eng.add_argument_group("against a peer engine (--peer vllm; benchmarks/peer/)")
    g.add_argument("--peer", choices=["vllm"], help="run vLLM's offline LLM on the same work")
    g.add_argument(
        "--peer-python",
        metavar="PATH",
        help="the Python of a venv with vLLM (benchmarks/peer/make_vllm_venv.sh)",
    )
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--prompt-len", type=_positive(int), default=64)
    g.add_argument("--max-tokens", type=_positive(int), default=64, help="new tokens each")
    g.add_argument("--max-num-seqs", type=_positive(int), default=32)
    g.add_argument("--max-num-batched-tokens", type=_positive(int), default=2048)
    g.add_argument(
        "--kv-tokens",
        type=_positive(int),
        help="KV capacity of each engine in tokens (default: room for --max-num-seqs whole "
        "sequences)",
    )
    g.add_argument(
        "--peer-block-size",
        type=_positive(int),
        default=128,
        help="vLLM's block size (its CPU attention needs a multiple of 32; fairbatch keeps 16)",
    )
    g.add_argument("--rounds", type=_positive(int), default=2, help="rounds per engine, alternated")
    g.add_argument("--seed", type=int, default=0, help="of the random prompts")
    g.add_argument(
        "--threads",
        type=_positive(int),
        help="compute threads of each engine (fairbatch's torch threads; vLLM's bound cores); "
        "default: every core",
    )
    eng.set_defaults(func=_bench_engine)
    lor = bench_sub.add_parser(
        "lora",
        help="multi-LoRA tokens/s: the base model vs 1, 8 and 64 adapters",
        description="The same requests on the base model alone and under 1, 8 and 64 random "
        "PEFT adapters (ranks 8 and 16, every linear), round-robin; the cases alternate over "
        "--rounds, medians reported (benchmarks/lora_bench.py). Needs peft.",
    )
    lor.add_argument("--json", help="write results to this JSON file")
    lor.add_argument(
        "--model",
        default="qwen2.5-0.5b",
        help="a random-weight shape (qwen2.5-0.5b, llama-3.2-1b, tiny; built once and cached, "
        "benchmarks/checkpoints.py) or a checkpoint directory (default qwen2.5-0.5b)",
    )
    lor.add_argument("--num-requests", type=_positive(int), default=64)
    lor.add_argument("--prompt-len", type=_positive(int), default=64)
    lor.add_argument("--output-len", type=_positive(int), default=64, help="new tokens each")
    lor.add_argument(
        "--adapters",
        type=lambda s: tuple(_positive(int)(x) for x in s.split(",")),
        default=(1, 8, 64),
        help="comma-separated adapter counts, one case each (default 1,8,64)",
    )
    lor.add_argument("--max-loras", type=_positive(int), default=8, help="adapter slots")
    lor.add_argument("--max-lora-rank", type=_positive(int), default=16)
    lor.add_argument("--max-num-seqs", type=_positive(int), default=32)
    lor.add_argument("--rounds", type=_positive(int), default=2, help="cases alternated")
    lor.add_argument("--device", default="cpu", help="cpu or cuda")
    lor.set_defaults(func=_bench_lora)
    clu = bench_sub.add_parser(
        "cluster", help="fairness controller: admissions/s, latency, fairness vs baselines"
    )
    clu.add_argument("--json", help="write results to this JSON file")
    clu.add_argument(
        "--replicas", type=int, nargs="+", default=[4, 16, 64], help="cluster sizes (N)"
    )
    clu.add_argument(
        "--systems",
        help="comma-separated subset of fairbatch,fairbatch_limits,fairbatch_usage,rr_local_wfq,"
        "p2c_fcfs (default: all; one may repeat, to alternate runs)",
    )
    clu.add_argument("--duration", type=float, default=12.0, help="virtual seconds per run")
    clu.add_argument(
        "--autoscale",
        action="store_true",
        help="instead: a day-shaped load on an autoscaled cluster of up to max(--replicas) "
        "vs fixed clusters sized for the peak and the mean (--duration default 240)",
    )
    clu.add_argument(
        "--workload",
        choices=["uniform", "shared_prefix"],
        default="uniform",
        help="shared_prefix: tenants reusing long system prompts; systems fcfs, weighted_fair, "
        "lpm, dlpm, prefix_affinity, d2lpm (benchmarks/locality_bench.py)",
    )
    clu.add_argument(
        "--load",
        type=_positive(float),
        help="shared_prefix: open loop instead, Poisson arrivals at LOAD x weighted_fair's "
        "closed-loop throughput (e.g. 0.8)",
    )
    clu.add_argument(
        "--shift",
        type=_positive(float),
        help="shared_prefix: at SHIFT virtual seconds each tenant's hot share moves from its "
        "first system prompt to its second, until then a cold one (a popularity shift)",
    )
    clu.add_argument(
        "--ray",
        action="store_true",
        help="also measure admissions/s through the controller actor on a local Ray",
    )
    clu.set_defaults(func=_bench_cluster)
    con = bench_sub.add_parser(
        "conversation",
        help="the host KV tier on Mooncake's conversation trace: no tier vs tier",
        description="Replays sampled conversations of Mooncake's conversation_trace.jsonl "
        "(benchmarks/conversation_bench.py) without and with the host KV tier.",
    )
    con.add_argument("--trace", required=True, help="conversation_trace.jsonl")
    con.add_argument("--json", help="write the summary to this JSON file")
    con.add_argument("--engine", choices=["model", "sim"], default="model")
    con.add_argument(
        "--every", type=_positive(int), default=64, help="keep one conversation in EVERY"
    )
    con.add_argument(
        "--time-scale", type=_positive(float), default=60.0, help="arrivals compressed by this"
    )
    con.add_argument("--model", default="qwen2.5-0.5b", help="model: a checkpoint shape")
    con.add_argument(
        "--tokens-per-block", type=_positive(int), default=4, help="model: a 512-token block's"
    )
    con.add_argument("--block-size", type=_positive(int), default=4, help="model: KV block")
    con.add_argument("--max-num-seqs", type=_positive(int), default=16)
    con.add_argument("--max-num-batched-tokens", type=_positive(int), default=512)
    con.add_argument(
        "--gpu-blocks",
        type=_positive(int),
        help="device KV blocks (model: default 1/8 of the sample's working set; sim: 8192)",
    )
    con.add_argument(
        "--replicas", type=_positive(int), nargs="+", default=[4], help="sim: cluster sizes"
    )
    con.add_argument(
        "--host-blocks", type=_positive(int), default=32768, help="sim: host-tier blocks"
    )
    con.set_defaults(func=_bench_conversation)
    _add_bench_serve(bench_sub)
