"""Resumable benchmark sweeps: one JSON line per configuration, a report with tables and plots.

``python -m ssd_jax.bench --sweep experiments/sweeps/NAME.json`` expands the config's grid
(method x K x fan-out x Saguaro C x backup x batch size x temperature x dataset category),
runs every configuration that the results file ``<out>/NAME.jsonl`` does not already hold,
and appends one JSON line per finished configuration. A killed sweep resumes where it
stopped: a line is appended with one ``write`` + ``fsync`` when a configuration finishes, and
a torn last line (a kill mid-write) is ignored on reading. ``--report NAME.jsonl`` renders a
markdown table and a matplotlib plot beside it.

Config file::

    {"name": "main", "target": "qwen2.5-coder-1.5b-instruct", "draft": "qwen2.5-coder-0.5b-instruct",
     "new_tokens": 64, "n_prompts": 2,
     "grid": {"method": ["ar", "sd", "ssd", "ngram"], "k": [4], "fan_out": ["geometric"],
              "saguaro_c": [1.0], "backup": ["neural"], "batch_size": [1], "temperature": [0.0],
              "category": ["code", "chat", "math"]}}

Keys a method ignores are dropped from its configuration (AR has no K), so the grid never
runs the same thing twice. ``ngram`` is SD with the n-gram drafter.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from ssd_jax.analysis import oracle
from ssd_jax.bench.common import environment, load_draft, saguaro_plot
from ssd_jax.data import prompts as prompt_sets
from ssd_jax.errors import UserError

AXES = ("method", "k", "fan_out", "saguaro_c", "backup", "batch_size", "temperature", "category")
USES = {
    "ar": ("method", "batch_size", "temperature", "category"),
    "sd": ("method", "k", "batch_size", "temperature", "category"),
    "ngram": ("method", "k", "batch_size", "temperature", "category"),
    "ssd": AXES,
}
DEFAULTS = {
    "k": 4,
    "fan_out": "geometric",
    "saguaro_c": 1.0,
    "backup": "auto",
    "batch_size": 1,
    "temperature": 0.0,
    "category": "code",
}


def read_config(path: str | os.PathLike | dict[str, Any]) -> dict[str, Any]:
    """A sweep config from a JSON file (or an already-parsed dict), checked."""
    if isinstance(path, dict):
        cfg, p = dict(path), Path(f"{path.get('name', 'sweep')}.json")
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"sweep config not found: {p}")
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{p}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if cfg.get("kind") == "oracle":
        for key in ("target", "draft"):
            if key not in cfg:
                raise UserError(f"{p}: missing {key!r}")
        cfg.setdefault("name", p.stem)
        return cfg
    for key in ("target", "grid"):
        if key not in cfg:
            raise UserError(f"{p}: missing {key!r}")
    unknown = set(cfg["grid"]) - set(AXES)
    if unknown:
        raise UserError(f"{p}: unknown grid axes {sorted(unknown)} (axes: {', '.join(AXES)})")
    bad = set(cfg["grid"].get("method", ["ar"])) - set(USES)
    if bad:
        raise UserError(f"{p}: unknown methods {sorted(bad)} (methods: {', '.join(USES)})")
    cfg.setdefault("name", p.stem)
    return cfg


def expand(grid: dict[str, list]) -> list[dict[str, Any]]:
    """Every distinct configuration of the grid (keys a method ignores removed), in grid order."""
    axes = [a for a in AXES if a in grid] or ["method"]
    values = [grid.get(a, ["ar"] if a == "method" else [DEFAULTS[a]]) for a in axes]
    seen, out = set(), []
    for combo in itertools.product(*values):
        c = {**{a: DEFAULTS[a] for a in AXES if a != "method"}, **dict(zip(axes, combo))}
        c = {a: c[a] for a in USES[c["method"]]}
        key = config_key(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def config_key(c: dict[str, Any]) -> str:
    return json.dumps(c, sort_keys=True)


def read_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a results file; a torn (unparseable) line, e.g. from a kill mid-write, is skipped."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def append_row(path: str | os.PathLike, row: dict[str, Any]) -> None:
    data = (json.dumps(row) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        # a torn previous line must not swallow this one: start on a fresh line
        if os.fstat(fd).st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    data = b"\n" + data
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _spec(c: dict[str, Any], draft):
    from ssd_jax.decoding.spec import SpecConfig

    m = c["method"]
    if m == "ar":
        return SpecConfig()
    if m == "ngram":
        return SpecConfig(method="sd", draft="ngram", k=c["k"])
    if m == "sd":
        return SpecConfig(method="sd", draft=draft, k=c["k"])
    fan = c["fan_out"] if c["fan_out"] == "geometric" else int(c["fan_out"])
    return SpecConfig(
        method="ssd", draft=draft, k=c["k"], fan_out=fan, saguaro_c=float(c["saguaro_c"]), backup=c["backup"]
    )


def category_prompts(category: str, n: int) -> list[dict]:
    """Prompts of a dataset category (``code``, ``chat``, ``math``) or ``copy`` (prompt-copying tasks)."""
    if category == "copy":
        return list(prompt_sets.copy_task_prompts(n))
    return prompt_sets.load_prompts(category, n=n)


def run_one(target, draft, c: dict[str, Any], cfg: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration over the config's prompts (batches of ``batch_size``); one result row."""
    import dataclasses

    from ssd_jax.sampling.filters import SamplingParams
    from ssd_jax.engine import generate

    n_prompts = int(cfg.get("n_prompts", 2))
    bs = int(c["batch_size"])
    prompts = [p["prompt"] for p in category_prompts(c["category"], max(n_prompts, bs) * bs)][
        : max(n_prompts // bs, 1) * bs
    ]
    sp = SamplingParams(
        temperature=float(c["temperature"]),
        seed=int(cfg.get("seed", 0)),
        max_new_tokens=int(cfg.get("new_tokens", 64)),
        ignore_eos=True,
    )
    spec = _spec(c, draft)
    generate(target, prompts[:bs], dataclasses.replace(sp, max_new_tokens=4), spec)  # compile, not timed
    runs = [generate(target, prompts[i : i + bs], sp, spec).metrics for i in range(0, len(prompts), bs)]
    tok = sum(m["generated_tokens"] for m in runs)
    wall = sum(m["wall_s"] for m in runs)
    dtok = sum(m["generated_tokens"] - m["batch_size"] for m in runs)
    dwall = sum(m["wall_s"] - m["ttft_s"] for m in runs)
    devices = runs[0].get("devices", {"target": 1, "draft": 0})
    n_dev = 1 if devices.get("single_device", True) else devices["target"] + devices["draft"]
    row: dict[str, Any] = {
        "config": c,
        "key": config_key(c),
        "prompts": len(prompts),
        "tokens_per_s": tok / wall,
        "decode_tokens_per_s": dtok / dwall if dwall > 0 else 0.0,
        "tokens_per_s_per_device": tok / wall / n_dev,
        "ttft_s": sum(m["ttft_s"] for m in runs) / len(runs),
        "tpot_s": sum(m["tpot_s"] for m in runs) / len(runs),
        "compile_s": runs[0]["compile_s"],
    }
    mean_keys = (
        "acceptance_rate",
        "mean_acceptance_length",
        "cache_hit_rate",
        "tau_hit",
        "tau_miss",
        "overlap_fraction",
    )
    sum_keys = ("draft_s", "verify_s", "sample_s", "overhead_s", "draft_exposed_s", "prefill_s")
    # a metric the engine did not measure is None (e.g. SD stage times without profile_stages): left out
    for k in mean_keys:
        if all(m.get(k) is not None for m in runs):
            row[k] = sum(m[k] for m in runs) / len(runs)
    for k in sum_keys:
        if all(m.get(k) is not None for m in runs):
            row[k] = sum(m[k] for m in runs)
    if "per_position_acceptance" in runs[0]:
        K = len(runs[0]["per_position_acceptance"])
        row["per_position_acceptance"] = [
            sum(m["per_position_acceptance"][j] for m in runs) / len(runs) for j in range(K)
        ]
    row["env"] = {**env, "loadavg": os.getloadavg()}
    return row


def _resolve_draft(name: str | None, target_name: str) -> str | None:
    """``"default"`` is the target's default draft model (e.g. the shipped trained checkpoint)."""
    if name == "default":
        from ssd_jax.drafters import default_draft

        return default_draft(target_name, method="model")
    return name


def _load_pair(cfg: dict[str, Any]):
    """(target, draft or None, environment with both models' weight hashes) of a sweep config."""
    import ssd_jax

    target = ssd_jax.load_model(cfg["target"])
    draft_name = _resolve_draft(cfg.get("draft"), cfg["target"])
    draft = load_draft(draft_name, target) if draft_name else None
    env = environment()
    env["models"] = {
        target.name: target.weights_sha256,
        **({draft.name: draft.weights_sha256} if draft else {}),
    }
    return target, draft, env


def run_sweep(config: str | os.PathLike | dict[str, Any], out_dir: str = "experiments/results") -> Path:
    """Run (or resume) a sweep given by a config file or dict; returns the results file."""
    from tqdm import tqdm

    cfg = read_config(config)
    if cfg.get("kind") == "oracle":
        return run_oracle(cfg, out_dir)
    configs = expand(cfg["grid"])
    os.makedirs(out_dir, exist_ok=True)
    path = Path(out_dir) / f"{cfg['name']}.jsonl"
    done = {r.get("key") for r in read_results(path)}
    todo = [c for c in configs if config_key(c) not in done]
    print(
        f"sweep {cfg['name']}: {len(configs)} configurations, {len(configs) - len(todo)} already in {path}",
        file=sys.stderr,
    )
    if not todo:
        return path
    target, draft, env = _load_pair(cfg)
    for c in (bar := tqdm(todo, desc=cfg["name"], unit="config")):
        bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in c.items()))
        t = time.perf_counter()
        row = run_one(target, draft, c, cfg, env)
        row["run_s"] = time.perf_counter() - t
        append_row(path, row)
    return path


