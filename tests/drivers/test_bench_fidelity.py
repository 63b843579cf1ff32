"""`mmjax bench patterns` fidelity section: pattern selection by name (Grid bands of any width)."""

import pytest

from mmjax.drivers.bench.fidelity import fidelity_patterns, select_patterns
from mmjax.sparse.patterns import Grid


def test_select_patterns_by_name_and_grid_bands_of_any_width():
    assert select_patterns(None) == fidelity_patterns() == select_patterns([])
    got = select_patterns(["AShape(128,1024)", "Grid(frame,hvs,local=11264)"])
    assert list(got) == ["AShape(128,1024)", "Grid(frame,hvs,local=11264)"]
    assert got["AShape(128,1024)"] == fidelity_patterns()["AShape(128,1024)"]
    assert got["Grid(frame,hvs,local=11264)"] == Grid(stride="frame", local=11264)
    with pytest.raises(ValueError, match=r"unknown \['Grid\(frame,hv,local=64\)', 'nope'\]"):
        select_patterns(["nope", "Grid(frame,hv,local=64)"])
