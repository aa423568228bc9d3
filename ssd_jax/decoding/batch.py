"""The batch every method shares: prompts to token ids, rows (prompt x n samples) with their
host-side state, the context-window check and cache size, and the metrics every method reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from ssd_jax.decoding.spec import SpecConfig
from ssd_jax.errors import UserError
from ssd_jax.sampling.filters import SamplingParams


@dataclasses.dataclass
class GenerationResult:
    outputs: list[dict[str, Any]]
    metrics: dict[str, Any]
    method: str = "ar"

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "outputs": self.outputs, "metrics": self.metrics}


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def prompt_bucket(n: int) -> int:
    """Prefill length bucket: powers of two from 16, so prompt lengths compile a handful of shapes."""
    b = 16
    while b < n:
        b *= 2
    return b


def encode_prompts(model, prompts: Sequence[str | Sequence[int]], chat: bool) -> list[list[int]]:
    """Token ids for each prompt; raw id lists pass through (for models without a tokenizer)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p.strip():
                raise UserError("empty prompt")
            if model.tokenizer is None:
                raise UserError(f"model {model.name} has no tokenizer: pass token ids (--prompt-ids)")
            text = p
            if chat:
                text = model.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True
                )
            ids = model.tokenizer.encode(text, add_special_tokens=not chat)
        else:
            ids = [int(t) for t in p]
            if not ids:
                raise UserError("empty prompt")
            bad = [t for t in ids if not 0 <= t < model.cfg.vocab_size]
            if bad:
                raise UserError(f"token id {bad[0]} outside the vocabulary [0, {model.cfg.vocab_size})")
        if not ids:
            raise UserError("prompt encodes to zero tokens")
        out.append(ids)
    return out


def eos_ids(model) -> set[int]:
    ids = set(model.cfg.eos_token_ids)
    if model.tokenizer is not None:
        ids |= set(model.tokenizer.eos_token_ids)
    return ids


class RowState:
    """Host-side bookkeeping for one sequence: its tokens, text, and why it stopped.

    Detokenisation is incremental (constant host work per token, whatever the length): only
    the tokens since the last complete character are decoded again, from a few tokens back so
    that merges across the boundary come out right, and stop strings are searched only in the
    new tail. When the row finishes, its text is decoded once in full, so the final ``text``
    is exactly ``decode(token_ids)`` cut at the first stop string.
    """

    def __init__(self, prompt, prompt_ids, model, sampling: SamplingParams, eos: set[int]):
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.tokens: list[int] = []
        self.done = False
        self.finish_reason: str | None = None
        self._tok = model.tokenizer
        self._sp = sampling
        self._eos = eos
        self._max_stop = max((len(s) for s in sampling.stop), default=0)
        self.text = ""  # printable text so far (complete characters only until the row is done)
        self._emitted = 0  # characters handed to the streaming callback
        self._prefix = 0  # tokens[_prefix:_read] decode to the tail of ``text`` (the re-decoding window)
        self._read = 0
        self._stop_from = 0 if sampling.min_tokens == 0 else None  # stop strings count from here (min_tokens)

    def push(self, tok: int) -> str:
        """Add one generated token; returns newly printable text (for streaming)."""
        if self.done:
            return ""
        self.tokens.append(tok)
        if tok in self._eos and not self._sp.ignore_eos:
            self.done, self.finish_reason = True, "eos"
        elif len(self.tokens) >= self._sp.max_new_tokens:
            self.done, self.finish_reason = True, "length"
        if self._tok is None:
            return ""
        decode = self._tok.decode
        before = decode(self.tokens[self._prefix : self._read], skip_special_tokens=True)
        window = decode(self.tokens[self._prefix :], skip_special_tokens=True)
        if len(window) > len(before) and not window.endswith("\ufffd"):
            start = len(self.text)
            self.text += window[len(before) :]
            self._prefix, self._read = max(self._read - 4, 0), len(self.tokens)
            if self._stop_from is None and len(self.tokens) >= self._sp.min_tokens:
                self._stop_from = start  # stop strings count from the min_tokens-th token's text on
            if self._max_stop and self._stop_from is not None:
                tail = self.text[max(self._stop_from, start - self._max_stop + 1) :]
                if any(s in tail for s in self._sp.stop):
                    self.done, self.finish_reason = True, "stop"
        if self.done:
            self._finish_text()
        new = self.text[self._emitted :]
        self._emitted = max(self._emitted, len(self.text))
        return new

    def _finish_text(self) -> None:
        """The final text: the full decode, cut before the first stop string (once per row)."""
        text = self._tok.decode(self.tokens, skip_special_tokens=True)
        for s in self._sp.stop:
            i = -1 if self._stop_from is None else text.find(s, self._stop_from)
            if i >= 0:
                text = text[:i]
                self.finish_reason = "stop"
        self.text = text
        self._emitted = min(self._emitted, len(text))

    def output(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": list(self.tokens),
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_ids),
        }


