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

from ssd_jax.errors import UserError

AXES = ("method", "k", "fan_out", "saguaro_c", "backup", "batch_size", "temperature", "category")
USES = {
    "ar": ("method", "batch_size", "temperature", "category"),
    "sd": ("method", "k", "batch_size", "temperature", "category"),
    "ngram": ("method", "k", "batch_size", "temperature", "category"),
    "ssd": AXES,
}
DEFAULTS = {"k": 4, "fan_out": "geometric", "saguaro_c": 1.0, "backup": "auto", "batch_size": 1, "temperature": 0.0,
            "category": "code"}


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"sweep config not found: {p}")
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{p}: invalid JSON ({e.msg} at line {e.lineno})") from None
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
    from ssd_jax import SpecConfig

    m = c["method"]
    if m == "ar":
        return SpecConfig()
    if m == "ngram":
        return SpecConfig(method="sd", draft="ngram", k=c["k"])
    if m == "sd":
        return SpecConfig(method="sd", draft=draft, k=c["k"])
    fan = c["fan_out"] if c["fan_out"] == "geometric" else int(c["fan_out"])
    return SpecConfig(method="ssd", draft=draft, k=c["k"], fan_out=fan, saguaro_c=float(c["saguaro_c"]),
                      backup=c["backup"])


def run_one(target, draft, c: dict[str, Any], cfg: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration over the config's prompts (batches of ``batch_size``); one result row."""
    import dataclasses

    from ssd_jax import SamplingParams, generate
    from ssd_jax.data import load_prompts

    n_prompts = int(cfg.get("n_prompts", 2))
    bs = int(c["batch_size"])
    prompts = [p["prompt"] for p in load_prompts(c["category"], n=max(n_prompts, bs) * bs)][: max(n_prompts // bs, 1) * bs]
    sp = SamplingParams(temperature=float(c["temperature"]), seed=int(cfg.get("seed", 0)),
                        max_new_tokens=int(cfg.get("new_tokens", 64)), ignore_eos=True)
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
    mean_keys = ("acceptance_rate", "mean_acceptance_length", "cache_hit_rate", "tau_hit", "tau_miss",
                 "overlap_fraction")
    sum_keys = ("draft_s", "verify_s", "sample_s", "overhead_s", "draft_exposed_s", "prefill_s")
    for k in mean_keys:
        if k in runs[0]:
            row[k] = sum(m[k] for m in runs) / len(runs)
    for k in sum_keys:
        if k in runs[0]:
            row[k] = sum(m[k] for m in runs)
    if "per_position_acceptance" in runs[0]:
        K = len(runs[0]["per_position_acceptance"])
        row["per_position_acceptance"] = [sum(m["per_position_acceptance"][j] for m in runs) / len(runs) for j in range(K)]
    row["env"] = {**env, "loadavg": os.getloadavg()}
    return row


def run_sweep(config_path: str, out_dir: str = "experiments/results") -> Path:
    """Run (or resume) a sweep; returns the results file."""
    from tqdm import tqdm

    import ssd_jax
    from ssd_jax.bench import _env, _load_draft

    cfg = read_config(config_path)
    configs = expand(cfg["grid"])
    os.makedirs(out_dir, exist_ok=True)
    path = Path(out_dir) / f"{cfg['name']}.jsonl"
    done = {r.get("key") for r in read_results(path)}
    todo = [c for c in configs if config_key(c) not in done]
    print(f"sweep {cfg['name']}: {len(configs)} configurations, {len(configs) - len(todo)} already in {path}",
          file=sys.stderr)
    if not todo:
        return path
    target = ssd_jax.load_model(cfg["target"])
    draft = _load_draft(cfg["draft"], target) if cfg.get("draft") else None
    env = _env()
    env["models"] = {target.name: target.weights_sha256, **({draft.name: draft.weights_sha256} if draft else {})}
    for c in (bar := tqdm(todo, desc=cfg["name"], unit="config")):
        bar.set_postfix_str(" ".join(f"{k}={v}" for k, v in c.items()))
        t = time.perf_counter()
        row = run_one(target, draft, c, cfg, env)
        row["run_s"] = time.perf_counter() - t
        append_row(path, row)
    return path


# --- report -------------------------------------------------------------------------------


def report(results_path: str | os.PathLike) -> tuple[Path, Path]:
    """Markdown table and a matplotlib plot (decode tok/s per configuration, by category) beside the results."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = Path(results_path)
    rows = read_results(p)
    if not rows:
        raise UserError(f"no results in {p}")
    cats = sorted({r["config"]["category"] for r in rows})
    base = {(r["config"]["category"], r["config"]["batch_size"], r["config"]["temperature"]): r["decode_tokens_per_s"]
            for r in rows if r["config"]["method"] == "ar"}

    def label(c):
        return " ".join(f"{k}={v}" for k, v in c.items() if k not in ("category",))

    e = rows[0]["env"]
    lines = [f"# Sweep {p.stem}", "",
             f"{e.get('backend')} ({e.get('device_kind')}, {e.get('device_count')} device(s)), jax {e.get('jax')}, "
             f"commit {e.get('git_commit')}; models {e.get('models')}. Decode tok/s excludes prefill and the first "
             "token; 'vs AR' compares with AR at the same category, batch size and temperature.", "",
             "| configuration | category | prompts | decode tok/s | vs AR | tok/s/device | acceptance | tokens/round "
             "| hit | tau hit | tau miss | load avg |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x):
        return "-" if x is None else f"{x:.2f}"

    for r in rows:
        c = r["config"]
        b = base.get((c["category"], c["batch_size"], c["temperature"]))
        lines.append(f"| {label(c)} | {c['category']} | {r['prompts']} | {r['decode_tokens_per_s']:.2f} "
                     f"| {f(r['decode_tokens_per_s'] / b if b else None)} | {r['tokens_per_s_per_device']:.2f} "
                     f"| {f(r.get('acceptance_rate'))} | {f(r.get('mean_acceptance_length'))} "
                     f"| {f(r.get('cache_hit_rate'))} | {f(r.get('tau_hit'))} | {f(r.get('tau_miss'))} "
                     f"| {r['env']['loadavg'][0]:.2f} |")
    md = p.with_suffix(".md")
    md.write_text("\n".join(lines) + f"\n\n![decode tok/s]({p.stem}.png)\n")

    labels = list(dict.fromkeys(label(r["config"]) for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) * len(cats) / 2), 4))
    width = 0.8 / max(len(cats), 1)
    for i, cat in enumerate(cats):
        vals = {label(r["config"]): r["decode_tokens_per_s"] for r in rows if r["config"]["category"] == cat}
        ax.bar([j + i * width for j in range(len(labels))], [vals.get(lb, 0.0) for lb in labels], width, label=cat)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))])
    ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{p.stem} ({e.get('backend')}, {e.get('device_kind')})")
    ax.legend()
    fig.tight_layout()
    png = p.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return md, png
