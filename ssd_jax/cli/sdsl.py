"""``python -m ssd_jax.sdsl``: the SDSL draft size and lookahead for a target, from the command line.

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
        raise UserError(f"{p} is neither a Hugging Face model directory (config.json + *.safetensors) "
                        f"nor a converted model (manifest.json)")
    if p.is_file():
        from ssd_jax.loading.gguf_loader import config_from_gguf, open_gguf

        return config_from_gguf(open_gguf(p))
    raise UserError(f"unknown model {key!r}: not a registered name ({', '.join(registry.REGISTRY)}) "
                    f"nor an existing path")


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
    p = Parser(prog="python -m ssd_jax.sdsl",
               description="SDSL: the throughput-optimal draft size and lookahead for a target model.")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-params", help="target size in parameters, e.g. 70e9 or 70B")
    g.add_argument("--target", help="registry name, .gguf file, HF or converted directory: counts its parameters")
    p.add_argument("--tokens", default=None, help=f"training tokens D for both models (default {DEFAULT_TOKENS:g})")
    p.add_argument("--integer-gamma", action="store_true", help="use the best integer lookahead, not the continuous one")
    p.add_argument("--drafts", default="", help="comma-separated draft sizes to add to the flatness table (e.g. 1e9,8e9)")
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
            linear_rule=dict(mu=PAPER_MU, M0=PAPER_M0, prediction=lin, fitted_range=list(FIT_RANGE),
                             in_range=in_range, note=LINEAR_NOTE),
            flatness=flatness(M, D, drafts=drafts, **kw),
        )
    if args.fit:
        f = fit_linear(None, D, **kw)
        out["fit"] = dict(mu=f.mu, M0=f.M0, r2=f.r2, paper_mu=PAPER_MU, paper_M0=PAPER_M0,
                          mu_rel_err=f.mu / PAPER_MU - 1.0, M0_rel_err=f.M0 / PAPER_M0 - 1.0,
                          range=list(FIT_RANGE), points=len(f.Ms))
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
            print(f"target {pc['name']}: {pc['total']:,} parameters in total "
                  f"({pc['non_embedding']:,} without embeddings; tied embeddings: {pc['tied_embeddings']}); "
                  f"the law uses the total")
        M = o["target_params"]
        print(f"target M = {M:.4g} parameters, training tokens D = {o['tokens']:.3g}, gamma {g}")
        print(f"N_opt      = {o['n_opt']:.4g} parameters  (M/N_opt = {M / o['n_opt']:.0f})")
        print(f"gamma*     = {o['gamma_star']:.3f}  (best integer: {o['gamma_integer']:.0f})")
        print(f"alpha      = {o['alpha']:.4f}  (draft ppl {o['draft_ppl']:.3f}, target ppl {o['target_ppl']:.3f})")
        print(f"E[tokens]  = {o['expected_tokens']:.3f} per round")
        print(f"speedup    = {o['speedup']:.3f}x over autoregressive (batch-1, weight-read model)")
        if not o["speculation_pays"]:
            print("speculation does not pay for this target in this model (gamma* = 0)")
        print("flatness (gamma re-optimised at each N):")
        print(f"  {'N/N_opt':>8} {'N':>10} {'gamma*':>7} {'alpha':>7} {'speedup':>8} {'T/T_opt':>8} {'loss':>7}")
        for r in o["flatness"]:
            print(f"  {r['factor']:8.3g} {r['N']:10.3g} {r['gamma']:7.2f} {r['alpha']:7.4f} "
                  f"{r['speedup']:8.3f} {r['rel_throughput']:8.4f} {r['loss_pct']:6.1f}%")
        lr = o["linear_rule"]
        where = "inside" if lr["in_range"] else "OUTSIDE"
        print(f"linear rule mu*M + M0 = {lr['prediction']:.4g} (target {where} the fitted 13-110B range)")
        print(lr["note"])
    if "fit" in o:
        f = o["fit"]
        print(f"fit over {f['range'][0]:.3g}-{f['range'][1]:.3g} ({f['points']} targets, D = {o['tokens']:.3g}, "
              f"gamma {g}): mu = {f['mu']:.4g} (paper {f['paper_mu']:.3g}, {100 * f['mu_rel_err']:+.1f}%), "
              f"M0 = {f['M0']:.4g} (paper {f['paper_M0']:.3g}, {100 * f['M0_rel_err']:+.1f}%), R^2 = {f['r2']:.5f}")


def main(argv=None) -> int:
    return cli_main(run, argv)


if __name__ == "__main__":
    sys.exit(main())
