"""The settings of a training run (:class:`TrainArgs`, one field per CLI flag) and their checks."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from ssd_jax.analysis import sdsl
from ssd_jax.errors import UserError

LOSSES = ("ce", "kl", "mix", "distill")
TAILS = ("bucket", "renorm")
INIT_MODES = ("spread", "first", "none")

# training arguments that must match when resuming (the others may change freely)
RESUME_KEYS = (
    "steps",
    "batch_size",
    "seq_len",
    "lr",
    "warmup",
    "weight_decay",
    "clip",
    "loss",
    "seed",
    "init_layers",
    "data",
    "ce_weight",
    "distill_tail",
    "draft_vocab",
    "pack",
)


@dataclasses.dataclass(frozen=True)
class TrainArgs:
    """Everything a training run depends on (the CLI flags).

    Attributes:
      target: registry name or path of the target model.
      size: "auto" (SDSL N_opt for the target) or a parameter count for the draft's
        non-embedding parameters ("10M", "1.2e7").
      steps, batch_size, seq_len: optimisation steps, windows per step, tokens per window.
      lr, warmup, weight_decay, clip: AdamW peak learning rate, warmup steps (None: 10% of
        the steps, at most 100), decoupled weight decay, global-norm clip.
      loss: "ce", "kl", "mix" (the target's logits computed on the fly over ``data``) or "distill"
        (stored target top-k from ``python -m ssd_jax.train distill-data``; ``data`` is its directory).
      ce_weight: ``distill`` only: loss = (1 - W)·KL + W·CE on the stored tokens.
      distill_tail: ``distill`` only: "bucket" (the target's mass off its top-k is one extra
        outcome) or "renorm" (the top-k renormalised); :mod:`ssd_jax.training.distill`.
      draft_vocab: ``distill`` only: train the head trimmed to the N most frequent tokens, as
        ``--draft-vocab N`` will decode with it (None: the full head).
      keep_evals: also export the draft at every evaluation to ``evals/<step>/`` (a loadable
        draft each, for :mod:`ssd_jax.bench.learning_curve`); off, only ``best/`` is exported.
      pack: ``distill`` only: several sequences per window, each attending to itself only
        (:mod:`ssd_jax.training.distill`); off, one right-padded sequence per window.
      seed: data order (and random init with ``init_layers="none"``).
      eval_every: evaluate (and save) every this many steps; 0 only at the end.
      eval_windows: held-out windows per evaluation (rounded up to whole batches).
      save_every: save the training state every this many steps (None: with each eval).
      keep: training states kept in ``state/``.
      init_layers: "spread", "first", "none" or comma-separated target layer indices.
      data: "corpus" (the shipped prompt sets), a .txt/.jsonl file, or (``--loss distill``) a
        distillation-data directory.
      out: output directory (None: ``checkpoints/<target>-draft``).
      resume: continue the run in ``out``.
      dtype: dtype the target is loaded in (the draft trains in float32; only float32 is tested).
    """

    target: str
    size: str = "auto"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 5e-4
    warmup: int | None = None
    weight_decay: float = 0.01
    clip: float = 1.0
    loss: str = "kl"
    seed: int = 0
    eval_every: int = 100
    eval_windows: int = 16
    save_every: int | None = None
    keep: int = 2
    init_layers: str = "spread"
    data: str = "corpus"
    out: str | None = None
    resume: bool = False
    dtype: str = "float32"
    ce_weight: float = 0.0
    distill_tail: str = "bucket"
    draft_vocab: int | None = None
    pack: bool = False
    keep_evals: bool = False

    def resolved(self) -> TrainArgs:
        warmup = self.warmup if self.warmup is not None else min(100, self.steps // 10)
        out = self.out or str(Path("checkpoints") / f"{_slug(self.target)}-draft")
        save_every = self.save_every if self.save_every is not None else (self.eval_every or self.steps)
        return dataclasses.replace(self, warmup=warmup, out=out, save_every=save_every)

    def check(self) -> None:
        if self.steps < 1:
            raise UserError(f"--steps must be >= 1, got {self.steps}")
        if self.batch_size < 1 or self.seq_len < 2:
            raise UserError(
                f"--batch-size must be >= 1 and --seq-len >= 2, got {self.batch_size}, {self.seq_len}"
            )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr must be positive, got {self.lr}")
        if self.warmup is not None and self.warmup < 0:
            raise UserError(f"--warmup must be >= 0, got {self.warmup}")
        if self.loss not in LOSSES:
            raise UserError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.eval_every < 0 or self.eval_windows < 1 or self.keep < 1:
            raise UserError("--eval-every must be >= 0, --eval-windows >= 1 and --keep >= 1")
        if self.save_every is not None and self.save_every < 1:
            raise UserError(f"--save-every must be >= 1, got {self.save_every}")
        if self.clip <= 0 or self.weight_decay < 0:
            raise UserError("--clip must be > 0 and --weight-decay >= 0")
        parse_size(self.size)
        if not 0.0 <= self.ce_weight <= 1.0:
            raise UserError(f"--ce-weight must be in [0, 1], got {self.ce_weight}")
        if self.distill_tail not in TAILS:
            raise UserError(f"--distill-tail must be one of {', '.join(TAILS)}, got {self.distill_tail!r}")
        if self.loss != "distill" and (self.draft_vocab is not None or self.ce_weight or self.pack):
            raise UserError("--draft-vocab, --ce-weight and --pack apply to --loss distill only")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise UserError(f"--draft-vocab must be >= 1, got {self.draft_vocab}")
        if self.loss == "distill" and not (Path(self.data) / "manifest.json").is_file():
            raise UserError(
                f"--loss distill needs --data DIR made by 'python -m ssd_jax.train distill-data', got {self.data!r}"
            )


def _slug(name: str) -> str:
    base = Path(str(name).rstrip("/")).name or "target"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in base)


def parse_size(s: str | float) -> float | None:
    """``"auto"`` -> None; "10M", "1.2e7", 5000 -> a positive parameter count."""
    if isinstance(s, str) and s.strip().lower() == "auto":
        return None
    try:
        v = sdsl.parse_size(str(s))
    except UserError:
        raise UserError(
            f"--size must be 'auto' or a positive parameter count such as 10M, got {s!r}"
        ) from None
    if v < 1:
        raise UserError(f"--size must be 'auto' or a positive parameter count, got {s!r}")
    return v


def eval_batch_count(args: TrainArgs) -> int:
    """Held-out batches per evaluation: ``eval_windows`` rounded up to whole batches."""
    return -(-args.eval_windows // args.batch_size)


#: values a run's metadata implies for keys it predates (resuming such a run compares against these)
RESUME_DEFAULTS = {"ce_weight": 0.0, "distill_tail": "bucket", "draft_vocab": None, "pack": False}
