"""Bidirectional attention inside the tiles of a vision tower (windows, frames, images), in XLA or cuDNN.

A vision tower attends within independent tiles: Qwen2.5-VL's windows and frames, SigLIP's images. The XLA
form computes float32 scores ``[tiles, heads, P, P]`` and a softmax over them, which makes the towers
memory-bound on a GPU; cuDNN's flash attention (``jax.nn.dot_product_attention``) keeps the scores on chip.
``attention_form`` picks the form: "auto" is cuDNN for bf16 / fp16 weights on a GPU when the head dim is a
multiple of 8 (at most 128), XLA otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ATTENTIONS = ("auto", "xla", "cudnn")


def attention_form(attention: str, dtype, head_dim: int) -> str:
    """"xla" or "cudnn" for ``attention`` in `ATTENTIONS` and the tower's weight dtype (ValueError naming the
    argument for an unknown name, or "cudnn" where cuDNN cannot run it)."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention: expected one of {ATTENTIONS}, got {attention!r}")
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    fits = head_dim % 8 == 0 and head_dim <= 128
    if attention == "auto":
        return "cudnn" if half and fits and jax.default_backend() == "gpu" else "xla"
    if attention == "cudnn" and not (half and fits):
        raise ValueError(f"attention: 'cudnn' needs bfloat16 / float16 weights and a head dim that is a multiple of 8 "
                         f"<= 128; got {jnp.dtype(dtype).name} weights, head dim {head_dim}")
    return attention


def tile_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float, lengths: jax.Array | None,
                   attention: str) -> jax.Array:
    """Softmax attention inside each tile, no mask but the tile's length.

    q, k, v: ``[B, P, N, D]`` (B tiles of P slots); lengths: int32 ``[B]`` valid slots of each tile (a prefix;
    the rest is padding that no query sees), or None (every slot valid); attention: "xla" | "cudnn" (from
    `attention_form`). Returns ``[B, P, N, D]`` in v's dtype; rows of padding slots are not defined.
    """
    if attention == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, scale=scale, query_seq_lengths=lengths,
                                            key_value_seq_lengths=lengths, implementation="cudnn")
    s = jnp.einsum("bqnd,bknd->bnqk", q, k, preferred_element_type=jnp.float32) * scale
    if lengths is not None:
        s = jnp.where((jnp.arange(k.shape[1]) < lengths[:, None])[:, None, None, :], s, -jnp.inf)
    a = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    return jnp.einsum("bnqk,bknd->bqnd", a, v, preferred_element_type=jnp.float32).astype(v.dtype)
