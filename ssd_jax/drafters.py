"""Drafters: who proposes the K speculative tokens of a round.

All drafters answer one question per round, for a whole batch: given each row's committed
context and its pending token ``cur`` (sampled but not yet in any KV cache), propose up to K
next tokens. They return ``Proposal(tokens_BxK, n_draft_B, q_BxKxV | None)``; ``q`` is the
filtered draft distribution each token was sampled from, or None for point-mass proposals
(n-gram, random), which the verifier then treats by the point-mass rule.

* :class:`ModelDrafter` - a small LM with its own KV cache. K draft steps are ONE jitted call
  (``lax.scan``). The first step feeds ``[prev, cur]`` at slots ``len-1, len``: rewriting the
  last context token is idempotent, and it fills the slot that is missing when the previous
  round accepted all K tokens (the draft never fed its own K-th token). So after verification
  the draft cache is rolled back by simply setting its lengths to the target's.
* :class:`NgramDrafter` - prompt lookup (vLLM's ``prompt_lookup_min/max``): find the most
  recent earlier occurrence of the context's last n tokens (n from max down to min) and
  propose what followed it. Runs on the host over numpy; rows without a match propose 0.
* :class:`RandomDrafter` - uniform random tokens (the paper's fast SSD backup; acceptance ≈ 0).

The same interface serves SSD's cache-miss fallback.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.models import llama
from ssd_jax.runtime import Compiled
from ssd_jax.sampling import RowSampling, filter_logprobs, sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    tokens: jax.Array  # (B, K) int32
    n_draft: jax.Array  # (B,) int32, real proposals per row (<= K)
    q: jax.Array | None  # (B, K, V) float32 log-probs, or None for point masses


def align_vocab(logits_BxV: jax.Array, vocab: int) -> jax.Array:
    """Pad (with -inf) or cut draft logits to the target's vocabulary size.

    Draft and target share a tokenizer but their embedding tables may be padded differently
    (e.g. 151936 vs 152064 rows): ids beyond the shorter table are padding no tokenizer emits.
    """
    v = logits_BxV.shape[-1]
    if v == vocab:
        return logits_BxV
    if v > vocab:
        return logits_BxV[..., :vocab]
    pad = jnp.full(logits_BxV.shape[:-1] + (vocab - v,), -jnp.inf, logits_BxV.dtype)
    return jnp.concatenate([logits_BxV, pad], axis=-1)


# --- model drafter ------------------------------------------------------------------------


def draft_prefill(params, cache, tokens_BxT, n_valid_B, *, cfg):
    _, cache = llama.forward(params, cfg, tokens_BxT, cache)
    return cache.with_lengths(cache.lengths + n_valid_B)


def draft_propose(params, cache, prev_B, cur_B, key, rs: RowSampling, *, cfg, k, vocab, needs_filter, catch_up):
    """K autoregressive draft steps in one call. Cache lengths in = committed context length.

    ``catch_up`` (static) feeds ``[prev, cur]`` in the first step instead of ``[cur]``: needed
    when some row accepted all K proposals last round, so the draft never fed its K-th token.
    On XLA:CPU a 2-token step costs about two 1-token steps, so the host picks the 1-token
    variant whenever no row needs the catch-up.
    """
    start = cache.lengths
    if catch_up:
        h, cache = llama.forward(params, cfg, jnp.stack([prev_B, cur_B], axis=1), cache.with_lengths(start - 1))
        h_last = h[:, 1]
    else:
        h, cache = llama.forward(params, cfg, cur_B[:, None], cache)
        h_last = h[:, 0]
    cache = cache.with_lengths(start + 1)
    lg = align_vocab(llama.logits(params, cfg, h_last), vocab)

    def draw(key, lg):
        return sample(key, lg, rs, needs_filter), filter_logprobs(lg, rs, needs_filter)

    keys = jax.random.split(key, k)
    tok0, q0 = draw(keys[0], lg)
    if k == 1:
        return tok0[:, None], q0[:, None], cache

    def body(carry, key_i):
        cache, tok = carry
        h, cache = llama.forward(params, cfg, tok[:, None], cache)
        cache = cache.with_lengths(cache.lengths + 1)
        nxt, q = draw(key_i, align_vocab(llama.logits(params, cfg, h[:, 0]), vocab))
        return (cache, nxt), (nxt, q)

    (cache, _), (toks, qs) = jax.lax.scan(body, (cache, tok0), keys[1:])
    tokens = jnp.concatenate([tok0[:, None], toks.T], axis=1)
    q = jnp.concatenate([q0[:, None], jnp.moveaxis(qs, 0, 1)], axis=1)
    return tokens, q, cache


@functools.lru_cache(maxsize=64)
def _draft_steps(cfg, k, vocab, needs_filter):
    pre = Compiled(functools.partial(draft_prefill, cfg=cfg), donate_argnums=(1,), name="draft_prefill")
    prop = {
        c: Compiled(
            functools.partial(draft_propose, cfg=cfg, k=k, vocab=vocab, needs_filter=needs_filter, catch_up=c),
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
        self._pre, self._prop = _draft_steps(model.cfg, k, target_vocab, needs_filter)
        self.cache: llama.KVCache | None = None

    @property
    def compile_s(self) -> float:
        return self._pre.compile_s + sum(p.compile_s for p in self._prop.values())

    def start(self, tokens_BxT, n_valid_B, max_len: int, put) -> float:
        """Allocate the draft cache and compile its prefill; returns seconds spent compiling."""
        from ssd_jax.engine import _cache_for

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
        return sum(p.precompile(self.model.params, self.cache, prev, cur, key, rs) for p in self._prop.values())

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


# --- n-gram (prompt lookup) ---------------------------------------------------------------


def ngram_lookup(history: np.ndarray, k: int, n_min: int, n_max: int) -> np.ndarray:
    """Tokens that followed the most recent earlier occurrence of the history's last n tokens.

    Tries n = n_max down to n_min; returns up to k tokens (empty if nothing matches).
    """
    L = len(history)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = history[L - n :]
        windows = np.lib.stride_tricks.sliding_window_view(history[: L - 1], n)  # starts 0..L-1-n
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < L]  # something must follow the match
        if hits.size:
            s = hits[-1] + n
            return history[s : s + k]
    return history[:0]


class NgramDrafter:
    """Prompt-lookup drafting on the host; proposals are point masses."""

    kind = "ngram"
    compile_s = 0.0
    needs_history = True

    def __init__(self, k: int, n_min: int = 1, n_max: int = 4):
        self.k, self.n_min, self.n_max = k, n_min, n_max
        self._put = jnp.asarray

    def start(self, tokens_BxT, n_valid_B, max_len: int, put) -> float:
        self._put = put
        return 0.0

    def prefill(self) -> None:
        pass

    def precompile(self, *a) -> float:
        return 0.0

    def propose(self, prev_B, cur_B, key, rs, history: list[np.ndarray] | None = None) -> Proposal:
        B = len(history)
        toks = np.zeros((B, self.k), np.int32)
        n = np.zeros((B,), np.int32)
        for b, h in enumerate(history):
            got = ngram_lookup(h, self.k, self.n_min, self.n_max)
            toks[b, : len(got)] = got
            n[b] = len(got)
        return Proposal(self._put(toks), self._put(n), None)

    def commit(self, lengths_B, all_accepted: bool = True) -> None:
        pass


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
        toks = jax.random.randint(key, (B, self.k), 0, self.vocab, jnp.int32)
        return Proposal(toks, jnp.full((B,), self.k, jnp.int32), None)

    def commit(self, lengths_B, all_accepted: bool = True) -> None:
        pass


#: target registry name -> the draft used when --draft is not given (paths are relative to the repo)
DEFAULT_DRAFTS = {
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct",
    "smollm2-135m-instruct": "checkpoints/smollm2-135m-draft",
}


def default_draft(target: str) -> str:
    """The default draft for a target name (a registry name, or a shipped checkpoint directory)."""
    from pathlib import Path

    from ssd_jax.errors import UserError

    d = DEFAULT_DRAFTS.get(str(target))
    if d is None:
        raise UserError(f"no default draft for {target}; pass --draft NAME_OR_PATH (or ngram)")
    if d.startswith("checkpoints/"):
        path = Path(__file__).resolve().parents[1] / d
        if not path.exists():
            raise UserError(f"the default draft for {target} ({d}) is not in this checkout; pass --draft")
        return str(path)
    return d


def make_drafter(spec, target, sampling, load) -> Any:
    """Build the drafter named by ``spec.draft`` for ``target`` (``load`` loads a model by name)."""
    d = spec.draft
    if d == "ngram":
        return NgramDrafter(spec.k, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if d == "random":
        tok = target.tokenizer
        return RandomDrafter(spec.k, tok.vocab_size if tok is not None else target.cfg.vocab_size)
    model = load(d) if isinstance(d, str) else d
    check_same_tokenizer(target, model)
    return ModelDrafter(model, spec.k, target.cfg.vocab_size, sampling.needs_filter)


def check_same_tokenizer(target, draft) -> None:
    from ssd_jax.errors import UserError

    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None:
        if tt.fingerprint() != dt.fingerprint():
            raise UserError(
                f"draft {draft.name} and target {target.name} use different tokenizers; speculative decoding "
                "needs a shared vocabulary"
            )
    elif (tt is None) != (dt is None) or abs(target.cfg.vocab_size - draft.cfg.vocab_size) > 1024:
        raise UserError(f"cannot check that draft {draft.name} and target {target.name} share a tokenizer")
