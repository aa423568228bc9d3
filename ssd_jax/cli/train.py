"""``python -m ssd_jax.train``: train an SDSL-sized draft for a target (:mod:`ssd_jax.training`).

``python -m ssd_jax.train distill-data --target NAME --out DIR``: generate the self-distillation
data (the target's continuations of training prompts with its top-k log-probabilities,
:mod:`ssd_jax.training.distill_data`); then ``python -m ssd_jax.train --loss distill --data DIR``.

``python -m ssd_jax.train learning-curve RUN... --out DIR``: acceptance against training tokens
from runs' evaluations and, for ``--keep-evals`` runs, SD on held-out prompts
(:mod:`ssd_jax.bench.learning_curve`).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

from ssd_jax.cli.args import Parser
from ssd_jax.errors import UserError, cli_main
from ssd_jax.loading import draft as dfmt
from ssd_jax.training.args import LOSSES, TAILS, TrainArgs
from ssd_jax.training.distill_data import DistillRecipe, build_distill_data
from ssd_jax.training.loop import train


def build_parser() -> argparse.ArgumentParser:
    d = TrainArgs(target="")
    p = Parser(prog="python -m ssd_jax.train", description="Train an SDSL-sized draft model for a target.")
    p.add_argument("--target", required=True, help="registry name, .gguf file, HF or converted directory")
    p.add_argument(
        "--size", default=d.size, help="'auto' (SDSL N_opt) or the draft's non-embedding parameters, e.g. 10M"
    )
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="windows per step")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per window")
    p.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    p.add_argument(
        "--warmup", type=int, default=None, help="warmup steps (default: 10%% of --steps, at most 100)"
    )
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--clip", type=float, default=d.clip, help="global gradient-norm clip")
    p.add_argument(
        "--loss",
        choices=LOSSES,
        default=d.loss,
        help="ce, kl (distillation from the target computed on "
        "the fly), mix, or distill (stored target top-k: --data DIR from 'distill-data')",
    )
    p.add_argument("--ce-weight", type=float, default=d.ce_weight, help="distill: loss = (1-W) KL + W CE")
    p.add_argument(
        "--distill-tail",
        choices=TAILS,
        default=d.distill_tail,
        help="distill: the target's mass off its "
        "top-k as one extra outcome (bucket) or the top-k renormalised (renorm)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        metavar="N",
        help="distill: train the head trimmed to the "
        "N most frequent tokens, as --draft-vocab N decodes with it",
    )
    p.add_argument(
        "--pack",
        action="store_true",
        help="distill: pack several sequences per window (each attends "
        "to itself only) instead of right-padding one",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="data order seed")
    p.add_argument(
        "--eval-every", type=int, default=d.eval_every, help="steps between evaluations (0: at the end)"
    )
    p.add_argument("--eval-windows", type=int, default=d.eval_windows, help="held-out windows per evaluation")
    p.add_argument(
        "--save-every", type=int, default=None, help="steps between saves (default: each evaluation)"
    )
    p.add_argument("--keep", type=int, default=d.keep, help="training states kept")
    p.add_argument(
        "--keep-evals",
        action="store_true",
        help="also export the draft at every evaluation to <out>/evals/<step>/ (for 'learning-curve')",
    )
    p.add_argument(
        "--init-layers", default=d.init_layers, help="spread, first, none or target layer indices (0,15,29)"
    )
    p.add_argument(
        "--data",
        default=d.data,
        help="'corpus' (shipped prompt sets), a .txt/.jsonl file, or a "
        "distill-data directory (--loss distill)",
    )
    p.add_argument("--out", default=None, help="output directory (default checkpoints/<target>-draft)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def run_cli(argv=None) -> int:
    a = build_parser().parse_args(argv)
    args = TrainArgs(
        target=a.target,
        size=a.size,
        steps=a.steps,
        batch_size=a.batch_size,
        seq_len=a.seq_len,
        lr=a.lr,
        warmup=a.warmup,
        weight_decay=a.weight_decay,
        clip=a.clip,
        loss=a.loss,
        seed=a.seed,
        eval_every=a.eval_every,
        eval_windows=a.eval_windows,
        save_every=a.save_every,
        keep=a.keep,
        init_layers=a.init_layers,
        data=a.data,
        out=a.out,
        resume=a.resume,
        ce_weight=a.ce_weight,
        distill_tail=a.distill_tail,
        draft_vocab=a.draft_vocab,
        pack=a.pack,
        keep_evals=a.keep_evals,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda msg, *_a, **_k: print(f"warning: {msg}", file=sys.stderr)
        s = train(args)
    summary = {k: s[k] for k in ("out", "step", "eval", "best", "timing")}
    if a.json:
        print(json.dumps(summary))
        return 0
    t, e, b = s["timing"], s["eval"], s["best"]
    print(f"draft saved in {s['out']} (step {s['step']}); load it with --draft {s['out']}")
    if e:
        print(
            f"final eval: ppl {e['ppl']:.3f} (target {e['target_ppl']:.3f}), alpha {e['alpha']:.4f}, "
            f"greedy match {e['greedy_match']:.4f}"
        )
    if b:
        print(f"best by alpha: step {b['step']}, alpha {b['alpha']:.4f} -> {Path(s['out']) / dfmt.BEST_DIR}")
    if t["step_s"]:
        trained = f", {t['loss_tokens_per_s']:,.0f} with a loss" if t.get("loss_tokens_per_s") else ""
        print(
            f"speed: {1 / t['step_s']:.3f} steps/s, {t['tokens_per_s']:,.0f} tokens/s{trained} "
            f"(first step incl. compile {t['first_step_s']:.1f}s, {t['steps']} timed steps)"
        )
    return 0


def build_data_parser() -> argparse.ArgumentParser:
    d = DistillRecipe(target="")
    p = Parser(
        prog="python -m ssd_jax.train distill-data",
        description="Generate self-distillation data: the target's answers to training prompts and its top-k "
        "log-probabilities at every generated position (resumable shards).",
    )
    p.add_argument("--target", required=True, help="registry name, .gguf file, HF or converted directory")
    p.add_argument("--out", required=True, help="data directory (rerun with the same recipe to resume)")
    p.add_argument(
        "--n-prompts", type=int, default=d.n_prompts, help="training prompts (never benchmark prompts)"
    )
    p.add_argument(
        "--temperatures",
        type=float,
        nargs="+",
        default=list(d.temperatures),
        help="one answer per prompt at each (0 = greedy)",
    )
    p.add_argument("--top-k", type=int, default=d.top_k, help="target tokens stored per generated position")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument(
        "--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="prompts are cut to this"
    )
    p.add_argument("--sources", nargs="+", default=list(d.sources), help="prompt sources")
    p.add_argument("--seed", type=int, default=d.seed, help="prompt order and sampling seed")
    p.add_argument("--no-chat", action="store_true", help="raw prompts, without the chat template")
    p.add_argument(
        "--batch-size", type=int, default=d.batch_size, help="generation batch (prompts sorted by length)"
    )
    p.add_argument("--shard-prompts", type=int, default=d.shard_prompts, help="prompts per shard file")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def run_data_cli(argv) -> int:
    a = build_data_parser().parse_args(argv)
    recipe = DistillRecipe(
        target=a.target,
        n_prompts=a.n_prompts,
        temperatures=tuple(a.temperatures),
        top_k=a.top_k,
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=a.max_prompt_tokens,
        sources=tuple(a.sources),
        seed=a.seed,
        chat=not a.no_chat,
        batch_size=a.batch_size,
        shard_prompts=a.shard_prompts,
    )
    s = build_distill_data(recipe, a.out)
    if a.json:
        print(json.dumps(s))
        return 0
    print(
        f"distillation data in {s['out']}: {s['shards']} shards ({s['shards_kept']} kept, {s['shards_written']} "
        f"written); train with --loss distill --data {s['out']}"
    )
    if s["tokens_per_s"]:
        print(
            f"speed: {s['gen_tokens']:,} generated tokens with their top-k, {s['tokens_per_s']:,.1f} tok/s "
            f"({s['compiles']} compiled shapes, {s['compile_s']:.1f}s compiling)"
        )
    return 0


def build_curve_parser() -> argparse.ArgumentParser:
    from ssd_jax.bench.protocol import CATEGORIES

    p = Parser(
        prog="python -m ssd_jax.train learning-curve",
        description="Acceptance against training tokens: each run's evaluations and, where the run kept its "
        "drafts (--keep-evals), SD acceptance on held-out benchmark prompts.",
    )
    p.add_argument("runs", nargs="+", help="training run directories")
    p.add_argument("--out", required=True, help="directory for learning_curve.{json,md,png}")
    p.add_argument("--k", type=int, default=4, help="SD lookahead")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--categories", nargs="+", default=list(CATEGORIES), choices=list(CATEGORIES))
    p.add_argument("--n-prompts", type=int, default=4, help="held-out prompts per category")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--no-chat", action="store_true", help="raw prompts (default: the chat template)")
    p.add_argument("--no-sd", action="store_true", help="only the training evaluations (loads no model)")
    return p


def run_curve_cli(argv) -> int:
    from ssd_jax.bench import learning_curve
    from ssd_jax.bench.protocol import category_prompts

    a = build_curve_parser().parse_args(argv)
    target = records = None
    if not a.no_sd and any(learning_curve.snapshots(Path(r)) for r in a.runs):
        from ssd_jax.loading import load_model

        target = load_model(dfmt.read_meta(Path(a.runs[0]))["target"]["name"])
        records = {c: category_prompts(c, a.n_prompts) for c in a.categories}
    md = learning_curve.write(
        a.runs,
        a.out,
        target=target,
        records=records,
        k=a.k,
        temperature=a.temperature,
        new_tokens=a.new_tokens,
        chat=not a.no_chat,
        log=lambda m: print(m, file=sys.stderr),
    )
    print(f"wrote {md}")
    return 0


def build_eagle_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m ssd_jax.train eagle",
        description="Train an EAGLE-style draft head (one layer over the target's features) on the target's "
        "own answers (a distill-data directory); resumable, checkpointed with orbax.",
    )
    p.add_argument("--target", required=True, help="registry name, .gguf file, HF or converted directory")
    p.add_argument(
        "--data", default=None,
        help="a distill-data directory made for this target (omit: corpus text only, --corpus-rows = --batch-size)",
    )  # fmt: skip
    p.add_argument("--out", required=True, help="run directory (head.safetensors, head.json, states)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=4, help="windows per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per window")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument(
        "--depth", type=int, default=3, help="draft steps unrolled in training (training-time test)"
    )
    p.add_argument(
        "--layers", type=int, nargs="+", default=None, help="target layers read (default: low, mid, high)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--draft-vocab", type=int, default=8192,
        help="the head's LM head keeps the N most frequent tokens (0: the whole vocabulary)",
    )  # fmt: skip
    p.add_argument(
        "--prompt-weight", type=float, default=1.0,
        help="loss weight of prompt positions (answers weigh 1; 0: answers only)",
    )  # fmt: skip
    p.add_argument(
        "--corpus-rows", type=int, default=0,
        help="rows of each batch taken from the training corpus's text instead of the target's answers",
    )  # fmt: skip
    p.add_argument(
        "--cached-windows", type=int, default=0,
        help="run the target once over N windows, store its features in the run, train on them for --steps",
    )  # fmt: skip
    p.add_argument(
        "--head-mlp", type=int, default=None, help="the head layer's MLP width (default: the target's)"
    )
    p.add_argument(
        "--save-dtype", choices=("float32", "bfloat16"), default=None,
        help="dtype of the weights in head.safetensors (training states stay float32)",
    )  # fmt: skip
    p.add_argument(
        "--init", default=None, metavar="HEAD",
        help="start from a trained head (shipped name or directory) of the same shape instead of random weights",
    )  # fmt: skip
    p.add_argument("--save-every", type=int, default=50, help="steps between saved states")
    p.add_argument("--eval-prompts", type=int, default=8, help="held-out prompts per category (code, chat)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    return p


def run_eagle_cli(argv) -> int:
    from ssd_jax.training.eagle_train import train_head

    a = build_eagle_parser().parse_args(argv)
    if min(a.steps, a.batch_size, a.seq_len, a.depth, a.save_every) < 1 or a.lr <= 0:
        raise UserError("--steps, --batch-size, --seq-len, --depth and --save-every must be >= 1, --lr > 0")
    if (
        a.draft_vocab < 0
        or a.prompt_weight < 0
        or a.cached_windows < 0
        or (a.head_mlp is not None and a.head_mlp < 1)
    ):
        raise UserError("--draft-vocab, --prompt-weight and --cached-windows must be >= 0, --head-mlp >= 1")
    s = train_head(
        a.target, a.data, a.out, steps=a.steps, batch=a.batch_size, seq_len=a.seq_len, lr=a.lr, depth=a.depth,
        layers=a.layers, seed=a.seed, save_every=a.save_every, resume=a.resume, eval_prompts=a.eval_prompts,
        vocab=a.draft_vocab or None, prompt_weight=a.prompt_weight, corpus_rows=a.corpus_rows,
        cached_windows=a.cached_windows, head_mlp=a.head_mlp, save_dtype=a.save_dtype, init=a.init,
    )  # fmt: skip
    print(json.dumps(s) if a.json else f"head in {s['out']}: {json.dumps(s)}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["eagle"]:
        return cli_main(run_eagle_cli, argv[1:])
    if argv[:1] == ["distill-data"]:
        return cli_main(run_data_cli, argv[1:])
    if argv[:1] == ["learning-curve"]:
        return cli_main(run_curve_cli, argv[1:])
    return cli_main(run_cli, argv)


if __name__ == "__main__":
    sys.exit(main())
