"""A progress bar: tqdm when it is installed, else a one-line bar on stderr."""

from __future__ import annotations

import sys


class _StderrBar:
    def __init__(self, total: int, desc: str):
        self.total, self.n, self.desc, self.note = total, 0, desc, ""
        self._draw()

    def _draw(self) -> None:
        width = 30
        done = int(width * self.n / max(self.total, 1))
        sys.stderr.write(f"\r{self.desc} [{'#' * done}{'.' * (width - done)}] {self.n}/{self.total} {self.note}"[:120])
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._draw()

    def set_postfix_str(self, note: str) -> None:
        self.note = note
        self._draw()

    def close(self) -> None:
        sys.stderr.write("\n")
        sys.stderr.flush()


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, note: str) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool = True):
    """An object with ``update(n)``, ``set_postfix_str(s)`` and ``close()``."""
    if not enabled:
        return _Silent()
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _StderrBar(total, desc)
    return tqdm(total=total, desc=desc)
