"""Draft vocabulary trimming (VocabTrim, arXiv 2506.22694): the draft's LM head keeps only the N
most frequent target tokens.

For a small draft with a big vocabulary the head is a large share of the bytes read per draft
step (SmolLM2-135M: 49,152 x 576 of 135M parameters; Qwen 0.5B: 0.54 of 1.98 GB). A trimmed
draft computes N logits and scatters them into a full-vocabulary row that is -inf elsewhere
(``ssd_jax.models.llama.trimmed_logits``), so its q is 0 outside the kept set and those tokens
are never proposed. Speculative decoding stays exact: the verifier sees the same q the tokens
were drawn from, and the residual max(0, p - q) = p outside the kept set gives every missing
token its full target probability at the first rejection. Only acceptance can drop.

Memory: the trimmed model holds an N-row ``head`` (a copy of the kept rows of the tied
embedding, or the sliced untied ``lm_head``, which is dropped) plus ``head_ids`` (N,) int32;
the embedding table stays whole for the input lookup.

Which tokens: the most frequent ones in the offline training corpus (``ssd_jax.data``:
ShareGPT, HumanEval, MT-bench, CHAMP, train split, a fixed prefix of :data:`CORPUS_CHARS`
characters) tokenized with the draft's (= the target's) tokenizer. Ties go to the smaller
id. Special tokens (EOS, BOS, chat markers) are always kept. The counts are computed once and
stored with the draft: ``token_counts.npz`` next to a trained draft's ``draft.json``, else in
``<cache>/vocab/<tokenizer sha256[:16]>-<corpus tag>.npz``; written atomically and checked on
reload (format, vocabulary size, tokenizer fingerprint, corpus tag).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.errors import UserError

COUNTS_FILE = "token_counts.npz"
FORMAT = "ssd_jax.token_counts"
FORMAT_VERSION = 1
#: characters of the training corpus counted (about 4-5M tokens; a few seconds with batch encode)
CORPUS_CHARS = 16_000_000
CORPUS_TAG = f"corpus-train-{CORPUS_CHARS // 1_000_000}M-v1"
_BATCH = 512


def count_tokens(tokenizer, texts: Sequence[str], vocab: int) -> np.ndarray:
    """Occurrences of each token id in ``texts`` (``(vocab,)`` int64; ids >= vocab are ignored)."""
    counts = np.zeros((vocab,), np.int64)
    for i in range(0, len(texts), _BATCH):
        encs = tokenizer.backend.encode_batch(list(texts[i : i + _BATCH]), add_special_tokens=False)
        ids = np.fromiter((t for e in encs for t in e.ids), np.int64)
        counts += np.bincount(ids[ids < vocab], minlength=vocab)[:vocab]
    return counts


def corpus_texts(max_chars: int = CORPUS_CHARS) -> list[str]:
    """A stable prefix of the training split (its order mixes the sources) of ``max_chars`` characters."""
    from ssd_jax.data import training_texts

    out, total = [], 0
    for t in training_texts("train"):
        if total >= max_chars:
            break
        t = t[: max_chars - total]
        out.append(t)
        total += len(t)
    return out


def always_kept(tokenizer) -> list[int]:
    """Token ids every trimmed head keeps: EOS ids, BOS and the tokenizer's special tokens."""
    if tokenizer is None:
        return []
    ids = set(tokenizer.eos_token_ids) | tokenizer.special_token_ids()
    if tokenizer.bos_token_id is not None:
        ids.add(tokenizer.bos_token_id)
    return sorted(int(i) for i in ids)


