"""The tools' side-by-side kernel benches (`last_q_scores_bench`, `phase_mass_bench`): every variant of a kernel timed
alone at each length (median of samples of queued calls, `mmjax.timing.time_fn`), checked against the first
variant's output, a failure recorded without stopping the others; a table on stdout, JSON and a grouped-bar plot."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import jax
from bar_panels import grouped_ms_bars
from jsonl_log import write_json_and_figure

from mmjax.timing import device_name, time_fn


def time_variants(fns: dict[str, Callable], args: tuple, check: Callable[[object], dict], *, seq_len: int,
                  rows: list[dict], reps: int, batch_s: float, width: int = 24) -> None:
    """Run and time ``fns`` (name -> fn(*args)) in order; ``check(output)`` gives each row's fields against the
    reference (e.g. its largest difference). The first variant is the base of the ``speedup`` column. Appends a
    row per variant to ``rows`` (``error`` for one that failed to compile or run) and prints it."""
    base = None
    for name, fn in fns.items():
        try:
            fields = check(fn(*args))
            ms = time_fn(lambda fn=fn: fn(*args), reps=reps, min_batch_s=batch_s)["ms"]
        except Exception as err:  # noqa: BLE001
            rows.append({"seq_len": seq_len, "variant": name, "error": repr(err)[:2000]})
            print(f"{seq_len:>9} {name:<{width}} FAILED {repr(err)[:600]}", flush=True)
            continue
        base = ms if base is None else base
        rows.append({"seq_len": seq_len, "variant": name, "ms": ms, "speedup": base / ms, **fields})
        shown = " ".join(f"{v:>15.2e}" if isinstance(v, float) else f"{v!s:>12}" for v in fields.values())
        print(f"{seq_len:>9} {name:<{width}} {ms:>9.3f} {base / ms:>8.2f} {shown}", flush=True)


def run_bench(argv, *, doc: str, stem: str, meta: dict, variants: Callable[[], dict], inputs: Callable[[int], tuple],
              check: Callable[[object, object], dict], columns: str, title: Callable[[dict], str]) -> int:
    """The command line of a bench (``--out``, ``--lens``, ``--reps``, ``--batch-s``): ``variants()`` (name -> jitted
    fn, the first the reference), ``inputs(S)`` their arguments, ``check(output, reference output)`` the row's
    fields (``columns`` their header), ``title(meta)`` the plot's. Writes ``<stem>.json`` and its plot into
    ``--out``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lens", type=int, nargs="+", default=[131072, 1048576])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--batch-s", type=float, default=0.1)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    result = {"meta": {"device": device_name(), "jax": jax.__version__, **meta}, "rows": []}
    fns = variants()
    print(f"{'S':>9} {'variant':<24} {'ms':>9} {'x first':>8} {columns}", flush=True)
    for s in a.lens:
        args = inputs(s)
        want = jax.block_until_ready(next(iter(fns.values()))(*args))
        time_variants(fns, args, lambda got, want=want: check(got, want), seq_len=s, rows=result["rows"],
                      reps=a.reps, batch_s=a.batch_s)
        del args, want
        jax.clear_caches()
    path = write_json_and_figure(a.out, stem, result, grouped_ms_bars(result["rows"], title(result["meta"])))
    print(f"wrote {path} and its plot")
    return 0
