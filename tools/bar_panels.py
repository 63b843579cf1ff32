"""Bar charts of the JSON-lines results of the kernel scripts in tools/: ms per case, one panel per device and
length, the PNG written atomically beside the JSON-lines file."""

from __future__ import annotations

import os
from collections.abc import Callable

from jsonl_log import latest_timed_rows, write_atomic


def plot_ms_bars(jsonl: str, *, name: str, title: Callable[[str, int], str],
                 highlight: Callable[[str], bool] = lambda _: False, log: bool = False, height: float = 3) -> str:
    """Horizontal bars of ``ms`` per value of the rows' ``name`` field (the latest row per device, length ``S`` and
    name; rows without a time left out), fastest on top, one panel per (device, S) titled ``title(device, S)``,
    the bars where ``highlight(value)`` in orange; ``log``: a log time axis. Returns the PNG's path."""
    import matplotlib  # here, not at the top: the measuring scripts import this module on GPU machines
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    latest = latest_timed_rows(jsonl, ("device", "S", name))
    panels = sorted({(d, s) for d, s, _ in latest})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), height), squeeze=False)
    for ax, (device, s) in zip(axes[0], panels):
        rows = sorted((r for (d, n, _), r in latest.items() if (d, n) == (device, s)), key=lambda r: r["ms"])
        ax.barh([r[name] for r in rows], [r["ms"] for r in rows],
                color=["tab:orange" if highlight(r[name]) else "tab:blue" for r in rows])
        ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
        ax.set_xlabel("ms per call" + (" (log)" if log else ""))
        ax.set_title(title(device, s), fontsize=9)
    fig.tight_layout()
    png = os.path.splitext(jsonl)[0] + ".png"
    write_atomic(png, lambda fh: fig.savefig(fh, format="png", dpi=110), binary=True)
    plt.close(fig)
    return png


def add_plot_args(p) -> None:
    """``--plot`` (draw the ``--out`` file's rows after measuring) and ``--plot-only`` (draw, measure nothing)."""
    p.add_argument("--plot", action="store_true", help="draw the --out file's rows into a PNG beside it")
    p.add_argument("--plot-only", action="store_true", help="only draw (no measurement)")
