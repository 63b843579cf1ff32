"""Argument parsing shared by every command and benchmark: a parser whose errors are one line
(``prog: error: ...``, exit status 2) and argument types that validate while parsing, so bad
values and unwritable outputs fail before any work starts."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from mmjax.files import check_output_dir, safe_name
from mmjax.speculative import TreeConfig
from pallas_kernels.checks import MAX_INT_ARG


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors are one line with exit status 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer; received {text!r}") from None


def positive_int(text: str) -> int:
    """An int in ``[1, 2**30]`` (lengths, counts, layers)."""
    value = _int(text)
    if not 1 <= value <= MAX_INT_ARG:
        raise argparse.ArgumentTypeError(f"expected an integer in [1, {MAX_INT_ARG}]; received {text!r}")
    return value


def nonneg_int(text: str) -> int:
    """An int in ``[0, 2**30]`` (0 = the default where the help says so)."""
    value = _int(text)
    if not 0 <= value <= MAX_INT_ARG:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {MAX_INT_ARG}]; received {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite float > 0 (seconds, budgets)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number; received {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0; received {text!r}")
    return value


def is_pow2(value: int, lo: int = 1) -> bool:
    return value >= lo and not value & (value - 1)


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive ints, e.g. ``16384,65536``."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers; received {text!r}")
    return tuple(positive_int(p) for p in parts)


def name_list(choices) -> Callable[[str], tuple[str, ...]]:
    """An argparse type: comma-separated names, each one of ``choices`` (the error names them all)."""
    choices = tuple(choices)

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(x.strip() for x in text.split(",") if x.strip())
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"expected comma-separated names of {', '.join(choices)}; "
                                             f"received {text!r}")
        return names
    return parse


def tree_list(text: str) -> tuple[str, ...]:
    """Comma-separated speculative trees ``TOTAL-DEPTH-TOPK`` of positive ints, e.g. ``30-4-8,48-5-10``."""
    trees = tuple(x.strip() for x in text.split(",") if x.strip())
    for tree in trees:
        try:
            TreeConfig.parse(tree)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    if not trees:
        raise argparse.ArgumentTypeError(f"expected at least one tree TOTAL-DEPTH-TOPK; received {text!r}")
    return trees


def name(text: str) -> str:
    """A result-file prefix that cannot leave ``--out`` (see `mmjax.files.safe_name`)."""
    try:
        return safe_name(text, "--name")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from None


def out_dir(text: str) -> str:
    """A directory for results, created and checked for writing now; ``""`` = write nothing."""
    if text == "":
        return ""
    try:
        return check_output_dir(text, "--out")
    except OSError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def out_file(text: str) -> str:
    """A file to write later: its directory must exist and be writable now (whether it may be
    replaced is the command's ``--overwrite``)."""
    path = os.path.abspath(text)
    parent = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{path} is a directory; expected a file path")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{path}: the directory {parent} is not writable")
    return path


def add_result_args(p: argparse.ArgumentParser, default_name: str) -> None:
    """``--out DIR`` (checked now; "" = no JSON) and ``--name`` (a safe file prefix)."""
    p.add_argument("--out", type=out_dir, default="bench/results",
                   help="directory for the JSON result, created if needed (\"\" writes none)")
    p.add_argument("--name", type=name, default=default_name, help="result file prefix (letters, digits, ._-)")
