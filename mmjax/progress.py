"""Progress bars on stderr (tqdm) that stay quiet when stderr is not a terminal."""

from __future__ import annotations

from collections.abc import Iterable

from tqdm.auto import tqdm


def progress(iterable: Iterable | None = None, total: int | None = None, desc: str = "", enabled: bool = True):
    """A tqdm bar over ``iterable`` (or a manual one with ``update(n)`` / ``close()`` when ``iterable`` is None).

    ``enabled=False`` silences it; otherwise tqdm's ``disable=None`` shows it only when stderr is a TTY, so logs,
    pipes and CI stay clean. Use it as a context manager or close it when done.
    """
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise ValueError(f"total: expected a non-negative int or None, got {total!r}")
    return tqdm(iterable, total=total, desc=desc, disable=None if enabled else True, leave=False, dynamic_ncols=True)
