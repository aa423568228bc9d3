"""Training data as token streams: documents, tokenization, and the (seed, step) -> windows order."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.data.sources import sharegpt_conversations, training_texts
from ssd_jax.errors import UserError
from ssd_jax.training.args import TrainArgs, eval_batch_count

CORPUS_SOURCES = ("humaneval", "mtbench", "champ")  # ShareGPT comes in as whole conversations
HELDOUT_EVERY = 20  # --data FILE: documents whose hash is 0 mod 20 are held out


@dataclasses.dataclass
class Corpus:
    """Token streams for training and held-out evaluation, plus where they came from."""

    train: np.ndarray  # (n,) int32
    heldout: np.ndarray
    info: dict[str, Any]


def _doc_heldout(text: str) -> bool:
    return (
        int.from_bytes(hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()[:8], "big")
        % HELDOUT_EVERY
        == 0
    )


def _file_texts(path: Path) -> list[str]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --data {path}: {e}") from None
    if path.suffix == ".jsonl":
        texts = []
        for i, line in enumerate(raw.splitlines()):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                texts.append(str(rec["text"]))
            except (ValueError, KeyError, TypeError):
                raise UserError(
                    f'--data {path}: line {i + 1} is not a JSON object with a "text" field'
                ) from None
        return [t for t in texts if t.strip()]
    return [t for t in raw.split("\n\n") if t.strip()]


def corpus_docs(data: str, split: str) -> list[str | list[dict[str, str]]]:
    """Documents of ``split`` ("train"/"heldout") in a fixed order: texts, or chat messages
    (ShareGPT conversations) that :func:`render` formats with the chat template when needed."""
    if data != "corpus":
        p = Path(data).expanduser()
        if not p.is_file():
            raise UserError(f"--data must be 'corpus' or an existing .txt/.jsonl file, got {data!r}")
        docs = [t for t in _file_texts(p) if _doc_heldout(t) == (split == "heldout")]
        if not docs:
            raise UserError(
                f"--data {p}: no {split} documents (every {HELDOUT_EVERY}th document by hash is held out)"
            )
        return list(docs)
    docs: list[str | list[dict[str, str]]] = list(training_texts(split, sources=CORPUS_SOURCES))
    for conv in sharegpt_conversations(split):
        msgs = [{"role": t["role"], "content": t["text"]} for t in conv["turns"] if t["text"].strip()]
        if msgs:
            docs.append(msgs)
    # mix the sources; fixed, not seeded (the string is part of the data order: keep it as it is)
    random.Random(f"ssd_jax.train/{split}").shuffle(docs)
    return docs


def render(doc: str | list[dict[str, str]], tokenizer) -> str:
    if isinstance(doc, str):
        return doc
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(doc, add_generation_prompt=False)
    return "\n\n".join(m["content"] for m in doc)


def token_stream(
    docs: list, tokenizer, n_tokens: int, chunk: int = 256, per_doc: int | None = None
) -> tuple[np.ndarray, int]:
    """The first ``n_tokens`` tokens (or all) of the documents joined by EOS, each document cut
    to ``per_doc`` tokens if given; returns (stream, documents used)."""
    eos = tokenizer.eos_token_id
    parts: list[np.ndarray] = []
    total = used = 0
    for i in range(0, len(docs), chunk):
        texts = [render(d, tokenizer) for d in docs[i : i + chunk]]
        for enc in tokenizer.backend.encode_batch(texts, add_special_tokens=False):
            ids = list(enc.ids)[:per_doc] + ([eos] if eos is not None else [])
            parts.append(np.asarray(ids, np.int32))
            total += len(ids)
            used += 1
            if total >= n_tokens:
                break
        if total >= n_tokens:
            break
    stream = np.concatenate(parts) if parts else np.zeros((0,), np.int32)
    return stream[:n_tokens], used


def build_corpus(args: TrainArgs, tokenizer) -> Corpus:
    """Tokenize as much text as the run needs (it then sees each window once) or all of it."""
    if tokenizer is None:
        raise UserError(f"target {args.target} has no tokenizer: cannot tokenize training text")
    need_train = args.steps * args.batch_size * args.seq_len + 1
    need_eval = eval_batch_count(args) * args.batch_size * args.seq_len + 1
    streams, info = {}, {"data": args.data}
    # held out: at most two windows per document, so an evaluation spans many documents
    for split, need, per_doc in (("train", need_train, None), ("heldout", need_eval, 2 * args.seq_len)):
        s, used = token_stream(corpus_docs(args.data, split), tokenizer, need, per_doc=per_doc)
        if len(s) < args.seq_len + 1:
            raise UserError(
                f"{split} data has only {len(s)} tokens, fewer than one window of {args.seq_len + 1}"
            )
        streams[split] = s
        info[split] = {
            "documents": used,
            "tokens": int(len(s)),
            "sha256": hashlib.sha256(s.tobytes()).hexdigest(),
            "epochs": need / len(s) if split == "train" else None,
        }
    return Corpus(streams["train"], streams["heldout"], info)


@functools.lru_cache(maxsize=4)
def _epoch_perm(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def train_batch(stream: np.ndarray, step: int, seed: int, batch: int, seq_len: int) -> np.ndarray:
    """Windows ``(batch, seq_len + 1)`` for ``step`` (0-based): a pure function of (seed, step).

    Window starts are multiples of ``seq_len``; global window ``step·batch + b`` is entry
    ``(step·batch + b) mod n`` of a permutation seeded by ``(seed, epoch)``.
    """
    n = (len(stream) - 1) // seq_len
    out = np.empty((batch, seq_len + 1), np.int32)
    for b, w in enumerate(window_ids(step, seed, batch, n)):
        out[b] = stream[w * seq_len : w * seq_len + seq_len + 1]
    return out


def window_ids(step: int, seed: int, batch: int, n: int) -> list[int]:
    """The ``batch`` window indices (of ``n``) of ``step``: global window ``step·batch + b`` is entry
    ``(step·batch + b) mod n`` of a permutation seeded by ``(seed, epoch)``."""
    return [int(_epoch_perm(seed, g // n, n)[g % n]) for g in range(step * batch, step * batch + batch)]


def eval_batches(stream: np.ndarray, batches: int, batch: int, seq_len: int) -> list[np.ndarray]:
    """Fixed held-out windows (the first ones of the stream; repeated if it is short)."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(batches * batch) % n
    wins = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in idx]).astype(np.int32)
    return [wins[i * batch : (i + 1) * batch] for i in range(batches)]
