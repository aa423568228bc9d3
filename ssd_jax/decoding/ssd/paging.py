"""SSD's paged draft cache and a preempted row's state.

The draft's pool has the target's blocks, with the same ids (a block holds the draft's keys and values
of the tokens the target's block of that id holds, so a prefix-cache hit serves both models), plus
``tree_blocks`` blocks of its own per slot for the speculation tree. A slot's draft block table is its
target table followed by its tree blocks, so the tree region starts at ``tree_base`` = the target
table's width in slots, past every slot a sequence may hold. The tree blocks are never shared, cached
or given back: each build rewrites them before any query reads them.

A preempted row keeps its speculation (tokens, the draft's q, hit flag and post-miss flag) and its
(cur, prev, step) as device copies, so that re-admitted it verifies what it would have verified had it
never left: nothing is read on the host, which is what lets a process that holds only one of the two
meshes run the same preemption.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ssd_jax.models import llama


@dataclasses.dataclass(frozen=True)
class DraftPages:
    """Where the draft's blocks are: ``n_blocks`` shared with the target's ids, then ``tree_blocks`` per
    slot; ``n_blocks + batch * tree_blocks`` (the pool's size) is the draft's empty entry."""

    n_blocks: int
    block_size: int
    batch: int
    per_row: int  # the target table's columns
    tree_blocks: int

    @property
    def tree_base(self) -> int:
        return self.per_row * self.block_size

    @property
    def empty(self) -> int:
        return self.n_blocks + self.batch * self.tree_blocks

    def cache(self, cfg) -> llama.KVCache:
        width = (self.per_row + self.tree_blocks) * self.block_size
        return llama.init_paged_cache(cfg, self.batch, width, self.empty, self.block_size)

    def table(self, target_table: np.ndarray) -> np.ndarray:
        """The draft's block table for the target's: its entries (an empty one made the draft's empty
        entry: the target's would name slot 0's first tree block), then each slot's tree blocks."""
        n, tb = self.n_blocks, self.tree_blocks
        tree = n + np.arange(self.batch)[:, None] * tb + np.arange(tb)[None, :]
        main = np.where(target_table >= n, self.empty, target_table)
        return np.concatenate([main, tree], axis=1).astype(np.int32)


def draft_pages(paged: tuple[int, int], batch: int, max_len: int, tree_slots: int) -> DraftPages:
    n_blocks, bs = paged
    return DraftPages(n_blocks, bs, batch, -(-max_len // bs), -(-tree_slots // bs))


@jax.jit
def take_row(tree, b):
    """Row ``b`` of every leaf (a preempted slot's state, kept on its device)."""
    return jax.tree.map(lambda x: x[b], tree)


@jax.jit
def put_row(tree, row, b):
    """``tree`` with row ``b`` of every leaf set to ``row``'s (a re-admitted slot's state restored)."""
    return jax.tree.map(lambda x, y: x.at[b].set(y.astype(x.dtype)), tree, row)
