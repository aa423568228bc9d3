"""The benchmark protocol behind every speed claim (``python -m ssd_jax.bench --suite protocol``).

A claim is a ratio against AR with its 95% interval, measured like this:

* **Units.** Per prompt category, at least 8 units; a unit is one prompt at batch 1, or ``B``
  prompts of the category at batch ``B``. Each of ``code``, ``chat`` and ``math`` takes its prompts
  from two sources in turn (:func:`ssd_jax.data.prompts.load_prompts`), so half of an 8-prompt
  sample are MT-bench questions: ``code`` is HumanEval and MT-bench coding, ``chat`` ShareGPT and
  MT-bench writing / roleplay / reasoning / extraction / STEM / humanities, ``math`` CHAMP and
  MT-bench math. ``copy`` is HumanEval functions with an instruction to repeat or lightly edit
  them (:func:`ssd_jax.data.prompts.copy_task_prompts`).
* **Interleaving.** For each repeat (at least 3) and each unit, every method runs back to
  back in one process, in a rotated order (or a seeded shuffle, ``order="shuffle"``), so a
  burst of load hits all methods alike and no method always runs first. Units of different
  categories alternate too.
* **Warm-up.** Before any timed run, every method is compiled on every shape the timed runs
  will use (one ``generate`` per distinct prefill width and cache length); a timed run that
  still compiled is flagged (``compile_s``).
* **Each run** records decode-only tok/s (tokens after the first / time after the first
  token) and end-to-end tok/s (prefill included), time to first token, acceptance and tokens
  per round, the 1-minute load average before and after, and a hash of the tokens (greedy
  methods must match AR's).
* **Results** go to a JSONL file, one line per run (appended with write + fsync; a rerun
  skips the runs it holds: resumable), with an ``env`` line per session (jax version,
  backend, device, git commit, measured bandwidth and the AR roofline), and a markdown
  report (:func:`render`).
* **Statistics** (:mod:`ssd_jax.bench.stats`): tok/s means with a 95% t-interval over
  prompts (a prompt's repeats averaged first: repeats of one prompt are not independent);
  each method's ratio to AR is the geometric mean of the paired per-(prompt, repeat) ratios,
  averaged in log space over a prompt's repeats, with a 95% t-interval on the log ratios
  across prompts, exponentiated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ssd_jax.bench.common import environment
from ssd_jax.bench.fair import hardware_fair
from ssd_jax.bench.stats import clustered, mean_ci, ratio_ci
from ssd_jax.bench.sweep import append_row
from ssd_jax.bench.sweep import read_results as read_rows
from ssd_jax.errors import UserError

CATEGORIES = ("code", "chat", "math", "copy")
ORDERS = ("rotate", "shuffle")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One timed input: a batch of prompts (strings or token-id lists) of one category."""

    category: str
    index: int
    prompts: tuple
    ident: str  # stable id of the unit (prompt ids), checked on resume


def category_prompts(category: str, n: int) -> list[dict]:
    """``n`` prompt records of a category from the offline sets (``copy``: the prompt-copying tasks)."""
    from ssd_jax.data.prompts import copy_task_prompts, load_prompts

    if category == "copy":
        return list(copy_task_prompts(n))
    if category not in CATEGORIES:
        raise UserError(f"unknown category {category!r} (choose from {', '.join(CATEGORIES)})")
    return load_prompts(category, n=n)


def build_units(records: dict[str, list[dict]], n_units: int, batch_size: int) -> list[Unit]:
    """``n_units`` units per category from its records (``{"id", "prompt"}``), categories alternating.

    At batch ``B`` unit ``i`` holds records ``i*B .. i*B+B-1``: disjoint batches when there are
    ``n_units * B`` records (the suite loads that many), cycling through fewer."""
    per_cat = {}
    for cat, recs in records.items():
        if not recs:
            raise UserError(f"no prompts for category {cat!r}")
        us = []
        for i in range(n_units):
            rs = [recs[(i * batch_size + j) % len(recs)] for j in range(batch_size)]
            us.append(
                Unit(
                    cat,
                    i,
                    tuple(r["prompt"] if isinstance(r["prompt"], str) else tuple(r["prompt"]) for r in rs),
                    "+".join(str(r["id"]) for r in rs),
                )
            )
        per_cat[cat] = us
    return [u for i in range(n_units) for us in per_cat.values() for u in us[i : i + 1]]


