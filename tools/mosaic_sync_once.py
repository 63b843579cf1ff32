"""Writes the block-sparse Mosaic kernel's "sync once" variant over a copy of its module (an experiment for a GPU
call; `tools/issue16_targets.sh sync-once` runs it).

Today each work item of the kernel starts with the second consumer taking a half-step lag on the schedule barrier
(``offset``) and ends with the first consumer making it up (``resync``), so both consumers write O together while
the tensor cores idle. On random 3% at 32k (one H200, 2026-11-28, `mosaic-profile-random3-32k-*-items_*`) those
two cost 3.5% of the consumers' cycles and ``write`` 2.8%. Each consumer does the same number of handshakes an item
(two a step; the shorter list padded by ``idle``), so the lag can be taken once before the first item and made up
once after the last: the consumers stay half a step apart across items, and one's ``write`` runs under the other's
products. Why this cannot deadlock: across an item boundary the pairing of handshakes is the one inside a list
(consumer 0's next ``S = Q K^T`` handshake pairs with consumer 1's end-of-softmax handshake of its current step),
and the first K / V tiles of an item go into stages both consumers released one step earlier.

Run: ``python tools/mosaic_sync_once.py FILE`` rewrites FILE (a copy of
``pallas_kernels/block_sparse/mosaic_gpu.py``) in place; it fails if the kernel no longer has the expected lines.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jsonl_log import write_atomic  # noqa: E402

REMOVE_OFFSET = '''                with jax.named_scope("offset"):
                    pl.when(wg == 1)(handshake)  # the two consumers run half a step apart
'''
REMOVE_RESYNC = '''                with jax.named_scope("resync"):
                    pl.when(wg == 0)(handshake)

'''
LOOP = '''            if cfg.persistent:
                load_q(Item.of(0))
            lax.fori_loop(0, my_items, run_item, jnp.int32(0))
'''
LOOP_SYNC_ONCE = '''            if cfg.persistent:
                load_q(Item.of(0))
            # The two consumers run half a step apart through all their items (each does the same number of
            # handshakes an item), so the lag is taken once here and made up once after the last item.
            with jax.named_scope("offset"):
                pl.when(wg == 1)(handshake)
            lax.fori_loop(0, my_items, run_item, jnp.int32(0))
            with jax.named_scope("resync"):
                pl.when(wg == 0)(handshake)
'''


def sync_once(text: str) -> str:
    """The module's text with the offset / resync handshakes moved out of the consumers' item loop."""
    for old in (REMOVE_OFFSET, REMOVE_RESYNC, LOOP):
        if text.count(old) != 1:
            raise ValueError(f"the kernel does not hold exactly one copy of:\n{old}")
    return text.replace(REMOVE_OFFSET, "").replace(REMOVE_RESYNC, "").replace(LOOP, LOOP_SYNC_ONCE)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[-1], file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        variant = sync_once(f.read())
    write_atomic(argv[0], lambda f: f.write(variant))
    return 0


if __name__ == "__main__":
    sys.exit(main())
