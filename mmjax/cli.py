"""`mmjax` command line: `mmjax bench kernels|patterns|momo|mixed|speculative [...]`, `mmjax search [...]`."""

from __future__ import annotations

import argparse
import sys

BENCHMARKS = ("kernels", "patterns", "momo", "mixed", "speculative")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="mmjax", description="mmjax command line")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run a benchmark (GPU; small interpret-mode run on CPU)")
    bench.add_argument("name", choices=BENCHMARKS)
    sub.add_parser("search", help="search per-head sparse patterns from a calibration .npz", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "search":
        from mmjax.pattern_search import cli

        return cli.main(rest)
    if args.command == "bench" and args.name == "kernels":
        from mmjax.bench import kernels

        return kernels.main(rest)
    if args.command == "bench" and args.name == "patterns":
        from mmjax.bench import patterns

        return patterns.main(rest)
    if args.command == "bench" and args.name == "mixed":
        from mmjax.bench import mixed

        return mixed.main(rest)
    if args.command == "bench" and args.name == "speculative":
        from mmjax.bench import speculative

        return speculative.main(rest)
    if args.command == "bench" and args.name == "momo":
        from mmjax.bench import momo

        return momo.main(rest)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
