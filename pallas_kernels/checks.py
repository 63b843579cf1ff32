"""Argument checks shared by the kernel entry points (raised before anything is traced)."""

from __future__ import annotations


def fmt_shape(shape) -> str:
    """(2, 3) -> "[2, 3]" for error messages."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_int(name: str, value, lo: int) -> None:
    """``value`` must be a Python int (not a bool) >= ``lo``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name}: expected an int >= {lo}; received {value!r}")


def check_pow2(name: str, value, lo: int = 16) -> None:
    """``value`` must be a Python int power of two >= ``lo``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or value & (value - 1):
        raise ValueError(f"{name}: expected a power of two >= {lo}; received {value!r}")
