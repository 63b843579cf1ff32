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


def grouped_ms_bars(rows: list[dict], title: str):
    """A figure of grouped bars: the median ``ms`` of each row's ``variant``, one group per ``seq_len`` (log time
    axis; a failed or missing variant shows as 0), titled ``title``."""
    import matplotlib  # here, not at the top: the measuring scripts import this module on GPU machines
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    lens = sorted({r["seq_len"] for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        ms = [next((r.get("ms", 0.0) for r in rows if r["seq_len"] == s and r["variant"] == name), 0.0)
              for s in lens]
        ax.bar(np.arange(len(lens)) + i * width, ms, width, label=name)
    ax.set_xticks(np.arange(len(lens)) + width * (len(names) - 1) / 2, [f"S = {s:,}" for s in lens])
    ax.set_yscale("log")
    ax.set_ylabel("ms (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
