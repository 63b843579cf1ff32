"""Fault injection for saves: interrupt a save at its n-th step, for every n.

A *step* is one call, made by `models.files`, of ``os.replace``, ``os.fsync``, ``os.chmod``,
``tempfile.mkstemp`` or ``tempfile.mkdtemp``, or one call of an extra function the test names
(an orbax save, ``np.savez``). `interrupt_every_step` first counts the steps of a clean save,
then reruns the save once per step with that step raising `Interrupted`, and after each run
calls ``check(n)``, which must find the old artefact or the new one, whole (or a clear error
the test expects), never a mixture.
"""

from __future__ import annotations

import os
import sys
import tempfile

import models.files

FILES_MODULE = os.path.abspath(models.files.__file__)


class Interrupted(RuntimeError):
    """Raised by the step a test interrupts."""


class _Steps:
    def __init__(self):
        self.count = 0
        self.fail_at = None

    def hit(self, what):
        self.count += 1
        if self.count == self.fail_at:
            raise Interrupted(f"interrupted at step {self.count} ({what})")


def _install(monkeypatch, steps: _Steps, extras):
    def wrap(owner, name, only_from_files):
        real = getattr(owner, name)

        def fake(*args, **kwargs):
            caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
            if not only_from_files or caller == FILES_MODULE:
                steps.hit(f"{getattr(owner, '__name__', owner)}.{name}")
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, fake)

    for owner, name in ((os, "replace"), (os, "fsync"), (os, "chmod"), (tempfile, "mkstemp"), (tempfile, "mkdtemp")):
        wrap(owner, name, True)
    for owner, name in extras:
        wrap(owner, name, False)


def interrupt_every_step(monkeypatch, save, check, reset=None, extras=()) -> tuple[int, list]:
    """Count the steps of a clean ``save()``, then for each step n: interrupt ``save()`` at step
    n and call ``check(n)``, which returns what it found ("old", "new", "none", ...). When it
    found anything but "old", ``reset()`` (if given) restores the old artefact first. Returns
    (number of steps, the findings). ``extras``: (object, attribute) functions counted as
    steps wherever they are called from."""
    steps = _Steps()
    with monkeypatch.context() as m:
        _install(m, steps, extras)
        save()
    total = steps.count
    assert total > 0
    found = ["new"]
    for n in range(1, total + 1):
        if reset is not None and found[-1] != "old":
            reset()
        steps = _Steps()
        steps.fail_at = n
        with monkeypatch.context() as m:
            _install(m, steps, extras)
            try:
                save()
            except Interrupted:
                pass
            else:
                raise AssertionError(f"step {n} of {total} was not reached")
        found.append(check(n))
    return total, found[1:]
