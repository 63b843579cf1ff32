"""The JSON-lines result file of the kernel scripts in tools/: one line per measurement, appended atomically (the
file is rewritten through a temporary file and a rename), so a run cut by a time limit leaves whole lines, and
several runs (e.g. one per commit) can add to one file."""

from __future__ import annotations

import json
import os
import tempfile


def write_atomic(path: str, write, binary: bool = False) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it onto ``path``."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-",
                               suffix=os.path.splitext(path)[1])
    try:
        with os.fdopen(fd, "wb" if binary else "w") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_json_and_figure(out_dir: str, stem: str, result: dict, fig) -> str:
    """``result`` as ``<out_dir>/<stem>.json`` and the matplotlib figure ``fig`` as ``<stem>.png`` beside it, each
    written atomically; returns the JSON path."""
    path = os.path.join(out_dir, f"{stem}.json")
    write_atomic(path, lambda f: json.dump(result, f, indent=1))
    write_atomic(os.path.join(out_dir, f"{stem}.png"), lambda f: fig.savefig(f, format="png", dpi=120), binary=True)
    return path


def append_jsonl(path: str, row: dict) -> None:
    """Append ``row`` as one JSON line to ``path`` (created if missing), atomically."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    write_atomic(path, lambda f: f.write(old + json.dumps(row) + "\n"))


def latest_timed_rows(path: str, key: tuple[str, ...]) -> dict[tuple, dict]:
    """The rows of the JSON-lines file ``path`` that hold a time (``"ms"``), the last one per value of the ``key``
    fields (later runs appended to the same file replace earlier ones): {key values: row}."""
    latest = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "ms" in row:
                latest[tuple(row[k] for k in key)] = row
    return latest
