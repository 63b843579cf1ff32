"""Progress bars for long work: tqdm on stderr, quiet when stderr is not a terminal."""

from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(total: int | None, desc: str, enabled: bool = True, *, unit: str = "it") -> tqdm:
    """A tqdm bar on stderr (``update(n)``, ``set_postfix_str(s)``, ``close()``, context manager).

    Shown when ``enabled`` and stderr is a terminal; otherwise a silent bar with the same
    interface (tqdm's ``disable``)."""
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None if enabled else True,
                dynamic_ncols=True)