def run_oracle(cfg: dict[str, Any], out_dir: str) -> Path:
    """Oracle bounds and n-gram vs draft by prompt-output overlap (greedy; see :mod:`ssd_jax.analysis.oracle`).

    Per prompt: the target's greedy output (AR, stopping at EOS), the draft's teacher-forced
    greedy matches on it, then the rounds each proposer would take. One JSON line per prompt.
    """
    from tqdm import tqdm

    from ssd_jax.sampling.filters import SamplingParams
    from ssd_jax.engine import generate
    from ssd_jax.decoding.batch import encode_prompts

    os.makedirs(out_dir, exist_ok=True)
    path = Path(out_dir) / f"{cfg['name']}.jsonl"
    k, n = int(cfg.get("k", 4)), int(cfg.get("n_prompts", 4))
    todo = [
        (cat, i, p)
        for cat in cfg.get("categories", ["code", "chat", "math", "copy"])
        for i, p in enumerate(category_prompts(cat, n)[:n])
    ]
    done = {r.get("key") for r in read_results(path)}
    todo = [t for t in todo if f"{t[0]}/{t[1]}" not in done]
    print(f"oracle {cfg['name']}: {len(todo)} prompts to run, results in {path}", file=sys.stderr)
    if not todo:
        return path
    target, draft, env = _load_pair(cfg)
    sp = SamplingParams(max_new_tokens=int(cfg.get("new_tokens", 64)))
    for cat, i, p in tqdm(todo, desc=cfg["name"], unit="prompt"):
        prompt_ids = encode_prompts(target, [p["prompt"]], chat=bool(cfg.get("chat", True)))[0]
        out_ids = generate(target, [prompt_ids], sp).outputs[0]["token_ids"]
        if len(out_ids) < 2:
            continue
        tokens = list(prompt_ids) + list(out_ids)
        matches = oracle.teacher_forced_matches(draft, tokens, len(prompt_ids))
        res = oracle.analyze(prompt_ids, out_ids, matches, k)
        append_row(
            path,
            {
                "kind": "oracle",
                "key": f"{cat}/{i}",
                "category": cat,
                "prompt_id": p.get("id"),
                "k": k,
                **res,
                "env": {**env, "loadavg": os.getloadavg()},
            },
        )
    return path


