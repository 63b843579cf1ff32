"""The JSON-lines result file of the kernel scripts in tools/: one line per measurement, appended atomically (the
file is rewritten through a temporary file and a rename), so a run cut by a time limit leaves whole lines, and
several runs (e.g. one per commit) can add to one file."""

from __future__ import annotations

import json
import os
import tempfile


def append_jsonl(path: str, row: dict) -> None:
    """Append ``row`` as one JSON line to ``path`` (created if missing), atomically."""
    old = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(old + json.dumps(row) + "\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
