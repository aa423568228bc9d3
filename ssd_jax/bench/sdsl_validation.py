"""SDSL validation under the benchmark protocol (``python -m ssd_jax.sdsl validate``).

Does the throughput-optimal draft size sit where the law (:mod:`ssd_jax.analysis.sdsl`) puts it?

1. **Sizes** (:func:`law_depths`): the draft shares the target's width, so a size is a depth.
   The law's N_opt gives a depth d (as ``python -m ssd_jax.train --size auto`` picks it); the
   validation takes the depths ``round(d·f)`` for f = 1/3, 2/3, 1, 4/3, 2 (distinct, below the
   target's depth), adding deeper ones until there are at least four.
2. **Training** (:func:`train_drafts`): every size with every seed (the seed sets the data
   order; the layers start from the target's), the same recipe and data for all, in
   ``<runs>/L<depth>-s<seed>``. Resumable: a finished run (its last step saved, a ``best/``
   export) is skipped, an unfinished one resumes from its last checkpoint.
3. **Measurement** (:func:`measure`): one protocol run (:mod:`ssd_jax.bench.protocol`) with AR
   and ``sd:K@<run>`` for every draft, interleaved per prompt in one process, several prompts
   per category, repeats; resumable like every protocol file.
4. **Report** (:func:`summarize`, :func:`render`): per size (seeds pooled), SD/AR with a 95%
   interval (the paired log ratios averaged per prompt over repeats and seeds, a t-interval
   across prompts), the measured acceptance, and the law's SD/AR from that acceptance at the K
   used, ``E[tau](alpha, K)·M / (M + K·N)``, beside it, with N the draft's layers (the law's
   count) and with its real per-token reads (layers + the shared head); per draft, its own
   interval. :func:`verdict` says from the numbers whether the optimum is resolved: the best
   size's interval is above both neighbours' (resolved), overlaps one (not resolved), or the
   best is the smallest or largest size measured (the optimum is not bracketed). Where the
   intervals overlap it adds the paired ratio of the best size over that neighbour on the same
   prompts and repeats (``next_vs_this``), which is sharper than comparing two intervals.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ssd_jax.analysis import sdsl
from ssd_jax.bench import protocol
from ssd_jax.bench.stats import clustered, ratio_ci
from ssd_jax.errors import UserError

FACTORS = (1 / 3, 2 / 3, 1.0, 4 / 3, 2.0)


@dataclasses.dataclass(frozen=True)
class Validation:
    """One validation: what to train and how to measure it.

    Attributes:
      target: registry name or path of the target.
      depths: draft depths (None: :func:`law_depths`).
      seeds: training seeds per size.
      data: a distill-data directory (``python -m ssd_jax.train distill-data``) for ``--loss
        distill``, or another ``--data`` of ``python -m ssd_jax.train`` with ``loss``.
      runs: directory of the training runs.
      out: directory of the results (protocol file, report, summary, plot).
      steps, batch_size, seq_len, lr, eval_every, eval_windows, loss, ce_weight, pack, draft_vocab:
        the training recipe, the same for every draft (``draft_vocab``: the head trimmed to that many
        tokens, as the shipped draft's; each draft then decodes with its trained head).
      k: SD lookahead in the measurement ("auto" or an integer).
      categories, n_prompts, repeats, new_tokens, chat: the protocol's settings.
    """

    target: str
    data: str
    runs: str
    out: str
    depths: tuple[int, ...] | None = None
    seeds: tuple[int, ...] = (0, 1)
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 5e-4
    eval_every: int = 200
    eval_windows: int = 32
    loss: str = "distill"
    ce_weight: float = 0.1
    pack: bool = True
    draft_vocab: int | None = None
    k: int | str = 4
    categories: tuple[str, ...] = protocol.CATEGORIES
    n_prompts: int = 8
    repeats: int = 3
    new_tokens: int = 64
    chat: bool = True


def law_depths(target_cfg, factors: Sequence[float] = FACTORS, at_least: int = 4) -> tuple[int, list[int]]:
    """(the law's depth, the depths to train): ``round(d·f)`` for each factor, distinct, at least 1,
    below the target's depth where possible, extended with deeper ones to ``at_least`` sizes."""
    from ssd_jax.models.params import count_params
    from ssd_jax.training.draft_model import layer_param_count

    per = layer_param_count(target_cfg)
    d = max(1, int(round((sdsl.n_opt(count_params(target_cfg)) - target_cfg.hidden_size) / per)))
    depths = sorted({max(1, int(round(d * f))) for f in factors})
    depths = [x for x in depths if x < target_cfg.num_layers] or [1]
    while len(depths) < at_least:
        depths.append(depths[-1] + 1)
    return d, depths


def size_of_depth(target_cfg, depth: int) -> str:
    """The ``--size`` that gives ``depth`` layers (:func:`ssd_jax.training.draft_model.size_draft`)."""
    from ssd_jax.training.draft_model import layer_param_count

    return str(depth * layer_param_count(target_cfg) + target_cfg.hidden_size)


def run_name(depth: int, seed: int) -> str:
    return f"L{depth}-s{seed}"


def plan(v: Validation, target_cfg) -> list[dict[str, Any]]:
    """The drafts of a validation: ``{name, depth, seed, size, path}`` per size and seed."""
    depths = list(v.depths) if v.depths else law_depths(target_cfg)[1]
    if any(d < 1 for d in depths):
        raise UserError(f"draft depths must be >= 1, got {depths}")
    if len(set(depths)) < len(depths):
        raise UserError(f"draft sizes must be distinct depths, got {depths}")
    return [
        {
            "name": run_name(d, s),
            "depth": d,
            "seed": s,
            "size": size_of_depth(target_cfg, d),
            "path": str(Path(v.runs) / run_name(d, s)),
        }
        for d in sorted(depths)
        for s in v.seeds
    ]


def _finished(path: Path, steps: int) -> bool:
    from ssd_jax.loading import draft as dfmt

    return dfmt.is_draft_dir(path / dfmt.BEST_DIR) and dfmt.read_meta(path).get("step", 0) >= steps


def train_drafts(v: Validation, drafts: Sequence[dict], *, corpus=None, log=print) -> list[dict[str, Any]]:
    """Train (or resume, or skip when finished) every draft of ``drafts``; returns their records
    (plan fields + N, reads per token, the law's M and N_opt, the best held-out eval), also
    written to ``<out>/drafts.json``. ``corpus`` overrides the held-out corpus (tests)."""
    from ssd_jax.loading import draft as dfmt
    from ssd_jax.training import RunDir, TrainArgs, train

    recs = []
    for d in drafts:
        path = Path(d["path"])
        if _finished(path, v.steps):
            log(f"{d['name']}: finished, skipped")
        else:
            args = TrainArgs(
                target=v.target,
                size=d["size"],
                steps=v.steps,
                batch_size=v.batch_size,
                seq_len=v.seq_len,
                lr=v.lr,
                loss=v.loss,
                seed=d["seed"],
                eval_every=v.eval_every,
                eval_windows=v.eval_windows,
                data=v.data,
                out=str(path),
                resume=RunDir(path).has_run(),
                ce_weight=v.ce_weight if v.loss == "distill" else 0.0,
                pack=v.pack and v.loss == "distill",
                draft_vocab=v.draft_vocab if v.loss == "distill" else None,
            )
            log(
                f"{d['name']}: training ({'resume' if args.resume else 'new'}), {d['depth']} layers, seed {d['seed']}"
            )
            train(args, corpus=corpus)
        meta = dfmt.read_meta(path / dfmt.BEST_DIR)
        recs.append(
            {
                **d,
                "N": meta["params"]["N"],
                "reads_per_token": meta["params"]["reads_per_token"],
                "M": meta["params"]["law"]["M"],
                "n_opt_law": meta["params"]["law"]["n_opt"],
                "steps": dfmt.read_meta(path)["step"],
                "best": meta.get("best"),
                "params_sha256": meta.get("params_sha256"),
            }
        )
    out = Path(v.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drafts.json").write_text(
        json.dumps({"validation": dataclasses.asdict(v), "drafts": recs}, indent=1) + "\n"
    )
    return recs


def method_name(v: Validation, draft: dict) -> str:
    return f"sd-k{v.k}@{draft['name']}"


def measure(
    v: Validation,
    drafts: Sequence[dict],
    target,
    records: dict[str, list[dict]] | None = None,
    progress: bool = True,
) -> Path:
    """The protocol run: AR and every draft interleaved per prompt (``<out>/protocol.jsonl``, resumable).
    ``records``: prompt records per category instead of the benchmark sets (tests)."""
    from ssd_jax.bench.common import load_draft

    methods = ["ar"] + [f"sd:{v.k}@{d['path']}" for d in drafts]
    specs = protocol.method_specs(methods, None, lambda ref: load_draft(ref, target))
    records = {
        c: (records[c] if records else protocol.category_prompts(c, v.n_prompts))[: v.n_prompts]
        for c in v.categories
    }
    units = protocol.build_units(records, v.n_prompts, 1)
    runners = {n: protocol.EngineRunner(target, s, chat=v.chat) for n, s in specs.items()}
    env_extra = {
        "target": target.name,
        "validation": dataclasses.asdict(v),
        "method_drafts": {
            method_name(v, d): {"path": d["path"], "params_sha256": d.get("params_sha256")} for d in drafts
        },
    }
    return protocol.run_protocol(
        runners,
        units,
        Path(v.out) / "protocol.jsonl",
        repeats=v.repeats,
        new_tokens=v.new_tokens,
        env_extra=env_extra,
        progress=progress,
    )


def _law(alpha: float | None, k: float | None, n: float, m: float) -> float | None:
    if alpha is None or k is None or not k > 0:
        return None
    return float(sdsl.speedup(min(max(alpha, 0.0), 1.0), k, n, m))


def summarize(v: Validation, drafts: Sequence[dict], rows: Sequence[dict]) -> dict[str, Any]:
    """Per draft and per size (seeds pooled): SD/AR decode tok/s ratio with its 95% interval, acceptance,
    tokens per round, K, the law's SD/AR from the measured acceptance; and :func:`verdict`."""
    runs = [r for r in rows if r.get("kind") == "run" and r["batch_size"] == 1]
    ar = {(r["category"], r["prompt_index"], r["repeat"]): r for r in runs if r["method"] == "ar"}
    by_method = defaultdict(list)
    for r in runs:
        by_method[r["method"]].append(r)
    per_draft, by_depth = [], defaultdict(list)
    log_speed: dict[int, dict[tuple, list[float]]] = defaultdict(lambda: defaultdict(list))
    for d in drafts:
        mine = by_method.get(method_name(v, d), [])
        pairs = [
            ((r["category"], r["prompt_index"]), r["decode_tok_s"] / ar[key]["decode_tok_s"])
            for r in mine
            if (key := (r["category"], r["prompt_index"], r["repeat"])) in ar
            and r["decode_tok_s"] > 0
            and ar[key]["decode_tok_s"] > 0
        ]
        acc = [r["acceptance_rate"] for r in mine if r.get("acceptance_rate") is not None]
        tpr = [r["tokens_per_round"] for r in mine if r.get("tokens_per_round") is not None]
        ks = [r["k"] for r in mine if r.get("k") is not None]
        rec = {
            **{k: d[k] for k in ("name", "depth", "seed", "N", "reads_per_token", "M")},
            "runs": len(mine),
            "sd_vs_ar": ratio_ci(clustered(pairs, log=True)) if pairs else (math.nan,) * 3,
            "acceptance": sum(acc) / len(acc) if acc else None,
            "tokens_per_round": sum(tpr) / len(tpr) if tpr else None,
            "k": sum(ks) / len(ks) if ks else None,
            "best_eval": d.get("best"),
        }
        per_draft.append(rec)
        by_depth[d["depth"]].append((rec, pairs))
        keyed = {
            (r["category"], r["prompt_index"], r["repeat"]): r["decode_tok_s"]
            for r in mine
            if r["decode_tok_s"] > 0
        }
        for key, x in keyed.items():
            log_speed[d["depth"]][key].append(math.log(x))
    sizes = []
    for depth in sorted(by_depth):
        recs = [x[0] for x in by_depth[depth]]
        pairs = [p for x in by_depth[depth] for p in x[1]]
        acc = [x["acceptance"] for x in recs if x["acceptance"] is not None]
        ks = [x["k"] for x in recs if x["k"] is not None]
        r0 = recs[0]
        a, k = (sum(acc) / len(acc) if acc else None), (sum(ks) / len(ks) if ks else None)
        sizes.append(
            {
                "depth": depth,
                "N": r0["N"],
                "reads_per_token": r0["reads_per_token"],
                "M": r0["M"],
                "seeds": [x["seed"] for x in recs],
                "sd_vs_ar": ratio_ci(clustered(pairs, log=True)) if pairs else (math.nan,) * 3,
                "acceptance": a,
                "k": k,
                "law_sd_vs_ar": _law(a, k, r0["N"], r0["M"]),
                "law_sd_vs_ar_reads": _law(a, k, r0["reads_per_token"], r0["M"]),
            }
        )
    for a, b in zip(sizes, sizes[1:]):  # paired on the same (prompt, repeat): the next size over this one
        ka, kb = log_speed[a["depth"]], log_speed[b["depth"]]
        pairs = [
            ((key[0], key[1]), math.exp(sum(kb[key]) / len(kb[key]) - sum(ka[key]) / len(ka[key])))
            for key in ka
            if key in kb
        ]
        a["next_vs_this"] = ratio_ci(clustered(pairs, log=True)) if pairs else (math.nan,) * 3
        a["next_depth"] = b["depth"]
    n_opt = drafts[0]["n_opt_law"] if drafts else None
    return {
        "drafts": per_draft,
        "sizes": sizes,
        "n_opt_law": n_opt,
        "law_depth": drafts[0].get("law_depth") if drafts else None,
        "verdict": verdict(sizes, n_opt),
    }


def _overlap(a: Sequence[float], b: Sequence[float]) -> bool:
    return not (a[1] > b[2] or b[1] > a[2])


def verdict(sizes: Sequence[dict], n_opt: float | None = None) -> str:
    """A plain statement, from the numbers, of whether the optimum is resolved and where it lies."""
    ok = [s for s in sizes if not math.isnan(s["sd_vs_ar"][0])]
    if len(ok) < 2:
        return "Not enough measurements to locate an optimum (fewer than two sizes measured)."
    if any(math.isnan(s["sd_vs_ar"][1]) for s in ok):
        return "No intervals (fewer than two prompts): the optimum cannot be judged."
    i = max(range(len(ok)), key=lambda j: ok[j]["sd_vs_ar"][0])
    best = ok[i]

    def desc(s):
        m, lo, hi = s["sd_vs_ar"]
        return f"{s['depth']} layer{'s' if s['depth'] > 1 else ''} (N = {s['N'] / 1e6:.2f}M): {m:.2f}x [{lo:.2f}, {hi:.2f}]"

    nbrs = [ok[j] for j in (i - 1, i + 1) if 0 <= j < len(ok)]
    over = [s for s in nbrs if _overlap(best["sd_vs_ar"], s["sd_vs_ar"])]
    if over:
        text = (
            f"The optimum is NOT resolved: the best size, {desc(best)}, has an interval that overlaps its "
            f"neighbour{'s' if len(over) > 1 else ''} {'; '.join(desc(s) for s in over)}."
        )
        paired = []
        for (
            s
        ) in over:  # the paired comparison on the same prompts is sharper than the overlap of two intervals
            j = ok.index(s)
            lo_s, hi_s = ok[min(i, j)], ok[max(i, j)]
            r = lo_s.get("next_vs_this")
            if r is None or lo_s.get("next_depth") != hi_s["depth"] or math.isnan(r[1]):
                continue
            m, lo, hi = r if j < i else tuple(1 / x for x in (r[0], r[2], r[1]))  # best / neighbour
            paired.append(
                f"{m:.3f}x [{lo:.3f}, {hi:.3f}] over {s['depth']} layers"
                + (" (excludes 1)" if lo > 1 or hi < 1 else " (includes 1)")
            )
        if paired:
            text += " Paired on the same prompts, the best size runs at " + "; ".join(paired) + "."
    elif i in (0, len(ok) - 1):
        edge = "smallest" if i == 0 else "largest"
        text = (
            f"The optimum is NOT bracketed: the best size is the {edge} one measured, {desc(best)}, above its "
            f"neighbour {desc(nbrs[0])}; the optimum may lie beyond the sizes measured."
        )
    else:
        text = (
            f"The optimum is resolved at {desc(best)}: its interval lies above both neighbours' "
            f"({'; '.join(desc(s) for s in nbrs)})."
        )
    if n_opt:
        law = min(ok, key=lambda s: abs(math.log(s["N"] / n_opt)))
        text += (
            f" The law's N_opt is {n_opt / 1e6:.2f}M, nearest the {law['depth']}-layer draft, which is "
            + ("the measured best." if law is best else "not the measured best.")
        )
    above = [s for s in ok if s["sd_vs_ar"][1] > 1.0]
    if above:
        text += (
            " Faster than AR (interval above 1): " + ", ".join(f"{s['depth']} layers" for s in above) + "."
        )
    elif all(s["sd_vs_ar"][2] < 1.0 for s in ok):
        text += " Every size is slower than AR (every interval below 1)."
    else:
        text += " No size is faster than AR beyond its interval."
    return text


def _ci(t) -> str:
    m, lo, hi = t
    if math.isnan(m):
        return "-"
    return f"{m:.2f}x" if math.isnan(lo) else f"{m:.2f}x [{lo:.2f}, {hi:.2f}]"


def _f(x, p=3) -> str:
    return "-" if x is None else f"{x:.{p}f}"


def render(v: Validation, summary: dict[str, Any], rows: Sequence[dict]) -> str:
    """The SDSL validation report (as docs/training.md quotes it)."""
    envs = [r for r in rows if r.get("kind") == "env"]
    e = envs[-1] if envs else {}
    loads = ", ".join(format(x["loadavg"][0], ".2f") for x in envs if "loadavg" in x)
    n_opt = summary.get("n_opt_law")
    lines = [
        f"# SDSL validation under the benchmark protocol: {v.target}",
        "",
        f"Drafts of {len(summary['sizes'])} sizes x {len(v.seeds)} seeds, each trained with the same recipe "
        f"({v.loss}{f', CE weight {v.ce_weight}' if v.loss == 'distill' else ''}{', packed' if v.pack and v.loss == 'distill' else ''}, "
        f"{v.steps} steps of {v.batch_size} x {v.seq_len} tokens, lr {v.lr:g}) on `{v.data}`; the seed sets the "
        f"data order. Measured under the protocol: AR and every draft's SD (K = {v.k}) interleaved per prompt in "
        f"one process; categories {', '.join(v.categories)}, {v.n_prompts} prompts each, {v.repeats} repeats, "
        f"{v.new_tokens} new tokens, greedy{', chat template' if v.chat else ''}. jax {e.get('jax', '?')}, "
        f"{e.get('backend', '?')}, commit {e.get('git_commit', '?')}, load average at session starts: {loads}.",
        "",
        f"Law: N_opt = {n_opt / 1e6:.2f}M non-embedding parameters." if n_opt else "",
        "",
        "## Per size (seeds pooled)",
        "",
        "SD/AR: decode tok/s ratio, geometric mean of the paired per-(prompt, repeat, seed) ratios, 95% "
        "t-interval across prompts (repeats and seeds of a prompt averaged first). Law: E[tau](alpha, K) M / "
        "(M + K N) with the measured acceptance alpha and the K used; N = the draft's layers (the law's count) "
        "or its real per-token reads (layers + the shared output head).",
        "",
        "| layers | N | reads/token vs target | seeds | SD/AR [95% CI] | next size / this, paired [95% CI] "
        "| acceptance | K | law SD/AR (N) | law SD/AR (reads) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary["sizes"]:
        nxt = _ci(s["next_vs_this"]) if "next_vs_this" in s else "-"
        lines.append(
            f"| {s['depth']} | {s['N'] / 1e6:.2f}M | {s['reads_per_token'] / s['M']:.2f} "
            f"| {', '.join(map(str, s['seeds']))} | {_ci(s['sd_vs_ar'])} | {nxt} | {_f(s['acceptance'])} "
            f"| {_f(s['k'], 1)} | {_f(s['law_sd_vs_ar'], 2)} | {_f(s['law_sd_vs_ar_reads'], 2)} |"
        )
    lines += [
        "",
        f"**{summary['verdict']}**",
        "",
        "## Per draft",
        "",
        "| draft | layers | seed | runs | SD/AR [95% CI] | acceptance | tokens/round | K | best held-out "
        "alpha (T=1, training eval) | step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for d in summary["drafts"]:
        b = d.get("best_eval") or {}
        lines.append(
            f"| {d['name']} | {d['depth']} | {d['seed']} | {d['runs']} | {_ci(d['sd_vs_ar'])} "
            f"| {_f(d['acceptance'])} | {_f(d['tokens_per_round'], 2)} | {_f(d['k'], 1)} "
            f"| {_f(b.get('alpha'))} | {b.get('step', '-')} |"
        )
    lines += [
        "",
        "Raw runs: `protocol.jsonl` (its protocol table: `protocol.md`); drafts: `drafts.json`; "
        "numbers: `summary.json`; plot: `sdsl.png`.",
    ]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> Path | None:
    """SD/AR with its interval against N, and the law's prediction from the measured acceptance."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a test dependency
        return None
    s = [x for x in summary["sizes"] if not math.isnan(x["sd_vs_ar"][0])]
    if not s:
        return None
    n = [x["N"] / 1e6 for x in s]
    m = [x["sd_vs_ar"][0] for x in s]
    lo = [x["sd_vs_ar"][0] - x["sd_vs_ar"][1] if not math.isnan(x["sd_vs_ar"][1]) else 0 for x in s]
    hi = [x["sd_vs_ar"][2] - x["sd_vs_ar"][0] if not math.isnan(x["sd_vs_ar"][2]) else 0 for x in s]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.errorbar(n, m, yerr=[lo, hi], fmt="o-", capsize=4, label="measured SD/AR (95% CI)")
    for key, lab in (
        ("law_sd_vs_ar", "law, measured alpha (N)"),
        ("law_sd_vs_ar_reads", "law, measured alpha (reads)"),
    ):
        pts = [(a, x[key]) for a, x in zip(n, s) if x[key] is not None]
        if pts:
            ax.plot(*zip(*pts), "x--", label=lab)
    if summary.get("n_opt_law"):
        ax.axvline(summary["n_opt_law"] / 1e6, color="grey", ls=":", label="law N_opt")
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("draft N (non-embedding parameters, M)")
    ax.set_ylabel("SD / AR decode tok/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(v: Validation, drafts: Sequence[dict] | None = None) -> Path:
    """Write ``<out>/sdsl.md``, ``summary.json``, ``sdsl.png`` and ``protocol.md`` from the results on disk."""
    out = Path(v.out)
    if drafts is None:
        f = out / "drafts.json"
        if not f.is_file():
            raise UserError(f"{f} does not exist: train the drafts first")
        drafts = json.loads(f.read_text())["drafts"]
    path = out / "protocol.jsonl"
    rows = protocol.read_rows(path) if path.is_file() else []
    summary = summarize(v, drafts, rows)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if rows:
        protocol.write_report(path, f"SDSL validation protocol runs: {v.target}")
    plot(summary, out / "sdsl.png")
    md = out / "sdsl.md"
    md.write_text(render(v, summary, rows))
    return md


def validate(
    v: Validation, target_cfg, *, train: bool = True, run: bool = True, corpus=None, records=None, log=print
) -> Path:
    """Train (resumably), measure (resumably) and report; returns the report's path. ``target_cfg``:
    the target's ModelConfig (sizes the drafts); ``corpus`` / ``records``: held-out corpus and
    prompts instead of the shipped sets (tests)."""
    import ssd_jax

    tcfg = target_cfg
    law_d, _ = law_depths(tcfg)
    drafts = plan(v, tcfg)
    if train:
        drafts = train_drafts(v, drafts, corpus=corpus, log=log)
    else:
        f = Path(v.out) / "drafts.json"
        if not f.is_file():
            raise UserError(f"{f} does not exist: run without --no-train first")
        drafts = json.loads(f.read_text())["drafts"]
    drafts = [{**d, "law_depth": law_d} for d in drafts]
    if run:
        target = ssd_jax.load_model(v.target)
        measure(v, drafts, target, records)
    return report(v, drafts)