# Built-in suites: lists of sweep configs. "draft": "default" is the target's default draft.
_SMOLLM = {"target": "smollm2-135m-instruct", "draft": "default"}
SUITES: dict[str, dict[str, Any]] = {
    "smoke": {
        "about": "AR / SD / n-gram / SSD on SmolLM2-135M with its shipped draft, two categories, 32 tokens, "
        "and the oracle bounds on two prompts per category (under 10 minutes on a 2-core CPU).",
        "sweeps": [
            {
                "name": "smoke_methods",
                **_SMOLLM,
                "new_tokens": 32,
                "n_prompts": 1,
                "grid": {
                    "method": ["ar", "sd", "ngram", "ssd"],
                    "k": [4],
                    "backup": ["auto"],
                    "category": ["code", "chat"],
                },
            },
            {
                "name": "smoke_oracle",
                "kind": "oracle",
                **_SMOLLM,
                "k": 4,
                "new_tokens": 48,
                "n_prompts": 2,
                "categories": ["code", "copy"],
            },
        ],
    },
    "paper": {
        "about": "The papers' tables at small scale on SmolLM2-135M and its shipped draft: the main table "
        "(1), temperature x fan-out (2), batch size x backup with the time breakdown (3, 5), the "
        "Saguaro C sweep (4), and the oracle bounds with n-gram vs draft by BLEU-4 bin (6, 7).",
        "sweeps": [
            {
                "name": "paper_main",
                **_SMOLLM,
                "new_tokens": 64,
                "n_prompts": 4,
                "grid": {
                    "method": ["ar", "sd", "ngram", "ssd"],
                    "k": [4],
                    "backup": ["auto"],
                    "category": ["code", "chat", "math"],
                },
            },
            {
                "name": "paper_temperature",
                **_SMOLLM,
                "new_tokens": 64,
                "n_prompts": 2,
                "grid": {
                    "method": ["ar", "sd", "ssd"],
                    "k": [4],
                    "fan_out": [2, "geometric"],
                    "backup": ["neural"],
                    "temperature": [0.0, 0.3, 0.7, 1.0],
                    "category": ["chat"],
                },
            },
            {
                "name": "paper_batch",
                **_SMOLLM,
                "new_tokens": 48,
                "n_prompts": 4,
                "grid": {
                    "method": ["ar", "sd", "ngram", "ssd"],
                    "k": [4],
                    "backup": ["neural", "ngram", "auto"],
                    "batch_size": [1, 4, 16],
                    "category": ["code"],
                },
            },
            {
                "name": "paper_saguaro",
                **_SMOLLM,
                "new_tokens": 64,
                "n_prompts": 2,
                "grid": {
                    "method": ["ssd"],
                    "k": [4],
                    "saguaro_c": [0.0, 0.25, 0.5, 0.75, 1.0],
                    "backup": ["neural"],
                    "temperature": [1.0],
                    "category": ["chat"],
                },
            },
            {
                "name": "paper_oracle",
                "kind": "oracle",
                **_SMOLLM,
                "k": 4,
                "new_tokens": 96,
                "n_prompts": 8,
                "categories": ["code", "chat", "math", "copy"],
            },
        ],
    },
}


