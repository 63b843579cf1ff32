"""`mmjax search`: per-head sparse patterns from calibration q / k / v (MMInference Algorithm 4).

The calibration file is an ``.npz`` holding, for layers l = 0..L-1, ``q_<l>`` float
``[B, T, N, D]``, ``k_<l>`` and ``v_<l>`` float ``[B, S, K, D]`` (N % K == 0, T <= S; the
queries are the last T of the S positions), plus ``modality`` int ``[B, S]`` (kind id of
every token: 0 text, 1 image, 2 video unless ``modality_names`` says otherwise) and
optionally ``modality_names`` str ``[M]``. Write one with ``mmjax.Calibration(...).save``
or capture it with ``mmjax.CalibrationRecorder`` during ``mmjax.prefill``.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from mmjax.drivers.args import ArgumentParser, out_file, positive_float
from mmjax.files import check_new, read_json
from mmjax.sparse.layouts import KernelOptions
from mmjax.sparse.pattern_search import SearchSpace, search


def _space(path: str | None) -> SearchSpace:
    if path is None:
        return SearchSpace()
    try:
        data = read_json(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--space: cannot read a JSON object ({e})") from e
    fields = {f.name for f in dataclasses.fields(SearchSpace)}
    if set(data) - fields:
        raise ValueError(f"--space {path}: expected an object with keys from {sorted(fields)}; received "
                         f"{sorted(data)}")

    def tup(x):
        return tuple(tup(y) for y in x) if isinstance(x, list) else x

    try:
        return SearchSpace(**{k: tup(v) for k, v in data.items()})
    except ValueError as e:
        raise ValueError(f"--space {path}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="mmjax search", description=__doc__.split("\n\n")[0],
                       epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calibration", required=True, help="calibration .npz (layout below)")
    p.add_argument("--out", required=True, type=out_file,
                   help="where to write the SparseConfig JSON (checked before the search starts)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    p.add_argument("--space", help="JSON object of SearchSpace fields overriding the default space "
                                   "(e.g. {\"ashape\": [[128, 1024]], \"boundaries\": [\"NoBoundary\"]})")
    p.add_argument("--budget", type=positive_float, help="density budget (fraction of dense causal pairs); default: "
                                                "the cost of AShape(sink=1024, local=4096)")
    p.add_argument("--implementation", choices=("triton", "reference"),
                   help="kernel implementation (default: triton on GPU, reference on CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    check_new(args.out, overwrite=args.overwrite)  # before the (long) search, not after it
    space = _space(args.space)
    config = search(args.calibration, space=space, budget=args.budget,
                    options=KernelOptions(implementation=args.implementation), progress=not args.quiet)
    config.save(args.out, overwrite=args.overwrite)
    kinds = {}
    for layer in config.layers:
        for pattern in layer:
            kinds[type(pattern).__name__] = kinds.get(type(pattern).__name__, 0) + 1
    print(f"wrote {args.out}: {config.num_layers} layers x {config.num_heads} heads; boundary types {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
