"""Prompt sets: the three project categories (seeded, balanced samples), prompt-copying tasks, and
the training prompts (:func:`training_prompts`) that never overlap what benchmarks use."""

from __future__ import annotations

import random
from collections.abc import Iterator

from ssd_jax.data.packages import package_spec
from ssd_jax.data.sources import champ_raw, humaneval_raw, mtbench_raw, prompt_heldout, sharegpt_first_turns
from ssd_jax.errors import UserError

DEFAULT_MAX_PROMPT_CHARS = 2000
CATEGORIES = ("code", "math", "chat")

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
CATEGORY_SOURCES = {
    "code": ("humaneval", "mtbench"),
    "math": ("champ", "mtbench"),
    "chat": ("sharegpt", "mtbench"),
}

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
            for r in humaneval_raw()
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
            for r in mtbench_raw()
        ]
    if source == "sharegpt":
        return [
            _record(f"sharegpt/{r['id']}", "sharegpt", "chat", None, r["text"])
            for r in sharegpt_first_turns()
        ]
    if source == "champ":
        return [
            _record(f"champ/{r['id']}", "champ", "math", r["category"], r["problem"]) for r in champ_raw()
        ]
    package_spec(source)  # raises for unknown names
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
    if category not in CATEGORY_SOURCES:
        raise UserError(f"unknown prompt category {category!r} (categories: {', '.join(CATEGORIES)})")
    if n is not None and n < 0:
        raise UserError(f"number of prompts must be >= 0, got {n}")
    pools = [
        [r for r in load_source(s, max_chars) if r["category"] == category]
        for s in CATEGORY_SOURCES[category]
    ]
    if n is None:
        return [r for pool in pools for r in pool]
    # the "ssd_jax.data/..." seed strings fix which prompts a seed gives: keep them as they are
    orders = [
        _balanced_order(pool, random.Random(f"ssd_jax.data/{seed}/{category}/{src}"))
        for src, pool in zip(CATEGORY_SOURCES[category], pools)
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
    problems = list(humaneval_raw())
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


# --------------------------------------------------------------------------- training prompts

#: prompts per category (seed 0, the benchmarks' seed) reserved for benchmarks and evaluation:
#: benchmarks take the first n <= 64 of ``load_prompts(category, n)`` / ``copy_task_prompts(n)``
BENCH_RESERVE = 64
TRAINING_SOURCES = ("humaneval", "mtbench", "sharegpt", "champ")


def benchmark_prompt_ids(reserve: int = BENCH_RESERVE) -> set[str]:
    """Ids of every prompt a benchmark may use: the first ``reserve`` of each category's seed-0
    sample, and the HumanEval problems behind the first ``reserve`` copy tasks (as ``humaneval/N``,
    since a copy prompt contains that problem's prompt and solution)."""
    ids = {r["id"] for c in CATEGORIES for r in load_prompts(c, n=reserve)}
    ids |= {"humaneval/" + r["id"].split("/")[1] for r in copy_task_prompts(reserve)}
    return ids


def training_prompts(
    sources: tuple[str, ...] = TRAINING_SOURCES,
    n: int | None = None,
    seed: int = 0,
    reserve: int = BENCH_RESERVE,
    max_chars: int | None = DEFAULT_MAX_PROMPT_CHARS,
) -> list[dict]:
    """Prompts for training on the target's own answers (self-distillation).

    Only the training split (:func:`ssd_jax.data.prompt_heldout` false) and nothing a benchmark
    may use (:func:`benchmark_prompt_ids`, matched by id and by prompt text). The sources are
    taken in turn, each in a seeded order, so any prefix (``n``) stays balanced; the same
    arguments always give the same list.
    """
    if n is not None and n < 0:
        raise UserError(f"number of prompts must be >= 0, got {n}")
    reserved = benchmark_prompt_ids(reserve)
    reserved_text = {r["prompt"].strip() for c in CATEGORIES for r in load_prompts(c, n=reserve)}
    pools = []
    for src in sources:
        pool = [
            r
            for r in load_source(src, max_chars)
            if r["id"] not in reserved
            and r["prompt"].strip() not in reserved_text
            and not prompt_heldout(r["id"])
        ]
        random.Random(f"ssd_jax.data/train-prompts/{seed}/{src}").shuffle(pool)
        pools.append(pool)
    out = _round_robin(pools)
    return out if n is None else out[:n]
