"""The `mmjax` command: ``mmjax COMMAND [args]``; ``mmjax COMMAND --help`` for a command's options.

A command that fails prints one line ``mmjax COMMAND: error: ...`` and exits with status 2:
bad arguments (checked while parsing, outputs included, before any work), bad files, and any
other error (then named by its type). ``--debug`` before the command shows the traceback
instead.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mmjax.drivers.args import ArgumentParser

# name -> (module exposing main(argv) -> int, one-line purpose)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("mmjax.drivers.bench", "run a benchmark by name (`mmjax bench --help` lists them)"),
    "generate": ("mmjax.drivers.generate", "answer a prompt about videos / images with a Hugging Face snapshot"),
    "search": ("mmjax.drivers.search", "search per-head sparse patterns from a calibration .npz -> SparseConfig"),
}


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mmjax", description="mmjax: fast long-context vision-language inference in JAX",
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (_, purpose) in COMMANDS.items():
        sub.add_parser(name, help=purpose, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv[:1]
    argv = argv[1:] if debug else argv
    p = parser()
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        p.error(f"argument COMMAND: invalid choice: {name!r} (choose from {', '.join(COMMANDS)})")
    try:
        return importlib.import_module(COMMANDS[name][0]).main(rest)
    except Exception as e:  # noqa: BLE001 - every failure is one line (--debug: the traceback)
        if debug:
            raise
        print(f"mmjax {name}: error: {one_line(e)}", file=sys.stderr)
        return 2


def one_line(e: BaseException) -> str:
    """The message of ``e`` on one line; errors other than bad input (ValueError, OSError) are
    prefixed with their type, and point to ``--debug``."""
    text = " ".join(str(e).split()) or "(no message)"
    if isinstance(e, (ValueError, OSError)):
        return text
    return f"{type(e).__name__}: {text} (run `mmjax --debug ...` for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
