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

The same interface serves SSD's cache-miss fallback."""

from __future__ import annotations

from typing import Any

from ssd_jax.drafters.base import check_same_tokenizer
from ssd_jax.drafters.model import ModelDrafter
from ssd_jax.drafters.ngram import NgramDrafter
from ssd_jax.drafters.random import RandomDrafter

#: target registry name -> the draft used when --draft is not given (a registry name or a shipped draft name)
DEFAULT_DRAFTS = {
    "qwen2.5-coder-1.5b-instruct": "qwen2.5-coder-0.5b-instruct",
    "smollm2-135m-instruct": "smollm2-135m-draft",
}
#: where SD's default differs: a shipped EAGLE-style head that beat the draft model under the protocol
#: (docs/eagle.md; SSD with a head is not built, so SSD keeps DEFAULT_DRAFTS)
DEFAULT_SD_DRAFTS = {"smollm2-135m-instruct": "smollm2-135m-eagle"}


def default_draft(target: str, method: str = "sd") -> str:
    """The default draft of ``method`` for a target name: a registry name, or a draft model or EAGLE
    head shipped in ``checkpoints/`` (loadable by name from any working directory). ``sd`` may get a
    head (:data:`DEFAULT_SD_DRAFTS`); any other method (``ssd``, or ``model`` to ask for one) a model."""
    from ssd_jax.errors import UserError
    from ssd_jax.loading.draft import SHIPPED_DRAFTS, SHIPPED_HEADS, resolve_draft, resolve_head

    d = (DEFAULT_SD_DRAFTS if method == "sd" else {}).get(str(target)) or DEFAULT_DRAFTS.get(str(target))
    if d is None:
        raise UserError(f"no default draft for {target}; pass --draft NAME_OR_PATH (or ngram)")
    if d in SHIPPED_DRAFTS:
        resolve_draft(d)  # a one-line error now if this install lacks checkpoints/
    if d in SHIPPED_HEADS:
        resolve_head(d)  # the same for a shipped head
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
