"""The `fairbatch` command line. Subcommands import what they need lazily, so `fairbatch bench
scheduler` starts without torch or ray."""

from __future__ import annotations

import argparse
import sys


def _bench_scheduler(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import scheduler_bench

    policies = args.policies.split(",") if args.policies else scheduler_bench.POLICIES
    scheduler_bench.main(args.json, steps=args.steps, policies=policies)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import engine_bench

    engine_bench.main(
        args.json,
        num_requests=args.num_requests,
        prompt_range=(args.min_prompt, args.max_prompt),
        output_range=(args.min_output, args.max_output),
        skip_cb=args.skip_cb,
    )
    return 0


def _bench_cluster(args: argparse.Namespace) -> int:
    from fairbatch.benchmarks import cluster_bench

    systems = args.systems.split(",") if args.systems else None
    cluster_bench.main(
        args.json,
        replicas=args.replicas,
        systems=systems,
        duration_s=args.duration,
        with_ray=args.ray,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser("bench", help="benchmarks (print results, optionally write JSON)")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    sched = bench_sub.add_parser("scheduler", help="schedule()+update time per policy")
    sched.add_argument("--json", help="write results to this JSON file")
    sched.add_argument("--steps", type=int, default=2000, help="measured steps per policy")
    sched.add_argument("--policies", help="comma-separated subset (default: all)")
    sched.set_defaults(func=_bench_scheduler)
    eng = bench_sub.add_parser("engine", help="fairbatch vs transformers tokens/s (tiny Llama)")
    eng.add_argument("--json", help="write results to this JSON file")
    eng.add_argument("--num-requests", type=int, default=128)
    eng.add_argument("--min-prompt", type=int, default=16)
    eng.add_argument("--max-prompt", type=int, default=512)
    eng.add_argument("--min-output", type=int, default=8)
    eng.add_argument("--max-output", type=int, default=256)
    eng.add_argument(
        "--skip-cb", action="store_true", help="skip transformers' continuous batching"
    )
    eng.set_defaults(func=_bench_engine)
    clu = bench_sub.add_parser(
        "cluster", help="fairness controller: admissions/s, latency, fairness vs baselines"
    )
    clu.add_argument("--json", help="write results to this JSON file")
    clu.add_argument(
        "--replicas", type=int, nargs="+", default=[4, 16, 64], help="cluster sizes (N)"
    )
    clu.add_argument("--systems", help="comma-separated subset of fairbatch,rr_local_wfq,p2c_fcfs")
    clu.add_argument("--duration", type=float, default=12.0, help="virtual seconds per run")
    clu.add_argument(
        "--ray",
        action="store_true",
        help="also measure admissions/s through the controller actor on a local Ray",
    )
    clu.set_defaults(func=_bench_cluster)

    from fairbatch.deployments import serve_cli  # stdlib-only at import: start-up stays fast

    serve_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
