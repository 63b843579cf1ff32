"""Tree-decode attention: T <= 64 new tokens over a long cache, split-K over the keys."""

from pallas_kernels.tree_decode.api import default_implementation, tree_decode_attention
from pallas_kernels.tree_decode.reference import tree_decode_attention_reference

__all__ = ["default_implementation", "tree_decode_attention", "tree_decode_attention_reference"]
