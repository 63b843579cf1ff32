"""Tensor- and sequence-parallel inference on ``jax.sharding`` meshes: ``make_mesh(tp, sp)``, ``shard_model``
(parameters into their layout; ``mmjax.load(..., mesh=)`` loads them there), and the ``mesh=`` option of
``mmjax.prefill`` / ``decode_step`` / ``generate``."""

from mmjax.parallel.attention import (
    HeadParallel,
    SequenceDecode,
    SequenceHeads,
    SequenceRing,
)
from mmjax.parallel.mesh import devices_mesh, make_mesh
from models.sharding import cache_sharding, shard_model

__all__ = ["HeadParallel", "SequenceDecode", "SequenceHeads", "SequenceRing", "cache_sharding", "devices_mesh", "make_mesh", "shard_model"]
