"""Uniform random proposals (the SSD paper's fast backup; acceptance about 0); point masses."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ssd_jax.drafters.base import Proposal
from ssd_jax.sampling.filters import is_key_batch


def random_tokens(key, batch: int, k: int, vocab: int) -> jax.Array:
    """(batch, k) uniform token ids below ``vocab``: the one random proposer (SD's random drafter, and
    SSD's random backup and first round). ``key``: one key, or a (batch,) batch of row keys (row b then
    draws from its own key alone)."""
    if is_key_batch(key):
        return jax.vmap(lambda kb: jax.random.randint(kb, (k,), 0, vocab, jnp.int32))(key)
    return jax.random.randint(key, (batch, k), 0, vocab, jnp.int32)


class RandomDrafter:
    """Uniform random proposals (point masses)."""

    kind = "random"
    compile_s = 0.0

    def __init__(self, k: int, vocab: int):
        self.k, self.vocab = k, vocab

    def start(self, *a, **kw) -> float:
        return 0.0

    def prefill(self) -> None:
        pass

    def precompile(self, *a) -> float:
        return 0.0

    def propose(self, prev_B, cur_B, key, rs, history=None) -> Proposal:
        B = cur_B.shape[0]
        toks = random_tokens(key, B, self.k, self.vocab)
        return Proposal(toks, jnp.full((B,), self.k, jnp.int32), None)

    def commit(self, lengths_B, all_accepted: bool = True) -> None:
        pass
