"""The paged KV cache's blocks on the host: allocation, automatic prefix caching and the block table.

The device holds one pool of ``n_blocks`` blocks of ``block_size`` slots per model (the target's, and a
draft model's with the same block ids) and a block table per slot (``llama.init_paged_cache``). This
module decides which blocks each sequence gets:

* **Allocation.** A sequence holds the blocks its context and the rounds in flight may write. Blocks are
  taken as it grows and given back when it ends. When none is left the engine preempts its newest
  sequence (:meth:`ssd_jax.engine.core.Engine._preempt`).
* **Prefix caching.** A full block is named by a hash chained over the token ids of every block up to it
  (so equal hashes mean equal prefixes, hence equal keys and values). A finished block stays in the
  cache after its sequence ends, until its slot in the pool is needed (least recently freed first; a
  sequence's last blocks before its first). A new sequence takes every cached block of its prompt's
  prefix and prefills the rest only. Only blocks that lie wholly below a sequence's last cached slot are
  named: the slot before a row's length may still be rewritten (SD's draft catch-up), with the same
  token but a float result that could differ in its last bit.
* **Counts** for ``/metrics`` in vLLM's units: prefix-cache queries and hits in tokens.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

#: slots per block (vLLM's default on GPU)
BLOCK_SIZE = 16


def block_hashes(tokens, n_blocks: int, block_size: int) -> list[bytes]:
    """The chained hashes of the first ``n_blocks`` full blocks of ``tokens``."""
    out, prev = [], b""
    arr = np.asarray(tokens[: n_blocks * block_size], np.int32)
    for i in range(n_blocks):
        prev = hashlib.blake2b(
            prev + arr[i * block_size : (i + 1) * block_size].tobytes(), digest_size=16
        ).digest()
        out.append(prev)
    return out


class BlockPool:
    """``n_blocks`` blocks: reference counts, the free queue (eviction order) and the prefix cache."""

    def __init__(self, n_blocks: int, block_size: int = BLOCK_SIZE, caching: bool = True):
        if n_blocks < 1 or block_size < 1:
            raise ValueError("n_blocks and block_size must be >= 1")
        self.n_blocks, self.block_size, self.caching = n_blocks, block_size, caching
        self.ref = np.zeros(n_blocks, np.int32)
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(n_blocks))
        self.hash_of: dict[int, bytes] = {}
        self.by_hash: dict[bytes, int] = {}
        self.queries = self.hits = 0  # prompt tokens looked up / found cached

    @property
    def n_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """The fraction of blocks a running sequence holds."""
        return 1.0 - len(self.free) / self.n_blocks

    def allocate(self, n: int) -> list[int] | None:
        """``n`` blocks (evicting cached ones, oldest first), or None (nothing taken) if too few are free."""
        if n > len(self.free):
            return None
        out = []
        for _ in range(n):
            b, _ = self.free.popitem(last=False)
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.by_hash[h]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks) -> None:
        """A sequence's blocks back (last first into the free queue, so they are evicted first)."""
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free[b] = None

    def match(self, tokens) -> list[int]:
        """The cached blocks of ``tokens``' longest cached prefix, taken (at least the last token is left
        to prefill: it gives the first new token). Counts the query and the hit."""
        self.queries += len(tokens)
        if not self.caching:
            return []
        out = []
        for h in block_hashes(tokens, (len(tokens) - 1) // self.block_size, self.block_size):
            b = self.by_hash.get(h)
            if b is None:
                break
            if self.ref[b] == 0:
                del self.free[b]
            self.ref[b] += 1
            out.append(b)
        self.hits += len(out) * self.block_size
        return out

    def register(self, blocks, tokens, n_cached_slots: int) -> None:
        """Name the blocks of ``tokens`` that lie wholly below slot ``n_cached_slots - 1`` (see the module
        docstring) so later sequences may share them."""
        if not self.caching:
            return
        n = min(len(blocks), max(0, n_cached_slots - 1) // self.block_size)
        for h, b in zip(block_hashes(tokens, n, self.block_size), blocks):
            if b in self.hash_of or h in self.by_hash:
                continue  # already named (a shared block), or an equal block is cached elsewhere
            self.hash_of[b], self.by_hash[h] = h, b


class Pages:
    """The engine's side of a paged cache: each slot's blocks and the block table the device reads."""

    def __init__(self, pool: BlockPool, batch: int, max_len: int):
        self.pool, self.bs = pool, pool.block_size
        self.per_row = -(-max_len // self.bs)
        self.table = np.full((batch, self.per_row), pool.n_blocks, np.int32)
        self.held: list[list[int]] = [[] for _ in range(batch)]
        self.dirty = True

    def _set(self, slot: int, blocks: list[int]) -> None:
        self.held[slot] = blocks
        self.table[slot] = self.pool.n_blocks
        self.table[slot, : len(blocks)] = blocks
        self.dirty = True

    def admit(self, slot: int, tokens, reserve: int) -> int | None:
        """Blocks for ``tokens`` plus ``reserve`` slots in ``slot``, its cached prefix shared: the number of
        prompt tokens already cached (to skip in the prefill), or None (nothing held) when too few blocks
        are free."""
        q, h = self.pool.queries, self.pool.hits
        hit = self.pool.match(tokens)
        n = min(self.per_row, -(-(len(tokens) + reserve) // self.bs))
        new = self.pool.allocate(max(0, n - len(hit)))
        if new is None:
            self.pool.release(hit)
            self.pool.queries, self.pool.hits = q, h  # asked again when admitted
            return None
        self._set(slot, hit + new)
        return len(hit) * self.bs

    def grow(self, slot: int, n_slots: int) -> bool:
        """Blocks for the first ``n_slots`` slots of ``slot`` (capped at a row's table); False if too few
        are free (nothing taken)."""
        have = len(self.held[slot])
        n = min(self.per_row, -(-n_slots // self.bs)) - have
        if n <= 0:
            return True
        new = self.pool.allocate(n)
        if new is None:
            return False
        self._set(slot, self.held[slot] + new)
        return True

    def name(self, slot: int, tokens, n_cached_slots: int) -> None:
        """Offer ``slot``'s full blocks of ``tokens`` to the prefix cache (:meth:`BlockPool.register`)."""
        self.pool.register(self.held[slot], tokens, n_cached_slots)

    def release(self, slot: int, tokens, n_cached_slots: int) -> None:
        """``slot``'s sequence ended (or was preempted): its full blocks named, every block given back, its
        table row emptied (a free row's writes are dropped)."""
        self.name(slot, tokens, n_cached_slots)
        self.pool.release(self.held[slot])
        self._set(slot, [])

    def take_table(self) -> np.ndarray | None:
        """The block table, when it changed since last taken."""
        if not self.dirty:
            return None
        self.dirty = False
        return self.table.copy()
