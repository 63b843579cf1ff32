"""One table row per variant of a kernel at one length, for the tools' side-by-side benches (`last_q_scores_bench`,
`phase_mass_bench`): each variant timed alone (median of samples of queued calls, `mmjax.timing.time_fn`), checked
against the first variant's output, a failure recorded without stopping the others."""

from __future__ import annotations

from collections.abc import Callable

from mmjax.timing import time_fn


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