def plan_batch(model, prompt_ids: list[list[int]], sampling: SamplingParams, spec: SpecConfig):
    """Check lengths against the context window; return (rows' ids, prefill width, cache length)."""
    ctx = model.cfg.max_position_embeddings
    longest = max(len(p) for p in prompt_ids)
    need = longest + sampling.max_new_tokens + spec.extra_cache_slots
    if need > ctx:
        raise UserError(
            f"prompt ({longest} tokens) + max-new-tokens ({sampling.max_new_tokens}) exceeds the context window "
            f"of {model.name} ({ctx} tokens)"
        )
    width = prompt_bucket(longest)
    max_len = min(_round_up(max(need, width), 128), max(ctx, width))
    return width, max_len


def speed_metrics(
    rows: list[RowState], wall: float, ttft: float, compile_s: float, n_valid
) -> dict[str, Any]:
    """The metrics every method reports (the CLI's JSON contract)."""
    B = len(rows)
    gen = sum(len(r.tokens) for r in rows)
    longest = max(len(r.tokens) for r in rows)
    return {
        "generated_tokens": gen,
        "tokens_per_s": gen / wall if wall > 0 else 0.0,
        "ttft_s": ttft,
        "tpot_s": (wall - ttft) / (longest - 1) if longest > 1 else 0.0,
        "wall_s": wall,
        "compile_s": compile_s,
        "decode_tokens_per_s": (gen - B) / (wall - ttft) if wall > ttft and gen > B else 0.0,
        "batch_size": B,
        "prompt_tokens": int(np.sum(n_valid)),
    }


@dataclasses.dataclass
class Batch:
    """The rows of one ``generate`` call (each prompt times ``n`` samples), shared by AR, SD and SSD:
    their host state, the right-padded prompt block for the prefill and the cache length."""

    rows: list[RowState]
    ids: list[list[int]]  # each row's prompt ids
    tokens: np.ndarray  # (B, width) int32, right-padded prompts
    n_valid: np.ndarray  # (B,) int32 prompt lengths
    max_len: int  # KV-cache slots per row

    @classmethod
    def build(cls, model, prompts, ids, sampling: SamplingParams, spec: SpecConfig, *, also_fits=()) -> Batch:
        """Rows for ``prompts`` (their token ``ids``); ``also_fits``: other models (drafts) whose context
        window must hold the batch too."""
        rows_prompt = [p for p in prompts for _ in range(sampling.n)]
        rows_ids = [list(x) for x in ids for _ in range(sampling.n)]
        width, max_len = plan_batch(model, rows_ids, sampling, spec)
        for other in also_fits:
            plan_batch(other, rows_ids, sampling, spec)
        eos = eos_ids(model)
        rows = [RowState(p, i, model, sampling, eos) for p, i in zip(rows_prompt, rows_ids)]
        tokens = np.zeros((len(rows_ids), width), np.int32)
        for b, r in enumerate(rows_ids):
            tokens[b, : len(r)] = r
        return cls(rows, rows_ids, tokens, np.array([len(r) for r in rows_ids], np.int32), max_len)

    @property
    def size(self) -> int:
        return len(self.rows)

    def last_prompt_tokens(self) -> np.ndarray:
        return np.asarray([r[-1] for r in self.ids], np.int32)

    def push_first(self, first: np.ndarray, on_text) -> None:
        """Hand every row its first generated token (from the prefill)."""
        for b, r in enumerate(self.rows):
            new = r.push(int(first[b]))
            if new and on_text is not None:
                on_text(b, new)

    def histories(self, first: np.ndarray) -> list[np.ndarray]:
        """Each row's tokens so far (prompt + first token), for host-side n-gram lookups."""
        return [np.asarray(r + [int(first[b])], np.int32) for b, r in enumerate(self.ids)]

    def outputs(self, row_metrics=None) -> list[dict[str, Any]]:
        outs = []
        for b, r in enumerate(self.rows):
            o = r.output()
            if row_metrics is not None:
                o["metrics"] = row_metrics(b)
            outs.append(o)
        return outs

    def speed_metrics(self, wall: float, ttft: float, compile_s: float) -> dict[str, Any]:
        return speed_metrics(self.rows, wall, ttft, compile_s, self.n_valid)


def seed_key(seed: int, put, fold: int | None = None) -> jax.Array:
    """The run's PRNG key from its seed (folded with ``fold`` if given), placed by ``put`` (every method
    derives its streams from it). Folded before it is placed: an eager op on an array of another
    process's devices (SSD's draft mesh under ``jax.distributed``) crashed the second run in a process."""
    key = jax.random.key(seed)
    if fold is not None:
        key = jax.random.fold_in(key, fold)
    return jax.random.wrap_key_data(put(jax.random.key_data(key)))
