"""A draft's learning curve: acceptance against training tokens (``python -m ssd_jax.train learning-curve``).

Two sources per training run, both read from its directory:

* **The training evaluations** (``draft.json``'s ``evals``, one per ``--eval-every`` steps, kept
  by every run): teacher-forced on the held-out split of the training corpus, the acceptance
  alpha at T = 1 (``sum_x min(p, q)``) and the greedy match P(argmax q = argmax p), which is the
  per-token acceptance of greedy SD on that text. Cheap, always there, but not SD on the
  benchmark prompts.
* **SD acceptance on held-out prompts** for the drafts a ``--keep-evals`` run exported at each
  evaluation (``evals/<step>/``): :func:`ssd_jax.bench.acceptance.measure` on the benchmark
  categories at T = 0 and K = 4 with the chat template (by default). Measured steps are cached
  in the output JSON by the snapshot's parameter hash, so a rerun measures only new snapshots.

Training tokens: window tokens (step x batch x seq_len) and, where the log has them (``--loss
distill``), the tokens that carried a loss, summed from ``train_log.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ssd_jax.errors import UserError


def _loss_tokens(run: Path) -> dict[int, float]:
    """step -> cumulative tokens with a loss (distill runs log ``tokens`` per step)."""
    log = run / "train_log.jsonl"
    out, tot = {}, 0.0
    if not log.is_file():
        return out
    for line in log.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            break
        if "tokens" not in r:
            return {}
        tot += float(r["tokens"])
        out[int(r["step"])] = tot
    return out


def snapshots(run: Path) -> dict[int, Path]:
    """step -> the draft exported at that evaluation (``--keep-evals``)."""
    from ssd_jax.loading import draft as dfmt
    from ssd_jax.training.loop import EVALS_DIR

    d = run / EVALS_DIR
    if not d.is_dir():
        return {}
    return {int(p.name): p for p in d.iterdir() if p.name.isdigit() and dfmt.is_draft_dir(p)}


def curve(
    run: str | Path,
    target=None,
    records: dict[str, list[dict]] | None = None,
    *,
    k: int = 4,
    temperature: float = 0.0,
    new_tokens: int = 64,
    chat: bool = True,
    cached: dict[str, Any] | None = None,
    save=None,
    log=print,
) -> dict[str, Any]:
    """The learning curve of one run: a point per training evaluation, with the SD acceptance on
    ``records`` (held-out prompts) where a snapshot exists and ``target`` is given. ``cached``: an
    earlier result of this run (its measurements are reused); ``save(partial)`` is called after
    each new measurement."""
    from ssd_jax.loading import draft as dfmt

    run = Path(run)
    try:  # the run's own metadata (its evaluations), read as plain JSON
        meta = json.loads((run / dfmt.DRAFT_META).read_text())
        a = meta["train"]["args"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(
            f"{run} is not a training run (no readable {dfmt.DRAFT_META} with its training args)"
        ) from None
    window = a["batch_size"] * a["seq_len"]
    loss_tok = _loss_tokens(run)
    snaps = snapshots(run)
    old = {
        (p["step"], p.get("params_sha256")): p.get("sd")
        for p in (cached or {}).get("points", [])
        if p.get("sd")
    }
    points = []
    head = {
        "run": str(run),
        "name": run.name,
        "loss": a.get("loss"),
        "batch_size": a["batch_size"],
        "seq_len": a["seq_len"],
        "steps": meta.get("step"),
        "points": points,
    }
    for e in sorted(meta.get("evals", []), key=lambda e: e["step"]):
        s = e["step"]
        p = {
            "step": s,
            "window_tokens": s * window,
            "loss_tokens": loss_tok.get(s, 0.0 if s == 0 else None),
            "alpha_t1": e.get("alpha"),
            "greedy_match": e.get("greedy_match"),
            "ppl": e.get("ppl"),
            "sd": None,
        }
        if s in snaps:
            sha = dfmt.read_meta(snaps[s]).get("params_sha256")
            p["params_sha256"] = sha
            if (s, sha) in old:
                p["sd"] = old[(s, sha)]
            elif target is not None and records:
                log(f"{run.name} step {s}: SD acceptance at T = {temperature:g}, K = {k}")
                p["sd"] = _sd_acceptance(target, snaps[s], records, k, temperature, new_tokens, chat)
                if save is not None:
                    save({**head, "points": points + [p]})
        points.append(p)
    return head


def _sd_acceptance(target, snapshot: Path, records, k: int, temperature: float, new_tokens: int, chat: bool):
    """SD's acceptance with the draft ``snapshot`` on ``records`` at one (temperature, K): over all of
    them, with its tokens per round, P(at least d accepted), rounds, and by category."""
    from ssd_jax.bench import acceptance
    from ssd_jax.bench.common import load_draft

    res = acceptance.measure(
        target,
        load_draft(str(snapshot), target),
        records,
        temperatures=(temperature,),
        ks=(k,),
        new_tokens=new_tokens,
        chat=chat,
    )
    allc = next(c for c in res["cells"] if c["category"] == "all")
    return {
        "k": k,
        "temperature": temperature,
        "acceptance": allc["acceptance"],
        "tokens_per_round": allc["tokens_per_round"],
        "at_least": allc["at_least"],
        "rounds": allc["rounds"],
        "by_category": {c["category"]: c["acceptance"] for c in res["cells"] if c["category"] != "all"},
    }


def render(curves: Sequence[dict[str, Any]]) -> str:
    lines = [
        "# Learning curve: acceptance against training tokens",
        "",
        "alpha (T=1) and greedy match: the training evaluations, teacher-forced on the held-out split of the "
        "training corpus (greedy match = per-token acceptance of greedy SD on that text). SD acceptance: "
        "SD runs on held-out benchmark prompts (accepted / drafted) with the draft exported at that step "
        "(`--keep-evals`); '-' where no snapshot was kept.",
        "",
    ]
    for c in curves:
        sd = next((p["sd"] for p in c["points"] if p["sd"]), None)
        head = f"SD acceptance (T = {sd['temperature']:g}, K = {sd['k']})" if sd else "SD acceptance"
        lines += [
            f"## {c['name']} ({c['loss']}, {c['batch_size']} x {c['seq_len']} tokens per step)",
            "",
            f"| step | window tokens | tokens with a loss | alpha (T=1) | greedy match | ppl | {head} "
            "| tokens/round |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in c["points"]:
            f = lambda x, q=3: "-" if x is None else f"{x:.{q}f}"  # noqa: E731
            lt = "-" if p["loss_tokens"] is None else f"{p['loss_tokens']:,.0f}"
            lines.append(
                f"| {p['step']} | {p['window_tokens']:,} | {lt} | {f(p['alpha_t1'])} | {f(p['greedy_match'])} "
                f"| {f(p['ppl'], 1)} | {f(p['sd'] and p['sd']['acceptance'])} "
                f"| {f(p['sd'] and p['sd']['tokens_per_round'], 2)} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(curves: Sequence[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c in curves:
        pts = c["points"]
        x = [p["window_tokens"] for p in pts]
        ax.plot(x, [p["greedy_match"] for p in pts], "o-", ms=3, label=f"{c['name']}: greedy match (eval)")
        ax.plot(x, [p["alpha_t1"] for p in pts], "s:", ms=3, label=f"{c['name']}: alpha T=1 (eval)")
        sd = [(p["window_tokens"], p["sd"]["acceptance"]) for p in pts if p["sd"]]
        if sd:
            ax.plot(*zip(*sd), "D-", label=f"{c['name']}: SD acceptance, held-out prompts")
    ax.axhline(0.5, color="grey", ls="--", lw=0.8, label="goal 0.5")
    ax.set_xlabel("training tokens (windows)")
    ax.set_ylabel("acceptance")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(
    runs: Sequence[str | Path],
    out: str | Path,
    *,
    target=None,
    records=None,
    k: int = 4,
    temperature: float = 0.0,
    new_tokens: int = 64,
    chat: bool = True,
    log=print,
) -> Path:
    """``<out>/learning_curve.{json,md,png}`` for ``runs``; reuses the SD measurements the JSON holds."""
    from ssd_jax.loading.draft import write_json_atomic

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "learning_curve.json"
    cached = {c["run"]: c for c in json.loads(js.read_text())["curves"]} if js.is_file() else {}
    curves: list[dict[str, Any]] = []
    for r in runs:
        key = str(Path(r))

        def save(partial, key=key):  # keep every measurement: a killed rerun measures only what is missing
            rest = [c for p, c in cached.items() if p != key and p not in {x["run"] for x in curves}]
            write_json_atomic(js, {"curves": curves + [partial] + rest})

        curves.append(
            curve(
                r,
                target,
                records,
                k=k,
                temperature=temperature,
                new_tokens=new_tokens,
                chat=chat,
                cached=cached.get(key),
                save=save,
                log=log,
            )
        )
    write_json_atomic(js, {"curves": curves})
    plot(curves, out / "learning_curve.png")
    md = out / "learning_curve.md"
    md.write_text(render(curves))
    return md