def run_order(
    methods: Sequence[str], position: int, repeat: int, order: str = "rotate", seed: int = 0
) -> list[str]:
    """The order of ``methods`` for the unit at ``position`` (in the schedule) in ``repeat``.

    ``rotate``: shifted by ``position + repeat``, so every method runs at every place in turn;
    ``shuffle``: a permutation seeded by (seed, repeat, position)."""
    ms = list(methods)
    if order == "rotate":
        o = (position + repeat) % len(ms)
        return ms[o:] + ms[:o]
    if order == "shuffle":
        random.Random(f"ssd_jax.protocol/{seed}/{repeat}/{position}").shuffle(ms)
        return ms
    raise UserError(f"unknown order {order!r} (choose from {', '.join(ORDERS)})")


# --- runners: one per method, the same interface for ssd_jax and peers ---------------------


class EngineRunner:
    """A method of ours: ``generate(target, prompts, greedy, spec)``."""

    def __init__(self, target, spec, chat: bool = False):
        self.target, self.spec, self.chat = target, spec, chat

    def _sp(self, new_tokens: int):
        from ssd_jax.sampling.filters import SamplingParams

        return SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)

    def warm(self, units: Sequence[Unit], new_tokens: int) -> int:
        """Compile every shape the units need: one run per distinct (prefill width, cache length)."""
        from ssd_jax.decoding.batch import encode_prompts, plan_batch

        sp, seen = self._sp(new_tokens), set()
        for u in units:
            key = plan_batch(
                self.target, encode_prompts(self.target, list(u.prompts), self.chat), sp, self.spec
            )
            if key not in seen:
                seen.add(key)
                self(u.prompts, new_tokens)
        return len(seen)

    def __call__(self, prompts, new_tokens: int) -> dict[str, Any]:
        from ssd_jax.engine import generate

        res = generate(
            self.target,
            [list(p) if not isinstance(p, str) else p for p in prompts],
            self._sp(new_tokens),
            self.spec,
            chat=self.chat,
        )
        m = res.metrics
        return {
            "generated_tokens": m["generated_tokens"],
            "wall_s": m["wall_s"],
            "ttft_s": m["ttft_s"],
            "decode_tok_s": m["decode_tokens_per_s"],
            "e2e_tok_s": m["tokens_per_s"],
            "compile_s": m.get("compile_s"),
            "acceptance_rate": m.get("acceptance_rate"),
            "tokens_per_round": m.get("mean_acceptance_length"),
            "rounds": m.get("verify_steps"),
            "k": m.get("k_mean") or m.get("k"),
            "cache_hit_rate": m.get("cache_hit_rate"),
            "tau_hit": m.get("tau_hit"),
            "tau_miss": m.get("tau_miss"),
            "round_s": m.get("round_s"),
            "expected_speedup": ((m.get("plan") or {}).get("predicted") or {}).get("expected_speedup"),
            "token_ids": [o["token_ids"] for o in res.outputs],
        }


