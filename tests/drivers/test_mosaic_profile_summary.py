"""tools/mosaic_profile.py's `summarise`: a Mosaic GPU profiler trace (one tid per warpgroup and CTA, nested
begin / end events, timestamps in cycles / 1000) -> cycles per named region and role."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
from mosaic_profile import summarise  # noqa: E402


def _ranges(tid, spans):
    """Events of one warpgroup from (name, begin cycle, end cycle, children) tuples."""
    events = []

    def walk(name, b, e, children):
        events.append({"name": name, "ph": "B", "ts": b / 1e3, "tid": tid, "pid": 1})
        for child in children:
            walk(*child)
        events.append({"name": name, "ph": "E", "ts": e / 1e3, "tid": tid, "pid": 1})

    for span in spans:
        walk(*span)
    return events


def test_summarise_attributes_nested_regions_to_roles():
    # Two CTAs: warpgroups 0 and 1 consume (tids 1, 2 and 4, 5), warpgroup 2 produces (tids 3, 6).
    consumer = [("qk", 0, 100, [("sched", 10, 40, [])]), ("softmax", 100, 400, [])]
    producer = [("k_free", 0, 50, []), ("v_free", 200, 400, [])]
    events = []
    for cta in range(2):
        events += _ranges(3 * cta + 1, consumer) + _ranges(3 * cta + 2, consumer) + _ranges(3 * cta + 3, producer)
    out = summarise({"traceEvents": events})
    c, p = out["consumer"], out["producer"]
    assert c["warpgroups"] == 4 and p["warpgroups"] == 2
    assert c["cycles"] == pytest.approx(4 * 400) and p["cycles"] == pytest.approx(2 * 400)
    assert c["regions"]["qk"]["ranges"] == 4 and c["regions"]["qk"]["mean_cycles"] == pytest.approx(100)
    assert c["regions"]["qk/sched"]["median_cycles"] == pytest.approx(30)
    assert c["regions"]["softmax"]["share"] == pytest.approx(0.75)
    assert p["regions"]["v_free"]["share"] == pytest.approx(0.5)
    assert set(p["regions"]) == {"k_free", "v_free"}
    assert c["outside"] == pytest.approx(0.0)  # qk and softmax cover each consumer's span
    assert p["outside"] == pytest.approx(1 - 50 / 400 - 200 / 400)