def kept_ids(counts: np.ndarray, n: int, always: Sequence[int] = ()) -> np.ndarray:
    """The ``n`` ids to keep, ascending: ``always`` first, then by count (ties: smaller id first)."""
    vocab = counts.shape[0]
    always = sorted({int(i) for i in always if 0 <= int(i) < vocab})
    if not 1 <= n <= vocab:
        raise UserError(
            f"--draft-vocab must be between 1 and the draft's vocabulary of {vocab} tokens, got {n}"
        )
    if n < len(always):
        raise UserError(
            f"--draft-vocab {n} is smaller than the {len(always)} special tokens every trimmed head keeps"
        )
    ids = np.arange(vocab)
    order = np.lexsort((ids, -counts))  # by count descending, then id ascending
    rest = order[~np.isin(order, always)][: n - len(always)]
    return np.sort(np.concatenate([np.asarray(always, np.int64), rest])).astype(np.int32)


# --- the counts file --------------------------------------------------------------------------
def _meta(tokenizer, vocab: int, **extra) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "vocab": vocab,
        "tokenizer_sha256": tokenizer.fingerprint() if tokenizer is not None else None,
        "corpus": CORPUS_TAG,
        **extra,
    }


def read_counts(path: str | os.PathLike, tokenizer, vocab: int) -> np.ndarray | None:
    """The stored counts at ``path``, or None if missing, unreadable or made for something else."""
    try:
        with np.load(path, allow_pickle=False) as z:
            meta, counts = json.loads(str(z["meta"])), np.asarray(z["counts"], np.int64)
    except (OSError, ValueError, KeyError):
        return None
    want = _meta(tokenizer, vocab)
    if any(
        meta.get(k) != want[k] for k in ("format", "format_version", "vocab", "tokenizer_sha256", "corpus")
    ):
        return None
    return counts if counts.shape == (vocab,) else None


def write_counts(path: str | os.PathLike, counts: np.ndarray, meta: dict[str, Any]) -> None:
    """Write counts and metadata as an ``.npz`` atomically (a temporary file, then a rename).

    The zip members carry a fixed timestamp, so the same counts always give the same bytes.
    """
    import io
    import zipfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    arrays = {"counts": np.asarray(counts, np.int64), "meta": np.asarray(json.dumps(meta, sort_keys=True))}
    try:
        with open(tmp, "wb") as f:
            with zipfile.ZipFile(f, "w") as z:
                for name, a in arrays.items():
                    buf = io.BytesIO()
                    np.lib.format.write_array(buf, a, allow_pickle=False)
                    z.writestr(
                        zipfile.ZipInfo(f"{name}.npy", (1980, 1, 1, 0, 0, 0)),
                        buf.getvalue(),
                        compress_type=zipfile.ZIP_DEFLATED,
                    )
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def counts_path(source: Any, tokenizer) -> Path:
    """Where a draft's counts live: next to a trained draft (if writable), else in the cache."""
    from ssd_jax.loading.draft import resolve_draft
    from ssd_jax.loading.registry import cache_root

    d = resolve_draft(source) if isinstance(source, (str, os.PathLike)) else None
    if d is not None and os.access(d, os.W_OK):
        return d / COUNTS_FILE
    return cache_root() / "vocab" / f"{tokenizer.fingerprint()[:16]}-{CORPUS_TAG}.npz"


def draft_token_counts(
    model, source: Any = None, texts_fn: Callable[[], list[str]] = corpus_texts
) -> np.ndarray:
    """Token counts for ``model``'s vocabulary: read from its stored file, else counted and stored."""
    tok, vocab = model.tokenizer, model.cfg.vocab_size
    if tok is None:
        raise UserError(
            f"draft {model.name} has no tokenizer: cannot count token frequencies for --draft-vocab"
        )
    path = counts_path(source, tok)
    counts = read_counts(path, tok, vocab)
    if counts is None:
        texts = texts_fn()
        counts = count_tokens(tok, texts, vocab)
        write_counts(path, counts, _meta(tok, vocab, texts=len(texts), tokens=int(counts.sum())))
    return counts


