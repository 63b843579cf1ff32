"""The Triton kernel lowers for an abstract H100 on a CPU machine (catches GPU lowering
errors in CI; the Triton-to-PTX compile itself needs a GPU)."""

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import BlockLayout, block_sparse_attention


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _lower(q_shape, k_shape, dtype, layout, **kw):
    dev = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
    f = jax.jit(lambda q, k, v, lay: block_sparse_attention(q, k, v, lay, implementation="triton", **kw))
    args = (jax.ShapeDtypeStruct(q_shape, dtype), jax.ShapeDtypeStruct(k_shape, dtype),
            jax.ShapeDtypeStruct(k_shape, dtype), jax.tree.map(_abstract, layout))
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = f.trace(*args).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "block_sparse_attention" in text and "__gpu$xla.gpu.triton" in text
    return text


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("d,bk", [(128, 64), (64, 128), (80, 64)])
def test_dense_layout_lowers_for_h100(dtype, d, bk):
    layout = BlockLayout.dense_causal(1000, 1500, block_q=128, block_k=bk)
    _lower((1, 1000, 28, d), (1, 1500, 4, d), dtype, layout)


def test_permuted_layout_with_columns_lowers_for_h100():
    b, t, s, n = 2, 700, 900, 8
    nq = -(-t // 128)
    z = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731  (shapes only; nothing runs)
    layout = BlockLayout(kv_blocks=z(b, n, nq, 5), kv_block_count=z(b, n, nq), kv_columns=z(b, 1, nq, 70),
                         kv_column_count=z(b, 1, nq), q_perm=z(b, n, t), kv_perm=z(1, n, s),
                         block_q=128, block_k=64, q_len=t, kv_len=s)
    _lower((b, t, n, 128), (b, s, 2, 128), jnp.bfloat16, layout, num_warps=8, num_stages=2)


@pytest.mark.parametrize("gap,window", [(192, 0), (0, 192)])
def test_layout_with_causal_gap_or_window_lowers_for_h100(gap, window):
    b, t, s, n = 1, 700, 900, 4
    nq = -(-t // 128)
    z = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    layout = BlockLayout(kv_blocks=z(b, n, nq, 5), kv_block_count=z(b, n, nq), q_perm=z(b, n, t),
                         kv_perm=z(1, n, s), block_q=128, block_k=64, q_len=t, kv_len=s, gap=gap, window=window)
    _lower((b, t, n, 128), (b, s, 2, 128), jnp.bfloat16, layout)
