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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
