"""Where a Hugging Face snapshot's files are: a plain directory or a hub-cache model tree.

A plain snapshot is a directory holding ``config.json`` (and the weights, tokenizer, ...). The hub cache
(``huggingface_hub.snapshot_download``) keeps a model as::

    models--org--name/
      refs/main                 the commit hash of the revision "main"
      snapshots/<hash>/...      the files, as symlinks into ../../blobs/
      blobs/<sha256>            the contents

``resolve_snapshot`` accepts either (the tree's root or one of its ``snapshots/<hash>/`` directories) and returns
the directory whose files to read; symlinked files are read through their links.
"""

from __future__ import annotations

import os


def resolve_snapshot(path: str | os.PathLike, revision: str = "main", marker: str = "config.json") -> str:
    """The snapshot directory of ``path``: ``path`` itself when it holds the file ``marker``, else the
    ``snapshots/<hash>`` named by ``refs/<revision>`` of a hub-cache model tree (or its only snapshot when there
    is no ``refs/`` entry), which must hold ``marker``. Raises ValueError naming the path and what was expected."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"snapshot_dir: expected a directory path, got {type(path).__name__}")
    d = os.fspath(path)
    if not os.path.exists(d):
        raise ValueError(f"snapshot_dir: {d!r} is not a directory (no such path)")
    if not os.path.isdir(d):
        raise ValueError(f"snapshot_dir: {d!r} is not a directory (it is a file)")
    if os.path.isfile(os.path.join(d, marker)):
        return d
    if os.path.islink(os.path.join(d, marker)):
        raise ValueError(f"snapshot_dir: {os.path.join(d, marker)!r} is a broken symlink (its blob is missing)")
    snapshots = os.path.join(d, "snapshots")
    if not os.path.isdir(snapshots):
        raise ValueError(f"snapshot_dir: no {marker} in {d!r} (expected a model snapshot directory, or a hub-cache "
                         "tree models--org--name/ with snapshots/<hash>/)")
    ref = os.path.join(d, "refs", revision)
    if os.path.isfile(ref):
        with open(ref, encoding="utf-8") as f:
            commit = f.read().strip()
        chosen = os.path.join(snapshots, commit)
        if not os.path.isdir(chosen):
            raise ValueError(f"snapshot_dir: refs/{revision} names snapshot {commit!r}, which is missing from "
                             f"{snapshots!r}")
    else:
        found = sorted(e for e in os.listdir(snapshots) if os.path.isdir(os.path.join(snapshots, e)))
        if len(found) != 1:
            raise ValueError(f"snapshot_dir: {d!r} has no refs/{revision} and {len(found)} snapshots {found}; "
                             "expected exactly one, or pass the snapshots/<hash> directory itself")
        chosen = os.path.join(snapshots, found[0])
    if not os.path.isfile(os.path.join(chosen, marker)):
        raise ValueError(f"snapshot_dir: no {marker} in the snapshot {chosen!r}")
    return chosen
