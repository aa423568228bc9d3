"""The draft-model drafter: a small LM with its own per-row KV cache; K draft steps are ONE
jitted call (``lax.scan``). The first step feeds ``[prev, cur]`` at slots ``len-1, len`` when
some row accepted all K proposals last round (the draft never fed its K-th token); rewriting
the last context token is idempotent, so after verification the draft cache is rolled back by
setting its lengths to the target's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.compile import Compiled, program_factory
from ssd_jax.drafters.base import Proposal, align_vocab
from ssd_jax.models import llama
from ssd_jax.sampling.filters import RowSampling, filter_logprobs, sample, split


def draft_prefill(params, cache, tokens_BxT, n_valid_B, *, cfg):
    _, cache = llama.forward(params, cfg, tokens_BxT, cache)
    return cache.with_lengths(cache.lengths + n_valid_B)


def draft_loop(params, cache, prev_B, cur_B, keys, draw, *, cfg, vocab, catch_up):
    """``len(keys)`` autoregressive draft steps after ``cur`` in one program (``lax.scan``): the one
    K-step draft loop, used by SD's drafter and SSD's neural backup.

    ``draw(key, logits_BxV, d)`` samples step ``d``: (tokens (B,), log-probs (B, V) or None).
    ``catch_up`` (static) feeds ``[prev, cur]`` in the first step instead of ``[cur]``: needed
    when some row accepted all K proposals last round, so the draft never fed its K-th token.
    On XLA:CPU a 2-token step costs about two 1-token steps, so the 1-token variant is used
    whenever no row needs the catch-up. Cache lengths in = committed context length; out =
    in + K. Returns (tokens (B, K), q (B, K, V) | None, cache).
    """
    start = cache.lengths
    if catch_up:
        h, cache = llama.forward(
            params, cfg, jnp.stack([prev_B, cur_B], axis=1), cache.with_lengths(start - 1)
        )
        h_last = h[:, 1]
    else:
        h, cache = llama.forward(params, cfg, cur_B[:, None], cache)
        h_last = h[:, 0]
    cache = cache.with_lengths(start + 1)
    tok0, q0 = draw(keys[0], align_vocab(llama.logits(params, cfg, h_last), vocab), 0)
    k = keys.shape[0]
    if k == 1:
        return tok0[:, None], None if q0 is None else q0[:, None], cache

    def body(carry, xs):
        cache, tok = carry
        key_i, d = xs
        h, cache = llama.forward(params, cfg, tok[:, None], cache)
        cache = cache.with_lengths(cache.lengths + 1)
        nxt, q = draw(key_i, align_vocab(llama.logits(params, cfg, h[:, 0]), vocab), d)
        return (cache, nxt), (nxt, q)

    (cache, _), (toks, qs) = jax.lax.scan(body, (cache, tok0), (keys[1:], jnp.arange(1, k)))
    tokens = jnp.concatenate([tok0[:, None], toks.T], axis=1)
    q = None if q0 is None else jnp.concatenate([q0[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return tokens, q, cache


def draft_propose(
    params, cache, prev_B, cur_B, key, rs: RowSampling, *, cfg, k, vocab, needs_filter, catch_up, greedy=False
):
    """SD's K draft tokens after ``cur``, sampled from the draft's filtered distribution (see :func:`draft_loop`).
    ``key``: one key, or a (B,) batch of row keys. ``greedy`` (static; every row at temperature 0):
    the argmax, with no distribution (q is None) and no random draws."""

    def draw(key, lg, d):
        if greedy:
            return jnp.argmax(lg, axis=-1).astype(jnp.int32), None
        return sample(key, lg, rs, needs_filter), filter_logprobs(lg, rs, needs_filter)

    return draft_loop(
        params, cache, prev_B, cur_B, split(key, k), draw, cfg=cfg, vocab=vocab, catch_up=catch_up
    )


@program_factory
def draft_steps(cfg, k, vocab, needs_filter):
    pre = Compiled(functools.partial(draft_prefill, cfg=cfg), donate_argnums=(1,), name="draft_prefill")
    prop = {
        c: Compiled(
            functools.partial(
                draft_propose, cfg=cfg, k=k, vocab=vocab, needs_filter=needs_filter, catch_up=c
            ),
            donate_argnums=(1,),
            name=f"draft_propose{'_catch_up' if c else ''}",
        )
        for c in (False, True)
    }
    return pre, prop


class ModelDrafter:
    """A draft language model with its own per-row KV cache."""

    kind = "model"

    def __init__(self, model, k: int, target_vocab: int, needs_filter: bool):
        self.model = model
        self.k = k
        self._pre, self._prop = draft_steps(model.cfg, k, target_vocab, needs_filter)
        self.cache: llama.KVCache | None = None

    @property
    def compile_s(self) -> float:
        return self._pre.compile_s + sum(p.compile_s for p in self._prop.values())

    def start(self, tokens_BxT, n_valid_B, max_len: int, put) -> float:
        """Allocate the draft cache and compile its prefill; returns seconds spent compiling."""
        from ssd_jax.parallel.placement import cache_for as _cache_for

        B = tokens_BxT.shape[0]
        self.cache = _cache_for(self.model, B, max_len)
        self._put = put
        self._prefill_args = (put(tokens_BxT), put(n_valid_B))
        self._n_draft = put(np.full((B,), self.k, np.int32))
        self._catch_up = False  # prefill writes the whole prompt; cur is the only new token
        return self._pre.precompile(self.model.params, self.cache, *self._prefill_args)

    def prefill(self) -> None:
        """Write the prompts into the draft cache (timed with the target's prefill)."""
        self.cache = self._pre(self.model.params, self.cache, *self._prefill_args)
        del self._prefill_args

    def precompile(self, prev, cur, key, rs) -> float:
        return sum(
            p.precompile(self.model.params, self.cache, prev, cur, key, rs) for p in self._prop.values()
        )

    def propose(self, prev_B, cur_B, key, rs, history=None) -> Proposal:
        prop = self._prop[self._catch_up]
        tokens, q, self.cache = prop(self.model.params, self.cache, prev_B, cur_B, key, rs)
        return Proposal(tokens, self._n_draft, q)

    def commit(self, lengths_B, all_accepted: bool = True) -> None:
        """Roll the draft cache to the committed context length (per row).

        ``all_accepted``: some row accepted every proposal, so the next round must catch up.
        """
        self.cache = self.cache.with_lengths(lengths_B)
        self._catch_up = all_accepted