def run_suite(
    name: str, out_dir: str = "experiments/results", target: str | None = None, draft: str | None = None
) -> Path:
    """Run (or resume) every sweep of a built-in suite into ``<out_dir>/<name>/``, report each,
    and write the suite's index ``README.md`` there; returns the index."""
    if name not in SUITES:
        raise UserError(f"unknown suite {name!r} (suites: {', '.join(SUITES)})")
    suite = SUITES[name]
    d = Path(out_dir) / name
    made = []
    for cfg in suite["sweeps"]:
        cfg = {**cfg, **({"target": target} if target else {}), **({"draft": draft} if draft else {})}
        path = run_sweep(cfg, str(d))
        made.append((cfg, path, *report(path)))
    lines = [
        f"# Suite `{name}`",
        "",
        suite["about"],
        "",
        f"Re-run (resumes; finished configurations are skipped): `python -m ssd_jax.bench --suite {name}`",
        "",
    ]
    for cfg, path, md, png in made:
        lines.append(
            f"- [{cfg['name']}]({md.name}) ({path.name}" + (f", [plot]({png.name})" if png else "") + ")"
        )
    index = d / "README.md"
    index.write_text("\n".join(lines) + "\n")
    return index


# --- report -------------------------------------------------------------------------------


def report(results_path: str | os.PathLike) -> tuple[Path, Path | None]:
    """Markdown tables and a matplotlib plot beside the results; returns (markdown, plot).

    Tables: decode speed, acceptance and cache hits per configuration; the time breakdown
    (draft, verify, sampling, overhead as shares of the round time; SSD's exposed draft time);
    for a Saguaro C sweep a second plot of cache hit rate against acceptance (the SSD paper's
    Fig. 5). Oracle results get the oracle tables instead (:func:`ssd_jax.analysis.oracle.render_markdown`).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(results_path)
    rows = read_results(p)
    if not rows:
        raise UserError(f"no results in {p}")
    if rows[0].get("kind") == "oracle":
        return _report_oracle(p, rows)
    lines = _speed_table(p, rows) + _breakdown_table(rows, _label)
    md = p.with_suffix(".md")
    extra_png = saguaro_plot(p, rows, plt)
    md.write_text(
        "\n".join(lines)
        + f"\n\n![decode tok/s]({p.stem}.png)\n"
        + (f"\n![cache hit rate against acceptance]({extra_png.name})\n" if extra_png else "")
    )
    return md, _speed_plot(p, rows, plt)


def _label(c: dict[str, Any]) -> str:
    """A configuration's name in the report: its settings but the category."""
    return " ".join(f"{k}={v}" for k, v in c.items() if k not in ("category",))


