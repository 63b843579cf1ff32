"""Each pattern `bench patterns` times on a GPU, end to end: its layout built on the video-like input and `attend`
with the default kernels (on Hopper the Mosaic GPU kernel with its row-range pass, fused shared columns and
permutations) against `attend` on the reference, and Grid(frame) inside each boundary wrapper: `pytest -m gpu`."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mmjax.drivers.bench.patterns import frame_grid_patterns, gpu_patterns
from mmjax.sparse.layouts import KernelOptions, attend
from mmjax.sparse.modality import Modality
from mmjax.sparse.patterns import AShape, Grid, KBoundary, QBoundary, TwoDBoundary
from mmjax.sparse.synthetic import video_qkv
from tests.pallas_kernels.helpers import rel_err

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU")

S = 8192
# beside them Grid at the input's frame stride (16 x 16 tokens): one key order for every head (kv_perm [1, 1, S])
PATTERNS = dict(gpu_patterns(), **frame_grid_patterns())


@pytest.fixture(scope="module")
def qkv():
    return video_qkv(jax.random.PRNGKey(3), S, heads=8, kv_heads=2, head_dim=128)


def _attend(q, k, v, layout, options: KernelOptions = KernelOptions()):
    return jax.jit(lambda q, k, v, lay: attend(q, k, v, lay, options))(q, k, v, layout)


def _assert_matches_the_reference(out, lse, q, k, v, layout):
    """out / lse of an `attend` on the GPU kernels against `attend` on the reference of ``layout``."""
    ref, ref_lse = _attend(q, k, v, layout, KernelOptions(implementation="reference"))
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out, ref) < 2e-2
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], rtol=2e-3, atol=2e-3)


def _boundary_layout(q, k, wrap: str):
    """Grid(frame) inside a boundary wrapper ("k", "q" or "2d") over a 512-token text prefix, then video."""
    kinds = np.ones((1, S), np.int32)
    kinds[0, :512] = 0
    mod = Modality.from_token_types(kinds, names=("text", "video"), frame_tokens=256)
    g = Grid(stride="frame", last_q=64)
    text = AShape(sink=128, local=1024)
    w = {"k": KBoundary(g), "q": QBoundary({"video": g, "text": text}),
         "2d": TwoDBoundary({("video", "video"): g}, default=text)}[wrap]
    return jax.jit(lambda q, k: w.build_layout(q, k, modality=mod))(q, k)


@needs_gpu
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_pattern_attend_matches_the_reference(qkv, name):
    q, k, v = qkv
    layout = jax.jit(PATTERNS[name].build_layout)(q, k)
    _assert_matches_the_reference(*_attend(q, k, v, layout), q, k, v, layout)


@needs_gpu
@pytest.mark.parametrize("wrap", ["k", "q", "2d"])
def test_frame_grid_inside_a_boundary_matches_the_reference(qkv, wrap):
    """Grid(frame) inside each boundary wrapper (a 512-token text prefix, then video): packed keys, the horizontal
    lines over their own key order (with TwoDBoundary the valid keys first), through the default kernels."""
    q, k, v = qkv
    layout = _boundary_layout(q, k, wrap)
    _assert_matches_the_reference(*_attend(q, k, v, layout), q, k, v, layout)


@needs_gpu
@pytest.mark.parametrize("seed,every_head_finds_the_frame", [(3, False), (4, True)])
def test_searched_grid_with_the_frame_known_matches_the_reference(seed, every_head_finds_the_frame):
    """Grid with searched strides, the frame size (256) known: `Grid.attend` runs Grid(frame)'s layout where every
    head finds 256 (seed 4; one key order, strided rows) and the searched layout where one does not (seed 3, a head
    finds 128), on the default kernels, against `attend` on the reference of that layout."""
    q, k, v = video_qkv(jax.random.PRNGKey(seed), S, heads=8, kv_heads=2, head_dim=128)
    mod = Modality.from_token_types(np.ones((1, S), np.int32), names=("text", "video"), frame_tokens=256)
    g = gpu_patterns()["Grid"]
    assert g.frame_guess(S, mod) == 256
    found = np.asarray(jax.jit(g.estimate)(q, k)[0])
    assert bool((found == 256).all()) == every_head_finds_the_frame
    out, lse = jax.jit(lambda q, k, v: g.attend(q, k, v, modality=mod))(q, k, v)
    expected = Grid(stride=256, last_q=64) if every_head_finds_the_frame else g
    _assert_matches_the_reference(out, lse, q, k, v, jax.jit(expected.build_layout)(q, k))


@needs_gpu
@pytest.mark.parametrize("name", ["Grid", "Grid(frame)", "q", "2d"])
def test_parts_merged_in_launch_match_the_reference(qkv, name):
    """A LayoutSet's parts each merging the result so far in before their store (``merge_in_launch``: Grid's band,
    its lines on strided rows or gathered rows, its horizontal lines' rows), and Grid(frame) inside QBoundary /
    TwoDBoundary (each row kind's parts merged on its rows, a row mask in the launch), against `attend` on the
    reference."""
    q, k, v = qkv
    layout = _boundary_layout(q, k, name) if name in ("q", "2d") else jax.jit(PATTERNS[name].build_layout)(q, k)
    _assert_matches_the_reference(*_attend(q, k, v, layout, KernelOptions(merge_in_launch=True)), q, k, v, layout)


@needs_gpu
def test_merge_in_launch_copies_no_whole_output():
    """Grid(frame) with ``merge_in_launch`` at 32k (its lines on strided rows, merging the band in their launch):
    the horizontal lines' rows are scattered into the lines launch's output in place (`merge.merge_rows` merges
    them outside the scatter's fusion); XLA once copied that whole output first (0.62 ms at 128k on an H100)."""
    s = 32768
    q, k, v = video_qkv(jax.random.PRNGKey(5), s, heads=8, kv_heads=2, head_dim=128)
    layout = jax.jit(PATTERNS["Grid(frame)"].build_layout)(q, k)
    run = jax.jit(lambda q, k, v, lay: attend(q, k, v, lay, KernelOptions(merge_in_launch=True)))
    hlo = run.lower(q, k, v, layout).compile().as_text()
    whole = re.compile(rf"= bf16\[1,{s},8,128\]\S* copy(-start)?\(")
    assert not [line for line in hlo.splitlines() if whole.search(line)]
    assert q.dtype == jnp.bfloat16 and f"bf16[1,{s},8,128]" in hlo  # (the shape is written as the pattern expects)
