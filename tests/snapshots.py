"""Checkpoint directory layouts the loader tests build from a plain snapshot."""

import hashlib
import os


def hub_tree(src, root, commit="0123456789abcdef0123456789abcdef01234567"):
    """The hub cache layout of snapshot ``src`` under ``root``: blobs named by content hash,
    snapshots/<commit>/ symlinks, refs/main. Returns the snapshot directory."""
    blobs, snap = os.path.join(root, "blobs"), os.path.join(root, "snapshots", commit)
    os.makedirs(blobs)
    os.makedirs(snap)
    for name in sorted(os.listdir(src)):
        with open(os.path.join(src, name), "rb") as f:
            data = f.read()
        digest = hashlib.sha256(data).hexdigest()
        with open(os.path.join(blobs, digest), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", digest), os.path.join(snap, name))
    os.makedirs(os.path.join(root, "refs"))
    with open(os.path.join(root, "refs", "main"), "w") as f:
        f.write(commit)
    return snap