def _speed_table(p: Path, rows: list[dict[str, Any]]) -> list[str]:
    """The report's header and decode-speed table: per configuration and category, tok/s (per sequence,
    per device, against AR at the same category, batch size and temperature), acceptance, cache hits."""
    at = lambda c: (c["category"], c["batch_size"], c["temperature"])
    base = {at(r["config"]): r["decode_tokens_per_s"] for r in rows if r["config"]["method"] == "ar"}
    e = rows[0]["env"]
    lines = [
        f"# Sweep {p.stem}",
        "",
        f"{e.get('backend')} ({e.get('device_kind')}, {e.get('device_count')} device(s)), jax {e.get('jax')}, "
        f"commit {e.get('git_commit')}; models {e.get('models')}. Decode tok/s excludes prefill and the first "
        "token and counts every sequence of the batch (throughput); per-seq divides by the batch size. "
        "'vs AR' compares with AR at the same category, batch size and temperature.",
        "",
        "| configuration | category | prompts | decode tok/s | per-seq tok/s | vs AR | tok/s/device | acceptance "
        "| tokens/round | hit | tau hit | tau miss | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x):
        return "-" if x is None else f"{x:.2f}"

    for r in rows:
        c = r["config"]
        b = base.get(at(c))
        lines.append(
            f"| {_label(c)} | {c['category']} | {r['prompts']} | {r['decode_tokens_per_s']:.2f} "
            f"| {r['decode_tokens_per_s'] / c['batch_size']:.2f} "
            f"| {f(r['decode_tokens_per_s'] / b if b else None)} | {r['tokens_per_s_per_device']:.2f} "
            f"| {f(r.get('acceptance_rate'))} | {f(r.get('mean_acceptance_length'))} "
            f"| {f(r.get('cache_hit_rate'))} | {f(r.get('tau_hit'))} | {f(r.get('tau_miss'))} "
            f"| {r['env']['loadavg'][0]:.2f} |"
        )
    return lines


def _speed_plot(p: Path, rows: list[dict[str, Any]], plt) -> Path:
    """``<results>.png``: decode tok/s per configuration, a bar per category."""
    cats = sorted({r["config"]["category"] for r in rows})
    e = rows[0]["env"]
    labels = list(dict.fromkeys(_label(r["config"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) * len(cats) / 2), 4))
    width = 0.8 / max(len(cats), 1)
    for i, cat in enumerate(cats):
        vals = {_label(r["config"]): r["decode_tokens_per_s"] for r in rows if r["config"]["category"] == cat}
        ax.bar(
            [j + i * width for j in range(len(labels))],
            [vals.get(lb, 0.0) for lb in labels],
            width,
            label=cat,
        )
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{p.stem} ({e.get('backend')}, {e.get('device_kind')})")
    ax.legend()
    fig.tight_layout()
    png = p.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


BREAKDOWN = ("draft_s", "verify_s", "sample_s", "overhead_s")


def _breakdown_table(rows: list[dict[str, Any]], label) -> list[str]:
    """The vLLM study's time breakdown: each part's share of the decode time, per configuration."""
    rows = [r for r in rows if all(r.get(k) is not None for k in BREAKDOWN)]
    if not rows:
        return []
    out = [
        "",
        "## Time breakdown",
        "",
        "Shares of the summed part times (draft, verify, sampling and rejection, host overhead). For SSD the "
        "draft runs beside the verify; 'exposed' is the draft time nothing else overlapped.",
        "",
        "| configuration | category | draft | verify | sampling | overhead | exposed draft s | total s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tot = sum(r[k] for k in BREAKDOWN) or 1.0
        exp = r.get("draft_exposed_s")
        out.append(
            f"| {label(r['config'])} | {r['config']['category']} | "
            + " | ".join(f"{r[k] / tot:.0%}" for k in BREAKDOWN)
            + f" | {'-' if exp is None else f'{exp:.2f}'} | {tot:.2f} |"
        )
    return out


def _report_oracle(p: Path, rows: list[dict[str, Any]]) -> tuple[Path, Path | None]:
    e = rows[0]["env"]
    md = p.with_suffix(".md")
    md.write_text(
        f"# {p.stem}\n\n{e.get('backend')}, commit {e.get('git_commit')}; models {e.get('models')}; "
        f"K = {rows[0]['k']}, greedy, {len(rows)} prompts.\n\n"
        + oracle.render_markdown(oracle.aggregate(rows))
        + "\n"
    )
    return md, None
