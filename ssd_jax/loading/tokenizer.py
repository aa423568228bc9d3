"""Tokenizer: a ``tokenizers.Tokenizer`` plus special-token ids and the chat template.

Built from a Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``) or
rebuilt offline from GGUF metadata (byte-level BPE: ``tokenizer.ggml.tokens/merges/
token_type`` and the ``tokenizer.ggml.pre`` pre-tokenizer name). ``save``/``load`` use the
HF file names, with our resolved special ids under the ``"ssd_jax"`` key.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from ssd_jax.errors import UserError

# end-of-turn / end-of-text tokens that also stop generation when the tokenizer marks
# them special (Qwen instruct: <|im_end|> 151645 next to <|endoftext|> 151643)
END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|end|>", "<end_of_turn>")

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Qwen2 pre-tokenizer regex (as in Qwen2's tokenizer.json and llama.cpp's "qwen2")
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama-3 ("llama-bpe"): as Qwen2 but numbers in groups of up to three digits
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SSD_KEY = "ssd_jax"


def _token_str(v: Any) -> str | None:
    """tokenizer_config token entries are strings or serialized AddedToken dicts."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


def _as_ids(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v]
    return [int(v)]


class Tokenizer:
    """Text <-> token ids, special tokens and chat-template rendering."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
    ):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.chat_template = chat_template
        self._fingerprint: str | None = None

    # --- basic API ---------------------------------------------------------------------
    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def special_token_ids(self) -> set[int]:
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def fingerprint(self) -> str:
        """sha256 of the id -> token table (added tokens included) and the special flags.

        Equal fingerprints mean two models can exchange token ids directly.
        """
        if self._fingerprint is None:
            vocab = self._tok.get_vocab(with_added_tokens=True)
            h = hashlib.sha256()
            for token, i in sorted(vocab.items(), key=lambda kv: kv[1]):
                h.update(f"{i}\t{token}\n".encode("utf-8", "surrogatepass"))
            h.update(("special:" + ",".join(map(str, sorted(self.special_token_ids())))).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, "
            f"eos={list(self.eos_token_ids)}, chat_template={self.chat_template is not None})"
        )

    # --- chat template -----------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}]) with the model's chat template."""
        if not self.chat_template:
            raise UserError("this model's tokenizer has no chat template; pass raw text instead of messages")
        template = _compile_template(self.chat_template)
        ctx = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._token_or_empty(self.bos_token_id),
            "eos_token": self._token_or_empty(self.eos_token_id),
            "tools": None,
            "documents": None,
        }
        ctx.update(kwargs)
        import jinja2

        try:
            return template.render(**ctx)
        except jinja2.TemplateError as e:
            raise UserError(f"chat template failed: {e}") from None

    def _token_or_empty(self, i: int | None) -> str:
        if i is None:
            return ""
        return self.id_to_token(i) or ""

    # --- persistence -------------------------------------------------------------------
    def save(self, directory: str | os.PathLike) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        config = {
            "bos_token": self._token_or_empty(self.bos_token_id) or None,
            "eos_token": self._token_or_empty(self.eos_token_id) or None,
            "chat_template": self.chat_template,
            _SSD_KEY: {"bos_token_id": self.bos_token_id, "eos_token_ids": list(self.eos_token_ids)},
        }
        with open(d / "tokenizer_config.json", "w") as f:
            json.dump(config, f, indent=1, ensure_ascii=False)

    @classmethod
    def load(cls, directory: str | os.PathLike, extra_eos_ids: Sequence[int] = ()) -> Tokenizer:
        """Load from a directory with ``tokenizer.json`` (ours or a Hugging Face one).

        Special ids: from our ``"ssd_jax"`` section when present; otherwise ``bos_token`` /
        ``eos_token`` of tokenizer_config.json, ``extra_eos_ids`` (e.g. from config.json or
        generation_config.json) and the special :data:`END_TOKENS` present in the vocab.
        """
        d = Path(directory)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise UserError(f"no tokenizer.json in {d}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the Rust side raises plain Exception
            raise UserError(f"cannot read {tj}: {e}") from None
        config: dict[str, Any] = {}
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            try:
                with open(tc) as f:
                    config = json.load(f)
            except (OSError, ValueError) as e:
                raise UserError(f"cannot read {tc}: {e}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = d / "chat_template.jinja"
        if not template and jinja_file.is_file():
            template = jinja_file.read_text()
        ours = config.get(_SSD_KEY)
        if isinstance(ours, dict):
            return cls(
                tok,
                bos_token_id=ours.get("bos_token_id"),
                eos_token_ids=ours.get("eos_token_ids") or (),
                chat_template=template,
            )
        bos_str = _token_str(config.get("bos_token"))
        eos_str = _token_str(config.get("eos_token"))
        bos = tok.token_to_id(bos_str) if bos_str else None
        eos = [tok.token_to_id(eos_str)] if eos_str and tok.token_to_id(eos_str) is not None else []
        eos += list(extra_eos_ids)
        return cls(tok, bos_token_id=bos, eos_token_ids=with_end_tokens(tok, eos), chat_template=template)

    @classmethod
    def from_hf_dir(cls, directory: str | os.PathLike) -> Tokenizer:
        """Hugging Face model directory: tokenizer files plus eos ids from the model configs."""
        d = Path(directory)
        extra: list[int] = []
        for name in ("generation_config.json", "config.json"):
            p = d / name
            if p.is_file():
                try:
                    with open(p) as f:
                        extra += _as_ids(json.load(f).get("eos_token_id"))
                except (OSError, ValueError, TypeError):
                    pass
        return cls.load(d, extra_eos_ids=extra)

    # --- GGUF ----------------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, md: dict[str, Any]) -> Tokenizer:
        """Rebuild a byte-level BPE tokenizer from GGUF ``tokenizer.*`` metadata values.

        Raises ValueError for tokenizer kinds this rebuild does not cover.
        """
        kind = md.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
        tokens: list[str] = list(md["tokenizer.ggml.tokens"])
        merges_raw = md.get("tokenizer.ggml.merges") or []
        types = list(md.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens))
        pre = md.get("tokenizer.ggml.pre", "default")
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = []
        for m in merges_raw:
            a, sep, b = m.partition(" ")
            if not sep:
                raise ValueError(f"bad merge entry {m!r}")
            merges.append((a, b))
        ignore_merges = pre in ("llama-bpe", "llama3")
        tok = tokenizers.Tokenizer(
            models.BPE(
                vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges
            )
        )
        _set_pre_tokenizer(tok, pre)
        tok.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == TOKEN_CONTROL
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == TOKEN_USER_DEFINED
        ]
        if special:
            tok.add_special_tokens(special)
        if user:
            tok.add_tokens(user)
        bos = md.get("tokenizer.ggml.bos_token_id")
        eos = md.get("tokenizer.ggml.eos_token_id")
        bos = int(bos) if bos is not None else None
        if md.get("tokenizer.ggml.add_bos_token") and bos is not None:
            bt = tokens[bos]
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bt}:0 $A:0", pair=f"{bt}:0 $A:0 $B:1", special_tokens=[(bt, bos)]
            )
        eos_ids = _as_ids(eos) + _as_ids(md.get("tokenizer.ggml.eot_token_id"))
        return cls(
            tok,
            bos_token_id=bos,
            eos_token_ids=with_end_tokens(tok, eos_ids),
            chat_template=md.get("tokenizer.chat_template"),
        )


def _set_pre_tokenizer(tok: tokenizers.Tokenizer, pre: str | None) -> None:
    """The pre-tokenizer (and normalizer) llama.cpp's ``tokenizer.ggml.pre`` names."""
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    elif pre in ("llama-bpe", "llama3"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
    elif pre == "smollm":
        # llama.cpp "smollm": every digit on its own, then the GPT-2 byte-level rule
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    elif pre in ("default", "gpt2", None):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (qwen2, smollm, llama-bpe, gpt2)")


def with_end_tokens(tok: tokenizers.Tokenizer, eos_ids: Sequence[int]) -> tuple[int, ...]:
    """``eos_ids`` followed by the ids of the special :data:`END_TOKENS` the tokenizer has."""
    ids = [int(i) for i in eos_ids]
    special = {t.content: i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    ids += [special[t] for t in END_TOKENS if t in special]
    return tuple(dict.fromkeys(ids))


def _raise_exception(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise UserError(f"the model's chat template does not parse: {e}") from None
