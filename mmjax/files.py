"""Files mmjax writes: the atomic helpers of `models.files` (temporary name + rename, whole
directory swaps, ``overwrite=True`` to replace) plus what the command line needs: names that
cannot leave their directory, output paths checked before any work starts.
"""

from __future__ import annotations

import os
import re

from models.files import atomic_directory, atomic_write, atomic_write_with, check_new, read_json, require_artifact

__all__ = ["atomic_directory", "atomic_write", "atomic_write_with", "check_new", "check_output_dir", "read_json",
           "require_artifact", "safe_name"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def safe_name(name: str, what: str = "name") -> str:
    """``name`` unchanged if it is a plain file-name stem (letters, digits, ``._-``, not
    starting with a dot or a dash, at most 128 characters): never a path, never ``..``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise ValueError(f"{what}: expected a plain name of letters, digits, '.', '_' or '-' (no path, no '..', "
                         f"not starting with '.' or '-'); received {name!r}")
    return name


def slug(text: str, default: str) -> str:
    """``text`` as a file-name piece: runs of characters other than letters, digits and ``._-`` become
    one ``-``, leading / trailing ``-`` and ``.`` are dropped; ``default`` when nothing is left."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or default


def check_output_dir(path: str | os.PathLike, what: str = "out") -> str:
    """Create directory ``path`` if needed and check that files can be created in it; returns
    the absolute path. Raises an OSError naming ``what`` and the path (before any work)."""
    path = os.path.abspath(os.fspath(path))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise type(e)(f"{what} {path}: cannot create the directory ({e.strerror or e})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {path}: the directory is not writable")
    return path
