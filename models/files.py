"""Atomic files and directories: how every artefact of the project is written.

* A file is written to a temporary name in its own directory, flushed to disk and renamed
  into place (`os.replace`): a reader sees the old file or the new one, never a part.
* A directory artefact (an orbax checkpoint, a draft, example shards) is built under a
  temporary name beside its target and swapped in whole: the old directory is renamed aside,
  the new one into place, and the old one removed (an error between the two renames puts the
  old one back). Only a crash of the process between them leaves no target;
  `require_artifact` then names the set-aside copy in its error.
* Replacing an existing artefact needs ``overwrite=True``; without it the save fails before
  writing anything (`FileExistsError`).

Temporary names start with ``.<name>.`` so that they never match a reader's pattern.
`read_json` is the reading side: every malformed file names itself.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
from typing import IO, Callable, Iterator


def _target(path: str | os.PathLike) -> tuple[str, str, str]:
    """(absolute path, parent directory, base name); the parent must exist."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    if not name:
        raise ValueError(f"path: expected a file or directory name; received {path!r}")
    if not os.path.isdir(parent):
        raise FileNotFoundError(f"{path}: the directory {parent} does not exist")
    return path, parent, name


def check_new(path: str | os.PathLike, *, overwrite: bool) -> str:
    """Absolute ``path`` after checking that it may be written: its directory exists and is
    writable, and it does not exist unless ``overwrite``. Raises FileExistsError /
    FileNotFoundError / PermissionError naming the path (before any work is done)."""
    path, parent, _ = _target(path)
    if os.path.lexists(path) and not overwrite:
        raise FileExistsError(f"{path}: already exists; pass overwrite=True to replace it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{path}: the directory {parent} is not writable")
    return path


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_with(path: str | os.PathLike, write: Callable[[IO], None], *, binary: bool = False,
                      overwrite: bool = False) -> str:
    """Call ``write(f)`` on a temporary file beside ``path`` (text UTF-8, or binary), then
    rename it to ``path``. On any error the temporary file is removed and ``path`` is
    untouched. Returns the absolute path."""
    path = check_new(path, overwrite=overwrite)
    parent, name = os.path.split(path)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    _fsync_dir(parent)
    return path


def atomic_write(path: str | os.PathLike, data: str | bytes, *, overwrite: bool = False) -> str:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (see `atomic_write_with`)."""
    return atomic_write_with(path, lambda f: f.write(data), binary=isinstance(data, bytes), overwrite=overwrite)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, overwrite: bool = False) -> Iterator[str]:
    """``with atomic_directory(path) as tmp:`` build the artefact in ``tmp`` (a new directory
    beside ``path``); on a clean exit it replaces ``path`` whole, on an error it is removed
    and ``path`` is untouched. An existing ``path`` needs ``overwrite=True``."""
    path = check_new(path, overwrite=overwrite)
    parent, name = os.path.split(path)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp")
    try:
        yield tmp
        os.chmod(tmp, 0o755)
        if os.path.lexists(path):
            if not overwrite:  # appeared while we were building
                raise FileExistsError(f"{path}: already exists; pass overwrite=True to replace it")
            old = tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".old")
            aside = os.path.join(old, name)
            try:
                os.replace(path, aside)
            except BaseException:
                os.rmdir(old)
                raise
            try:
                os.replace(tmp, path)
            except BaseException:
                os.replace(aside, path)  # roll back: the old artefact stays in place
                os.rmdir(old)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(parent)


def require_artifact(path: str | os.PathLike, marker: str, what: str) -> str:
    """Absolute ``path`` after checking that it holds ``marker`` (a file written last by the
    save); otherwise a FileNotFoundError naming the path, what writes it, and a copy set aside
    by an interrupted `atomic_directory` swap if there is one."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(os.path.join(path, marker)):
        return path
    parent, name = os.path.split(path)
    aside = sorted(glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.*.old", name)))
    hint = f"; an interrupted save set the previous copy aside at {aside[-1]}" if aside else ""
    raise FileNotFoundError(f"{path}: expected {marker} (written by {what}){hint}")


def read_json(path: str | os.PathLike, expect: type | None = dict) -> object:
    """Parse a JSON file; every failure is a ValueError (missing file: FileNotFoundError)
    naming the file: not UTF-8 (with the byte offset), not JSON (line and column), or not
    of type ``expect``."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 1]!r})") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    if expect is not None and not isinstance(data, expect):
        raise ValueError(f"{path}: expected a JSON {'object' if expect is dict else expect.__name__}; "
                         f"received {type(data).__name__}")
    return data
