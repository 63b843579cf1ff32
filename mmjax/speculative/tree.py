"""Dynamic draft trees (EAGLE-2 style): configuration, expansion bookkeeping and tree selection.

A speculative step grows a *pool* of candidate tokens level by level. Level 1 holds the draft's
``top_k`` best next tokens after the root (the last emitted token). Each later level expands the
``top_k`` pool nodes of the previous level with the highest cumulative log-probability (the
*frontier*); each frontier node proposes ``top_k`` children, so the pool holds
``top_k + (depth - 1) * top_k**2`` nodes. The tree that the target verifies is the root plus the
``total_tokens`` pool nodes with the highest cumulative log-probability (ancestor-closed, since a
child never scores above its parent), in topological order (by depth, then pool index).

All functions are pure and shape-static; batch rows have independent trees.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """``total_tokens``-``depth``-``top_k``: draft tokens verified per step, draft levels, branching.

    The paper's settings are ``TreeConfig(30, 4, 8)`` and ``TreeConfig(48, 5, 10)``.
    """

    total_tokens: int = 30
    depth: int = 4
    top_k: int = 8

    def __post_init__(self):
        for name in ("total_tokens", "depth", "top_k"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TreeConfig.{name}: expected a positive int, got {getattr(self, name)!r}")
        if self.total_tokens > self.pool_size:
            raise ValueError(f"TreeConfig.total_tokens: expected at most the pool size top_k + (depth-1)*top_k**2 = "
                             f"{self.pool_size}, got {self.total_tokens}")

    @classmethod
    def parse(cls, text: str) -> "TreeConfig":
        """``"30-4-8"`` -> TreeConfig(30, 4, 8)."""
        try:
            a, b, c = (int(x) for x in str(text).split("-"))
        except ValueError:
            raise ValueError(f"tree: expected 'total_tokens-depth-top_k' such as '30-4-8', got {text!r}") from None
        return cls(a, b, c)

    @property
    def pool_size(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def expanded_slots(self) -> int:
        """Draft KV slots used by the frontier entries of levels 1 .. depth-1."""
        return (self.depth - 1) * self.top_k

    @property
    def n_tree(self) -> int:
        """Tokens in the verified tree, root included."""
        return self.total_tokens + 1

    def __str__(self) -> str:
        return f"{self.total_tokens}-{self.depth}-{self.top_k}"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Pool:
    """Candidate nodes. tokens/parent/depth: int32 [B, N]; score: float32 [B, N] cumulative log-prob.
    ``parent`` is the parent's pool index (-1 for the root's children); unfilled nodes score -inf."""

    tokens: jax.Array
    score: jax.Array
    parent: jax.Array
    depth: jax.Array


def empty_pool(batch: int, tree: TreeConfig) -> Pool:
    n = tree.pool_size
    z = jnp.zeros((batch, n), jnp.int32)
    return Pool(z, jnp.full((batch, n), -jnp.inf, jnp.float32), z - 1, z)


def add_level(pool: Pool, offset: int, tokens, score, parent, depth: int) -> Pool:
    """Write ``m`` nodes (tokens/score/parent: [B, m]) at pool indices ``offset .. offset + m - 1``."""
    put = lambda a, x: jax.lax.dynamic_update_slice_in_dim(a, x.astype(a.dtype), offset, axis=1)
    return Pool(put(pool.tokens, tokens), put(pool.score, score), put(pool.parent, parent),
                put(pool.depth, jnp.full(tokens.shape, depth, jnp.int32)))


def level_offset(level: int, tree: TreeConfig) -> int:
    """Pool index of the first node of ``level`` (1-based)."""
    return 0 if level == 1 else tree.top_k + (level - 2) * tree.top_k ** 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tree:
    """The verified tree (index 0 = root). tokens/parent/depth: int32 [B, n] (root: parent 0, depth 0);
    ancestors: bool [B, n, n], ``ancestors[b, i, j]`` = j is i or an ancestor of i; path: int32
    [B, n, depth + 1], ``path[b, i, d]`` = ancestor of i at depth d (i itself at its depth, then i
    repeated); children: int32 [B, n, top_k] children of each node ordered by pool index (= draft
    rank for siblings), -1 padded."""

    tokens: jax.Array
    parent: jax.Array
    depth: jax.Array
    ancestors: jax.Array
    path: jax.Array
    children: jax.Array


def select_tree(pool: Pool, root_tokens: jax.Array, tree: TreeConfig) -> Tree:
    """Root + the ``total_tokens`` best pool nodes. root_tokens: int [B]."""
    b, n_pool = pool.tokens.shape
    n = tree.n_tree
    idx = jnp.broadcast_to(jnp.arange(n_pool, dtype=jnp.int32), (b, n_pool))
    # best score first; on ties the shallower node (a parent ties with a child of probability 1) and
    # then the lower pool index, so the selection is ancestor-closed.
    order = jax.vmap(lambda s, d, i: jnp.lexsort((i, d, -s)))(pool.score, pool.depth, idx)
    chosen = order[:, :tree.total_tokens]
    topo_key = jnp.take_along_axis(pool.depth, chosen, 1) * n_pool + chosen
    chosen = jnp.take_along_axis(chosen, jnp.argsort(topo_key, axis=1), 1)  # [B, n-1] pool indices
    # pool index -> tree index (root's children have pool parent -1 -> tree 0)
    to_tree = jnp.zeros((b, n_pool + 1), jnp.int32)
    to_tree = to_tree.at[jnp.arange(b)[:, None], chosen + 1].set(jnp.arange(1, n, dtype=jnp.int32)[None])
    take = lambda a: jnp.take_along_axis(a, chosen, 1)
    parent = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.take_along_axis(to_tree, take(pool.parent) + 1, 1)], 1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), take(pool.depth)], 1)
    tokens = jnp.concatenate([root_tokens.reshape(b, 1).astype(jnp.int32), take(pool.tokens)], 1)
    # ancestors at each depth, walking up from every node
    cols, cur = [], jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n))
    anc = jnp.zeros((b, n, n), bool)
    for _ in range(tree.depth + 1):
        anc = anc | jax.nn.one_hot(cur, n, dtype=bool)
        cols.append(cur)
        cur = jnp.take_along_axis(parent, cur, 1)
    walk = jnp.stack(cols, -1)  # [B, n, depth+1]: self, parent, grandparent, ...
    # path[i, d] = ancestor at depth d: walk[i, depth(i) - d] for d <= depth(i), else i
    d_idx = depth[:, :, None] - jnp.arange(tree.depth + 1)[None, None, :]
    path = jnp.where(d_idx >= 0, jnp.take_along_axis(walk, jnp.clip(d_idx, 0, tree.depth), 2), jnp.arange(n)[None, :, None])
    # children: nodes whose parent is i, by tree index (topological order keeps pool order within a level)
    is_child = (parent[:, None, :] == jnp.arange(n)[None, :, None]) & (jnp.arange(n)[None, None, :] > 0)
    rank = jnp.cumsum(is_child, axis=2) - 1
    slot = jnp.where(is_child & (rank < tree.top_k), rank, tree.top_k)
    children = jnp.full((b, n, tree.top_k + 1), -1, jnp.int32)
    bi, ii, jj = jnp.meshgrid(jnp.arange(b), jnp.arange(n), jnp.arange(n), indexing="ij")
    children = children.at[bi, ii, slot].max(jnp.where(is_child, jj, -1))[:, :, :tree.top_k]
    return Tree(tokens, parent, depth, anc, path.astype(jnp.int32), children)
