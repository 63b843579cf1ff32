"""Tree-decode attention: T <= 64 new tokens over a long cache, split-K over the keys."""

from pallas_kernels.tree_decode.api import tree_decode_attention

__all__ = ["tree_decode_attention"]
