"""The four sources as records (parsed once, cached beside the raw files) and as training texts
with a fixed ~5 % held-out split."""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
from collections.abc import Iterable, Iterator

from ssd_jax.data.packages import (
    MTBENCH_QUESTIONS,
    SHAREGPT_JSON,
    SOURCES,
    derived_records,
    ensure_package,
    member_path,
    package_spec,
    read_jsonl,
)
from ssd_jax.errors import UserError

HELDOUT_PER_MILLE = 50  # ~5 % of training texts (by conversation / problem) are held out

_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}
_CHUNK_SUFFIX = re.compile(r"_(\d+)$")  # ShareGPT V3 splits long chats into <id>_0, <id>_1, ...


def clear_cache() -> None:
    """Forget the parsed sources held in memory (the files on disk stay)."""
    for fn in (
        humaneval_raw,
        mtbench_raw,
        champ_raw,
        sharegpt_first_turns,
        sharegpt_raw,
        _training_items,
    ):
        fn.cache_clear()


# --------------------------------------------------------------------------- raw sources


@functools.cache
def humaneval_raw() -> tuple[dict, ...]:
    ensure_package("humaneval")
    with gzip.open(member_path("humaneval", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(rows)


@functools.cache
def mtbench_raw() -> tuple[dict, ...]:
    ensure_package("mtbench")
    return tuple(read_jsonl(member_path("mtbench", MTBENCH_QUESTIONS)))


def _build_champ() -> list[dict]:
    with open(member_path("champ", "v0.json"), encoding="utf-8") as f:
        problems = json.load(f)["problems"]  # 72 MB, mostly model transcripts we do not keep
    out = []
    for key, p in problems.items():
        steps = [s.get("_text") or "" for s in (p.get("solution") or {}).get("steps", [])]
        out.append(
            {
                "id": p.get("identifier") or key,
                "category": p.get("category"),
                "problem": p.get("_text") or "",
                "solution": "\n".join(s for s in steps if s.strip()),
                "answer": p.get("_answer") or "",
            }
        )
    return out


@functools.cache
def champ_raw() -> tuple[dict, ...]:
    return tuple(derived_records("champ", "problems", _build_champ))


def iter_json_array(text: str) -> Iterator[object]:
    """Elements of a JSON array, one at a time, stopping quietly where the text is cut off."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


@functools.lru_cache(maxsize=1)
def sharegpt_raw() -> tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]:
    """(unique id, original id, ((role, text), ...)) for every complete conversation, file order."""
    ensure_package("sharegpt")
    with open(member_path("sharegpt", SHAREGPT_JSON), encoding="utf-8") as f:
        text = f.read()
    seen: dict[str, int] = {}
    out = []
    for obj in iter_json_array(text):
        if not isinstance(obj, dict):
            continue
        orig = str(obj.get("id", ""))
        k = seen.get(orig, 0) + 1
        seen[orig] = k
        uid = orig if k == 1 else f"{orig}#{k}"  # 123 ids occur twice with different chats
        turns = tuple(
            (_SHAREGPT_ROLES.get(str(m.get("from", "")).lower(), "assistant"), str(m.get("value") or ""))
            for m in obj.get("conversations") or ()
            if isinstance(m, dict)
        )
        out.append((uid, orig, turns))
    return tuple(out)


def _opening_user_turn(orig_id: str, turns: tuple[tuple[str, str], ...]) -> str | None:
    """The user's first message if the record starts a conversation, else None.

    Records ``<id>_1``, ``<id>_2``... continue a chat split for length, and records whose
    first (non-system) message is the assistant's also start mid-chat: their user turns
    ("continue", "now in French") make no sense alone.
    """
    m = _CHUNK_SUFFIX.search(orig_id)
    if m and int(m.group(1)) > 0:
        return None
    for role, text in turns:
        if role == "system":
            continue
        return text if role == "user" else None
    return None


def _build_sharegpt_first_turns() -> list[dict]:
    out = []
    for uid, orig, turns in sharegpt_raw():
        text = _opening_user_turn(orig, turns)
        if text is not None and text.strip():
            out.append({"id": uid, "text": text})
    return out


@functools.cache
def sharegpt_first_turns() -> tuple[dict, ...]:
    return tuple(derived_records("sharegpt", "first_turns", _build_sharegpt_first_turns))


# --------------------------------------------------------------------------- training text


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def _is_heldout(group: str) -> bool:
    return _bucket("split/" + group) % 1000 < HELDOUT_PER_MILLE


def _sharegpt_group(orig_id: str) -> str:
    return "sharegpt/" + _CHUNK_SUFFIX.sub("", orig_id)  # all chunks of one chat on one side


def prompt_heldout(prompt_id: str) -> bool:
    """Whether a prompt record (``humaneval/N``, ``mtbench/N``, ``champ/ID``, ``sharegpt/UID``) is in
    the held-out split of :func:`training_texts` (the same hash of its problem or conversation)."""
    source, _, rest = str(prompt_id).partition("/")
    if source == "sharegpt":
        return _is_heldout(_sharegpt_group(rest.split("#", 1)[0]))
    if source in ("humaneval", "mtbench", "champ"):
        return _is_heldout(f"{source}/{rest}")
    raise UserError(f"prompt id {prompt_id!r} names no known source")


@functools.lru_cache(maxsize=1)
def _training_items() -> tuple[tuple[str, str, bool, str], ...]:
    """(key, source, held out?, text) for every training text, in a hash-mixed stable order."""
    items: list[tuple[str, str, bool, str]] = []

    def add(key: str, source: str, group: str, text: str) -> None:
        if text.strip():
            items.append((key, source, _is_heldout(group), text))

    for uid, orig, turns in sharegpt_raw():
        add(
            f"sharegpt/{uid}",
            "sharegpt",
            _sharegpt_group(orig),
            "\n\n".join(t for _, t in turns if t.strip()),
        )
    for p in humaneval_raw():
        key = f"humaneval/{p['task_id'].split('/')[-1]}"
        add(key, "humaneval", key, p["prompt"] + p["canonical_solution"])
    for q in mtbench_raw():
        key = f"mtbench/{q['question_id']}"
        add(key, "mtbench", key, "\n\n".join(q["turns"]))
    for p in champ_raw():
        key = f"champ/{p['id']}"
        parts = [p["problem"], p["solution"], f"Answer: {p['answer']}" if p["answer"] else ""]
        add(key, "champ", key, "\n\n".join(x for x in parts if x.strip()))
    items.sort(key=lambda it: _bucket(it[0]))
    return tuple(items)


def training_texts(
    split: str = "train", max_texts: int | None = None, sources: Iterable[str] | None = None
) -> list[str]:
    """Real text for draft training: ShareGPT conversations (turns joined by blank lines),
    HumanEval prompt + canonical solution, MT-bench questions, CHAMP problem + solution +
    answer. ``split`` is ``train`` or ``heldout`` (~5 %, by a hash of the conversation or
    problem id, so it never changes and chunks of one chat stay together). The order is
    fixed and mixes the sources, so ``max_texts`` takes a stable prefix. ``sources``
    restricts the sources (e.g. leave out ``humaneval``/``mtbench`` when benchmarking
    on them)."""
    if split not in ("train", "heldout"):
        raise UserError(f"split must be 'train' or 'heldout', got {split!r}")
    wanted = set(SOURCES if sources is None else sources)
    for s in wanted:
        package_spec(s)
    heldout = split == "heldout"
    out = [text for _, src, h, text in _training_items() if h == heldout and src in wanted]
    return out if max_texts is None else out[:max_texts]


def sharegpt_conversations(split: str | None = None) -> list[dict]:
    """Every recovered ShareGPT conversation as ``{"id", "turns": [{"role", "text"}]}``
    (roles ``user``/``assistant``/``system``), file order; ``split`` as in
    :func:`training_texts` (``None``: all)."""
    if split not in (None, "train", "heldout"):
        raise UserError(f"split must be 'train', 'heldout' or None, got {split!r}")
    out = []
    for uid, orig, turns in sharegpt_raw():
        if split is not None and _is_heldout(_sharegpt_group(orig)) != (split == "heldout"):
            continue
        out.append({"id": f"sharegpt/{uid}", "turns": [{"role": r, "text": t} for r, t in turns]})
    return out
