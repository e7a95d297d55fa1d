"""The `fairbatch` command line: `fairbatch serve` (deployments/serve/cli.py) and `fairbatch
bench` (benchmarks/cli.py). Subcommands import what they need lazily, so `fairbatch bench
scheduler` starts without torch or ray."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fairbatch", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from fairbatch.benchmarks import cli as bench_cli  # the one arrow up: stdlib-only at import

    bench_cli.add_parser(sub)

    from fairbatch.deployments.serve import (
        cli as serve_cli,  # stdlib-only at import: start-up stays fast
    )

    serve_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
