"""`mmjax bench NAME [args]`: every benchmark, by name. Each module exposes ``main(argv) -> int``
with its own ``--help``; results go to ``bench/results/`` as JSON named by device and date."""

from __future__ import annotations

import argparse
import importlib

from mmjax.drivers.args import ArgumentParser

# name -> (module, one-line purpose)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "kernels": ("mmjax.drivers.bench.kernels", "block-sparse kernel vs cuDNN: dense and random layouts, 32k-1M"),
    "patterns": ("mmjax.drivers.bench.patterns", "each sparse pattern end to end vs cuDNN on video-like inputs"),
    "momo": ("mmjax.drivers.bench.momo", "MOMO: time split, speedup over dense, captured mass vs oracle top-k"),
    "mixed": ("mmjax.drivers.bench.mixed", "modality boundaries: searched per-head plans on mixed video + text"),
    "prefill": ("mmjax.drivers.bench.prefill", "full VLM prefill (7B shape): time to first token, peak memory"),
    "speculative": ("mmjax.drivers.bench.speculative", "Sparrow speculative decoding: draft / verify / step costs"),
    "tree_decode": ("mmjax.drivers.bench.tree_decode", "tree-verification attention: split-K kernel vs XLA, cuDNN"),
    "decode_layers": ("mmjax.drivers.bench.decode_layers", "7B decode step: layers under lax.scan vs unrolled"),
    "decode": ("mmjax.drivers.bench.decode", "7B decode vs the memory roofline: B 1/4/16, 1k-128k, host vs in-jit"),
    "vision": ("mmjax.drivers.bench.vision", "7B vision tower alone: XLA vs cuDNN attention, window order forms"),
    "slash_windows": ("mmjax.drivers.bench.slash_windows", "Vertical-Slash: key windows vs aligned blocks, pairs + ms"),
}


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="mmjax bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="benchmarks:\n" + "\n".join(f"  {n:<14} {purpose}"
                                                                   for n, (_, purpose) in BENCHMARKS.items())
                                + "\n\n`mmjax bench NAME --help` shows a benchmark's own options.")
    p.add_argument("name", choices=tuple(BENCHMARKS), metavar="NAME", help="one of: " + ", ".join(BENCHMARKS))
    return p


def main(argv: list[str] | None = None) -> int:
    """Run benchmark ``argv[0]`` with the rest of ``argv``."""
    argv = list(argv or [])
    p = parser()
    if not argv or argv[0] in ("-h", "--help"):
        p.print_help()
        return 0 if argv else 2
    p.parse_args(argv[:1])  # exits with status 2 and a one-line error for an unknown name
    return importlib.import_module(BENCHMARKS[argv[0]][0]).main(argv[1:])
