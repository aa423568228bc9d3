"""``python -m ssd_jax.sdsl``: the SDSL draft size and lookahead for a target, from the command line.

``python -m ssd_jax.sdsl validate``: train drafts of several sizes around the law's N_opt and
measure them under the benchmark protocol (:mod:`ssd_jax.bench.sdsl_validation`).

The law itself is :mod:`ssd_jax.analysis.sdsl` (pure math over parameter counts); this module
adds what needs real models: :func:`model_params` counts a registered or local model's
parameters from its config (``--target``), reading no weights where a config is on disk.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ssd_jax.analysis.sdsl import (
    DEFAULT_TOKENS,
    FIT_RANGE,
    PAPER_M0,
    PAPER_MU,
    best_integer_gamma,
    fit_linear,
    flatness,
    optimal_draft,
    parse_size,
)
from ssd_jax.cli.args import Parser
from ssd_jax.errors import UserError, cli_main


# --- real models --------------------------------------------------------------------------
def _config_of(name_or_path: str):
    """ModelConfig of a registry name / GGUF file / HF or converted directory, reading no weights
    where a config is already on disk (falls back to ``load_numpy``, which may fetch and convert)."""
    from ssd_jax.loading import registry, store
    from ssd_jax.models.config import ModelConfig

    key = str(name_or_path)
    if key in registry.REGISTRY:
        entry = registry.REGISTRY[key]
        for dt in store.SUPPORTED_DTYPES:
            p = registry.converted_path(entry.sha256, dt)
            if store.is_converted_dir(p):
                return ModelConfig.from_dict(store.read_manifest(p)["config"])
        g = registry.gguf_path(key)
        if g.is_file():
            from ssd_jax.loading.gguf_loader import config_from_gguf, open_gguf

            return config_from_gguf(open_gguf(g))
        from ssd_jax.loading import load_numpy

        return load_numpy(key).cfg
    from ssd_jax.loading import draft as draft_ckpt

    p = draft_ckpt.resolve_draft(key) or Path(key).expanduser()  # a shipped draft by name, or a path
    if p.is_dir():
        if draft_ckpt.is_draft_dir(p):  # a trained draft (python -m ssd_jax.train)
            return draft_ckpt.draft_config(draft_ckpt.read_meta(p))
        if store.is_converted_dir(p):
            return ModelConfig.from_dict(store.read_manifest(p)["config"])
        from ssd_jax.loading import hf_loader

        if hf_loader.is_hf_dir(p):
            return hf_loader.hf_config(p)
        raise UserError(
            f"{p} is neither a Hugging Face model directory (config.json + *.safetensors) "
            f"nor a converted model (manifest.json)"
        )
    if p.is_file():
        from ssd_jax.loading.gguf_loader import config_from_gguf, open_gguf

        return config_from_gguf(open_gguf(p))
    raise UserError(
        f"unknown model {key!r}: not a registered name ({', '.join(registry.REGISTRY)}) nor an existing path"
    )


def model_params(name_or_path: str) -> dict[str, Any]:
    """Parameter counts of a real model from its config.

    ``total`` (the count the law uses: all parameters, tied embeddings once) and
    ``non_embedding`` (without the embedding table and output head).
    """
    from ssd_jax.models.params import count_params

    cfg = _config_of(name_or_path)
    return dict(
        name=str(name_or_path),
        total=count_params(cfg, include_embeddings=True),
        non_embedding=count_params(cfg, include_embeddings=False),
        tied_embeddings=bool(cfg.tie_embeddings),
    )


LINEAR_NOTE = (
    "note: the linear rule N_opt = mu*M + M0 (mu = 2.71e-3, M0 = 8.71e7) is the paper's fit over "
    "13-110B targets only; outside that range use the full optimisation (N_opt above)."
)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m ssd_jax.sdsl",
        description="SDSL: the throughput-optimal draft size and lookahead for a target model.",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-params", help="target size in parameters, e.g. 70e9 or 70B")
    g.add_argument(
        "--target", help="registry name, .gguf file, HF or converted directory: counts its parameters"
    )
    p.add_argument(
        "--tokens", default=None, help=f"training tokens D for both models (default {DEFAULT_TOKENS:g})"
    )
    p.add_argument(
        "--integer-gamma", action="store_true", help="use the best integer lookahead, not the continuous one"
    )
    p.add_argument(
        "--drafts", default="", help="comma-separated draft sizes to add to the flatness table (e.g. 1e9,8e9)"
    )
    p.add_argument("--fit", action="store_true", help="fit N_opt = mu*M + M0 over 13-110B targets")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.target_params is None and args.target is None and not args.fit:
        raise UserError("give --target-params N, --target NAME_OR_PATH or --fit")
    D = DEFAULT_TOKENS if args.tokens is None else parse_size(args.tokens)
    drafts = [parse_size(s) for s in args.drafts.split(",") if s.strip()]
    kw = dict(integer_gamma=args.integer_gamma)
    out: dict[str, Any] = {"tokens": D, "integer_gamma": args.integer_gamma, "param_count": None}
    M = None
    if args.target is not None:
        pc = model_params(args.target)
        pc["used"] = "total"
        out["param_count"] = pc
        M = float(pc["total"])
    elif args.target_params is not None:
        M = parse_size(args.target_params)
    if M is not None:
        best = optimal_draft(M, D, **kw)
        lin = PAPER_MU * M + PAPER_M0
        in_range = FIT_RANGE[0] <= M <= FIT_RANGE[1]
        out.update(
            target=args.target,
            target_params=M,
            n_opt=best.N,
            gamma_star=best.gamma,
            gamma_integer=float(best_integer_gamma(best.alpha, M / best.N)),
            alpha=best.alpha,
            draft_ppl=best.draft_ppl,
            target_ppl=best.target_ppl,
            expected_tokens=best.expected_tokens,
            speedup=best.speedup,
            speculation_pays=bool(best.gamma > 0),
            linear_rule=dict(
                mu=PAPER_MU,
                M0=PAPER_M0,
                prediction=lin,
                fitted_range=list(FIT_RANGE),
                in_range=in_range,
                note=LINEAR_NOTE,
            ),
            flatness=flatness(M, D, drafts=drafts, **kw),
        )
    if args.fit:
        f = fit_linear(None, D, **kw)
        out["fit"] = dict(
            mu=f.mu,
            M0=f.M0,
            r2=f.r2,
            paper_mu=PAPER_MU,
            paper_M0=PAPER_M0,
            mu_rel_err=f.mu / PAPER_MU - 1.0,
            M0_rel_err=f.M0 / PAPER_M0 - 1.0,
            range=list(FIT_RANGE),
            points=len(f.Ms),
        )
    if args.json:
        print(json.dumps(out))
        return 0
    _print_text(out)
    return 0


def _print_text(o: dict[str, Any]) -> None:
    g = "integer" if o["integer_gamma"] else "continuous"
    if "n_opt" in o:
        if o["param_count"]:
            pc = o["param_count"]
            print(
                f"target {pc['name']}: {pc['total']:,} parameters in total "
                f"({pc['non_embedding']:,} without embeddings; tied embeddings: {pc['tied_embeddings']}); "
                f"the law uses the total"
            )
        M = o["target_params"]
        print(f"target M = {M:.4g} parameters, training tokens D = {o['tokens']:.3g}, gamma {g}")
        print(f"N_opt      = {o['n_opt']:.4g} parameters  (M/N_opt = {M / o['n_opt']:.0f})")
        print(f"gamma*     = {o['gamma_star']:.3f}  (best integer: {o['gamma_integer']:.0f})")
        print(
            f"alpha      = {o['alpha']:.4f}  (draft ppl {o['draft_ppl']:.3f}, target ppl {o['target_ppl']:.3f})"
        )
        print(f"E[tokens]  = {o['expected_tokens']:.3f} per round")
        print(f"speedup    = {o['speedup']:.3f}x over autoregressive (batch-1, weight-read model)")
        if not o["speculation_pays"]:
            print("speculation does not pay for this target in this model (gamma* = 0)")
        print("flatness (gamma re-optimised at each N):")
        print(
            f"  {'N/N_opt':>8} {'N':>10} {'gamma*':>7} {'alpha':>7} {'speedup':>8} {'T/T_opt':>8} {'loss':>7}"
        )
        for r in o["flatness"]:
            print(
                f"  {r['factor']:8.3g} {r['N']:10.3g} {r['gamma']:7.2f} {r['alpha']:7.4f} "
                f"{r['speedup']:8.3f} {r['rel_throughput']:8.4f} {r['loss_pct']:6.1f}%"
            )
        lr = o["linear_rule"]
        where = "inside" if lr["in_range"] else "OUTSIDE"
        print(f"linear rule mu*M + M0 = {lr['prediction']:.4g} (target {where} the fitted 13-110B range)")
        print(lr["note"])
    if "fit" in o:
        f = o["fit"]
        print(
            f"fit over {f['range'][0]:.3g}-{f['range'][1]:.3g} ({f['points']} targets, D = {o['tokens']:.3g}, "
            f"gamma {g}): mu = {f['mu']:.4g} (paper {f['paper_mu']:.3g}, {100 * f['mu_rel_err']:+.1f}%), "
            f"M0 = {f['M0']:.4g} (paper {f['paper_M0']:.3g}, {100 * f['M0_rel_err']:+.1f}%), R^2 = {f['r2']:.5f}"
        )


def build_validate_parser() -> argparse.ArgumentParser:
    from ssd_jax.bench import protocol
    from ssd_jax.bench.sdsl_validation import Validation
    from ssd_jax.training.args import LOSSES

    d = Validation(target="", data="", runs="", out="")
    p = Parser(
        prog="python -m ssd_jax.sdsl validate",
        description="SDSL validation: train drafts of >= 4 sizes around N_opt with several seeds (resumable), "
        "measure AR and every draft's SD interleaved under the benchmark protocol, and report "
        "SD/AR with 95%% intervals against size beside the law's prediction.",
    )
    p.add_argument("--target", required=True, help="registry name or path of the target")
    p.add_argument(
        "--data",
        required=True,
        help="distill-data directory (python -m ssd_jax.train distill-data), or the --data of another --loss",
    )
    p.add_argument(
        "--out", required=True, help="results directory (sdsl.md, summary.json, sdsl.png, protocol.jsonl)"
    )
    p.add_argument("--runs", default=None, help="training runs directory (default: runs/sdsl-<target>)")
    p.add_argument(
        "--sizes",
        nargs="+",
        default=None,
        metavar="SIZE",
        help="draft sizes: layer counts (3L) or "
        "non-embedding parameter counts (10M); default: the law's depth x 1/3, 2/3, 1, 4/3, 2",
    )
    p.add_argument(
        "--seeds", type=int, nargs="+", default=list(d.seeds), help="training seeds (data order) per size"
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows)
    p.add_argument("--loss", choices=LOSSES, default=d.loss)
    p.add_argument("--ce-weight", type=float, default=d.ce_weight, help="distill: loss = (1-W) KL + W CE")
    p.add_argument(
        "--no-pack", action="store_true", help="distill: one sequence per window (default: packed)"
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="distill: train every draft's head trimmed to the N most frequent target tokens (the "
        "shipped draft's recipe: 8192); the drafts decode with it",
    )
    p.add_argument("--k", default=str(d.k), help="SD lookahead in the measurement: an integer or auto")
    p.add_argument("--categories", nargs="+", default=list(d.categories), choices=list(protocol.CATEGORIES))
    p.add_argument("--n-prompts", type=int, default=d.n_prompts, help="prompts per category")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--no-chat", action="store_true", help="raw prompts (default: the chat template)")
    p.add_argument("--no-train", action="store_true", help="measure the drafts already trained (drafts.json)")
    p.add_argument(
        "--report-only", action="store_true", help="only re-render the report from the files on disk"
    )
    return p


def _depths(sizes, cfg) -> tuple[int, ...] | None:
    from ssd_jax.training.draft_model import size_draft

    if not sizes:
        return None
    out = []
    for s in sizes:
        if s.upper().endswith("L") and s[:-1].isdigit():
            out.append(int(s[:-1]))
        else:
            out.append(size_draft(cfg, s)[0].num_layers)
    return tuple(out)


def run_validate(argv) -> int:
    from ssd_jax.bench import sdsl_validation as sv

    a = build_validate_parser().parse_args(argv)
    k = a.k if a.k == "auto" else int(a.k) if a.k.isdigit() else None
    if k is None or k == 0:
        raise UserError(f"--k must be a positive integer or auto, got {a.k!r}")
    cfg = _config_of(a.target)
    v = sv.Validation(
        target=a.target,
        data=a.data,
        out=a.out,
        runs=a.runs or f"runs/sdsl-{Path(str(a.target).rstrip('/')).name}",
        depths=_depths(a.sizes, cfg),
        seeds=tuple(a.seeds),
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        lr=a.lr,
        eval_every=a.eval_every,
        eval_windows=a.eval_windows,
        loss=a.loss,
        ce_weight=a.ce_weight,
        pack=not a.no_pack,
        draft_vocab=a.draft_vocab,
        k=k,
        categories=tuple(a.categories),
        n_prompts=a.n_prompts,
        repeats=a.repeats,
        new_tokens=a.new_tokens,
        chat=not a.no_chat,
    )
    if a.report_only:
        md = sv.report(v)
    else:
        md = sv.validate(v, cfg, train=not a.no_train, log=lambda m: print(m, file=sys.stderr))
    print(f"wrote {md}")
    print(json.loads((Path(a.out) / "summary.json").read_text())["verdict"])
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["validate"]:
        return cli_main(run_validate, argv[1:])
    return cli_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
