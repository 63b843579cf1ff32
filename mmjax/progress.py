"""Progress bars for long work: tqdm on stderr, quiet when stderr is not a terminal."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm.auto import tqdm


def progress_bar(total: int | None = None, desc: str = "", enabled: bool = True, *, iterable: Iterable | None = None,
                 unit: str = "it") -> tqdm:
    """A tqdm bar on stderr over ``iterable``, or a manual one (``update(n)``, ``set_postfix_str(s)``,
    ``close()``; also a context manager) of ``total`` steps.

    Shown when ``enabled`` and stderr is a terminal (tqdm's ``disable=None``), so logs, pipes and CI
    stay clean; ``enabled=False`` silences it.
    """
    if total is not None and (not isinstance(total, int) or isinstance(total, bool) or total < 0):
        raise ValueError(f"total: expected a non-negative int or None, got {total!r}")
    return tqdm(iterable, total=total, desc=desc, unit=unit, file=sys.stderr, disable=None if enabled else True,
                leave=False, dynamic_ncols=True)