def method_specs(
    names: Sequence[str], draft=None, load_draft: Callable[[str], Any] | None = None
) -> dict[str, Any]:
    """SpecConfigs by name: ``ar``, ``sd:K`` (the draft model), ``ngram:K`` (n-gram SD), ``ssd:K``;
    K is an integer or ``auto`` (measured, cached: :mod:`ssd_jax.planning`), default 4. The draft's
    vocabulary and weight dtype are ``auto`` (the defaults a user gets) unless options say:
    ``:vN`` trims the head to N tokens and ``:full`` keeps the whole head (``--draft-vocab``);
    ``:bf16`` / ``:f32`` store the matrices in bfloat16 / float32 (``--draft-dtype``); e.g.
    ``sd:auto`` (the defaults), ``sd:auto:v32768:bf16`` (tuned by hand), ``sd:auto:full:f32``
    (the defaults before they were automatic).

    ``sd:K@DRAFT`` / ``ssd:K@DRAFT`` use the draft ``DRAFT`` (a name or path, loaded once by
    ``load_draft``) instead of ``draft``, so one run can interleave drafts of several sizes; the
    method is named ``sd-kK@<last path component of DRAFT>``."""
    from ssd_jax.decoding.spec import SpecConfig
    from ssd_jax.engine.methods.eagle import is_eagle

    usage = "(ar, sd:K, ngram:K, ssd:K; K an integer or auto; sd:K:vN|full; sd:K:bf16|f32; sd:K@DRAFT)"
    out, loaded, labels = {}, {}, {}
    for n in names:
        body, at, ref = n.partition("@")
        kind, *rest = body.split(":")
        vocab, wdtype, vtag, dtag = "auto", "auto", "", ""
        try:
            k = rest[0] if rest and rest[0] == "auto" else int(rest[0]) if rest and rest[0] else 4
            for o in rest[1:]:
                if o in ("bf16", "f32") and not dtag:
                    wdtype, dtag = ("bfloat16" if o == "bf16" else "float32"), f"-{o}"
                elif o == "full" and not vtag:
                    vocab, vtag = None, "-vfull"
                elif o.startswith("v") and not vtag:
                    vocab = int(o[1:])
                    vtag = f"-v{vocab}"
                else:
                    raise ValueError(o)
        except ValueError:
            raise UserError(f"bad method {n!r} {usage}") from None
        if (vtag or dtag) and kind not in ("sd", "ssd"):
            raise UserError(f"bad method {n!r} {usage}")
        if at and (kind not in ("sd", "ssd") or not ref):
            raise UserError(f"bad method {n!r}: only sd and ssd take @DRAFT {usage}")
        suffix = f"-k{k}{vtag}{dtag}"
        if kind == "ar":
            out["ar"] = SpecConfig()
        elif kind == "ngram":
            out[f"ngram{suffix}"] = SpecConfig(method="sd", draft="ngram", k=k)
        elif kind in ("sd", "ssd"):
            d = draft
            if at:
                label = Path(ref.rstrip("/")).name or ref
                if labels.setdefault(label, ref) != ref:
                    raise UserError(f"drafts {labels[label]!r} and {ref!r} would both be named {label!r}")
                # an EAGLE head stays a reference: the engine loads it beside the target
                if ref not in loaded:
                    loaded[ref] = load_draft(ref) if load_draft is not None and not is_eagle(ref) else ref
                d, suffix = loaded[ref], f"{suffix}@{label}"
            if d is None:
                raise UserError(f"method {n} needs a draft model")
            out[f"{kind}{suffix}"] = SpecConfig(
                method=kind, draft=d, k=k, draft_vocab=vocab, draft_dtype=wdtype
            )
        else:
            raise UserError(f"unknown method {n!r} {usage}")
    if "ar" not in out:
        raise UserError("the protocol needs the ar method: every ratio is against it")
    return out


# --- the run ---------------------------------------------------------------------------------


def _key(r: dict) -> tuple:
    return (r["batch_size"], r["category"], r["prompt_index"], r["repeat"], r["method"])


def _sha(token_ids) -> str:
    return hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]


