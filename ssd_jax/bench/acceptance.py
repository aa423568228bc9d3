"""A draft's acceptance by position and by category (``python -m ssd_jax.bench --suite acceptance``).

SD runs of the draft against the target on held-out prompts (the benchmark categories of
:mod:`ssd_jax.bench.protocol`; the distillation data and the training corpus use the prompt
sets' training splits only, :mod:`ssd_jax.data.prompts`), at each temperature and K, one batch
of prompts per category. From the engine's per-request ``accepted_per_round`` (the accepted
count of every verify round) and ``drafted`` (:mod:`ssd_jax.decoding.stats`):

* ``at_least[j-1]``: the fraction of rounds that accepted at least ``j`` proposals, j = 1..K;
* ``conditional[j-1]``: P(proposal j accepted | proposal j - 1 was), ``at_least[j-1] / at_least[j-2]``;
* ``acceptance``: accepted / drafted proposals (the per-token acceptance; the last round of a
  request may draft fewer than K), and ``tokens_per_round`` (accepted + 1 per round, the bonus
  token included).

At T = 0 the runs are greedy (the token stream is AR's); at T > 0 they sample with a fixed seed.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ssd_jax.errors import UserError


def round_stats(accepted_per_round: Sequence[int], drafted: int, k: int) -> dict[str, Any]:
    """Position statistics of a set of verify rounds (``accepted_per_round``) with ``drafted`` proposals."""
    n = np.asarray(list(accepted_per_round), np.int64)
    rounds = len(n)
    at_least = [float((n >= j).mean()) if rounds else 0.0 for j in range(1, k + 1)]
    cond = [at_least[0]] + [a / b if b > 0 else 0.0 for a, b in zip(at_least[1:], at_least[:-1])]
    acc = int(n.sum())
    return {
        "rounds": rounds,
        "accepted": acc,
        "drafted": int(drafted),
        "acceptance": acc / drafted if drafted else 0.0,
        "tokens_per_round": (acc + rounds) / rounds if rounds else 0.0,
        "at_least": at_least,
        "conditional": cond,
        "histogram": np.bincount(n, minlength=k + 1).tolist() if rounds else [0] * (k + 1),
    }


def measure(
    target,
    draft,
    records: dict[str, list[dict]],
    *,
    temperatures: Sequence[float] = (0.0, 1.0),
    ks: Sequence[int] = (4,),
    new_tokens: int = 64,
    chat: bool = True,
    seed: int = 0,
    draft_vocab: int | None = None,
) -> dict[str, Any]:
    """Acceptance of ``draft`` against ``target`` per (K, temperature, category) and over all categories.

    ``records``: category -> prompt records (``{"id", "prompt"}``), e.g. from
    :func:`ssd_jax.bench.protocol.category_prompts`."""
    from ssd_jax.decoding.spec import SpecConfig
    from ssd_jax.drafters.vocab import head_vocab
    from ssd_jax.engine import generate
    from ssd_jax.sampling.filters import SamplingParams

    if not records or not any(records.values()):
        raise UserError("no prompts to measure acceptance on")
    cells = []
    for k in ks:
        spec = SpecConfig(method="sd", draft=draft, k=int(k), draft_vocab=draft_vocab)
        for t in temperatures:
            sp = SamplingParams(temperature=float(t), seed=seed, max_new_tokens=new_tokens, ignore_eos=True)
            pooled: list[int] = []
            drafted_all = 0
            for cat, recs in records.items():
                prompts = [r["prompt"] if isinstance(r["prompt"], str) else list(r["prompt"]) for r in recs]
                t0 = time.perf_counter()
                res = generate(target, prompts, sp, spec, chat=chat)
                per = [o["metrics"] for o in res.outputs]
                counts = [n for m in per for n in m["accepted_per_round"]]
                drafted = sum(m["drafted"] for m in per)
                pooled += counts
                drafted_all += drafted
                cells.append(
                    {
                        "k": int(k),
                        "temperature": float(t),
                        "category": cat,
                        "prompts": len(prompts),
                        "prompt_ids": [r["id"] for r in recs],
                        "wall_s": time.perf_counter() - t0,
                        **round_stats(counts, drafted, int(k)),
                    }
                )
            cells.append(
                {
                    "k": int(k),
                    "temperature": float(t),
                    "category": "all",
                    "prompts": sum(len(r) for r in records.values()),
                    **round_stats(pooled, drafted_all, int(k)),
                }
            )
    return {
        "target": target.name,
        "draft": getattr(draft, "name", draft),
        "draft_weights_sha256": getattr(draft, "weights_sha256", None),
        "new_tokens": new_tokens,
        "chat": chat,
        "seed": seed,
        "draft_vocab": draft_vocab if draft_vocab is not None else head_vocab(draft),
        "cells": cells,
    }


def render(res: dict[str, Any], title: str | None = None) -> str:
    """The markdown table of :func:`measure`'s result."""
    ks = sorted({c["k"] for c in res["cells"]})
    kmax = max(ks)
    lines = [
        f"# {title or 'Acceptance by position and category'}",
        "",
        f"Target {res['target']}, draft {res['draft']}"
        + (f" (vocabulary {res['draft_vocab']})" if res.get("draft_vocab") else "")
        + f"; {res['new_tokens']} new tokens per prompt, chat template: {'yes' if res['chat'] else 'no'}, "
        f"seed {res['seed']}. Held-out prompts (the benchmark categories; never training prompts).",
        "",
        ">= j: the fraction of verify rounds that accepted at least j of the K proposals. "
        "acceptance: accepted / drafted proposals. tokens/round: accepted + 1 (the bonus token).",
        "",
        "| K | T | category | prompts | rounds | acceptance | tokens/round | "
        + " | ".join(f">= {j}" for j in range(1, kmax + 1))
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * kmax,
    ]
    for c in res["cells"]:
        pos = [f"{x:.2f}" for x in c["at_least"]] + ["-"] * (kmax - c["k"])
        lines.append(
            f"| {c['k']} | {c['temperature']:g} | {c['category']} | {c['prompts']} | {c['rounds']} "
            f"| {c['acceptance']:.3f} | {c['tokens_per_round']:.2f} | " + " | ".join(pos) + " |"
        )
    return "\n".join(lines) + "\n"


def write(res: dict[str, Any], stem: str | os.PathLike) -> tuple[Path, Path]:
    """``<stem>.json`` and ``<stem>.md``."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    js, md = stem.with_suffix(".json"), stem.with_suffix(".md")
    js.write_text(json.dumps(res, indent=1) + "\n")
    md.write_text(render(res))
    return js, md


def suite(args) -> Path:
    """``--suite acceptance``: the draft ``--draft`` against ``--target`` on ``--categories``."""
    import jax

    import ssd_jax
    from ssd_jax.bench.common import environment, load_draft
    from ssd_jax.bench.protocol import category_prompts

    target = ssd_jax.load_model(args.target, dtype=args.dtype)
    draft = load_draft(args.draft, target)
    records = {c: category_prompts(c, args.n_prompts) for c in args.categories}
    res = measure(
        target,
        draft,
        records,
        temperatures=args.temperatures,
        ks=args.ks,
        new_tokens=args.new_tokens,
        chat=args.chat,
        seed=args.seed,
    )
    res["env"] = environment()
    stem = Path(args.out) / (f"acceptance_{jax.default_backend()}" + (f"_{args.tag}" if args.tag else ""))
    return write(res, stem)[1]