# --- trimming ---------------------------------------------------------------------------------
def trim_draft(model, head_ids: np.ndarray):
    """``model`` with its output head cut to the rows ``head_ids`` (``llama.trimmed_logits``).

    The untied ``lm_head`` is replaced by its slice (the full matrix is not kept); a tied
    embedding stays for the input lookup and the slice is a separate N-row ``head``. A tied
    draft that is trimmed already (one trained with ``--draft-vocab``) is re-cut from its embedding.
    """
    import jax.numpy as jnp

    if "head_ids" in model.params:
        if not model.cfg.tie_embeddings:
            raise UserError(f"draft {model.name} already has a trimmed head")
        model = full_head(model)
    from ssd_jax.models import llama

    params = dict(model.params)
    ids = jnp.asarray(np.asarray(head_ids, np.int32))
    params["head"] = llama.head_rows(params, model.cfg, ids)  # in the head's stored layout
    params.pop("lm_head", None)
    params["head_ids"] = ids
    return dataclasses.replace(model, params=params)


def full_head(model):
    """A tied draft with a trimmed head back on its whole embedding (every token proposable)."""
    if "head_ids" not in model.params:
        return model
    if not model.cfg.tie_embeddings:
        raise UserError(f"draft {model.name} has a trimmed untied head: its other rows are not loaded")
    params = {k: v for k, v in model.params.items() if k not in ("head", "head_ids")}
    return dataclasses.replace(model, params=params)


def head_vocab(draft: Any) -> int | None:
    """Tokens in a draft's trimmed head: a loaded model's, or what a draft given by name or path
    loads with (``trained_head_vocab``). None: the full head, or no draft model."""
    from ssd_jax.loading.draft import resolve_draft, trained_head_vocab

    params = getattr(draft, "params", None)
    if isinstance(params, dict):
        return int(params["head_ids"].shape[0]) if "head_ids" in params else None
    if isinstance(draft, (str, os.PathLike)) and str(draft) not in ("ngram", "random"):
        d = resolve_draft(draft)
        head = trained_head_vocab(d) if d is not None else None
        return head[0] if head else None
    return None


def trim_to(model, n: int, source: Any):
    """``model`` with the ``n``-token head of the counts stored with ``source`` (its draft directory)."""
    counts = draft_token_counts(model, source)
    return trim_draft(model, kept_ids(counts, n, always_kept(model.tokenizer)))


def with_trained_head(model):
    """``model`` cut to the head it was trained with, if it is a draft trained with ``--draft-vocab N``
    (``ssd_jax.loading.draft.trained_head_vocab``); otherwise ``model`` itself."""
    from ssd_jax.loading.draft import trained_head_vocab

    head = trained_head_vocab(model.source) if getattr(model, "source", None) else None
    if head is None or head[0] >= model.cfg.vocab_size or "head_ids" in model.params:
        return model
    return trim_to(model, head[0], head[1])


def load_with_head(name_or_path, **kw):
    """``ssd_jax.loading.load_model``, then :func:`with_trained_head` (how drafts are loaded)."""
    from ssd_jax.loading import load_model

    return with_trained_head(load_model(name_or_path, **kw))


def trimmed_draft(draft: Any, n: int, load: Callable[[str], Any]):
    """The draft of a spec (a name / path, or a loaded model) with its head cut to ``n`` tokens
    (``n`` = the vocabulary: the full head, also for a draft trained with a trimmed one)."""
    model = load(draft) if isinstance(draft, str) else draft
    vocab = model.cfg.vocab_size
    if not 1 <= n <= vocab:
        raise UserError(
            f"--draft-vocab must be between 1 and the draft's vocabulary of {vocab} tokens, got {n}"
        )
    if n == vocab:  # every token kept: the full head is the trimmed head
        return full_head(model)
    if isinstance(draft, str):  # loaded afresh: nothing to reuse
        return trim_to(model, n, draft)
    from ssd_jax.loading.loaded import derived

    # a loaded draft reused across generate() calls: counts read and head cut once
    return derived(model, f"vocab:{n}", lambda: trim_to(model, n, draft))