def run_protocol(
    runners: dict[str, Callable],
    units: Sequence[Unit],
    out_path: str | os.PathLike,
    *,
    repeats: int = 3,
    new_tokens: int = 64,
    order: str = "rotate",
    seed: int = 0,
    warmup: bool = True,
    env_extra: dict | None = None,
    progress: bool = True,
    local: set[str] | None = None,
    write: bool = True,
    meet: frozenset[str] | set[str] = frozenset(),
) -> Path:
    """Run (or resume) the protocol: every runner on every unit, ``repeats`` times, interleaved.

    ``runners``: method name -> callable ``(prompts, new_tokens) -> run metrics`` (optionally
    with ``warm(units, new_tokens)``), one of them ``ar``. Appends to ``out_path`` (JSONL).
    Under ``jax.distributed`` every process walks the same schedule: ``local`` names the methods
    this process takes part in (None: all; the others are skipped), the processes meet before each
    run of a method in ``meet`` (those that span processes), and only the process with ``write``
    records rows."""
    from tqdm import tqdm

    if "ar" not in runners:
        raise UserError("the protocol needs an 'ar' runner: every ratio is against it")
    if repeats < 1 or not units:
        raise UserError("need at least one repeat and one unit")
    batch = len(units[0].prompts)
    path = Path(out_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    old = read_rows(path)
    _check_resumable(path, old, units, batch, new_tokens)
    done = {_key(r) for r in old if r.get("kind") == "run"}
    todo = [
        (r, pos, u, m)
        for r in range(repeats)
        for pos, u in enumerate(units)
        for m in run_order(list(runners), pos, r, order, seed)
        if (batch, u.category, u.index, r, m) not in done
    ]
    if not todo:
        return path
    config = {
        "methods": list(runners),
        "repeats": repeats,
        "new_tokens": new_tokens,
        "order": order,
        "seed": seed,
        "batch_size": batch,
        "units": len(units),
    }
    if write:
        row = {"kind": "env", "time": time.time(), "config": config, **environment(), **(env_extra or {})}
        append_row(path, row)
    if warmup:
        _warm_up(runners, units, new_tokens, local, meet)
    bar = tqdm(total=len(todo), disable=not progress, unit="run")
    for r, pos, u, name in todo:
        if local is not None and name not in local:
            bar.update(1)
            continue
        position = run_order(list(runners), pos, r, order, seed).index(name)
        if name in meet:  # a run across processes: meet before it (process 0 ran others meanwhile)
            _meet(name)
        before = os.getloadavg()[0]
        m = runners[name](u.prompts, new_tokens)
        row = _run_row(u, batch, r, name, position, new_tokens, before, m)
        if write:
            append_row(path, row)
        bar.update(1)
        bar.set_postfix_str(f"{u.category}[{u.index}] r{r} {name} {row['decode_tok_s']:.2f} tok/s")
    bar.close()
    return path


def _check_resumable(path: Path, old: list[dict], units: Sequence[Unit], batch: int, new_tokens: int) -> None:
    """Refuses a results file whose runs at this batch size had another number of new tokens, or other
    prompts for one of ``units``."""
    idents = {
        (r["batch_size"], r["category"], r["prompt_index"]): r["unit"] for r in old if r.get("kind") == "run"
    }
    for r in old:
        c = r.get("config", {}) if r.get("kind") == "env" else {}
        if c.get("batch_size") == batch and c.get("new_tokens") != new_tokens:
            raise UserError(
                f"{path} holds runs of {c.get('new_tokens')} new tokens at batch {batch}, not "
                f"{new_tokens}: use a new file"
            )
    for u in units:
        prev = idents.get((batch, u.category, u.index))
        if prev is not None and prev != u.ident:
            raise UserError(
                f"{path} holds other prompts for {u.category}[{u.index}] at batch {batch}: use a new file"
            )


def _warm_up(runners: dict[str, Callable], units: Sequence[Unit], new_tokens: int, local, meet) -> None:
    """Compiles every method this process runs on every shape of ``units`` (a runner without ``warm``: one
    run of the first unit)."""
    for name, run in runners.items():
        if local is not None and name not in local:
            continue
        if name in meet:
            _meet(name)
        t = time.perf_counter()
        warm = getattr(run, "warm", None)
        shapes = warm(units, new_tokens) if warm else (run(units[0].prompts, new_tokens), 1)[1]
        print(f"warm-up {name}: {shapes} shape(s), {time.perf_counter() - t:.1f} s", flush=True)


def _run_row(u: Unit, batch: int, repeat: int, method: str, position: int, new_tokens: int, before: float, m):
    """The results row of one timed run: where it ran, the load average before and after, the runner's
    metrics ``m`` (its token ids kept as a hash)."""
    row = {
        "kind": "run",
        "batch_size": batch,
        "category": u.category,
        "prompt_index": u.index,
        "unit": u.ident,
        "repeat": repeat,
        "method": method,
        "position": position,
        "new_tokens": new_tokens,
        "loadavg_before": before,
        "loadavg_after": os.getloadavg()[0],
        "time": time.time(),
        **{k: v for k, v in m.items() if k != "token_ids"},
    }
    if "token_ids" in m:
        row["tokens_sha"] = _sha(m["token_ids"])
    return row


def _meet(name: str) -> None:
    """Under the hardware-fair protocol, the processes meet before each run both take part in."""
    from ssd_jax.parallel.distributed import wait_for_peers

    wait_for_peers(f"protocol/{name}")


# --- the report ------------------------------------------------------------------------------


#: the env line's fields a report lists
ENV_FIELDS = ("bandwidth_gb_s", "roofline_ar_tok_s_per_row", "target", "draft", "weights", "peer", "threads", "versions")  # fmt: skip
#: per-run fields a summary averages (the plan's prediction among them: its expected decode speedup over AR)
MEAN_FIELDS = ("acceptance_rate", "tokens_per_round", "ttft_s", "k", "cache_hit_rate", "expected_speedup")


def summarize(rows: Sequence[dict], base: str = "ar") -> list[dict]:
    """One summary per (batch size, category or ``all``, method): tok/s and intervals of the ratio to
    ``base`` (``ar``; a peer report also uses e.g. ``hf-generate``); ``same_tokens_as_ar`` is always against AR."""
    runs = [r for r in rows if r.get("kind") == "run"]
    by = defaultdict(dict)
    for r in runs:
        by[(r["batch_size"], r["category"], r["prompt_index"], r["repeat"])][r["method"]] = r
    out = []
    groups = sorted(
        {(r["batch_size"], c) for r in runs for c in (r["category"], "all")},
        key=lambda g: (g[0], g[1] == "all", g[1]),
    )
    methods = list(dict.fromkeys(r["method"] for r in runs))
    for bs, cat in groups:
        cells = {k: v for k, v in by.items() if k[0] == bs and (cat == "all" or k[1] == cat)}
        for meth in methods:
            mine = [(k, v[meth]) for k, v in cells.items() if meth in v]
            if not mine:
                continue
            s = {
                "batch_size": bs,
                "category": cat,
                "method": meth,
                "runs": len(mine),
                "prompts": len({k[1:3] for k, _ in mine}),
                "repeats": len({k[3] for k, _ in mine}),
            }
            for f in ("decode_tok_s", "e2e_tok_s"):
                s[f] = mean_ci(clustered((k[1:3], v[f]) for k, v in mine))
                pairs = [
                    (k[1:3], v[f] / cells[k][base][f])
                    for k, v in mine
                    if base in cells[k] and v[f] > 0 and cells[k][base][f] > 0
                ]
                s[f + "_vs_base"] = ratio_ci(clustered(pairs, log=True)) if pairs else (math.nan,) * 3
                s[f + "_pairs"] = len(pairs)
            for f in MEAN_FIELDS:
                vals = [v[f] for _, v in mine if v.get(f) is not None]
                s[f] = sum(vals) / len(vals) if vals else None
            same = [
                v["tokens_sha"] == cells[k]["ar"].get("tokens_sha")
                for k, v in mine
                if "ar" in cells[k] and "tokens_sha" in v
            ]
            s["same_tokens_as_ar"] = sum(same) / len(same) if same else None
            s["loadavg"] = sum((v["loadavg_before"] + v["loadavg_after"]) / 2 for _, v in mine) / len(mine)
            s["compiled_in_timed_runs"] = sum(1 for _, v in mine if (v.get("compile_s") or 0) > 0)
            out.append(s)
    return out


def _ci(t, p=2, x="") -> str:
    m, lo, hi = t
    if math.isnan(m):
        return "-"
    if math.isnan(lo):
        return f"{m:.{p}f}{x}"
    return f"{m:.{p}f}{x} [{lo:.{p}f}, {hi:.{p}f}]"


def render(rows: Sequence[dict], title: str = "Benchmark protocol", base: str = "ar") -> str:
    """The markdown report of a protocol results file's rows (ratios against method ``base``)."""
    envs = [r for r in rows if r.get("kind") == "env"]
    e = envs[-1] if envs else {}
    cfg = e.get("config", {})
    lines = [
        f"# {title}",
        "",
        f"{e.get('backend', '?')} ({e.get('device_kind', '?')}, {e.get('cpu_count', '?')} cores), jax "
        f"{e.get('jax', '?')}, commit {', '.join(dict.fromkeys(x.get('git_commit', '?') for x in envs))}; "
        f"{len(envs)} session(s). Methods {cfg.get('methods')}, {cfg.get('new_tokens')} new tokens, greedy, "
        f"order {cfg.get('order')}; load average (1 min) at session starts: "
        f"{', '.join(format(x['loadavg'][0], '.2f') for x in envs if 'loadavg' in x)}.",
        "",
    ]
    for k in ENV_FIELDS:
        if k in e:
            lines.append(f"- {k}: {e[k]}")
    lines += [
        "",
        "Interleaved per unit in one process after a warm-up. Means with 95% t-intervals over prompts "
        "(a prompt's repeats averaged first). Ratios: geometric mean of the paired per-(prompt, repeat) ratios "
        f"to {base}, 95% t-interval on the log ratios across prompts. decode = tokens after the first / time after "
        "the first token; e2e = all tokens / wall time (prefill included).",
        "",
        f"| batch | category | method | prompts x repeats | decode tok/s [95% CI] | decode vs {base} [95% CI] "
        "| plan's prediction vs AR "
        f"| e2e tok/s [95% CI] | e2e vs {base} [95% CI] | K | acceptance | tokens/round | SSD cache hits "
        "| decode / AR roofline "
        "| same tokens as AR | load avg | timed runs that compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    roof = e.get("roofline_ar_tok_s_per_row")
    for s in summarize(rows, base):
        f = lambda x, p=2: "-" if x is None else f"{x:.{p}f}"
        frac = f"{s['decode_tok_s'][0] / (roof * s['batch_size']):.0%}" if roof else "-"
        lines.append(
            f"| {s['batch_size']} | {s['category']} | {s['method']} | {s['prompts']} x {s['repeats']} "
            f"| {_ci(s['decode_tok_s'])} | {_ci(s['decode_tok_s_vs_base'], x='x')} "
            f"| {'-' if s['expected_speedup'] is None else format(s['expected_speedup'], '.2f') + 'x'} "
            f"| {_ci(s['e2e_tok_s'])} "
            f"| {_ci(s['e2e_tok_s_vs_base'], x='x')} | {f(s['k'], 1)} | {f(s['acceptance_rate'])} "
            f"| {f(s['tokens_per_round'])} | {f(s['cache_hit_rate'])} "
            f"| {frac} | {f(s['same_tokens_as_ar'])} | {s['loadavg']:.2f} | {s['compiled_in_timed_runs']} |"
        )
    lines += [
        "",
        "decode / AR roofline: decode tok/s over the AR bandwidth ceiling (measured read bandwidth / weight "
        "bytes per token, times the batch size; KV-cache reads ignored); speculation can exceed 100%. K: the mean "
        "speculation length over runs (with K auto, the measured choice); SSD cache hits: the share of rounds "
        "whose speculation came from the cache. The plan's prediction: the expected decode speedup over AR the "
        "planner chose K by (K auto only; from the run's calibration, the mean over runs).",
    ]
    return "\n".join(lines) + "\n"


def write_report(
    jsonl: str | os.PathLike, title: str = "Benchmark protocol", bases: Sequence[str] = ("ar",)
) -> Path:
    """``<jsonl>.md``: one table per base method."""
    md = Path(jsonl).with_suffix(".md")
    rows = read_rows(jsonl)
    md.write_text(
        "\n".join(render(rows, title if i == 0 else f"Against {b}", b) for i, b in enumerate(bases))
    )
    return md


def ar_roofline(cfg, bandwidth_gb_s: float) -> float:
    """AR's tok/s ceiling per row: read bandwidth / weight bytes per token (in the target's dtype)."""
    from ssd_jax.models.params import weight_bytes_per_token

    itemsize = 2 if cfg.dtype in ("bfloat16", "float16") else 4
    return bandwidth_gb_s * 1e9 / weight_bytes_per_token(cfg, itemsize)


def suite(args) -> Path:
    """``--suite protocol``: load the target (and draft), build the units, run every batch size, report."""
    import ssd_jax
    from ssd_jax.bench.common import load_draft
    from ssd_jax.bench.suites import measure_bandwidth

    target = ssd_jax.load_model(args.target, dtype=args.dtype)
    needs_draft = any(m.split(":")[0] in ("sd", "ssd") and "@" not in m for m in args.methods)
    draft = load_draft(args.draft, target) if needs_draft else None
    specs = method_specs(args.methods, draft, lambda ref: load_draft(ref, target))
    specs, local, write, fair = hardware_fair(specs)
    bw = args.bandwidth or (measure_bandwidth() if write else 0.0)  # one process measures, alone
    env_extra = {
        **fair,
        "target": target.name,
        "draft": getattr(draft, "name", draft),
        "bandwidth_gb_s": bw,
        "roofline_ar_tok_s_per_row": ar_roofline(target.cfg, bw),
        "weights": {m.name: m.weights_sha256 for m in (target, draft) if hasattr(m, "weights_sha256")},
    }
    at_drafts = {n: s.draft for n, s in specs.items() if "@" in n}
    if at_drafts:  # the drafts of sd:K@DRAFT methods, by method
        env_extra["method_drafts"] = {
            n: {"name": getattr(d, "name", d), "weights_sha256": getattr(d, "weights_sha256", None)}
            for n, d in at_drafts.items()
        }
    import jax

    path = Path(args.out) / (
        f"protocol_{jax.default_backend()}" + (f"_{args.tag}" if args.tag else "") + ".jsonl"
    )
    for bs in args.batch_sizes:
        n_rec = args.n_prompts * bs
        records = {c: category_prompts(c, n_rec) for c in args.categories}
        units = build_units(records, args.n_prompts, bs)
        runners = {name: EngineRunner(target, spec, chat=args.chat) for name, spec in specs.items()}
        run_protocol(
            runners,
            units,
            path,
            repeats=args.repeats,
            new_tokens=args.new_tokens,
            order=args.order,
            seed=args.seed,
            env_extra=env_extra,
            local=local,
            write=write,
            meet=set(fair.get("hardware_fair", {}).get("two_process_methods", [])),
        )
    if not write:
        return path
    return write_report(
        path, f"Benchmark protocol: {target.name}" + (f" / {getattr(draft, 'name', draft)}" if draft else "")
    )
