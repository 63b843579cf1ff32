"""`ranges_to_lists` against the union of its ranges written out in NumPy: overlapping, empty, negative, past the last
block and wider than their group's bound; several groups with their own bounds; leading batch axes."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from mmjax.sparse.block_lists import ranges_to_lists


def _union(groups, nk):
    """NumPy: per row, the sorted distinct blocks of every range (clipped to [0, nk), a range keeping its first
    max_width blocks from max(lo, 0))."""
    lead = groups[0][0].shape[:-1]
    out = np.empty(lead, object)
    for idx in np.ndindex(*lead):
        blocks = set()
        for lo, hi, w in groups:
            for a, b in zip(lo[idx], hi[idx]):
                a = max(int(a), 0)
                blocks.update(x for x in range(a, min(int(b), a + w - 1, nk - 1) + 1))
        out[idx] = sorted(blocks)
    return out


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_ranges_to_lists_is_the_sorted_union(data):
    nk = data.draw(st.integers(1, 40))
    lead = tuple(data.draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    groups = []
    for _ in range(data.draw(st.integers(1, 4))):
        r = data.draw(st.integers(1, 8))  # up to 32 ranges a row: both of ranges_to_lists' forms
        width = data.draw(st.integers(1, 50))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
        lo = rng.integers(-5, nk + 5, lead + (r,)).astype(np.int32)
        hi = (lo + rng.integers(-3, width + 5, lead + (r,))).astype(np.int32)  # some empty, some too wide
        groups.append((lo, hi, width))
    blocks, count = ranges_to_lists([(jnp.asarray(lo), jnp.asarray(hi), w) for lo, hi, w in groups], nk)
    blocks, count = np.asarray(blocks), np.asarray(count)
    assert blocks.shape == lead + (sum(lo.shape[-1] * min(w, nk) for lo, _, w in groups),)
    want = _union(groups, nk)
    for idx in np.ndindex(*lead):
        n = len(want[idx])
        assert count[idx] == n
        np.testing.assert_array_equal(blocks[idx][:n], want[idx])
        assert (blocks[idx][n:] == 0).all()
